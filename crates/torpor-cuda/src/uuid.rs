//! GPU UUIDs in the form NVML and `nvidia-smi` print them.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The 16-byte UUID of a GPU (`CUuuid`), printed and parsed as
/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, the form NVML and `nvidia-smi -L` use. The bytes
/// are in the order the string shows them, which is also the order `cuDeviceGetUuid` returns.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GpuUuid(pub [u8; 16]);

/// Lengths of the dash-separated hex groups of a UUID.
const GROUPS: [usize; 5] = [8, 4, 4, 4, 12];
const PREFIX: &str = "GPU-";

impl fmt::Display for GpuUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(PREFIX)?;
        let mut bytes = self.0.iter();
        for (i, len) in GROUPS.iter().enumerate() {
            if i > 0 {
                f.write_str("-")?;
            }
            for byte in bytes.by_ref().take(len / 2) {
                write!(f, "{byte:02x}")?;
            }
        }
        Ok(())
    }
}

impl fmt::Debug for GpuUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// A string that is not a GPU UUID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{input}` is not a GPU UUID: give it as GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx \
     (32 hex digits), as `nvidia-smi -L` prints it"
)]
pub struct ParseGpuUuidError {
    /// The text that was rejected.
    pub input: String,
}

impl FromStr for GpuUuid {
    type Err = ParseGpuUuidError;

    /// Parses `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`; the `GPU-` prefix may be left out and
    /// the hex digits may be of either case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseGpuUuidError {
            input: s.to_owned(),
        };
        let body = s.strip_prefix(PREFIX).unwrap_or(s);
        let mut out = [0u8; 16];
        let mut at = 0;
        let mut groups = body.split('-');
        for len in GROUPS {
            let group = groups.next().ok_or_else(err)?;
            if group.len() != len || !group.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(err());
            }
            for pair in group.as_bytes().chunks(2) {
                // The group is ASCII hex digits, so each pair is valid UTF-8 and valid hex.
                let text = std::str::from_utf8(pair).map_err(|_| err())?;
                out[at] = u8::from_str_radix(text, 16).map_err(|_| err())?;
                at += 1;
            }
        }
        if groups.next().is_some() {
            return Err(err());
        }
        Ok(GpuUuid(out))
    }
}

impl Serialize for GpuUuid {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for GpuUuid {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The H100 of the GPU test machine, as `nvidia-smi` printed it and `cuDeviceGetUuid_v2`
    /// returned it.
    const H100: &str = "GPU-5ff58419-0b17-9a1d-ee0f-e8313d9dc14f";
    const H100_BYTES: [u8; 16] = [
        0x5f, 0xf5, 0x84, 0x19, 0x0b, 0x17, 0x9a, 0x1d, 0xee, 0x0f, 0xe8, 0x31, 0x3d, 0x9d, 0xc1,
        0x4f,
    ];

    #[test]
    fn parses_and_prints_the_nvidia_smi_form() {
        let uuid: GpuUuid = H100.parse().unwrap();
        assert_eq!(uuid.0, H100_BYTES);
        assert_eq!(uuid.to_string(), H100);
        assert_eq!(format!("{uuid:?}"), H100);
    }

    #[test]
    fn round_trips_every_byte_value() {
        for seed in 0..=255u8 {
            let bytes: [u8; 16] =
                std::array::from_fn(|i| seed.wrapping_mul(31).wrapping_add(i as u8 * 17));
            let uuid = GpuUuid(bytes);
            assert_eq!(uuid.to_string().parse::<GpuUuid>().unwrap(), uuid);
        }
    }

    #[test]
    fn accepts_no_prefix_and_upper_case() {
        let bare = H100.trim_start_matches("GPU-").to_uppercase();
        assert_eq!(bare.parse::<GpuUuid>().unwrap().0, H100_BYTES);
    }

    #[test]
    fn rejects_malformed_text() {
        for bad in [
            "",
            "GPU-",
            "GPU-5ff58419-0b17-9a1d-ee0f-e8313d9dc14",
            "GPU-5ff58419-0b17-9a1d-ee0f-e8313d9dc14f0",
            "GPU-5ff584190b17-9a1d-ee0f-e8313d9dc14f",
            "GPU-5ff58419-0b17-9a1d-ee0f-e8313d9dc14f-00",
            "GPU-5ff58419-0b17-9a1d-ee0f-e8313d9dc1 g",
            "MIG-5ff58419-0b17-9a1d-ee0f-e8313d9dc14f",
            "GPU-5ff58419-+b17-9a1d-ee0f-e8313d9dc14f",
            "GPU-5ff58419-0b17-9a1d-ee0f-e8313d9dc1é",
        ] {
            let err = bad.parse::<GpuUuid>().unwrap_err();
            assert_eq!(err.input, bad);
            assert!(err.to_string().contains("nvidia-smi -L"), "{err}");
        }
    }

    #[test]
    fn serializes_as_the_string() {
        let uuid: GpuUuid = H100.parse().unwrap();
        let json = serde_json::to_string(&uuid).unwrap();
        assert_eq!(json, format!("\"{H100}\""));
        assert_eq!(serde_json::from_str::<GpuUuid>(&json).unwrap(), uuid);
        let err = serde_json::from_str::<GpuUuid>("\"GPU-nope\"").unwrap_err();
        assert!(err.to_string().contains("not a GPU UUID"), "{err}");
    }
}
