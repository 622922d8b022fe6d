"""A CPU worker whose memory a lazy restore leaves on the page server, for the fork and mremap
tests of tests/test_pages.py.

    python3 lazy_mem.py SOCKET MIB

Holds MIB MiB of random bytes in its heap (a private anonymous mapping of malloc's) and MIB more
in an area of its own (mmap, MAP_PRIVATE | MAP_ANONYMOUS). Listens on the Unix socket SOCKET,
one request per connection, one answer line:
  sum       SHA-256 of the heap data and of the area, space-separated
  forksum   the same, computed by a child forked for it (which faults the pages in through the
            uffd the kernel made for it at fork)
  remap     moves the area elsewhere with mremap(MREMAP_MAYMOVE | MREMAP_FIXED), then answers
            the SHA-256 of the area at its new address
  protect   makes a few pages inside the area read-only (mprotect: its VMA splits in three, and
            the kernel tells no page server), then answers the SHA-256 of the area
  churn     while a thread gives a scratch area's pages back again and again (madvise
            MADV_DONTNEED: each an event the page server must read before the kernel takes its
            copies again), answers the SHA-256 of the heap data and of the area
Creates SOCKET.ready once the data is in memory.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import socket
import sys

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
LIBC.mremap.restype = ctypes.c_void_p
LIBC.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
LIBC.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_DONTNEED = 4
SCRATCH = 1 << 20
MAP_FAILED = ctypes.c_void_p(-1).value
MREMAP_MAYMOVE, MREMAP_FIXED = 1, 2


def anonymous(size: int, prot: int) -> int:
    addr = LIBC.mmap(None, size, prot, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if addr in (None, MAP_FAILED):
        raise OSError(ctypes.get_errno(), "mmap")
    return int(addr)


def main(argv: list[str]) -> int:
    path, size = argv[0], int(argv[1]) << 20
    data = bytearray(os.urandom(size))
    area = anonymous(size, mmap.PROT_READ | mmap.PROT_WRITE)
    ctypes.memmove(area, os.urandom(size), size)
    scratch = anonymous(SCRATCH, mmap.PROT_READ | mmap.PROT_WRITE)
    ctypes.memset(scratch, 1, SCRATCH)

    def sums() -> str:
        return f"{hashlib.sha256(data).hexdigest()} {hashlib.sha256(ctypes.string_at(area, size)).hexdigest()}"

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
            if words == ["sum"]:
                answer = sums()
            elif words == ["forksum"]:
                r, w = os.pipe()
                child = os.fork()
                if child == 0:
                    os.close(r)
                    os.write(w, sums().encode())
                    os._exit(0)
                os.close(w)
                with os.fdopen(r, "rb") as pipe:
                    answer = pipe.read().decode()
                _, status = os.waitpid(child, 0)
                if status != 0:
                    answer = f"error: the child exited with status {status}"
            elif words == ["remap"]:
                target = anonymous(size, 0)  # PROT_NONE: a place to move to
                moved = LIBC.mremap(area, size, size, MREMAP_MAYMOVE | MREMAP_FIXED, target)
                if moved in (None, MAP_FAILED):
                    answer = f"error: mremap: {os.strerror(ctypes.get_errno())}"
                else:
                    area = int(moved)
                    answer = hashlib.sha256(ctypes.string_at(area, size)).hexdigest()
            elif words == ["churn"]:
                import threading

                stop = threading.Event()

                def churn() -> None:
                    while not stop.is_set():
                        LIBC.madvise(scratch, SCRATCH, MADV_DONTNEED)
                        ctypes.memset(scratch, 1, mmap.PAGESIZE)

                t = threading.Thread(target=churn)
                t.start()
                try:
                    answer = sums()
                finally:
                    stop.set()
                    t.join()
            elif words == ["protect"]:
                # Off the 1 MiB runs the server copies around a fault, so one of them crosses
                # the new VMA boundaries.
                at = area + size // 2 + 3 * mmap.PAGESIZE
                if LIBC.mprotect(at, 4 * mmap.PAGESIZE, mmap.PROT_READ) != 0:
                    answer = f"error: mprotect: {os.strerror(ctypes.get_errno())}"
                else:
                    answer = hashlib.sha256(ctypes.string_at(area, size)).hexdigest()
            else:
                answer = "error: unknown request"
            conn.sendall(answer.encode() + b"\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
