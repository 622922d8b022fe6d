"""What the CUDA driver's checkpoint of a split worker holds, and what shrinks it.

    python3 bench/coldstart/residue.py [--models ctx,gpt2-large] [--variants base,stack0,...] --out FILE
    python3 bench/coldstart/residue.py --table FILE   # the Markdown docs/split.md quotes

The split path takes every big buffer out of a worker (the device-memory hook's segments) before
the snapshot; what the driver's checkpoint still moves into the process — the *residue* — is then
copied by CRIU and restored by the driver on every cold start. This probe measures it without
CRIU, on the GPU machine: a child process builds the model with the hook preloaded, answers one
request (logits digest), applies a variant at the quiet point, hands its segments' fds to the
parent (as the worker hands them to torpord) and releases them; the parent then takes the driver
checkpoint (cuCheckpointProcessLock/Checkpoint), reads how much anonymous memory the process
grew by, restores in place (cuCheckpointProcessRestore/Unlock), hands the fds back, and the child
maps its segments again and answers the same request: the digest must not change.

Per variant: NVML's per-process memory before the checkpoint and after the restore, PyTorch's
allocated/reserved bytes, the hook's segment bytes, the residue (RssAnon growth at checkpoint),
checkpoint/restore/unlock times, the first request's time after the restore, and the digest.

Variants (applied at the quiet point, after the request, in the child):
  base      nothing
  empty     torch.cuda.empty_cache()
  stack0    cuCtxSetLimit(CU_LIMIT_STACK_SIZE, 0): the per-thread stack the context reserves for
            every resident thread; the driver grows it again when a kernel needs more
  limits    stack0 plus the printf FIFO and the device malloc heap at their smallest
  all       limits plus empty

Page sizes of the residue (`--pages`, the parent's side; issue 9 asks why the driver restores a
lazily served residue 0.1 s slower than a copied one, docs/lazy-pages.md):
  as-is         the node's THP mode as it is
  4k            THP `never` while the driver checkpoints: the residue in 4 KiB pages, as
                Torpor's page server leaves it (UFFDIO_COPY installs small pages only)
  4k-collapse   4k, then process_madvise(MADV_COLLAPSE) over the residue's mappings before
                the restore (timed as `collapse_s`): what collapsing the hot set would buy
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

Json = dict[str, Any]

MODELS = ("ctx", "gpt2-large")
VARIANTS = ("base", "empty", "stack0", "limits", "all")
CU_LIMIT_STACK_SIZE, CU_LIMIT_PRINTF_FIFO_SIZE, CU_LIMIT_MALLOC_HEAP_SIZE = 0, 1, 2


class _LockArgs(ctypes.Structure):
    _fields_ = [("timeout_ms", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class _Args64(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


def _cuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"{what}: CUDA error {rc} ({(name.value or b'?').decode()})")


def _limits(lib: ctypes.CDLL) -> Json:
    out: Json = {}
    for name, which in (("stack", CU_LIMIT_STACK_SIZE), ("printf_fifo", CU_LIMIT_PRINTF_FIFO_SIZE), ("malloc_heap", CU_LIMIT_MALLOC_HEAP_SIZE)):
        v = ctypes.c_size_t()
        rc = lib.cuCtxGetLimit(ctypes.byref(v), which)
        out[name] = v.value if rc == 0 else f"error {rc}"
    return out


def _set_limit(lib: ctypes.CDLL, which: int, value: int) -> str:
    rc = lib.cuCtxSetLimit(which, ctypes.c_size_t(value))
    return "ok" if rc == 0 else f"error {rc}"


def _rss_anon(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def _anon_huge(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def _anon_vmas(pid: int) -> set[tuple[int, int]]:
    """The private anonymous mappings of `pid` (no path), as (start, end)."""
    out: set[tuple[int, int]] = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        f = line.split()
        if len(f) == 5 and f[1][3] == "p":
            a, b = f[0].split("-")
            out.add((int(a, 16), int(b, 16)))
    return out


THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
SYS_PROCESS_MADVISE, MADV_COLLAPSE, HPAGE = 440, 25, 2 << 20


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _thp_mode() -> str:
    text = THP_ENABLED.read_text()
    return text[text.index("[") + 1 : text.index("]")]


def _collapse(pid: int, ranges: list[tuple[int, int]]) -> Json:
    """process_madvise(MADV_COLLAPSE) over each range's whole 2 MiB windows; per-window failures
    (a window not fully populated, no huge page free) are counted, not raised."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    failed = 0
    try:
        for start, end in ranges:
            a = (start + HPAGE - 1) & ~(HPAGE - 1)
            b = end & ~(HPAGE - 1)
            for w in range(a, b, HPAGE):
                iov = _Iovec(w, HPAGE)
                if libc.syscall(SYS_PROCESS_MADVISE, pidfd, ctypes.byref(iov), 1, MADV_COLLAPSE, 0) < 0:
                    failed += 1
    finally:
        os.close(pidfd)
    return {"collapse_failed_windows": failed}


def _nvml_used(pid: int) -> int | None:
    r = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=False,
    )
    for line in r.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return int(parts[1]) * 1024 * 1024
    return None


# -- the child: the worker's side ---------------------------------------------------------------


def _send(sock: socket.socket, doc: Json, fds: list[int] | None = None) -> None:
    data = (json.dumps(doc) + "\n").encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)


def _recv(sock: socket.socket, maxfds: int = 0) -> tuple[Json, list[int]]:
    if maxfds:
        data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, maxfds)
    else:
        data, fds = sock.recv(1 << 20), []
    return json.loads(data.decode()), list(fds)


def build(model: str) -> Callable[[], bytes]:
    """Builds `model` on the GPU (seeded: the same weights every time) and returns its request,
    which answers the output's bytes. Shared by the probes that need a worker's model
    (bench/concurrent/quiet_steps.py, written_pages.py)."""
    import torch

    torch.manual_seed(0)
    if model == "ctx":
        x = torch.ones(4, device="cuda")

        def answer_ctx() -> bytes:
            return bytes((x * 2).cpu().numpy().tobytes())

        return answer_ctx
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=1280, n_layer=36, n_head=20, vocab_size=50257, n_positions=1024)
    with torch.device("cuda"):
        net = GPT2LMHeadModel(cfg).eval()
    ids = (torch.arange(64, device="cuda") * 7919 % cfg.vocab_size).view(1, 64)

    def answer_gpt2() -> bytes:
        with torch.no_grad():
            return bytes(net(ids).logits.float().cpu().numpy().tobytes())

    return answer_gpt2


def child(model: str, variant: str, fd: int) -> None:
    import torch

    from torpor import hook as torpor_hook

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=fd)
    h = torpor_hook.get()
    t0 = time.perf_counter()
    answer = build(model)
    digest0 = hashlib.sha256(answer()).hexdigest()
    built_s = time.perf_counter() - t0
    lib = _cuda()
    before_limits = _limits(lib)
    applied: Json = {}
    torch.cuda.synchronize()
    if variant in ("empty", "all"):
        torch.cuda.empty_cache()
        applied["empty_cache"] = "ok"
    if variant in ("stack0", "limits", "all"):
        applied["stack"] = _set_limit(lib, CU_LIMIT_STACK_SIZE, 0)
    if variant in ("limits", "all"):
        applied["printf_fifo"] = _set_limit(lib, CU_LIMIT_PRINTF_FIFO_SIZE, 4096)
        applied["malloc_heap"] = _set_limit(lib, CU_LIMIT_MALLOC_HEAP_SIZE, 4096)
    torch.cuda.synchronize()
    segments = [s for s in h.segments() if s.backend == "cuda"]
    seg_fds = [h.export(s.va) for s in segments]
    doc = {
        "built_s": built_s,
        "torch_allocated": torch.cuda.memory_allocated(),
        "torch_reserved": torch.cuda.memory_reserved(),
        "segments": len(segments),
        "segment_bytes": sum(s.size for s in segments),
        "limits_before": before_limits,
        "limits_after": _limits(lib),
        "applied": applied,
        "digest": digest0,
    }
    # torpord holds the fds across the snapshot; the worker keeps none.
    _send(sock, doc | {"vas": [s.va for s in segments]}, seg_fds[:250])
    for i in range(250, len(seg_fds), 250):
        _send(sock, {"more": True}, seg_fds[i : i + 250])
    for f in seg_fds:
        os.close(f)
    h.release_all()
    torch.cuda.synchronize()
    _send(sock, {"released": True})
    msg, fds = _recv(sock, maxfds=250)
    while msg.get("more"):
        more, more_fds = _recv(sock, maxfds=250)
        fds += more_fds
        msg = more
    assert msg.get("restored"), msg
    for s, f in zip(segments, fds, strict=True):
        h.map(s.va, f, False)
        os.close(f)
    t1 = time.perf_counter()
    digest1 = hashlib.sha256(answer()).hexdigest()
    first_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    answer()
    second_s = time.perf_counter() - t2
    _send(sock, {"digest_after": digest1, "first_request_s": first_s, "second_request_s": second_s, "limits_restored": _limits(lib)})


# -- the parent: torpord's side -----------------------------------------------------------------


def one(model: str, variant: str, pages: str = "as-is") -> Json:
    # SEQPACKET keeps each message whole: two quick sends must not arrive as one read.
    parent, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # TORPOR_HOOK_CUDA=1, as torpord sets for a split worker: without it the hook interposes
    # nothing and every buffer stays in the driver's checkpoint.
    env = os.environ | {"LD_PRELOAD": os.environ["TORPOR_HOOK_LIB"], "TORPOR_HOOK_CUDA": "1"}
    p = subprocess.Popen(
        [sys.executable, __file__, "--child", model, variant, str(child_sock.fileno())],
        pass_fds=[child_sock.fileno()], env=env,
    )
    child_sock.close()
    lib = _cuda()
    _check(lib, lib.cuInit(0), "cuInit")
    try:
        doc, fds = _recv(parent, maxfds=250)
        while len(fds) < doc["segments"]:
            _more, more_fds = _recv(parent, maxfds=250)
            fds += more_fds
        released, _ = _recv(parent)
        assert released.get("released"), released
        time.sleep(0.5)  # NVML's per-process figure lags a release
        doc["nvml_before"] = _nvml_used(p.pid)
        anon0 = _rss_anon(p.pid)
        huge0 = _anon_huge(p.pid)
        vmas0 = _anon_vmas(p.pid)
        thp0 = _thp_mode()
        doc["pages"] = pages
        doc["thp_mode"] = thp0
        lock = _LockArgs(timeout_ms=10000)
        args = _Args64()
        t = time.perf_counter()
        _check(lib, lib.cuCheckpointProcessLock(p.pid, ctypes.byref(lock)), "lock")
        doc["lock_s"] = time.perf_counter() - t
        if pages != "as-is":
            THP_ENABLED.write_text("never")
        try:
            t = time.perf_counter()
            _check(lib, lib.cuCheckpointProcessCheckpoint(p.pid, ctypes.byref(args)), "checkpoint")
            doc["checkpoint_s"] = time.perf_counter() - t
        finally:
            if pages != "as-is":
                THP_ENABLED.write_text(thp0)
        doc["residue_bytes"] = _rss_anon(p.pid) - anon0
        doc["residue_huge_bytes"] = _anon_huge(p.pid) - huge0
        if pages == "4k-collapse":
            grown = sorted(_anon_vmas(p.pid) - vmas0)
            t = time.perf_counter()
            doc |= _collapse(p.pid, grown)
            doc["collapse_s"] = time.perf_counter() - t
            doc["residue_huge_bytes_collapsed"] = _anon_huge(p.pid) - huge0
        doc["nvml_checkpointed"] = _nvml_used(p.pid)
        t = time.perf_counter()
        _check(lib, lib.cuCheckpointProcessRestore(p.pid, None), "restore")
        doc["restore_s"] = time.perf_counter() - t
        t = time.perf_counter()
        _check(lib, lib.cuCheckpointProcessUnlock(p.pid, None), "unlock")
        doc["unlock_s"] = time.perf_counter() - t
        doc["nvml_after_restore"] = _nvml_used(p.pid)
        for i in range(0, max(len(fds), 1), 250):
            last = i + 250 >= len(fds)
            _send(parent, {"restored": True} if last else {"more": True}, fds[i : i + 250])
        for f in fds:
            os.close(f)
        after, _ = _recv(parent)
        doc |= after
        doc["identical"] = doc["digest"] == doc["digest_after"]
        doc["nvml_after_request"] = _nvml_used(p.pid)
    finally:
        p.kill()
        p.wait()
    doc.pop("vas", None)
    return doc


def table(doc: Json) -> str:
    """The residue per model and variant as the Markdown docs/split.md quotes (first run of each)."""
    lines = [
        "| worker | variant | segments out | residue (MiB) | driver checkpoint | driver restore | first request after | outputs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        run = next((x for x in r["runs"] if "error" not in x), None)
        pages = r.get("pages", "as-is")
        label = r["variant"] if pages == "as-is" else f"{r['variant']}, {pages} pages"
        if run is None:
            lines.append(f"| {r['model']} | {label} | error: {r['runs'][0]['error'][:80]} |||||")
            continue
        lines.append(
            f"| {r['model']} | {label} | {run['segments']} ({run['segment_bytes'] / 2**30:.2f} GiB) "
            f"| {run['residue_bytes'] / 2**20:.0f} | {run['checkpoint_s']:.2f} s | {run['restore_s']:.2f} s "
            f"| {run['first_request_s'] * 1e3:.0f} ms | {'identical' if run['identical'] else 'DIFFER'} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--table"]:
        print(table(json.loads(Path(argv[1]).read_text())))
        return 0
    if argv[:1] == ["--child"]:
        child(argv[1], argv[2], int(argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--pages", default="as-is", help="comma list of as-is, 4k, 4k-collapse (the module doc)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if not os.environ.get("TORPOR_HOOK_LIB"):
        print("residue: set TORPOR_HOOK_LIB to libtorpor_hook.so (make gpu-carry puts it in .gpu/)", file=sys.stderr)
        return 2
    results = []
    for model in a.models.split(","):
        for variant in a.variants.split(","):
            for pages in a.pages.split(","):
                runs = []
                for _ in range(a.runs):
                    try:
                        runs.append(one(model, variant, pages))
                    except Exception as e:  # a variant the driver refuses is a result, not a crash
                        runs.append({"error": f"{type(e).__name__}: {e}"})
                    print(json.dumps({"model": model, "variant": variant, **runs[-1]}), flush=True)
                ok = [r for r in runs if "error" not in r]
                keys = ("residue_bytes", "residue_huge_bytes", "restore_s", "checkpoint_s", "first_request_s", "collapse_s")
                med = {k: statistics.median(r[k] for r in ok) for k in keys if ok and all(k in r for r in ok)}
                results.append({"model": model, "variant": variant, "pages": pages, "runs": runs, "median": med})
    a.out.write_text(json.dumps({"machine": _machine(), "results": results}, indent=1))
    return 0


def _machine() -> Json:
    r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True, check=False)
    try:
        import torch

        torch_v = torch.__version__
    except ImportError:
        torch_v = None
    return {"gpu": r.stdout.strip(), "torch": torch_v, "commit": os.environ.get("TORPOR_COMMIT"), "dirty": os.environ.get("TORPOR_DIRTY")}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
