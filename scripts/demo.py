"""`make demo`: Torpor's function runtime, end to end, with the daemon's own timings.

It starts torpord (`torpor serve`) on a temporary state directory and socket, deploys an example
and shows: a from-scratch boot, a cold start from the function snapshot, a warm call, a second
instance started by concurrent requests, the keep-alive step-down stages and a wake, then what
/metrics says. Every timing is read from the daemon's answers (`torpor deploy`, `torpor invoke -v`:
X-Torpor-Start and X-Torpor-Timings, `torpor ls --json`), and every answer is compared with the
booted instance's. It ends with a graceful stop and checks that nothing it started is left.

The example: examples/resnet152 on a machine with an NVIDIA GPU and PyTorch (its weights are
generated first if missing), examples/cpu-mlp otherwise (`--cpu` forces it). The example is
copied into the temporary directory with short [keepalive] delays, so the stages pass in seconds.

    sudo TORPOR_BIN=target/release/torpor python3 scripts/demo.py [--cpu]

The from-scratch boot runs on torpord started with `--cold-start boot` (snapshots off at invoke,
the baseline); the daemon is then restarted on the same state directory in its default mode, which
also shows that a restart keeps every deployed function.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The checkout's SDK: its client of the daemon's API (torpor.client).
sys.path.insert(0, str(ROOT / "python"))
from torpor import client  # noqa: E402

TORPOR = Path(os.environ.get("TORPOR_BIN", str(ROOT / "target/release/torpor")))
STAGES = ("warm", "gpu_released", "hibernated", "evicted")


@dataclass(frozen=True)
class Example:
    name: str
    dir: Path
    request: Any
    # Short keep-alive delays (idle seconds, cumulative) for the demo's copy of the spec.
    keepalive: tuple[float, float, float]
    label: str


CPU = Example(
    "cpu-mlp",
    ROOT / "examples/cpu-mlp",
    {"x": [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]},
    (1.0, 2.0, 4.0),
    "CPU: examples/cpu-mlp",
)
GPU = Example(
    "resnet152",
    ROOT / "examples/resnet152",
    {"seed": 1},
    (2.0, 5.0, 10.0),
    "GPU: examples/resnet152, ResNet-152 with generated weights",
)


class DemoError(Exception):
    """A step failed; the message names it (and the daemon's log)."""


def has_gpu() -> bool:
    probe = "import torch, torchvision, safetensors; assert torch.cuda.is_available()"
    try:
        subprocess.run(["nvidia-smi", "-L"], check=True, capture_output=True)
        subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return False
    return True


@dataclass
class Call:
    """One invocation as the daemon answered it."""

    value: Any
    start: str
    timings: dict[str, float]
    wall_s: float


class Daemon:
    """`torpor serve` on the demo's state directory; stopped with SIGTERM, as systemd does."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.state = work / "state"
        self.socket = work / "torpord.sock"
        self.log = work / "torpord.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *flags: str) -> float:
        t = time.monotonic()
        self.socket.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [TORPOR, "serve", "--state-dir", self.state, "--socket", self.socket, *flags],
            stdout=subprocess.DEVNULL,
            stderr=open(self.log, "ab"),  # noqa: SIM115 (the child holds it)
            env={k: v for k, v in os.environ.items() if k != "TORPOR_SOCKET"},
        )
        while not self.socket.exists():
            if self.proc.poll() is not None:
                raise DemoError(f"torpor serve exited with {self.proc.returncode}: see {self.log}")
            if time.monotonic() - t > 30:
                raise DemoError(f"torpor serve did not listen within 30 s: see {self.log}")
            time.sleep(0.02)
        return time.monotonic() - t

    def stop(self) -> float:
        """SIGTERM, then wait: the daemon stops its live instances and removes its socket."""
        t = time.monotonic()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise DemoError(f"torpord did not stop within 30 s of SIGTERM: see {self.log}") from None
        return time.monotonic() - t

    def cli(self, *args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, TORPOR_SOCKET=str(self.socket))
        r = subprocess.run([TORPOR, *map(str, args)], capture_output=True, text=True, env=env, check=False)
        if check and r.returncode != 0:
            raise DemoError(f"torpor {' '.join(map(str, args))} failed: {r.stderr.strip()} (daemon log: {self.log})")
        return r

    def invoke(self, name: str, request: Any) -> Call:
        """`torpor invoke -v`: the value on stdout, the start kind and timings on stderr."""
        t = time.monotonic()
        r = self.cli("invoke", name, "-v", "--data", json.dumps(request))
        wall = time.monotonic() - t
        m = re.search(r"start: (\S+)\s+timings: (\{.*\})", r.stderr)
        if m is None:
            raise DemoError(f"torpor invoke -v printed no start/timings line: {r.stderr.strip()}")
        return Call(json.loads(r.stdout), m.group(1), json.loads(m.group(2)), wall)

    def invoke_http(self, name: str, request: Any) -> Call:
        """The same over the API socket, for requests sent at the same moment."""
        t = time.monotonic()
        r = client.request(self.socket, "POST", f"/v1/functions/{name}/invoke", request, timeout=300)
        if r.status != 200:
            raise DemoError(f"invoke {name} answered {r.status}: {r.body.decode(errors='replace')}")
        return Call(
            r.json(),
            r.headers.get("x-torpor-start") or "?",
            json.loads(r.headers.get("x-torpor-timings") or "{}"),
            time.monotonic() - t,
        )

    def stage_counts(self, name: str) -> dict[str, int]:
        """`torpor ls --json`: the function's instances per stage."""
        listing = json.loads(self.cli("ls", "--json").stdout)
        for f in listing["functions"]:
            if f["name"] == name:
                return {s: int(f["instances"][s]) for s in STAGES}
        raise DemoError(f"torpor ls does not list {name}")

    def metrics(self) -> str:
        return client.request(self.socket, "GET", "/metrics", timeout=30).body.decode()


def counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "none"


def timings_text(t: dict[str, float]) -> str:
    return ", ".join(f"{k} {v * 1000:.1f} ms" if v < 1 else f"{k} {v:.3f} s" for k, v in t.items())


def same(call: Call, reference: Any) -> str:
    if call.value != reference:
        raise DemoError(f"the answer differs from the booted instance's: {call.value} != {reference}")
    return "identical output"


def step(d: Daemon, example: Example, label: str, expect: str, reference: Any) -> Call:
    """One `torpor invoke -v`: checks how the daemon got the instance and, given a reference
    answer, that the answer is the same; prints the line and the daemon's timings."""
    call = d.invoke(example.name, example.request)
    if call.start != expect:
        raise DemoError(f"{label} expected X-Torpor-Start {expect}, the daemon says {call.start}")
    check = "" if reference is None else same(call, reference)
    print(f"{label:<27} {call.start:<9} {call.wall_s:7.3f} s   {check}".rstrip())
    print(f"   ({timings_text(call.timings)})")
    return call


def prepare(example: Example, work: Path) -> Path:
    """The example copied into `work`, with the demo's [keepalive] in its spec."""
    if example is GPU and not (example.dir / "weights.safetensors").is_file():
        print("generating examples/resnet152/weights.safetensors (241 MB, once) ...", flush=True)
        subprocess.run([sys.executable, example.dir / "make_weights.py"], check=True)
    fdir = work / example.name
    shutil.copytree(example.dir, fdir, ignore=shutil.ignore_patterns("__pycache__", ".*"))
    spec = fdir / "torpor.toml"
    text = re.sub(r"(?ms)^\[keepalive\].*?(?=^\[|\Z)", "", spec.read_text())
    g, h, e = example.keepalive
    spec.write_text(f"{text.rstrip()}\n\n[keepalive]\ngpu_release_s = {g}\nhibernate_s = {h}\nevict_s = {e}\n")
    return fdir


def step_down(d: Daemon, example: Example, idle_since: float) -> None:
    """Polls `torpor ls --json` until every instance is evicted, printing each change."""
    last: dict[str, int] | None = None
    deadline = idle_since + example.keepalive[2] + 60
    while True:
        counts = d.stage_counts(example.name)
        if counts != last:
            print(f"    idle {time.monotonic() - idle_since:5.1f} s: {counts_text(counts)}", flush=True)
            last = counts
        live = counts["warm"] + counts["gpu_released"] + counts["hibernated"]
        if live == 0 and counts["evicted"] > 0:
            return
        if time.monotonic() > deadline:
            raise DemoError(f"the instances did not reach evicted in time ({counts_text(counts)}): see {d.log}")
        time.sleep(0.1)


# The /metrics lines worth reading after the demo: how instances were started, the outcome of every
# invocation, the start latency, and where the instances' time went.
METRICS_SHOWN = re.compile(
    r"^torpor_(starts_total|invocations_total|instance_stage_seconds_total|gpu_memory_byte_seconds_total)\{.*\} "
    r"|^torpor_phase_duration_seconds_(sum|count)\{.*phase=\"(start|restore|total)\".*\} "
    r"|^torpor_instances\{"
)


def show_metrics(text: str, name: str) -> None:
    for line in text.splitlines():
        if not METRICS_SHOWN.search(line):
            continue
        if "function=" in line and f'function="{name}"' not in line:
            continue
        # Series still at zero say nothing here.
        if line.rsplit(" ", 1)[-1] in ("0", "0.0"):
            continue
        print(f"    {line}")


def leftovers(token: str) -> list[int]:
    """Live processes whose command line names `token` (the demo's state directory)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if token.encode() in cmd and state != "Z":
            found.append(int(entry))
    return found


def mounted_under(path: Path) -> list[str]:
    prefix = str(path)
    return [
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split()[4].startswith(prefix)
    ]


def run(example: Example, work: Path, d: Daemon) -> None:
    fdir = prepare(example, work)
    g, h, e = example.keepalive
    print(f"== Torpor runtime demo ({example.label})")
    print(f"   torpord: {TORPOR} serve, state {d.state}, socket {d.socket}")

    # 1. From scratch: snapshots off at invoke.
    took = d.start("--cold-start", "boot")
    print(f"torpord started (--cold-start boot) in {took:.2f} s")
    print(f"deploy {example.dir.relative_to(ROOT)} (torpor deploy: boot the base and the function, snapshot both):")
    for line in d.cli("deploy", fdir).stdout.splitlines():
        print(f"    {line}")
    booted = step(d, example, "1. from-scratch boot:", "booted", None)
    print(f"   answer: {json.dumps(booted.value)[:110]}")
    took = d.stop()
    print(f"   torpord stopped (SIGTERM, its instance stopped) in {took:.2f} s; restarted in restore mode:")
    took = d.start()
    print(
        f"   torpord started in {took:.2f} s; the deploy is kept (instances: {counts_text(d.stage_counts(example.name))})"
    )

    # 2. Cold start from the function snapshot, 3. warm.
    step(d, example, "2. cold start (snapshot):", "restored", booted.value)
    step(d, example, "3. warm call:", "warm", booted.value)

    # 4. Requests at the same moment: the warm instance takes one, the others start instances.
    burst = 3

    def burst_round() -> list[Call]:
        calls: list[Call | Exception] = []
        gate = threading.Barrier(burst)

        def one() -> None:
            gate.wait()
            try:
                calls.append(d.invoke_http(example.name, example.request))
            except (DemoError, OSError, http.client.HTTPException, ValueError) as exc:  # reported below
                calls.append(exc)

        threads = [threading.Thread(target=one) for _ in range(burst)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for c in calls:
            if isinstance(c, Exception):
                raise DemoError(f"a concurrent request failed: {c}")
        return [c for c in calls if isinstance(c, Call)]

    def live_instances() -> tuple[int, dict[str, int]]:
        counts = d.stage_counts(example.name)
        return counts["warm"] + counts["gpu_released"], counts

    # A request starts an instance only if it finds none free. The example answers in about a
    # millisecond, so on a loaded machine one instance may take a whole burst, one request after
    # the other, before any of them finds it busy: then the burst is sent again (at most 5 times).
    for rounds in range(1, 6):
        done = burst_round()
        time.sleep(0.5)
        if live_instances()[0] >= 2:
            break
    idle_since = time.monotonic()
    again = f" (burst {rounds}: the ones before found the instance free)" if rounds > 1 else ""
    print(f"4. {burst} requests at once:     ", end="")
    print(", ".join(f"{c.start} {c.wall_s:.3f} s" for c in done), f"  {same(done[0], booted.value)}{again}")
    for c in done[1:]:
        same(c, booted.value)
    # Bound late: a request is served by the first instance free, so the warm one may answer
    # them all while the instances they started still restore; those join the pool idle.
    deadline = time.monotonic() + 60
    while True:
        live, counts = live_instances()
        if live >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    print(f"   torpor ls: {counts_text(counts)}")
    if live < 2:
        raise DemoError(f"the concurrent requests started no second instance ({counts_text(counts)})")

    # 5. Idle: the instances step down on the spec's [keepalive].
    stages = "warm -> gpu_released -> hibernated -> evicted" if example is GPU else "warm -> hibernated -> evicted"
    print(f"5. step-down ({stages}; keepalive {g:g}/{h:g}/{e:g} s idle):")
    step_down(d, example, idle_since)

    # 6. Wake: the next request restores a hibernated (here evicted) instance, its memory as it was.
    step(d, example, "6. wake from evicted:", "restored", booted.value)
    print(f"   torpor ls: {counts_text(d.stage_counts(example.name))}")

    print("/metrics since the restart (the non-zero series of this function):")
    show_metrics(d.metrics(), example.name)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="use examples/cpu-mlp even if a GPU is there")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("demo: needs root (namespaces, CRIU): run `sudo make demo`", file=sys.stderr)
        return 1
    if not TORPOR.is_file():
        print(f"demo: no torpor binary at {TORPOR}: build it (make release) or set TORPOR_BIN", file=sys.stderr)
        return 1
    example = CPU if args.cpu or not has_gpu() else GPU
    work = Path(tempfile.mkdtemp(prefix="torpor-demo-"))
    d = Daemon(work)
    code = 0
    try:
        run(example, work, d)
    except (DemoError, subprocess.CalledProcessError) as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        try:
            print(f"--- the end of {d.log}:\n{d.log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
        except OSError:
            pass
        code = 1
    finally:
        try:
            took = d.stop()
        except DemoError as exc:
            print(f"demo: error: {exc}", file=sys.stderr)
            code = 1
            took = float("nan")
        # Whatever the graceful stop missed is a defect to report, and is killed here.
        left = leftovers(str(work))
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        mounts = mounted_under(work)
        for m in mounts:
            subprocess.run(["umount", "--lazy", m], check=False)
        shutil.rmtree(work, ignore_errors=True)
        if left or mounts:
            print(f"demo: error: left after the stop: pids {left}, mounts {mounts}", file=sys.stderr)
            code = 1
        elif code == 0:
            print(f"shutdown: torpord stopped on SIGTERM in {took:.2f} s; no process or mount left; {work} removed")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
