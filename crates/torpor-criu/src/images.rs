//! Reading the CRIU image files a page server needs: `pstree.img` (which tasks a restore sends),
//! `pagemap-<pid>.img` (which pages are where in `pages-<id>.img`, which of them lazy) and
//! `mm-<pid>.img` (the VMAs, since one `UFFDIO_COPY` cannot span two). docs/lazy-pages.md has
//! the format as read in CRIU's source: two `u32` magics, then `u32` length + protobuf entries
//! (images/pstree.proto, pagemap.proto, mm.proto, vma.proto); `pages-*.img` is raw. With
//! `files.img` (images/fdinfo.proto, regfile.proto) they also tell which pages of which mapped
//! files a restore reads ([`private_file_pages`]).

use std::fs;
use std::path::{Path, PathBuf};

const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
const PSTREE_MAGIC: u32 = 0x5027_3030;
const PAGEMAP_MAGIC: u32 = 0x5608_4025;
const MM_MAGIC: u32 = 0x5749_2820;
const FILES_MAGIC: u32 = 0x5630_3138;

/// criu/include/image.h: a private mapping of a file.
const VMA_FILE_PRIVATE: u32 = 1 << 6;
/// images/fdinfo.proto, `fd_types`: a regular file.
const FD_TYPE_REG: i32 = 1;

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
    /// The file offset of `start`, in bytes (as /proc/PID/maps shows it).
    #[prost(uint64, optional, tag = "3")]
    pgoff: Option<u64>,
    /// For a file mapping, the file's id in `files.img`.
    #[prost(uint64, optional, tag = "4")]
    shmid: Option<u64>,
    #[prost(uint32, optional, tag = "7")]
    status: Option<u32>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RegFileEntry {
    /// The path, as the dumped tree saw it.
    #[prost(string, optional, tag = "6")]
    name: Option<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct FileEntry {
    #[prost(int32, optional, tag = "1")]
    kind: Option<i32>,
    #[prost(uint32, optional, tag = "2")]
    id: Option<u32>,
    #[prost(message, optional, tag = "3")]
    reg: Option<RegFileEntry>,
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

/// The pages of one mapped file that a restore of the images reads from it: `ranges` are
/// `(offset, len)` in bytes, sorted, more than 128 KiB apart (closer ones are merged).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilePages {
    /// The path as the dumped tree saw it (absolute).
    pub path: String,
    pub ranges: Vec<(u64, u64)>,
}

/// Ranges closer than this are read as one: the pages between cost less than another request.
const MERGE_GAP: u64 = 128 * 1024;

/// Which pages of which files CRIU's restore of the images in `dir` reads: those under every
/// saved page of a private file mapping (a library's relocated data, a patched page of code).
/// CRIU maps the file and writes the saved page over it, so the kernel first reads the file's
/// page, one synchronous fault at a time; after a dropped page cache these reads were most of a
/// GPU worker's CPU restore (H200: 1.0 of 1.8 s, `bench/coldstart/criu_log_gaps.py`). Lazy pages
/// are never file pages, so they are not counted. Files are named as in `files.img`.
pub fn private_file_pages(dir: &Path) -> Result<Vec<FilePages>, ImageReadError> {
    use std::collections::BTreeMap;
    let files_path = dir.join("files.img");
    let mut names: std::collections::HashMap<u64, String> = std::collections::HashMap::new();
    for e in entries(&files_path, FILES_MAGIC)? {
        let f: FileEntry = decode(&files_path, &e)?;
        if let (Some(FD_TYPE_REG), Some(id), Some(name)) =
            (f.kind, f.id, f.reg.and_then(|r| r.name))
        {
            names.insert(u64::from(id), name);
        }
    }
    let mut by_file: BTreeMap<String, Vec<(u64, u64)>> = BTreeMap::new();
    for pid in task_pids(dir)? {
        let mm_path = dir.join(format!("mm-{pid}.img"));
        // (start, end, file offset of start, file id), sorted by start.
        let mut vmas: Vec<(u64, u64, u64, u64)> = Vec::new();
        for e in entries(&mm_path, MM_MAGIC)? {
            let mm: MmEntry = decode(&mm_path, &e)?;
            vmas.extend(
                mm.vmas
                    .iter()
                    .filter(|v| v.status.unwrap_or(0) & VMA_FILE_PRIVATE != 0)
                    .filter_map(|v| Some((v.start, v.end, v.pgoff.unwrap_or(0), v.shmid?))),
            );
        }
        if vmas.is_empty() {
            continue;
        }
        vmas.sort_unstable();
        let path = dir.join(format!("pagemap-{pid}.img"));
        let all = entries(&path, PAGEMAP_MAGIC)?;
        for raw in all.iter().skip(1) {
            let e: PagemapEntry = decode(&path, raw)?;
            let flags = e.flags.unwrap_or(PE_PRESENT);
            if flags & PE_PRESENT == 0 || flags & PE_LAZY != 0 || e.in_parent == Some(true) {
                continue;
            }
            let pages = e.nr_pages.unwrap_or(u64::from(e.compat_nr_pages));
            let (begin, end) = (e.vaddr, e.vaddr.saturating_add(pages * PAGE_SIZE));
            // The VMAs that may hold [begin, end): from the last one starting at or before it.
            let first = vmas.partition_point(|v| v.0 <= begin).saturating_sub(1);
            for &(vs, ve, pgoff, id) in vmas[first..].iter().take_while(|v| v.0 < end) {
                let (s, t) = (begin.max(vs), end.min(ve));
                if s >= t {
                    continue;
                }
                if let Some(name) = names.get(&id) {
                    by_file
                        .entry(name.clone())
                        .or_default()
                        .push((pgoff + (s - vs), t - s));
                }
            }
        }
    }
    Ok(by_file
        .into_iter()
        .map(|(name, mut ranges)| {
            ranges.sort_unstable();
            let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
            for (off, len) in ranges {
                match merged.last_mut() {
                    Some((o, l)) if off <= *o + *l + MERGE_GAP => {
                        *l = (*l).max(off + len - *o);
                    }
                    _ => merged.push((off, len)),
                }
            }
            let path = if name.starts_with('/') {
                name
            } else {
                format!("/{name}")
            };
            FilePages {
                path,
                ranges: merged,
            }
        })
        .collect())
}

/// What [`flatten`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Flattened {
    /// Pagemap images rewritten.
    pub pagemaps: usize,
    /// Pages copied in from the parent images.
    pub pages_from_parents: u64,
}

/// The name of the link CRIU puts in a dump taken with a parent (`--prev-images-dir`).
pub const PARENT_LINK: &str = "parent";

/// One pagemap of one image directory of a chain: its entries (sorted by address) with their
/// offsets in its pages file.
struct Level {
    pages: fs::File,
    pages_path: PathBuf,
    /// (vaddr, pages, flags, offset in the pages file)
    entries: Vec<(u64, u64, u32, u64)>,
}

fn read_level(dir: &Path, name: &str) -> Result<Option<(Level, Vec<u8>)>, ImageReadError> {
    let path = dir.join(name);
    if !path.exists() {
        return Ok(None);
    }
    let all = entries(&path, PAGEMAP_MAGIC)?;
    let (head_bytes, rest) = all.split_first().ok_or_else(|| ImageReadError::Format {
        path: path.clone(),
        why: "no pagemap head".into(),
    })?;
    let head: PagemapHead = decode(&path, head_bytes)?;
    let pages_path = dir.join(format!("pages-{}.img", head.pages_id));
    let pages = fs::File::open(&pages_path).map_err(|source| ImageReadError::Io {
        path: pages_path.clone(),
        source,
    })?;
    let mut list = Vec::with_capacity(rest.len());
    let mut offset = 0u64;
    for e in rest {
        let e: PagemapEntry = decode(&path, e)?;
        let flags = e.flags.unwrap_or(PE_PRESENT) | u32::from(e.in_parent == Some(true));
        let n = e.nr_pages.unwrap_or(u64::from(e.compat_nr_pages));
        list.push((e.vaddr, n, flags, offset));
        if flags & PE_PRESENT != 0 && flags & PE_PARENT == 0 {
            offset += n * PAGE_SIZE;
        }
    }
    list.sort_unstable_by_key(|e| e.0);
    Ok(Some((
        Level {
            pages,
            pages_path,
            entries: list,
        },
        head_bytes.clone(),
    )))
}

/// Where the page at `vaddr` is stored: (level, offset in that level's pages file), found down
/// the chain from `level`.
fn resolve(
    levels: &[Level],
    level: usize,
    vaddr: u64,
    path: &Path,
) -> Result<(usize, u64), ImageReadError> {
    let missing = || ImageReadError::Format {
        path: path.to_path_buf(),
        why: format!("the page at {vaddr:#x} is in no parent image"),
    };
    let l = levels.get(level).ok_or_else(missing)?;
    let i = l.entries.partition_point(|e| e.0 <= vaddr);
    let &(start, n, flags, offset) = i
        .checked_sub(1)
        .and_then(|i| l.entries.get(i))
        .ok_or_else(missing)?;
    if vaddr >= start + n * PAGE_SIZE {
        return Err(missing());
    }
    if flags & PE_PARENT != 0 {
        resolve(levels, level + 1, vaddr, path)
    } else if flags & PE_PRESENT != 0 {
        Ok((level, offset + (vaddr - start)))
    } else {
        Err(missing())
    }
}

/// Makes the images in `dir`, a dump taken with a parent (pre-dump rounds, `--prev-images-dir`),
/// self-contained: every page its pagemaps record as "in parent" is copied from the chain of
/// parents into its own pages files (in pagemap order, as CRIU reads them), the pagemaps say
/// they are present, and the `parent` link is removed. A dump without a parent is left as it
/// is. The parents are only read.
pub fn flatten(dir: &Path) -> Result<Flattened, ImageReadError> {
    use std::io::Write;
    use std::os::unix::fs::FileExt;
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ImageReadError::Io { path, source }
    };
    let link = dir.join(PARENT_LINK);
    if fs::symlink_metadata(&link).is_err() {
        return Ok(Flattened::default());
    }
    // The chain of image directories, this one first.
    let mut chain = vec![dir.to_path_buf()];
    while let Ok(target) = fs::read_link(chain[chain.len() - 1].join(PARENT_LINK)) {
        let last = &chain[chain.len() - 1];
        chain.push(last.join(target));
        if chain.len() > 64 {
            return Err(ImageReadError::Format {
                path: dir.to_path_buf(),
                why: "a chain of more than 64 parent images".into(),
            });
        }
    }
    let mut names: Vec<String> = fs::read_dir(dir)
        .map_err(io(dir))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("pagemap-") && n.ends_with(".img"))
        .collect();
    names.sort();
    let mut done = Flattened::default();
    for name in names {
        let path = dir.join(&name);
        let mut levels = Vec::new();
        let mut head = Vec::new();
        for (i, d) in chain.iter().enumerate() {
            match read_level(d, &name)? {
                Some((level, h)) => {
                    if i == 0 {
                        head = h;
                    }
                    levels.push(level);
                }
                None if i == 0 => unreachable!("listed above"),
                None => break,
            }
        }
        // The entries in file order (CRIU writes them sorted by address).
        let all = entries(&path, PAGEMAP_MAGIC)?;
        let needs = levels[0].entries.iter().any(|e| e.2 & PE_PARENT != 0);
        if !needs {
            done.pagemaps += 1;
            continue;
        }
        let new_pages_path = levels[0].pages_path.with_extension("img.flat");
        let mut out = std::io::BufWriter::new(
            fs::File::create(&new_pages_path).map_err(io(&new_pages_path))?,
        );
        let mut buf = Vec::new();
        let mut copy =
            |levels: &[Level], level: usize, offset: u64, len: u64| -> Result<(), ImageReadError> {
                buf.resize(len as usize, 0);
                let l = &levels[level];
                l.pages
                    .read_exact_at(&mut buf, offset)
                    .map_err(io(&l.pages_path))?;
                out.write_all(&buf).map_err(io(&new_pages_path))
            };
        let mut map = Vec::new();
        map.extend_from_slice(&IMG_COMMON_MAGIC.to_le_bytes());
        map.extend_from_slice(&PAGEMAP_MAGIC.to_le_bytes());
        let push = |map: &mut Vec<u8>, bytes: &[u8]| {
            map.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
            map.extend_from_slice(bytes);
        };
        push(&mut map, &head);
        for raw in &all[1..] {
            let mut e: PagemapEntry = decode(&path, raw)?;
            let mut flags = e.flags.unwrap_or(PE_PRESENT);
            if e.in_parent == Some(true) {
                flags |= PE_PARENT;
            }
            let n = e.nr_pages.unwrap_or(u64::from(e.compat_nr_pages));
            if flags & PE_PARENT != 0 {
                // Page by page down the chain, consecutive pages of one file read at once.
                let mut run: Option<(usize, u64, u64)> = None;
                for p in 0..n {
                    let (level, offset) = resolve(&levels, 1, e.vaddr + p * PAGE_SIZE, &path)?;
                    run = match run {
                        Some((l, o, len)) if l == level && o + len == offset => {
                            Some((l, o, len + PAGE_SIZE))
                        }
                        Some((l, o, len)) => {
                            copy(&levels, l, o, len)?;
                            Some((level, offset, PAGE_SIZE))
                        }
                        None => Some((level, offset, PAGE_SIZE)),
                    };
                }
                if let Some((l, o, len)) = run {
                    copy(&levels, l, o, len)?;
                }
                done.pages_from_parents += n;
                e.in_parent = None;
                e.flags = Some((flags & !PE_PARENT) | PE_PRESENT);
            } else if flags & PE_PRESENT != 0 {
                let (_, _, _, offset) = *levels[0]
                    .entries
                    .iter()
                    .find(|x| x.0 == e.vaddr)
                    .expect("every entry was read");
                copy(&levels, 0, offset, n * PAGE_SIZE)?;
            }
            push(&mut map, &prost::Message::encode_to_vec(&e));
        }
        out.into_inner()
            .map_err(|e| ImageReadError::Io {
                path: new_pages_path.clone(),
                source: e.into_error(),
            })?
            .sync_all()
            .map_err(io(&new_pages_path))?;
        let new_map_path = path.with_extension("img.flat");
        fs::write(&new_map_path, &map).map_err(io(&new_map_path))?;
        fs::rename(&new_pages_path, &levels[0].pages_path).map_err(io(&levels[0].pages_path))?;
        fs::rename(&new_map_path, &path).map_err(io(&path))?;
        done.pagemaps += 1;
    }
    fs::remove_file(&link).map_err(io(&link))?;
    Ok(done)
}

#[cfg(test)]
mod flatten_tests {
    use super::*;

    fn write_image(path: &Path, pages_id: u32, list: &[(u64, u64, u32)]) {
        let mut map = Vec::new();
        map.extend_from_slice(&IMG_COMMON_MAGIC.to_le_bytes());
        map.extend_from_slice(&PAGEMAP_MAGIC.to_le_bytes());
        let mut push = |bytes: Vec<u8>| {
            map.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
            map.extend_from_slice(&bytes);
        };
        push(prost::Message::encode_to_vec(&PagemapHead { pages_id }));
        for &(vaddr, n, flags) in list {
            push(prost::Message::encode_to_vec(&PagemapEntry {
                vaddr,
                compat_nr_pages: n as u32,
                in_parent: None,
                flags: Some(flags),
                nr_pages: Some(n),
            }));
        }
        fs::write(path, map).expect("write pagemap");
    }

    fn page(tag: u8) -> Vec<u8> {
        vec![tag; PAGE_SIZE as usize]
    }

    /// Three levels: the grandparent has pages A B C D at 0x10000.., the parent re-dumped B
    /// (now b) and keeps the rest in its parent, the final dump re-dumped D (now d) and keeps
    /// the rest in the parents. Flattened, the final dump holds A b C d itself.
    #[test]
    fn pages_in_parents_are_copied_in_and_the_link_removed() {
        let root = tempfile::tempdir().expect("tempdir");
        let (g, p, f) = (
            root.path().join("1"),
            root.path().join("2"),
            root.path().join("final"),
        );
        for d in [&g, &p, &f] {
            fs::create_dir(d).expect("mkdir");
        }
        let base = 0x10000u64;
        write_image(&g.join("pagemap-7.img"), 1, &[(base, 4, PE_PRESENT)]);
        fs::write(
            g.join("pages-1.img"),
            [page(b'A'), page(b'B'), page(b'C'), page(b'D')].concat(),
        )
        .expect("w");
        write_image(
            &p.join("pagemap-7.img"),
            1,
            &[
                (base, 1, PE_PARENT),
                (base + PAGE_SIZE, 1, PE_PRESENT),
                (base + 2 * PAGE_SIZE, 2, PE_PARENT),
            ],
        );
        fs::write(p.join("pages-1.img"), page(b'b')).expect("w");
        std::os::unix::fs::symlink("../1", p.join(PARENT_LINK)).expect("link");
        write_image(
            &f.join("pagemap-7.img"),
            3,
            &[
                (base, 3, PE_PARENT),
                (base + 3 * PAGE_SIZE, 1, PE_PRESENT),
                (0x90000, 1, PE_PRESENT | PE_LAZY),
            ],
        );
        fs::write(f.join("pages-3.img"), [page(b'd'), page(b'z')].concat()).expect("w");
        std::os::unix::fs::symlink("../2", f.join(PARENT_LINK)).expect("link");

        let done = flatten(&f).expect("flatten");
        assert_eq!(
            done,
            Flattened {
                pagemaps: 1,
                pages_from_parents: 3
            }
        );
        assert!(
            fs::symlink_metadata(f.join(PARENT_LINK)).is_err(),
            "the parent link is gone"
        );
        let pages = fs::read(f.join("pages-3.img")).expect("read");
        assert_eq!(
            pages,
            [page(b'A'), page(b'b'), page(b'C'), page(b'd'), page(b'z')].concat()
        );
        // Every entry is now present here; the lazy one stays lazy.
        let (level, _) = read_level(&f, "pagemap-7.img")
            .expect("read")
            .expect("there");
        let flags: Vec<u32> = level.entries.iter().map(|e| e.2).collect();
        assert_eq!(flags, [PE_PRESENT, PE_PRESENT, PE_PRESENT | PE_LAZY]);
        // Flattening again is a no-op.
        assert_eq!(flatten(&f).expect("again"), Flattened::default());
        // A page no parent holds is an error, not a hole.
        fs::write(f.join("pages-3.img"), page(b'x')).expect("w");
        write_image(&f.join("pagemap-7.img"), 3, &[(0x500000, 1, PE_PARENT)]);
        std::os::unix::fs::symlink("../2", f.join(PARENT_LINK)).expect("link");
        assert!(matches!(flatten(&f), Err(ImageReadError::Format { .. })));
    }
}

#[cfg(test)]
mod run_merge_tests {
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
