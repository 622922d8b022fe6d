"""A CPU worker holding N MiB of distinct (random) data, for the CRIU restore benchmark.

    python3 worker.py SOCKET MIB [VMAS]

VMAS (default 0): also hold that many one-page mappings of random data, every other one
read-only so that the kernel cannot merge them: a fragmented address space like a GPU worker's,
whose driver residue sits in tens of thousands of one-page VMAs that a lazy restore serves one
by one. `touch` and `sum` cover them too.

Listens on the Unix socket SOCKET (one request per connection, one answer line):
  touch PERCENT   read one byte of every page of the first PERCENT % of the data; answers a CRC
  sum             SHA-256 of all the data (to compare restores bit for bit)
Creates SOCKET.ready once the data is in memory.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import socket
import sys
import zlib

PAGE = 4096


def fragments(n: int) -> memoryview:
    """`n` pages of random data in `n` VMAs (alternate pages read-only)."""
    # Private: CRIU serves only private anonymous memory lazily (a shared mapping is restored whole).
    region = mmap.mmap(-1, max(n, 1) * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.write(os.urandom(n * PAGE))
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None, use_errno=True)
    for i in range(1, n, 2):
        if libc.mprotect(ctypes.c_void_p(base + i * PAGE), PAGE, mmap.PROT_READ) != 0:
            raise OSError(ctypes.get_errno(), "mprotect")
    return memoryview(region)[: n * PAGE]


def main(argv: list[str]) -> int:
    path, mib = argv[0], int(argv[1])
    vmas = int(argv[2]) if len(argv) > 2 else 0
    data = bytearray(os.urandom(mib << 20))
    view = memoryview(data)
    frag = fragments(vmas)
    if os.path.exists(path):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    with open(path + ".ready", "w") as f:
        f.write(str(os.getpid()))
    while True:
        conn, _ = server.accept()
        with conn:
            words = conn.recv(256).decode().split()
            if words[:1] == ["touch"] and len(words) == 2:
                end = len(data) * int(words[1]) // 100
                # A strided slice reads one byte per page: every page of the range is faulted in.
                fend = len(frag) * int(words[1]) // 100
                answer = str(zlib.crc32(view[0:end:PAGE].tobytes() + frag[0:fend:PAGE].tobytes()))
            elif words == ["sum"]:
                answer = hashlib.sha256(bytes(view) + bytes(frag)).hexdigest()
            else:
                answer = "error: unknown request"
            conn.sendall(answer.encode() + b"\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
