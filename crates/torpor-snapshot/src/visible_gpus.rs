//! Which GPUs a CUDA process can see. The driver restores a process onto other GPUs only when
//! given a pair for *every* GPU the process had (one pair out of two visible GPUs is refused with
//! CUDA_ERROR_INVALID_VALUE, measured on 2×H200), so the snapshot records them all.

use std::fs;

use torpor_cuda::GpuDevice;

/// The devices (of `all`, torpor's own view of every GPU) that `pid` can see, from its
/// `CUDA_VISIBLE_DEVICES`: ordinals, UUIDs or UUID prefixes; all of them when unset. Entries
/// that match nothing (MIG instances, typos) are skipped, as CUDA itself stops at them.
pub fn visible_to(pid: i32, all: &[GpuDevice]) -> Vec<GpuDevice> {
    let environ = fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    let setting = environ
        .split(|b| *b == 0)
        .find_map(|kv| kv.strip_prefix(b"CUDA_VISIBLE_DEVICES="))
        .map(|v| String::from_utf8_lossy(v).into_owned());
    match setting {
        None => all.to_vec(),
        Some(list) => select(&list, all),
    }
}

fn select(list: &str, all: &[GpuDevice]) -> Vec<GpuDevice> {
    let mut out: Vec<GpuDevice> = Vec::new();
    for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let found = match entry.parse::<i32>() {
            Ok(ordinal) => all.iter().find(|d| d.ordinal == ordinal),
            Err(_) => {
                let want = entry.to_ascii_lowercase();
                let want = want.strip_prefix("gpu-").unwrap_or(&want);
                all.iter().find(|d| {
                    let uuid = d.uuid.to_string().to_ascii_lowercase();
                    uuid.strip_prefix("gpu-").unwrap_or(&uuid).starts_with(want)
                })
            }
        };
        // CUDA stops enumerating at the first entry it cannot resolve.
        let Some(dev) = found else { break };
        if !out.iter().any(|d| d.uuid == dev.uuid) {
            out.push(dev.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use torpor_cuda::GpuUuid;

    fn dev(ordinal: i32, byte: u8) -> GpuDevice {
        GpuDevice {
            ordinal,
            name: "NVIDIA H200".into(),
            uuid: GpuUuid([byte; 16]),
            total_memory: 1 << 30,
        }
    }

    #[test]
    fn selects_by_ordinal_uuid_and_prefix() {
        let all = [dev(0, 0xaa), dev(1, 0xbb), dev(2, 0xcc)];
        let ords = |v: Vec<GpuDevice>| v.iter().map(|d| d.ordinal).collect::<Vec<_>>();
        assert_eq!(ords(select("2,0", &all)), vec![2, 0]);
        assert_eq!(ords(select("GPU-bbbbbbbb", &all)), vec![1]);
        assert_eq!(
            ords(select(&GpuUuid([0xcc; 16]).to_string(), &all)),
            vec![2]
        );
        assert_eq!(
            ords(select("1,7,0", &all)),
            vec![1],
            "stops at the first unknown entry"
        );
        assert!(select("", &all).is_empty());
    }

    #[test]
    fn own_process_without_the_variable_sees_all() {
        if std::env::var_os("CUDA_VISIBLE_DEVICES").is_none() {
            let all = [dev(0, 1), dev(1, 2)];
            assert_eq!(visible_to(std::process::id() as i32, &all).len(), 2);
        }
    }
}
