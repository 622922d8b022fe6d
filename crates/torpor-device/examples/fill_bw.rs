//! How fast a segment can be filled: host→device (and device→host) copy bandwidth through the
//! `Device` trait, printed as one JSON object.
//!
//! ```text
//! cargo run --release -p torpor-device --example fill_bw -- [cuda|host] [SIZE_MIB] [STREAMS,...] [CHUNK_MIB] [REPEATS]
//! ```
//! Defaults: `cuda 1024 1,2,4,8 8 5`. On cuda each stream count is measured from pinned host
//! memory (`host_buffer`, copied straight), from pageable memory (staged through pinned
//! buffers), and from the pageable memory once pinned in place (`CudaDevice::pin`, whose cost is
//! reported too); on host (memfd) the stream count does not apply and one `memcpy` fill is measured.
//! Each figure is the median and the best of REPEATS copies, in GB/s (10^9 bytes per second).

use std::time::Instant;

use serde_json::{json, Value};
use torpor_device::cuda::{CopyConfig, CudaDevice};
use torpor_device::host::HostDevice;
use torpor_device::{Access, Device, DeviceError};

struct Args {
    backend: String,
    size: usize,
    streams: Vec<usize>,
    chunk: usize,
    repeats: usize,
}

fn parse() -> Result<Args, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |i: usize, default: &str| args.get(i).cloned().unwrap_or_else(|| default.into());
    let number = |text: &str, what: &str| {
        text.parse::<usize>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("{what} `{text}` is not a positive whole number"))
    };
    let backend = get(0, "cuda");
    if backend != "cuda" && backend != "host" {
        return Err(format!("backend `{backend}` is neither cuda nor host"));
    }
    Ok(Args {
        backend,
        size: number(&get(1, "1024"), "SIZE_MIB")? << 20,
        streams: get(2, "1,2,4,8")
            .split(',')
            .map(|s| number(s, "STREAMS"))
            .collect::<Result<_, _>>()?,
        chunk: number(&get(3, "8"), "CHUNK_MIB")? << 20,
        repeats: number(&get(4, "5"), "REPEATS")?,
    })
}

/// Median and best GB/s of `repeats` runs of `copy` over `bytes`.
fn measure(
    bytes: usize,
    repeats: usize,
    mut copy: impl FnMut() -> Result<(), DeviceError>,
) -> Result<Value, DeviceError> {
    copy()?; // warm-up: first-touch and driver set-up costs are not bandwidth
    let mut rates: Vec<f64> = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let start = Instant::now();
        copy()?;
        rates.push(bytes as f64 / start.elapsed().as_secs_f64() / 1e9);
    }
    rates.sort_by(|a, b| a.total_cmp(b));
    Ok(json!({
        "gb_per_s_median": rates[rates.len() / 2],
        "gb_per_s_best": rates[rates.len() - 1],
    }))
}

/// A mapped segment of `size` bytes (rounded up to the granularity) on `device`.
fn segment<D: Device>(device: &D, size: usize) -> Result<(u64, usize, D::Memory), DeviceError> {
    let len = size.next_multiple_of(device.granularity());
    let at = device.reserve(len, None)?;
    let memory = device.create(len)?;
    device.map(&memory, at, Access::ReadWrite)?;
    Ok((at, len, memory))
}

fn cuda(args: &Args) -> Result<Value, DeviceError> {
    let mut results = Vec::new();
    let mut name = String::new();
    for &streams in &args.streams {
        let config = CopyConfig {
            streams,
            chunk: args.chunk,
        };
        let device = CudaDevice::open_with(torpor_cuda::CudaDriver::load()?, 0, config)?;
        if name.is_empty() {
            name = device
                .driver()
                .devices()?
                .first()
                .map(|g| g.name.clone())
                .unwrap_or_default();
        }
        let (at, len, memory) = segment(&device, args.size)?;
        let mut pinned = device.host_buffer(len)?;
        pinned
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = i as u8);
        let mut pageable = vec![0u8; len];
        pageable.copy_from_slice(&pinned);

        let h2d_pinned = measure(len, args.repeats, || device.copy_to_device(at, &pinned))?;
        let d2h_pinned = measure(len, args.repeats, || device.copy_to_host(at, &mut pinned))?;
        let h2d_staged = measure(len, args.repeats, || device.copy_to_device(at, &pageable))?;
        let d2h_staged = measure(len, args.repeats, || device.copy_to_host(at, &mut pageable))?;
        let start = Instant::now();
        let region = device.pin(&mut pageable)?;
        let pin_seconds = start.elapsed().as_secs_f64();
        let h2d_registered = measure(len, args.repeats, || device.copy_to_device(at, &region))?;
        drop(region);
        results.push(json!({
            "streams": streams,
            "h2d_pinned": h2d_pinned,
            "d2h_pinned": d2h_pinned,
            "h2d_staged_from_pageable": h2d_staged,
            "d2h_staged_to_pageable": d2h_staged,
            "pin_in_place_seconds": pin_seconds,
            "h2d_pinned_in_place": h2d_registered,
        }));
        device.release(at, memory)?;
        device.free_reservation(at, len)?;
    }
    Ok(json!({
        "backend": "cuda",
        "gpu": name,
        "size_bytes": args.size,
        "chunk_bytes": args.chunk,
        "repeats": args.repeats,
        "results": results,
    }))
}

fn host(args: &Args) -> Result<Value, DeviceError> {
    let device = HostDevice::new();
    let (at, len, memory) = segment(&device, args.size)?;
    let source: Vec<u8> = (0..len).map(|i| i as u8).collect();
    let fill = measure(len, args.repeats, || device.copy_to_device(at, &source))?;
    device.release(at, memory)?;
    device.free_reservation(at, len)?;
    Ok(json!({
        "backend": "host",
        "size_bytes": args.size,
        "repeats": args.repeats,
        "memfd_fill": fill,
    }))
}

fn main() {
    let args = parse().unwrap_or_else(|e| {
        eprintln!("fill_bw: {e}; usage: fill_bw [cuda|host] [SIZE_MIB] [STREAMS,...] [CHUNK_MIB] [REPEATS]");
        std::process::exit(2)
    });
    let result = if args.backend == "cuda" {
        cuda(&args)
    } else {
        host(&args)
    };
    match result {
        Ok(value) => println!("{value}"),
        Err(e) => {
            eprintln!("fill_bw: {e}");
            std::process::exit(1)
        }
    }
}
