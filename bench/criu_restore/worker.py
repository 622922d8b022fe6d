"""A CPU worker holding N MiB of distinct (random) data, for the CRIU restore benchmark.

    python3 worker.py SOCKET MIB

Listens on the Unix socket SOCKET (one request per connection, one answer line):
  touch PERCENT   read one byte of every page of the first PERCENT % of the data; answers a CRC
  sum             SHA-256 of all the data (to compare restores bit for bit)
Creates SOCKET.ready once the data is in memory.
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
import zlib

PAGE = 4096


def main(argv: list[str]) -> int:
    path, mib = argv[0], int(argv[1])
    data = bytearray(os.urandom(mib << 20))
    view = memoryview(data)
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
                answer = str(zlib.crc32(view[0:end:PAGE].tobytes()))
            elif words == ["sum"]:
                answer = hashlib.sha256(view).hexdigest()
            else:
                answer = "error: unknown request"
            conn.sendall(answer.encode() + b"\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
