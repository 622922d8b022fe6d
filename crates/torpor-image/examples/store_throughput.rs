//! Throughput of the chunk store on this machine: store a segment, read it back into a buffer,
//! materialise it into a file. Numbers for people, not a test.
//!
//! cargo run --release -p torpor-image --example store_throughput -- STORE_DIR [MIB=1024] [raw]
//!
//! `raw` stores without trying zstd.
//! The segment is incompressible (like weights) and stored twice: with zstd tried (and kept raw,
//! as it does not pay) and as a second snapshot, which only hashes and finds every chunk present.

use std::path::Path;
use std::time::Instant;

use torpor_image::store::{ChunkStore, Compression};

fn rate(bytes: usize, start: Instant) -> String {
    let s = start.elapsed().as_secs_f64();
    format!("{:7.3} s  {:6.2} GB/s", s, bytes as f64 / s / 1e9)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let root = args
        .next()
        .ok_or("usage: store_throughput STORE_DIR [MIB]")?;
    let mib: usize = args.next().map(|m| m.parse()).transpose()?.unwrap_or(1024);
    let mut store = ChunkStore::open(Path::new(&root))?;
    if args.next().as_deref() == Some("raw") {
        store = store.with_compression(Compression::None);
    }
    let mut data = vec![0u8; mib << 20];
    blake3::Hasher::new()
        .update(b"weights")
        .finalize_xof()
        .fill(&mut data);

    let start = Instant::now();
    let mut writer = store.writer()?;
    let recipe = writer.put_bytes("segment", &data)?;
    writer.commit("throughput-1", std::slice::from_ref(&recipe))?;
    println!("put + commit (new)     {}", rate(data.len(), start));

    let start = Instant::now();
    let mut writer = store.writer()?;
    let again = writer.put_bytes("segment", &data)?;
    writer.commit("throughput-2", &[again])?;
    println!("put + commit (dedup)   {}", rate(data.len(), start));

    let mut buf = vec![0u8; data.len()];
    let start = Instant::now();
    store.read_into(&recipe, &mut buf)?;
    println!("read_into              {}", rate(data.len(), start));
    assert!(buf == data);

    let dest = Path::new(&root).join("materialised");
    let _ = std::fs::remove_file(&dest);
    let start = Instant::now();
    store.materialise(&recipe, &dest)?;
    println!("materialise            {}", rate(data.len(), start));
    std::fs::remove_file(&dest)?;

    store.release("throughput-1")?;
    store.release("throughput-2")?;
    let report = store.gc()?;
    println!(
        "gc: {} chunks, {} bytes freed",
        report.deleted_chunks, report.freed_bytes
    );
    Ok(())
}
