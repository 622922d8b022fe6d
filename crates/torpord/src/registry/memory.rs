//! Each function's memory model (crate::runtime::memory): what it holds after setup() and the
//! most one request needed, measured by its pool at its deploy (torpor.mempool) and kept with
//! the function (the row goes with it).

use rusqlite::OptionalExtension;

use super::store::Store;
use super::RegistryError;
use crate::protocol::{MemoryBackend, MemoryModel};

fn backend(text: &str) -> MemoryBackend {
    match text {
        "cuda" => MemoryBackend::Cuda,
        _ => MemoryBackend::Host,
    }
}

fn bytes(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

fn column(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl Store<'_> {
    /// Records `function`'s memory model (its deploy measured it).
    pub fn set_function_memory(
        &self,
        function: &str,
        model: &MemoryModel,
        now: i64,
    ) -> Result<(), RegistryError> {
        self.conn
            .prepare_cached(
                "INSERT INTO function_memory (function, backend, resident, request_peak, measured) \
                 VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (function) DO UPDATE SET \
                 backend = excluded.backend, resident = excluded.resident, \
                 request_peak = excluded.request_peak, measured = excluded.measured",
            )?
            .execute((
                function,
                model.backend.as_str(),
                column(model.resident),
                column(model.request_peak),
                now,
            ))?;
        Ok(())
    }

    /// `function`'s memory model, if a deploy measured one.
    pub fn function_memory(&self, function: &str) -> Result<Option<MemoryModel>, RegistryError> {
        Ok(self
            .conn
            .prepare_cached(
                "SELECT backend, resident, request_peak FROM function_memory WHERE function = ?1",
            )?
            .query_row([function], |r| {
                Ok(MemoryModel {
                    backend: backend(&r.get::<_, String>(0)?),
                    resident: bytes(r.get(1)?),
                    request_peak: bytes(r.get(2)?),
                })
            })
            .optional()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::{Function, FunctionState, Registry};

    #[test]
    fn a_model_is_kept_with_its_function_and_goes_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let reg = Registry::open(&dir.path().join("r.db")).unwrap();
        let f = Function {
            name: "f".into(),
            dir: "/f".into(),
            spec: serde_json::json!({}),
            base_key: "k".into(),
            snapshot: None,
            state: FunctionState::Ready,
            created: 1,
            updated: 1,
        };
        let model = MemoryModel {
            backend: MemoryBackend::Host,
            resident: 5,
            request_peak: 60 << 20,
        };
        reg.with(|s| {
            s.insert_function(&f)?;
            assert_eq!(s.function_memory("f")?, None);
            s.set_function_memory("f", &model, 2)?;
            assert_eq!(s.function_memory("f")?, Some(model));
            let bigger = MemoryModel {
                request_peak: 70 << 20,
                ..model
            };
            s.set_function_memory("f", &bigger, 3)?;
            assert_eq!(s.function_memory("f")?, Some(bigger));
            s.delete_function("f")?;
            assert_eq!(s.function_memory("f")?, None);
            Ok::<_, RegistryError>(())
        })
        .unwrap();
    }
}
