//! CRIU over its RPC interface; finding CRIU.
//!
//! * [`locate`] finds a CRIU >= 4.1: `$TORPOR_CRIU`, then the private prefix that
//!   `scripts/provision-criu.sh` (`make criu`) fills, then `criu` on `PATH`. A private CRIU is
//!   run through its own packaged loader and libraries ([`Criu::from_unpacked_root`]).
//! * [`Criu::dump`] and [`Criu::restore`] speak CRIU's RPC protocol to `criu swrk <fd>` over a
//!   `SOCK_SEQPACKET` socket pair: one child process per request, which inherits nothing but its
//!   end of the pair. CRIU's notifications (its action-script points) reach a caller's handler
//!   through [`Criu::dump_with`] and [`Criu::restore_with`].
//! * [`Criu::start_lazy_pages`] runs the `criu lazy-pages` daemon that serves a restore made
//!   with [`RestoreRequest::lazy_pages`] its memory on demand over userfaultfd.
//! * [`set_loopback_up`] brings `lo` up in a restored process's network namespace.
//!
//! # Why not the `rust-criu` crate
//!
//! Checked against rust-criu's main branch (the crate DESIGN.md names): it has `external`,
//! `root`, `rst_sibling`, `tcp_established`, `ext_unix_sk`, `file_locks`, `orphan_pts_master`
//! and a notify callback, but not `empty_ns` nor `network_lock` (both needed for side-by-side
//! restores); its notify callback is a bare `fn` pointer, so it cannot capture state (the
//! restored pid, a log); a failed request becomes a string (`"criu failed: type .. errno N"`),
//! losing `cr_errmsg` and the typed errno Torpor keeps; the child inherits the caller's
//! stdout/stderr; and it pulls in `anyhow` and the `protobuf` crate with generated code. The
//! subset Torpor needs is small, so this crate mirrors it by hand with prost's derive macros
//! (`proto.rs`, CRIU's field numbers, no protoc and no build script) and keeps CRIU's errno and
//! message as typed fields of [`CriuError::Failed`].
//!
//! # Facts this crate was tested against (CRIU 4.1.1 and 4.2.1, Linux 6.18)
//!
//! * CRIU < 4.2 cannot dump a process holding any INET socket (TCP or UDP) on Linux >= 6.16:
//!   `getsockopt(SO_PASSCRED)` on it now fails with EOPNOTSUPP ("Can't get 1:16 opt"); CRIU 4.2
//!   fixed it. Debian 13 ships 4.1.1; Debian sid has 4.2.1 (`TORPOR_CRIU_SUITE=sid`).
//! * After a restore with `empty_ns_net`, the new network namespace's `lo` is down: a listener
//!   on 127.0.0.1 is restored but unreachable until `lo` is up
//!   ([`RestoreRequest::loopback_up`]).
//! * CRIU opens the images directory as `/proc/<caller>/fd/<images_dir_fd>` and writes
//!   `log_file` inside it, so the descriptor is not inherited by the child.
//!
//! # Tests
//!
//! `cargo test -p torpor-criu` runs dump/restore tests against the real CRIU, as root, after
//! `make criu` (or `scripts/provision-criu.sh`); without a provisioned CRIU they print `SKIP`
//! with the reason and pass. `TORPOR_CRIU=/path/to/criu` picks another CRIU.

mod error;
pub mod images;
mod kerndat;
mod lazy;
mod locate;
mod netns;
pub mod page_server;
mod proto;
mod request;
mod spawn;
mod swrk;

pub use error::{Action, CriuError};
pub use kerndat::remove_leaked_cache_mounts;
pub use lazy::{
    start_page_server, LazyPages, LazyPagesError, PageServerOptions, LAZY_PAGES_SOCKET,
};
pub use locate::{
    locate, min_version, private_prefix, Criu, Version, ENV_CRIU, ENV_PREFIX, MIN_VERSION,
};
pub use netns::{set_loopback_up, NetnsError};
pub use request::{DumpRequest, InheritedFd, RestoreRequest, PRE_RESUME, SETUP_NAMESPACES};
pub use swrk::{Notification, NotifyHandler};
