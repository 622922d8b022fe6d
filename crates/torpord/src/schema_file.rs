//! Test support: the JSON schemas generated from the daemon's types live in python/torpor/ for
//! the SDK's tests to read; each generating module's test checks its file is current.

use serde_json::Value;

/// Asserts that `python/torpor/<name>` holds `schema`; with `TORPOR_WRITE_SCHEMA` set, writes
/// it first. `module` names the defining module (for the message).
pub fn assert_current(name: &str, schema: &Value, module: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../python/torpor")
        .join(name);
    let want = serde_json::to_string_pretty(schema).expect("a schema is JSON") + "\n";
    if std::env::var_os("TORPOR_WRITE_SCHEMA").is_some() {
        std::fs::write(&path, &want).unwrap();
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        have == want,
        "{} is not what crates/torpord/src/{module}.rs defines: run \
         `TORPOR_WRITE_SCHEMA=1 cargo test -p torpord {module}::` and commit it",
        path.display()
    );
}
