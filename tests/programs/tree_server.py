"""A process tree of the kinds users bring, without a GPU: a forked worker that inherited a device
mapping, a connected TCP pair, a POSIX semaphore and a shared-memory file.

Serves line requests (see linesrv.py) on a Unix socket:

    ping          "pong"
    work N        the forked worker's answer for N (N*N+1), through a pipe pair
    devmaps       how many mappings of the device the worker still has (from its /proc maps)
    tcp WORD      WORD sent through one end of the connected loopback TCP pair, read at the other
    sem           post then wait the semaphore; answers its value (stays at the initial value)
    shm           the text the shared-memory file holds

Options: --device PATH maps PATH (read-only, shared) before forking, so the worker inherits it,
and the parent unmaps its own copy afterwards: exactly what a CUDA parent and its DataLoader
worker look like once the driver checkpoint released the parent's device mappings. --tcp,
--sem NAME and --shm NAME add the other kinds of state. --marker NAME keeps a memfd of that name
open (what Torpor's hook does while a process holds GPU memory the driver cannot checkpoint), and
--nccl-shm maps /dev/shm/nccl-torpor-test in both processes, as two NCCL ranks do. --io-uring
opens an io_uring instance (io_uring_setup), as libuv does unless UV_USE_IO_URING=0. --cuda LIB
loads a (fake) libcuda and serves:

    ipc-open      cuIpcOpenMemHandle_v2 (answers the CUresult)
    ipc-close     cuIpcCloseMemHandle of what ipc-open returned
    managed       cuMemAllocManaged of 1 MiB

called through the process's global symbol scope, where a preloaded libtorpor_hook.so comes first.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import socket
import sys

from linesrv import Endpoint, Request, listen, serve

SEM_VALUE = 3


class IpcHandle(ctypes.Structure):
    """CUipcMemHandle: 64 opaque bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_char * 64)]
SHM_TEXT = b"torpor shared memory survives\n"


def worker(rd: int, wr: int) -> None:
    """The forked child: answers N*N+1 for each N, like a DataLoader worker yields batches."""
    with os.fdopen(rd, "rb", buffering=0) as r, os.fdopen(wr, "wb", buffering=0) as w:
        while True:
            line = b""
            while not line.endswith(b"\n"):
                chunk = r.read(1)
                if not chunk:
                    os._exit(0)
                line += chunk
            n = int(line)
            w.write(f"{n * n + 1}\n".encode())


class Tree:
    def __init__(self, args: argparse.Namespace) -> None:
        self.device = args.device
        mapping = None
        if args.device:
            fd = os.open(args.device, os.O_RDONLY)
            mapping = mmap.mmap(fd, 1 << 20, mmap.MAP_SHARED, mmap.PROT_READ)
            os.close(fd)
        self.nccl: mmap.mmap | None = None
        if args.nccl_shm:
            fd = os.open("/dev/shm/nccl-torpor-test", os.O_RDWR | os.O_CREAT, 0o600)
            os.ftruncate(fd, 4096)
            self.nccl = mmap.mmap(fd, 4096, mmap.MAP_SHARED)
            os.close(fd)
        self.marker = os.memfd_create(args.marker) if args.marker else None
        self.ring = -1
        if args.io_uring:
            params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
            self.ring = ctypes.CDLL(None, use_errno=True).syscall(425, 4, params)  # io_uring_setup
            if self.ring < 0:
                raise OSError(ctypes.get_errno(), "io_uring_setup")
        self.cuda: ctypes.CDLL | None = None
        self.ipc_ptr = ctypes.c_ulonglong(0)
        if args.cuda:
            # --cuda-local: loaded as Python extensions load their libraries (RTLD_LOCAL), so the
            # preloaded hook's RTLD_NEXT cannot see it.
            ctypes.CDLL(args.cuda, mode=ctypes.RTLD_LOCAL if args.cuda_local else ctypes.RTLD_GLOBAL)
            self.cuda = ctypes.CDLL(None)
        to_child, from_parent = os.pipe()
        to_parent, from_child = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(from_parent)
            os.close(to_parent)
            worker(to_child, from_child)
            os._exit(0)
        os.close(to_child)
        os.close(from_child)
        self.child = pid
        self.to_child = os.fdopen(from_parent, "wb", buffering=0)
        self.from_child = os.fdopen(to_parent, "rb", buffering=0)
        if mapping is not None:
            mapping.close()  # the parent's own copy goes, as the driver checkpoint's would

        self.tcp: tuple[socket.socket, socket.socket] | None = None
        if args.tcp:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            client = socket.create_connection(listener.getsockname())
            server, _ = listener.accept()
            listener.close()
            self.tcp = (client, server)

        self.sem: ctypes.c_void_p | None = None
        if args.sem:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.sem_open.restype = ctypes.c_void_p
            libc.sem_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_uint]
            libc.sem_post.argtypes = [ctypes.c_void_p]
            libc.sem_wait.argtypes = [ctypes.c_void_p]
            libc.sem_getvalue.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
            sem = libc.sem_open(f"/{args.sem}".encode(), os.O_CREAT, 0o600, SEM_VALUE)
            if sem is None or sem == ctypes.c_void_p(-1).value:
                raise OSError(ctypes.get_errno(), "sem_open")
            self.libc = libc
            self.sem = sem

        self.shm: mmap.mmap | None = None
        if args.shm:
            fd = os.open(f"/dev/shm/{args.shm}", os.O_RDWR | os.O_CREAT, 0o600)
            os.ftruncate(fd, 4096)
            self.shm = mmap.mmap(fd, 4096, mmap.MAP_SHARED)
            os.close(fd)
            self.shm[: len(SHM_TEXT)] = SHM_TEXT

    def handle(self, req: Request) -> str:
        match req.words:
            case ["ping"]:
                return "pong"
            case ["work", n]:
                self.to_child.write(f"{int(n)}\n".encode())
                line = b""
                while not line.endswith(b"\n"):
                    chunk = self.from_child.read(1)
                    if not chunk:
                        return "error worker gone"
                    line += chunk
                return line.decode().strip()
            case ["devmaps"]:
                with open(f"/proc/{self.child}/maps") as f:
                    return str(sum(1 for line in f if self.device and line.rstrip().endswith(self.device)))
            case ["tcp", word]:
                assert self.tcp is not None
                client, server = self.tcp
                client.sendall(word.encode() + b"\n")
                got = b""
                while not got.endswith(b"\n"):
                    got += server.recv(4096)
                return got.decode().strip()
            case ["sem"]:
                assert self.sem is not None
                if self.libc.sem_post(self.sem) != 0 or self.libc.sem_wait(self.sem) != 0:
                    return f"error errno {ctypes.get_errno()}"
                value = ctypes.c_int(-1)
                self.libc.sem_getvalue(self.sem, ctypes.byref(value))
                return str(value.value)
            case ["ipc-open"]:
                assert self.cuda is not None
                return str(self.cuda.cuIpcOpenMemHandle_v2(ctypes.byref(self.ipc_ptr), IpcHandle(), 1))
            case ["ipc-close"]:
                assert self.cuda is not None
                return str(self.cuda.cuIpcCloseMemHandle(self.ipc_ptr))
            case ["managed"]:
                assert self.cuda is not None
                ptr = ctypes.c_ulonglong(0)
                return str(self.cuda.cuMemAllocManaged(ctypes.byref(ptr), ctypes.c_size_t(1 << 20), 1))
            case ["env", name]:
                return os.environ.get(name, "(unset)")
            case ["shm"]:
                assert self.shm is not None
                return self.shm[: len(SHM_TEXT)].decode().strip()
        return "error unknown request"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--unix", required=True)
    p.add_argument("--ready", required=True)
    p.add_argument("--device")
    p.add_argument("--tcp", action="store_true")
    p.add_argument("--sem")
    p.add_argument("--shm")
    p.add_argument("--marker")
    p.add_argument("--nccl-shm", action="store_true")
    p.add_argument("--cuda")
    p.add_argument("--io-uring", action="store_true")
    p.add_argument("--cuda-local", action="store_true")
    args = p.parse_args()
    tree = Tree(args)
    serve(listen(Endpoint(unix=args.unix)), tree.handle, args.ready)


if __name__ == "__main__":
    sys.exit(main())
