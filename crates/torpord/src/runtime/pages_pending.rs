//! The markers of instances whose lazy pages their page server is still serving
//! (`<state>/pages-pending/<instance id>`): a daemon that dies leaves them for the next one,
//! which kills such instances instead of re-adopting them (crate::recovery::drop_pages_pending).

use std::path::Path;

/// Their directory, under the state directory.
pub const DIR: &str = "pages-pending";

/// Marks instance `id` as having pages its page server has not served yet: created before the
/// instance's registry row (so no row of a lazily restored instance is ever without it until
/// its pages are in), removed by [`served`]. A woken instance's marker holds the id of the
/// hibernation snapshot it woke from, whose registry row is kept until its pages are in: a
/// daemon that dies meanwhile puts the instance back to sleep from it.
pub fn mark(root: &Path, id: &str, hibernation: Option<&str>) -> std::io::Result<()> {
    let dir = root.join(DIR);
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join(id), hibernation.unwrap_or("").as_bytes())
}

/// The hibernation snapshot a marker names (see [`mark`]), if any.
pub fn hibernation_of(marker: &Path) -> Option<String> {
    let text = std::fs::read_to_string(marker).ok()?;
    let id = text.trim();
    (!id.is_empty()).then(|| id.to_string())
}

/// Every page of instance `id` is in (or the instance is gone): its marker goes.
pub fn served(root: &Path, id: &str) {
    let _ = std::fs::remove_file(root.join(DIR).join(id));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_woken_instances_marker_names_its_hibernation() {
        let tmp = tempfile::tempdir().unwrap();
        mark(tmp.path(), "cold", None).unwrap();
        mark(tmp.path(), "woken", Some("hib-f-1")).unwrap();
        assert_eq!(hibernation_of(&tmp.path().join(DIR).join("cold")), None);
        assert_eq!(
            hibernation_of(&tmp.path().join(DIR).join("woken")).as_deref(),
            Some("hib-f-1")
        );
        served(tmp.path(), "woken");
        assert_eq!(hibernation_of(&tmp.path().join(DIR).join("woken")), None);
    }
}
