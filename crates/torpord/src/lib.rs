//! `torpord`, Torpor's node daemon: it keeps the registry of functions, snapshots and
//! instances, and serves the HTTP/JSON API (docs/torpord.md) on a Unix socket and, when asked,
//! on TCP behind a bearer token. `torpor serve` and the `torpord` binary both run [`run`].
//!
//! Layers: [`config`] (file + flags) → [`server::Daemon`] (state directory, [`registry`],
//! listeners) → [`api`] (routes) with [`metrics`]. Functions run as workers: [`workers`] (their
//! socket and [`frames`]), [`launcher`] (starting them), [`deploy`] (base and function
//! snapshots, on top of the runtime) and [`runtime`] (instances: their pools and routing, the
//! ways they start, their states, keep-alive). [`client`] is the blocking client the CLI uses.
//! docs/architecture.md follows a deploy and a cold invoke through these modules; no two of
//! them import each other in a circle (tests/module_graph.rs).

pub mod accounting;
pub mod api;
pub mod auth;
pub mod bucket;
pub mod cgroup;
pub mod client;
pub mod config;
pub mod connections;
pub mod deploy;
pub mod deploy_locks;
pub mod frames;
pub mod function_mounts;
pub mod gpudata;
pub mod hugepages;
pub mod idempotency;
pub mod instance_logs;
pub mod journal;
pub mod launcher;
pub mod limits;
pub mod logging;
pub mod metrics;
pub mod objstore;
pub mod profiles;
pub mod protocol;
pub mod recovery;
pub mod registry;
mod run;
pub mod runtime;
pub mod s3data;
#[cfg(test)]
mod schema_file;
pub mod sdk_dir;
pub mod server;
pub mod socket;
pub mod spec;
pub mod split;
pub mod staging;
pub mod state_dir;
mod sync;
pub mod tenant;
pub mod toml_table;
pub mod users;
pub mod workers;

pub use config::{Config, ServeArgs};
pub use run::{run, RunError};
pub use server::Daemon;
