"""The worker harness: one function per process (or a sandbox's several), driven by torpord
over a Unix socket.

    python3 -m torpor.worker --role base|function [--preload m1,m2] [--gpu] [--announce-warm]

torpord starts it under `torpor run` with $TORPOR_WORKER_SOCKET set to its workers.sock. The
protocol is docs/torpord.md's; frames are torpor.frames'. What this harness does:

1. Blocks SIGUSR2 (so the wake-up after a snapshot is never lost and never kills it), connects,
   and sends `hello` {pid, role, function: null, resumed: false, protocol: 5, reattach: false}.
   `pid` is the worker's PID in its own namespace; torpord identifies connections by SO_PEERCRED.
   `protocol: 2` says this harness sends `started` and reattaches after losing torpord (below);
   `protocol: 3` that it takes `release_gpu`; `protocol: 4` that it keeps its mappings of the
   store's GPU memory where torpord names a `block`, sends `store_release` {blocks} once a got
   object is gone, and takes `store_unmap` {blocks} (torpor.store_gpu, "Kept mappings");
   `protocol: 5` that it takes `quiesce` {released: true} while its GPU is released.
2. Sets the memory defaults frameworks read at start (XLA_PYTHON_CLIENT_PREALLOCATE=false: a JAX
   base must not reserve most of the GPU into its snapshot; torpor.gpu), imports the --preload
   modules in order and, with --gpu, warms CUDA through the first of torch, jax, cupy it imported
   (torch: matmul, linear, softmax and conv in fp32 and fp16, so cuBLAS, cuBLASLt and cuDNN are
   initialised, then its cached blocks are freed; jax: a compiled matmul and softmax; cupy: a
   matmul and a kernel, then its pools are emptied), or with none of them through the driver API
   (a primary context on device 0). Role `base` then sends
   `ready` {ok: true, setup_s: import time, warmup_s: GPU warm-up time}; role `function` sends
   nothing yet and waits for `load`, unless launched with --announce-warm (a ready sandbox of
   torpord's live-context pool, which counts it ready only then): it first sends `warmed`
   {preload_s: import time, warmup_s: GPU warm-up time}. A failure in either step is `ready`
   {ok: false} as below, with or without the flag.
3. Serves frames until the connection ends:
   - `load` {spec, dir, data}: checks every declared data file the `data` map names (it must
     exist, and read-only data must have the declared size); an entry {"fd": true} (a `source`
     in torpor.toml) comes as a `data_fd` {name, fd: true} frame right after `load`, in declared
     order, its memfd attached, served as /proc/self/fd/N and closed once setup() and the
     warm-up are done (docs/data.md); binds them for torpor.load, imports
     `entry` with `dir` first on sys.path, instantiates the decorated class, runs setup(), packs
     the function's CUDA weights into segments of their own when the hook backs CUDA memory
     ($TORPOR_HOOK_CUDA=1, unless spec.gpu.pack_weights is false: torpor.pack), then runs the
     spec's warm-up request (recording the segments' first-use order: torpor.hook), and sends
     `ready` {ok: true, setup_s, warmup_s, packed?} (role function adds `preload_s`; `packed`:
     what packing did, torpor.pack.Packed.frame). From then on hello says role "function" and
     the spec's name.
   - A sandbox (the spec's scaling.sandbox = true; docs/sandboxes.md) takes more `load` frames,
     one per function of its tenant and workflow (another tenant's is a protocol error); the
     first one loaded names the worker in hello. Each later load first drops from sys.modules
     the modules of the directories loaded before, so every function imports its own files.
   - `invoke` {id, request, timeout_s, function?, key?, fingerprint?}: `key` (with the
     request's `fingerprint`) is the client's idempotency key: the outcome is kept for 10 min
     (torpor.kept) for a daemon that re-adopts this worker. `function` names which of a sandbox's
     functions serves it (a function not loaded is answered `ok: false`, type NotLoaded). In a
     sandbox every invoke runs on a lane (torpor.lanes: a long-lived thread; under torch on a
     CUDA stream of its own, torpor.gpu.request_stream) and the main loop reads on; a sandbox's request threads may send
     `store_put` {id, key, ttl_s, meta, nodes?} + `store_fd` {id, fd: true} (the sealed memfd attached)
     and `store_get` {id, key, keep}, whose answers `store_stored` {id, ok, error?} and
     `store_value` {id, found, meta?, bytes?, fd?, gpu?} (the memfd, or GPU memory with gpu
     {padded, ordinal, source}, attached) the main loop hands to them (torpor.store); a CUDA
     tensor's put is `store_put` {id, key, ttl_s, meta, gpu: {bytes, ordinal}}, answered
     `store_memory` {id, ok, padded?, ordinal?, fd?, error?} (GPU memory attached), which the
     thread fills, then `store_written` {id, ok, error?}, answered `store_stored`
     (torpor.store_gpu). Otherwise: sends `started` {id}, calls the function (every
     {"$ref", "data"} object torpord loaded in the request replaced by its bytes; torpor.dump
     sends `dump` {name, data: base64} meanwhile) and sends `result` {id, ok, value, handler_s}. Invokes run one after another, so with
     requests_per_instance > 1 a request waits here until the ones before it end; torpord counts
     its timeout from `started`. An exception from the function, or a value that cannot be sent (not JSON, NaN,
     over 64 MiB), is `ok: false` with `error` {type, message, traceback} (texts capped at 64 KiB),
     and the worker serves on. `timeout_s` is enforced by torpord, which kills a hung worker.
   - `quiesce` {split?}: synchronises CUDA for each framework that initialised it, flushes stdout and stderr (so
     buffered output is not copied into every restored instance), runs the garbage collector, sends
     `quiet` {cuda_synced: whether a synchronize ran}, closes the connection and blocks in
     sigwait(SIGUSR2). torpord should snapshot once it has read EOF after `quiet`. On SIGUSR2 it
     reconnects and sends `hello` with resumed: true (the original and every restored copy alike).
     With released: true (protocol 5; only after `release_gpu`, while the driver holds the
     context checkpointed, so that torpord hibernates the instance without resuming its GPU):
     no CUDA call at all (no synchronize, no pool or cache emptied, no segment listed: torpord
     has the segments it handed over since `unmap`, and the worker's own are in the driver's
     checkpoint); `quiet` {cuda_synced: false, released: true}, then closes and waits as above.
     The next GPU frame after the wake (`map`, `invoke`) ends the release as usual.
     With split: true (docs/split.md; needs the device-memory hook, $TORPOR_HOOK_LIB), `quiet`
     also lists the segments {va, size, backend, order, first_use, readonly}, one `segment_fd`
     {va, fd: true} frame per segment follows with the segment's fd attached, and the worker
     waits for `release`: it then releases every segment's memory (keeping the addresses),
     answers `released` {bytes}, and closes and waits for SIGUSR2 as above (`shutdown` instead
     of `release` ends the worker, exit 0; `resume` releases nothing and the worker serves on,
     still connected).
   - `map` {va, size, readonly, fd: true} with an fd attached (after a split snapshot or an
     `unmap`): maps that memory into the released segment at va and answers `mapped` {va, ok:
     true}; a map the hook refuses is `mapped` {va, ok: false, error {type, message}} and the
     worker serves on (the segment stays released; torpord should retire the instance). After a
     restore, until every segment is mapped, a thread (MapReader) reads the connection and
     applies `map` frames even while a request runs; the request first waits for the segments
     it may touch (torpor.readiness; for PyTorch modules, each module waits for its own
     weights' segments as it runs).
   - `release_gpu` (before torpord checkpoints the GPU in place: a GPU release, a move to another
     GPU; first of all, before `unmap`): gives every idle pool's memory back (a sandbox sends
     `memory` for each), synchronises CUDA and answers `gpu_quiet` {bytes}; no pool is released
     again, by its idle timer or `release_memory`, until `invoke`, `map`, `quiesce` or `load`
     says torpord resumed the GPU (a release into the checkpointed context killed workers).
   - `unmap` {vas} (before torpord releases the GPU of an instance on the split path):
     synchronises CUDA, releases the memory of the segments at `vas` (those torpord handed over;
     segments the worker made since keep their memory), keeping the addresses, answers
     `unmapped` {ok: true, bytes} and serves on, connected; `map` frames bring the memory back.
     A release the hook refuses is `unmapped` {ok: false, released: [va of each of them now
     without memory], error {type, message, traceback}}.
   - Memory pools (torpor.mempool): `ready` after a `load` carries the function's memory model
     `memory` {backend, resident, request_peak}; a sandbox's `result` carries `memory`
     {function, resident, pool, peak}; when a sandbox's function has been idle for its
     keepalive.memory_release_s, or on torpord's `release_memory`, its pool is given back and
     the worker sends `memory` {function, resident, pool} (never after `quiet`).
   - `attached` {reattach_s}: torpord took this worker into service as an instance; how long to
     wait for a daemon after losing this one.
   - `shutdown`: closes the connection and exits 0.
   Losing torpord (EOF or a broken connection outside a quiet point) after `load`: the worker
   keeps its state, drops the frames of the lost connection (their requests died with it; so
   does a sandbox's invoke read from it whose lane had not started it yet) and
   reconnects with backoff, saying `hello` with resumed: true and reattach: true (and `keys`
   [{function?, key, fingerprint}]: the keyed requests it answered or runs), until a daemon
   answers `attached`; it then sends `settled` {function?, key, fingerprint, ok, value?, error?,
   handler_s} for each answered one, and for each still running when it ends. After
   `reattach_s` (default 60 s) without one, it exits 0. A base worker,
   or one still loading, exits 0 at once (its deploy died with the daemon).
   A failure while loading (or preloading) is reported as `ready` {ok: false, phase, error
   {type, message, traceback}} with phase one of "preload", "gpu_warmup", "data", "import",
   "setup", "warmup"; the worker then exits 4.

Exit status: 0 after `shutdown`, when torpord closes or drops the connection of a worker that
serves no function yet, or when no torpord took the instance back within `reattach_s`; 1 on a crash of
the harness itself (traceback on stderr); 2 for wrong usage or a missing $TORPOR_WORKER_SOCKET;
3 on a protocol error (a frame too long, truncated, not a JSON object, an unknown type, missing
fields, or a frame out of order), with the reason on stderr; 4 after a failed load; 5 when
torpord's socket cannot be connected to within 10 s.

Limitation: SIGUSR2 stays blocked in processes the function starts (the mask is inherited).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import faulthandler
import gc
import importlib
import os
import queue
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from torpor import data as torpor_data
from torpor import gpu as torpor_gpu
from torpor import hook as torpor_hook
from torpor import kept as torpor_kept
from torpor import lanes as torpor_lanes
from torpor import mempool as torpor_mempool
from torpor import pack as torpor_pack
from torpor import store as torpor_store
from torpor import store_gpu as torpor_store_gpu
from torpor.errors import DataError, FrameError, HookError
from torpor.frames import FrameReader, encode, write_frame_with_fd
from torpor.functions import resolve
from torpor.readiness import ModuleWaits, Readiness, deferrable_vas
from torpor.shareable import shareable_vas

T = TypeVar("T")

ENV_SOCKET = "TORPOR_WORKER_SOCKET"
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_PROTOCOL = 3
EXIT_LOAD = 4
EXIT_CONNECT = 5
CONNECT_TIMEOUT_S = 10.0
PROTOCOL = 5
# The frame types torpord sends (protocol.schema.json's to_worker, checked by
# tests/sdk/test_sdk_protocol.py): those the serve loop takes, and those only a split quiesce
# takes (after its quiet).
SERVES = (
    "load", "invoke", "attached", "quiesce", "map", "unmap", "shutdown", "store_stored", "store_value", "store_memory",
    "release_memory", "release_gpu", "store_unmap",
)
# After `release_gpu`, the frames torpord sends only once the GPU is back.
GPU_BACK = ("invoke", "load", "quiesce", "map")
# torpord's answers to a sandbox's store requests (torpor.store), handed to the waiting thread.
STORE_ANSWERS = ("store_stored", "store_value", "store_memory")
STORE_TIMEOUT_S = 30.0
# A put for every node and a get (which may ask the bucket) wait for an upload or download.
STORE_BUCKET_TIMEOUT_S = 300.0
AFTER_SPLIT_QUIET = ("release", "resume", "shutdown")
# Taken only right after `load`: one per declared data entry with a source (torpord loaded it).
AFTER_LOAD = ("data_fd", "gpu_data")
DEFAULT_REATTACH_S = 60.0
# keepalive.memory_release_s when a spec has none (torpor.spec's default).
DEFAULT_MEMORY_RELEASE_S = 2.0
REATTACH_MAX_DELAY_S = 0.5
MAX_TEXT = 64 << 10
ROLES = ("base", "function")
_PACKAGE_DIR = str(Path(__file__).resolve().parent) + os.sep
_MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class ProtocolError(Exception):
    """torpord sent a frame that is valid JSON but not a valid message here."""


class ConnectError(Exception):
    pass


# What the map reader queues when every segment is mapped: the main loop reads on from here.
_HAND_BACK = object()


class MapReader:
    """While segments are unmapped after a restore: a thread that reads every frame, applies
    `map` frames itself (so a request waiting for a segment cannot hold up its map) and queues
    every other frame, in order, for the main loop. It stops reading right after the frame that
    mapped the last segment and queues _HAND_BACK; the main loop then reads the socket itself
    again. The end of the connection is queued as None, a bad frame as its exception."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.frames: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="torpor-map-reader", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        worker = self.worker
        reader = worker.reader
        assert reader is not None
        try:
            while True:
                msg = reader.read()
                if msg is None:
                    self.frames.put(None)
                    return
                if msg.get("type") in STORE_ANSWERS:
                    worker.store_answer(msg, reader.take_fd())
                    continue
                if msg.get("type") == "store_unmap":
                    worker.store_unmap(msg)
                    continue
                if msg.get("type") != "map":
                    self.frames.put(msg)
                    continue
                worker.map_segment(msg)
                if not reader.fds:
                    self.frames.put(_HAND_BACK)
                    return
        except ConnectionError:
            self.frames.put(None)
        except Exception as e:  # FrameError, ProtocolError, a failing send: the main loop raises it
            self.frames.put(e)

    def next(self) -> Any:
        return self.frames.get()


def _text(s: str) -> str:
    """A string that encodes as UTF-8 (lone surrogates escaped), at most MAX_TEXT characters."""
    s = s.encode("utf-8", "backslashreplace").decode("utf-8")
    return s if len(s) <= MAX_TEXT else s[: MAX_TEXT - 20] + "\n... (truncated)"


def _str(e: BaseException) -> str:
    """str(e), even when the exception's __str__ itself fails."""
    try:
        return str(e)
    except Exception as inner:
        return f"<str() of the exception failed: {_type_name(inner)}>"


def _type_name(e: BaseException) -> str:
    t = type(e)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _user_tb(tb: TracebackType | None) -> TracebackType | None:
    """The traceback without the harness's and importlib's leading frames (unless that is all)."""
    t = tb
    while t is not None:
        name = t.tb_frame.f_code.co_filename
        if not (name.startswith(_PACKAGE_DIR) or name.startswith("<frozen importlib")):
            return t
        t = t.tb_next
    return tb


def error_doc(e: BaseException) -> dict[str, str]:
    try:
        tb = "".join(traceback.format_exception(type(e), e, _user_tb(e.__traceback__)))
    except Exception as inner:
        tb = f"<formatting the traceback failed: {_type_name(inner)}>"
    return {"type": _type_name(e), "message": _text(_str(e)), "traceback": _text(tb)}


def _drain_sigusr2() -> None:
    """Consume a SIGUSR2 left pending from before, so the next sigwait waits for a fresh one."""
    while signal.SIGUSR2 in signal.sigpending():
        signal.sigtimedwait({signal.SIGUSR2}, 0)


def _wait_sigusr2() -> None:
    while True:
        try:
            if signal.sigwait({signal.SIGUSR2}) == signal.SIGUSR2:
                return
        except InterruptedError:
            continue


class Worker:
    def __init__(
        self, role: str, preload: list[str], gpu: bool, socket_path: str, announce_warm: bool = False
    ) -> None:
        self.role = role
        self.announce_warm = announce_warm
        self.started_as = role
        self.preload = preload
        self.gpu = gpu
        self.gpu_framework: str | None = None
        self.socket_path = socket_path
        self.function: str | None = None
        self.entry = ""
        self.call: Callable[[Any], Any] | None = None
        # Every function this worker serves by name: one, or in a sandbox (spec
        # scaling.sandbox, docs/sandboxes.md) every function loaded into it. A sandbox runs
        # each request on a lane (torpor.lanes); `function` above stays the first one loaded
        # (its host: the name torpord knows the instance by).
        self.functions: dict[str, Callable[[Any], Any]] = {}
        self.sandbox = False
        self.tenant: str | None = None
        # The directories of the functions loaded so far (a sandbox keeps their modules apart).
        self.loaded_dirs: list[str] = []
        # A sandbox's store requests to torpord waiting for their answers, by id.
        self.store_waits: dict[int, tuple[threading.Event, dict[str, Any]]] = {}
        self.store_ids = 0
        self.store_lock = threading.Lock()
        self.preload_s = 0.0
        # spec.gpu.shrink_context: the context's stack limit to 0 at each quiet point (a base's
        # quiet point too: the base snapshot's residue is every cold start's of its functions).
        self.shrink_context = True
        self.sock: socket.socket | None = None
        self.reader: FrameReader | None = None
        self.reattach_s = DEFAULT_REATTACH_S
        # When the daemon was lost; None while a daemon holds this worker.
        self.lost_at: float | None = None
        # The main loop and the map reader both send: one whole frame at a time.
        self.send_lock = threading.Lock()
        # Counts the connections (under send_lock): a sandbox request that began under another
        # daemon must not send its `result`, whose id is that daemon's, and one whose invoke
        # came on a lost connection must not start at all.
        self.generation = 0
        # The outcomes of requests with an idempotency key, for a daemon that re-adopts this
        # worker after losing the one that sent them (torpor.kept).
        self.kept = torpor_kept.KeptAnswers()
        # Set at each split quiesce: the segments a request may run without (torpor.readiness).
        self.deferrable: set[int] = set()
        # The hook's segments as listed at the first `map` frame of a mapping phase, and those
        # still unmapped: listing all of them per frame cost ~0.2 ms a frame (68 at 8B).
        self._listing: dict[int, torpor_hook.Segment] | None = None
        self._unmapped: set[int] = set()
        # While segments are being mapped after a restore (None otherwise).
        self.readiness: Readiness | None = None
        self.module_waits: ModuleWaits | None = None
        self.map_reader: MapReader | None = None
        # Each loaded function's memory pool (torpor.mempool) and keepalive.memory_release_s;
        # each function's count of requests begun, so an idle release knows it is still idle.
        self.pools: dict[str, torpor_mempool.FunctionPool] = {}
        self.release_after: dict[str, float] = {}
        self.begun: dict[str, int] = {}
        # Held while an idle release sends its `memory` frame, and by quiesce while it sets
        # `quiescing`: no frame of a release may follow `quiet`.
        self.memory_lock = threading.Lock()
        # A sandbox's requests and its functions' setup and warm-up run on lanes: long-lived
        # threads with a CUDA stream each, so one request at a time uses one cuBLAS handle and
        # one workspace (torpor.lanes).
        self.lanes = torpor_lanes.Lanes()
        self.quiescing = False
        # Set by `release_gpu` (torpord checkpoints the GPU in place next), cleared when torpord
        # serves this worker again: no pool is released meanwhile. A pool release while the
        # driver held the process checkpointed killed sandbox workers in libcuda on the H200
        # (docs/sandboxes.md, "The GPU release of a sandbox"), where a plain process's
        # empty_cache() waits for the restore.
        self.gpu_released = False
        # The pools whose idle release fell while the GPU was released: timed again once it is
        # back.
        self.held_back: set[str] = set()

    # -- connection ---------------------------------------------------------------------------

    def connect(self, resumed: bool) -> None:
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        delay = 0.01
        while True:
            try:
                self.dial(resumed, reattach=False)
                return
            except OSError as e:
                retry = e.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN)
                if not retry or time.monotonic() > deadline:
                    raise ConnectError(
                        f"cannot connect to ${ENV_SOCKET}={self.socket_path}: {e.strerror}; "
                        "start torpord (or point the variable at its workers.sock)"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.2)

    def dial(self, resumed: bool, reattach: bool) -> None:
        """One connection attempt and its hello; OSError when the daemon is not there."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(self.socket_path)
        except OSError:
            s.close()
            raise
        with self.send_lock:
            self.sock = s
            self.generation += 1
        if self.reader is None:
            self.reader = FrameReader(s)
        else:
            self.reader.sock = s
        hello: dict[str, Any] = {
            "type": "hello",
            "pid": os.getpid(),
            "role": self.role,
            "function": self.function,
            "resumed": resumed,
            "protocol": PROTOCOL,
            "reattach": reattach,
        }
        # Taken after the generation changed: a sandbox's keyed request has either begun
        # before that, and is named here, or will not start (_request_thread).
        held = self.kept.held() if reattach else []
        if held:
            hello["keys"] = held
        self.send(hello)

    def send(self, obj: dict[str, Any]) -> None:
        self.send_frame(encode(obj))

    def send_frame(self, frame: bytes) -> None:
        assert self.sock is not None
        with self.send_lock:
            self.sock.sendall(frame)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def fail(self, phase: str, e: BaseException) -> int:
        """Report a failed preload/load as ready {ok: false} and return the exit status."""
        what = self.function or self.role
        print(f"torpor worker: {what}: {phase} failed: {_type_name(e)}: {_str(e)}", file=sys.stderr)
        self.send({"type": "ready", "ok": False, "phase": phase, "error": error_doc(e)})
        self.close()
        return EXIT_LOAD

    # -- life cycle ---------------------------------------------------------------------------

    def run(self) -> int:
        self.connect(resumed=False)
        # Before any framework is imported: they read their memory settings when they start.
        torpor_gpu.prepare_environment()
        t0 = time.perf_counter()
        try:
            for name in self.preload:
                importlib.import_module(name)
        except Exception as e:
            return self.fail("preload", e)
        t1 = time.perf_counter()
        warm_requests = 0
        if self.gpu:
            try:
                self.gpu_framework = torpor_gpu.warm()
                if self.announce_warm:
                    # A ready sandbox of the pool: its functions' first requests find the
                    # common kernels loaded (torpor.gpu.warm_requests).
                    warm_requests = torpor_gpu.warm_requests(self.gpu_framework, self.lanes.run)
            except Exception as e:
                return self.fail("gpu_warmup", e)
        t2 = time.perf_counter()
        self.preload_s = t1 - t0
        if self.role == "base":
            self.send({"type": "ready", "ok": True, "setup_s": t1 - t0, "warmup_s": t2 - t1})
        elif self.announce_warm:
            self.send({"type": "warmed", "preload_s": t1 - t0, "warmup_s": t2 - t1, "warm_requests": warm_requests})
        return self.serve()

    def next_frame(self) -> dict[str, Any] | None:
        """The next frame to serve; None when the connection ended. While segments are being
        mapped it comes from the map reader, else straight from the socket."""
        assert self.reader is not None
        if self.map_reader is not None:
            item = self.map_reader.next()
            if isinstance(item, dict):
                return item
            self.map_reader.thread.join()
            self.map_reader = None
            self.settle_readiness()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                return None
        try:
            return self.reader.read()
        except ConnectionError:
            return None

    def serve(self) -> int:
        while True:
            msg = self.next_frame()
            if msg is None:
                if not self.reattach():
                    return EXIT_OK
                continue
            kind = msg.get("type")
            if kind in GPU_BACK and self.gpu_released and not (kind == "quiesce" and msg.get("released") is True):
                # torpord resumes a released GPU before it sends any of these (but a quiesce
                # that says released: the GPU stays checkpointed through the snapshot).
                self.gpu_back()
            if kind == "invoke":
                try:
                    self.invoke(msg)
                except ConnectionError:
                    # The daemon went while the handler ran: its client went with it.
                    if not self.reattach():
                        return EXIT_OK
            elif kind == "attached":
                self.attached(msg)
            elif kind == "load":
                if not self.load(msg):
                    return EXIT_LOAD
            elif kind == "quiesce":
                if not self.quiesce(msg):
                    self.close()
                    return EXIT_OK
                self.quiescing = False
            elif kind == "map":
                # After `unmap`: torpord maps the segments back before the next request.
                self.map_segment(msg)
            elif kind == "unmap":
                self.unmap_segments(msg)
            elif kind == "release_gpu":
                self.release_gpu()
            elif kind == "shutdown":
                self.close()
                return EXIT_OK
            elif kind == "release_memory":
                # A request waits for room in this sandbox: idle pools go back now.
                for pool in list(self.pools.values()):
                    self._idle_release(pool, None)
            elif kind in STORE_ANSWERS:
                self.store_answer(msg, self.reader.take_fd() if self.reader is not None else None)
            elif kind == "store_unmap":
                self.store_unmap(msg)
            elif kind == "release":
                raise ProtocolError("release outside a split quiesce; send quiesce {split: true} first")
            else:
                raise ProtocolError(f"unknown frame type {kind!r} (known: {', '.join(SERVES)})")

    # -- messages -----------------------------------------------------------------------------

    def invoke(self, msg: dict[str, Any]) -> None:
        call = self.call
        if call is None:
            raise ProtocolError("invoke before load; send load and wait for ready first")
        if "id" not in msg or "request" not in msg:
            raise ProtocolError(f"invoke frame lacks {'id' if 'id' not in msg else 'request'}")
        rid = msg["id"]
        fname = msg.get("function")
        key, fingerprint = msg.get("key"), msg.get("fingerprint")
        slot: torpor_kept.Slot | None = None
        if key is not None or fingerprint is not None:
            if not isinstance(key, str) or not isinstance(fingerprint, str):
                raise ProtocolError("invoke's key and fingerprint must both be strings, or both absent")
            slot = (fname, key)
        if fname is not None:
            if not isinstance(fname, str):
                raise ProtocolError(f"invoke's function must be a string, got {fname!r}")
            named = self.functions.get(fname)
            if named is None:
                # A function deployed after this sandbox's snapshot was taken (docs/sandboxes.md).
                self.send({"type": "started", "id": rid})
                self.send_result(
                    {
                        "type": "result",
                        "id": rid,
                        "ok": False,
                        "error": {
                            "type": "NotLoaded",
                            "message": _text(
                                f"function {fname!r} is not loaded in this sandbox (it hosts "
                                f"{', '.join(sorted(self.functions))}); deploy {fname} again so that "
                                "its sandbox's snapshot includes it"
                            ),
                            "traceback": "",
                        },
                        "handler_s": 0.0,
                    }
                )
                return
            call = named
        if self.map_reader is None and self.reader is not None and self.reader.fds:
            # After `unmap`, until the map frames bring every segment back: the request would
            # touch memory that is not there (SIGSEGV, or a broken CUDA context).
            raise ProtocolError(
                "invoke while segments are released after unmap; torpord must map them back first"
            )
        readiness = self.readiness
        if readiness is not None:
            # Right after a restore: wait for every segment the request could touch outside
            # the modules' forwards (the module pre-hooks wait for the rest).
            try:
                readiness.wait_segments(readiness.pending() - self.deferrable)
            except Exception as e:
                self.send({"type": "started", "id": rid})
                self.send_result(
                    {"type": "result", "id": rid, "ok": False, "error": error_doc(e), "handler_s": 0.0}
                )
                return
        if self.sandbox:
            # Each request on a lane (a thread with a CUDA stream of its own under torch): the
            # sandbox's functions (and more requests of one of them, up to
            # requests_per_instance) run side by side.
            request = msg["request"]
            # The connection this frame came on, taken here: the lane may start it only after
            # this loop has reattached to another daemon (_request_thread).
            generation = self.generation
            self.lanes.submit(
                lambda: self._request_thread(
                    call, rid, request, fname or self.function, slot, fingerprint, generation
                )
            )
            return
        # The daemon's timeout counts from here, not from the time this request waited behind
        # the ones before it.
        self.send({"type": "started", "id": rid})
        # Kept from here, where it runs: one whose `started` found no daemon never ran, and
        # must not be named in the reattach hello (its retry would wait for an answer).
        if slot is not None and fingerprint is not None:
            self.kept.begin(slot, fingerprint)
        try:
            out = self.call_result(rid, call, msg["request"], fname or self.function)
        finally:
            torpor_data.set_dump_sink(None)
        self.settle_readiness()
        self.send_result(out, slot=slot)

    def call_result(
        self, rid: Any, call: Callable[[Any], Any], request: Any, function: str | None
    ) -> dict[str, Any]:
        """Calls `function` on `request` (its {"$ref"} objects replaced by their bytes,
        torpor.dump's sink set, torpor.load and dump on its own declared data) and returns the
        `result` frame: its value or its error, and the handler's time."""
        t0 = time.perf_counter()
        try:
            torpor_data.set_dump_sink(self.send_dump)
            with torpor_data.serving(function or ""):
                value = call(torpor_data.with_refs(request))
        except Exception as e:
            return {"type": "result", "id": rid, "ok": False, "error": error_doc(e), "handler_s": time.perf_counter() - t0}
        return {"type": "result", "id": rid, "ok": True, "value": value, "handler_s": time.perf_counter() - t0}

    def send_dump(self, function: str, name: str, data: bytes) -> None:
        """torpor.dump while a request runs: torpord writes `data` to the object of `function`'s
        entry `name` in the background (the handler does not wait for the store). The function
        is named for a sandbox, whose functions each declare their own data."""
        import base64

        frame: dict[str, Any] = {"type": "dump", "name": name, "data": base64.b64encode(data).decode("ascii")}
        if function and function != self.function:
            frame["function"] = function
        self.send(frame)

    def _request_thread(
        self,
        call: Callable[[Any], Any],
        rid: Any,
        request: Any,
        fname: str | None,
        slot: torpor_kept.Slot | None,
        fingerprint: str | None,
        generation: int,
    ) -> None:
        """A sandbox's request, on a lane (torpor.lanes: its thread and CUDA stream) and in its
        function's memory pool: `started`, the call, its `result` with the pool's `memory`
        report. A lost daemon is the main loop's business: the result dies with the connection
        (a keyed one is kept, and settled with the daemon that re-adopts this worker).
        `generation`: the connection its invoke frame came on."""
        pool = self._begin(fname)
        try:
            with self.send_lock:
                # A frame of a lost connection never runs, as a plain worker's `started` finds
                # no daemon: the lane may start it after the main loop reattached, and then
                # its key is not in that hello (the client's retry would run it again) and its
                # `result` would carry the lost daemon's id to the new one. `started` and
                # kept.begin in one section: dial bumps the generation under this lock before
                # it takes hello's keys, so a request that ran is named there.
                if generation != self.generation or self.sock is None:
                    return
                self.sock.sendall(encode({"type": "started", "id": rid}))
                if slot is not None and fingerprint is not None:
                    self.kept.begin(slot, fingerprint)
            framework = self.gpu_framework or torpor_gpu.framework()

            def on_own_stream(req: Any) -> Any:
                with torpor_gpu.request_stream(framework):
                    return call(req)

            # torpor.dump's sink is process-wide: a sandbox's threads share it (never unset).
            try:
                # Before the pool routes this thread's allocations (the workspace stays out
                # of it).
                torpor_gpu.prepare_lane(framework)
                if pool is None:
                    out = self.call_result(rid, on_own_stream, request, fname)
                else:
                    with pool.request() as used:
                        out = self.call_result(rid, on_own_stream, request, fname)
                    out["memory"] = pool.report(used["peak"])
            except Exception as e:
                # The harness's own part failed (the request's memory pool, its stream): the
                # request is answered with that error rather than never (the daemon would wait
                # for it until timeout_s and hold its slot meanwhile).
                out = {"type": "result", "id": rid, "ok": False, "error": error_doc(e), "handler_s": 0.0}
            # The next request, which torpord may send as soon as it has this result, finds
            # this lane free instead of starting another.
            torpor_lanes.release()
            self.send_result(out, generation=generation, slot=slot)
        except (ConnectionError, OSError, AssertionError):
            pass
        finally:
            self._ended(fname)

    # -- the functions' memory pools (torpor.mempool) ---------------------------------------

    def _begin(self, fname: str | None) -> torpor_mempool.FunctionPool | None:
        pool = self.pools.get(fname) if fname is not None else None
        if pool is not None:
            with self.memory_lock:
                self.begun[pool.name] = self.begun.get(pool.name, 0) + 1
        return pool

    def _ended(self, fname: str | None) -> None:
        """After a request of `fname`: its pool's memory is given back once the function has
        been idle for its keepalive.memory_release_s."""
        pool = self.pools.get(fname) if fname is not None else None
        if pool is None:
            return
        with self.memory_lock:
            token = self.begun.get(pool.name, 0)
        timer = threading.Timer(self.release_after.get(pool.name, 0.0), self._idle_release, (pool, token))
        timer.daemon = True
        timer.start()

    def _idle_release(self, pool: torpor_mempool.FunctionPool, token: int | None) -> None:
        """The function stayed idle (`token`: its count of requests begun then; None: torpord
        asked, `release_memory`): its pool's memory goes back, and a sandbox tells torpord
        (`memory` {function, resident, pool}), whose accounting drops."""
        with self.memory_lock:
            if self.gpu_released and not self.quiescing:
                self.held_back.add(pool.name)
                return
            if self.quiescing or pool.in_flight:
                return
            if token is not None and self.begun.get(pool.name, 0) != token:
                return
            got = pool.release()
            if got == torpor_mempool.DEFERRED:
                # Another function's request (or a graph capture) is in a pool: PyTorch would
                # abort the process if this one were emptied now. Again once none is.
                torpor_mempool.GATE.when_idle(lambda: self._release_later(pool, token))
                return
            if got == 0 or self.sock is None:
                return
            try:
                self._report_memory(pool)
            except (ConnectionError, OSError, AssertionError):
                pass

    def _release_later(self, pool: torpor_mempool.FunctionPool, token: int | None) -> None:
        """A deferred idle release, tried again on a thread of its own (this runs on the thread
        whose request ended last, or under the memory lock)."""
        timer = threading.Timer(0, self._idle_release, (pool, token))
        timer.daemon = True
        timer.start()

    def _report_memory(self, pool: torpor_mempool.FunctionPool) -> None:
        """A sandbox tells torpord what `pool` holds after a release (`memory` {function,
        resident, pool}); a single function's worker has no account there to tell."""
        if self.sandbox:
            self.send(pool.report() | {"type": "memory"})

    # -- torpord's communication store (a sandbox's request threads) ----------------------

    def _store_request(
        self, frame: dict[str, Any], fd: int | None = None, rid: int | None = None, timeout_s: float = STORE_TIMEOUT_S
    ) -> tuple[dict[str, Any], int | None]:
        """Sends a store request (with `fd` after it, in a store_fd frame) and waits for
        torpord's answer, which the main loop (or the map reader) hands over. `rid`: the id of
        the request this one goes on (a GPU put's store_written), else a new one."""
        return self._store_wait(frame["type"], *self._store_send(frame, fd, rid), timeout_s=timeout_s)

    def _store_send(
        self, frame: dict[str, Any], fd: int | None = None, rid: int | None = None
    ) -> tuple[int, tuple[threading.Event, dict[str, Any]]]:
        """The sending half of `_store_request`: the request's id and where its answer lands."""
        with self.store_lock:
            if rid is None:
                self.store_ids += 1
                rid = self.store_ids
            done: tuple[threading.Event, dict[str, Any]] = (threading.Event(), {})
            self.store_waits[rid] = done
        frame["id"] = rid
        try:
            with self.send_lock:
                sock = self.sock
                if sock is None:
                    raise ConnectionError("not connected to torpord")
                release = self.store_release_frame()
                if release is not None:
                    # The gets this worker ended and the leases it let go of go first: this
                    # request may want their memory.
                    sock.sendall(encode(release))
                sock.sendall(encode(frame))
                if fd is not None:
                    write_frame_with_fd(sock, {"type": "store_fd", "id": rid, "fd": True}, fd)
            done[1]["sent"] = time.perf_counter()
        except BaseException:
            with self.store_lock:
                self.store_waits.pop(rid, None)
            raise
        return rid, done

    def _store_wait(
        self, what: str, rid: int, done: tuple[threading.Event, dict[str, Any]], timeout_s: float = STORE_TIMEOUT_S
    ) -> tuple[dict[str, Any], int | None]:
        """The waiting half of `_store_request`: torpord's answer to request `rid`. For a GPU
        put's or get's steps (torpor.store_gpu.steps()), how long the answer took to reach the
        main loop after the send (`<what>.answer`) and this thread to wake after that
        (`<what>.wake`)."""
        try:
            if not done[0].wait(timeout_s):
                raise TimeoutError(f"torpord did not answer {what} within {timeout_s:g} s")
        finally:
            with self.store_lock:
                self.store_waits.pop(rid, None)
        woke = time.perf_counter()
        answer = done[1]
        torpor_store_gpu.note(f"{what}.answer", answer["arrived"] - answer["sent"])
        torpor_store_gpu.note(f"{what}.wake", woke - answer["arrived"])
        return answer["msg"], answer["fd"]

    def store_answer(self, msg: dict[str, Any], fd: int | None) -> None:
        """torpord's answer to a store request: to the thread waiting for it (an answer nobody
        waits for any more is dropped, its fd closed)."""
        rid = msg.get("id")
        with self.store_lock:
            waiting = self.store_waits.get(rid) if isinstance(rid, int) else None
        if waiting is None:
            if fd is not None:
                os.close(fd)
            return
        waiting[1].update(msg=msg, fd=fd, arrived=time.perf_counter())
        waiting[0].set()

    def store_put_remote(self, key: str, ttl_s: float, meta: dict[str, Any], fd: int, nodes: str | None) -> str | None:
        put: dict[str, Any] = {"type": "store_put", "key": key, "ttl_s": ttl_s, "meta": meta}
        if nodes is not None:
            put["nodes"] = nodes
        msg, got = self._store_request(put, fd, timeout_s=STORE_TIMEOUT_S if nodes is None else STORE_BUCKET_TIMEOUT_S)
        if got is not None:
            os.close(got)
        if msg.get("ok") is True:
            return None
        return str(msg.get("error") or "refused")

    def store_put_gpu_remote(
        self,
        key: str,
        ttl_s: float,
        meta: dict[str, Any],
        nbytes: int,
        ordinal: int,
        fill: Callable[[int, int, Callable[[], None], int | None], None],
        nodes: str | None,
    ) -> str | None:
        """A GPU put: torpord's memory (store_memory) filled by `fill(fd, padded, copied,
        block)`, which calls `copied()` once the value is in it (store_written is sent then)
        and unmaps it after (or keeps the mapping of torpord's `block`); torpord's error line,
        or None once stored."""
        put: dict[str, Any] = {"type": "store_put", "key": key, "ttl_s": ttl_s, "meta": meta, "gpu": {"bytes": nbytes, "ordinal": ordinal}}
        if nodes is not None:
            put["nodes"] = nodes
        lease = torpor_store_gpu.take_lease(nbytes, ordinal) if nodes is None else None
        if lease is not None:
            # Into the memory torpord set aside for it: filled first, then one request.
            try:
                fill(lease.fd, lease.padded, lambda: None, lease.block)
            except BaseException:
                # Not filled: the lease goes back to torpord (only the worker's word does that).
                torpor_store_gpu.let_go(lease)
                raise
            os.close(lease.fd)
            put["gpu"]["lease"] = lease.block
            msg, got = self._store_request(put)
            torpor_store_gpu.step("leased_request")
            self._store_lease(msg, got)
            return None if msg.get("ok") is True else str(msg.get("error") or "refused")
        msg, fd = self._store_request(put)
        torpor_store_gpu.step("put_request")
        if msg.get("ok") is not True or fd is None or not isinstance(msg.get("padded"), int):
            if fd is not None:
                os.close(fd)
            return str(msg.get("error") or "torpord's store_memory came without its memory")
        rid = int(msg["id"])
        # For every node, torpord uploads the value before it answers.
        timeout_s = STORE_TIMEOUT_S if nodes is None else STORE_BUCKET_TIMEOUT_S
        written: list[tuple[int, tuple[threading.Event, dict[str, Any]]]] = []

        def copied() -> None:
            # The value is in torpord's memory: store_written goes now, and the worker unmaps
            # its mapping while torpord stores the value (the answer is awaited below).
            written.append(self._store_send({"type": "store_written", "ok": True}, rid=rid))

        try:
            block = msg.get("block")
            fill(fd, int(msg["padded"]), copied, block if isinstance(block, int) and not isinstance(block, bool) else None)
        except BaseException as e:
            if not written:
                # torpord takes its memory back; the key keeps what it held.
                self._store_request({"type": "store_written", "ok": False, "error": f"{type(e).__name__}: {e}"}, rid=rid)
            else:
                with self.store_lock:
                    self.store_waits.pop(rid, None)
            raise
        finally:
            os.close(fd)
            torpor_store_gpu.step("close_fd")
        if not written:
            raise RuntimeError("the GPU value was filled without telling torpord (store_written)")
        msg, got = self._store_wait("store_written", *written[0], timeout_s=timeout_s)
        torpor_store_gpu.step("written_request")
        self._store_lease(msg, got)
        return None if msg.get("ok") is True else str(msg.get("error") or "refused")

    def _store_lease(self, msg: dict[str, Any], fd: int | None) -> None:
        """A `store_stored`'s lease (protocol 4) and its fd, kept for the next put."""
        lease = msg.get("lease")
        if fd is None:
            return
        fields = ("block", "padded", "min_bytes", "ordinal")
        if not isinstance(lease, dict) or not all(isinstance(lease.get(k), int) for k in fields):
            os.close(fd)
            return
        block, padded, min_bytes, ordinal = (int(lease[k]) for k in fields)
        torpor_store_gpu.set_lease(torpor_store_gpu.Lease(block, padded, min_bytes, ordinal, fd))

    def store_get_remote(self, key: str, keep: bool) -> tuple[dict[str, Any], int, int, dict[str, Any] | None] | None:
        msg, fd = self._store_request({"type": "store_get", "key": key, "keep": keep}, timeout_s=STORE_BUCKET_TIMEOUT_S)
        torpor_store_gpu.step("get_request")
        if msg.get("found") is not True:
            if fd is not None:
                os.close(fd)
            if msg.get("error"):
                raise RuntimeError(f"torpord's store: {msg['error']}")
            return None
        size, meta = msg.get("bytes"), msg.get("meta")
        if fd is None or not isinstance(size, int) or not isinstance(meta, dict):
            if fd is not None:
                os.close(fd)
            raise RuntimeError("torpord's store_value came without its memfd, size or meta")
        gpu = msg.get("gpu")
        return meta, size, fd, gpu if isinstance(gpu, dict) else None

    def send_result(
        self, out: dict[str, Any], generation: int | None = None, slot: torpor_kept.Slot | None = None
    ) -> None:
        """Sends a result frame; a value that cannot be sent becomes a ResultError. A keyed
        request's outcome is kept first (torpor.kept). `generation`: the connection the request
        came on; on a later one its `settled` frame goes instead (or nothing, unkeyed)."""
        self.send_store_releases()
        rid = out["id"]
        try:
            frame = encode(out)
        except FrameError as e:
            out = {
                "type": "result",
                "id": rid,
                "ok": False,
                "error": {
                    "type": "ResultError",
                    "message": _text(f"the value {self.entry} returned cannot be sent: {e}"),
                    "traceback": "",
                },
                "handler_s": out["handler_s"],
            }
            frame = encode(out)
        if slot is not None:
            self.kept.end(slot, out, len(frame))
        if generation is not None:
            with self.send_lock:
                if generation != self.generation:
                    settled = self.kept.settled(slot) if slot is not None else None
                    if settled is None or self.sock is None:
                        return
                    frame = encode(settled)
                assert self.sock is not None
                self.sock.sendall(frame)
            return
        self.send_frame(frame)

    def send_store_releases(self) -> None:
        """The store gets whose objects went during a request (torpor.store_gpu, "Kept
        mappings"), told to torpord before its result: torpord reads them first, so the next
        put, which the result may set off in another sandbox, finds their memory free."""
        release = self.store_release_frame()
        if release is None:
            return
        try:
            self.send(release)
        except (ConnectionError, OSError, AssertionError):
            # torpord forgets a lost connection's gets itself.
            pass

    @staticmethod
    def store_release_frame() -> dict[str, Any] | None:
        """`store_release` for the gets ended and the leases let go of since the last one."""
        blocks, leases = torpor_store_gpu.take_releases(), torpor_store_gpu.take_unleased()
        if not blocks and not leases:
            return None
        frame: dict[str, Any] = {"type": "store_release", "blocks": blocks}
        if leases:
            frame["leases"] = leases
        return frame

    def store_unmap(self, msg: dict[str, Any]) -> None:
        """torpord let go of blocks of its store's GPU memory: this worker's kept mappings of
        them go."""
        blocks = msg.get("blocks")
        if not isinstance(blocks, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks):
            raise ProtocolError("store_unmap needs blocks, the list of block ids")
        try:
            torpor_store_gpu.unmap_blocks(blocks)
        except torpor_store_gpu.StoreGpuError as e:
            # No context to unmap with: the mappings stay until the worker ends (its memory is
            # the driver's to take back then), and the worker serves on.
            print(f"torpor worker: store_unmap: {e}", file=sys.stderr)

    def drop_store_mappings(self) -> None:
        """A quiet point: the store's GPU memory this worker kept mapped goes (neither a
        snapshot nor the driver's checkpoint carries it; torpor.store_gpu)."""
        try:
            torpor_store_gpu.drop_kept()
        except torpor_store_gpu.StoreGpuError:
            pass

    def attached(self, msg: dict[str, Any]) -> None:
        grace = msg.get("reattach_s")
        if not isinstance(grace, (int, float)) or isinstance(grace, bool) or grace < 0:
            raise ProtocolError(f"attached needs reattach_s (seconds >= 0), got {grace!r}")
        self.reattach_s = float(grace)
        self.lost_at = None

    def reattach(self) -> bool:
        """After losing torpord outside a quiet point: keep this instance (its memory is what a
        new daemon re-adopts) and reconnect until a daemon answers `attached`, for at most
        reattach_s. False when the worker should exit instead."""
        self.stop_map_reader()
        self.close()
        if self.call is None:
            print("torpor worker: torpord closed the connection; exiting", file=sys.stderr)
            return False
        if self.lost_at is None:
            self.lost_at = time.monotonic()
            print(
                f"torpor worker: lost torpord; waiting up to {self.reattach_s:g} s for one to take this instance back",
                file=sys.stderr,
            )
        deadline = self.lost_at + self.reattach_s
        delay = 0.02
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                print(
                    f"torpor worker: no torpord took this instance back within {self.reattach_s:g} s; exiting",
                    file=sys.stderr,
                )
                return False
            msg: dict[str, Any] | None = None
            try:
                self.dial(resumed=True, reattach=True)
                assert self.sock is not None
                self.sock.settimeout(left)
                # A fresh reader: frames buffered from the lost connection are for a dead daemon.
                self.reader = FrameReader(self.sock)
                self.reader.accept_fds = self.sandbox
                msg = self.reader.read()
            except OSError:
                msg = None
            if msg is not None:
                if msg.get("type") != "attached":
                    raise ProtocolError(f"expected attached after reattaching, got {msg.get('type')!r}")
                assert self.sock is not None
                self.sock.settimeout(None)
                self.attached(msg)
                print("torpor worker: a torpord took this instance back", file=sys.stderr)
                self.settle_kept()
                return True
            self.close()
            time.sleep(min(delay, max(left, 0.0)))
            delay = min(delay * 2, REATTACH_MAX_DELAY_S)

    def settle_kept(self) -> None:
        """To a daemon that re-adopted this worker: a `settled` frame for each keyed request
        answered (the lost daemon may not have passed the answer on). One that fails to send is
        the main loop's to find: the connection is gone again."""
        try:
            for slot in self.kept.answered():
                frame = self.kept.settled(slot)
                if frame is not None:
                    self.send(frame)
        except OSError:
            pass

    def load(self, msg: dict[str, Any]) -> bool:
        spec, fdir, data_map = msg.get("spec"), msg.get("dir"), msg.get("data")
        if not isinstance(spec, dict) or not isinstance(fdir, str) or not isinstance(data_map, dict):
            raise ProtocolError("load needs spec (object), dir (string) and data (object)")
        name, entry = spec.get("name"), spec.get("entry")
        scaling = spec.get("scaling")
        sandboxed = isinstance(scaling, dict) and scaling.get("sandbox") is True
        tenant = spec.get("tenant")
        if self.call is not None:
            if not (self.sandbox and sandboxed):
                raise ProtocolError(
                    f"a second load, but this worker already serves {self.function} and is not a sandbox; "
                    "start another worker (or set scaling.sandbox = true on both functions)"
                )
            if tenant != self.tenant:
                raise ProtocolError(
                    f"load of {name!r} of tenant {tenant!r} into a sandbox of tenant {self.tenant!r}: "
                    "functions of different tenants never share a sandbox"
                )
            if name in self.functions:
                raise ProtocolError(f"a second load of {name!r} into this sandbox; it is loaded already")
        decls, warmup = spec.get("data", []), spec.get("warmup")
        if not isinstance(name, str) or not isinstance(entry, str):
            raise ProtocolError(
                "load's spec lacks name or entry; send the JSON of `python3 -m torpor.spec DIR`"
            )
        if not isinstance(decls, list) or not all(
            isinstance(d, dict)
            and isinstance(d.get("name"), str)
            and isinstance(d.get("size"), int)
            and d.get("access", "read-only") in ("read-only", "writable")
            for d in decls
        ):
            raise ProtocolError("load's spec.data must be a list of {name, size, access}")
        if warmup is not None and (not isinstance(warmup, dict) or "request" not in warmup):
            raise ProtocolError("load's spec.warmup must be null or {request}")
        gpu = spec.get("gpu", {})
        pack_weights = gpu.get("pack_weights", True) if isinstance(gpu, dict) else None
        shrink = gpu.get("shrink_context", True) if isinstance(gpu, dict) else None
        if not isinstance(pack_weights, bool) or not isinstance(shrink, bool):
            raise ProtocolError(
                "load's spec.gpu must be absent or {pack_weights: true|false, shrink_context: true|false}"
            )
        self.shrink_context = shrink
        declared = {d["name"] for d in decls}
        if set(data_map) != declared or not all(
            isinstance(p, str) or p == {"fd": True} for p in data_map.values()
        ):
            raise ProtocolError(
                f"load's data map names {sorted(data_map)} but the spec declares {sorted(declared)}; "
                'send one path (or {"fd": true}, then a data_fd frame) per declared name'
            )
        # Platform-loaded data (a source in torpor.toml): its memfd follows in a data_fd frame.
        data_fds = self.read_data_fds([d["name"] for d in decls if data_map[d["name"]] == {"fd": True}])
        # Platform-managed GPU data (device = "cuda"): its memory follows in gpu_data frames.
        gpu_data = self.read_gpu_data([d["name"] for d in decls if d.get("device") == "cuda"])
        if self.call is None:
            self.function, self.entry, self.role = name, entry, "function"
            self.sandbox, self.tenant = sandboxed, tenant if isinstance(tenant, str) else None
            if sandboxed:
                assert self.reader is not None
                self.reader.accept_fds = True
                torpor_store.connect(self.store_put_remote, self.store_get_remote, self.store_put_gpu_remote)
        else:
            self.entry = entry
            _forget_modules_of(self.loaded_dirs)
        phase = "data"
        t_data = time.perf_counter()
        try:
            bound = []
            for d in decls:
                fd = data_fds.get(d["name"])
                path = Path(f"/proc/self/fd/{fd}") if fd is not None else Path(data_map[d["name"]])
                access = str(d.get("access", "read-only"))
                try:
                    size = path.stat().st_size
                except OSError as e:
                    raise DataError(
                        f"declared data {d['name']!r}: {path}: {e.strerror}; restore the file or redeploy"
                    ) from None
                if access == "read-only" and size != d["size"]:
                    raise DataError(
                        f"declared data {d['name']!r}: {path} has {size} bytes, "
                        f"the spec says {d['size']}; redeploy the function"
                    )
                bound.append(
                    torpor_data.Bound(d["name"], path, d["size"], access, d.get("source"), str(d.get("device", "host")))
                )
            torpor_data.bind(bound, f"the torpor.toml of {name}", function=name)
            for frame, fd in gpu_data:
                torpor_data.map_gpu(frame["name"], fd, frame["size"], frame["padded"], frame["readonly"])
            phase = "import"
            t_import = time.perf_counter()
            cls = resolve(fdir, entry)
            t_imported = time.perf_counter()
            phase = "setup"
            gpu_memory = spec.get("gpu_memory", 0)
            torpor_gpu.limit_memory(gpu_memory if isinstance(gpu_memory, int) else 0)
            t0 = time.perf_counter()
            pool = torpor_mempool.FunctionPool(
                name, torpor_mempool.backend_for(self.gpu_framework or torpor_gpu.framework())
            )
            instance = cls()
            framework = self.gpu_framework or torpor_gpu.framework()
            if sandboxed and self.call is None:
                # This worker becomes a sandbox: the boot's warm-up left cuBLAS a workspace for
                # the default stream, which its lanes never use.
                torpor_gpu.clear_blas_workspaces()
            # A sandbox's function sets up and warms up on a lane, in its stream, as its
            # requests will run: the main thread never holds a cuBLAS handle of its own there
            # (torpor.lanes). A function in a worker of its own runs both here, as its requests.
            on_lane = self.lanes.run if sandboxed else _here

            def set_up() -> None:
                torpor_gpu.prepare_lane(framework)
                with torpor_gpu.request_stream(framework) if sandboxed else contextlib.nullcontext(), pool.setup():
                    instance.setup()

            on_lane(set_up)
            t1 = time.perf_counter()
            packed = self.pack(instance, name) if pack_weights else None
            t_packed = time.perf_counter()
            phase = "warmup"
            if warmup is not None:
                # The warm-up request sets the segments' first-use order (docs/split.md).
                # A sandbox's function warms up in its pool (its memory model's peak); a
                # function in a worker of its own allocates as before.
                def warm_up() -> Any:
                    torpor_gpu.prepare_lane(framework)
                    scope = pool.request() if sandboxed else contextlib.nullcontext()
                    stream = torpor_gpu.request_stream(framework) if sandboxed else contextlib.nullcontext()
                    with torpor_hook.recording_first_use(), scope, stream:
                        return instance(warmup["request"])

                value = on_lane(warm_up)
                try:
                    encode({"value": value})
                except FrameError as e:
                    raise TypeError(f"the warm-up request's value cannot be sent: {e}") from None
            t2 = time.perf_counter()
        except Exception as e:
            self.fail(phase, e)
            return False
        finally:
            # The objects torpord loaded are for setup() and the warm-up: closed before the
            # snapshot, so that it does not carry a second copy of them.
            for fd in data_fds.values():
                os.close(fd)
            for _, fd in gpu_data:
                os.close(fd)
            torpor_data.loaded_done()
        if self.call is None:
            self.call = instance.__call__
        self.functions[name] = instance.__call__
        self.loaded_dirs.append(fdir)
        # The warm-up's memory is given back before the snapshot: the model keeps its peak
        # (in a sandbox whose other functions serve now, once none of their requests runs).
        deferred = pool.release() == torpor_mempool.DEFERRED
        self.pools[name] = pool
        self.release_after[name] = _memory_release_s(spec)
        self.begun[name] = 0
        if deferred:
            torpor_mempool.GATE.when_idle(lambda: self._release_later(pool, None))
        ready: dict[str, Any] = {
            "type": "ready",
            "ok": True,
            "map_s": t_import - t_data,
            "import_s": t_imported - t_import,
            "setup_s": t1 - t0,
            "pack_s": t_packed - t1,
            "warmup_s": t2 - t_packed,
            "memory": pool.model(),
        }
        if self.started_as == "function":
            ready["preload_s"] = self.preload_s
        if packed is not None:
            ready["packed"] = packed
        self.send(ready)
        return True

    def read_data_fds(self, names: list[str]) -> dict[str, int]:
        """The memfds of `names` from the data_fd frames that follow `load`, in that order."""
        assert self.reader is not None
        fds: dict[str, int] = {}
        if not names:
            return fds
        self.reader.fds = True
        try:
            for want in names:
                msg = self.reader.read()
                fd = self.reader.take_fd()
                if msg is None or msg.get("type") != "data_fd" or msg.get("name") != want or fd is None:
                    if fd is not None:
                        os.close(fd)
                    for f in fds.values():
                        os.close(f)
                    got = "the end of the connection" if msg is None else f"{msg.get('type')!r} {msg.get('name')!r}"
                    raise ProtocolError(
                        f"expected data_fd {want!r} with its memfd after load, got {got}"
                        f"{'' if fd is not None or msg is None else ' without an fd'}"
                    )
                fds[want] = fd
        finally:
            self.reader.fds = False
        return fds

    def read_gpu_data(self, names: list[str]) -> list[tuple[dict[str, Any], int]]:
        """The gpu_data frames of `names` (and their fds) that follow `load` and its data_fd
        frames, in that order."""
        assert self.reader is not None
        out: list[tuple[dict[str, Any], int]] = []
        if not names:
            return out
        self.reader.fds = True
        try:
            for want in names:
                msg = self.reader.read()
                fd = self.reader.take_fd()
                ok = (
                    msg is not None
                    and msg.get("type") == "gpu_data"
                    and msg.get("name") == want
                    and all(isinstance(msg.get(k), int) for k in ("size", "padded"))
                    and isinstance(msg.get("readonly"), bool)
                )
                if not ok or fd is None:
                    if fd is not None:
                        os.close(fd)
                    for _, f in out:
                        os.close(f)
                    got = "the end of the connection" if msg is None else f"{msg.get('type')!r} {msg.get('name')!r}"
                    raise ProtocolError(f"expected gpu_data {want!r} with its fd after load, got {got}")
                assert msg is not None
                out.append((msg, fd))
        finally:
            self.reader.fds = False
        return out

    def pack(self, instance: Any, name: str) -> dict[str, Any] | None:
        """Move the function's CUDA weights into segments of their own (torpor.pack), when its
        CUDA allocations are segments of the hook; what was packed, for the ready frame. Packing
        is an optimisation: when it fails the weights stay correct where they are, and the
        function runs unpacked (a line on stderr says why)."""
        if os.environ.get(torpor_pack.ENV_HOOK_CUDA) != "1":
            return None
        try:
            packed = torpor_pack.pack_function(instance, name=name)
        except Exception as e:
            print(
                f"torpor worker: {name}: weights not packed, so instances will not share them: "
                f"{_type_name(e)}: {_str(e)}",
                file=sys.stderr,
            )
            return None
        if packed is None:
            return None
        doc = packed.frame()
        print(
            f"torpor worker: {name}: packed {doc['bytes']} bytes of weights ({doc['tensors']} tensors) "
            f"into {doc['segments']} segments of {doc['segment_bytes']} bytes in {doc['s']:.3f} s"
            + ("" if packed.whole else "; some pack is not a whole segment, so it will not be shared")
            + (f"; {doc['left_bytes']} bytes of old weights are still held outside the modules" if packed.left_bytes else ""),
            file=sys.stderr,
        )
        return doc

    # Shared memory left in a snapshot past this is worth a line in the worker's log: CRIU copies
    # all of it on every restore (about 1.5 GB/s on the H100), before the function runs.
    SHARED_MEMORY_NOTE_BYTES = 64 << 20

    def release_pinned_memory(self) -> None:
        """The quiet point's pinned host memory given back (torpor.gpu.release_pinned_caches), and
        a line naming what stays in the snapshot when that is much."""
        freed = torpor_gpu.release_pinned_caches()
        left = torpor_gpu.shared_anonymous_bytes()
        if left >= self.SHARED_MEMORY_NOTE_BYTES:
            print(
                f"torpor worker: {left / 2**20:.0f} MiB of shared memory (pinned host buffers the "
                f"function still holds?) stay in the snapshot after {freed / 2**20:.0f} MiB of cached "
                "pinned memory went; every restore copies it before the function runs: free pinned "
                "buffers once setup() is done",
                file=sys.stderr,
            )

    def quiesce(self, msg: dict[str, Any]) -> bool:
        """The quiet point; False when torpord sent shutdown instead of release."""
        split = msg.get("split", False)
        if not isinstance(split, bool):
            raise ProtocolError(f"quiesce's split must be true or false, got {split!r}")
        released = msg.get("released", False)
        if not isinstance(released, bool):
            raise ProtocolError(f"quiesce's released must be true or false, got {released!r}")
        if released:
            return self.quiesce_released()
        if self.map_reader is not None or self.readiness is not None:
            # The map reader too: a request may have settled the waits before the reader handed
            # the connection back, and its queue still holds frames.
            what = (
                f"{len(self.readiness.pending())} segment(s) are"
                if self.readiness is not None
                else "the last segment is"
            )
            raise ProtocolError(
                f"quiesce while {what} still being mapped after a restore; wait for every "
                "mapped frame before the next snapshot"
            )
        hook = self._split_hook("quiesce {split: true}") if split else None
        with self.memory_lock:
            # No idle release may send a frame after `quiet`; the pools' idle memory is not
            # worth a snapshot's bytes.
            self.quiescing = True
            for pool in self.pools.values():
                pool.release()
            # And what the allocator caches outside the pools (a graph capture's warm-up runs):
            # this snapshot lists the segments afresh, so no segment torpord holds goes.
            torpor_mempool.empty_cache()
        synced = torpor_gpu.sync()
        if synced:
            self.drop_store_mappings()
        if synced and self.shrink_context:
            torpor_gpu.shrink_context()
        if synced:
            self.release_pinned_memory()
        self.settle_for_snapshot()
        if hook is None:
            try:
                self.send({"type": "quiet", "cuda_synced": synced})
            except ConnectionError:
                # torpord went between quiesce and quiet: nothing was snapshotted, so this is
                # a lost daemon like any other; False (exit) when none takes it back.
                self.close()
                return self.reattach()
        else:
            outcome = self.hand_over_segments(hook, synced)
            if outcome == "shutdown":
                return False
            if outcome == "resume":
                # torpord only read the segments (their hashes): serve on, connected.
                return True
        self.sleep_until_woken()
        return True

    def settle_for_snapshot(self) -> None:
        """The host side of every quiet point: output flushed, buffers shrunk, garbage collected
        and what survives frozen, a stale SIGUSR2 drained."""
        sys.stdout.flush()
        sys.stderr.flush()
        assert self.reader is not None
        self.reader.shrink()
        # With a released GPU, what PyTorch's allocator gets back here stays in its cache (no
        # driver call).
        gc.collect()
        # What lived through this collection (the model, the libraries: 445 000 objects in a
        # GPT-2-Large worker) is frozen out of the cyclic collector: the next quiet point's
        # collect (a hibernation's stop) then scans only what came since, 0.0001 s instead of
        # 0.25 s on the H100 (bench/results/quiet-steps-s26-h100.json), and no later collection
        # walks, and so faults in or dirties, the restored heap's pages. Reference counting still
        # frees frozen objects; only a cycle among them that becomes garbage stays (gc.unfreeze()).
        gc.freeze()
        _drain_sigusr2()

    def sleep_until_woken(self) -> None:
        """After `quiet`: closes, waits for SIGUSR2 (the original after a failed snapshot, or
        any restored copy) and reconnects; segments released at the quiet point are mapped
        as `map` frames come."""
        assert self.reader is not None
        self.close()
        _wait_sigusr2()
        self.connect(resumed=True)
        if self.reader.fds:
            self.start_mapping()

    def quiesce_released(self) -> bool:
        """The quiet point of a worker whose GPU torpord released (`release_gpu`, then the
        driver's checkpoint in place): torpord snapshots it as it is, without resuming the GPU,
        so nothing here may call CUDA (a call would wait on the driver's lock): no synchronize
        (its work was done before `gpu_quiet`), no pool or allocator cache emptied (given back at
        `release_gpu`), no segment listed (torpord has those it handed over, saved at `unmap`;
        those this worker made since are in the driver's checkpoint, restored with the process)."""
        if not self.gpu_released:
            raise ProtocolError(
                "quiesce {released: true}, but torpord did not release this worker's GPU "
                "(release_gpu); send quiesce without released"
            )
        with self.memory_lock:
            self.quiescing = True
        self.settle_for_snapshot()
        try:
            self.send({"type": "quiet", "cuda_synced": False, "released": True})
        except ConnectionError:
            self.close()
            return self.reattach()
        self.sleep_until_woken()
        return True

    # -- segments mapped after a restore ------------------------------------------------------

    def start_mapping(self) -> None:
        """After a restore: from now until every segment is mapped, `map` frames are applied by
        the map reader, even while a request runs, and requests wait for the segments they need
        (torpor.readiness). (After `unmap` the main loop maps them, before any request.)"""
        assert self.map_reader is None and self.reader is not None
        hook = torpor_hook.get()
        self.readiness = Readiness((s.va, s.size, s.backend) for s in hook.segments() if not s.mapped)
        self.module_waits = ModuleWaits(self.readiness) if self.deferrable else None
        self.reader.fds = True
        self.map_reader = MapReader(self)

    def settle_readiness(self) -> None:
        """On the main thread: once every segment is mapped, drops the waits."""
        if self.readiness is not None and self.readiness.done():
            if self.module_waits is not None:
                self.module_waits.remove()
            self.readiness = None
            self.module_waits = None

    def stop_map_reader(self) -> None:
        """Ends the map reader of a connection being given up (its frames die with it)."""
        if self.map_reader is None:
            return
        if self.sock is not None:
            try:
                # Wakes the thread's blocked recvmsg; close() alone would not.
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.map_reader.thread.join()
        self.map_reader = None

    def _split_hook(self, frame: str) -> torpor_hook.Hook:
        """The hook, for a frame that needs every segment mapped (`frame` names it in errors)."""
        if not torpor_hook.available():
            raise ProtocolError(
                f"{frame}, but this worker has no device-memory hook "
                f"(${torpor_hook.ENV_LIB} is not set); torpord must start split workers with the hook"
            )
        try:
            hook = torpor_hook.get()
        except HookError as e:
            raise ProtocolError(f"{frame}: {e}") from None
        unmapped = [s for s in hook.segments() if not s.mapped]
        if unmapped:
            raise ProtocolError(
                f"{frame} while {len(unmapped)} segment(s) are still released "
                f"(first at {unmapped[0].va:#x}); map every segment first"
            )
        return hook

    def release_gpu(self) -> None:
        """torpord checkpoints this worker's GPU in place next (a GPU release, a move to another
        GPU): every idle pool's memory goes back first (what the driver would otherwise copy
        out and back), and none is released again until torpord serves the worker (`invoke`,
        `map`, `quiesce`, `load`): a pool released while the driver held the context
        checkpointed killed the worker in libcuda. Answers `gpu_quiet` {bytes}."""
        released = 0
        try:
            with self.memory_lock:
                self.gpu_released = True
                for pool in self.pools.values():
                    # Deferred (a request in a pool, which torpord does not release the GPU
                    # under): the driver keeps that pool's memory instead.
                    got = pool.release()
                    if got > 0:
                        released += got
                        self._report_memory(pool)
            if torpor_gpu.sync():
                self.drop_store_mappings()
            self.send({"type": "gpu_quiet", "bytes": released})
        except (ConnectionError, OSError):
            # torpord went before its checkpoint: the next read finds the connection closed
            # and the worker reattaches, its GPU never released.
            pass

    def gpu_back(self) -> None:
        """torpord resumed the GPU (it serves this worker again): the idle releases held back
        meanwhile are timed afresh."""
        with self.memory_lock:
            self.gpu_released = False
            held, self.held_back = self.held_back, set()
        for name in held:
            self._ended(name)

    def unmap_segments(self, msg: dict[str, Any]) -> None:
        """Give back the memory of the segments torpord names and serve on (torpord then
        checkpoints the GPU in place, and maps them back with `map` frames before the next
        request). Only torpord's memory goes: the driver will not resume a process mapping memory
        it imported, while segments this worker made since (PyTorch's allocator may grow) are its
        own and stay in the driver's checkpoint."""
        assert self.reader is not None
        vas = msg.get("vas")
        if not isinstance(vas, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in vas):
            raise ProtocolError("unmap needs vas, the list of segment addresses to release")
        hook = self._split_hook("unmap")
        sizes = {s.va: s.size for s in hook.segments()}
        unknown = [v for v in vas if v not in sizes]
        if unknown:
            # A segment torpord handed over that this worker gave back since (its allocator
            # emptied a cache): refused with nothing released, so torpord keeps the instance
            # warm (its GPU not released) instead of losing it (session 36: a sandbox of
            # graphed functions was lost at each GPU release this way).
            why = (
                f"unmap names {unknown[0]:#x}, which is not the start of a segment of this worker "
                f"({len(unknown)} of {len(vas)} named are gone): its allocator gave a segment "
                "torpord handed over back since the restore; the GPU stays held until the next "
                "snapshot lists the segments afresh"
            )
            print(f"torpor worker: {why}", file=sys.stderr)
            self.send({"type": "unmapped", "ok": False, "released": [], "error": error_doc(HookError(why))})
            return
        # The driver checkpoints the context next (a GPU release in place, or a migration's
        # residue moved to another GPU): its stack reservation shrunk first, as at a snapshot's
        # quiet point, is a smaller and faster checkpoint and restore.
        if torpor_gpu.sync():
            self.drop_store_mappings()
            if self.shrink_context:
                torpor_gpu.shrink_context()
        released = 0
        try:
            for va in vas:
                hook.release(va)
                released += sizes[va]
        except HookError as e:
            left = [s.va for s in hook.segments() if not s.mapped]
            print(f"torpor worker: unmap: {e}", file=sys.stderr)
            self.reader.fds = bool(left)
            self._listing = None
            self.send({"type": "unmapped", "ok": False, "released": left, "error": error_doc(e)})
            return
        # From now on map frames carry fds, until every segment is mapped again.
        self.reader.fds = bool(vas)
        self._listing = None
        self.send({"type": "unmapped", "ok": True, "bytes": released})

    def hand_over_segments(self, hook: torpor_hook.Hook, synced: bool) -> str:
        """The split part of quiesce: list and send the segments, then release them on request.
        Returns "released", "shutdown" (torpord gave up the snapshot) or "resume" (torpord only
        read the segments, e.g. to hash them before a warm-up request; nothing is released)."""
        assert self.sock is not None and self.reader is not None
        segments = hook.segments()
        # Every function this worker serves (a sandbox's several): a segment is shareable or
        # deferrable when it holds only one function's weights.
        functions = [getattr(c, "__self__", None) for c in self.functions.values()] or [getattr(self.call, "__self__", None)]
        cuda = any(s.backend == "cuda" for s in segments)
        shareable: set[int] = set().union(*(shareable_vas(f) for f in functions)) if cuda else set()
        # Allocator state is part of the snapshot: what is deferrable now is so after a restore.
        self.deferrable = set().union(*(deferrable_vas(f) for f in functions)) if cuda else set()
        frames = [
            s.frame()
            | ({"shareable": True} if s.va in shareable else {})
            | ({"deferrable": True} if s.va in self.deferrable else {})
            for s in segments
        ]
        self.send({"type": "quiet", "cuda_synced": synced, "segments": frames})
        for segment in segments:
            fd = hook.export(segment.va)
            try:
                with self.send_lock:
                    write_frame_with_fd(self.sock, {"type": "segment_fd", "va": segment.va, "fd": True}, fd)
            finally:
                os.close(fd)
        msg = self.reader.read()
        if msg is None:
            raise ConnectionResetError(errno.ECONNRESET, "closed by torpord before release")
        if msg.get("type") in ("shutdown", "resume"):
            return str(msg["type"])
        if msg.get("type") != "release":
            raise ProtocolError(
                f"after a split quiet torpord must send release, resume or shutdown, got {msg.get('type')!r}"
            )
        released = hook.release_all()
        # From now on map frames carry fds, until every segment is mapped again.
        self.reader.fds = bool(segments)
        self._listing = None
        self.send({"type": "released", "bytes": released})
        return "released"

    def map_segment(self, msg: dict[str, Any]) -> None:
        """Applies one `map` frame and answers `mapped` (on the map reader's thread while
        segments are pending after a restore)."""
        assert self.reader is not None
        readiness = self.readiness
        fd = self.reader.take_fd()
        try:
            va, size, readonly = msg.get("va"), msg.get("size"), msg.get("readonly", False)
            if not isinstance(va, int) or not isinstance(size, int) or not isinstance(readonly, bool):
                raise ProtocolError("map needs va (integer), size (integer) and readonly (boolean)")
            if fd is None:
                raise ProtocolError(
                    f"map of {va:#x} came without an fd; torpord must attach the segment's fd to the "
                    "frame (SCM_RIGHTS), and only after a split snapshot"
                )
            try:
                hook = torpor_hook.get()
                if self._listing is None:
                    # Once per mapping phase: this thread is the only one that maps or
                    # releases until every segment is mapped (segments a request makes
                    # meanwhile are mapped already).
                    listed = hook.segments()
                    self._listing = {s.va: s for s in listed}
                    self._unmapped = {s.va for s in listed if not s.mapped}
                segment = self._listing.get(va)
                if segment is not None and segment.size != size:
                    raise HookError(
                        f"map of {va:#x} says {size} bytes but the segment has {segment.size}; "
                        "torpord must send the size the quiet frame listed"
                    )
                t_map = time.perf_counter()
                hook.map(va, fd, readonly)
                map_s = time.perf_counter() - t_map
            except HookError as e:
                print(f"torpor worker: {e}", file=sys.stderr)
                try:
                    self.send({"type": "mapped", "va": va, "ok": False, "error": error_doc(e)})
                finally:
                    if readiness is not None:
                        readiness.refused(va, _str(e))
                return
        finally:
            if fd is not None:
                os.close(fd)
        self._unmapped.discard(va)
        if not self._unmapped:
            self.reader.fds = False
            self._listing = None
        # `mapped` goes out before a request waiting for this segment is let go, so torpord
        # reads it before that request's result.
        try:
            # map_s: the hook's own time (import, map, access), which torpord sums into the
            # start's `segments.map` phase, to tell the driver's part from the frames' trips.
            self.send({"type": "mapped", "va": va, "ok": True, "map_s": round(map_s, 6)})
        finally:
            if readiness is not None:
                readiness.mapped(va)


def _memory_release_s(spec: dict[str, Any]) -> float:
    """The spec's keepalive.memory_release_s (specs of before have none: the default)."""
    keepalive = spec.get("keepalive")
    value = keepalive.get("memory_release_s") if isinstance(keepalive, dict) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    return DEFAULT_MEMORY_RELEASE_S


def _here(fn: Callable[[], T]) -> T:
    """Runs `fn` on the calling thread (a function in a worker of its own; a sandbox's
    counterpart is Lanes.run)."""
    return fn()


def _forget_modules_of(dirs: list[str]) -> None:
    """Before a sandbox imports the next function: every module imported from the directory of
    a function loaded before is dropped from sys.modules, so that this function's `import
    model` or `import common` finds its own files (the functions loaded before keep their
    module objects, referenced by their instances)."""
    roots = tuple(str(Path(d).resolve()) + os.sep for d in dirs)
    for name, module in list(sys.modules.items()):
        where = getattr(module, "__file__", None)
        if isinstance(where, str) and str(Path(where).resolve()).startswith(roots):
            del sys.modules[name]


def _modules(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if not _MODULE_RE.fullmatch(n):
            raise argparse.ArgumentTypeError(
                f"{n!r} is not a module name (write e.g. --preload torch,torchvision)"
            )
    return names


def main(argv: list[str] | None = None) -> int:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    # torpord sends SIGUSR1 before it kills a worker whose request ran past timeout_s: every
    # thread's stack goes to the log, to say where it hung (docs/torpord.md, "Logs"). A worker
    # that crashes (SIGSEGV in a native library, SIGABRT) leaves every thread's stack there too.
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    ap = argparse.ArgumentParser(
        prog="python3 -m torpor.worker", description="Torpor's worker harness (started by torpord)."
    )
    ap.add_argument(
        "--role", choices=ROLES, required=True, help="base: preload and report ready; function: wait for load"
    )
    ap.add_argument("--preload", type=_modules, default=[], help="modules to import first, comma-separated")
    ap.add_argument("--gpu", action="store_true", help="warm CUDA through torch (needs torch in --preload)")
    ap.add_argument(
        "--announce-warm",
        action="store_true",
        help="role function: send `warmed` once preloaded and warmed, before waiting for load",
    )
    args = ap.parse_args(argv)
    if args.announce_warm and args.role != "function":
        # argparse's usage error: one line, exit 2.
        ap.error("--announce-warm is for --role function (a base announces itself with ready)")
    path = os.environ.get(ENV_SOCKET)
    if not path:
        print(
            f"torpor worker: ${ENV_SOCKET} is not set; torpord sets it "
            "(to run a worker by hand, set it to a listening socket's path)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    worker = Worker(args.role, args.preload, args.gpu, path, args.announce_warm)
    try:
        return worker.run()
    except (FrameError, ProtocolError) as e:
        print(f"torpor worker: protocol error from torpord: {e}", file=sys.stderr)
        return EXIT_PROTOCOL
    except ConnectError as e:
        print(f"torpor worker: {e}", file=sys.stderr)
        return EXIT_CONNECT
    except ConnectionError as e:
        print(f"torpor worker: lost the connection to torpord ({e.strerror}); exiting", file=sys.stderr)
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
