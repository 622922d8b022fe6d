//! Finding a usable CRIU: `$TORPOR_CRIU`, then the private prefix that
//! `scripts/provision-criu.sh` fills, then `criu` on `PATH`.

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::error::CriuError;

/// The oldest CRIU Torpor accepts on any kernel: Linux >= 6.13 moved the vDSO in a way older CRIU
/// cannot restore.
pub const MIN_VERSION: Version = Version::new(4, 1, 0);

/// The oldest CRIU that works on the running kernel: Linux >= 6.16 refuses `SO_PASSCRED` on INET
/// sockets, and CRIU < 4.2 then fails to dump any process holding a TCP or UDP socket
/// (criu#2718, fixed in 4.2).
pub fn min_version() -> Version {
    min_version_for(&kernel_release())
}

fn min_version_for(release: &str) -> Version {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major: u32 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    let minor: u32 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    if (major, minor) >= (6, 16) {
        Version::new(4, 2, 0)
    } else {
        MIN_VERSION
    }
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Environment variable naming a CRIU executable to use before anything else.
pub const ENV_CRIU: &str = "TORPOR_CRIU";

/// Environment variable overriding the private prefix (the same one the script reads).
pub const ENV_PREFIX: &str = "TORPOR_CRIU_PREFIX";

/// The multiarch directory and loader of the packaged libc (the script provisions x86_64 only).
const TRIPLET: &str = "x86_64-linux-gnu";
const LOADER: &str = "ld-linux-x86-64.so.2";

/// A CRIU version as `criu --version` prints it ("Version: 4.1.1").
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    pub major: u32,
    pub minor: u32,
    pub sublevel: u32,
}

impl Version {
    pub const fn new(major: u32, minor: u32, sublevel: u32) -> Self {
        Version {
            major,
            minor,
            sublevel,
        }
    }

    /// Parses the output of `criu --version`: the first line `Version: MAJOR.MINOR[.SUBLEVEL]`.
    pub fn from_criu_output(output: &str) -> Option<Version> {
        let rest = output
            .lines()
            .find_map(|l| l.trim().strip_prefix("Version:"))?
            .trim();
        let number = rest.split(|c: char| c.is_whitespace() || c == '-').next()?;
        let mut parts = number.split('.');
        let major = parts.next()?.parse().ok()?;
        let minor = parts.next()?.parse().ok()?;
        let sublevel = match parts.next() {
            Some(s) => s.parse().ok()?,
            None => 0,
        };
        Some(Version::new(major, minor, sublevel))
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.sublevel)
    }
}

/// A usable CRIU: how to start it, and its version.
#[derive(Clone, Debug)]
pub struct Criu {
    program: PathBuf,
    prefix_args: Vec<OsString>,
    version: Version,
}

impl Criu {
    /// Finds a usable CRIU: see [`locate`].
    pub fn locate() -> Result<Criu, CriuError> {
        locate()
    }

    /// Uses the CRIU executable at `program` (a path, or a name looked up in `PATH`), checking
    /// that it runs and is at least [`MIN_VERSION`].
    pub fn from_program(program: impl Into<PathBuf>) -> Result<Criu, CriuError> {
        Criu::with_args(program.into(), Vec::new())
    }

    /// Uses a private CRIU unpacked from Debian packages under `root` (`$PREFIX/root`), run
    /// through its own packaged loader and libraries: mixing the system's loader with the newer
    /// packaged libc is undefined, the packaged loader always works.
    pub fn from_unpacked_root(root: &Path) -> Result<Criu, CriuError> {
        let libdir = root.join("usr/lib").join(TRIPLET);
        let mut library_path = libdir.clone().into_os_string();
        library_path.push(":");
        library_path.push(root.join("lib").join(TRIPLET));
        Criu::with_args(
            libdir.join(LOADER),
            vec![
                OsString::from("--library-path"),
                library_path,
                root.join("usr/sbin/criu").into_os_string(),
            ],
        )
    }

    fn with_args(program: PathBuf, prefix_args: Vec<OsString>) -> Result<Criu, CriuError> {
        let mut criu = Criu {
            program,
            prefix_args,
            version: Version::new(0, 0, 0),
        };
        let files = criu.files();
        if let Some(version) = answered::lookup(&files) {
            criu.version = version;
            return criu.at_least_needed();
        }
        let output = criu
            .command()
            .arg("--version")
            .stdin(Stdio::null())
            .output()
            .map_err(|source| CriuError::Spawn {
                program: criu.program.clone(),
                source,
            })?;
        let text = String::from_utf8_lossy(&output.stdout);
        criu.version = Version::from_criu_output(&text).ok_or_else(|| CriuError::NoVersion {
            program: criu.program.clone(),
            output: tail(
                &format!("{text}{}", String::from_utf8_lossy(&output.stderr)),
                3,
            ),
        })?;
        answered::remember(files, criu.version);
        criu.at_least_needed()
    }

    fn at_least_needed(self) -> Result<Criu, CriuError> {
        let need = min_version();
        if self.version < need {
            return Err(CriuError::TooOld {
                program: self.program,
                found: self.version,
                need,
            });
        }
        Ok(self)
    }

    /// The files that make up this CRIU and so its answer to `--version`: the program, and the
    /// criu binary a packaged loader runs. `None` when one cannot be looked at (a bare name
    /// found in `PATH`): such a CRIU is asked every time.
    fn files(&self) -> Option<Vec<answered::Stamp>> {
        std::iter::once(self.program.as_path())
            .chain(
                self.prefix_args
                    .last()
                    .map(Path::new)
                    .filter(|p| p.is_absolute() && p.is_file()),
            )
            .map(answered::Stamp::of)
            .collect()
    }

    /// A `Criu` for tests of the plumbing around it: no version check.
    #[cfg(test)]
    pub(crate) fn unchecked(program: impl Into<PathBuf>, prefix_args: Vec<OsString>) -> Criu {
        Criu {
            program: program.into(),
            prefix_args,
            version: MIN_VERSION,
        }
    }

    /// The program that is executed (the criu binary, or the packaged loader).
    pub fn program(&self) -> &Path {
        &self.program
    }

    /// Arguments that precede CRIU's own (the loader's library path and the criu binary).
    pub fn prefix_args(&self) -> &[OsString] {
        &self.prefix_args
    }

    /// The version `criu --version` reported.
    pub fn version(&self) -> Version {
        self.version
    }

    /// The version as text ("4.1.1"), e.g. for a snapshot manifest.
    pub fn version_string(&self) -> String {
        self.version.to_string()
    }

    /// A command that runs this CRIU; add CRIU's arguments to it.
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.prefix_args);
        cmd
    }

    /// Runs `criu check` (needs root): succeeds when CRIU says "Looks good".
    pub fn check(&self) -> Result<(), CriuError> {
        let output = self
            .command()
            .arg("check")
            .stdin(Stdio::null())
            .output()
            .map_err(|source| CriuError::Spawn {
                program: self.program.clone(),
                source,
            })?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        if output.status.success() && text.contains("Looks good") {
            Ok(())
        } else {
            Err(CriuError::CheckFailed {
                program: self.program.clone(),
                status: output.status,
                output: tail(&text, 5),
            })
        }
    }
}

/// The last `n` non-empty lines of `text`, joined with " | " to stay on one line.
pub(crate) fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

/// The private prefix `scripts/provision-criu.sh` provisions into:
/// `$TORPOR_CRIU_PREFIX`, else `${XDG_DATA_HOME:-$HOME/.local/share}/torpor/criu`.
pub fn private_prefix() -> Option<PathBuf> {
    let nonempty = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(prefix) = nonempty(ENV_PREFIX) {
        return Some(PathBuf::from(prefix));
    }
    let data = match nonempty("XDG_DATA_HOME") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(nonempty("HOME")?).join(".local/share"),
    };
    Some(data.join("torpor/criu"))
}

/// What `$PREFIX/ready` says (written last by the script, only after `criu check` passed).
#[derive(Debug, PartialEq, Eq)]
enum Marker {
    /// The system CRIU at this path is used.
    System(PathBuf),
    /// The unpacked packages under `$PREFIX/root` are used.
    Private,
}

fn parse_marker(text: &str) -> Option<Marker> {
    let value = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
            .map(str::trim)
    };
    match value("mode")? {
        "system" => Some(Marker::System(PathBuf::from(value("program")?))),
        "private" => Some(Marker::Private),
        _ => None,
    }
}

/// Finds a usable CRIU >= [`MIN_VERSION`], in this order:
/// 1. `$TORPOR_CRIU`, a path to a criu executable (an error if it is not usable: it was asked for);
/// 2. the private prefix ([`private_prefix`]) once `scripts/provision-criu.sh` marked it ready;
/// 3. `criu` on `PATH` (and the sbin directories, which a non-root `PATH` often lacks).
pub fn locate() -> Result<Criu, CriuError> {
    if let Some(program) = std::env::var_os(ENV_CRIU).filter(|v| !v.is_empty()) {
        return Criu::from_program(PathBuf::from(program));
    }
    let mut looked = Vec::new();
    let mut too_old = None;
    if let Some(prefix) = private_prefix() {
        let ready = prefix.join("ready");
        match read_small(&ready).as_deref().and_then(parse_marker) {
            Some(Marker::Private) => return Criu::from_unpacked_root(&prefix.join("root")),
            Some(Marker::System(program)) if program.exists() => {
                return Criu::from_program(program)
            }
            _ => looked.push(format!("{} (not provisioned)", ready.display())),
        }
    }
    for dir in search_path() {
        let candidate = dir.join("criu");
        if !is_executable(&candidate) {
            continue;
        }
        match Criu::from_program(&candidate) {
            Ok(criu) => return Ok(criu),
            Err(e @ CriuError::TooOld { .. }) => {
                too_old.get_or_insert(e);
            }
            Err(e) => looked.push(format!("{} ({e})", candidate.display())),
        }
    }
    if let Some(e) = too_old {
        return Err(e);
    }
    looked.push("criu on PATH".to_string());
    Err(CriuError::NotFound {
        looked: looked.join(", "),
        need: min_version(),
    })
}

fn search_path() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    for extra in ["/usr/local/sbin", "/usr/sbin", "/sbin"] {
        if !dirs.iter().any(|d| d.as_os_str() == OsStr::new(extra)) {
            dirs.push(PathBuf::from(extra));
        }
    }
    dirs
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// What `criu --version` answered, by the files that answered it. A long-running caller (torpord)
/// locates CRIU for every restore and dump, and each `--version` is an exec of CRIU and its
/// libraries (~3 ms, on a cold start's path); a file changed since (CRIU provisioned again) is
/// asked again.
mod answered {
    use std::os::unix::fs::MetadataExt;
    use std::path::{Path, PathBuf};
    use std::sync::Mutex;

    use super::Version;

    /// A file as it was when it answered: path, inode, size and modification time.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub(super) struct Stamp(PathBuf, u64, u64, i64, i64);

    impl Stamp {
        pub(super) fn of(path: &Path) -> Option<Stamp> {
            let m = std::fs::metadata(path).ok()?;
            Some(Stamp(
                path.to_path_buf(),
                m.ino(),
                m.len(),
                m.mtime(),
                m.mtime_nsec(),
            ))
        }
    }

    static ANSWERS: Mutex<Vec<(Vec<Stamp>, Version)>> = Mutex::new(Vec::new());

    pub(super) fn lookup(files: &Option<Vec<Stamp>>) -> Option<Version> {
        let files = files.as_ref()?;
        let answers = ANSWERS.lock().unwrap_or_else(|e| e.into_inner());
        answers
            .iter()
            .find(|(f, _)| f == files)
            .map(|(_, version)| *version)
    }

    pub(super) fn remember(files: Option<Vec<Stamp>>, version: Version) {
        let Some(files) = files else { return };
        let mut answers = ANSWERS.lock().unwrap_or_else(|e| e.into_inner());
        // The same program again, changed: its old answer goes.
        answers.retain(|(f, _)| f.first().map(|s| &s.0) != files.first().map(|s| &s.0));
        answers.push((files, version));
    }
}

/// Reads a small text file (the marker); `None` if absent, unreadable or implausibly large.
fn read_small(path: &Path) -> Option<String> {
    let file = std::fs::File::open(path).ok()?;
    let mut text = String::new();
    file.take(4096).read_to_string(&mut text).ok()?;
    Some(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_criu_version_output() {
        assert_eq!(
            Version::from_criu_output("Version: 4.1.1\n"),
            Some(Version::new(4, 1, 1))
        );
        assert_eq!(
            Version::from_criu_output("Version: 4.2\nGitID: v4.2-12-gabc\n"),
            Some(Version::new(4, 2, 0))
        );
        assert_eq!(
            Version::from_criu_output("Version: 3.17.1\n"),
            Some(Version::new(3, 17, 1))
        );
        assert_eq!(Version::from_criu_output("criu: command not found"), None);
        assert!(Version::new(3, 17, 1) < MIN_VERSION);
        assert!(Version::new(4, 1, 1) >= MIN_VERSION);
        assert_eq!(min_version_for("6.12.9-amd64"), Version::new(4, 1, 0));
        assert_eq!(min_version_for("6.18.44-fc-v769"), Version::new(4, 2, 0));
        assert_eq!(min_version_for("7.0.1"), Version::new(4, 2, 0));
        assert_eq!(Version::new(4, 1, 1).to_string(), "4.1.1");
    }

    #[test]
    fn parses_ready_marker() {
        assert_eq!(
            parse_marker("version=4.1.1\nmode=private\nprogram=/x/root/usr/sbin/criu\n"),
            Some(Marker::Private)
        );
        assert_eq!(
            parse_marker("version=4.2.0\nmode=system\nprogram=/usr/sbin/criu\n"),
            Some(Marker::System("/usr/sbin/criu".into()))
        );
        assert_eq!(parse_marker("version=4.1.1\n"), None);
        assert_eq!(parse_marker("mode=other\n"), None);
    }

    #[test]
    fn rejects_a_program_that_is_not_criu() {
        match Criu::from_program("/bin/true") {
            Err(CriuError::NoVersion { program, .. }) => {
                assert_eq!(program, Path::new("/bin/true"))
            }
            other => panic!("expected NoVersion, got {other:?}"),
        }
        match Criu::from_program("/nonexistent/criu") {
            Err(CriuError::Spawn { source, .. }) => {
                assert_eq!(source.kind(), std::io::ErrorKind::NotFound)
            }
            other => panic!("expected Spawn, got {other:?}"),
        }
    }

    #[test]
    fn a_criu_is_asked_its_version_once_until_its_file_changes() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let asked = dir.path().join("asked");
        let program = dir.path().join("criu");
        let write = |version: &str| {
            let script = format!(
                "#!/bin/sh\necho x >> {}\necho 'Version: {version}'\n",
                asked.display()
            );
            std::fs::write(&program, script).unwrap();
            std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
        };
        let times_asked = || {
            std::fs::read_to_string(&asked)
                .unwrap_or_default()
                .lines()
                .count()
        };
        write("9.0.0");
        assert_eq!(
            Criu::from_program(&program).unwrap().version(),
            Version::new(9, 0, 0)
        );
        assert_eq!(
            Criu::from_program(&program).unwrap().version(),
            Version::new(9, 0, 0)
        );
        assert_eq!(times_asked(), 1, "the second locate must not run --version");
        // Provisioned again: another size, so another answer is asked for.
        write("9.1.10");
        assert_eq!(
            Criu::from_program(&program).unwrap().version(),
            Version::new(9, 1, 10)
        );
        assert_eq!(times_asked(), 2);
        // One too old is refused from the remembered answer as from a fresh one.
        write("4.0.0");
        assert!(matches!(
            Criu::from_program(&program),
            Err(CriuError::TooOld { .. })
        ));
        assert!(matches!(
            Criu::from_program(&program),
            Err(CriuError::TooOld { .. })
        ));
        assert_eq!(times_asked(), 3);
    }

    #[test]
    fn tail_keeps_last_lines_on_one_line() {
        assert_eq!(tail("a\n\nb\nc\n", 2), "b | c");
        assert_eq!(tail("", 2), "");
    }
}
