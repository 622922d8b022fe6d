//! Typed reading of a TOML table whose errors name the key, e.g.
//! `torpord.toml: queue.length must be an integer ≥ 0, got "many"`.
//!
//! Each getter removes the key it reads; [`Table::finish`] then reports any key left over as
//! unknown, so a misspelt key is an error rather than a silently ignored setting.

use std::time::Duration;

/// A key with a value of the wrong type or range, or a key nobody reads.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{file}: {message}")]
pub struct KeyError {
    /// The file the table was read from, as shown to the user.
    pub file: String,
    /// The dotted key, e.g. `keepalive.evict_s`.
    pub key: String,
    /// The message after the file name; it starts with the key.
    pub message: String,
}

/// One table of a TOML document, with the dotted path that leads to it.
#[derive(Debug)]
pub struct Table {
    file: String,
    prefix: String,
    entries: toml::Table,
}

impl Table {
    /// The document's root table; `file` is how errors name the document.
    pub fn root(file: impl Into<String>, entries: toml::Table) -> Self {
        Self {
            file: file.into(),
            prefix: String::new(),
            entries,
        }
    }

    fn full_key(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.prefix)
        }
    }

    fn error(&self, key: &str, message: String) -> KeyError {
        let key = self.full_key(key);
        KeyError {
            file: self.file.clone(),
            message: format!("{key} {message}"),
            key,
        }
    }

    fn wrong(&self, key: &str, expected: &str, got: &toml::Value) -> KeyError {
        self.error(key, format!("must be {expected}, got {}", describe(got)))
    }

    /// A string.
    pub fn string(&mut self, key: &str) -> Result<Option<String>, KeyError> {
        match self.entries.remove(key) {
            None => Ok(None),
            Some(toml::Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(self.wrong(key, "a string", &other)),
        }
    }

    /// A non-empty string (paths, addresses).
    pub fn nonempty_string(&mut self, key: &str) -> Result<Option<String>, KeyError> {
        match self.string(key)? {
            Some(s) if s.is_empty() => Err(self.error(key, "must not be empty".to_string())),
            other => Ok(other),
        }
    }

    /// A string that `parse` turns into a value; `expected` describes the accepted forms.
    pub fn parsed<T>(
        &mut self,
        key: &str,
        expected: &str,
        parse: impl FnOnce(&str) -> Option<T>,
    ) -> Result<Option<T>, KeyError> {
        match self.entries.remove(key) {
            None => Ok(None),
            Some(toml::Value::String(s)) => match parse(&s) {
                Some(v) => Ok(Some(v)),
                None => Err(self.wrong(key, expected, &toml::Value::String(s))),
            },
            Some(other) => Err(self.wrong(key, expected, &other)),
        }
    }

    /// A boolean.
    pub fn boolean(&mut self, key: &str) -> Result<Option<bool>, KeyError> {
        match self.entries.remove(key) {
            None => Ok(None),
            Some(toml::Value::Boolean(b)) => Ok(Some(b)),
            Some(other) => Err(self.wrong(key, "true or false", &other)),
        }
    }

    /// An integer from `min` to `max`.
    pub fn integer(&mut self, key: &str, min: i64, max: i64) -> Result<Option<i64>, KeyError> {
        let expected = format!("an integer from {min} to {max}");
        match self.entries.remove(key) {
            None => Ok(None),
            Some(toml::Value::Integer(n)) if (min..=max).contains(&n) => Ok(Some(n)),
            Some(other) => Err(self.wrong(key, &expected, &other)),
        }
    }

    /// An integer that `ok` accepts; `expected` says which, as the error shows it.
    pub fn integer_where(
        &mut self,
        key: &str,
        expected: &str,
        ok: impl Fn(i64) -> bool,
    ) -> Result<Option<i64>, KeyError> {
        match self.entries.remove(key) {
            None => Ok(None),
            Some(toml::Value::Integer(n)) if ok(n) => Ok(Some(n)),
            Some(other) => Err(self.wrong(key, expected, &other)),
        }
    }

    /// A number (an integer or a float) that `ok` accepts; `expected` says which.
    pub fn number_where(
        &mut self,
        key: &str,
        expected: &str,
        ok: impl Fn(f64) -> bool,
    ) -> Result<Option<f64>, KeyError> {
        let value = match self.entries.remove(key) {
            None => return Ok(None),
            Some(v) => v,
        };
        let n = match &value {
            toml::Value::Integer(n) => *n as f64,
            toml::Value::Float(f) => *f,
            _ => return Err(self.wrong(key, expected, &value)),
        };
        if n.is_finite() && ok(n) {
            Ok(Some(n))
        } else {
            Err(self.wrong(key, expected, &value))
        }
    }

    /// A duration in seconds: an integer or a float, ≥ 0 (> 0 when `positive`) and ≤ `max`.
    pub fn seconds(
        &mut self,
        key: &str,
        positive: bool,
        max: f64,
    ) -> Result<Option<Duration>, KeyError> {
        let expected = if positive {
            format!("a number of seconds > 0 and ≤ {max}")
        } else {
            format!("a number of seconds from 0 to {max}")
        };
        let value = match self.entries.remove(key) {
            None => return Ok(None),
            Some(v) => v,
        };
        let secs = match &value {
            toml::Value::Integer(n) => *n as f64,
            toml::Value::Float(f) => *f,
            _ => return Err(self.wrong(key, &expected, &value)),
        };
        let low = if positive { secs > 0.0 } else { secs >= 0.0 };
        // NaN fails both comparisons.
        if low && secs <= max {
            Ok(Some(crate::limits::secs(secs)))
        } else {
            Err(self.wrong(key, &expected, &value))
        }
    }

    /// A sub-table (`[name]` or `name = { … }`).
    pub fn table(&mut self, key: &str) -> Result<Option<Table>, KeyError> {
        match self.entries.remove(key) {
            None => Ok(None),
            Some(toml::Value::Table(entries)) => Ok(Some(Table {
                file: self.file.clone(),
                prefix: self.full_key(key),
                entries,
            })),
            Some(other) => Err(self.wrong(key, "a table", &other)),
        }
    }

    /// An error about `key` of this table: `message` follows the dotted key.
    pub fn invalid(&self, key: &str, message: String) -> KeyError {
        self.error(key, message)
    }

    /// Whether the table still holds `key` (not read yet).
    pub fn has(&self, key: &str) -> bool {
        self.entries.contains_key(key)
    }

    /// Fails on the first key (in sorted order) that no getter read.
    pub fn finish(self) -> Result<(), KeyError> {
        match self.entries.keys().min() {
            None => Ok(()),
            Some(key) => Err(self.error(key, "is not a known key".to_string())),
        }
    }
}

/// A value as an error message quotes it.
fn describe(value: &toml::Value) -> String {
    match value {
        toml::Value::String(s) => format!("{s:?}"),
        toml::Value::Integer(n) => n.to_string(),
        toml::Value::Float(f) => format!("{f:?}"),
        toml::Value::Boolean(b) => b.to_string(),
        toml::Value::Datetime(d) => d.to_string(),
        toml::Value::Array(_) => "an array".to_string(),
        toml::Value::Table(_) => "a table".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(text: &str) -> Table {
        Table::root("t.toml", text.parse::<toml::Table>().unwrap())
    }

    #[test]
    fn errors_name_the_dotted_key() {
        let mut t = table("[queue]\nlength = \"many\"\n");
        let mut q = t.table("queue").unwrap().unwrap();
        let err = q.integer("length", 0, 9).unwrap_err();
        assert_eq!(err.key, "queue.length");
        assert_eq!(
            err.to_string(),
            "t.toml: queue.length must be an integer from 0 to 9, got \"many\""
        );
    }

    #[test]
    fn unknown_keys_are_errors() {
        let mut t = table("a = 1\nzz = 2\nb = 3\n");
        assert_eq!(t.integer("a", 0, 1).unwrap(), Some(1));
        let err = t.finish().unwrap_err();
        assert_eq!(err.key, "b");
        assert_eq!(err.to_string(), "t.toml: b is not a known key");
    }

    #[test]
    fn seconds_accept_integers_and_floats_in_range() {
        let mut t = table("a = 2\nb = 0.25\nc = -1\nd = 0\ne = nan\nf = 1e300\ng = 10.5\nh = 10\n");
        assert_eq!(
            t.seconds("a", true, 10.0).unwrap(),
            Some(Duration::from_secs(2))
        );
        assert_eq!(
            t.seconds("b", true, 10.0).unwrap(),
            Some(Duration::from_millis(250))
        );
        assert!(t.seconds("c", false, 10.0).is_err());
        assert!(t.seconds("d", true, 10.0).is_err());
        assert!(t.seconds("e", false, 10.0).is_err());
        let e = t.seconds("f", false, 10.0).unwrap_err();
        assert_eq!(
            e.to_string(),
            "t.toml: f must be a number of seconds from 0 to 10, got 1e300"
        );
        assert!(t.seconds("g", true, 10.0).is_err());
        assert_eq!(
            t.seconds("h", true, 10.0).unwrap(),
            Some(Duration::from_secs(10))
        );
        assert_eq!(t.seconds("missing", false, 10.0).unwrap(), None);
    }

    #[test]
    fn wrong_types_are_described() {
        let mut t = table("a = [1]\nb = true\nc = { x = 1 }\n");
        let e = t.string("a").unwrap_err();
        assert_eq!(e.to_string(), "t.toml: a must be a string, got an array");
        let e = t.seconds("b", false, 1.0).unwrap_err();
        assert!(e.to_string().ends_with("got true"), "{e}");
        let e = t.integer("c", 1, 2).unwrap_err();
        assert!(e.to_string().ends_with("got a table"), "{e}");
    }
}
