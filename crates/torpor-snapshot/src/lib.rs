//! Transparent snapshot and restore of process trees (the CRIUgpu design): start a command in
//! namespaces that allow many restores side by side, snapshot it with the CUDA driver's
//! checkpoint API and CRIU, restore it, and roll back every failure so the source keeps running.

pub mod checkpoints;
pub mod dirty_tracking;
pub mod empty_gpu_memory;
pub mod fault;
pub mod file_prefetch;
pub mod gpu_map;
pub mod gpu_restore_slots;
pub mod gpu_tasks;
pub mod guard;
pub mod inherited_mappings;
pub mod interrupt;
pub mod launch;
pub mod migrate;
pub mod mount_ns;
pub mod mounts;
pub mod phases;
pub mod preflight;
pub mod proctree;
pub mod remote_syscall;
pub mod restore;
pub mod restore_thread;
pub mod snapshot;
pub mod space;
pub mod stage;
pub mod supervise;
mod sys;
pub mod unsupported;
pub mod visible_gpus;

pub use sys::is_root;

/// The lazy restores' page server, whose subcommand the torpor binaries run.
pub use torpor_criu::page_server;
