//! `--gpu OLD=NEW[,OLD=NEW…]`: which GPU of this node takes over each GPU of a snapshot. Each
//! side is an ordinal or a UUID (`GPU-…`); OLD refers to the snapshot's GPUs, NEW to this node's.

use std::str::FromStr;

use torpor_cuda::GpuUuid;

/// A GPU named by ordinal or UUID.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuRef {
    Ordinal(u32),
    Uuid(GpuUuid),
}

impl FromStr for GpuRef {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if let Ok(n) = s.parse::<u32>() {
            return Ok(GpuRef::Ordinal(n));
        }
        s.parse::<GpuUuid>()
            .map(GpuRef::Uuid)
            .map_err(|_| format!("{s:?} is neither a GPU ordinal nor a UUID like GPU-0123abcd-…"))
    }
}

impl std::fmt::Display for GpuRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuRef::Ordinal(n) => write!(f, "{n}"),
            GpuRef::Uuid(u) => write!(f, "{u}"),
        }
    }
}

impl GpuRef {
    /// Whether this names the GPU with the given ordinal and UUID.
    pub fn matches(&self, ordinal: u32, uuid: &GpuUuid) -> bool {
        match self {
            GpuRef::Ordinal(n) => *n == ordinal,
            GpuRef::Uuid(u) => u == uuid,
        }
    }
}

/// One `OLD=NEW` pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuMapping {
    pub old: GpuRef,
    pub new: GpuRef,
}

/// Parses `OLD=NEW[,OLD=NEW…]`.
pub fn parse_gpu_map(spec: &str) -> Result<Vec<GpuMapping>, String> {
    let mut out = Vec::new();
    for part in spec.split(',').filter(|p| !p.trim().is_empty()) {
        let (old, new) = part
            .split_once('=')
            .ok_or_else(|| format!("--gpu {part:?}: expected OLD=NEW, e.g. --gpu 0=1"))?;
        let m = GpuMapping {
            old: old.parse()?,
            new: new.parse()?,
        };
        if out.iter().any(|x: &GpuMapping| x.old == m.old) {
            return Err(format!(
                "--gpu maps {} twice: give each snapshot GPU once",
                m.old
            ));
        }
        out.push(m);
    }
    if out.is_empty() {
        return Err("--gpu needs OLD=NEW, e.g. --gpu 0=1".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ordinals_and_uuids() {
        let m = parse_gpu_map("0=1, GPU-00112233-4455-6677-8899-aabbccddeeff=0").unwrap();
        assert_eq!(
            m[0],
            GpuMapping {
                old: GpuRef::Ordinal(0),
                new: GpuRef::Ordinal(1)
            }
        );
        assert!(matches!(m[1].old, GpuRef::Uuid(_)));
        assert_eq!(m[1].new, GpuRef::Ordinal(0));
    }

    #[test]
    fn rejects_bad_specs_with_a_hint() {
        assert!(parse_gpu_map("0").unwrap_err().contains("OLD=NEW"));
        assert!(parse_gpu_map("").unwrap_err().contains("OLD=NEW"));
        assert!(parse_gpu_map("0=x").unwrap_err().contains("neither"));
        assert!(parse_gpu_map("0=1,0=2").unwrap_err().contains("twice"));
    }
}
