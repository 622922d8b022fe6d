//! Recipes: how to put a stored file or segment back together.

use serde::{Deserialize, Serialize};

use crate::store::error::StoreError;
use crate::store::ChunkId;

/// One chunk of a recipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    pub id: ChunkId,
    /// Raw (uncompressed) length.
    pub len: u64,
}

/// A stored file or segment: its chunks in order, its size and its whole BLAKE3 hash.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recipe {
    /// What it is inside its snapshot: a file path relative to the snapshot directory
    /// (`pages-1.img`) or a segment name. Error messages name it.
    pub name: String,
    pub size: u64,
    /// BLAKE3 of the whole contents, lowercase hex.
    pub blake3: String,
    pub chunks: Vec<ChunkRef>,
}

impl Recipe {
    /// Checks that the chunks add up to the size and the hash is well-formed.
    pub fn validate(&self) -> Result<(), StoreError> {
        let invalid = |reason: String| StoreError::InvalidRecipe {
            file: self.name.clone(),
            reason,
        };
        let total = self
            .chunks
            .iter()
            .try_fold(0u64, |sum, c| sum.checked_add(c.len))
            .ok_or_else(|| invalid("chunk lengths overflow".into()))?;
        if total != self.size {
            return Err(invalid(format!(
                "chunks add up to {total} bytes, size is {}",
                self.size
            )));
        }
        if self.chunks.iter().any(|c| c.len == 0) {
            return Err(invalid("an empty chunk".into()));
        }
        if ChunkId::from_hex(&self.blake3).is_none() {
            return Err(invalid(format!("{:?} is not a BLAKE3 hash", self.blake3)));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recipe() -> Recipe {
        Recipe {
            name: "pages-1.img".into(),
            size: 10,
            blake3: blake3::hash(b"0123456789").to_hex().to_string(),
            chunks: vec![
                ChunkRef {
                    id: ChunkId::of(b"0123"),
                    len: 4,
                },
                ChunkRef {
                    id: ChunkId::of(b"456789"),
                    len: 6,
                },
            ],
        }
    }

    #[test]
    fn valid_recipe_roundtrips_through_json() {
        let r = recipe();
        r.validate().expect("valid");
        let json = serde_json::to_string(&r).expect("encode");
        assert_eq!(serde_json::from_str::<Recipe>(&json).expect("decode"), r);
    }

    #[test]
    fn inconsistent_recipes_are_refused() {
        let mut r = recipe();
        r.size = 11;
        let err = r.validate().expect_err("size");
        assert!(err.to_string().contains("add up to 10 bytes"), "{err}");
        let mut r = recipe();
        r.blake3 = "xyz".into();
        assert!(r.validate().is_err());
        let mut r = recipe();
        r.chunks[0].len = 0;
        r.chunks[1].len = 10;
        assert!(r.validate().is_err());
        let bad_id = r#"{"name":"a","size":1,"blake3":"00","chunks":[{"id":"zz","len":1}]}"#;
        assert!(serde_json::from_str::<Recipe>(bad_id).is_err());
    }
}
