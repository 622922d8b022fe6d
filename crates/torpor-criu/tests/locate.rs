//! `locate` against fake CRIUs (shell scripts printing a version); no root needed.
//!
//! One test function: it changes the process environment, which other threads must not read
//! meanwhile, so the cases run in sequence in this test binary of their own.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use torpor_criu::{locate, CriuError, Version, ENV_CRIU, ENV_PREFIX};

fn fake_criu(dir: &Path, version: &str) -> PathBuf {
    std::fs::create_dir_all(dir).expect("dir");
    let path = dir.join("criu");
    std::fs::write(&path, format!("#!/bin/sh\necho 'Version: {version}'\n")).expect("write");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

#[test]
fn locate_order_and_errors() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let t = tmp.path();
    let empty_bin = t.join("empty-bin");
    std::fs::create_dir(&empty_bin).expect("dir");
    let prefix = t.join("prefix");
    std::fs::create_dir(&prefix).expect("dir");
    std::env::set_var(ENV_PREFIX, &prefix);
    std::env::set_var("PATH", &empty_bin);

    // 1. $TORPOR_CRIU is honoured, and an unusable one is an error rather than skipped.
    std::env::set_var(ENV_CRIU, fake_criu(&t.join("env"), "4.2.1"));
    assert_eq!(locate().expect("found").version(), Version::new(4, 2, 1));
    std::env::set_var(ENV_CRIU, "/bin/true");
    assert!(matches!(locate(), Err(CriuError::NoVersion { .. })));
    std::env::remove_var(ENV_CRIU);

    // 2. Nothing provisioned, nothing on PATH: NotFound naming the fix.
    let system_criu = ["/usr/local/sbin/criu", "/usr/sbin/criu", "/sbin/criu"]
        .iter()
        .any(|p| Path::new(p).exists());
    if system_criu {
        eprintln!("SKIP the NotFound case: this machine has a system criu in an sbin directory");
    } else {
        let err = locate().expect_err("nothing to find");
        assert!(matches!(err, CriuError::NotFound { .. }), "{err:?}");
        let text = err.to_string();
        assert!(
            text.contains("make criu") && text.contains("ready"),
            "{text}"
        );
    }

    // 3. An old criu on PATH: TooOld, with both versions.
    let old_bin = t.join("old-bin");
    fake_criu(&old_bin, "3.17.1");
    std::env::set_var("PATH", &old_bin);
    match locate() {
        Err(CriuError::TooOld { found, need, .. }) => {
            assert_eq!(found, Version::new(3, 17, 1));
            assert_eq!(need, torpor_criu::min_version());
        }
        other => panic!("expected TooOld, got {other:?}"),
    }

    // 4. The prefix's ready marker pointing at a system criu wins over PATH.
    let marked = fake_criu(&t.join("system"), "4.2.1");
    std::fs::write(
        prefix.join("ready"),
        format!("version=4.2.1\nmode=system\nprogram={}\n", marked.display()),
    )
    .expect("marker");
    let criu = locate().expect("found through the marker");
    assert_eq!(criu.program(), marked);
    assert_eq!(criu.version(), Version::new(4, 2, 1));

    // 5. A new enough criu on PATH is used when the prefix is not ready.
    std::fs::remove_file(prefix.join("ready")).expect("rm marker");
    let new_bin = t.join("new-bin");
    let on_path = fake_criu(&new_bin, "4.2");
    std::env::set_var(
        "PATH",
        std::env::join_paths([&old_bin, &new_bin]).expect("join"),
    );
    let criu = locate().expect("found on PATH");
    assert_eq!(criu.program(), on_path);
    assert_eq!(criu.version(), Version::new(4, 2, 0));
}
