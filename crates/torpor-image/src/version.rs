//! The snapshot format version and the rule that decides which versions load.
//!
//! Rule (as in Firecracker's snapshot format): a snapshot loads iff its major version equals ours
//! and its minor version is not newer than ours. A minor bump only adds optional fields (readers
//! give them defaults); a major bump changes the meaning or layout of existing ones.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{ImageError, Result};

/// A `MAJOR.MINOR` snapshot format version, stored in JSON as a string such as `"1.0"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FormatVersion {
    pub major: u32,
    pub minor: u32,
}

impl FormatVersion {
    /// The version this torpor writes, and the newest it reads.
    ///
    /// 1.1: the snapshot may hold `manifest.mac` (see [`crate::SnapshotKey`]), which a 1.0 reader
    /// would refuse as an unlisted file.
    pub const CURRENT: FormatVersion = FormatVersion::new(1, 1);

    pub const fn new(major: u32, minor: u32) -> FormatVersion {
        FormatVersion { major, minor }
    }

    /// Whether a snapshot of this version can be loaded by this torpor.
    pub fn check_loadable(self) -> Result<()> {
        self.check_loadable_by(FormatVersion::CURRENT)
    }

    /// Whether a snapshot of this version can be loaded by a reader that supports `ours`.
    pub fn check_loadable_by(self, ours: FormatVersion) -> Result<()> {
        if self.major != ours.major {
            return Err(ImageError::FormatMajor {
                found: self,
                supported: ours,
            });
        }
        if self.minor > ours.minor {
            return Err(ImageError::FormatNewer {
                found: self,
                supported: ours,
            });
        }
        Ok(())
    }
}

impl fmt::Display for FormatVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

impl FromStr for FormatVersion {
    type Err = ImageError;

    fn from_str(text: &str) -> Result<FormatVersion> {
        let syntax = || ImageError::FormatVersionSyntax {
            text: text.to_owned(),
        };
        let (major, minor) = text.split_once('.').ok_or_else(syntax)?;
        Ok(FormatVersion {
            major: parse_number(major).ok_or_else(syntax)?,
            minor: parse_number(minor).ok_or_else(syntax)?,
        })
    }
}

/// A decimal number without sign, spaces or redundant leading zeros.
fn parse_number(text: &str) -> Option<u32> {
    let digits_only = !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit());
    let canonical = text == "0" || !text.starts_with('0');
    if digits_only && canonical {
        text.parse().ok()
    } else {
        None
    }
}

impl Serialize for FormatVersion {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for FormatVersion {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn current_is_1_1() {
        assert_eq!(FormatVersion::CURRENT.to_string(), "1.1");
        assert!(FormatVersion::CURRENT.check_loadable().is_ok());
    }

    #[test]
    fn parse_and_display() {
        for (text, major, minor) in [
            ("1.0", 1, 0),
            ("0.0", 0, 0),
            ("2.15", 2, 15),
            ("10.3", 10, 3),
        ] {
            let v: FormatVersion = text.parse().expect(text);
            assert_eq!((v.major, v.minor), (major, minor));
            assert_eq!(v.to_string(), text);
        }
    }

    #[test]
    fn parse_rejects_malformed() {
        for text in [
            "",
            "1",
            "1.",
            ".1",
            "1.0.0",
            "v1.0",
            "1.0 ",
            " 1.0",
            "+1.0",
            "-1.0",
            "1.-0",
            "01.0",
            "1.00",
            "1.a",
            "99999999999.0",
            "1,0",
        ] {
            let err = text.parse::<FormatVersion>().expect_err(text);
            assert!(
                matches!(err, ImageError::FormatVersionSyntax { .. }),
                "{text}: {err}"
            );
        }
    }

    #[test]
    fn loadable_rule_table() {
        let ours = FormatVersion::new(1, 2);
        // (snapshot version, loads?)
        let table = [
            ((1, 0), Ok(())),
            ((1, 1), Ok(())),
            ((1, 2), Ok(())),
            ((1, 3), Err("newer")),
            ((1, 99), Err("newer")),
            ((0, 0), Err("major")),
            ((0, 9), Err("major")),
            ((2, 0), Err("major")),
            ((2, 2), Err("major")),
        ];
        for ((major, minor), expected) in table {
            let got = FormatVersion::new(major, minor).check_loadable_by(ours);
            match (expected, got) {
                (Ok(()), Ok(())) => {}
                (Err("newer"), Err(e @ ImageError::FormatNewer { .. })) => {
                    assert_eq!(
                        e.to_string(),
                        format!(
                            "snapshot format {major}.{minor} is newer than this torpor supports (1.2): upgrade torpor"
                        )
                    );
                }
                (Err("major"), Err(e @ ImageError::FormatMajor { .. })) => {
                    let text = e.to_string();
                    assert!(text.contains("major"), "{text}");
                    assert!(text.contains("re-take the snapshot"), "{text}");
                }
                (expected, got) => panic!("{major}.{minor}: expected {expected:?}, got {got:?}"),
            }
        }
    }

    #[test]
    fn serde_as_string() {
        let json = serde_json::to_string(&FormatVersion::new(1, 7)).expect("serialize");
        assert_eq!(json, "\"1.7\"");
        let back: FormatVersion = serde_json::from_str(&json).expect("deserialize");
        assert_eq!(back, FormatVersion::new(1, 7));
        let err = serde_json::from_str::<FormatVersion>("\"x\"").expect_err("bad");
        assert!(err.to_string().contains("MAJOR.MINOR"), "{err}");
        assert!(serde_json::from_str::<FormatVersion>("1.0").is_err());
    }
}
