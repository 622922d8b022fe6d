//! The user a tenant's workers run as (docs/security.md, "Unprivileged workers"): uid and gid
//! `workers.uid_base + N`, N the tenant's number in the registry (given when the tenant is first
//! seen, never reused). No `/etc/passwd` entry is needed or made: the kernel knows users by
//! number only, and nothing of a worker's looks its user up by name (`USER` and `LOGNAME` are set
//! to `torpor-UID`).

use torpor_snapshot::launch::User;

use crate::config::WorkerUsers;
use crate::registry::{Registry, RegistryError};

/// Why a tenant's workers have no user.
#[derive(Debug, thiserror::Error)]
pub enum UserError {
    /// More tenants than `workers.uid_count` allows.
    #[error(
        "tenant {tenant:?} is tenant number {number} of this node, and workers.uid_count = \
         {count} allows numbers below {count} only: raise workers.uid_count in torpord's config"
    )]
    TooManyTenants {
        tenant: String,
        number: u32,
        count: u32,
    },
    /// The registry could not give the tenant its number.
    #[error("cannot record the number of tenant {tenant:?} in the registry: {source}")]
    Registry {
        tenant: String,
        #[source]
        source: Box<RegistryError>,
    },
}

/// The user of `tenant`'s workers; `None` when workers run as root (`workers.unprivileged =
/// false`).
pub fn of_tenant(
    registry: &Registry,
    config: &WorkerUsers,
    tenant: &str,
) -> Result<Option<User>, UserError> {
    if !config.unprivileged {
        return Ok(None);
    }
    let number = registry
        .with(|s| s.tenant_number(tenant))
        .map_err(|source| UserError::Registry {
            tenant: tenant.to_string(),
            source: Box::new(source),
        })?;
    if number >= config.uid_count {
        return Err(UserError::TooManyTenants {
            tenant: tenant.to_string(),
            number,
            count: config.uid_count,
        });
    }
    let id = config.uid_base + number;
    Ok(Some(User { uid: id, gid: id }))
}

/// The NVIDIA device files (`/dev/nvidia*`, character devices) an unprivileged worker could
/// not open for reading and writing (their mode leaves others out): each as one line saying
/// so and how to fix it. The CUDA driver opens `/dev/nvidiactl`, `/dev/nvidia-uvm` and
/// `/dev/nvidiaN` as the process's user; the driver makes them 0666 unless told otherwise
/// (`NVreg_DeviceFileMode`), and torpord changes nothing about them.
pub fn unusable_gpu_devices(dev: &std::path::Path) -> Vec<String> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let Ok(entries) = std::fs::read_dir(dev) else {
        return Vec::new();
    };
    let mut out: Vec<String> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("nvidia"))
        .filter_map(|e| {
            let meta = e.metadata().ok()?;
            let mode = meta.permissions().mode() & 0o7777;
            (meta.file_type().is_char_device() && mode & 0o006 != 0o006).then(|| {
                format!(
                    "{} is mode {mode:o}: unprivileged workers (workers.unprivileged) cannot \
                     open it, so GPU functions fail in cuInit; make the NVIDIA device files \
                     0666 (the driver's default, NVreg_DeviceFileMode=0666) or set \
                     workers.unprivileged = false",
                    e.path().display()
                )
            })
        })
        .collect();
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_tenant_keeps_its_own_user_and_the_range_is_enforced() {
        let dir = tempfile::tempdir().unwrap();
        let reg = Registry::open(&dir.path().join("r.db")).unwrap();
        let cfg = WorkerUsers {
            unprivileged: true,
            uid_base: 5000,
            uid_count: 2,
        };
        let a = of_tenant(&reg, &cfg, "a").unwrap().unwrap();
        let b = of_tenant(&reg, &cfg, "b").unwrap().unwrap();
        assert_eq!((a.uid, a.gid, b.uid), (5000, 5000, 5001));
        assert_eq!(of_tenant(&reg, &cfg, "a").unwrap(), Some(a));
        let e = of_tenant(&reg, &cfg, "c").unwrap_err().to_string();
        assert!(e.contains("workers.uid_count = 2"), "{e}");
        drop(reg);
        let reg = Registry::open(&dir.path().join("r.db")).unwrap();
        assert_eq!(of_tenant(&reg, &cfg, "b").unwrap(), Some(b));
        let root = WorkerUsers {
            unprivileged: false,
            ..cfg
        };
        assert_eq!(of_tenant(&reg, &root, "a").unwrap(), None);
    }

    #[test]
    fn gpu_device_files_others_cannot_open_are_named() {
        use std::os::unix::fs::PermissionsExt;
        let dev = tempfile::tempdir().unwrap();
        let node = |name: &str, mode: u32| {
            let path = std::ffi::CString::new(dev.path().join(name).to_str().unwrap()).unwrap();
            // SAFETY: makes a character device file (1:3, what /dev/null is) in our temp dir.
            let rc =
                unsafe { libc::mknod(path.as_ptr(), libc::S_IFCHR | 0o600, libc::makedev(1, 3)) };
            if rc == 0 {
                std::fs::set_permissions(dev.path().join(name), PermissionsExt::from_mode(mode))
                    .unwrap();
            }
            rc == 0
        };
        if !(node("nvidiactl", 0o666) && node("nvidia0", 0o660) && node("null", 0o600)) {
            return; // not root: mknod refused
        }
        std::fs::write(dev.path().join("nvidia-caps"), b"").unwrap();
        let lines = unusable_gpu_devices(dev.path());
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].contains("nvidia0 is mode 660") && lines[0].contains("0666"),
            "{lines:?}"
        );
    }
}
