//! Fault switches, so the rollback of each failure point of a snapshot is tested against the real
//! CRIU and a real process (CRIU's CUDA plugin has the same idea). `TORPOR_FAULT=<point>` in the
//! environment of `torpor snapshot` (or torpord) makes every snapshot fail at that point:
//!
//! - `before-dump`: after the driver's checkpoint (GPU memory now in the process), before CRIU;
//! - `after-dump`: after CRIU wrote the images, before the snapshot is hashed and committed;
//! - `after-pre-dump`: a concurrent snapshot's pre-dump rounds are done, the tree not stopped;
//! - `skip-tracking-check`: a concurrent snapshot asks CRIU to pre-dump even where the kernel
//!   has no soft-dirty tracking, so that CRIU's own refusal (and the rollback) is tested.
//!
//! CRIU's own failure points need no switch here: CRIU reads `CRIU_FAULT` from the environment
//! torpor passes on (`1`: CRIU kills itself with its parasite inside the process, as a kill -9
//! or the OOM killer would; `3`: the page dump fails after the memory was made readable), and a
//! page write that fails for want of space is forced with a full filesystem.

/// The environment variable that arms a fault point.
pub const ENV: &str = "TORPOR_FAULT";

/// A point of the snapshot at which a fault can be forced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Point {
    BeforeDump,
    AfterDump,
    AfterPreDump,
    SkipTrackingCheck,
}

impl Point {
    pub fn name(self) -> &'static str {
        match self {
            Point::BeforeDump => "before-dump",
            Point::AfterDump => "after-dump",
            Point::AfterPreDump => "after-pre-dump",
            Point::SkipTrackingCheck => "skip-tracking-check",
        }
    }
}

/// Whether `TORPOR_FAULT` names `point`.
pub fn armed(point: Point) -> bool {
    std::env::var(ENV).is_ok_and(|v| v.trim() == point.name())
}

/// The environment variable of the timing switch: `TORPOR_DELAY=criu-<notification>:<ms>` (e.g.
/// `criu-pre-resume:3000`) holds every CRIU restore or dump at that notification of CRIU's for
/// `ms` (at most a minute), CRIU waiting for the answer, so that a fault suite can kill CRIU, the
/// daemon, `torpor snapshot` or a helper while CRIU is inside a restore (its tasks forked) or a
/// dump (the tree seized: `criu-post-dump` comes with every image written, the tree still
/// frozen).
pub const DELAY_ENV: &str = "TORPOR_DELAY";

/// The milliseconds a timing switch `env=<point>:<ms>` asks for at `point`, if it names it
/// (torpord's `TORPORD_DELAY` is read the same way).
pub fn delay_ms(env: &str, point: &str) -> Option<u64> {
    let v = std::env::var(env).ok()?;
    let (p, ms) = v.trim().split_once(':')?;
    (p == point).then(|| ms.parse::<u64>().ok()).flatten()
}

/// Waits as [`DELAY_ENV`] says if it names CRIU's notification `script`.
pub fn delay_at_notification(script: &str) {
    if let Some(ms) = delay_ms(DELAY_ENV, &format!("criu-{script}")) {
        std::thread::sleep(std::time::Duration::from_millis(ms.min(60_000)));
    }
}
