//! One invocation: the request routed to an instance ([`super::pool`]), sent as an `invoke` frame
//! with the client's bytes, and answered by the instance's reader ([`Runtime::read_results`]),
//! which hands every `result` to the request waiting for its id. The warm path touches no
//! database.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::value::RawValue;
use serde_json::{json, Value};
use tokio::net::unix::OwnedReadHalf;
use tokio::sync::oneshot;

use crate::frames;
use crate::metrics::{outcome, start};
use crate::protocol::{FromWorker, Invoke, ResultFrame, Started, ToWorker};
use crate::runtime::instance::{Instance, Pending};
use crate::runtime::lifecycle::State;
use crate::runtime::Runtime;
use crate::sync::lock;
use crate::workers::{self, ConnError};

/// How often a keyed request waiting for an instance's lazy pages looks whether the instance
/// is gone (the pages coming in wake it at once).
const PAGES_DEAD_CHECK: Duration = Duration::from_millis(50);

/// A worker's `result` frame, its `value` as the bytes the worker sent (so the daemon never
/// re-encodes a function's result: no float or big integer changes on the way).
pub(crate) type Answer = ResultFrame;

/// How an invocation went wrong; the API maps each to a status.
#[derive(Debug)]
pub enum InvokeError {
    /// 400: the request is not usable.
    BadRequest(String),
    /// 404.
    NotFound(String),
    /// 409: deploying or failed.
    NotReady(String),
    /// 429: the queue is full.
    QueueFull(String),
    /// 503 with Retry-After: waited in the queue too long.
    QueueTimeout { message: String, retry_after_s: u64 },
    /// 500: the function raised; the error document of the worker.
    User(Value, Timings),
    /// 502: the worker died or broke the protocol while holding the request.
    Crashed(String),
    /// 504: the request ran past the function's timeout_s; the worker was killed.
    Timeout(String),
    /// 503 with Retry-After: no GPU had the free memory the function's snapshot needs, for as
    /// long as the request could wait (other processes hold it).
    NoGpuMemory { message: String, retry_after_s: u64 },
    /// 500: the daemon could not start an instance, or another failure of its own.
    Internal(String),
}

/// Phase timings of one invocation, in seconds, in order.
pub type Timings = Vec<(String, f64)>;

/// A successful invocation.
#[derive(Debug)]
pub struct Invoked {
    /// The function's value as the worker encoded it.
    pub value: Box<RawValue>,
    pub start: &'static str,
    pub timings: Timings,
}

/// How long a worker past its timeout gets to write its threads' stacks (SIGUSR1) before its
/// tree is killed: faulthandler writes them from the signal handler at once.
const STACKS_GRACE: Duration = Duration::from_millis(300);

impl Runtime {
    /// Takes `inst` out of service for `why`, its worker's threads' stacks written to its log
    /// first (SIGUSR1, faulthandler), its tree killed [`STACKS_GRACE`] later: where a worker
    /// stuck or its GPU failed, the stacks say what its threads were doing.
    pub(crate) fn remove_with_stacks(self: &Arc<Self>, inst: &Arc<Instance>, why: &str) {
        crate::runtime::instance::dump_stacks(inst.worker_pid);
        self.remove_instance(inst, why, false);
        let init = inst.init_pid;
        tokio::spawn(async move {
            tokio::time::sleep(STACKS_GRACE).await;
            crate::runtime::instance::kill_tree(init);
        });
    }

    /// Runs one request of function `name`.
    pub async fn invoke(
        self: &Arc<Self>,
        name: &str,
        request: Box<RawValue>,
    ) -> Result<Invoked, InvokeError> {
        self.invoke_keyed(name, request, None).await
    }

    /// [`invoke`](Self::invoke) a request that has an idempotency key: the worker keeps its
    /// outcome (crate::idempotency; the API claims the key first).
    pub async fn invoke_keyed(
        self: &Arc<Self>,
        name: &str,
        request: Box<RawValue>,
        keyed: Option<crate::idempotency::Keyed>,
    ) -> Result<Invoked, InvokeError> {
        let t0 = Instant::now();
        let result = self.invoke_inner(name, request, keyed, t0).await;
        let o = match &result {
            Ok(_) => outcome::OK,
            Err(InvokeError::User(..)) => outcome::ERROR,
            Err(InvokeError::QueueFull(_) | InvokeError::QueueTimeout { .. }) => outcome::REJECTED,
            Err(
                InvokeError::NotFound(_) | InvokeError::BadRequest(_) | InvokeError::NotReady(_),
            ) => return result,
            Err(_) => outcome::FAILED,
        };
        self.metrics.invocations.with_label_values(&[name, o]).inc();
        result
    }

    /// Function `name`'s timeout_s (its sandbox's pool's, for a member); the default when it
    /// has no pool.
    pub async fn function_timeout(self: &Arc<Self>, name: &str) -> Duration {
        let host = self.sandbox_host(name).await.ok().flatten();
        match self.pool(host.as_deref().unwrap_or(name)).await {
            Ok(pool) => lock(&pool.state).info.timeout,
            Err(_) => crate::limits::DEFAULT_TIMEOUT,
        }
    }

    pub(crate) async fn invoke_inner(
        self: &Arc<Self>,
        name: &str,
        request: Box<RawValue>,
        keyed: Option<crate::idempotency::Keyed>,
        t0: Instant,
    ) -> Result<Invoked, InvokeError> {
        // A sandboxed function's requests go to its sandbox's host pool (sandbox).
        let host = self.sandbox_host(name).await?;
        let pool = self.pool(host.as_deref().unwrap_or(name)).await?;
        // In a sandbox with a memory budget: room for the function's peak (memory).
        let demand = match host {
            Some(_) => {
                let spec = Arc::clone(&lock(&pool.state).info.spec);
                self.sandbox_demand(name, &spec).await?
            }
            None => None,
        };
        let (lease, kind, mut timings) = self.acquire(&pool, demand).await?;
        let (timeout, per_instance) = {
            let st = lock(&pool.state);
            (st.info.timeout, st.info.per_instance)
        };
        let inst = Arc::clone(&lease.instance);
        // A split restore whose segments were all filled by its hello: its first request goes
        // after every map frame (HandingOver::all_filled); the gate opens when they are sent,
        // or when their hand-over fails (the request then fails with the instance).
        let gate = lock(&inst.maps_first).take();
        if let Some(gate) = gate {
            let t = Instant::now();
            // Bounded as the hand-over is: past it the request goes, and meets what the
            // hand-over's own timeout did to the instance.
            let _ = tokio::time::timeout(crate::split::server::MAP_TIMEOUT, gate).await;
            timings.push(("maps_first".to_string(), t.elapsed().as_secs_f64()));
        }
        // A keyed request's answer outlives a kill -9 of this daemon in its worker, which the
        // next daemon re-adopts (crate::idempotency); but that daemon kills an instance whose
        // lazy pages still come (crate::recovery::drop_pages_pending), and the retry would run
        // the request a second time. So a keyed request goes once the pages are in.
        if keyed.is_some() && inst.pages_pending.load(Ordering::SeqCst) {
            let t = Instant::now();
            self.pages_in(&inst).await;
            timings.push(("pages".to_string(), t.elapsed().as_secs_f64()));
        }
        let t_call = Instant::now();
        let member = host.is_some().then_some(name);
        let res = self
            .call(&inst, member, request, keyed, timeout, per_instance)
            .await;
        // The function's memory after the request, taken before its reservation is given
        // back, so a waiting request sees the pool it left (memory).
        if let Ok(ResultFrame {
            memory: Some(report),
            ..
        }) = &res
        {
            self.memory_report(&inst.id, &inst.function, report);
        }
        drop(lease);
        if kind == start::RESTORED {
            // hello → every segment mapped, when that happened before the answer (a request
            // that needs only some segments may finish first).
            let (mapped_s, map_calls_s) = lock(&inst.mapping)
                .as_ref()
                .map_or((None, None), |m| (m.segments_s(), m.worker_map_s()));
            if let Some(s) = mapped_s {
                timings.push(("segments".to_string(), s));
            }
            if let Some(s) = map_calls_s {
                timings.push(("segments.map".to_string(), s));
            }
        }
        let call_s = t_call.elapsed().as_secs_f64();
        let total = t0.elapsed().as_secs_f64();
        self.metrics.starts.with_label_values(&[name, kind]).inc();
        let finish = |timings: &mut Timings, handler: Option<f64>| {
            if let Some(h) = handler {
                timings.push(("handler".into(), h));
                timings.push(("overhead".into(), (call_s - h).max(0.0)));
            }
            timings.push(("total".into(), total));
            for (phase, s) in timings.iter() {
                self.metrics.observe_phase(name, phase, *s);
            }
        };
        match res {
            Ok(ResultFrame {
                ok,
                value,
                error,
                handler_s,
                ..
            }) => {
                finish(&mut timings, handler_s);
                if ok {
                    Ok(Invoked {
                        value: value.unwrap_or_else(|| {
                            RawValue::from_string("null".into()).expect("null is JSON")
                        }),
                        start: kind,
                        timings,
                    })
                } else {
                    let err = error.unwrap_or_else(
                        || json!({"type": "Error", "message": "the worker sent ok: false without an error", "traceback": ""}),
                    );
                    Err(InvokeError::User(err, timings))
                }
            }
            Err(e) => {
                finish(&mut timings, None);
                Err(e)
            }
        }
    }

    /// Waits until every lazy page of `inst` is in or it is gone, for at most the queue's
    /// timeout: past it (a page server that never finishes) the request goes anyway, and only
    /// a kill of this daemon before the pages are in would run it again.
    async fn pages_in(&self, inst: &Instance) {
        let deadline = Instant::now() + self.config.queue.timeout;
        loop {
            // Armed before the check, so that the pages coming in between are not missed.
            let served = inst.pages_served.notified();
            tokio::pin!(served);
            served.as_mut().enable();
            if !inst.pages_pending.load(Ordering::SeqCst) || inst.is_dead() {
                return;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!(instance = %inst.id, function = %inst.function, "a keyed request goes to an instance whose lazy pages are still not in after the queue's timeout: a kill of torpord before they are would run it again on retry");
                return;
            }
            // A removal is not told here: looked at again every PAGES_DEAD_CHECK.
            let _ = tokio::time::timeout(left.min(PAGES_DEAD_CHECK), served).await;
        }
    }

    /// Sends the request to `inst` and waits for its result, killing the worker at `timeout`
    /// after the handler started (`per_instance` requests may share the worker).
    pub(crate) async fn call(
        self: &Arc<Self>,
        inst: &Arc<Instance>,
        function: Option<&str>,
        request: Box<RawValue>,
        keyed: Option<crate::idempotency::Keyed>,
        timeout: Duration,
        per_instance: usize,
    ) -> Result<Answer, InvokeError> {
        let id = self.next();
        let (tx, rx) = oneshot::channel();
        let (started_tx, started_rx) = oneshot::channel();
        lock(&inst.pending).insert(
            id,
            Pending {
                started: Some(started_tx),
                result: tx,
            },
        );
        let frame = ToWorker::Invoke(Invoke {
            id,
            request,
            timeout_s: timeout.as_secs_f64(),
            function: function.map(str::to_string),
            fingerprint: keyed.as_ref().map(|k| k.fingerprint.clone()),
            key: keyed.map(|k| k.key),
        });
        let frame = match frames::encode(&frame) {
            Ok(frame) => frame,
            Err(e) => {
                lock(&inst.pending).remove(&id);
                return Err(InvokeError::BadRequest(format!(
                    "the request cannot be sent ({e}): send less data (e.g. a path)"
                )));
            }
        };
        let crashed = |inst: &Instance| {
            InvokeError::Crashed(format!(
                "the worker of function {:?} (instance {}, pid {}) failed while handling the \
                 request: {}; the instance was removed and the next request starts a new one",
                inst.function,
                inst.id,
                inst.worker_pid,
                inst.reason()
            ))
        };
        if inst.is_dead() {
            // Removed before its request was recorded (e.g. a split restore whose segments
            // failed in the background): the removal did not see this request to fail it.
            lock(&inst.pending).remove(&id);
            return Err(crashed(inst));
        }
        // In a task of its own: a caller given up mid-write (its client went away) must not
        // leave half a frame on the connection, which a restore's map frames share.
        let to = Arc::clone(inst);
        let sent = tokio::spawn(async move {
            let mut wr = to.writer.lock().await;
            workers::send_frame(&mut wr, &frame).await
        })
        .await
        .unwrap_or_else(|e| Err(ConnError::Write(std::io::Error::other(e))));
        if let Err(e) = sent {
            lock(&inst.pending).remove(&id);
            return match e {
                ConnError::Frame(frames::FrameError::TooLong(n)) => Err(InvokeError::BadRequest(
                    format!("the request is {n} bytes, over the 64 MiB frame limit: send less data (e.g. a path)"),
                )),
                e => {
                    self.remove_instance(inst, &e.to_string(), true);
                    Err(crashed(inst))
                }
            };
        }
        if inst.announces_start {
            // With requests_per_instance > 1 the request may wait inside the worker behind
            // others, each of which ends or is killed within its own timeout_s: the timeout
            // counts from the start of the handler, and this bound only catches a worker that
            // never starts it. Passing it fails this request alone (503); the worker lives.
            let ahead = u32::try_from(per_instance.saturating_sub(1)).unwrap_or(u32::MAX);
            let bound = timeout
                .saturating_mul(ahead)
                .saturating_add(self.config.queue.timeout);
            // A restored instance's worker also waits here for the segments the request may
            // touch: that wait is bounded by the hand-over (MAP_TIMEOUT, then the instance
            // goes), so the bound counts only once every segment is mapped.
            let mut started_rx = started_rx;
            let mut waited = Duration::ZERO;
            let started = loop {
                match tokio::time::timeout(bound, &mut started_rx).await {
                    Err(_) if inst.still_mapping() => waited += bound,
                    r => break r,
                }
            };
            match started {
                Ok(Ok(())) => {}
                Ok(Err(_)) => {
                    // A result without `started` can only mean the instance is gone.
                    if inst.is_dead() {
                        return Err(crashed(inst));
                    }
                }
                Err(_) => {
                    lock(&inst.pending).remove(&id);
                    let retry = bound.as_secs().clamp(1, 60);
                    return Err(InvokeError::QueueTimeout {
                        message: format!(
                            "the request waited {:.1} s inside instance {} of {:?} without its \
                             handler starting: retry after {retry} s",
                            (waited + bound).as_secs_f64(),
                            inst.id,
                            inst.function
                        ),
                        retry_after_s: retry,
                    });
                }
            }
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(msg)) => Ok(msg),
            Ok(Err(_)) => Err(crashed(inst)),
            Err(_) => {
                lock(&inst.pending).remove(&id);
                let why = format!("the request ran past timeout_s = {}", timeout.as_secs_f64());
                // Where it hung: the harness writes every thread's stack to its log on SIGUSR1
                // (faulthandler), which it gets a moment to do before its tree is killed. The
                // instance is out of service from now on.
                self.remove_with_stacks(inst, &why);
                Err(InvokeError::Timeout(format!(
                    "function {:?} did not answer within its timeout_s of {} s: its worker (pid {}) \
                     was killed and will be replaced, its threads' stacks written to its log \
                     (torpor logs {} --instance {}); raise timeout_s in torpor.toml if the \
                     handler needs longer",
                    inst.function,
                    timeout.as_secs_f64(),
                    inst.worker_pid,
                    inst.function,
                    inst.id
                )))
            }
        }
    }

    /// Hands each `result` to its request; anything else, or the end, removes the instance.
    pub(crate) async fn read_results(self: Arc<Self>, inst: Arc<Instance>, mut rd: OwnedReadHalf) {
        let why = loop {
            let payload = match frames::read_payload(&mut rd).await {
                Ok(Some(payload)) => payload,
                Ok(None) => {
                    break "its connection closed (the worker exited or crashed)".to_string()
                }
                Err(e) => break e.what_happened(),
            };
            let frame = match FromWorker::parse(&payload) {
                Ok(frame) => frame,
                Err(e) => break format!("it broke the protocol: {e}"),
            };
            match frame {
                FromWorker::Quiet(_) if inst.state() == State::Hibernating => {
                    // The hibernation reads the rest: segment fds (split), then the EOF.
                    let msg = match frames::parse(&payload) {
                        Ok(msg) => msg,
                        Err(e) => break format!("it sent a malformed frame ({e})"),
                    };
                    let tx = lock(&inst.quiet_tx).take();
                    match tx {
                        Some(tx) => match tx.send((msg, rd)) {
                            Ok(()) => {
                                // The snapshot does not carry its mappings of the store's memory.
                                self.store.forget_holder(inst.store_holder);
                                return;
                            }
                            Err(_) => break "its hibernation was given up".to_string(),
                        },
                        None => break "it sent quiet twice".to_string(),
                    }
                }
                FromWorker::Mapped(_) if self.mapping_awaited(&inst) => {
                    // The segments of a restore (mapped while the instance takes requests)
                    // or of a GPU resume.
                    let answered = match frames::parse(&payload) {
                        Ok(msg) => lock(&inst.mapping).as_mut().map(|m| m.answer(&msg)),
                        Err(e) => break format!("it sent a malformed frame ({e})"),
                    };
                    match answered {
                        Some(Ok(())) | None => continue,
                        Some(Err(why)) => break why.to_string(),
                    }
                }
                FromWorker::Unmapped(_) | FromWorker::GpuQuiet(_) => {
                    // The answer to the daemon's `unmap` or `release_gpu` (a GPU release).
                    let forward = lock(&inst.segment_replies).clone();
                    let msg = match frames::parse(&payload) {
                        Ok(msg) => msg,
                        Err(e) => break format!("it sent a malformed frame ({e})"),
                    };
                    match forward {
                        Some(tx) if tx.send(msg).is_ok() => continue,
                        _ => {
                            break format!(
                            "it broke the protocol (sent {} while its GPU was not being released)",
                            frame.kind()
                        )
                        }
                    }
                }
                FromWorker::StorePut(put) if put.gpu.is_some() => {
                    // A CUDA tensor: no memfd follows (crate::runtime::store_gpu).
                    self.store_put_gpu(&inst, put);
                }
                FromWorker::StoreWritten(w) => self.store_written(&inst, w),
                FromWorker::StoreRelease(r) => self.store_release(&inst, &r.blocks, &r.leases),
                FromWorker::StorePut(put) => {
                    // Its memfd comes with the next frame (crate::runtime::store).
                    let fd = match crate::split::fds::read_with_fd(&mut rd).await {
                        Ok(Some((msg, Some(fd))))
                            if msg.get("type").and_then(Value::as_str) == Some("store_fd")
                                && msg.get("id").and_then(Value::as_u64) == Some(put.id) =>
                        {
                            fd
                        }
                        Ok(Some(_)) => {
                            break "it broke the protocol (store_put not followed by its store_fd with the memfd attached)".to_string()
                        }
                        Ok(None) => {
                            break "its connection closed (the worker exited or crashed)"
                                .to_string()
                        }
                        Err(e) => break e.to_string(),
                    };
                    self.store_put(&inst, put, fd);
                }
                FromWorker::StoreGet(get) => self.store_get(&inst, get),
                FromWorker::Memory(report) => {
                    // A sandbox's idle function gave its pool's memory back (memory).
                    self.memory_report(&inst.id, &inst.function, &report);
                }
                FromWorker::Started(Started { id }) => {
                    // Unknown: a request the daemon gave up on.
                    if let Some(p) = lock(&inst.pending).get_mut(&id) {
                        if let Some(tx) = p.started.take() {
                            let _ = tx.send(());
                        }
                    }
                }
                FromWorker::Result(result) => {
                    let id = result.id;
                    let waiter = lock(&inst.pending).remove(&id);
                    match waiter {
                        Some(p) => {
                            let _ = p.result.send(result);
                        }
                        None => {
                            tracing::debug!(instance = %inst.id, id, "result for a request that was given up")
                        }
                    }
                }
                FromWorker::Settled(settled) => {
                    // A keyed request of the daemon this worker lost (crate::idempotency).
                    let function = settled.function.as_deref().unwrap_or(&inst.function);
                    let answer = crate::idempotency::Answer::settled(&settled);
                    self.keys.settle(function, &settled.key, answer);
                }
                FromWorker::Dump(d) => {
                    // torpor.dump: written in the background; the handler does not wait.
                    self.dump_in_background(&inst.function, d);
                }
                other => {
                    break format!(
                        "it broke the protocol (sent a {:?} frame while serving requests)",
                        other.kind()
                    )
                }
            }
        };
        self.store.forget_holder(inst.store_holder);
        self.remove_instance(&inst, &why, true);
    }

    /// Writes a `dump` frame's data to its object (crate::s3data::dump) on the blocking pool;
    /// the outcome is logged and counted (`torpor_dumps_total{function, outcome}`).
    fn dump_in_background(self: &Arc<Self>, function: &str, d: crate::protocol::Dump) {
        let rt = Arc::clone(self);
        let host = function.to_string();
        let function = d.function.clone().unwrap_or_else(|| host.clone());
        tokio::task::spawn_blocking(move || {
            let spec = match rt.registry.with(|s| dump_target(s, &host, &function)) {
                Ok(DumpTarget::Spec(spec)) => spec,
                Ok(DumpTarget::Gone) => {
                    tracing::warn!(function = %function, name = %d.name, "torpor.dump dropped: the function is gone");
                    return;
                }
                Ok(DumpTarget::Outside) => {
                    // Counted under the instance's own function: the name is the worker's word.
                    tracing::warn!(instance_function = %host, function = %function, name = %d.name, "torpor.dump refused: the worker named a function that is not in its sandbox");
                    rt.metrics
                        .dumps
                        .with_label_values(&[host.as_str(), "refused"])
                        .inc();
                    return;
                }
                Err(e) => {
                    tracing::warn!(function = %function, name = %d.name, error = %e, "torpor.dump dropped: the registry failed");
                    return;
                }
            };
            let t = std::time::Instant::now();
            let outcome = match crate::s3data::dump(rt.objstore.as_deref(), &spec, &d.name, &d.data)
            {
                Ok(key) => {
                    tracing::info!(function = %function, name = %d.name, key = %key, seconds = t.elapsed().as_secs_f64(), "torpor.dump written");
                    "written"
                }
                Err(e) => {
                    tracing::warn!(function = %function, name = %d.name, error = %e, "torpor.dump failed");
                    "failed"
                }
            };
            rt.metrics
                .dumps
                .with_label_values(&[function.as_str(), outcome])
                .inc();
        });
    }

    /// Whether `inst` has segments whose `mapped` answers its reader counts.
    fn mapping_awaited(&self, inst: &Instance) -> bool {
        lock(&inst.mapping)
            .as_ref()
            .is_some_and(|m| m.unmapped() > 0)
    }
}

/// Whose declared data a `dump` frame writes.
enum DumpTarget {
    Spec(Value),
    /// The function was deleted meanwhile.
    Gone,
    /// The frame named a function outside the instance's sandbox.
    Outside,
}

/// The spec a `dump` from an instance of `host` is written against: `host`'s own, or, when the
/// frame names another `function`, that function's if it is a member of `host`'s sandbox group
/// (crate::runtime::sandbox). The name comes from the worker, so it never reaches another
/// group's (and so another tenant's) objects.
fn dump_target(
    s: &crate::registry::Store<'_>,
    host: &str,
    function: &str,
) -> Result<DumpTarget, crate::registry::RegistryError> {
    let Some(f) = s.function(function)? else {
        return Ok(DumpTarget::Gone);
    };
    if function == host {
        return Ok(DumpTarget::Spec(f.spec));
    }
    let group = crate::runtime::sandbox::group_of(&f.spec);
    let host_group = s
        .function(host)?
        .and_then(|h| crate::runtime::sandbox::group_of(&h.spec));
    Ok(match (group, host_group) {
        (Some(a), Some(b)) if a == b => DumpTarget::Spec(f.spec),
        _ => DumpTarget::Outside,
    })
}
