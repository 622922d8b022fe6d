"""`make demo-snapshot`: the transparent CLI underneath torpord. Boot a process once, snapshot it,
restore it — twice, side by side — and show what each step costs. Uses the GPU when there is one
(a PyTorch ResNet-50), the CPU otherwise. `make demo` (scripts/demo.py) shows the runtime instead."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORPOR = os.environ.get("TORPOR_BIN", str(ROOT / "target/release/torpor"))
WORKER = ROOT / "scripts/demo_worker.py"
CLONE_NEWNET = 0x40000000
libc = ctypes.CDLL(None, use_errno=True)


def has_gpu() -> bool:
    try:
        subprocess.run(["nvidia-smi", "-L"], check=True, capture_output=True)
        subprocess.run([sys.executable, "-c", "import torch, torchvision; assert torch.cuda.is_available()"],
                       check=True, capture_output=True)
        return True
    except (OSError, subprocess.CalledProcessError):
        return False


def torpor(*args: str) -> subprocess.CompletedProcess[str]:
    res = subprocess.run([TORPOR, *args], capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"demo: torpor {' '.join(args)} failed:\n{res.stderr.strip()}")
    return res


def ask(pid: int, timeout: float = 120.0) -> dict[str, object]:
    """Sends one request to the worker in the network namespace of `pid`."""
    deadline = time.monotonic() + timeout
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    theirs = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        while True:
            # A socket belongs to the namespace it was created in: enter theirs just for that.
            if libc.setns(theirs, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns")
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            libc.setns(own, CLONE_NEWNET)
            try:
                s.connect("\0torpor-demo")
                s.sendall(b"infer")
                return json.loads(s.recv(4096))
            except (ConnectionRefusedError, FileNotFoundError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
            finally:
                s.close()
    finally:
        os.close(own)
        os.close(theirs)


def phases(stderr: str) -> str:
    parts = [line.split() for line in stderr.splitlines() if line.startswith("phase ")]
    return ", ".join(f"{p[1]} {float(p[2]):.3f}s" for p in parts if len(p) == 3)


def main() -> None:
    if os.geteuid() != 0:
        sys.exit("demo: needs root (namespaces and CRIU): run `sudo make demo`")
    gpu = has_gpu()
    work = Path(tempfile.mkdtemp(prefix="torpor-demo-"))
    snap = work / "snapshot"
    pids: list[int] = []
    try:
        print(f"== Torpor demo ({'GPU: PyTorch ResNet-50' if gpu else 'CPU: no GPU found, a CPU process'})")
        t0 = time.monotonic()
        pid = int(torpor("run", "--log", str(work / "worker.log"), "--", sys.executable, str(WORKER),
                         "gpu" if gpu else "cpu").stdout)
        pids.append(pid)
        first = ask(pid, timeout=300)
        boot = time.monotonic() - t0
        print(f"boot from scratch -> first answer: {boot:7.3f} s   {first}")

        t = time.monotonic()
        res = torpor("snapshot", "--pid", str(pid), "--out", str(snap), "--leave-running", "-v")
        print(f"snapshot (source keeps running):   {time.monotonic() - t:7.3f} s   {res.stdout.strip()}")
        print(f"    phases: {phases(res.stderr)}")
        print(f"original still answers:            {ask(pid)}")

        for i in (1, 2):
            t = time.monotonic()
            res = torpor("restore", str(snap), "--detach", "-v")
            rpid = int(res.stdout)
            pids.append(rpid)
            answer = ask(rpid)
            took = time.monotonic() - t
            same = "identical" if answer["digest"] == first["digest"] else "DIFFERENT"
            print(f"restore #{i} -> first answer:       {took:7.3f} s   {answer} ({same} output)")
            print(f"    phases: {phases(res.stderr)}")
        print("all three instances answer at once:")
        for p in pids:
            print(f"    pid {p}: {ask(p)}")
        print(torpor("verify", str(snap)).stdout.strip())
        print("what the snapshot holds (torpor inspect):")
        for line in torpor("inspect", str(snap)).stdout.splitlines():
            if not line.startswith(" " * 4) or "img" in line:
                print(f"    {line}")
    finally:
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
