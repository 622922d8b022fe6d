//! Workflows (docs/sandboxes.md): a recorded DAG of deployed functions of one tenant, run as
//! one request. A workflow's JSON is what `python3 -m torpor.workflow DIR` prints (validated
//! there: names, edges, no cycle, stages in an order that runs each after its inputs); the daemon
//! keeps it in `STATE/workflows/NAME.json`.
//!
//! [`Runtime::invoke_workflow`] runs the stages in that order. A root stage gets the request, a
//! stage after one other that stage's value, after several an object `{stage: value}`; the
//! answer is the value of the one stage nothing comes after (several: `{stage: value}`). When
//! every stage is served by one sandbox host (crate::runtime::sandbox: sandboxed functions of
//! one tenant and workflow), the whole request holds one lease on one sandbox and every stage
//! runs there, "where its input is": its functions hand intermediates to each other through
//! the communication store (torpor.put / torpor.get, the same object) and pass keys as
//! values. Otherwise each stage is an ordinary invoke and values travel as JSON through the
//! daemon.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};

use crate::runtime::invoke::{InvokeError, Invoked, Timings};
use crate::runtime::Runtime;
use crate::sync::lock;

/// A workflow as `python3 -m torpor.workflow` prints it.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Workflow {
    /// The directory its workflow.toml was read from.
    pub dir: String,
    pub name: String,
    pub tenant: String,
    /// In an order that runs each stage after the ones it takes.
    pub stages: Vec<Stage>,
}

/// One stage: a deployed function and the stages whose values it takes.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Stage {
    pub function: String,
    pub after: Vec<String>,
}

/// Why a workflow could not be recorded or read.
#[derive(Debug, thiserror::Error)]
pub enum WorkflowFileError {
    /// No workflow of that name.
    #[error(
        "no workflow named {0:?}: deploy it first (`torpor deploy DIR` with DIR/workflow.toml)"
    )]
    NotFound(String),
    /// The file could not be read or written.
    #[error("workflow file {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file holds no workflow this daemon reads.
    #[error("workflow file {}: {source}; deploy the workflow again", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

impl Workflow {
    /// Its stages that no other stage takes.
    pub fn sinks(&self) -> Vec<&str> {
        self.stages
            .iter()
            .filter(|s| !self.stages.iter().any(|o| o.after.contains(&s.function)))
            .map(|s| s.function.as_str())
            .collect()
    }

    /// The stages in an order that runs each after its inputs, or why not (a workflow written
    /// by hand, not through torpor.workflow).
    pub fn check(&self) -> Result<(), String> {
        let mut seen: Vec<&str> = Vec::new();
        for s in &self.stages {
            if seen.contains(&s.function.as_str()) {
                return Err(format!("stage {} appears twice", s.function));
            }
            if let Some(a) = s.after.iter().find(|a| !seen.contains(&a.as_str())) {
                return Err(format!("stage {} comes before its input {a}", s.function));
            }
            seen.push(&s.function);
        }
        if seen.is_empty() {
            return Err("it has no stage".into());
        }
        Ok(())
    }
}

/// Where workflows are kept.
pub fn workflows_dir(state_root: &Path) -> PathBuf {
    state_root.join("workflows")
}

/// Records `wf` (replacing a workflow of its name): written aside, then renamed.
pub fn save(state_root: &Path, wf: &Workflow) -> Result<(), WorkflowFileError> {
    let dir = workflows_dir(state_root);
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| WorkflowFileError::Io { path, source }
    };
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    let path = dir.join(format!("{}.json", wf.name));
    let tmp = dir.join(format!(".{}.json.tmp", wf.name));
    let text = serde_json::to_vec_pretty(wf).map_err(|source| WorkflowFileError::Json {
        path: path.clone(),
        source,
    })?;
    std::fs::write(&tmp, text).map_err(io(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io(&path))
}

/// The workflow `name` (a name torpor.workflow accepted: no path separator).
pub fn load(state_root: &Path, name: &str) -> Result<Workflow, WorkflowFileError> {
    let path = workflows_dir(state_root).join(format!("{name}.json"));
    let text = match std::fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(WorkflowFileError::NotFound(name.to_string()))
        }
        Err(source) => return Err(WorkflowFileError::Io { path, source }),
    };
    serde_json::from_slice(&text).map_err(|source| WorkflowFileError::Json { path, source })
}

/// Forgets the workflow `name`; whether there was one.
pub fn remove(state_root: &Path, name: &str) -> Result<bool, WorkflowFileError> {
    let path = workflows_dir(state_root).join(format!("{name}.json"));
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(WorkflowFileError::Io { path, source }),
    }
}

/// A stage's error, said of the stage.
fn in_stage(stage: &str, e: InvokeError) -> InvokeError {
    let say = |m: String| format!("workflow stage {stage}: {m}");
    match e {
        InvokeError::BadRequest(m) => InvokeError::BadRequest(say(m)),
        InvokeError::NotFound(m) => InvokeError::NotFound(say(m)),
        InvokeError::NotReady(m) => InvokeError::NotReady(say(m)),
        InvokeError::QueueFull(m) => InvokeError::QueueFull(say(m)),
        InvokeError::QueueTimeout {
            message,
            retry_after_s,
        } => InvokeError::QueueTimeout {
            message: say(message),
            retry_after_s,
        },
        InvokeError::NoGpuMemory {
            message,
            retry_after_s,
        } => InvokeError::NoGpuMemory {
            message: say(message),
            retry_after_s,
        },
        InvokeError::User(mut err, t) => {
            if let Some(o) = err.as_object_mut() {
                o.insert("stage".into(), json!(stage));
            }
            InvokeError::User(err, t)
        }
        InvokeError::Crashed(m) => InvokeError::Crashed(say(m)),
        InvokeError::Timeout(m) => InvokeError::Timeout(say(m)),
        InvokeError::Internal(m) => InvokeError::Internal(say(m)),
    }
}

fn raw(v: &Value) -> Result<Box<RawValue>, InvokeError> {
    serde_json::value::to_raw_value(v)
        .map_err(|e| InvokeError::Internal(format!("cannot encode a stage's input: {e}")))
}

impl Runtime {
    /// Runs workflow `wf` as one request (module doc).
    pub async fn invoke_workflow(
        self: &Arc<Self>,
        wf: &Workflow,
        request: Box<RawValue>,
    ) -> Result<Invoked, InvokeError> {
        let t0 = Instant::now();
        wf.check().map_err(|why| {
            InvokeError::Internal(format!(
                "workflow {} is not runnable: {why}; deploy it again",
                wf.name
            ))
        })?;
        // One sandbox host for every stage: the request runs in one sandbox.
        let mut hosts = Vec::new();
        for s in &wf.stages {
            hosts.push(
                self.sandbox_host(&s.function)
                    .await
                    .map_err(|e| in_stage(&s.function, e))?,
            );
        }
        let one_host = match hosts.first() {
            Some(Some(h)) if hosts.iter().all(|x| x.as_ref() == Some(h)) => Some(h.clone()),
            _ => None,
        };
        let mut timings: Timings = Vec::new();
        let mut values: Map<String, Value> = Map::new();
        let mut start = crate::metrics::start::WARM;
        let lease = match &one_host {
            Some(host) => {
                let pool = self.pool(host).await.map_err(|e| in_stage(host, e))?;
                let (lease, kind, t) = self
                    .acquire(&pool, None)
                    .await
                    .map_err(|e| in_stage(host, e))?;
                start = kind;
                timings.extend(t);
                let (timeout, per_instance) = {
                    let st = lock(&pool.state);
                    (st.info.timeout, st.info.per_instance)
                };
                Some((lease, timeout, per_instance))
            }
            None => None,
        };
        let mut first = true;
        for s in &wf.stages {
            let input = match s.after.as_slice() {
                [] => request.clone(),
                [one] => raw(values.get(one).unwrap_or(&Value::Null))?,
                many => raw(&Value::Object(
                    many.iter()
                        .map(|a| (a.clone(), values.get(a).cloned().unwrap_or(Value::Null)))
                        .collect(),
                ))?,
            };
            let t = Instant::now();
            let value: Box<RawValue> = match &lease {
                Some((lease, timeout, per_instance)) => {
                    let inst = Arc::clone(&lease.instance);
                    let answer = self
                        .call(
                            &inst,
                            Some(&s.function),
                            input,
                            None,
                            *timeout,
                            *per_instance,
                        )
                        .await
                        .map_err(|e| in_stage(&s.function, e))?;
                    if !answer.ok {
                        let err = answer.error.unwrap_or_else(|| json!({"type": "Error", "message": "the worker sent ok: false without an error", "traceback": ""}));
                        return Err(in_stage(
                            &s.function,
                            InvokeError::User(err, timings.clone()),
                        ));
                    }
                    answer.value.unwrap_or_else(|| {
                        RawValue::from_string("null".into()).expect("null is JSON")
                    })
                }
                None => {
                    let done = self
                        .invoke(&s.function, input)
                        .await
                        .map_err(|e| in_stage(&s.function, e))?;
                    if first {
                        start = done.start;
                    }
                    done.value
                }
            };
            first = false;
            timings.push((format!("stage:{}", s.function), t.elapsed().as_secs_f64()));
            let v: Value = serde_json::from_str(value.get()).map_err(|e| {
                in_stage(
                    &s.function,
                    InvokeError::Internal(format!("its value is not JSON: {e}")),
                )
            })?;
            values.insert(s.function.clone(), v);
        }
        drop(lease);
        let sinks = wf.sinks();
        let answer = match sinks.as_slice() {
            [one] => values.remove(*one).unwrap_or(Value::Null),
            many => Value::Object(
                many.iter()
                    .map(|s| (s.to_string(), values.remove(*s).unwrap_or(Value::Null)))
                    .collect(),
            ),
        };
        timings.push(("sandbox".into(), if one_host.is_some() { 1.0 } else { 0.0 }));
        timings.push(("total".into(), t0.elapsed().as_secs_f64()));
        Ok(Invoked {
            value: raw(&answer)?,
            start,
            timings,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wf(stages: &[(&str, &[&str])]) -> Workflow {
        Workflow {
            dir: "/w".into(),
            name: "w".into(),
            tenant: "default".into(),
            stages: stages
                .iter()
                .map(|(f, a)| Stage {
                    function: f.to_string(),
                    after: a.iter().map(|s| s.to_string()).collect(),
                })
                .collect(),
        }
    }

    #[test]
    fn a_chain_has_one_sink_and_a_fork_two() {
        let chain = wf(&[("a", &[]), ("b", &["a"]), ("c", &["b"])]);
        assert!(chain.check().is_ok());
        assert_eq!(chain.sinks(), ["c"]);
        let fork = wf(&[("a", &[]), ("b", &["a"]), ("c", &["a"])]);
        assert_eq!(fork.sinks(), ["b", "c"]);
    }

    #[test]
    fn an_order_that_runs_a_stage_before_its_input_is_refused() {
        assert!(wf(&[("b", &["a"]), ("a", &[])]).check().is_err());
        assert!(wf(&[("a", &[]), ("a", &[])]).check().is_err());
        assert!(wf(&[]).check().is_err());
    }

    #[test]
    fn a_workflow_is_saved_and_read_back_and_removed() {
        let root = std::env::temp_dir().join(format!("torpor-wf-{}", std::process::id()));
        let w = wf(&[("a", &[]), ("b", &["a"])]);
        save(&root, &w).unwrap();
        let back = load(&root, "w").unwrap();
        assert_eq!(back.stages.len(), 2);
        assert!(matches!(
            load(&root, "x"),
            Err(WorkflowFileError::NotFound(_))
        ));
        assert!(remove(&root, "w").unwrap());
        assert!(!remove(&root, "w").unwrap());
        let _ = std::fs::remove_dir_all(&root);
    }
}
