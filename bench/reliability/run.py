#!/usr/bin/env python3
"""The reliability report of issue 13: each fault forced `--runs` times through the real daemon,
workers and CRIU, plus the fuzz campaign's and the load test's results, written to
bench/results/reliability.json (rendered into the README by bench/reliability/table.py).

    python3 bench/reliability/run.py                 # 2 runs per fault (a few minutes)
    python3 bench/reliability/run.py --runs 20       # the soak (docs/reliability.md)
    python3 bench/reliability/run.py --only daemon_kill_hibernate_quiet --runs 5

Needs root, CRIU (`make criu`) and a built torpor (`--torpor`, default $TORPOR_BIN or
target/debug/torpor). Fuzz and load are not run here: their own scripts write
bench/results/fuzz.json (bench/reliability/fuzz.py) and bench/results/reliability-load*.json
(bench/reliability/load.py), and this reads them.

The faults (one daemon for them all, on a fresh state directory):
- `daemon_kill_hibernate_<step>`: kill -9 of torpord at each step of a hibernation's journal
  (`TORPORD_HOLD=hibernate:<step>`) and inside CRIU's dump (`in_dump`), then a restart: the
  machinery of tests/daemon/test_daemon_crash.py.
- `daemon_kill_redeploy_<phase>`: kill -9 of torpord at a redeploy's phase line, or inside the
  function snapshot's dump, then a restart.
- `worker_kill`: kill -9 of a warm instance's worker between requests.
- `criu_fault_hibernate_<switch>`: a hibernation whose snapshot fails inside CRIU (`CRIU_FAULT=1`:
  CRIU dies with its parasite in the worker) or after CRIU wrote everything
  (`TORPOR_FAULT=after-dump`); the daemon then restarts without the switch.
- `gpu_oom_restore`: a cold start while the GPU's memory is gone (the driver's restore answers
  CUDA_ERROR_OUT_OF_MEMORY): the request must wait and be answered 503 with the line naming
  the lack of GPU memory, leave nothing behind, and the next request once the memory is back
  must be restored. `gpu_oom_deploy`: a redeploy whose setup finds the GPU full: it must fail
  in that line, leave no worker, and the previous deploy must answer afterwards. Without
  `--gpu` these two run on a second daemon whose GPU is tests/fakes (the fake driver's switch
  files); with `--gpu` a hog process holds all but 128 MiB of the real GPU.

`--gpu` runs every fault with a GPU function (the echoer with torch preloaded, `gpus = 1`, a
32 MiB tensor made in setup) on the machine's real GPU, through the transparent path
(`split_gpu = false`; `--split-gpu` for the split path, whose interrupted hibernations past
`segments` are dropped, docs/reliability.md), and writes
bench/results/reliability-gpu.json unless `--out` says otherwise; `--budget-s` shares that many
seconds equally among the chosen faults, each starting no run past its share (the GPU machine's
calls are bounded), and the JSON counts the runs that were made. The GPU machine's one-call soak
(docs/reliability.md; `scripts/gpu-run.sh reliability` runs it):

    python3 bench/reliability/run.py --gpu --runs 20 --budget-s 480 \
        --only worker_kill --only daemon_kill_hibernate_dump --only daemon_kill_redeploy_load \
        --only gpu_oom_restore --only gpu_oom_deploy

Each run counts, after the fault and its recovery:
- `harmed_sources`: 1 when the process the fault hit is left in a state nobody accounts for: an
  instance a daemon kill interrupted that is no longer listed (dropped), or a process of the
  daemon's that it does not list (stray, or left stopped by a dump).
- `invalid_snapshots_accepted`: snapshots the registry names whose directory fails `torpor verify`
  with the daemon's key (a half-written or damaged snapshot taken as good).
- `lost_requests`: requests sent after the recovery (one per run, plus the one after a worker
  kill) that were not answered 200 with the right answer.
- `recovery_s`: from the restart (or the fault) until the function answered again.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "python"), str(Path(__file__).resolve().parent)]

from daemon import test_daemon_crash as crash  # noqa: E402
from daemon import test_daemon_faults as faults_t  # noqa: E402
from daemon.conftest import Torpord, fake_gpu_env  # noqa: E402
from load import machine  # noqa: E402  (the same record of the machine as the load test)

RESULTS = ROOT / "bench" / "results"
OUT = RESULTS / "reliability.json"
OUT_GPU = RESULTS / "reliability-gpu.json"
MIB = 1 << 20
# What the hog leaves free on a real GPU: less than a PyTorch CUDA context needs.
HOG_LEAVES = 128 * MIB
HOG = f"""
import sys, torch
free, total = torch.cuda.mem_get_info()
held = torch.empty(max(free - {HOG_LEAVES}, 0), dtype=torch.uint8, device="cuda")
free, total = torch.cuda.mem_get_info()
print(f"holding {{held.numel() >> 20}} MiB, {{free >> 20}} MiB free of {{total >> 20}}", flush=True)
sys.stdin.read()
"""
# The setup of the GPU function: 32 MiB of device memory, through torch or, on the fake GPU,
# through the driver (as a framework's allocator would).
ALLOC_TORCH = """        import torch

        self.buf = torch.ones(8 << 20, device="cuda")
"""
ALLOC_DRIVER = """        import ctypes

        from torpor import gpu

        driver = gpu.Driver.loaded
        self.ptr = ctypes.c_uint64()
        driver.check("cuMemAlloc_v2", driver.lib.cuMemAlloc_v2(ctypes.byref(self.ptr), ctypes.c_size_t(32 << 20)))
"""
# The one line every GPU-memory failure must carry (the restore's check and the driver's
# out-of-memory both name it; so does a deploy's).
GPU_MEMORY_LINE = "free GPU memory"
HIBERNATION = crash.HIBERNATION_POINTS
REDEPLOY = ["load", "dump_function", "stage"]
CRIU_SWITCHES = [("CRIU_FAULT", "1"), ("TORPOR_FAULT", "after-dump")]
# Where a cold start's or a wake's restore is interrupted: inside CRIU (held at its pre-resume
# notification, `TORPOR_DELAY`), or after CRIU restored the tree, before it is adopted
# (`TORPORD_DELAY=restored` / `woken`).
RESTORE_POINTS = ["in_criu", "restored"]
# `early`: inside CRIU's restore just after it forked the restored root (caught by watching).
EARLY = "early"
FIRST_DEPLOY = ["boot_base", "snapshot_base", "restore_base", "load"]




class Hog:
    """Another process holding all but HOG_LEAVES of the real GPU's memory, until `release`."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line.startswith("holding"), f"the GPU hog did not start: {line!r}"

    def release(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        time.sleep(1.0)  # the driver frees a dead process's memory shortly after it is reaped


class FakeNvml:
    """tests/fakes/fake_nvml.c built under `root` (fake_gpu_env builds the fake libcuda itself)."""

    def __init__(self, root: Path) -> None:
        self.nvml = root / "nvml" / "libnvidia-ml.so.1"
        self.nvml.parent.mkdir(parents=True)
        cc = shutil.which("cc") or shutil.which("gcc")
        assert cc, "no C compiler to build tests/fakes (apt-get install gcc)"
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(self.nvml), str(ROOT / "tests/fakes/fake_nvml.c")], check=True)


class Bench:
    def __init__(self, binary: Path, root: Path, gpu: str = "", split_gpu: bool = False) -> None:
        """`gpu`: "" (CPU functions), "fake" (GPU functions on tests/fakes' GPU) or "real";
        `split_gpu`: on the real GPU, the split path (else the transparent one, whose undo of an
        interrupted GPU hibernation is what the soak checks)."""
        root.mkdir(parents=True, exist_ok=True)
        self.gpu = gpu
        if gpu == "fake":
            env = fake_gpu_env(
                root,
                FakeNvml(root),  # type: ignore[arg-type]
                FAKE_CUDA_TOTAL_MEM=str(1024 * MIB),
                FAKE_NVML_PROCS_MATCH=f"torpor.worker:{64 * MIB}",
            )
            self.d = Torpord(binary, root, config="split = false\n", env=env, queue_timeout_s=3)
        elif gpu == "real":
            self.d = Torpord(binary, root, config=f"split_gpu = {str(split_gpu).lower()}\n", queue_timeout_s=3)
        else:
            self.d = Torpord(binary, root)
        # The daemon's own variables, which every restart keeps (a fault's are added to them).
        self.base_env = dict(self.d.env)
        self.tmp = root / "functions"
        self.tmp.mkdir()
        self.versions: dict[str, int] = {}
        self.attempts: dict[str, int] = {}

    def function_dir(self, name: str, version: int, keepalive: str = "") -> Path:
        """The echoer answering `version`; with a GPU, a GPU function that holds 32 MiB of it."""
        torch = self.gpu == "real"
        d = crash.function_dir(self.tmp, name, ["torch"] if torch else [], version, keepalive)
        if self.gpu:
            handler = d / "handler.py"
            setup = '        print("echoer setup", flush=True)\n'
            text = handler.read_text()
            assert setup in text, "the echoer's setup changed: update bench/reliability/run.py"
            handler.write_text(text.replace(setup, ALLOC_TORCH if torch else ALLOC_DRIVER))
            toml = d / "torpor.toml"
            gpu_keys = 'gpus = 1\ngpu_memory = "64MiB"\nload_timeout_s = 120\n'
            toml.write_text(toml.read_text().replace("timeout_s = 30\n", "timeout_s = 30\n" + gpu_keys, 1))
        return d

    # -- GPU memory -----------------------------------------------------------------------------

    def fill_gpu(self, *switches: str) -> Callable[[], None]:
        """Takes the GPU's memory away (the fake driver's `switches` answer out of memory, or a
        hog process holds the real GPU's); returns what gives it back."""
        if self.gpu == "real":
            return Hog().release
        lib_dir = self.d.state / "fake-cuda"
        for name in switches:
            (lib_dir / name).write_text("2")

        def release() -> None:
            for name in switches:
                (lib_dir / name).unlink(missing_ok=True)

        return release

    # -- checks ---------------------------------------------------------------------------------

    def stray(self, settle_s: float = 5.0) -> list[str]:
        """Processes of the daemon's it does not list, still there after `settle_s` (a restore's
        CRIU lazy-pages server, not in the instance's tree, leaves once its pages are served)."""
        deadline = time.monotonic() + settle_s
        while True:
            listed = crash.listed_pids(self.d)
            pids = [
                p for p in crash.daemon_processes(self.d.state) if p != self.d.proc.pid and not crash.in_tree(p, listed)
            ]
            if not pids or time.monotonic() > deadline:
                return crash.describe(pids).split("; ") if pids else []
            time.sleep(0.05)

    def invalid_snapshots(self) -> int:
        bad = 0
        key = self.d.state / "snapshot.key"
        for (path,) in crash.registry(self.d, "SELECT path FROM snapshots"):
            r = subprocess.run([str(self.d.binary), "verify", "--key", str(key), path], capture_output=True, check=False)
            bad += r.returncode != 0
        return bad

    def stray_snapshots(self) -> int:
        try:
            crash.assert_no_stray_snapshots(self.d)
        except AssertionError:
            return 1
        return 0

    def answers(self, name: str) -> bool:
        try:
            r = self.d.invoke(name, {"say": "hi"}, timeout=60)
            return r.status == 200 and r.json().get("version") == self.versions[name]
        except (OSError, ValueError):
            return False

    def recovered(self, name: str, t0: float) -> tuple[int, float]:
        """(lost requests, seconds until it answered): one request, retried only while nothing
        was sent (the socket not there yet)."""
        ok = self.answers(name)
        return (0 if ok else 1), time.monotonic() - t0

    def deploy(self, name: str, version: int, keepalive: str = "") -> None:
        self.d.deploy(self.function_dir(name, version, keepalive))
        self.versions[name] = version

    def restart(self, env: dict[str, str] | None = None) -> None:
        if self.d.proc.poll() is None:
            assert self.d.request("GET", "/v1/functions").status == 200
            self.d.proc.send_signal(signal.SIGTERM)
            self.d.proc.wait(timeout=30)
        self.d.env = {**self.base_env, **(env or {})}
        self.d.restart()

    # -- faults ---------------------------------------------------------------------------------

    def hibernate_kill(self, point: str) -> dict[str, Any]:
        name = "rel-hib"
        if name not in self.versions:
            self.deploy(name, 1, crash.KEEPALIVE)
        # A graceful restart first, as each round of the crash test ends with one: the stop
        # ends the live instances, so the request below starts the only one (an instance still
        # hibernating from the last run would make the request start a second).
        self.restart({"TORPORD_HOLD": "" if point == "in_dump" else f"hibernate:{point}"})
        iid, pid = crash.crash_hibernation(self.d, name, point)
        self.d.env = dict(self.base_env)
        t0 = time.monotonic()
        self.d.restart()
        listed = False
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not listed:
            listed = any(i["id"] == iid for i in self.d.instances(name))
            if not listed:
                time.sleep(0.02)
        outcome = "undone" if pid in crash.listed_pids(self.d) else "finished" if listed else "dropped"
        lost, secs = self.recovered(name, t0)
        stray = self.stray()
        return {
            "outcome": outcome,
            "harmed_sources": int(not listed or bool(stray)),
            "lost_requests": lost,
            "recovery_s": round(secs, 3),
            "stray_processes": stray,
        }

    def redeploy_kill(self, point: str) -> dict[str, Any]:
        name = f"rel-re-{point.replace('_', '-')}"
        if name not in self.versions:
            self.deploy(name, 1)
        # A new version each attempt (one that did not take effect leaves its directory).
        self.attempts[name] = self.attempts.get(name, 1) + 1
        new = self.attempts[name]
        crash.deploy_until(self.d, self.function_dir(name, new), point)
        t0 = time.monotonic()
        self.d.restart()
        if point in crash.TAKEN:
            self.versions[name] = new
        lost, secs = self.recovered(name, t0)
        stray = self.stray()
        return {
            "outcome": crash.state_of(self.d, name),
            "harmed_sources": int(bool(stray)),
            "lost_requests": lost,
            "recovery_s": round(secs, 3),
            "stray_processes": stray,
        }

    def worker_kill(self) -> dict[str, Any]:
        name = "rel-worker"
        if name not in self.versions:
            self.deploy(name, 1)
        lost = 0 if self.answers(name) else 1
        (inst,) = [i for i in self.d.instances(name) if i.get("pid")]
        init = int(inst["pid"])
        kids = Path(f"/proc/{init}/task/{init}/children").read_text().split()
        t0 = time.monotonic()
        os.kill(int(kids[0]), signal.SIGKILL)
        crash.wait_until(lambda: inst["id"] not in [i["id"] for i in self.d.instances(name)], 15, "the instance to go")
        more, secs = self.recovered(name, t0)
        stray = self.stray()
        return {
            "outcome": "replaced",
            "harmed_sources": int(bool(stray)),
            "lost_requests": lost + more,
            "recovery_s": round(secs, 3),
            "stray_processes": stray,
        }

    def criu_fault(self, switch: tuple[str, str]) -> dict[str, Any]:
        name = "rel-criu"
        if name not in self.versions:
            self.deploy(name, 1, crash.KEEPALIVE)
        self.restart({switch[0]: switch[1]})
        assert self.answers(name)
        before = self.d.log.read_text(errors="replace").count("hibernation failed")
        crash.wait_until(
            lambda: self.d.log.read_text(errors="replace").count("hibernation failed") > before,
            30,
            "the hibernation to fail",
        )
        stray = self.stray()
        t0 = time.monotonic()
        self.restart({})
        lost, secs = self.recovered(name, t0)
        stray += self.stray()
        return {
            # The failed hibernation removes its instance (logged); the function serves on.
            "outcome": "instance_removed",
            "harmed_sources": int(bool(stray)),
            "lost_requests": lost,
            "recovery_s": round(secs, 3),
            "stray_processes": stray,
        }

    def gpu_oom_restore(self) -> dict[str, Any]:
        name = "rel-gpu-restore"
        if name not in self.versions:
            self.deploy(name, 1)
        # A graceful restart ends the live instances: the request below must start one.
        self.restart({})
        release = self.fill_gpu("FAKE_CUDA_RESTORE_RESULT")
        try:
            r = self.d.invoke(name, {"say": "hi"}, timeout=120)
            stray = self.stray()
            listed = self.d.instances(name)
        finally:
            release()
        body = r.body.decode(errors="replace")
        clear = r.status == 503 and GPU_MEMORY_LINE in body and "\n" not in body.strip()
        t0 = time.monotonic()
        lost, secs = self.recovered(name, t0)
        return {
            "outcome": "waited_503" if clear else f"answered {r.status}: {body[:300]}",
            "harmed_sources": int(bool(stray) or bool(listed)),
            # The request the fault hit must get the clear 503; the one after, the answer.
            "lost_requests": lost + int(not clear),
            "recovery_s": round(secs, 3),
            "stray_processes": stray,
        }

    def gpu_oom_deploy(self) -> dict[str, Any]:
        name = "rel-gpu-deploy"
        if name not in self.versions:
            self.deploy(name, 1)
        self.attempts[name] = self.attempts.get(name, 1) + 1
        if self.gpu == "real":
            # End the live instances first: one stepping down to "GPU released in place" while the
            # hog holds the GPU frees its memory under the hog, and the redeploy then fits (seen on
            # the H100 in session 24: a deploy that succeeded, then counted as lost requests).
            self.restart({})
        release = self.fill_gpu("FAKE_CUDA_MEM_ALLOC_RESULT", "FAKE_CUDA_MEM_CREATE_RESULT")
        try:
            r = self.d.cli("deploy", self.function_dir(name, self.attempts[name]), timeout=300)
            stray = self.stray()
        finally:
            release()
        lines = r.stderr.strip().splitlines()
        clear = r.returncode != 0 and bool(lines) and GPU_MEMORY_LINE in lines[-1]
        if r.returncode == 0:
            # The fault did not happen (the GPU had room after all): the new version serves, and
            # the check below must expect it, or every later run counts its answer as lost.
            self.versions[name] = self.attempts[name]
        t0 = time.monotonic()
        # The previous deploy serves on (self.versions still names it).
        lost, secs = self.recovered(name, t0)
        return {
            "outcome": "refused" if clear else f"deploy exited {r.returncode}: {(lines or [''])[-1][:300]}",
            "harmed_sources": int(bool(stray)),
            # A deploy that found room is a run the fault missed, not a request lost.
            "lost_requests": lost + int(not clear and r.returncode != 0),
            "not_exercised": int(r.returncode == 0),
            "recovery_s": round(secs, 3),
            "stray_processes": stray,
        }

    # -- kills during restores, wakes and dumps (tests/daemon/test_daemon_faults.py) ----------

    def strict_stray(self) -> list[str]:
        """Processes of the daemon's outside the instances it lists, counting those in its
        cgroups that lost its environment marker (what a killed CRIU had half restored)."""
        pids = faults_t.strays(self.d)
        return crash.describe(pids).split("; ") if pids else []

    def held(self, delay: str) -> None:
        """A graceful restart with the switch that holds restores (`TORPOR_DELAY=criu-...` or
        `TORPORD_DELAY=...`; "" for none)."""
        env = {}
        if delay.startswith("criu-"):
            env["TORPOR_DELAY"] = delay
        elif delay:
            env["TORPORD_DELAY"] = delay
        self.restart(env)

    def hibernated(self, name: str) -> str:
        if name not in self.versions:
            self.deploy(name, 1, crash.KEEPALIVE)
        if not any(r[1] == "hibernated" for r in crash.instance_rows(self.d, name)):
            self.restart({})
            faults_t.hibernated(self.d, name)
        (iid,) = [r[0] for r in crash.instance_rows(self.d, name) if r[1] == "hibernated"]
        return str(iid)

    def restore_kill(self, point: str, wake: bool) -> dict[str, Any]:
        """kill -9 of torpord in a cold start's (or a wake's) restore at `point`, then a restart.
        A wake must leave the instance hibernated, its snapshot kept, and the request after the
        restart must wake that very instance."""
        name = "rel-wake" if wake else "rel-restore"
        iid = self.hibernated(name) if wake else None
        if not wake and name not in self.versions:
            self.deploy(name, 1)
        mark = "woken" if wake else "restored"
        self.held({"in_criu": faults_t.IN_CRIU, "early": ""}.get(point, f"{mark}:60000"))
        before = faults_t.delays_seen(self.d, mark)
        req = faults_t.InFlight(self.d, name)
        caught = True
        if point == "in_criu":
            faults_t.helper_of(self.d, " swrk ", forks=1)
        elif point == "early":
            # CRIU with its helper and the restored root just forked (watched: no switch holds
            # CRIU there); a restore that ended first is counted `not_caught`.
            try:
                faults_t.helper_of(self.d, " swrk ", timeout=10, forks=2, until=lambda: not req.thread.is_alive())
            except AssertionError:
                caught = False
        else:
            crash.wait_until(faults_t.delayed(self.d, mark, before), 30, "the restore to be held")
        crash.kill_daemon(self.d)
        req.answer()
        self.d.env = dict(self.base_env)
        t0 = time.monotonic()
        self.d.restart()
        kept = True
        if wake:
            kept = [(r[0], r[1]) for r in crash.instance_rows(self.d, name)] == [(iid, "hibernated")]
        lost, secs = self.recovered(name, t0)
        if wake:
            kept = kept and iid in [i["id"] for i in self.d.instances(name)]
        stray = self.strict_stray()
        return {
            "outcome": ("" if caught else "not_caught: ")
            + (("woke_the_kept_instance" if kept else "instance_lost") if wake else "served"),
            "harmed_sources": int(bool(stray) or not kept),
            "lost_requests": lost,
            "recovery_s": round(secs, 3),
            "stray_processes": stray,
        }

    def answered_row(self, name: str, out: Any, t0: float, outcome_pre: str = "") -> dict[str, Any]:
        """The row of a fault whose request `out` must be answered or refused in one line; then
        nothing stray, and the next request (after `t0`) answered."""
        ok = faults_t.answered_or_error_line(out)
        stray = self.strict_stray()
        more, secs = self.recovered(name, t0)
        status = out.status if isinstance(out, faults_t.Answer) else type(out).__name__
        return {
            "outcome": f"{outcome_pre}answered {status}",
            "harmed_sources": int(bool(stray)),
            "lost_requests": more + int(not ok),
            "recovery_s": round(secs, 3),
            "stray_processes": stray,
        }

    def criu_kill_restore(self, point: str) -> dict[str, Any]:
        """kill -9 of CRIU in a cold start's restore: `early` (caught with its forks, before the
        restored root has its own descriptors) or `in_criu` (held at pre-resume). The request
        it hit must be served (a booted instance) or refused in one line, never hang."""
        name = "rel-restore"
        if name not in self.versions:
            self.deploy(name, 1)
        t0 = time.monotonic()
        if point == "early":
            killed, outs = faults_t.kill_criu_early_in_a_restore(self.d, name)
            out = outs[-1]
            outcome_pre = "" if killed else "not_caught: "
        else:
            self.held(faults_t.IN_CRIU)
            req = faults_t.InFlight(self.d, name)
            os.kill(faults_t.helper_of(self.d, " swrk ", forks=1), signal.SIGKILL)
            out = req.answer()
            self.restart({})
            outcome_pre = ""
        return self.answered_row(name, out, t0, outcome_pre)

    def page_server_kill(self) -> dict[str, Any]:
        """kill -9 of Torpor's page server (a lazy restore's helper) while CRIU restores through
        it: the restore fails naming it, the request is served by a booted instance."""
        name = "rel-restore"
        if name not in self.versions:
            self.deploy(name, 1)
        self.held(faults_t.IN_CRIU_BRIEFLY)
        t0 = time.monotonic()
        req = faults_t.InFlight(self.d, name)
        faults_t.helper_of(self.d, " swrk ", forks=1)
        os.kill(faults_t.helper_of(self.d, "__page-server"), signal.SIGKILL)
        out = req.answer()
        self.restart({})
        return self.answered_row(name, out, t0)

    def instance_pids(self) -> set[int]:
        """The processes of the daemon's cgroups and every instance's init (`torpor-init-N`): a
        node whose cgroups lack controllers (the GPU machine's) runs workers unconfined, without
        an instance cgroup to find them in."""
        inits: set[int] = set()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if (entry / "comm").read_text().startswith("torpor-init"):
                        inits.add(int(entry.name))
                except OSError:
                    continue
        return faults_t.cgroup_pids(self.d.state) | inits

    def worker_kill_restore(self, wake: bool) -> dict[str, Any]:
        """kill -9 of the restored worker before its hello (a cold start, a wake): the request is
        answered, nothing is left."""
        name = "rel-wake" if wake else "rel-restore"
        if wake:
            self.hibernated(name)
        elif name not in self.versions:
            self.deploy(name, 1)
        mark = "woken" if wake else "restored"
        self.held(f"{mark}:3000")
        before = faults_t.delays_seen(self.d, mark)
        known = self.instance_pids()
        t0 = time.monotonic()
        req = faults_t.InFlight(self.d, name)
        crash.wait_until(faults_t.delayed(self.d, mark, before), 30, "the restore to be held")
        new = [p for p in self.instance_pids() - known if faults_t.children(p)]
        os.kill(faults_t.worker_of(new[0]), signal.SIGKILL)
        out = req.answer()
        self.restart({})
        return self.answered_row(name, out, t0)

    def first_deploy_kill(self, point: str) -> dict[str, Any]:
        """kill -9 of torpord at a first deploy's phase: the restart leaves nothing, the function
        is failed (or unknown), and a new deploy of it succeeds."""
        self.attempts["first"] = self.attempts.get("first", 0) + 1
        name = f"rel-first-{point.replace('_', '-')}-{self.attempts['first']}"
        # A base of its own where the kill comes before the base exists: a preload set no
        # earlier run had (the attempt number's bits pick stdlib modules).
        k = self.attempts["first"]
        preload = [m for i, m in enumerate(crash.STDLIB) if k >> i & 1] if "base" in point else []
        fdir = crash.function_dir(self.tmp, name, preload, 1)
        crash.deploy_until(self.d, fdir, point)
        t0 = time.monotonic()
        self.d.restart()
        state = crash.state_of(self.d, name)
        stray = self.strict_stray()
        snaps = self.stray_snapshots()
        self.d.deploy(crash.function_dir(self.tmp, name, [], 2))
        self.versions[name] = 2
        lost, secs = self.recovered(name, t0)
        self.d.cli("rm", name)
        self.versions.pop(name)
        return {
            "outcome": f"then {state}, redeployed",
            "harmed_sources": int(bool(stray) or bool(snaps)),
            "lost_requests": lost,
            "recovery_s": round(secs, 3),
            "stray_processes": stray,
        }

    def criu_kill_dump(self, what: str) -> dict[str, Any]:
        """kill -9 of CRIU inside a dump: a hibernation's (its half-written directory seen; the
        source must keep serving or sleep from a good snapshot) or a redeploy's function
        snapshot (the previous deploy must keep serving)."""
        if what == "hibernate":
            name = "rel-criu-dump"
            if name not in self.versions:
                self.deploy(name, 1, crash.KEEPALIVE)
            self.restart({})
            assert self.answers(name)
            crash.poll(crash.partial_in(self.d, "hib-"), 30, "the hibernation's CRIU dump")
        else:
            name = "rel-criu-redeploy"
            if name not in self.versions:
                self.deploy(name, 1)
            self.attempts[name] = self.attempts.get(name, 1) + 1
            p = subprocess.Popen(
                [str(self.d.binary), "deploy", str(self.function_dir(name, self.attempts[name]))],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                env=dict(os.environ, TORPOR_SOCKET=str(self.d.socket)),
            )
            crash.poll(crash.partial_in(self.d, "fn-"), 60, "the function snapshot's CRIU dump")
        t0 = time.monotonic()
        failed_before = self.d.log.read_text(errors="replace").count("hibernation failed")
        criu = faults_t.helper_of(self.d, " swrk ", timeout=5)
        os.kill(criu, signal.SIGKILL)
        outcome = "killed"
        deploy_error = ""
        if what == "deploy":
            _, err = p.communicate(timeout=120)
            lines = err.strip().splitlines()
            deploy_error = (lines or [""])[-1][:300]
            outcome = "refused_previous_serves" if p.returncode != 0 else "deployed"
            if p.returncode == 0:
                self.versions[name] = self.attempts[name]
        else:
            crash.wait_until(
                lambda: self.d.log.read_text(errors="replace").count("hibernation failed") > failed_before,
                30,
                "the hibernation to fail",
            )
            outcome = "hibernation failed, instance removed"
        lost, secs = self.recovered(name, t0)
        stray = self.strict_stray()
        row = {
            "outcome": outcome,
            "harmed_sources": int(bool(stray)),
            "lost_requests": lost,
            "recovery_s": round(secs, 3),
            "stray_processes": stray,
        }
        if what == "deploy":
            row["deploy_error"] = deploy_error
        return row

    def worker_kill_quiesce(self) -> dict[str, Any]:
        """kill -9 of the worker while its hibernation holds at `quiesce`: the instance is
        removed, nothing is left, the function answers."""
        name = "rel-quiesce"
        if name not in self.versions:
            self.deploy(name, 1, crash.KEEPALIVE)
        self.restart({"TORPORD_HOLD": "hibernate:quiesce"})
        assert self.answers(name)
        rows = [r for r in crash.instance_rows(self.d, name) if r[2] is not None]
        crash.poll(crash.journal_step(self.d, "quiesce"), 30, "the hibernation's quiesce")
        init = int(rows[0][2])
        t0 = time.monotonic()
        os.kill(faults_t.worker_of(init), signal.SIGKILL)
        crash.wait_until(lambda: crash.gone(init), 15, "the instance's tree to go")
        lost, secs = self.recovered(name, t0)
        stray = self.strict_stray()
        self.restart({})
        stray += self.strict_stray()
        return {
            "outcome": "instance_removed",
            "harmed_sources": int(bool(stray)),
            "lost_requests": lost,
            "recovery_s": round(secs, 3),
            "stray_processes": stray,
        }

    def run(self, fault: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        t = time.monotonic()
        try:
            row = fault()
        except Exception as e:  # a run that could not even be checked is harm, reported
            row = {"outcome": f"error: {type(e).__name__}: {str(e)[:300]}", "harmed_sources": 1, "lost_requests": 1}
            # A fresh daemon (a graceful stop ends the live instances) for the next run.
            try:
                self.restart({})
            except Exception:  # noqa: BLE001 (a daemon that will not stop is killed)
                self.d.proc.kill()
                self.d.proc.wait()
                self.d.env = dict(self.base_env)
                self.d.restart()
        if row["harmed_sources"] or row["lost_requests"]:
            # What the daemon said, for whoever reads the report.
            row["log_tail"] = self.d.log.read_text(errors="replace").splitlines()[-40:]
        row["invalid_snapshots_accepted"] = self.invalid_snapshots()
        row["stray_snapshots"] = self.stray_snapshots()
        row["seconds"] = round(time.monotonic() - t, 3)
        return row


def faults(b: Bench, gpu_bench: Callable[[], Bench]) -> dict[str, Callable[[], dict[str, Any]]]:
    """Every fault by name; the GPU-memory ones on `gpu_bench()` (made when first needed)."""
    out: dict[str, Callable[[], dict[str, Any]]] = {}

    def on_b(fault: Callable[..., dict[str, Any]], *args: Any) -> Callable[[], dict[str, Any]]:
        return lambda: b.run(functools.partial(fault, *args))

    for p in HIBERNATION:
        out[f"daemon_kill_hibernate_{p}"] = on_b(b.hibernate_kill, p)
    for p in REDEPLOY:
        out[f"daemon_kill_redeploy_{p}"] = on_b(b.redeploy_kill, p)
    out["worker_kill"] = on_b(b.worker_kill)
    for s in CRIU_SWITCHES:
        out[f"criu_fault_hibernate_{s[0]}={s[1]}"] = on_b(b.criu_fault, s)
    for p in RESTORE_POINTS:
        out[f"daemon_kill_restore_{p}"] = on_b(b.restore_kill, p, False)
        out[f"daemon_kill_wake_{p}"] = on_b(b.restore_kill, p, True)
    out["daemon_kill_restore_early"] = on_b(b.restore_kill, EARLY, False)
    for p in ["early", "in_criu"]:
        out[f"criu_kill_restore_{p}"] = on_b(b.criu_kill_restore, p)
    out["criu_kill_hibernate_dump"] = on_b(b.criu_kill_dump, "hibernate")
    out["criu_kill_redeploy_dump"] = on_b(b.criu_kill_dump, "deploy")
    out["page_server_kill_restore"] = on_b(b.page_server_kill)
    out["worker_kill_restore"] = on_b(b.worker_kill_restore, False)
    out["worker_kill_wake"] = on_b(b.worker_kill_restore, True)
    out["worker_kill_quiesce"] = on_b(b.worker_kill_quiesce)
    for p in FIRST_DEPLOY:
        out[f"daemon_kill_first_deploy_{p}"] = on_b(b.first_deploy_kill, p)
    out["gpu_oom_restore"] = lambda: gpu_bench().run(gpu_bench().gpu_oom_restore)
    out["gpu_oom_deploy"] = lambda: gpu_bench().run(gpu_bench().gpu_oom_deploy)
    return out


def median(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return round(statistics.median(vals), 3) if vals else None


def read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def fuzz_part() -> dict[str, Any] | None:
    doc = read(RESULTS / "fuzz.json")
    if doc is None:
        return None
    return {
        "source": "bench/results/fuzz.json (bench/reliability/fuzz.py)",
        "executions": doc["executions"],
        "findings": doc["findings"],
        "fixed_findings": len(doc.get("fixed_findings", [])),
        "targets": len(doc["targets"]),
    }


def load_part() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path in sorted(RESULTS.glob("reliability-load*.json")):
        doc = read(path)
        assert doc is not None
        out[path.stem] = {
            "source": f"bench/results/{path.name} (bench/reliability/load.py)",
            "restart": doc["settings"]["restart"]["mode"],
            "invocations": doc["summary"]["invocations"],
            "lost_requests": doc["summary"]["lost_requests"],
            "duplicated_requests": doc["summary"]["duplicated_requests"],
            "wrong_answers": doc["summary"]["wrong_answers"],
            "errors": doc["summary"]["errors"],
            "throughput_rps": doc["throughput_rps"],
            "p50_ms": doc["summary"]["p50_ms"],
            "p99_ms": doc["summary"]["p99_ms"],
            # Whether its clients sent Idempotency-Keys and retried a reset request with them
            # (runs before keys existed had none).
            "idempotency_keys": bool(doc["settings"].get("idempotency_keys", False)),
            "commit": doc["machine"].get("commit"),
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--torpor", default=os.environ.get("TORPOR_BIN", str(ROOT / "target/debug/torpor")))
    p.add_argument("--runs", type=int, default=2, help="runs per fault (20 for the soak)")
    p.add_argument("--only", action="append", default=[], help="run only this fault (repeatable)")
    p.add_argument("--out", default=None, help=f"default {OUT} ({OUT_GPU} with --gpu)")
    p.add_argument("--gpu", action="store_true", help="every fault with a GPU function on this machine's real GPU")
    p.add_argument("--split-gpu", action="store_true", help="with --gpu: the split path (default: transparent)")
    p.add_argument("--budget-s", type=float, default=None, help="start no run after this many seconds")
    p.add_argument(
        "--refresh",
        action="store_true",
        help="force no fault: rewrite the output file with its faults as they are and the fuzz and load results read again",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the faults of the existing output file that this run did not force (their rows, settings and wall time)",
    )
    args = p.parse_args()
    if os.geteuid() != 0:
        p.error("needs root: torpord starts workers in namespaces and runs CRIU")
    out_path = Path(args.out) if args.out else OUT_GPU if args.gpu else OUT
    binary = Path(args.torpor).resolve()
    t = time.monotonic()
    results: dict[str, Any] = {}
    if args.refresh:
        args.merge = True
    with tempfile.TemporaryDirectory(prefix="torpor-reliability-") as tmp:
        if args.refresh:
            return write(args, out_path, binary, {}, time.monotonic() - t)
        b = Bench(binary, Path(tmp) / "main", "real" if args.gpu else "", args.split_gpu)
        benches = [b]

        def gpu_bench() -> Bench:
            # The real GPU's bench is the main one; the fake GPU's, a daemon of its own.
            if len(benches) == 1 and not args.gpu:
                benches.append(Bench(binary, Path(tmp) / "fake-gpu", "fake"))
            return benches[-1]

        try:
            table = faults(b, gpu_bench)
            unknown = set(args.only) - set(table)
            if unknown:
                p.error(f"no such fault: {', '.join(sorted(unknown))}; there are {', '.join(table)}")
            chosen = [n for n in table if not args.only or n in args.only]
            for k, name in enumerate(chosen):
                fault = table[name]
                # The budget is shared out: each fault gets an equal part of what is left.
                share = None if args.budget_s is None else (args.budget_s - (time.monotonic() - t)) / (len(chosen) - k)
                t_fault = time.monotonic()
                rows = []
                for i in range(args.runs):
                    if share is not None and time.monotonic() - t_fault > share:
                        print(f"{name}: its share of the budget ({share:.0f} s) is spent after {i} runs", flush=True)
                        break
                    row = fault()
                    print(f"{name} run {i + 1}/{args.runs}: {json.dumps(row)}", flush=True)
                    rows.append(row)
                if not rows:
                    continue
                results[name] = {
                    "runs": len(rows),
                    "harmed_sources": sum(r["harmed_sources"] for r in rows),
                    "invalid_snapshots_accepted": sum(r["invalid_snapshots_accepted"] for r in rows),
                    "lost_requests": sum(r["lost_requests"] for r in rows),
                    # Runs whose fault did not take (e.g. the GPU had room after all).
                    "not_exercised": sum(r.get("not_exercised", 0) for r in rows),
                    "median_recovery_s": median(rows, "recovery_s"),
                    "median_run_s": median(rows, "seconds"),
                    "every_run": rows,
                }
        finally:
            for bench in benches:
                bench.d.stop()
    return write(args, out_path, binary, results, time.monotonic() - t)


def write(args: argparse.Namespace, out_path: Path, binary: Path, results: dict[str, Any], took_s: float) -> int:
    """Writes the output file: these faults' results (after the earlier ones, with --merge),
    the fuzz and load results, the summary."""
    fuzz, load = fuzz_part(), load_part()
    earlier = read(out_path) if args.merge else None
    forced = bool(results)
    wall_s = round(took_s, 1)
    if earlier is not None:
        # The new faults after the earlier ones; a fault forced again replaces its rows.
        results = {**{k: v for k, v in earlier["faults"].items() if k not in results}, **results}
        wall_s = round(wall_s + float(earlier.get("wall_s") or 0), 1)
    summary = {
        "faults": len(results),
        "runs": sum(r["runs"] for r in results.values()),
        "harmed_sources": sum(r["harmed_sources"] for r in results.values()),
        "invalid_snapshots_accepted": sum(r["invalid_snapshots_accepted"] for r in results.values()),
        # Lost under faults, plus the load tests': requests sent that never ran nor answered.
        # The load tests whose clients retry with Idempotency-Keys, as docs/torpord.md tells
        # clients to; a client without keys cannot retry a reset request, and the kill -9
        # loses those the dead daemon held (`lost_requests_without_keys`, the baseline).
        "lost_requests": sum(r["lost_requests"] for r in results.values())
        + sum(v["lost_requests"] for v in load.values() if v["idempotency_keys"]),
        "lost_requests_without_keys": sum(v["lost_requests"] for v in load.values() if not v["idempotency_keys"]),
        "lost_requests_under_faults": sum(r["lost_requests"] for r in results.values()),
        "runs_not_exercised": sum(r.get("not_exercised", 0) for r in results.values()),
        "fuzz_executions": fuzz["executions"] if fuzz else None,
        "fuzz_findings": fuzz["findings"] if fuzz else None,
    }
    doc = {
        "what": "faults forced through the real daemon, workers and CRIU; fuzz and load results (docs/reliability.md)",
        "settings": {
            "runs": args.runs,
            "only": args.only or None,
            "gpu": args.gpu,
            "split_gpu": args.split_gpu if args.gpu else None,
            "budget_s": args.budget_s,
            "merged": bool(earlier),
        },
        "machine": machine(binary),
        "wall_s": wall_s,
        "faults": results,
        "fuzz": fuzz,
        "load": load,
        "summary": summary,
    }
    if earlier is not None and not forced:
        # Nothing forced (--refresh): the faults' settings and machine stay theirs.
        doc["settings"], doc["machine"] = earlier["settings"], earlier["machine"]
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary))
    return 0 if summary["harmed_sources"] == summary["invalid_snapshots_accepted"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
