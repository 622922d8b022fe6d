"""A small function's cold start while a large model loads, with the fair PCIe scheduler and
without it (issue 11 item 6, "Measure"; docs/sandboxes.md "Fair PCIe").

For each side (`[pcie] fair = true`, then `fair = false`) the bench starts its own torpord
(fresh state, split path, GPU cache off so that every cold start copies its weights host→device
from the restore server's host cache), deploys a large function (--large-mib of weights, 3 GiB
by default) and a small one (--small-mib, 4 MiB), restores each once (the store fills the host
cache), then measures the small function's cold start (`torpor stop`, then one invoke: restore
→ first answer, as the client sees it):

- solo: --runs times with nothing else on the node;
- during a large load: --runs times, each with the large function stopped and cold-started
  first, the small invoke sent once the large function's fill is copying (torpord's
  `torpor_pcie_transfers` gauge of the device is ≥ 1).

`small_p99_ratio` is p99(during) ÷ p99(solo) with the scheduler; `small_p99_ratio_without`
the same without it. Writes bench/results/sandbox-pcie-<device>.json with a top-level
`summary`.

    python3 bench/pcie/run.py [--runs 20] [--large-mib 3072] [--tensor-mib 1024] [--small-mib 4] [--out FILE]
    python3 bench/pcie/run.py --cpu    # CPU functions, torpor.buffer() segments, host backend

On the GPU the functions are PyTorch ones whose weights are CUDA tensors (segments of the
hook), the large one's in 1 GiB tensors by default: each segment is one transfer, and without
the scheduler a copy of a segment holds the GPU's copy engine whole; with --cpu they keep their weights in torpor.buffer() (the host backend stands in for the
GPU; its copies are memcpy, so the figures say little about PCIe).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "python"))

from torpor import client  # noqa: E402

GPU_MODEL = '''
import torch
import torpor

MIB = {mib}
TENSOR_MIB = {tensor_mib}


@torpor.function
class Fn:
    def setup(self) -> None:
        # Tensors of TENSOR_MIB (or one smaller one): each a segment of the hook, so one
        # transfer of the restore server; held in a list, not a module, so a request waits for
        # all of them (docs/split.md).
        chunk = min(MIB, TENSOR_MIB)
        self.w = [torch.full((chunk << 18,), 1.0 / (1 + i), device="cuda") for i in range(max(1, MIB // chunk))]

    def __call__(self, request):
        return {{"sum": float(sum(float(w[:16].sum()) for w in self.w)), "tensors": len(self.w)}}
'''

CPU_MODEL = '''
import torpor

MIB = {mib}


@torpor.function
class Fn:
    def setup(self) -> None:
        self.w = torpor.buffer(MIB << 20)
        self.w[0] = 1

    def __call__(self, request):
        # Written on every request: the segment is writable, so every restore fills it.
        self.w[0] = (self.w[0] + 1) % 256
        return {{"first": self.w[0], "bytes": len(self.w)}}
'''


def write_function(root: Path, name: str, mib: int, cpu: bool, tensor_mib: int) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "model.py").write_text((CPU_MODEL if cpu else GPU_MODEL).format(mib=mib, tensor_mib=tensor_mib))
    spec = [
        f'name = "{name}"',
        'entry = "model:Fn"',
        *([] if cpu else ['preload = ["torch"]', "gpus = 1", f'gpu_memory = "{mib + 1024}MiB"']),
        "timeout_s = 120",
        "load_timeout_s = 600",
        "[scaling]",
        "max_instances = 1",
        "requests_per_instance = 1",
    ]
    (d / "torpor.toml").write_text("\n".join(spec) + "\n")
    return d


class Daemon:
    def __init__(self, torpor: Path, fair: bool, host_cache_mib: int) -> None:
        self.torpor = torpor
        self.root = Path(tempfile.mkdtemp(prefix="torpor-pcie-bench-"))
        self.sock = self.root / "torpord.sock"
        (self.root / "torpord.toml").write_text(
            "[restore_server]\n"
            f"host_cache_bytes = {host_cache_mib << 20}\n"
            "gpu_cache_bytes = 0\n"
            f"[pcie]\nfair = {'true' if fair else 'false'}\n"
        )
        self.log = open(self.root / "torpord.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [torpor, "serve", "--config", self.root / "torpord.toml", "--state-dir", self.root / "state", "--socket", self.sock],
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )
        for _ in range(400):
            if self.sock.exists():
                break
            time.sleep(0.05)
        self.env = dict(os.environ, TORPOR_SOCKET=str(self.sock))

    def cli(self, *args: Any) -> None:
        r = subprocess.run([self.torpor, *args], capture_output=True, text=True, env=self.env, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"torpor {' '.join(map(str, args))} failed: {r.stdout}{r.stderr}")

    def instances(self, name: str) -> list[dict[str, Any]]:
        a = client.request(self.sock, "GET", f"/v1/functions/{name}", None, 30)
        return list(json.loads(a.body).get("instances", [])) if a.status == 200 else []

    def stop_fn(self, name: str) -> None:
        self.cli("stop", name)
        deadline = time.monotonic() + 60
        while any(i.get("pid") for i in self.instances(name)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}'s instances did not stop")
            time.sleep(0.02)

    def cold(self, name: str) -> tuple[float, dict[str, Any]]:
        t = time.monotonic()
        a = client.request(self.sock, "POST", f"/v1/functions/{name}/invoke", b"{}", 300)
        s = time.monotonic() - t
        if a.status != 200:
            raise RuntimeError(f"invoke {name}: {a.status} {a.body[:300]!r}")
        start = a.headers.get("x-torpor-start")
        if start != "restored":
            raise RuntimeError(f"invoke {name}: started {start!r}, not restored")
        return s, dict(json.loads(a.headers.get("x-torpor-timings", "{}")))

    def transfers(self) -> int:
        text = client.request(self.sock, "GET", "/metrics", None, 30).body.decode()
        n = 0
        for line in text.splitlines():
            if line.startswith("torpor_pcie_transfers{"):
                n += int(float(line.split()[-1]))
        return n

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))]


def one_side(args: argparse.Namespace, fair: bool) -> dict[str, Any]:
    d = Daemon(args.torpor, fair, max(4096, 2 * (args.large_mib + args.small_mib)))
    try:
        fns = d.root / "fns"
        for name, mib in (("large", args.large_mib), ("small", args.small_mib)):
            d.cli("deploy", write_function(fns, name, mib, args.cpu, args.tensor_mib))
            d.cold(name)  # from the store: into the host cache
            d.stop_fn(name)
        solo, during, large_s, small_timings = [], [], [], []
        for _ in range(args.runs):
            s, _t = d.cold("small")
            solo.append(s)
            d.stop_fn("small")
        for _ in range(args.runs):
            got: dict[str, Any] = {}
            t = threading.Thread(target=lambda: got.update(large=d.cold("large")))
            t.start()
            deadline = time.monotonic() + 60
            while d.transfers() < 1:
                if time.monotonic() > deadline or not t.is_alive():
                    raise RuntimeError("the large function's fill was not seen copying")
                time.sleep(0.001)
            s, timings = d.cold("small")
            t.join()
            if "large" not in got:
                raise RuntimeError("the large cold start failed")
            during.append(s)
            small_timings.append(timings)
            large_s.append(got["large"][0])
            d.stop_fn("small")
            d.stop_fn("large")
        return {
            "fair": fair,
            "solo_s": solo,
            "during_large_s": during,
            "large_s": large_s,
            "small_timings_during": small_timings,
            "p50_solo_s": pct(solo, 50),
            "p99_solo_s": pct(solo, 99),
            "p50_during_s": pct(during, 50),
            "p99_during_s": pct(during, 99),
            "p99_ratio": pct(during, 99) / pct(solo, 99),
            "p50_ratio": pct(during, 50) / pct(solo, 50),
        }
    finally:
        d.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--large-mib", type=int, default=3072)
    ap.add_argument("--small-mib", type=int, default=4)
    ap.add_argument("--tensor-mib", type=int, default=1024,
                    help="GPU: the large function's weights in tensors (segments, transfers) of this size")
    ap.add_argument("--cpu", action="store_true", help="CPU functions on the host backend (no GPU)")
    ap.add_argument("--torpor", type=Path, default=Path(os.environ.get("TORPOR_BIN", ROOT / "target/release/torpor")))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with_it = one_side(args, True)
    without = one_side(args, False)
    device = "cpu"
    if not args.cpu:
        device = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, check=False
        ).stdout.strip().splitlines()[0]
    doc = {
        "summary": {
            # p99 of the small function's cold start during a large load ÷ p99 solo.
            "small_p99_ratio": with_it["p99_ratio"],
            "small_p99_ratio_without": without["p99_ratio"],
            "small_p50_ratio": with_it["p50_ratio"],
            "small_p50_ratio_without": without["p50_ratio"],
            "small_p99_solo_s": with_it["p99_solo_s"],
            "small_p99_during_s": with_it["p99_during_s"],
            "small_p99_during_without_s": without["p99_during_s"],
            # The large start itself (restore → first answer while the small one starts): what
            # the scheduler costs it.
            "large_p50_s": pct(with_it["large_s"], 50),
            "large_p50_without_s": pct(without["large_s"], 50),
            "target": "small_p99_ratio <= 1.2 (issue 11)",
        },
        "machine": {"device": device, "kernel": platform.release(), "python": platform.python_version()},
        "settings": {"torpor": str(args.torpor), "commit": os.environ.get("TORPOR_COMMIT"), "runs": args.runs, "large_mib": args.large_mib, "tensor_mib": args.tensor_mib, "small_mib": args.small_mib, "cpu": args.cpu,
                     "block_bytes": 2 << 20, "solo_bytes": 64 << 20, "gpu_cache_bytes": 0},
        "with_scheduler": with_it,
        "without_scheduler": without,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    text = json.dumps(doc, indent=2)
    print(text)
    out = args.out or ROOT / "bench" / "results" / f"sandbox-pcie-{'cpu' if args.cpu else 'h100'}.json"
    out.write_text(text + "\n")
    print(
        f"small cold start p99 during a {args.large_mib} MiB load ÷ solo: {with_it['p99_ratio']:.2f} with the "
        f"scheduler, {without['p99_ratio']:.2f} without",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
