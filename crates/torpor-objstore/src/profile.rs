//! A snapshot's page profile (its hot set: the order its restores first touch their pages,
//! recorded at deploy) between a node and the bucket, so that the first restore on a node that
//! pulled the snapshot serves it first as the deploying node's restores do.
//!
//! It travels as one object, `snapshots/<id>/pages-profile`: a header line naming the key and
//! the MAC ([`SnapshotKey::profile_mac`], which covers the snapshot's id), then the profile's
//! bytes. The pulling node checks the MAC with its own key before it keeps anything: the
//! profile steers which memory the page server copies first, so nobody without the key may
//! choose it.

use torpor_image::SnapshotKey;

use crate::client::Remote;
use crate::error::TransferError;
use crate::snapshot_key;

/// The object holding a snapshot's page profile, under `snapshots/<id>/`.
pub const PROFILE_OBJECT: &str = "pages-profile";
/// Larger objects are refused: a profile is a line per range, ~30 bytes each.
pub const MAX_PROFILE_BYTES: u64 = 64 << 20;
/// The header's first word: the format.
const MAGIC: &str = "torpor-pages-profile-v1";

/// The object for snapshot `id`'s `profile`, sealed with `key`.
pub fn seal_profile(key: &SnapshotKey, id: &str, profile: &[u8]) -> Vec<u8> {
    let header = format!(
        "{MAGIC} {} {}\n",
        key.id(),
        key.profile_mac(id, profile).to_hex()
    );
    let mut out = header.into_bytes();
    out.extend_from_slice(profile);
    out
}

/// The profile in `object` if `key` sealed it for snapshot `id`; else why not.
pub fn open_profile<'a>(key: &SnapshotKey, id: &str, object: &'a [u8]) -> Result<&'a [u8], String> {
    let not_one = || "not a sealed page profile".to_owned();
    let end = object
        .iter()
        .position(|&b| b == b'\n')
        .ok_or_else(not_one)?;
    let header = std::str::from_utf8(&object[..end]).map_err(|_| not_one())?;
    let profile = &object[end + 1..];
    let [magic, key_id, mac] = header.split(' ').collect::<Vec<_>>()[..] else {
        return Err(not_one());
    };
    if magic != MAGIC || key_id.len() != 16 || !key_id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(not_one());
    }
    if key_id != key.id() {
        return Err(format!(
            "sealed by snapshot key {key_id}, not this node's {}: the nodes of a cluster share the key",
            key.id()
        ));
    }
    // blake3::Hash compares in constant time.
    match blake3::Hash::from_hex(mac) {
        Ok(mac) if mac == key.profile_mac(id, profile) => Ok(profile),
        Ok(_) => Err(format!(
            "its MAC does not match snapshot {id}'s profile: changed after it was sealed"
        )),
        Err(_) => Err(not_one()),
    }
}

/// Puts snapshot `id`'s `profile`, sealed with `key`. Returns the bytes put.
pub fn push_profile(
    remote: &Remote,
    id: &str,
    key: &SnapshotKey,
    profile: &[u8],
) -> Result<u64, TransferError> {
    let object = seal_profile(key, id, profile);
    remote.put(&snapshot_key(id, PROFILE_OBJECT), &object)?;
    Ok(object.len() as u64)
}

/// Snapshot `id`'s profile in the bucket, its MAC checked with `key` (`Ok(None)`: the bucket
/// has none: a push from before profiles travelled, or a deploy that recorded none).
pub fn pull_profile(
    remote: &Remote,
    id: &str,
    key: &SnapshotKey,
) -> Result<Option<Vec<u8>>, TransferError> {
    let object = snapshot_key(id, PROFILE_OBJECT);
    let Some(bytes) = remote.get(&object, MAX_PROFILE_BYTES)? else {
        return Ok(None);
    };
    match open_profile(key, id, &bytes) {
        Ok(profile) => Ok(Some(profile.to_vec())),
        Err(reason) => Err(TransferError::CorruptObject {
            bucket: remote.bucket().to_owned(),
            key: remote.full_key(&object),
            reason,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn a_sealed_profile_opens_only_intact_for_its_snapshot_and_key() {
        let key = SnapshotKey::from_bytes([1; 32], Path::new("k"));
        let other = SnapshotKey::from_bytes([2; 32], Path::new("o"));
        let profile = b"0x7f0000000000 0x7f0000004000\n-\n0x7f0000010000 0x7f0000011000\n";
        let sealed = seal_profile(&key, "fn-a-1", profile);
        assert_eq!(open_profile(&key, "fn-a-1", &sealed), Ok(&profile[..]));
        // An empty profile is one too.
        assert_eq!(
            open_profile(&key, "fn-a-1", &seal_profile(&key, "fn-a-1", b"")),
            Ok(&b""[..])
        );

        // Any byte flipped, in the header or the profile, is refused.
        for i in 0..sealed.len() {
            let mut bad = sealed.clone();
            bad[i] ^= 0x01;
            assert!(open_profile(&key, "fn-a-1", &bad).is_err(), "byte {i}");
        }
        let mut flipped = sealed.clone();
        *flipped.last_mut().unwrap() ^= 0xff;
        let why = open_profile(&key, "fn-a-1", &flipped).unwrap_err();
        assert!(why.contains("MAC does not match"), "{why}");
        // Another snapshot's, another key's, a truncated one, not one at all.
        assert!(open_profile(&key, "fn-a-2", &sealed)
            .unwrap_err()
            .contains("MAC"));
        let why = open_profile(&other, "fn-a-1", &sealed).unwrap_err();
        assert!(why.contains(key.id()) && why.contains(other.id()), "{why}");
        assert!(open_profile(&key, "fn-a-1", &sealed[..sealed.len() - 1]).is_err());
        for junk in [
            &b""[..],
            b"0x1000 0x2000\n",
            b"torpor-pages-profile-v1 x y\n",
        ] {
            assert_eq!(
                open_profile(&key, "fn-a-1", junk),
                Err("not a sealed page profile".to_owned())
            );
        }
    }
}
