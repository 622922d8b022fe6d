//! A byte-bounded LRU cache: the restore server's host cache (segment bytes in host memory,
//! pinned on cuda) and GPU cache (filled device memory, copied device to device on a hit).
//!
//! Entries are keyed by the segment's content hash, so every snapshot holding the same segment
//! (a function snapshot and its instances' hibernations, two functions sharing weights) shares
//! one entry. Values are `Arc`s: a fill copies from an entry outside the cache's lock, and an
//! entry evicted meanwhile lives until that copy ends.

use std::collections::HashMap;
use std::sync::Arc;

/// An LRU cache holding at most `capacity` bytes.
#[derive(Debug)]
pub struct Lru<V> {
    capacity: u64,
    used: u64,
    clock: u64,
    entries: HashMap<String, Entry<V>>,
}

#[derive(Debug)]
struct Entry<V> {
    value: Arc<V>,
    bytes: u64,
    last_used: u64,
}

impl<V> Lru<V> {
    pub fn new(capacity: u64) -> Self {
        Self {
            capacity,
            used: 0,
            clock: 0,
            entries: HashMap::new(),
        }
    }

    /// Bytes held.
    pub fn used(&self) -> u64 {
        self.used
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn contains(&self, key: &str) -> bool {
        self.entries.contains_key(key)
    }

    /// The entry for `key`, now the most recently used.
    pub fn get(&mut self, key: &str) -> Option<Arc<V>> {
        self.clock += 1;
        let clock = self.clock;
        self.entries.get_mut(key).map(|e| {
            e.last_used = clock;
            Arc::clone(&e.value)
        })
    }

    /// Adds (or replaces) `key`, evicting the least recently used entries until it fits.
    /// Returns the keys evicted, or `None` (nothing changed) when `bytes` is over the capacity.
    pub fn insert(&mut self, key: &str, value: Arc<V>, bytes: u64) -> Option<Vec<String>> {
        if bytes > self.capacity {
            return None;
        }
        self.remove(key);
        let mut evicted = Vec::new();
        while self.used + bytes > self.capacity {
            let Some(oldest) = self
                .entries
                .iter()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            self.remove(&oldest);
            evicted.push(oldest);
        }
        self.clock += 1;
        self.entries.insert(
            key.to_string(),
            Entry {
                value,
                bytes,
                last_used: self.clock,
            },
        );
        self.used += bytes;
        Some(evicted)
    }

    /// Drops `key`; whether it was there.
    pub fn remove(&mut self, key: &str) -> bool {
        match self.entries.remove(key) {
            Some(e) => {
                self.used -= e.bytes;
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_accounted_and_the_least_recently_used_goes_first() {
        let mut c: Lru<u32> = Lru::new(100);
        assert_eq!(c.insert("a", Arc::new(1), 40), Some(vec![]));
        assert_eq!(c.insert("b", Arc::new(2), 40), Some(vec![]));
        assert_eq!(c.used(), 80);
        // Using a makes b the oldest.
        assert_eq!(c.get("a").as_deref(), Some(&1));
        assert_eq!(c.insert("c", Arc::new(3), 40), Some(vec!["b".to_string()]));
        assert!(c.contains("a") && c.contains("c") && !c.contains("b"));
        assert_eq!(c.used(), 80);
        assert!(c.get("b").is_none());
    }

    #[test]
    fn an_entry_over_the_capacity_changes_nothing_and_replacing_reaccounts() {
        let mut c: Lru<u32> = Lru::new(100);
        c.insert("a", Arc::new(1), 60);
        assert_eq!(c.insert("huge", Arc::new(9), 101), None);
        assert!(c.contains("a"));
        assert_eq!(c.used(), 60);
        c.insert("a", Arc::new(2), 30);
        assert_eq!(c.used(), 30);
        assert_eq!(c.len(), 1);
        assert_eq!(c.get("a").as_deref(), Some(&2));
        // One entry needing the whole capacity evicts everything else.
        c.insert("b", Arc::new(3), 50);
        assert_eq!(c.insert("all", Arc::new(4), 100).map(|e| e.len()), Some(2));
        assert_eq!(c.used(), 100);
        assert!(c.remove("all"));
        assert!(!c.remove("all"));
        assert_eq!(c.used(), 0);
        assert!(c.is_empty());
    }

    #[test]
    fn a_zero_capacity_cache_holds_nothing() {
        let mut c: Lru<u32> = Lru::new(0);
        assert_eq!(c.insert("a", Arc::new(1), 1), None);
        assert_eq!(c.capacity(), 0);
        assert!(c.is_empty());
    }
}
