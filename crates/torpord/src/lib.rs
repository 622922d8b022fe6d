//! `torpord`, Torpor's node daemon: it keeps the registry of functions, snapshots and
//! instances, and serves the HTTP/JSON API (docs/torpord.md) on a Unix socket and, when asked,
//! on TCP behind a bearer token. `torpor serve` and the `torpord` binary both run [`run`].
//!
//! Layers: [`config`] (file + flags) → [`server::Daemon`] (state directory, [`registry`],
//! listeners) → [`api`] (routes) with [`metrics`]. Functions run as workers: [`workers`] (their
//! socket and [`frames`]), [`launcher`] (starting them), [`deploy`] (base and function
//! snapshots) and [`runtime`] (instances, routing, the queue). [`client`] is the blocking client
//! the CLI uses.

pub mod accounting;
pub mod api;
pub mod auth;
pub mod client;
pub mod config;
pub mod connections;
pub mod deploy;
pub mod deploy_locks;
pub mod frames;
pub mod instance_logs;
pub mod keepalive;
pub mod launcher;
pub mod limits;
pub mod logging;
pub mod metrics;
pub mod registry;
mod run;
pub mod runtime;
pub mod server;
pub mod socket;
pub mod split;
pub mod staging;
pub mod standby;
pub mod state_dir;
pub mod toml_table;
pub mod workers;

pub use config::{Config, ServeArgs};
pub use run::{run, RunError};
pub use server::Daemon;
