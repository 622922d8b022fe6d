"""Load with a daemon restart in the middle: N invocations of mixed functions at the node's full
concurrency, and torpord restarted while they run. Nothing may be lost or run twice, every error
must be accounted for, and every answer must be right.

    python3 bench/reliability/load.py [--torpor target/release/torpor] [--invocations 10000]
        [--restart graceful|kill] [--restart-at 0.5] [--out bench/results/reliability-load.json]

It starts its own `torpor serve` on a fresh state directory and socket and deploys three CPU
functions: `tally` (answers at once; 4 instances x 4 requests), `tally-slow` (sleeps 5 ms; 4 x 2)
and examples/cpu-mlp (a real model; 4 x 1). The concurrency is the node's total slots for them
(28): that many client threads send back to back, each request to the next function of the mix,
over a fresh connection to the API socket.

The restart, once `--restart-at` of the invocations have been answered:
- `graceful` (the default: an upgrade or a `systemctl restart`): SIGTERM, which finishes the requests
  in flight and refuses new connections, then `torpor serve` again on the same state directory.
- `kill`: SIGKILL; the workers outlive the daemon and the new one re-adopts them.

What a client does when the daemon is down: a connection that is refused (or finds no socket) sent
nothing, so it is retried (counted as `retried_unsent`), for at most 60 s. A request whose connection
breaks after it was sent has an unknown outcome. Every request carries an Idempotency-Key (its id;
`--no-keys` leaves it out), so such a request is sent again with its key (`retried_after_reset`),
for at most 60 s: torpord runs a keyed request once, and answers its retry from the run that
already happened, even across a kill -9 (its worker keeps the answer; docs/torpord.md, "Retries").
Without keys it is not retried (that could run it twice) and is counted under `errors` as `reset`;
`resets_sent_after_the_stop` counts those sent after the old daemon was gone (reaped), which only
the new daemon could have lost (must be 0). A status other than 200 is counted under `errors` by status.

The checks, from the answers and from the functions' own logs (each tally request prints its id on
the instance's stdout, which torpord keeps in <state>/logs/<function>/<instance>.log):
- `lost`: requests sent that got no answer at all (a reset) and did not run either (not in the
  tally logs); plus 200 answers whose request is not in the logs.
- `duplicated`: tally requests that ran more than once.
- `wrong`: 200 answers that are not the right answer (tally: its id and payload back; cpu-mlp: the
  answer the warm daemon gave to the same input before the run).
- `unaccounted_errors`: non-200 answers without a JSON error line saying why.
The JSON has every setting, the machine, the counts per function and outcome, a latency histogram
and percentiles of the 200 answers, and a top-level `summary`
(`invocations`, `lost_requests`, `duplicated_requests`, `wrong_answers`, `errors`, `p50_ms`, `p99_ms`).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TALLY = Path(__file__).resolve().parent / "functions" / "tally"
CPU_MLP = ROOT / "examples" / "cpu-mlp"
# Latency histogram bucket upper bounds, in milliseconds (the last bucket is everything above).
BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
# How long a client keeps retrying a request whose connection is refused (the daemon is down).
RETRY_UNSENT_S = 60.0
REQUEST_TIMEOUT_S = 60.0


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("torpord", timeout=timeout)
        self.path = str(path)

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self.path)
        self.sock = s


class Unsent(Exception):
    """The daemon refused the connection (or has no socket): the request was not sent."""


def post(
    sock: Path, path: str, body: bytes, timeout: float = REQUEST_TIMEOUT_S, key: str | None = None
) -> tuple[int, bytes]:
    """`key`: the request's Idempotency-Key."""
    conn = UnixHTTPConnection(sock, timeout)
    try:
        try:
            conn.connect()
        except (ConnectionRefusedError, FileNotFoundError) as e:
            raise Unsent(str(e)) from e
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Idempotency-Key"] = key
        conn.request("POST", path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@dataclass
class Daemon:
    binary: Path
    root: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: list[float] = field(default_factory=list)

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def socket(self) -> Path:
        return self.root / "torpord.sock"

    def start(self) -> None:
        self.socket.unlink(missing_ok=True)
        log = open(self.root / "torpord.log", "ab")  # noqa: SIM115 (the daemon's stderr for its life)
        env = {k: v for k, v in os.environ.items() if k != "TORPOR_SOCKET"}
        self.proc = subprocess.Popen(
            [str(self.binary), "serve", "--state-dir", str(self.state), "--socket", str(self.socket)],
            stdout=subprocess.DEVNULL,
            stderr=log,
            env=env,
        )
        log.close()
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"torpor serve exited: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError("torpor serve did not listen within 30 s")
            time.sleep(0.01)
        self.starts.append(time.monotonic())

    def stop(self, sig: int) -> float:
        """Sends `sig` and waits for the daemon's exit; returns how long that took."""
        assert self.proc is not None
        t = time.monotonic()
        self.proc.send_signal(sig)
        self.proc.wait(timeout=60)
        return time.monotonic() - t

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, TORPOR_SOCKET=str(self.socket))
        return subprocess.run([str(self.binary), *args], capture_output=True, text=True, timeout=600, env=env, check=False)

    def log_tail(self) -> str:
        p = self.root / "torpord.log"
        return p.read_text(errors="replace")[-3000:] if p.exists() else ""

    def shutdown(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop(signal.SIGTERM)


@dataclass
class Outcome:
    function: str
    rid: str
    status: int | None  # None: reset (sent, no answer)
    latency_s: float
    sent_at: float  # monotonic clock
    body: bytes
    retries_unsent: int
    # Resets retried with the request's Idempotency-Key (--keys).
    retries_reset: int = 0


def function_copies(root: Path) -> list[tuple[str, Path]]:
    """The three functions of the mix, copied under `root` (tally twice, renamed and rescaled)."""
    out = []
    for name, sleep_scale in (("tally", (4, 4)), ("tally-slow", (4, 2))):
        d = root / "functions" / name
        shutil.copytree(TALLY, d)
        toml = (d / "torpor.toml").read_text()
        toml = re.sub(r'(?m)^name = ".*"$', f'name = "{name}"', toml)
        toml = re.sub(r"(?m)^max_instances = \d+$", f"max_instances = {sleep_scale[0]}", toml)
        toml = re.sub(r"(?m)^requests_per_instance = \d+$", f"requests_per_instance = {sleep_scale[1]}", toml)
        (d / "torpor.toml").write_text(toml)
        out.append((name, d))
    d = root / "functions" / "cpu-mlp"
    shutil.copytree(CPU_MLP, d)
    if not (d / "weights.f32").exists():
        subprocess.run([sys.executable, str(d / "make_weights.py")], cwd=d, check=True, capture_output=True)
    out.append(("cpu-mlp", d))
    return out


# Slots per function (max_instances x requests_per_instance), as the copies above set them.
SLOTS = {"tally": 16, "tally-slow": 8, "cpu-mlp": 4}


def mlp_inputs(n: int, seed: int) -> list[list[float]]:
    rng = random.Random(seed)
    return [[rng.uniform(-4, 4) for _ in range(16)] for _ in range(n)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="torpor-load-", dir="/var/tmp"))
    daemon = Daemon(Path(args.torpor).resolve(), root)
    try:
        return _run(args, daemon)
    finally:
        daemon.shutdown()
        if getattr(args, "keep", False):
            print(f"kept {root} (state, logs, torpord.log)", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


def _run(args: argparse.Namespace, daemon: Daemon) -> dict[str, Any]:
    daemon.start()
    for _name, d in function_copies(daemon.root):
        r = daemon.cli("deploy", str(d))
        if r.returncode != 0:
            raise RuntimeError(f"deploy {d.name} failed: {r.stderr.strip()}\n{daemon.log_tail()}")
    # cpu-mlp's right answers: what the daemon answers before the load, for a few inputs.
    inputs = mlp_inputs(8, args.seed)
    expected: list[bytes] = []
    for x in inputs:
        status, body = post(daemon.socket, "/v1/functions/cpu-mlp/invoke", json.dumps({"x": x}).encode())
        if status != 200:
            raise RuntimeError(f"cpu-mlp answered {status} before the load: {body[:300]!r}")
        expected.append(body)

    mix = ("tally", "tally-slow", "cpu-mlp")
    concurrency = args.concurrency or sum(SLOTS[f] for f in mix)
    answered = 0
    answered_lock = threading.Lock()
    restart_done = threading.Event()
    restart_info: dict[str, Any] = {"mode": args.restart, "at_fraction": args.restart_at}

    def one(i: int) -> Outcome:
        nonlocal answered
        fn = mix[i % len(mix)]
        rid = f"r{i}"
        if fn == "cpu-mlp":
            body = json.dumps({"x": inputs[i % len(inputs)]}).encode()
        else:
            payload = {"i": i, "f": random.Random(i).random(), "s": "é" * (i % 5)}
            body = json.dumps({"id": rid, "payload": payload, "sleep": 0.005 if fn == "tally-slow" else 0}).encode()
        retries, resets = 0, 0
        key = rid if args.keys else None
        first_try = time.monotonic()
        while True:
            t = time.monotonic()
            try:
                status, out = post(daemon.socket, f"/v1/functions/{fn}/invoke", body, key=key)
                o = Outcome(fn, rid, status, time.monotonic() - t, t, out, retries, resets)
                break
            except Unsent:
                if time.monotonic() - first_try > RETRY_UNSENT_S:
                    o = Outcome(fn, rid, None, time.monotonic() - t, t, b"unsent for 60 s", retries, resets)
                    break
                retries += 1
                time.sleep(0.02)
            except (OSError, http.client.HTTPException) as e:
                # Sent, outcome unknown: only a keyed request may be sent again (it runs once).
                if key is None or time.monotonic() - first_try > RETRY_UNSENT_S:
                    o = Outcome(fn, rid, None, time.monotonic() - t, t, repr(e).encode(), retries, resets)
                    break
                resets += 1
                time.sleep(0.02)
        with answered_lock:
            answered += 1
        return o

    def restarter() -> None:
        target = int(args.invocations * args.restart_at)
        while True:
            with answered_lock:
                if answered >= target:
                    break
            time.sleep(0.005)
        sig = signal.SIGTERM if args.restart == "graceful" else signal.SIGKILL
        restart_info["answered_before"] = target
        restart_info["stop_at"] = time.monotonic()
        restart_info["stop_s"] = daemon.stop(sig)
        t = time.monotonic()
        daemon.start()
        restart_info["start_s"] = round(time.monotonic() - t, 4)
        restart_done.set()

    rt = threading.Thread(target=restarter, daemon=True)
    rt.start()
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        outcomes = list(pool.map(one, range(args.invocations)))
    wall = time.monotonic() - t0
    rt.join(timeout=120)
    if not restart_done.is_set():
        raise RuntimeError("the restart did not happen: the run ended before it")

    # What ran: the tally ids in the instance logs.
    ran: Counter[str] = Counter()
    for log in (daemon.state / "logs").glob("tally*/*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("tally-ran r"):
                ran[line.split()[1]] += 1

    per_function: dict[str, Counter[str]] = {f: Counter() for f in mix}
    errors: Counter[str] = Counter()
    lost, wrong, unaccounted = [], [], []
    latencies: list[float] = []
    for i, o in enumerate(outcomes):
        tally = o.function != "cpu-mlp"
        if o.status == 200:
            latencies.append(o.latency_s)
            per_function[o.function]["ok"] += 1
            if tally:
                got = json.loads(o.body)
                want = json.loads(json.dumps({"i": i, "f": random.Random(i).random(), "s": "é" * (i % 5)}))
                if got.get("id") != o.rid or got.get("payload") != want:
                    wrong.append(o.rid)
                if ran[o.rid] == 0:
                    lost.append(o.rid)
            elif o.body != expected[i % len(inputs)]:
                wrong.append(o.rid)
            continue
        key = "reset" if o.status is None else str(o.status)
        errors[key] += 1
        per_function[o.function][key] += 1
        if o.status is None:
            # No answer: lost unless it ran (tally) — cpu-mlp's runs cannot be seen, so its resets count as lost.
            if not tally or ran[o.rid] == 0:
                lost.append(o.rid)
        else:
            try:
                why = json.loads(o.body).get("error")
            except (ValueError, AttributeError):
                why = None
            if not why:
                unaccounted.append(o.rid)
    duplicated = sorted(r for r, n in ran.items() if n > 1)
    latencies.sort()

    def pct(p: float) -> float | None:
        return round(latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1000, 3) if latencies else None

    hist = Counter()
    for s in latencies:
        ms = s * 1000
        hist[next((f"le_{b}" for b in BUCKETS_MS if ms <= b), "inf")] += 1
    return {
        "settings": {
            "invocations": args.invocations,
            "concurrency": concurrency,
            "mix": {f: SLOTS[f] for f in mix},
            "restart": restart_info,
            "seed": args.seed,
            "idempotency_keys": args.keys,
        },
        "machine": machine(daemon.binary),
        "wall_s": round(wall, 3),
        "throughput_rps": round(args.invocations / wall, 1),
        "retried_unsent": sum(o.retries_unsent for o in outcomes),
        "requests_retried_unsent": sum(1 for o in outcomes if o.retries_unsent),
        "retried_after_reset": sum(o.retries_reset for o in outcomes),
        "requests_retried_after_reset": sum(1 for o in outcomes if o.retries_reset),
        "per_function": {f: dict(c) for f, c in per_function.items()},
        "errors": dict(errors),
        # What the daemon said, for each status other than 200 (the first 3 of each).
        "error_samples": {
            st: [o.body.decode(errors="replace")[:300] for o in outcomes if str(o.status) == st][:3]
            for st in sorted(errors) if st != "reset"
        },
        "lost": lost[:50],
        # A reset sent after the killed daemon was reaped would be a request lost by the new one.
        "resets_sent_after_the_stop": sum(
            1 for o in outcomes if o.status is None and o.sent_at > restart_info["stop_at"] + restart_info["stop_s"]
        ),
        "resets": sorted({o.body.decode(errors="replace")[:120] for o in outcomes if o.status is None})[:10],
        "duplicated": duplicated[:50],
        "wrong": wrong[:50],
        "unaccounted_errors": unaccounted[:50],
        "latency_ms": {"p50": pct(0.50), "p90": pct(0.90), "p99": pct(0.99), "max": pct(1.0)},
        "latency_histogram_ms": {k: hist[k] for k in [f"le_{b}" for b in BUCKETS_MS] + ["inf"]},
        "summary": {
            "invocations": args.invocations,
            "lost_requests": len(lost),
            "duplicated_requests": len(duplicated),
            "wrong_answers": len(wrong),
            "errors": sum(errors.values()),
            "unaccounted_errors": len(unaccounted),
            "p50_ms": pct(0.50),
            "p99_ms": pct(0.99),
        },
    }


def machine(binary: Path) -> dict[str, Any]:
    commit = os.environ.get("TORPOR_COMMIT")
    if not commit:
        r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
        commit = r.stdout.strip() or None
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=False).stdout.strip()
    return {
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torpor": version,
        "binary": str(binary),
        "commit": commit,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--torpor", default=os.environ.get("TORPOR_BIN", str(ROOT / "target/release/torpor")))
    p.add_argument("--invocations", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=0, help="client threads (default: the node's slots, 28)")
    p.add_argument("--restart", choices=("graceful", "kill"), default="graceful")
    p.add_argument("--restart-at", type=float, default=0.5, help="fraction of the invocations answered before the restart")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--keys",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send each request with an Idempotency-Key and retry a reset one with it (default); "
        "--no-keys: a reset request is not retried (its outcome unknown)",
    )
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--keep", action="store_true", help="keep the daemon's state directory and log")
    args = p.parse_args()
    if not 0 < args.restart_at < 1:
        p.error("--restart-at must be between 0 and 1 (exclusive)")
    result = run(args)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(json.dumps(result["summary"]), "errors:", result["errors"], "wall:", result["wall_s"], "s")
    bad = result["summary"]
    return 0 if bad["lost_requests"] == bad["duplicated_requests"] == bad["wrong_answers"] == bad["unaccounted_errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
