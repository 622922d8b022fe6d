//! At startup: the instances an earlier daemon left. Live ones are re-adopted once their workers
//! reconnect ([`Runtime::readopt`]); hibernated ones join their function's pool so that their
//! keep-alive (eviction) goes on ([`Runtime::take_up_hibernated`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::registry::{Instance as InstanceRow, Stage};
use crate::runtime::instance::{kill_tree, new_instance, Keep};
use crate::runtime::lifecycle::{State, Transition, WorkerTree};
use crate::runtime::pool::{Pool, Starting};
use crate::runtime::Runtime;
use crate::sync::lock;

/// How long a restarted daemon waits for the workers of an earlier one to reconnect (they retry
/// at least twice a second).
pub const READOPT_TIMEOUT: Duration = Duration::from_secs(10);

/// The live instances of an earlier daemon not re-adopted (nor dropped) yet, by id, with the
/// init pid of each; closed at the daemon's stop, which kills them ([`Runtime::shutdown`]).
#[derive(Debug, Default)]
pub(crate) struct Readopting {
    /// Instance id → (init pid, function).
    trees: std::collections::HashMap<String, (i32, String)>,
    closed: bool,
}

impl Readopting {
    /// Records an instance waiting to be re-adopted; `false` once the daemon is stopping.
    fn wait(&mut self, id: &str, init: i32, function: &str) -> bool {
        if !self.closed {
            self.trees
                .insert(id.to_string(), (init, function.to_string()));
        }
        !self.closed
    }

    /// Whether an instance of `function` (a pool's name) still waits to be re-adopted.
    pub(crate) fn waits_for(&self, function: &str) -> bool {
        self.trees.values().any(|(_, f)| f == function)
    }

    /// The instance `id` is re-adopted (it joined its pool under this lock) or dropped;
    /// `false` when the daemon is stopping (and killed it, or will not have it).
    fn done(&mut self, id: &str) -> bool {
        self.trees.remove(id);
        !self.closed
    }

    /// At the daemon's stop: no instance is re-adopted from now on; those still waiting (id,
    /// init pid), for the stop to kill.
    pub(crate) fn close(&mut self) -> Vec<(String, i32)> {
        self.closed = true;
        self.trees
            .drain()
            .map(|(id, (init, _))| (id, init))
            .collect()
    }
}

impl Runtime {
    /// At startup: the pools of functions with hibernated instances left by an earlier daemon,
    /// so that their keep-alive (eviction) goes on before any request comes.
    pub async fn take_up_hibernated(self: &Arc<Self>) {
        let registry = Arc::clone(&self.registry);
        let names = tokio::task::spawn_blocking(move || {
            registry.with(|s| {
                let mut names: Vec<String> = s
                    .instances()?
                    .into_iter()
                    .filter(|i| !i.stage.has_process())
                    .map(|i| i.function)
                    .collect();
                names.sort();
                names.dedup();
                Ok::<_, crate::registry::RegistryError>(names)
            })
        })
        .await;
        let names = match names {
            Ok(Ok(n)) => n,
            Ok(Err(e)) => {
                tracing::error!(error = %e, "cannot list the hibernated instances");
                return;
            }
            Err(e) => {
                tracing::error!(error = %e, "registry task failed");
                return;
            }
        };
        for name in names {
            match self.pool(&name).await {
                Ok(pool) => {
                    let n = lock(&pool.state).sleepers.len();
                    tracing::info!(function = %name, hibernated = n, "took up the hibernated instances of an earlier torpord");
                }
                Err(e) => {
                    tracing::warn!(function = %name, error = ?e, "cannot take up the hibernated instances")
                }
            }
        }
    }

    /// At startup: takes back the live instances an earlier daemon left, whose workers
    /// reconnect on their own. Each counts as starting in its function's pool (so requests wait
    /// for it rather than start another past max_instances) until it reconnects, within
    /// [`READOPT_TIMEOUT`], or is killed and its row removed.
    ///
    /// `woken`: the instances whose interrupted hibernation was undone (crate::recovery): their
    /// workers may wait at their quiet point, and are woken with SIGUSR2 first.
    pub async fn readopt(self: &Arc<Self>, orphans: Vec<InstanceRow>, woken: Vec<String>) {
        let live: Vec<&str> = orphans.iter().map(|r| r.id.as_str()).collect();
        self.sweep_placements(&live);
        for row in orphans {
            if let Some(init) = row.pid {
                if !lock(&self.readopting).wait(&row.id, init, &row.function) {
                    // Stopping already: the stop's own sweep of the rows is past; kill it here.
                    self.drop_orphan(&row, "torpord is stopping").await;
                    continue;
                }
            }
            let woken = woken.contains(&row.id);
            let pool = match self.pool(&row.function).await {
                Ok(p) => p,
                Err(e) => {
                    self.drop_orphan(&row, &format!("its function cannot serve: {e:?}"))
                        .await;
                    continue;
                }
            };
            let generation = {
                let mut st = lock(&pool.state);
                st.starting += 1;
                st.generation
            };
            let guard = Starting {
                pool: Arc::clone(&pool),
                armed: true,
            };
            let rt = Arc::clone(self);
            tokio::spawn(async move { rt.readopt_one(pool, guard, generation, row, woken).await });
        }
    }

    pub(crate) async fn readopt_one(
        self: Arc<Self>,
        pool: Arc<Pool>,
        mut guard: Starting,
        generation: u64,
        row: InstanceRow,
        woken: bool,
    ) {
        let Some(init) = row.pid else {
            return self.drop_orphan(&row, "its row has no pid").await;
        };
        let split = self.split_function(&pool).await;
        if row.stage == Stage::GpuReleased && split {
            // Its segments' contents were saved in the earlier daemon's memory (crate::split::
            // release): nothing can map them back.
            let why = "it released its GPU on the split path, and its segments' saved contents \
                       went with the earlier torpord";
            return self.drop_orphan(&row, why).await;
        }
        let worker = match crate::launcher::worker_pid(init) {
            Ok(w) => w,
            Err(e) => return self.drop_orphan(&row, &e.to_string()).await,
        };
        let claim = self.hub.claim(worker);
        if woken {
            // At its quiet point it waits in sigwait(SIGUSR2) and then reconnects as resumed;
            // anywhere else SIGUSR2 stays blocked and pending, and is drained at its next quiet.
            // SAFETY: kill(2) only sends a signal, to the worker of a tree the registry records.
            unsafe { libc::kill(worker, libc::SIGUSR2) };
        }
        let conn = match claim.wait(READOPT_TIMEOUT).await {
            Ok(c) => c,
            Err(e) => {
                let why = format!("its worker did not reconnect: {e}");
                return self.drop_orphan(&row, &why).await;
            }
        };
        let hello = &conn.hello;
        // Woken from its quiet point, it says resumed (as after a restore), not reattach.
        let back = hello.reattach || (woken && hello.resumed);
        if !back || hello.function.as_deref() != Some(row.function.as_str()) {
            let why = format!(
                "its worker reconnected as {:?} (reattach: {}), not as a lost instance of {:?}",
                hello.function, hello.reattach, row.function
            );
            return self.drop_orphan(&row, &why).await;
        }
        let held_keys = conn.hello.keys.clone();
        // Its idle time counts from now: the warm path does not write last_used, so the row
        // cannot say when it was last busy.
        let (inst, rd) = new_instance(
            row.id.clone(),
            &row.function,
            generation,
            WorkerTree::new(init, worker, conn, None),
            Keep::new(State::Starting, Instant::now()),
        );
        {
            let mut keep = lock(&inst.keep);
            let _ = self.step(&row.function, &mut keep, Transition::Readopt(row.stage));
        }
        // Where a live migration put it (crate::runtime::migrate).
        self.load_placement(&inst);
        if split {
            // Its worker maps segments the earlier daemon handed it, and this daemon holds no
            // record of them to unmap and save: an in-place checkpoint would leave a process the
            // driver refuses to resume. It stays warm until it hibernates (the capture reads its
            // segments through the worker).
            inst.gpu_release_failed.store(true, Ordering::SeqCst);
        }
        // The keyed requests it ran for the lost daemon: their retries wait for its `settled`
        // frames, from before it can take a request (crate::idempotency).
        for held in &held_keys {
            let keyed = crate::idempotency::Keyed {
                key: held.key.clone(),
                fingerprint: held.fingerprint.clone(),
            };
            let function = held.function.as_deref().unwrap_or(&row.function);
            self.keys.adopt(function, &keyed, &row.id);
        }
        guard.armed = false;
        {
            let mut readopting = lock(&self.readopting);
            let mut st = lock(&pool.state);
            st.starting -= 1;
            if !readopting.done(&row.id) {
                // The daemon is stopping: its stop killed the tree (or drained the pools).
                drop((st, readopting));
                kill_tree(init);
                return;
            }
            st.instances.push((Arc::clone(&inst), 0));
        }
        self.attach(&inst, rd).await;
        pool.changed.notify_waiters();
        tracing::info!(function = %row.function, instance = %row.id, pid = init, stage = %row.stage, "re-adopted an instance of an earlier torpord");
    }

    /// Waits, at most [`READOPT_TIMEOUT`], until no instance of `function` (or of the
    /// sandbox hosting it) waits to be re-adopted: a keyed request must not run before the
    /// worker that may hold its answer is back (crate::idempotency).
    pub async fn readoption_settled(self: &Arc<Self>, function: &str) {
        // Once the start-up's re-adoptions are over (always, but in its first seconds), at once.
        if lock(&self.readopting).trees.is_empty() {
            return;
        }
        let host = self.sandbox_host(function).await.ok().flatten();
        let deadline = Instant::now() + READOPT_TIMEOUT;
        while Instant::now() < deadline {
            {
                let r = lock(&self.readopting);
                if !r.waits_for(function) && host.as_deref().is_none_or(|h| !r.waits_for(h)) {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Whether the function snapshot of `pool` is a split snapshot (unknown counts as split).
    pub(crate) async fn split_function(&self, pool: &Pool) -> bool {
        let (split, id, tenant) = {
            let st = lock(&pool.state);
            (
                Arc::clone(&self.split),
                st.info.snapshot_id.clone(),
                crate::tenant::of_spec(&st.info.spec).to_string(),
            )
        };
        !matches!(
            tokio::task::spawn_blocking(move || split.plan(&id, &tenant)).await,
            Ok(Ok(None))
        )
    }

    /// An instance of an earlier daemon that cannot be taken back: killed, its row removed.
    pub(crate) async fn drop_orphan(&self, row: &InstanceRow, why: &str) {
        lock(&self.readopting).done(&row.id);
        if let Some(pid) = row.pid {
            kill_tree(pid);
        }
        tracing::warn!(function = %row.function, instance = %row.id, pid = row.pid, "killed an instance of an earlier torpord: {why}");
        let registry = Arc::clone(&self.registry);
        let id = row.id.clone();
        let deleted = tokio::task::spawn_blocking(move || registry.remove_instance_row(&id)).await;
        if !matches!(deleted, Ok(Ok(_))) {
            tracing::error!(instance = %row.id, "cannot remove the registry row of an instance that was not re-adopted");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_takes_every_instance_still_waiting_and_none_joins_after_it() {
        let mut r = Readopting::default();
        assert!(r.wait("a", 10, "f"));
        assert!(r.wait("b", 11, "g"));
        assert!(r.waits_for("f") && r.waits_for("g") && !r.waits_for("h"));
        // "a" came back before the stop: it joins its pool, and the stop does not see it.
        assert!(r.done("a"));
        assert_eq!(r.close(), vec![("b".to_string(), 11)]);
        // After the stop: "b" must not join (the stop killed it), nor may any other wait.
        assert!(!r.done("b"));
        assert!(!r.wait("c", 12, "f"));
        assert!(r.close().is_empty());
    }
}
