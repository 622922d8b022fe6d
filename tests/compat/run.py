"""The compatibility suite: real programs of different kinds through `torpor run/snapshot/restore`,
and functions through `torpor deploy/invoke`, each checking its own answers before and after.

    python3 tests/compat/run.py [--out bench/results/compat-h100.json] [--only NAME,...]

For each program in tests/compat/programs/ (its REQUIRES and EXPECT are read from the file):
start it with `torpor run`, ask `check` (the reference answer, computed at start, and one computed
again), `torpor snapshot` it (the source is killed when that succeeds), `torpor restore` the
snapshot and ask `check` again. A program ends in one of:

- restored_identical: the restored process answers "ok" with the reference digest;
- refused_cleanly: the snapshot failed with one error line and the source still answers "ok";
- unhandled: neither (the restore failed or answered differently, or the check failed);
- skipped: a package it REQUIRES is missing, or there is no GPU, or the time budget ran out.

harmed_sources counts refusals after which the source no longer answers. Then each function in
tests/compat/functions/ is deployed on a fresh daemon, once on the transparent path and once on
the split path, and invoked twice on each (a cold start from its snapshot, then warm):
deployable when, on every path, both answers are ok and equal.

One program's failure never stops the others: every step has a timeout, every tree is killed
after its program, and the suite stops starting programs when --budget-s is spent.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PROGRAMS = HERE / "programs"
FUNCTIONS = HERE / "functions"
sys.path.insert(0, str(ROOT / "tests" / "programs"))

from linesrv import Endpoint, request

PYTHON = shutil.which("python3") or sys.executable


def find_torpor() -> Path:
    env = os.environ.get("TORPOR_BIN")
    if env:
        return Path(env)
    for p in (ROOT / "target/release/torpor", ROOT / "target/debug/torpor"):
        if p.exists():
            return p
    raise SystemExit("compat: no torpor binary: set TORPOR_BIN or build it (cargo build)")


def declared(path: Path) -> dict[str, Any]:
    """A program's REQUIRES, EXPECT, GPU (default True) and RESTORES (default 1), and its
    docstring's first line, read without importing it."""
    tree = ast.parse(path.read_text())
    found: dict[str, Any] = {"REQUIRES": (), "EXPECT": "identical", "GPU": True, "RESTORES": 1}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id in found:
            found[target.id] = ast.literal_eval(value)
    return {
        "requires": tuple(found["REQUIRES"]),
        "expect": str(found["EXPECT"]),
        "gpu": bool(found["GPU"]),
        "restores": int(found["RESTORES"]),
        "what": (ast.get_docstring(tree) or "").split("\n")[0],
    }


def missing_packages(requires: tuple[str, ...]) -> list[str]:
    return [name for name in requires if importlib.util.find_spec(name) is None]


def have_gpu() -> bool:
    return Path("/dev/nvidiactl").exists() and shutil.which("nvidia-smi") is not None


def error_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith("torpor: error:")]
    return lines[-1] if lines else text.strip()[-2000:]


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(x) for x in f.read().split()]
                out += kids
                todo += kids
        except OSError:
            pass
    return out


def kill_tree(pid: int | None) -> None:
    if not pid:
        return
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


class Torpor:
    def __init__(self, binary: Path, env: dict[str, str]) -> None:
        self.binary = binary
        self.env = env

    def __call__(self, *args: object, timeout: float) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [str(self.binary), *map(str, args)],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=self.env,
                check=False,
            )
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            return subprocess.CompletedProcess(e.cmd, 124, out, err + f"\ntimed out after {timeout} s")


def ask(endpoint: Endpoint, word: str, wait: float, timeout: float) -> str:
    try:
        return request(endpoint, [word], wait=wait, timeout=timeout)
    except Exception as e:  # a dead or stuck program is an answer too  # noqa: BLE001
        return f"no answer: {type(e).__name__}: {e}"


def run_program(torpor: Torpor, path: Path, work: Path, step_s: float) -> dict[str, Any]:
    d = declared(path)
    requires, expect = d["requires"], d["expect"]
    name = path.stem
    row: dict[str, Any] = {"program": name, "what": d["what"], "requires": list(requires), "expect": expect}
    missing = missing_packages(requires)
    if missing:
        return {**row, "outcome": "skipped", "reason": f"missing packages: {', '.join(missing)}"}
    base = work / name
    base.mkdir(parents=True, exist_ok=True)
    endpoint = Endpoint(unix=str(base / "ctl.sock"))
    ready = base / "ready"
    log = base / "program.log"
    env_cmd = [PYTHON, str(path), "--unix", endpoint.unix or "", "--ready", str(ready)]
    source = restored = None
    try:
        t0 = time.monotonic()
        r = torpor("run", "--log", log, "--", *env_cmd, timeout=30)
        if r.returncode != 0:
            return {**row, "outcome": "unhandled", "stage": "run", "error": error_line(r.stderr)}
        source = int(r.stdout.split()[0])
        deadline = time.monotonic() + step_s
        while not ready.exists() and alive(source) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not ready.exists():
            tail = log.read_text()[-3000:] if log.exists() else ""
            return {**row, "outcome": "unhandled", "stage": "start", "error": "never ready", "log": tail}
        row["start_s"] = round(time.monotonic() - t0, 3)
        before = ask(endpoint, "check", wait=5, timeout=step_s)
        row["before"] = before
        if not before.startswith("ok "):
            tail = log.read_text()[-3000:] if log.exists() else ""
            return {**row, "outcome": "unhandled", "stage": "check before", "log": tail}
        snap = base / "snap"
        t0 = time.monotonic()
        r = torpor("snapshot", "--pid", source, "--out", snap, timeout=step_s)
        row["snapshot_s"] = round(time.monotonic() - t0, 3)
        row["snapshot_warnings"] = [ln for ln in r.stderr.splitlines() if ln.startswith("torpor: warning:")]
        if r.returncode != 0:
            row["snapshot_error"] = error_line(r.stderr)
            after = ask(endpoint, "check", wait=5, timeout=step_s)
            row["source_after_refusal"] = after
            harmed = after != before
            row["source_harmed"] = harmed
            clean = not harmed and r.stderr.count("torpor: error:") == 1
            return {**row, "outcome": "refused_cleanly" if clean else "unhandled"}
        row["snapshot_bytes"] = sum(f.stat().st_size for f in snap.rglob("*") if f.is_file())
        deadline = time.monotonic() + 15
        while alive(source) and time.monotonic() < deadline:
            time.sleep(0.1)
        # Several restores of one snapshot for programs whose restore was seen to fail
        # intermittently (RESTORES): each must answer identically; `attempts` > 1 says the driver's
        # restore failed and the snapshot was restored again (docs/compat.md).
        restores = []
        for _ in range(d["restores"]):
            t0 = time.monotonic()
            r = torpor("restore", snap, "--detach", timeout=step_s)
            one: dict[str, Any] = {"restore_s": round(time.monotonic() - t0, 3), "attempts": _attempts(r.stderr)}
            if r.returncode != 0:
                restores.append({**one, "error": error_line(r.stderr)})
                break
            restored = int(r.stdout.split()[0])
            t0 = time.monotonic()
            one["after"] = ask(endpoint, "check", wait=30, timeout=step_s)
            one["first_check_after_restore_s"] = round(time.monotonic() - t0, 3)
            restores.append(one)
            kill_tree(restored)
            gone = time.monotonic() + 15
            while alive(restored) and time.monotonic() < gone:
                time.sleep(0.1)
            restored = None
        row.update({k: v for k, v in restores[0].items() if k != "attempts"})
        row["attempts"] = [x["attempts"] for x in restores]
        if len(restores) > 1:
            row["restores"] = restores
        if any("error" in x for x in restores):
            bad = next(x for x in restores if "error" in x)
            # For the post-mortem: what the program printed (its restored copy writes to the same
            # log) and what the kernel said (a restored process killed by a signal is logged there).
            tail = log.read_text()[-3000:] if log.exists() else ""
            kernel = subprocess.run(["dmesg"], capture_output=True, text=True, check=False).stdout.splitlines()[-20:]
            return {**row, "outcome": "unhandled", "stage": "restore", "error": bad["error"], "log": tail, "kernel": kernel}
        identical = all(x.get("after") == before for x in restores)
        return {**row, "outcome": "restored_identical" if identical else "unhandled"}
    except Exception as e:  # the next program must run whatever happened here  # noqa: BLE001
        return {**row, "outcome": "unhandled", "stage": "runner", "error": f"{type(e).__name__}: {e}"}
    finally:
        kill_tree(restored)
        kill_tree(source)


def _attempts(stderr: str) -> int:
    """How many restores `torpor restore` needed (it notes "attempt N succeeded" past 1)."""
    for line in stderr.splitlines():
        if "attempt " in line and " succeeded" in line:
            return int(line.rsplit("attempt ", 1)[1].split()[0])
    return 1


# The daemon's two paths for a GPU function: transparent (CRIU and the driver restore everything)
# and split (segments filled from the restore server's caches; the GPU machine's default).
PATHS = {"transparent": "split = false\n", "split": "split = true\nsplit_gpu = true\n"}


def run_functions(
    torpor: Torpor, work: Path, names: list[str] | None, step_s: float, budget_s: float
) -> list[dict[str, Any]]:
    """Each function on a fresh daemon per path: deploy, a cold start, a warm call. The first
    call after the restore must compile nothing: its handler time is recorded beside the warm
    call's (`cold_handler_s`, `warm_handler_s`, from X-Torpor-Timings)."""
    rows: list[dict[str, Any]] = []
    dirs = [d for d in sorted(FUNCTIONS.iterdir()) if (d / "torpor.toml").exists()]
    if names:
        dirs = [d for d in dirs if d.name in names]
    started = time.monotonic()
    for path, config in PATHS.items():
        if dirs:
            rows += _functions_on(torpor, work / f"daemon-{path}", path, config, dirs, step_s, budget_s, started)
    return rows


def _functions_on(
    torpor: Torpor, state: Path, path: str, config: str, dirs: list[Path], step_s: float, budget_s: float,
    started: float,
) -> list[dict[str, Any]]:  # fmt: skip
    rows: list[dict[str, Any]] = []
    state.mkdir(parents=True, exist_ok=True)
    sock = state / "torpord.sock"
    (state / "torpord.toml").write_text(config)
    daemon_log = open(state / "daemon.log", "w")  # noqa: SIM115
    daemon = subprocess.Popen(
        [str(torpor.binary), "serve", "--config", str(state / "torpord.toml"), "--state-dir", str(state),
         "--socket", str(sock)],
        stdout=daemon_log, stderr=subprocess.STDOUT, env=torpor.env, start_new_session=True,
    )  # fmt: skip
    client = Torpor(torpor.binary, {**torpor.env, "TORPOR_SOCKET": str(sock)})
    try:
        for _ in range(100):
            if sock.exists():
                break
            time.sleep(0.1)
        for d in dirs:
            requires = tuple(_preload(d))
            row: dict[str, Any] = {"function": d.name, "path": path, "requires": list(requires)}
            missing = missing_packages(requires)
            if missing:
                rows.append({**row, "outcome": "skipped", "reason": f"missing packages: {', '.join(missing)}"})
                continue
            if time.monotonic() - started > budget_s:
                rows.append({**row, "outcome": "skipped", "reason": "time budget spent"})
                continue
            t0 = time.monotonic()
            r = client("deploy", d, timeout=max(step_s, 180))
            row["deploy_s"] = round(time.monotonic() - t0, 3)
            if r.returncode != 0:
                rows.append({**row, "outcome": "failed", "stage": "deploy", "error": error_line(r.stderr)})
                continue
            answers = []
            for start in ("cold", "warm"):
                t0 = time.monotonic()
                r = client("invoke", f"compat-{d.name}", "--data", "{}", "-v", timeout=step_s)
                row[f"{start}_s"] = round(time.monotonic() - t0, 3)
                seen = invoke_timings(r.stderr)
                row[f"{start}_start"] = seen.get("kind")
                row[f"{start}_handler_s"] = seen.get("handler")
                try:
                    answers.append(json.loads(r.stdout) if r.returncode == 0 else {"error": error_line(r.stderr)})
                except json.JSONDecodeError:
                    answers.append({"error": r.stdout[-500:]})
            row["answers"] = answers
            ok = all(a.get("ok") is True for a in answers) and answers[0].get("digest") == answers[1].get("digest")
            ok = ok and row["cold_start"] == "restored" and row["warm_start"] == "warm"
            rows.append({**row, "outcome": "deployable" if ok else "failed"})
    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
        daemon_log.close()
    return rows


def invoke_timings(stderr: str) -> dict[str, Any]:
    """`torpor invoke -v`'s line `start: KIND  timings: {JSON}` as {"kind": KIND, phase: seconds}
    (the timings have a phase named "start" of their own)."""
    for line in stderr.splitlines():
        if line.startswith("start: ") and "  timings: " in line:
            kind, _, timings = line[len("start: "):].partition("  timings: ")
            try:
                phases = json.loads(timings)
            except json.JSONDecodeError:
                phases = {}
            return {**(phases if isinstance(phases, dict) else {}), "kind": kind.strip()}
    return {}


def _preload(d: Path) -> list[str]:
    import tomllib

    return list(tomllib.loads((d / "torpor.toml").read_text()).get("preload", []))


def summarise(programs: list[dict[str, Any]], functions: list[dict[str, Any]]) -> dict[str, Any]:
    ran = [p for p in programs if p["outcome"] != "skipped"]
    return {
        "programs": len(ran),
        "restored_identical": sum(p["outcome"] == "restored_identical" for p in ran),
        "refused_cleanly": sum(p["outcome"] == "refused_cleanly" for p in ran),
        "unhandled": sum(p["outcome"] == "unhandled" for p in ran),
        "harmed_sources": sum(bool(p.get("source_harmed")) for p in ran),
        "unexpected": [p["program"] for p in ran if _expected(p) != p["outcome"]],
        "skipped": [p["program"] for p in programs if p["outcome"] == "skipped"],
        # A function counts when it deploys and answers cold and warm on every path it ran.
        "deployable_functions": len(deployable(functions)),
        "deployable": deployable(functions),
    }


def deployable(functions: list[dict[str, Any]]) -> list[str]:
    ran: dict[str, list[bool]] = {}
    for f in functions:
        if f["outcome"] != "skipped":
            ran.setdefault(f["function"], []).append(f["outcome"] == "deployable")
    return sorted(name for name, oks in ran.items() if all(oks))


def _expected(p: dict[str, Any]) -> str:
    return "refused_cleanly" if p.get("expect") == "refused" else "restored_identical"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/compat-h100.json")
    ap.add_argument("--only", default="", help="comma-separated program and function names")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop starting programs after this")
    ap.add_argument("--functions-budget-s", type=float, default=240.0, help="stop deploying after this")
    ap.add_argument("--step-s", type=float, default=90.0, help="timeout of each step of a program")
    ap.add_argument("--no-functions", action="store_true")
    args = ap.parse_args()
    only = [n for n in args.only.split(",") if n]
    torpor = Torpor(find_torpor(), dict(os.environ))
    started = time.monotonic()
    gpu = have_gpu()
    work = Path(tempfile.mkdtemp(prefix="torpor-compat-"))
    programs: list[dict[str, Any]] = []
    for path in sorted(PROGRAMS.glob("*.py")):
        if path.name == "compat_common.py" or (only and path.stem not in only):
            continue
        d = declared(path)
        if d["gpu"] and not gpu:
            programs.append({"program": path.stem, "what": d["what"], "expect": d["expect"], "outcome": "skipped",
                             "reason": "no GPU (/dev/nvidiactl, nvidia-smi)"})  # fmt: skip
            continue
        if time.monotonic() - started > args.budget_s:
            programs.append({"program": path.stem, "outcome": "skipped", "reason": "time budget spent"})
            continue
        row = run_program(torpor, path, work, args.step_s)
        programs.append(row)
        print(f"compat: {row['program']}: {row['outcome']} {row.get('snapshot_error', row.get('error', ''))}",
              flush=True)  # fmt: skip
    functions: list[dict[str, Any]] = []
    if gpu and not args.no_functions:
        try:
            functions = run_functions(torpor, work, only, args.step_s, args.functions_budget_s)
        except Exception as e:  # noqa: BLE001
            functions = [{"function": "(daemon)", "outcome": "failed", "error": f"{type(e).__name__}: {e}"}]
        for f in functions:
            print(f"compat: function {f['function']}: {f['outcome']} {f.get('error', '')}", flush=True)
    doc = {
        "commit": os.environ.get("TORPOR_COMMIT", ""),
        "machine": _machine(),
        "wall_s": round(time.monotonic() - started, 1),
        "summary": summarise(programs, functions),
        "programs": programs,
        "functions": functions,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    # Each path's daemon log beside the JSON: a slow or failed function is explained there.
    for path in PATHS:
        log = work / f"daemon-{path}" / "daemon.log"
        if log.exists():
            shutil.copy(log, args.out.parent / f"{args.out.stem}-daemon-{path}.log")
    print(json.dumps(doc["summary"], indent=2))
    shutil.rmtree(work, ignore_errors=True)
    s = summarise(programs, functions)
    return 0 if s["unhandled"] == 0 and s["harmed_sources"] == 0 else 1


def _machine() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=False,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "no GPU"


if __name__ == "__main__":
    sys.exit(main())
