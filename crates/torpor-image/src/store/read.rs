//! Reading stored files and segments back: into a buffer or into a file, verified.

use std::fs::{self, File};
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::{mpsc, Mutex, OnceLock, PoisonError};

use rayon::prelude::*;

use crate::manifest::check_relative_path;
use crate::store::chunk::{self, Damage, HEADER_LEN};
use crate::store::error::{io_error, StoreError};
use crate::store::{ChunkRef, ChunkStore, Recipe, CORRUPT_DIR};

/// Threads of the pool that reads chunk files (each chunk checked against its id as it comes):
/// more than cores, since a read mostly waits for the disk and a deep queue is what reaches its
/// bandwidth; a pool apart from rayon's global one, where whole files are hashed, so that
/// neither waits behind the other. 32: the fastest of 8, 16 and 32 on the CPU benchmark of a
/// restore from disk (docs/split.md, "Fill order and bounds").
pub const READ_THREADS: usize = 32;

/// A recipe of at least this many bytes (and more than one chunk) is hashed whole while its
/// chunks are read: each chunk joins the hash once it and every chunk before it are in, so the
/// whole check ends with the last read instead of starting after it.
const HASH_WHILE_READING: u64 = 16 << 20;

/// The pool of [`READ_THREADS`], made on first use; `None` (then rayon's global pool reads)
/// where no thread can be started.
fn read_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(READ_THREADS)
            .thread_name(|i| format!("torpor-read-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// A chunk of a recipe and where its bytes go: its place in the recipe, its reference, its
/// slice of the buffer.
type Piece<'a> = (usize, &'a ChunkRef, &'a mut [u8]);

/// `buf` cut into the recipe's chunks (`validate` checked that their lengths add up to it).
fn pieces<'a>(recipe: &'a Recipe, buf: &'a mut [u8]) -> Vec<Piece<'a>> {
    let mut pieces = Vec::with_capacity(recipe.chunks.len());
    let mut rest: &mut [u8] = buf;
    for (i, c) in recipe.chunks.iter().enumerate() {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(c.len as usize);
        pieces.push((i, c, head));
        rest = tail;
    }
    pieces
}

/// The hash of the pieces `done` brings (each once, in any order) taken in their order; ends
/// when `done` does.
fn hash_in_order(done: mpsc::Receiver<(usize, &[u8])>, n: usize) -> blake3::Hash {
    let mut hasher = blake3::Hasher::new();
    let mut waiting: Vec<Option<&[u8]>> = vec![None; n];
    let mut next = 0;
    for (i, bytes) in done {
        if let Some(slot) = waiting.get_mut(i) {
            *slot = Some(bytes);
        }
        while let Some(bytes) = waiting.get_mut(next).and_then(Option::take) {
            hasher.update_rayon(bytes);
            next += 1;
        }
    }
    // Fewer than all only after a failed read, whose error is returned instead; were it
    // otherwise, this hash of a part would not match the recipe's.
    hasher.finalize()
}

impl ChunkStore {
    /// Fills `buf` (exactly `recipe.size` bytes) with the recipe's contents, chunks in parallel
    /// on the read pool ([`READ_THREADS`]), each checked against its id, then the whole against
    /// the recipe's hash (a large recipe's hashed while its chunks are read).
    pub fn read_into(&self, recipe: &Recipe, buf: &mut [u8]) -> Result<(), StoreError> {
        recipe.validate()?;
        if buf.len() as u64 != recipe.size {
            return Err(StoreError::BufferSize {
                file: recipe.name.clone(),
                expected: recipe.size,
                actual: buf.len() as u64,
            });
        }
        let actual = if recipe.size >= HASH_WHILE_READING && recipe.chunks.len() > 1 {
            self.read_hashing(recipe, buf)?
        } else {
            self.read_pieces(&recipe.name, pieces(recipe, buf), None)?;
            blake3::Hasher::new().update_rayon(buf).finalize()
        };
        if actual.to_hex().as_str() != recipe.blake3 {
            return Err(StoreError::WholeHashMismatch {
                file: recipe.name.clone(),
                expected: recipe.blake3.clone(),
                actual: actual.to_hex().to_string(),
            });
        }
        Ok(())
    }

    /// Reads the recipe into `buf` while a thread of its own hashes the whole in order; returns
    /// that hash.
    fn read_hashing(&self, recipe: &Recipe, buf: &mut [u8]) -> Result<blake3::Hash, StoreError> {
        let pieces = pieces(recipe, buf);
        let n = pieces.len();
        let (done, rx) = mpsc::channel();
        let rx = Mutex::new(Some(rx));
        let take = || rx.lock().unwrap_or_else(PoisonError::into_inner).take();
        std::thread::scope(|scope| {
            let hasher = std::thread::Builder::new()
                .name("torpor-hash".into())
                .spawn_scoped(scope, || take().map(|rx| hash_in_order(rx, n)));
            let read = self.read_pieces(&recipe.name, pieces, Some(done));
            let hash = match hasher {
                Ok(h) => h
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
                // No thread for it: the same hash here, after the reads.
                Err(_) => None,
            };
            read?;
            Ok(hash.unwrap_or_else(|| {
                take().map_or_else(|| blake3::hash(&[]), |rx| hash_in_order(rx, n))
            }))
        })
    }

    /// Reads each piece into its slice on the read pool, each chunk checked; `done` is told of
    /// each as it is in.
    fn read_pieces<'a>(
        &self,
        file: &str,
        pieces: Vec<Piece<'a>>,
        done: Option<mpsc::Sender<(usize, &'a [u8])>>,
    ) -> Result<(), StoreError> {
        let read = || {
            pieces
                .into_par_iter()
                .try_for_each_with(done, |done, (i, c, out)| {
                    self.read_chunk_into(c, file, out)?;
                    if let Some(done) = done {
                        let out: &[u8] = out;
                        // The hasher ends only after the reads: it is there to receive.
                        let _ = done.send((i, out));
                    }
                    Ok(())
                })
        };
        match read_pool() {
            Some(pool) => pool.install(read),
            None => read(),
        }
    }

    /// Writes the recipe's contents to a new file `dest` (which must not exist) and checks it;
    /// on error `dest` is removed.
    pub fn materialise(&self, recipe: &Recipe, dest: &Path) -> Result<(), StoreError> {
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(dest)
            .map_err(|e| match e.kind() {
                io::ErrorKind::AlreadyExists => StoreError::DestExists {
                    path: dest.to_path_buf(),
                },
                _ => io_error("create", dest, e),
            })?;
        let result = self.fill(recipe, &file, dest);
        if result.is_err() {
            let _ = fs::remove_file(dest);
        }
        result
    }

    /// Materialises every recipe into `dir` under its name (a relative path, e.g. the files of
    /// a CRIU image directory), creating subdirectories as needed.
    pub fn materialise_all(&self, recipes: &[Recipe], dir: &Path) -> Result<(), StoreError> {
        for recipe in recipes {
            if let Err(reason) = check_relative_path(&recipe.name) {
                return Err(StoreError::InvalidRecipe {
                    file: recipe.name.clone(),
                    reason: format!("not a safe relative path: {reason}"),
                });
            }
        }
        recipes.par_iter().try_for_each(|recipe| {
            let dest = dir.join(&recipe.name);
            if let Some(parent) = dest.parent() {
                fs::create_dir_all(parent).map_err(|e| io_error("create", parent, e))?;
            }
            self.materialise(recipe, &dest)
        })
    }

    fn fill(&self, recipe: &Recipe, file: &File, dest: &Path) -> Result<(), StoreError> {
        recipe.validate()?;
        if recipe.size == 0 {
            return self.read_into(recipe, &mut []);
        }
        file.set_len(recipe.size)
            .map_err(|e| io_error("write", dest, e))?;
        // SAFETY: `dest` was created by this call (O_EXCL) with mode 0600 and is written only
        // through this map, which lives until the end of this block.
        let mut map =
            unsafe { memmap2::MmapMut::map_mut(file) }.map_err(|e| io_error("map", dest, e))?;
        // No msync: a materialised file is a working copy (typically in tmpfs for CRIU); the
        // store holds the durable data, and readers see the pages through the page cache.
        self.read_into(recipe, &mut map)
    }

    /// Reads one chunk into `out`, checking it; a damaged chunk is moved aside.
    pub(crate) fn read_chunk_into(
        &self,
        c: &ChunkRef,
        file: &str,
        out: &mut [u8],
    ) -> Result<(), StoreError> {
        let path = self.chunk_path(&c.id);
        let open = || {
            File::options()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&path)
        };
        let missing = || StoreError::MissingChunk {
            chunk: c.id,
            file: file.to_owned(),
            snapshots: self.holders(&c.id),
        };
        let mut handle = match open() {
            Ok(handle) => handle,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // Held, not yet written (shelf.rs): from memory.
                if let Some(held) = self.shelf.get(&c.id) {
                    return chunk::decode_into(held.bytes(), &c.id, out).map_err(|damage| {
                        StoreError::CorruptChunk {
                            chunk: c.id,
                            file: file.to_owned(),
                            damage: format!("{damage} (held in memory, not yet written)"),
                            snapshots: self.holders(&c.id),
                        }
                    });
                }
                // Its file may have been written between the two looks.
                match open() {
                    Ok(handle) => handle,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(missing()),
                    Err(e) => return Err(io_error("read", &path, e)),
                }
            }
            Err(e) => return Err(io_error("read", &path, e)),
        };
        let read_error = |e| io_error("read", &path, e);
        let mut header = [0u8; HEADER_LEN];
        let damage = match read_full(&mut handle, &mut header).map_err(read_error)? {
            n if n < HEADER_LEN => Err(Damage::Header),
            _ if header[5] == 0 => {
                // Raw: straight into `out`, no intermediate copy.
                let mut whole = header.to_vec();
                let got = read_full(&mut handle, out).map_err(read_error)?;
                let extra = read_full(&mut handle, &mut [0u8; 1]).map_err(read_error)?;
                if got < out.len() || extra > 0 || chunk::raw_len(&header) != Some(c.len) {
                    // Let decode name the exact damage.
                    whole.extend_from_slice(&out[..got]);
                    whole.extend(std::iter::repeat_n(0, extra));
                    chunk::decode_into(&whole, &c.id, out)
                } else if blake3::hash(out).as_bytes() != &c.id.0 {
                    Err(Damage::Hash {
                        actual: blake3::hash(out).to_hex().to_string(),
                    })
                } else {
                    Ok(())
                }
            }
            _ => {
                let mut bytes = header.to_vec();
                handle.read_to_end(&mut bytes).map_err(read_error)?;
                chunk::decode_into(&bytes, &c.id, out)
            }
        };
        damage.map_err(|damage| self.corrupt(c, file, damage))
    }

    pub(crate) fn corrupt(&self, c: &ChunkRef, file: &str, damage: Damage) -> StoreError {
        let path = self.chunk_path(&c.id);
        let aside = self.root.join(CORRUPT_DIR).join(c.id.to_hex());
        // Moved aside so that re-taking a snapshot holding it writes it anew (a writer skips
        // chunks already present).
        let moved = match fs::rename(&path, &aside) {
            Ok(()) => format!("moved to {}", aside.display()),
            Err(e) => format!(
                "moving it aside failed: {e}; delete {} by hand",
                path.display()
            ),
        };
        StoreError::CorruptChunk {
            chunk: c.id,
            file: file.to_owned(),
            damage: format!("{damage}; {moved}"),
            snapshots: self.holders(&c.id),
        }
    }
}

/// Reads until `buf` is full or the file ends; returns the bytes read.
fn read_full(file: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}
