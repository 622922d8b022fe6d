//! Chunks as whole chunk files, for copying them between stores (the object tier).
//!
//! A chunk travels as its chunk file (header + raw or zstd body, see `chunk.rs`): no
//! re-compression on either side, and the receiver checks it exactly as a read would before it
//! stores it under its id.

use std::fs;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::time::Duration;

use crate::store::chunk::{self, HEADER_LEN};
use crate::store::error::{io_error, StoreError};
use crate::store::write::{already_stored, check_foreign, place_chunk_file};
use crate::store::{ChunkRef, ChunkStore, StoreWriter};

impl ChunkStore {
    /// The chunk file of `c` as stored, checked against its id first (a damaged one is moved
    /// aside and refused, as a read would; `file` names what it belongs to in that error).
    pub fn chunk_file(&self, c: &ChunkRef, file: &str) -> Result<Vec<u8>, StoreError> {
        let path = self.chunk_path(&c.id);
        let bytes = match fs::File::options()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .and_then(|f| {
                use io::Read;
                let mut bytes = Vec::new();
                // A header and a body of at most the raw length plus zstd's worst-case growth.
                let cap = HEADER_LEN as u64 + c.len + c.len / 64 + 1024;
                f.take(cap).read_to_end(&mut bytes)?;
                Ok(bytes)
            }) {
            Ok(bytes) => bytes,
            // Held, not yet written (shelf.rs): checked when it was held.
            Err(e) if e.kind() == io::ErrorKind::NotFound && self.shelf.contains(&c.id) => {
                match self.shelf.get(&c.id) {
                    Some(held) => held.bytes().to_vec(),
                    // Written meanwhile.
                    None => return self.chunk_file(c, file),
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(StoreError::MissingChunk {
                    chunk: c.id,
                    file: file.to_owned(),
                    snapshots: self.holders(&c.id),
                })
            }
            Err(e) => return Err(io_error("read", &path, e)),
        };
        let mut raw = vec![0u8; c.len as usize];
        chunk::decode_into(&bytes, &c.id, &mut raw).map_err(|d| self.corrupt(c, file, d))?;
        Ok(bytes)
    }
}

impl StoreWriter<'_> {
    /// Stores `bytes`, a chunk file that came from elsewhere (`origin` names it, e.g. the
    /// object's key), after checking that it decodes to exactly `c`; a damaged one is refused and
    /// nothing is stored. Returns whether the chunk was new. Safe to call from several threads.
    /// (A pull's writers use [`hold_chunk_file`](Self::hold_chunk_file), which may also keep it
    /// in memory.)
    pub fn put_chunk_file(
        &self,
        c: &ChunkRef,
        bytes: &[u8],
        origin: &str,
    ) -> Result<bool, StoreError> {
        check_foreign(c, bytes, origin, &mut Vec::new())?;
        let store = self.store();
        let path = store.chunk_path(&c.id);
        let new = !already_stored(&path, c.len);
        if new {
            place_chunk_file(store, &c.id, &path, bytes, self.writes_back())?;
        }
        Ok(new)
    }
}

/// What [`StoreWriter::hold_chunk_file`] did.
#[derive(Debug)]
pub struct PutChunkFile<'a> {
    /// The chunk was not in the store before.
    pub new: bool,
    /// Time spent checking it against its id.
    pub checked: Duration,
    /// Its raw bytes.
    pub raw: &'a [u8],
}

impl ChunkStore {
    /// Reads chunk `c`'s raw bytes into `out` (its length), checked against its id (a damaged
    /// one is moved aside and refused, as any read); `file` names what it belongs to in errors.
    pub fn read_chunk(&self, c: &ChunkRef, file: &str, out: &mut [u8]) -> Result<(), StoreError> {
        self.read_chunk_into(c, file, out)
    }
}

#[cfg(test)]
mod tests {
    use crate::store::{ChunkStore, Chunking, StoreError};

    #[test]
    fn chunk_files_copy_between_stores_and_damage_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = ChunkStore::open(&dir.path().join("a")).expect("a");
        let b = ChunkStore::open(&dir.path().join("b")).expect("b");
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let mut w = a.writer().expect("writer");
        let recipe = w
            .put_bytes_with("seg", &data, Chunking::Fixed { bytes: 64 << 10 })
            .expect("put");
        w.commit("snap", std::slice::from_ref(&recipe))
            .expect("commit");

        let wb = b.writer().expect("writer b");
        for c in &recipe.chunks {
            let file = a.chunk_file(c, "seg").expect("chunk file");
            assert!(wb.put_chunk_file(c, &file, "test").expect("put"));
            assert!(!wb.put_chunk_file(c, &file, "test").expect("again"));
        }
        wb.commit("snap", std::slice::from_ref(&recipe))
            .expect("commit b");
        let mut out = vec![0u8; data.len()];
        b.read_into(&recipe, &mut out).expect("read");
        assert_eq!(out, data);

        let c = &recipe.chunks[0];
        let mut bad = a.chunk_file(c, "seg").expect("file");
        let last = bad.len() - 1;
        bad[last] ^= 1;
        let c2 = ChunkStore::open(&dir.path().join("c")).expect("c");
        let w = c2.writer().expect("writer c");
        let err = w
            .put_chunk_file(c, &bad, "s3://bucket/chunks/x")
            .expect_err("damaged");
        assert!(
            matches!(err, StoreError::ForeignChunkCorrupt { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("s3://bucket/chunks/x"), "{err}");
        assert!(!c2.contains(&c.id));
    }
}
