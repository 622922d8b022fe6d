"""Prober: what a function can do to the node, from inside its worker.

{"op": "whoami"} -> its ids, groups, capabilities, no_new_privs and a call count (kept in memory,
so a restored or woken instance shows the count of its snapshot).
{"op": "write", "paths": [...]} -> {path: "ok" or the errno's name} for creating each file.
{"op": "read", "paths": [...]} -> {path: "ok:<first bytes>" (a file), "ok:[names]" (a directory)
or the errno's name}.
{"op": "escape", "read": [...], "signal": [[pid, sig], ...]} -> first tries to detach its own
/proc and /tmp (root could: the host's procfs and /tmp lie below them), then reads each path and
signals each host pid, by kill() and through /proc/PID (pidfd_send_signal): {"umount": {...},
"read": {...}, "signal": {pid: {"kill": ..., "pidfd": ...}}}.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
from typing import Any

import torpor

MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


def _err(e: OSError) -> str:
    return errno.errorcode.get(e.errno or 0, str(e.errno))


def _status() -> dict[str, str]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp"):
                out[key] = value.strip()
    return out


def _write(path: str) -> str:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as e:
        return _err(e)
    try:
        os.write(fd, b"written by a function\n")
    finally:
        os.close(fd)
    return "ok"


def _read(path: str) -> str:
    try:
        if os.path.isdir(path):
            return "ok:" + repr(sorted(os.listdir(path)))
        with open(path, "rb") as f:
            return "ok:" + f.read(64).decode(errors="replace")
    except OSError as e:
        return _err(e)


def _umount(path: str) -> str:
    if _libc.umount2(path.encode(), MNT_DETACH) == 0:
        return "ok"
    return errno.errorcode.get(ctypes.get_errno(), "?")


def _signal(pid: int, sig: int) -> dict[str, str]:
    out = {}
    try:
        os.kill(pid, sig)
        out["kill"] = "ok"
    except OSError as e:
        out["kill"] = _err(e)
    try:
        fd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY)
        try:
            signal.pidfd_send_signal(fd, sig)
            out["pidfd"] = "ok"
        finally:
            os.close(fd)
    except OSError as e:
        out["pidfd"] = _err(e)
    return out


@torpor.function
class Prober:
    def setup(self) -> None:
        self.calls = 0

    def __call__(self, request: Any) -> Any:
        self.calls += 1
        op = request.get("op")
        if op == "whoami":
            return {
                "uid": os.getuid(),
                "euid": os.geteuid(),
                "gid": os.getgid(),
                "egid": os.getegid(),
                "groups": os.getgroups(),
                "status": _status(),
                "calls": self.calls,
            }
        if op == "write":
            return {p: _write(p) for p in request["paths"]}
        if op == "read":
            return {p: _read(p) for p in request["paths"]}
        if op == "escape":
            umount = {p: _umount(p) for p in ("/tmp", "/proc")}
            return {
                "umount": umount,
                "read": {p: _read(p) for p in request.get("read", [])},
                "signal": {str(pid): _signal(pid, sig) for pid, sig in request.get("signal", [])},
            }
        raise ValueError(f"unknown op {op!r}")
