//! Chunk ids and the chunk file format.
//!
//! A chunk is named by the BLAKE3 hash of its *raw* contents, so the same bytes get the same id
//! whichever snapshot, file or compression they came from. On disk a chunk is
//! `chunks/<first two hex digits>/<64 hex digits>` (256 fan-out directories keep each directory
//! small), holding a 16-byte header and the body:
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `TPCK` |
//! | 4 | format version, 1 |
//! | 5 | encoding: 0 raw, 1 zstd |
//! | 6..8 | zero |
//! | 8..16 | raw length, little-endian u64 |
//!
//! A header (rather than a `.zst` suffix) keeps one name per id, so a lookup is one `open`.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::store::compress::{self, Compression};

/// Magic at the start of every chunk file.
const MAGIC: &[u8; 4] = b"TPCK";
/// Version of the chunk file layout.
const CHUNK_FORMAT: u8 = 1;
/// Size of the header before the body.
pub(crate) const HEADER_LEN: usize = 16;

/// How a chunk's body is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Encoding {
    Raw = 0,
    Zstd = 1,
}

/// The BLAKE3 hash of a chunk's raw contents.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId(pub [u8; 32]);

impl ChunkId {
    /// The id of `data`.
    pub fn of(data: &[u8]) -> ChunkId {
        ChunkId(*blake3::hash(data).as_bytes())
    }

    /// Lowercase hex, 64 digits.
    pub fn to_hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }

    /// Parses 64 lowercase hex digits.
    pub fn from_hex(text: &str) -> Option<ChunkId> {
        if text.len() != 64 || !text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return None;
        }
        blake3::Hash::from_hex(text)
            .ok()
            .map(|h| ChunkId(*h.as_bytes()))
    }

    /// Where the chunk lives under the store's `chunks/` directory.
    pub(crate) fn path_in(&self, chunks_dir: &Path) -> PathBuf {
        let hex = self.to_hex();
        chunks_dir.join(&hex[..2]).join(hex)
    }
}

impl fmt::Display for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkId({})", self.to_hex())
    }
}

impl Serialize for ChunkId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for ChunkId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        ChunkId::from_hex(&text)
            .ok_or_else(|| serde::de::Error::custom(format!("{text:?} is not a BLAKE3 chunk id")))
    }
}

/// The bytes of a chunk file for `raw`: compressed when `compression` asks for it and it pays
/// (see [`compress::worth_it`]), raw otherwise.
pub(crate) fn encode(raw: &[u8], compression: Compression) -> Vec<u8> {
    let compressed = compress::compress(raw, compression);
    let (encoding, body) = match &compressed {
        Some(body) => (Encoding::Zstd, body.as_slice()),
        None => (Encoding::Raw, raw),
    };
    let mut file = Vec::with_capacity(HEADER_LEN + body.len());
    file.extend_from_slice(MAGIC);
    file.push(CHUNK_FORMAT);
    file.push(encoding as u8);
    file.extend_from_slice(&[0, 0]);
    file.extend_from_slice(&(raw.len() as u64).to_le_bytes());
    file.extend_from_slice(body);
    file
}

/// Why a chunk file could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Damage {
    /// Not a chunk header (truncated, overwritten).
    Header,
    /// The raw length differs from what the recipe expects.
    Length { expected: u64, found: u64 },
    /// zstd refused the body or it inflated to another length.
    Decompress(String),
    /// The contents do not hash to the chunk's id.
    Hash { actual: String },
}

impl fmt::Display for Damage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Damage::Header => f.write_str("bad chunk header"),
            Damage::Length { expected, found } => {
                write!(f, "holds {found} bytes, {expected} expected")
            }
            Damage::Decompress(why) => write!(f, "cannot be decompressed: {why}"),
            Damage::Hash { actual } => write!(f, "contents hash to {actual}"),
        }
    }
}

/// Decodes a chunk file into `out` (exactly the expected raw length) and checks its hash.
pub(crate) fn decode_into(file: &[u8], id: &ChunkId, out: &mut [u8]) -> Result<(), Damage> {
    if file.len() < HEADER_LEN
        || &file[..4] != MAGIC
        || file[4] != CHUNK_FORMAT
        || file[6..8] != [0, 0]
    {
        return Err(Damage::Header);
    }
    let raw_len = u64::from_le_bytes(file[8..16].try_into().expect("8 bytes"));
    if raw_len != out.len() as u64 {
        return Err(Damage::Length {
            expected: out.len() as u64,
            found: raw_len,
        });
    }
    let body = &file[HEADER_LEN..];
    match file[5] {
        0 if body.len() == out.len() => out.copy_from_slice(body),
        0 => {
            return Err(Damage::Length {
                expected: out.len() as u64,
                found: body.len() as u64,
            })
        }
        1 => compress::decompress_into(body, out).map_err(Damage::Decompress)?,
        _ => return Err(Damage::Header),
    }
    let actual = blake3::hash(out);
    if actual.as_bytes() != &id.0 {
        return Err(Damage::Hash {
            actual: actual.to_hex().to_string(),
        });
    }
    Ok(())
}

/// Checks that `file` is a chunk file of `len` raw bytes that hash to `id`, as
/// [`decode_into`] would, and returns those bytes: a raw body hashed where it lies (no buffer
/// to allocate, fault in and copy into: a pull's 4 MiB segment chunks are raw), a zstd body
/// decoded into `scratch` (resized to `len`; reuse it across chunks).
pub(crate) fn check_raw<'a>(
    file: &'a [u8],
    id: &ChunkId,
    len: u64,
    scratch: &'a mut Vec<u8>,
) -> Result<&'a [u8], Damage> {
    if file.len() >= HEADER_LEN && file[5] == 0 {
        if &file[..4] != MAGIC || file[4] != CHUNK_FORMAT || file[6..8] != [0, 0] {
            return Err(Damage::Header);
        }
        let raw_len = u64::from_le_bytes(file[8..16].try_into().expect("8 bytes"));
        let body = &file[HEADER_LEN..];
        if raw_len != len {
            return Err(Damage::Length {
                expected: len,
                found: raw_len,
            });
        }
        if body.len() as u64 != len {
            return Err(Damage::Length {
                expected: len,
                found: body.len() as u64,
            });
        }
        let actual = blake3::hash(body);
        if actual.as_bytes() != &id.0 {
            return Err(Damage::Hash {
                actual: actual.to_hex().to_string(),
            });
        }
        return Ok(body);
    }
    scratch.resize(len as usize, 0);
    decode_into(file, id, scratch)?;
    Ok(scratch)
}

/// The raw length a chunk file's header claims, if it has a valid header.
pub(crate) fn raw_len(header: &[u8]) -> Option<u64> {
    (header.len() >= HEADER_LEN && &header[..4] == MAGIC && header[4] == CHUNK_FORMAT)
        .then(|| u64::from_le_bytes(header[8..16].try_into().expect("8 bytes")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_roundtrip_and_refusals() {
        let id = ChunkId::of(b"torpor");
        assert_eq!(ChunkId::from_hex(&id.to_hex()), Some(id));
        assert_eq!(id.to_hex(), blake3::hash(b"torpor").to_hex().as_str());
        assert_eq!(ChunkId::from_hex(&id.to_hex().to_uppercase()), None);
        assert_eq!(ChunkId::from_hex("abc"), None);
        let path = id.path_in(Path::new("/s/chunks"));
        assert_eq!(
            path,
            Path::new("/s/chunks")
                .join(&id.to_hex()[..2])
                .join(id.to_hex())
        );
    }

    #[test]
    fn encode_decode_raw_and_zstd() {
        let text: Vec<u8> = b"the same line again\n".repeat(5000);
        for compression in [Compression::None, Compression::default()] {
            let file = encode(&text, compression);
            let zstd = file[5] == Encoding::Zstd as u8;
            assert_eq!(zstd, compression != Compression::None);
            assert_eq!(raw_len(&file), Some(text.len() as u64));
            let mut out = vec![0; text.len()];
            decode_into(&file, &ChunkId::of(&text), &mut out).expect("decode");
            assert_eq!(out, text);
        }
    }

    #[test]
    fn damage_is_detected() {
        let data = vec![42u8; 10_000];
        let id = ChunkId::of(&data);
        let mut out = vec![0; data.len()];
        let good = encode(&data, Compression::None);

        let mut flipped = good.clone();
        flipped[HEADER_LEN + 5000] ^= 1;
        let err = decode_into(&flipped, &id, &mut out).expect_err("flipped");
        assert!(matches!(err, Damage::Hash { .. }), "{err}");

        let err = decode_into(&good[..HEADER_LEN + 10], &id, &mut out).expect_err("short");
        assert!(matches!(err, Damage::Length { .. }), "{err}");
        let err = decode_into(&good[..8], &id, &mut out).expect_err("header");
        assert_eq!(err, Damage::Header);
        let err = decode_into(&good, &id, &mut out[..100]).expect_err("len");
        assert_eq!(
            err,
            Damage::Length {
                expected: 100,
                found: 10_000
            }
        );

        let mut zstd = encode(&data, Compression::default());
        let last = zstd.len() - 3;
        zstd[last] ^= 0xff;
        assert!(decode_into(&zstd, &id, &mut out).is_err());
    }

    fn check(file: &[u8], id: &ChunkId, len: u64) -> Result<(), Damage> {
        check_raw(file, id, len, &mut Vec::new()).map(|_| ())
    }

    #[test]
    fn check_agrees_with_decoding_on_good_and_damaged_files() {
        let data: Vec<u8> = (0..50_000u32).map(|i| (i * 7 % 253) as u8).collect();
        let id = ChunkId::of(&data);
        let len = data.len() as u64;
        for compression in [Compression::None, Compression::default()] {
            let good = encode(&data, compression);
            let mut variants = vec![
                good.clone(),
                good[..8].to_vec(),
                good[..good.len() - 1].to_vec(),
            ];
            let mut flipped = good.clone();
            let at = flipped.len() - 2;
            flipped[at] ^= 1;
            variants.push(flipped);
            let mut bad_magic = good.clone();
            bad_magic[0] ^= 1;
            variants.push(bad_magic);
            let mut longer = good.clone();
            longer.push(0);
            variants.push(longer);
            for file in &variants {
                let mut out = vec![0; data.len()];
                let decoded = decode_into(file, &id, &mut out);
                assert_eq!(check(file, &id, len), decoded, "{compression:?}");
            }
            check(&good, &id, len).expect("good");
            assert!(matches!(
                check(&good, &id, len - 1),
                Err(Damage::Length { .. })
            ));
            assert!(matches!(
                check(&good, &ChunkId::of(b"other"), len),
                Err(Damage::Hash { .. })
            ));
        }
    }
}
