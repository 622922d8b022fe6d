//! Idempotency keys: a client that sends `Idempotency-Key: K` with an invocation may send it
//! again — after a timeout, a reset connection, a daemon killed mid-request — and the function
//! runs once. The retry joins the run under way, or gets the answer it gave.
//!
//! What makes this hold across a daemon's death is that the answer outlives the daemon in the
//! worker. Every keyed request carries its key to the worker, which keeps its outcome for
//! [`TTL`]. A worker that reattaches to a new daemon names the keys it holds in its `hello`
//! (before its instance joins a pool). They become entries under way here, and its `settled`
//! frames then complete them. A keyed request that comes while an instance of its function
//! waits to be re-adopted waits for that first, so the retry of a request the old daemon handed
//! to a worker cannot run it a second time. A keyed request goes to a lazily restored instance
//! only once its pages are in: a restart kills, not re-adopts, one whose pages still came
//! (crate::recovery::drop_pages_pending), and its answers with it.
//!
//! What is kept as an answer is what the function said: its value (200) or its exception
//! (500). Anything else — a full queue, a crash, a timeout — is handed to the retries that
//! waited on that run, and then forgotten: the next retry runs the request again. A request
//! that never reached a worker ran nowhere, and runs once when it is retried. A worker that
//! dies holding keys takes their answers with it, so their retries run again (at least once,
//! never twice with an answer given).
//!
//! The table is in memory, bounded by [`TTL`] and [`MAX_ANSWER_BYTES`] (the oldest answers go
//! first). It follows the IETF's draft "The Idempotency-Key HTTP Header Field": the same key
//! with another request body is refused (422). A retry that comes while the first run is
//! under way waits for it, where the draft answers 409: a serverless client's retry wants the
//! answer, not a conflict to retry again.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use tokio::sync::watch;

use crate::sync::lock;

/// The request header.
pub const HEADER: &str = "idempotency-key";
/// The answer header on a response that was not run for this request, but given before.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";
/// How long an answer is kept, here and in the worker.
pub const TTL: Duration = Duration::from_secs(600);
/// The most answer bytes kept; past it the oldest answers go.
pub const MAX_ANSWER_BYTES: usize = 256 << 20;
/// The most answers kept; past it the oldest go.
pub const MAX_ANSWERS: usize = 100_000;
/// The longest key.
pub const MAX_KEY_LEN: usize = 255;

/// A key and the fingerprint of its request's bytes, as the worker gets them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keyed {
    pub key: String,
    pub fingerprint: String,
}

impl Keyed {
    /// Checks a header's value and hashes the request's bytes (BLAKE3, hex).
    pub fn new(header: &[u8], request: &[u8]) -> Result<Self, KeyError> {
        let key = std::str::from_utf8(header)
            .ok()
            .filter(|k| !k.is_empty() && k.len() <= MAX_KEY_LEN)
            .filter(|k| k.bytes().all(|b| b.is_ascii_graphic()))
            .ok_or(KeyError::Malformed)?;
        Ok(Self {
            key: key.to_string(),
            fingerprint: blake3::hash(request).to_hex().to_string(),
        })
    }
}

/// Why an `Idempotency-Key` cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("the Idempotency-Key header must be 1 to {MAX_KEY_LEN} visible ASCII characters (no spaces): send e.g. a UUID")]
    Malformed,
    #[error("Idempotency-Key {0:?} was used with another request body: a retry must send the same request, a new request a new key")]
    OtherRequest(String),
}

impl KeyError {
    /// The HTTP status of the refusal.
    pub fn status(&self) -> u16 {
        match self {
            Self::Malformed => 400,
            Self::OtherRequest(_) => 422,
        }
    }
}

/// A finished invocation's response, as it is given to every request of its key.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
    /// The function's own answer (a value or its exception): kept for later retries.
    pub keep: bool,
}

impl Answer {
    /// The answer of a `settled` frame, as the invoke API gives a result: the value (200) or
    /// the exception (500), with the handler's time.
    pub fn settled(s: &crate::protocol::Settled) -> Self {
        let timings = match s.handler_s {
            Some(h) => serde_json::json!({ "handler": h }).to_string(),
            None => "{}".to_string(),
        };
        let mut headers = vec![("x-torpor-timings".to_string(), timings)];
        let (status, body) = if s.ok {
            headers.push(("x-torpor-start".to_string(), "warm".to_string()));
            let value = s.value.as_ref().map_or("null", |v| v.get());
            (200, Bytes::from(value.to_string()))
        } else {
            let error = s.error.clone().unwrap_or(serde_json::Value::Null);
            (
                500,
                Bytes::from(serde_json::json!({ "error": error }).to_string()),
            )
        };
        headers.push(("content-type".to_string(), "application/json".to_string()));
        Self {
            status,
            headers,
            body,
            keep: true,
        }
    }
}

/// What a keyed request does.
pub enum Claim {
    /// Run it, and hand the answer to the ticket.
    Run(Ticket),
    /// Another request of the key runs: wait for its answer (`None` on the channel until then;
    /// the channel closes if that run ends without one: claim again). `held`: the run is a
    /// re-adopted worker's, which no timeout of this daemon bounds.
    Join {
        answers: watch::Receiver<Option<Arc<Answer>>>,
        held: bool,
    },
    /// It ran: this is its answer.
    Replay(Arc<Answer>),
}

type Slot = (String, String);

enum Entry {
    Running {
        fingerprint: String,
        done: watch::Sender<Option<Arc<Answer>>>,
        /// Adopted from a reattaching worker: that instance's id, and when (a key it never
        /// settles — it hibernated first — goes after [`TTL`]).
        held_by: Option<(String, Instant)>,
    },
    Done {
        fingerprint: String,
        answer: Arc<Answer>,
        at: Instant,
    },
}

#[derive(Default)]
struct Table {
    entries: HashMap<Slot, Entry>,
    /// Kept answers, oldest first (a slot may appear again after a newer answer replaced it).
    order: VecDeque<(Slot, Instant)>,
    bytes: usize,
    /// Entries adopted from reattached workers and not settled yet.
    held: usize,
}

/// The node's idempotency keys (one table; a key is scoped by its function).
#[derive(Clone, Default)]
pub struct Keys {
    table: Arc<Mutex<Table>>,
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Keys { .. }")
    }
}

impl Keys {
    /// What the request of `function` with `keyed` does now.
    pub fn claim(&self, function: &str, keyed: &Keyed) -> Result<Claim, KeyError> {
        let mut t = lock(&self.table);
        t.expire(Instant::now());
        let slot = (function.to_string(), keyed.key.clone());
        let same = |fp: &str| {
            if fp == keyed.fingerprint {
                Ok(())
            } else {
                Err(KeyError::OtherRequest(keyed.key.clone()))
            }
        };
        match t.entries.get(&slot) {
            Some(Entry::Done {
                fingerprint,
                answer,
                ..
            }) => {
                same(fingerprint)?;
                return Ok(Claim::Replay(Arc::clone(answer)));
            }
            Some(Entry::Running {
                fingerprint,
                done,
                held_by,
            }) => {
                same(fingerprint)?;
                return Ok(Claim::Join {
                    answers: done.subscribe(),
                    held: held_by.is_some(),
                });
            }
            None => {}
        }
        let (done, _) = watch::channel(None);
        t.entries.insert(
            slot.clone(),
            Entry::Running {
                fingerprint: keyed.fingerprint.clone(),
                done,
                held_by: None,
            },
        );
        Ok(Claim::Run(Ticket {
            keys: self.clone(),
            slot: Some(slot),
        }))
    }

    /// A reattaching worker (instance `instance`) holds the outcome of `keyed`, or runs it:
    /// its retries wait for the `settled` frame.
    pub fn adopt(&self, function: &str, keyed: &Keyed, instance: &str) {
        let mut t = lock(&self.table);
        let slot = (function.to_string(), keyed.key.clone());
        if t.entries.contains_key(&slot) {
            return;
        }
        let (done, _) = watch::channel(None);
        t.entries.insert(
            slot,
            Entry::Running {
                fingerprint: keyed.fingerprint.clone(),
                done,
                held_by: Some((instance.to_string(), Instant::now())),
            },
        );
        t.held += 1;
    }

    /// A worker's `settled` frame: the adopted run of `key` ended with `answer`.
    pub fn settle(&self, function: &str, key: &str, answer: Answer) {
        let slot = (function.to_string(), key.to_string());
        let held = matches!(
            lock(&self.table).entries.get(&slot),
            Some(Entry::Running {
                held_by: Some(_),
                ..
            })
        );
        if held {
            Ticket {
                keys: self.clone(),
                slot: Some(slot),
            }
            .finish(answer);
        }
    }

    /// Instance `instance` is gone: the keys it held have no answer any more (their retries
    /// run again).
    pub fn drop_held_by(&self, instance: &str) {
        let mut t = lock(&self.table);
        if t.held == 0 {
            return;
        }
        t.entries.retain(
            |_, e| !matches!(e, Entry::Running { held_by: Some((i, _)), .. } if i == instance),
        );
        t.count_held();
    }

    /// The keys an instance's worker still has to settle.
    #[cfg(test)]
    fn held_by(&self, instance: &str) -> usize {
        lock(&self.table)
            .entries
            .values()
            .filter(|e| matches!(e, Entry::Running { held_by: Some((i, _)), .. } if i == instance))
            .count()
    }
}

impl Table {
    fn count_held(&mut self) {
        self.held = self
            .entries
            .values()
            .filter(|e| {
                matches!(
                    e,
                    Entry::Running {
                        held_by: Some(_),
                        ..
                    }
                )
            })
            .count();
    }

    fn expire(&mut self, now: Instant) {
        if self.held > 0 {
            self.entries.retain(|_, e| {
                !matches!(e, Entry::Running { held_by: Some((_, since)), .. } if now.duration_since(*since) >= TTL)
            });
            self.count_held();
        }
        while let Some((slot, at)) = self.order.front().cloned() {
            if now.duration_since(at) < TTL
                && self.bytes <= MAX_ANSWER_BYTES
                && self.order.len() <= MAX_ANSWERS
            {
                break;
            }
            self.order.pop_front();
            // Only the answer this record is for: a later run of the slot has its own.
            if let Some(Entry::Done {
                at: kept, answer, ..
            }) = self.entries.get(&slot)
            {
                if *kept == at {
                    self.bytes = self.bytes.saturating_sub(answer.body.len());
                    self.entries.remove(&slot);
                }
            }
        }
    }
}

/// The right, and the duty, to answer a key: dropped unfinished (its run was given up), the
/// key is forgotten and the requests waiting on it claim again.
pub struct Ticket {
    keys: Keys,
    slot: Option<Slot>,
}

impl Ticket {
    /// The answers of this run, for the request that claimed it.
    pub fn subscribe(&self) -> Option<watch::Receiver<Option<Arc<Answer>>>> {
        let slot = self.slot.as_ref()?;
        match lock(&self.keys.table).entries.get(slot) {
            Some(Entry::Running { done, .. }) => Some(done.subscribe()),
            _ => None,
        }
    }

    /// The run ended: its waiters get `answer`, which is kept if it is the function's own.
    pub fn finish(mut self, answer: Answer) {
        let Some(slot) = self.slot.take() else {
            return;
        };
        let answer = Arc::new(answer);
        let mut t = lock(&self.keys.table);
        let Some(Entry::Running {
            fingerprint,
            done,
            held_by,
        }) = t.entries.remove(&slot)
        else {
            return;
        };
        if held_by.is_some() {
            t.held = t.held.saturating_sub(1);
        }
        done.send_replace(Some(Arc::clone(&answer)));
        if answer.keep {
            let at = Instant::now();
            t.bytes += answer.body.len();
            t.order.push_back((slot.clone(), at));
            t.entries.insert(
                slot,
                Entry::Done {
                    fingerprint,
                    answer,
                    at,
                },
            );
            t.expire(at);
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            lock(&self.keys.table).entries.remove(&slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keyed(key: &str, body: &[u8]) -> Keyed {
        Keyed::new(key.as_bytes(), body).unwrap()
    }

    fn answer(body: &str, keep: bool) -> Answer {
        Answer {
            status: if keep { 200 } else { 503 },
            headers: vec![],
            body: Bytes::from(body.to_string()),
            keep,
        }
    }

    #[test]
    fn a_key_must_be_short_visible_ascii() {
        assert!(Keyed::new(b"0b7f3c1e-order-17", b"{}").is_ok());
        for bad in [&b""[..], b"a b", b"caf\xc3\xa9", &[b'k'; 256]] {
            assert_eq!(Keyed::new(bad, b"{}").unwrap_err(), KeyError::Malformed);
        }
        assert_eq!(KeyError::Malformed.status(), 400);
        assert_eq!(KeyError::OtherRequest("k".into()).status(), 422);
    }

    #[test]
    fn the_first_request_runs_a_retry_joins_it_then_replays_its_answer() {
        let keys = Keys::default();
        let k = keyed("k1", b"[1]");
        let Ok(Claim::Run(ticket)) = keys.claim("f", &k) else {
            panic!("the first request must run")
        };
        let Ok(Claim::Join {
            answers: mut rx,
            held: false,
        }) = keys.claim("f", &k)
        else {
            panic!("a retry while it runs must join")
        };
        // The same key of another function is another request.
        assert!(matches!(keys.claim("g", &k), Ok(Claim::Run(_))));
        ticket.finish(answer("42", true));
        assert_eq!(rx.borrow_and_update().as_ref().unwrap().body, "42");
        match keys.claim("f", &k) {
            Ok(Claim::Replay(a)) => assert_eq!(a.body, "42"),
            _ => panic!("a retry after the answer must replay it"),
        }
        assert_eq!(
            keys.claim("f", &keyed("k1", b"[2]")).err(),
            Some(KeyError::OtherRequest("k1".into()))
        );
    }

    #[test]
    fn an_answer_that_is_not_the_functions_is_handed_to_waiters_and_forgotten() {
        let keys = Keys::default();
        let k = keyed("k", b"{}");
        let Ok(Claim::Run(ticket)) = keys.claim("f", &k) else {
            panic!()
        };
        let Ok(Claim::Join { answers: rx, .. }) = keys.claim("f", &k) else {
            panic!()
        };
        ticket.finish(answer("queue full", false));
        assert_eq!(rx.borrow().as_ref().unwrap().status, 503);
        assert!(matches!(keys.claim("f", &k), Ok(Claim::Run(_))));
    }

    #[test]
    fn a_run_given_up_closes_its_waiters_channel_and_the_key_runs_again() {
        let keys = Keys::default();
        let k = keyed("k", b"{}");
        let Ok(Claim::Run(ticket)) = keys.claim("f", &k) else {
            panic!()
        };
        let Ok(Claim::Join { answers: rx, .. }) = keys.claim("f", &k) else {
            panic!()
        };
        drop(ticket);
        assert!(rx.has_changed().is_err(), "the channel must close");
        assert!(matches!(keys.claim("f", &k), Ok(Claim::Run(_))));
    }

    #[test]
    fn keys_a_reattached_worker_holds_wait_for_its_settled_frames_or_its_end() {
        let keys = Keys::default();
        let (a, b) = (keyed("a", b"1"), keyed("b", b"2"));
        keys.adopt("f", &a, "inst-1");
        keys.adopt("f", &b, "inst-1");
        assert_eq!(keys.held_by("inst-1"), 2);
        let Ok(Claim::Join {
            answers: mut rx,
            held: true,
        }) = keys.claim("f", &a)
        else {
            panic!("a held key must be waited for")
        };
        keys.settle("f", "a", answer("7", true));
        assert_eq!(rx.borrow_and_update().as_ref().unwrap().body, "7");
        assert!(matches!(keys.claim("f", &a), Ok(Claim::Replay(_))));
        // A settle for a key nobody holds (a run this daemon started) changes nothing.
        keys.settle("f", "zzz", answer("8", true));
        assert!(matches!(
            keys.claim("f", &keyed("zzz", b"")),
            Ok(Claim::Run(_))
        ));
        // The worker died before settling b: b runs again.
        keys.drop_held_by("inst-1");
        assert_eq!(keys.held_by("inst-1"), 0);
        assert!(matches!(keys.claim("f", &b), Ok(Claim::Run(_))));
    }

    #[test]
    fn answers_past_the_byte_bound_go_oldest_first() {
        let keys = Keys::default();
        let big = "x".repeat(MAX_ANSWER_BYTES / 2 + 1);
        for key in ["old", "new"] {
            let Ok(Claim::Run(t)) = keys.claim("f", &keyed(key, b"")) else {
                panic!()
            };
            t.finish(answer(&big, true));
        }
        assert!(matches!(
            keys.claim("f", &keyed("old", b"")),
            Ok(Claim::Run(_))
        ));
        assert!(matches!(
            keys.claim("f", &keyed("new", b"")),
            Ok(Claim::Replay(_))
        ));
    }
}
