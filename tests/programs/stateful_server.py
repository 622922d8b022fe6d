"""A CPU process whose state lives in memory, in an open file and in listening sockets.

Serves line requests (see linesrv.py) on a Unix socket (path or abstract) and optionally on TCP
127.0.0.1:PORT (a fixed port is fine: it runs in its own network namespace):

    incr          add one to the counter, flip one byte of the 1 MB buffer; answers the new counter
    get           the counter
    digest        sha256 of the 1 MB buffer (changes with every incr)
    file          {"written": bytes written through the held fd, "size": fstat size of that fd}
    pid           {"pid": os.getpid(), "nspid": [...]} (NSpid as this process's /proc shows it)
    takefd        keep the file descriptors that came with the request (SCM_RIGHTS); answers how many
    held          how many descriptors takefd keeps
    exit CODE     answer "bye", then exit with CODE
    ping          "pong"

Every request first appends one line to the data file through a descriptor opened once at start
(O_WRONLY|O_APPEND, as a log is). The ready file is written once the sockets listen.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import sys
import threading
import time

from linesrv import Endpoint, Exit, Request, listen, serve

BLOB_SIZE = 1 << 20


def make_blob() -> bytearray:
    pattern = bytes((i * 7 + 3) & 0xFF for i in range(256))
    return bytearray(pattern * (BLOB_SIZE // len(pattern)))


def nspid() -> list[int]:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    return []


class State:
    def __init__(self, data_file: str | None) -> None:
        self.counter = 0
        self.blob = make_blob()
        self.fd = os.open(data_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if data_file else None
        self.written = 0
        self.seq = 0
        self.held: list[int] = []

    def log(self, words: list[str]) -> None:
        self.seq += 1
        if self.fd is None:
            return
        line = f"{self.seq} {' '.join(words)}\n".encode()
        n = os.write(self.fd, line)
        self.written += n

    def handle(self, req: Request) -> str:
        self.log(req.words)
        cmd, args = req.words[0], req.words[1:]
        if cmd != "takefd":
            for fd in req.fds:
                os.close(fd)
        if cmd == "incr":
            self.counter += 1
            self.blob[(self.counter * 4099) % BLOB_SIZE] ^= 0x5A
            return str(self.counter)
        if cmd == "get":
            return str(self.counter)
        if cmd == "digest":
            return hashlib.sha256(self.blob).hexdigest()
        if cmd == "file":
            if self.fd is None:
                return json.dumps({"written": None, "size": None})
            return json.dumps({"written": self.written, "size": os.fstat(self.fd).st_size})
        if cmd == "pid":
            return json.dumps({"pid": os.getpid(), "nspid": nspid()})
        if cmd == "takefd":
            self.held.extend(req.fds)
            return f"took {len(req.fds)}"
        if cmd == "held":
            return str(len(self.held))
        if cmd == "exit":
            raise Exit("bye", int(args[0]) if args else 0)
        if cmd == "ping":
            return "pong"
        return f"error unknown command {cmd!r}"


def tick() -> None:
    while True:
        time.sleep(0.01)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ready", required=True, help="file created once the sockets listen")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--unix", help="listen on this Unix socket path")
    g.add_argument("--abstract", help="listen on this abstract Unix socket name instead")
    p.add_argument("--port", type=int, help="also listen on TCP 127.0.0.1:PORT")
    p.add_argument("--data-file", help="append one line per request to this file through a held fd")
    p.add_argument("--hold-mb", type=int, default=0, help="also hold this many MiB of filled memory")
    p.add_argument("--load-lib", help="dlopen this shared library (look like a process using it)")
    p.add_argument("--threads", type=int, default=0, help="also run this many threads that wake every 10 ms")
    a = p.parse_args(argv)
    for _ in range(a.threads):
        # Like a driver's or a framework's helper threads: always about to run again.
        threading.Thread(target=tick, daemon=True).start()

    state = State(a.data_file)
    # Filled memory (every page touched), so a snapshot has that much to write.
    hold = bytes(range(256)) * (a.hold_mb * 4096) if a.hold_mb else b""
    lib = ctypes.CDLL(a.load_lib) if a.load_lib else None
    socks = listen(Endpoint(unix=a.unix, abstract=a.abstract, port=a.port))
    try:
        serve(socks, state.handle, a.ready)
    finally:
        del hold, lib


if __name__ == "__main__":
    main(sys.argv[1:])
