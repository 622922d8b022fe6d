//! Reading the CRIU image files a page server needs: `pstree.img` (which tasks a restore sends),
//! `pagemap-<pid>.img` (which pages are where in `pages-<id>.img`, which of them lazy) and
//! `mm-<pid>.img` (the VMAs, since one `UFFDIO_COPY` cannot span two). docs/lazy-pages.md has
//! the format as read in CRIU's source: two `u32` magics, then `u32` length + protobuf entries
//! (images/pstree.proto, pagemap.proto, mm.proto, vma.proto); `pages-*.img` is raw.

use std::fs;
use std::path::{Path, PathBuf};

const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
const PSTREE_MAGIC: u32 = 0x5027_3030;
const PAGEMAP_MAGIC: u32 = 0x5608_4025;
const MM_MAGIC: u32 = 0x5749_2820;

/// criu/include/pagemap.h.
const PE_PARENT: u32 = 1 << 0;
const PE_LAZY: u32 = 1 << 1;
const PE_PRESENT: u32 = 1 << 2;

pub const PAGE_SIZE: u64 = 4096;

/// An image that cannot be read as CRIU writes it.
#[derive(Debug, thiserror::Error)]
pub enum ImageReadError {
    #[error("cannot read CRIU image {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("CRIU image {path} is not what CRIU 4 writes ({why}): the snapshot is damaged or from another CRIU")]
    Format { path: PathBuf, why: String },
}

#[derive(Clone, PartialEq, prost::Message)]
struct PstreeEntry {
    #[prost(uint32, required, tag = "1")]
    pid: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
struct PagemapHead {
    #[prost(uint32, required, tag = "1")]
    pages_id: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
struct PagemapEntry {
    #[prost(uint64, required, tag = "1")]
    vaddr: u64,
    #[prost(uint32, required, tag = "2")]
    compat_nr_pages: u32,
    #[prost(bool, optional, tag = "3")]
    in_parent: Option<bool>,
    #[prost(uint32, optional, tag = "4")]
    flags: Option<u32>,
    #[prost(uint64, optional, tag = "5")]
    nr_pages: Option<u64>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct VmaEntry {
    #[prost(uint64, required, tag = "1")]
    start: u64,
    #[prost(uint64, required, tag = "2")]
    end: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct MmEntry {
    #[prost(message, repeated, tag = "14")]
    vmas: Vec<VmaEntry>,
}

/// The protobuf entries of an image whose second magic is `magic`.
fn entries(path: &Path, magic: u32) -> Result<Vec<Vec<u8>>, ImageReadError> {
    let bytes = fs::read(path).map_err(|source| ImageReadError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let bad = |why: String| ImageReadError::Format {
        path: path.to_path_buf(),
        why,
    };
    let word = |at: usize| -> Option<u32> {
        bytes
            .get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    if word(0) != Some(IMG_COMMON_MAGIC) || word(4) != Some(magic) {
        return Err(bad(format!("magics {:x?} {:x?}", word(0), word(4))));
    }
    let mut out = Vec::new();
    let mut at = 8;
    while at < bytes.len() {
        let len = word(at).ok_or_else(|| bad("a truncated entry length".into()))? as usize;
        let body = bytes
            .get(at + 4..at + 4 + len)
            .ok_or_else(|| bad(format!("an entry of {len} bytes past the end")))?;
        out.push(body.to_vec());
        at += 4 + len;
    }
    Ok(out)
}

fn decode<M: prost::Message + Default>(path: &Path, bytes: &[u8]) -> Result<M, ImageReadError> {
    M::decode(bytes).map_err(|e| ImageReadError::Format {
        path: path.to_path_buf(),
        why: e.to_string(),
    })
}

/// The pids (as in the images) of every task of the tree, in `pstree.img`'s order.
pub fn task_pids(dir: &Path) -> Result<Vec<i32>, ImageReadError> {
    let path = dir.join("pstree.img");
    entries(&path, PSTREE_MAGIC)?
        .iter()
        .map(|e| decode::<PstreeEntry>(&path, e).map(|p| p.pid as i32))
        .collect()
}

/// A run of lazy pages: `[start, end)` in the task, its bytes at `offset` in the pages file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LazyRun {
    pub start: u64,
    pub end: u64,
    pub offset: u64,
}

/// A task's lazy pages: the runs (each inside one VMA, sorted) and the pages file they are in.
#[derive(Debug, Clone)]
pub struct LazyPagesOf {
    pub pages_file: PathBuf,
    pub runs: Vec<LazyRun>,
}

/// Runs sorted by start, each with the index of its VMA, merged where one continues the one
/// before it in the same VMA and in the pages file. CRIU writes a GPU worker's memory as tens of
/// thousands of one-page pagemap entries in a few hundred VMAs (H100: 1 736 VMAs, ~60 000
/// one-page runs for GPT-2-Large); one run per entry made one `UFFDIO_COPY` per page. A run
/// never crosses a VMA: a copy may not.
fn merge_runs(runs: Vec<(usize, LazyRun)>) -> Vec<LazyRun> {
    let mut out: Vec<(usize, LazyRun)> = Vec::with_capacity(runs.len());
    for (v, r) in runs {
        match out.last_mut() {
            Some((lv, last))
                if *lv == v
                    && last.end == r.start
                    && last.offset + (last.end - last.start) == r.offset =>
            {
                last.end = r.end;
            }
            _ => out.push((v, r)),
        }
    }
    out.into_iter().map(|(_, r)| r).collect()
}

/// The lazy pages of task `pid` of the images in `dir`.
pub fn lazy_pages(dir: &Path, pid: i32) -> Result<LazyPagesOf, ImageReadError> {
    let path = dir.join(format!("pagemap-{pid}.img"));
    let all = entries(&path, PAGEMAP_MAGIC)?;
    let (head, rest) = all.split_first().ok_or_else(|| ImageReadError::Format {
        path: path.clone(),
        why: "no pagemap head".into(),
    })?;
    let head: PagemapHead = decode(&path, head)?;
    let mm_path = dir.join(format!("mm-{pid}.img"));
    let mut vmas: Vec<(u64, u64)> = Vec::new();
    for e in entries(&mm_path, MM_MAGIC)? {
        let mm: MmEntry = decode(&mm_path, &e)?;
        vmas.extend(mm.vmas.iter().map(|v| (v.start, v.end)));
    }
    vmas.sort_unstable();
    let mut runs = Vec::new();
    let mut offset = 0u64;
    for e in rest {
        let e: PagemapEntry = decode(&path, e)?;
        let mut flags = e.flags.unwrap_or(PE_PRESENT);
        if e.in_parent == Some(true) {
            flags |= PE_PARENT;
        }
        let pages = e.nr_pages.unwrap_or(u64::from(e.compat_nr_pages));
        let len = pages * PAGE_SIZE;
        if flags & PE_PARENT != 0 {
            return Err(ImageReadError::Format {
                path: path.clone(),
                why: "pages in a parent image (an incremental dump)".into(),
            });
        }
        if flags & PE_PRESENT == 0 {
            continue;
        }
        if flags & PE_LAZY != 0 {
            // Clipped to each VMA it spans (an entry may cross adjacent ones).
            let (begin, end) = (e.vaddr, e.vaddr + len);
            for (v, &(vs, ve)) in vmas
                .iter()
                .enumerate()
                .filter(|(_, (vs, ve))| *vs < end && *ve > begin)
            {
                let (s, t) = (begin.max(vs), end.min(ve));
                if s < t {
                    let run = LazyRun {
                        start: s,
                        end: t,
                        offset: offset + (s - e.vaddr),
                    };
                    runs.push((v, run));
                }
            }
        }
        offset += len;
    }
    runs.sort_unstable_by_key(|(_, r)| r.start);
    Ok(LazyPagesOf {
        pages_file: dir.join(format!("pages-{}.img", head.pages_id)),
        runs: merge_runs(runs),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(start: u64, end: u64, offset: u64) -> LazyRun {
        LazyRun { start, end, offset }
    }

    #[test]
    fn runs_merge_only_within_one_vma_and_where_the_pages_file_continues() {
        let runs = vec![
            (0, run(0x1000, 0x2000, 0)),
            (0, run(0x2000, 0x3000, 0x1000)), // continues: merged
            (0, run(0x3000, 0x4000, 0x5000)), // adjacent, but elsewhere in the file
            (1, run(0x4000, 0x5000, 0x6000)), // continues the file, but another VMA
            (1, run(0x6000, 0x7000, 0x7000)), // a hole before it
        ];
        assert_eq!(
            merge_runs(runs),
            vec![
                run(0x1000, 0x3000, 0),
                run(0x3000, 0x4000, 0x5000),
                run(0x4000, 0x5000, 0x6000),
                run(0x6000, 0x7000, 0x7000),
            ]
        );
    }
}
