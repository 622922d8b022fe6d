//! `torpord`, Torpor's node daemon: it keeps the registry of functions, snapshots and
//! instances, and serves the HTTP/JSON API (docs/torpord.md) on a Unix socket and, when asked,
//! on TCP behind a bearer token. `torpor serve` and the `torpord` binary both run [`run`].
//!
//! Layers: [`config`] (file + flags) → [`server::Daemon`] (state directory, [`registry`],
//! listeners) → [`api`] (routes) with [`metrics`]. [`client`] is the blocking client the CLI
//! uses.

pub mod api;
pub mod auth;
pub mod client;
pub mod config;
pub mod logging;
pub mod metrics;
pub mod registry;
mod run;
pub mod server;
pub mod socket;
pub mod state_dir;
pub mod toml_table;

pub use config::{Config, ServeArgs};
pub use run::{run, RunError};
pub use server::Daemon;
