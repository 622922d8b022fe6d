//! Which deploys wait for which. Deploys of different functions run side by side; what they share
//! is serialised by the narrowest lock that covers it:
//! - one function: its deploys and its delete, one at a time ([`DeployLocks::function`]);
//! - one base key: booting and snapshotting the base, so that two first deploys on one key make
//!   one base ([`DeployLocks::base`]), held only until the base snapshot is recorded, never
//!   across a function's load;
//! - everything: the restage at start takes all ([`DeployLocks::all`]), so that it never stages
//!   a snapshot a deploy or delete is replacing.
//!
//! Before, one daemon-wide lock covered every deploy from start to end: a deploy whose import hung
//! held every other deploy for up to the load bound (then 900 s; issue 20).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{
    Mutex as AsyncMutex, OwnedMutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard,
};

/// Per-function and per-base-key locks of deploys.
#[derive(Debug, Default)]
pub struct DeployLocks {
    all: RwLock<()>,
    functions: Keyed,
    bases: Keyed,
}

/// Held by a deploy or a delete of one function.
#[derive(Debug)]
pub struct FunctionLock<'a> {
    _all: RwLockReadGuard<'a, ()>,
    _one: OwnedMutexGuard<()>,
}

impl DeployLocks {
    /// Waits until no other deploy or delete of `function` runs (and no restage), then holds it.
    pub async fn function(&self, function: &str) -> FunctionLock<'_> {
        let all = self.all.read().await;
        let one = self.functions.lock(function).await;
        FunctionLock {
            _all: all,
            _one: one,
        }
    }

    /// Waits until no other deploy boots or snapshots the base of `key`, then holds it.
    pub async fn base(&self, key: &str) -> OwnedMutexGuard<()> {
        self.bases.lock(key).await
    }

    /// Waits until no deploy or delete runs, then holds them all off.
    pub async fn all(&self) -> RwLockWriteGuard<'_, ()> {
        self.all.write().await
    }
}

/// One async mutex per key, made on first use and dropped once nobody holds or waits for it.
#[derive(Debug, Default)]
struct Keyed(Mutex<HashMap<String, Arc<AsyncMutex<()>>>>);

impl Keyed {
    async fn lock(&self, key: &str) -> OwnedMutexGuard<()> {
        let m = {
            let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
            // Keys nobody holds or waits for (only the map's reference is left) go.
            map.retain(|_, m| Arc::strong_count(m) > 1);
            Arc::clone(map.entry(key.to_string()).or_default())
        };
        m.lock_owned().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn deploys_of_different_functions_do_not_wait_for_each_other() {
        let locks = DeployLocks::default();
        let _a = locks.function("a").await;
        tokio::time::timeout(Duration::from_secs(1), locks.function("b"))
            .await
            .expect("b does not wait for a");
        // The same function waits.
        assert!(
            tokio::time::timeout(Duration::from_millis(50), locks.function("a"))
                .await
                .is_err()
        );
        // A base is locked apart from the functions.
        let _k = locks.base("k").await;
        assert!(
            tokio::time::timeout(Duration::from_millis(50), locks.base("k"))
                .await
                .is_err()
        );
        tokio::time::timeout(Duration::from_secs(1), locks.base("other"))
            .await
            .expect("another base key does not wait");
    }

    #[tokio::test]
    async fn all_waits_for_every_deploy_and_holds_them_off() {
        let locks = DeployLocks::default();
        let a = locks.function("a").await;
        assert!(tokio::time::timeout(Duration::from_millis(50), locks.all())
            .await
            .is_err());
        drop(a);
        let all = locks.all().await;
        assert!(
            tokio::time::timeout(Duration::from_millis(50), locks.function("b"))
                .await
                .is_err()
        );
        drop(all);
        let _b = locks.function("b").await;
    }

    #[tokio::test]
    async fn unused_keys_are_forgotten() {
        let locks = DeployLocks::default();
        drop(locks.function("a").await);
        drop(locks.function("b").await);
        assert!(locks.functions.0.lock().unwrap().len() <= 1);
    }
}
