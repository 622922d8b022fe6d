//! Tenants (docs/security.md, "Tenants"): every function belongs to one, named by its spec's
//! `tenant` (`"default"` when torpor.toml names none). A tenant's API token sees and acts on its
//! own functions only ([`Scope`]); what functions share (read-only segment copies, cached
//! segments, base snapshots) is shared within a tenant, never across two.

use serde_json::Value;

/// The tenant of a function whose spec names none (python/torpor/spec.py's `DEFAULT_TENANT`).
pub const DEFAULT_TENANT: &str = "default";

/// Whether `name` is a tenant name: the rule of a function's name too (spec.py's `NAME_RE`,
/// `[a-z0-9][a-z0-9_.-]{0,62}`), which crate::api::is_function_name uses from here, so that this
/// module depends on none of the daemon's.
pub fn is_tenant_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"_.-".contains(c))
}

/// The tenant a stored or validated spec names; a spec without the key (one deployed before
/// tenants existed) belongs to [`DEFAULT_TENANT`].
pub fn of_spec(spec: &Value) -> &str {
    spec.get("tenant")
        .and_then(Value::as_str)
        .unwrap_or(DEFAULT_TENANT)
}

/// What an API caller may see and act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Every function: the Unix socket (root only, by its mode) and the admin token
    /// (`token_file`).
    All,
    /// The functions of one tenant: a token of `tenant_tokens_file`.
    Tenant(String),
}

impl Scope {
    /// Whether a function of `tenant` is visible in this scope.
    pub fn sees(&self, tenant: &str) -> bool {
        match self {
            Scope::All => true,
            Scope::Tenant(t) => t == tenant,
        }
    }

    /// Whether a function with this stored spec is visible in this scope.
    pub fn sees_spec(&self, spec: &Value) -> bool {
        self.sees(of_spec(spec))
    }
}

/// The key under which something shared between the functions of one tenant is kept: `key`
/// itself for the default tenant (so what a node shared before tenants keeps its key), else
/// prefixed with the tenant, so two tenants with the same contents never share one copy.
pub fn scoped_key(tenant: &str, key: &str) -> String {
    if tenant == DEFAULT_TENANT {
        key.to_string()
    } else {
        format!("tenant={tenant}|{key}")
    }
}

/// `tenant` as one path component (a directory of the node, a key prefix in the bucket): the
/// name itself when it is a tenant's name, else a name of its own derived from its hash, so a
/// damaged record's tenant never walks out of its place.
pub fn path_component(tenant: &str) -> String {
    if is_tenant_name(tenant) {
        tenant.to_string()
    } else {
        format!(
            "not-a-tenant-{}",
            &blake3::hash(tenant.as_bytes()).to_hex()[..16]
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_without_a_tenant_is_the_default_ones() {
        assert_eq!(of_spec(&serde_json::json!({"name": "f"})), "default");
        assert_eq!(
            of_spec(&serde_json::json!({"name": "f", "tenant": "a"})),
            "a"
        );
    }

    #[test]
    fn a_tenant_scope_sees_only_its_own() {
        let a = Scope::Tenant("a".into());
        assert!(a.sees("a") && !a.sees("b") && !a.sees("default"));
        assert!(Scope::All.sees("b"));
        assert!(!a.sees_spec(&serde_json::json!({"name": "f"})));
        assert!(Scope::Tenant("default".into()).sees_spec(&serde_json::json!({"name": "f"})));
    }

    #[test]
    fn keys_of_two_tenants_differ_and_the_default_keeps_its_own() {
        assert_eq!(scoped_key("default", "k"), "k");
        assert_ne!(scoped_key("a", "k"), scoped_key("b", "k"));
        assert_ne!(scoped_key("a", "k"), "k");
        // A tenant name cannot hold '|' or '=', so no tenant's key is another's.
        assert!(!is_tenant_name("a|b") && !is_tenant_name("a=b"));
        assert!(is_tenant_name("team-a") && is_tenant_name(DEFAULT_TENANT));
        for bad in ["", "A", "-a", "a/b", "..", &"a".repeat(64)] {
            assert!(!is_tenant_name(bad), "{bad:?}");
        }
    }
}
