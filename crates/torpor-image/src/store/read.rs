//! Reading stored files and segments back: into a buffer or into a file, verified.

use std::fs::{self, File};
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use rayon::prelude::*;

use crate::manifest::check_relative_path;
use crate::store::chunk::{self, Damage, HEADER_LEN};
use crate::store::error::{io_error, StoreError};
use crate::store::{ChunkRef, ChunkStore, Recipe, CORRUPT_DIR};

impl ChunkStore {
    /// Fills `buf` (exactly `recipe.size` bytes) with the recipe's contents, chunks in parallel,
    /// each checked against its id, then the whole against the recipe's hash.
    pub fn read_into(&self, recipe: &Recipe, buf: &mut [u8]) -> Result<(), StoreError> {
        recipe.validate()?;
        if buf.len() as u64 != recipe.size {
            return Err(StoreError::BufferSize {
                file: recipe.name.clone(),
                expected: recipe.size,
                actual: buf.len() as u64,
            });
        }
        let mut slices: Vec<(&ChunkRef, &mut [u8])> = Vec::with_capacity(recipe.chunks.len());
        let mut rest: &mut [u8] = &mut *buf;
        for c in &recipe.chunks {
            // validate() checked that the lengths add up to buf's length.
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(c.len as usize);
            slices.push((c, head));
            rest = tail;
        }
        slices
            .into_par_iter()
            .try_for_each(|(c, out)| self.read_chunk_into(c, &recipe.name, out))?;
        let actual = blake3::Hasher::new().update_rayon(buf).finalize();
        if actual.to_hex().as_str() != recipe.blake3 {
            return Err(StoreError::WholeHashMismatch {
                file: recipe.name.clone(),
                expected: recipe.blake3.clone(),
                actual: actual.to_hex().to_string(),
            });
        }
        Ok(())
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
    fn read_chunk_into(&self, c: &ChunkRef, file: &str, out: &mut [u8]) -> Result<(), StoreError> {
        let path = self.chunk_path(&c.id);
        let mut handle = match File::options()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
        {
            Ok(handle) => handle,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(StoreError::MissingChunk {
                    chunk: c.id,
                    file: file.to_owned(),
                    snapshots: self.holders(&c.id),
                })
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
