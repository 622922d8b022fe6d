//! The registry's records. Times are Unix milliseconds (UTC).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Milliseconds since the Unix epoch, as the registry stores times.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Declares a string-valued enum stored as TEXT: `as_str`, `parse` and `ALL`.
macro_rules! text_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident = $text:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, utoipa::ToSchema)]
        #[serde(rename_all = "snake_case")]
        pub enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            /// Every value, in order.
            pub const ALL: &'static [$name] = &[$($name::$variant,)+];

            /// The text stored in the registry and shown in the API.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }

            /// The value for its text, if any.
            pub fn parse(text: &str) -> Option<Self> {
                match text {
                    $($text => Some($name::$variant),)+
                    _ => None,
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

text_enum! {
    /// Where a function is in its life.
    FunctionState {
        /// Deploy in progress: base and function snapshots being made.
        Deploying = "deploying",
        /// Its function snapshot exists; it can be invoked.
        Ready = "ready",
        /// The last deploy failed; the reason is in its deploy log.
        Failed = "failed",
    }
}

text_enum! {
    /// What a snapshot holds.
    SnapshotKind {
        /// Interpreter + preloaded framework (+ warmed CUDA), shared by functions with its base key.
        Base = "base",
        /// A function loaded, set up and warmed, restored to start instances.
        Function = "function",
        /// One idle instance, written when it hibernated.
        Hibernation = "hibernation",
    }
}

text_enum! {
    /// What a step-journal row is about (crate::journal).
    JournalOp {
        /// A deploy of the function named by the row's subject.
        Deploy = "deploy",
        /// A hibernation of the instance named by the row's subject.
        Hibernate = "hibernate",
        /// The stop of a migration of the instance named by the row's subject to another GPU
        /// (its pre-copy is not journaled: it leaves the worker as it was).
        Migrate = "migrate",
    }
}

text_enum! {
    /// Keep-alive stage of an instance (docs/torpord.md, "Keep-alive stages").
    Stage {
        /// Process and GPU memory held.
        Warm = "warm",
        /// Process held, GPU memory released in place.
        GpuReleased = "gpu_released",
        /// Process gone; a hibernation snapshot on disk.
        Hibernated = "hibernated",
        /// As hibernated, and the snapshot dropped from the page cache.
        Evicted = "evicted",
    }
}

impl Stage {
    /// Whether an instance in this stage has a live process (and so a pid).
    pub fn has_process(self) -> bool {
        matches!(self, Stage::Warm | Stage::GpuReleased)
    }
}

/// A deployed (or deploying) function.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Function {
    /// Unique name, from the spec.
    pub name: String,
    /// The function's directory (its copy under the state directory).
    #[schema(value_type = String)]
    pub dir: PathBuf,
    /// The parsed `torpor.toml`, as JSON.
    pub spec: serde_json::Value,
    /// Key of the base snapshot it builds on: (interpreter, preload set, GPU or not).
    pub base_key: String,
    /// Id of its function snapshot, once made.
    pub snapshot: Option<String>,
    pub state: FunctionState,
    pub created: i64,
    pub updated: i64,
}

/// A snapshot directory known to the registry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Snapshot {
    pub id: String,
    pub kind: SnapshotKind,
    /// The snapshot directory.
    #[schema(value_type = String)]
    pub path: PathBuf,
    /// The function it belongs to; `None` exactly for base snapshots.
    pub function: Option<String>,
    /// The base key: always set for base snapshots; for others, the base they came from.
    pub base_key: Option<String>,
    /// Size on disk.
    pub bytes: u64,
    pub created: i64,
}

/// A worker instance of a function, live or hibernated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Instance {
    pub id: String,
    pub function: String,
    /// Host pid; set exactly when the stage has a process.
    pub pid: Option<i32>,
    pub stage: Stage,
    /// The snapshot it was restored from or, once hibernated, the one it was written to.
    pub snapshot: Option<String>,
    pub started: i64,
    pub last_used: i64,
}

/// Number of instances in each stage.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StageCounts {
    pub warm: u64,
    pub gpu_released: u64,
    pub hibernated: u64,
    pub evicted: u64,
}

impl StageCounts {
    /// One instance fewer in `stage`.
    pub fn remove(&mut self, stage: Stage) {
        let n = match stage {
            Stage::Warm => &mut self.warm,
            Stage::GpuReleased => &mut self.gpu_released,
            Stage::Hibernated => &mut self.hibernated,
            Stage::Evicted => &mut self.evicted,
        };
        *n = n.saturating_sub(1);
    }

    /// The count for one stage.
    pub fn get(&self, stage: Stage) -> u64 {
        match stage {
            Stage::Warm => self.warm,
            Stage::GpuReleased => self.gpu_released,
            Stage::Hibernated => self.hibernated,
            Stage::Evicted => self.evicted,
        }
    }

    pub(crate) fn add(&mut self, stage: Stage, n: u64) {
        match stage {
            Stage::Warm => self.warm += n,
            Stage::GpuReleased => self.gpu_released += n,
            Stage::Hibernated => self.hibernated += n,
            Stage::Evicted => self.evicted += n,
        }
    }

    /// All instances.
    pub fn total(&self) -> u64 {
        self.warm + self.gpu_released + self.hibernated + self.evicted
    }
}

/// Number of snapshots of each kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SnapshotCounts {
    pub base: u64,
    pub function: u64,
    pub hibernation: u64,
}

/// What the registry holds, in numbers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    pub functions: u64,
    pub snapshots: SnapshotCounts,
    pub instances: StageCounts,
}
