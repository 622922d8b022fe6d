//! `torpor`: snapshot an initialised process once, restore it in milliseconds many times.

mod cmd;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use torpor_snapshot::restore::PageSource;

#[derive(Parser)]
#[command(
    name = "torpor",
    version,
    about = "Snapshot and restore processes, GPU or CPU"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start CMD in new PID, mount and network namespaces so it can be snapshotted; prints its PID.
    Run {
        /// File for the command's stdout and stderr (appended) [default: /var/log/torpor/run-<time>.log]
        #[arg(long)]
        log: Option<PathBuf>,
        /// Checkpoint the job every SECS seconds while it runs (it keeps running) into the chunk
        /// store of --checkpoints; torpor run then stays until the job exits and exits with its
        /// status. `torpor restore DIR` restores the newest checkpoint (docs/checkpoints.md).
        #[arg(long, value_name = "SECS", requires = "checkpoints")]
        checkpoint_every: Option<f64>,
        /// The checkpoint directory (created; one job per directory).
        #[arg(long, value_name = "DIR", requires = "checkpoint_every")]
        checkpoints: Option<PathBuf>,
        /// How many checkpoints to keep; older ones are pruned (their chunks collected).
        #[arg(
            long,
            value_name = "N",
            default_value_t = 3,
            requires = "checkpoint_every"
        )]
        keep: usize,
        /// Seconds to wait for in-flight CUDA work when locking, at each checkpoint.
        #[arg(long, default_value_t = 10.0, requires = "checkpoint_every")]
        timeout: f64,
        /// Take each checkpoint concurrently (as `torpor snapshot --concurrent`, with N
        /// pre-dump rounds): the job is stopped only for what changed since the last round.
        /// Needs the kernel's soft-dirty tracking; refused before the job starts without it.
        #[arg(long, value_name = "N", requires = "checkpoint_every",
              value_parser = clap::value_parser!(u32).range(1..))]
        concurrent_rounds: Option<u32>,
        #[command(flatten)]
        key: cmd::KeyArgs,
        /// The command and its arguments.
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<OsString>,
    },
    /// Snapshot the process tree rooted at PID (started by `torpor run`) into DIR.
    Snapshot {
        /// The pid `torpor run` printed.
        #[arg(long)]
        pid: i32,
        /// Snapshot directory to create (must not exist).
        #[arg(long)]
        out: PathBuf,
        /// Keep the source running after the snapshot (default: it is killed).
        #[arg(long)]
        leave_running: bool,
        /// Seconds to wait for in-flight CUDA work when locking.
        #[arg(long, default_value_t = 10.0)]
        timeout: f64,
        /// Concurrent snapshot: CRIU pre-dump rounds copy the memory while the process runs, the
        /// stop copies only what changed since (and the GPU state). Needs the kernel's
        /// soft-dirty tracking; refused in one line where it has none (docs/checkpoints.md).
        #[arg(long)]
        concurrent: bool,
        /// Pre-dump rounds of --concurrent.
        #[arg(long, value_name = "N", default_value_t = 2, requires = "concurrent",
              value_parser = clap::value_parser!(u32).range(1..))]
        rounds: u32,
        /// Print phase timings.
        #[arg(short, long)]
        verbose: bool,
        #[command(flatten)]
        key: cmd::KeyArgs,
    },
    /// Move the running process tree rooted at PID (started by `torpor run`) onto another GPU
    /// of this node, in place: the driver checkpoints its GPU state and restores it there.
    /// With --instance, a torpord instance moves live (docs/migration.md).
    Migrate {
        /// The pid `torpor run` printed.
        #[arg(
            long,
            required_unless_present = "instance",
            conflicts_with = "instance"
        )]
        pid: Option<i32>,
        /// A torpord instance's id (GET /v1/functions/NAME, `torpor status`): moved live, its
        /// segments pre-copied while it serves.
        #[arg(long)]
        instance: Option<String>,
        /// Print the daemon's JSON answer (with --instance).
        #[arg(long, requires = "instance")]
        json: bool,
        #[command(flatten)]
        daemon: cmd::DaemonArgs,
        /// The GPU to move to: an ordinal or a UUID (GPU-…).
        #[arg(long)]
        gpu: String,
        /// Seconds to wait for in-flight CUDA work when locking.
        #[arg(long, default_value_t = 10.0)]
        timeout: f64,
        /// Print phase timings.
        #[arg(short, long)]
        verbose: bool,
    },
    /// Restore a snapshot into new namespaces (several restores may run side by side).
    Restore {
        /// Snapshot directory.
        dir: PathBuf,
        /// Print the restored PID and return, instead of waiting for it to exit.
        #[arg(long)]
        detach: bool,
        /// Put GPU state on other GPUs: OLD=NEW[,OLD=NEW] (ordinals or UUIDs).
        #[arg(long)]
        gpu: Option<String>,
        /// File for the restored tree's stdout and stderr (appended) [default: the files they had when snapshotted]
        #[arg(long)]
        log: Option<PathBuf>,
        /// How memory comes back: `copy` (every page before the process runs), `lazy` (over
        /// userfaultfd by Torpor's page server: faults first, then the rest in the background;
        /// torpor waits for it to finish before it returns; docs/lazy-pages.md) or `criu-lazy`
        /// (the same with CRIU's lazy-pages daemon).
        #[arg(long, default_value = "copy")]
        pages: PageSource,
        /// DIR being a checkpoint directory: restore this checkpoint (ckpt-…) instead of the
        /// newest.
        #[arg(long, value_name = "ID")]
        checkpoint: Option<String>,
        /// DIR being a checkpoint directory: go on checkpointing the restored job every SECS
        /// into it, as `torpor run --checkpoint-every` did (CUDA lock timeout 10 s), until it
        /// exits.
        #[arg(long, value_name = "SECS", conflicts_with = "detach")]
        checkpoint_every: Option<f64>,
        /// How many checkpoints to keep with --checkpoint-every.
        #[arg(
            long,
            value_name = "N",
            default_value_t = 3,
            requires = "checkpoint_every"
        )]
        keep: usize,
        /// Concurrent checkpoints with --checkpoint-every (N pre-dump rounds each).
        #[arg(long, value_name = "N", requires = "checkpoint_every",
              value_parser = clap::value_parser!(u32).range(1..))]
        concurrent_rounds: Option<u32>,
        /// Print phase timings.
        #[arg(short, long)]
        verbose: bool,
        #[command(flatten)]
        key: cmd::KeyArgs,
    },
    /// Copy a snapshot into memory (a tmpfs such as /dev/shm), checking every file's hash on
    /// the way; restore from the copy to read the images from RAM.
    Stage {
        /// Snapshot directory.
        dir: PathBuf,
        /// Where the copy goes (must not exist; on a tmpfs).
        #[arg(long)]
        to: PathBuf,
        #[command(flatten)]
        key: cmd::KeyArgs,
    },
    /// Show what a snapshot holds.
    Inspect {
        dir: PathBuf,
        /// Print the manifest as JSON (with --store: {"manifest": ..., "store": ...}).
        #[arg(long)]
        json: bool,
        /// Also show the snapshot's logical, stored and shared sizes in this chunk store.
        #[arg(long, value_name = "STORE")]
        store: Option<PathBuf>,
        /// The snapshot's id in the store (default: the snapshot directory's name).
        #[arg(long, value_name = "ID", requires = "store")]
        store_id: Option<String>,
        /// The key to check the snapshot's MAC with [default: the `torpor snapshot` default,
        /// when it exists]
        #[arg(long, value_name = "FILE")]
        key: Option<PathBuf>,
    },
    /// Push a snapshot to the object store: into the local chunk store, then the chunks the
    /// bucket lacks, then its record and manifest (docs/objstore.md).
    Push {
        /// Snapshot directory.
        dir: PathBuf,
        /// The snapshot's id in the store and the bucket [default: the directory's name].
        #[arg(long)]
        id: Option<String>,
        #[command(flatten)]
        remote: cmd::objstore::RemoteArgs,
        #[command(flatten)]
        key: cmd::KeyArgs,
    },
    /// Pull a snapshot from the object store: only the chunks the local store lacks, each
    /// checked, then a verified snapshot directory at --out.
    Pull {
        /// The snapshot's id in the bucket.
        id: String,
        /// Snapshot directory to create (must not exist).
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        remote: cmd::objstore::RemoteArgs,
        #[command(flatten)]
        key: cmd::KeyArgs,
    },
    /// Check a snapshot's MAC (who wrote it) and every file against its size and BLAKE3 hash.
    Verify {
        dir: PathBuf,
        #[command(flatten)]
        key: cmd::KeyArgs,
    },
    /// Run the node daemon torpord in the foreground (stop it with SIGTERM or Ctrl-C).
    Serve(torpord::ServeArgs),
    /// List the functions torpord knows.
    Ls {
        /// Print the daemon's JSON answer.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        daemon: cmd::DaemonArgs,
    },
    /// Show the tail of each instance's log file, most recently written first.
    Logs {
        name: String,
        /// Lines per file.
        #[arg(long, default_value_t = 200)]
        lines: usize,
        /// Only this instance's log.
        #[arg(long)]
        instance: Option<String>,
        /// Print the daemon's JSON answer.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        daemon: cmd::DaemonArgs,
    },
    /// Delete a function: stop its instances, remove its snapshots (the shared base stays).
    Rm {
        name: String,
        /// Print the daemon's JSON answer.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        daemon: cmd::DaemonArgs,
    },
    /// Stop every live instance of a function, the deploy kept (idle ones now, busy ones when
    /// their request ends) and discard its hibernated ones: the next request restores afresh.
    Stop {
        name: String,
        /// Leave the hibernated instances on disk (later requests wake them).
        #[arg(long)]
        keep_hibernated: bool,
        /// Print the daemon's JSON answer.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        daemon: cmd::DaemonArgs,
    },
    /// Show torpord's state: version, uptime, listeners, functions, snapshots, instances.
    Status {
        /// Print the daemon's JSON answer.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        daemon: cmd::DaemonArgs,
    },
    /// Deploy the function in DIR (its torpor.toml): base snapshot, function snapshot; prints the phases.
    /// A DIR holding workflow.toml instead records that workflow (docs/sandboxes.md).
    Deploy {
        dir: PathBuf,
        /// Print the daemon's NDJSON lines as they arrive.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        daemon: cmd::DaemonArgs,
    },
    /// Invoke a deployed function (or, with --workflow, a workflow); prints its value (JSON).
    Invoke {
        name: String,
        /// NAME is a workflow (deployed from a directory holding workflow.toml), run as one request.
        #[arg(long)]
        workflow: bool,
        /// The request, as JSON.
        #[arg(long, default_value = "null")]
        data: String,
        /// Print how the instance was obtained and the phase timings on stderr.
        #[arg(short, long)]
        verbose: bool,
        /// Run the request once for KEY (e.g. a UUID): sent again with the same KEY and --data,
        /// it gets the first run's answer instead of running again; a lost connection (the
        /// daemon restarting) is retried for 60 s (docs/torpord.md, "Retries").
        #[arg(long, value_name = "KEY")]
        idempotency_key: Option<String>,
        #[command(flatten)]
        daemon: cmd::DaemonArgs,
    },
    /// Torpor across nodes on Ray: `cluster up` on each node, `cluster status` (docs/cluster.md;
    /// runs `python3 -m torpor.cluster` with these arguments).
    #[command(disable_help_flag = true)]
    Cluster {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Launches one worker for torpord (internal).
    #[command(name = "__launch", hide = true)]
    Launch {
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// The guard `torpor snapshot` starts: the rollback of a snapshot that is killed (internal;
    /// torpor_snapshot::guard).
    #[command(name = "__snapshot-guard", hide = true)]
    SnapshotGuard {
        #[arg(long)]
        pid: i32,
    },
    /// The init that `torpor run` execs inside the new namespaces (internal).
    #[command(name = "__init", hide = true)]
    Init {
        report_fd: i32,
        log: PathBuf,
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<OsString>,
    },
}

fn main() -> ExitCode {
    // torpor enumerates every GPU of the node; the processes it snapshots keep their own
    // CUDA_VISIBLE_DEVICES, read from /proc. Removed while the process is single-threaded.
    std::env::remove_var("CUDA_VISIBLE_DEVICES");
    // A lazy restore's page server (torpor_criu::page_server), run by this binary for itself.
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if args.len() > 1 && args[1] == torpor_snapshot::page_server::SUBCOMMAND {
        return ExitCode::from(torpor_snapshot::page_server::main(&args[2..]) as u8);
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run {
            log,
            checkpoint_every,
            checkpoints,
            keep,
            timeout,
            concurrent_rounds,
            key,
            command,
        } => cmd::run::run(
            log,
            checkpoint_every
                .zip(checkpoints)
                .map(|(every, dir)| cmd::checkpointing::Periodic {
                    every,
                    dir,
                    keep,
                    timeout,
                    pre_dump_rounds: concurrent_rounds.unwrap_or(0),
                }),
            &key,
            &command,
        ),
        Command::Snapshot {
            pid,
            out,
            leave_running,
            timeout,
            concurrent,
            rounds,
            verbose,
            key,
        } => cmd::snapshot::run(
            pid,
            &out,
            leave_running,
            timeout,
            if concurrent { rounds } else { 0 },
            verbose,
            &key,
        ),
        Command::Migrate {
            pid,
            instance,
            json,
            daemon,
            gpu,
            timeout,
            verbose,
        } => match (pid, instance) {
            (_, Some(id)) => cmd::migrate::run_instance(&daemon, &id, &gpu, json),
            (Some(pid), None) => cmd::migrate::run(pid, &gpu, timeout, verbose),
            (None, None) => Err(anyhow::anyhow!(
                "give --pid PID (a process started by torpor run) or --instance ID (a torpord instance)"
            )),
        },
        Command::Restore {
            dir,
            detach,
            gpu,
            log,
            pages,
            checkpoint,
            checkpoint_every,
            keep,
            concurrent_rounds,
            verbose,
            key,
        } => cmd::restore::run(
            &dir,
            detach,
            gpu.as_deref(),
            log.as_deref(),
            pages,
            checkpoint.as_deref(),
            checkpoint_every.map(|every| cmd::checkpointing::Periodic {
                every,
                dir: dir.clone(),
                keep,
                timeout: 10.0,
                pre_dump_rounds: concurrent_rounds.unwrap_or(0),
            }),
            verbose,
            &key,
        ),
        Command::Stage { dir, to, key } => cmd::stage::run(&dir, &to, &key),
        Command::Inspect {
            dir,
            json,
            store,
            store_id,
            key,
        } => cmd::inspect::run(
            &dir,
            json,
            store.as_deref(),
            store_id.as_deref(),
            key.as_deref(),
        ),
        Command::Push {
            dir,
            id,
            remote,
            key,
        } => cmd::objstore::push(&dir, id.as_deref(), &remote, &key),
        Command::Pull {
            id,
            out,
            remote,
            key,
        } => cmd::objstore::pull(&id, &out, &remote, &key),
        Command::Verify { dir, key } => cmd::verify::run(&dir, &key),
        Command::Serve(args) => cmd::serve::run(&args),
        Command::Ls { json, daemon } => cmd::ls::run(&daemon, json),
        Command::Status { json, daemon } => cmd::status::run(&daemon, json),
        Command::Rm { name, json, daemon } => cmd::rm::run(&daemon, &name, json),
        Command::Stop {
            name,
            keep_hibernated,
            json,
            daemon,
        } => cmd::stop::run(&daemon, &name, keep_hibernated, json),
        Command::Logs {
            name,
            lines,
            instance,
            json,
            daemon,
        } => cmd::logs::run(&daemon, &name, lines, instance.as_deref(), json),
        Command::Deploy { dir, json, daemon } => cmd::deploy::run(&daemon, &dir, json),
        Command::Invoke {
            name,
            workflow,
            data,
            verbose,
            idempotency_key,
            daemon,
        } => cmd::invoke::run(
            &daemon,
            &name,
            &data,
            verbose,
            workflow,
            idempotency_key.as_deref(),
        ),
        Command::Cluster { args } => cmd::cluster::run(&args),
        Command::Launch { args } => return torpord::launcher::launch_main(&args),
        Command::SnapshotGuard { pid } => {
            let code = torpor_snapshot::guard::guard_main(pid, std::io::stdin().lock());
            return ExitCode::from(code.clamp(0, 255) as u8);
        }
        Command::Init {
            report_fd,
            log,
            command,
        } => {
            let code = torpor_snapshot::launch::init_main(report_fd, &log, &command);
            return ExitCode::from(code.clamp(0, 255) as u8);
        }
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            // One line naming the cause and the fix: torpor's errors already carry their causes,
            // so the chain is not printed again.
            let msg = err.to_string().replace('\n', " ");
            eprintln!("torpor: error: {msg}");
            if cmd::is_interrupted(&err) {
                ExitCode::from(130)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}
