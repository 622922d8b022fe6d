"""torpor.toml, the function spec: parsing, validation and its JSON form.

The file format is the one docs/torpord.md fixes; every key but `name` and `entry` has a default:

    name = "cpu-mlp"              # required; [a-z0-9][a-z0-9_.-]*, at most 63 characters
    tenant = "default"            # who owns it (docs/security.md, "Tenants"); a name like `name`;
                                  # default "default". A tenant's token deploys only its own.
    workflow = "vision"           # optional: the workflow the function belongs to (a name like
                                  # `name`); with [scaling] sandbox = true, the functions of one
                                  # tenant and workflow share sandboxes (docs/sandboxes.md)
    entry = "model:MLP"           # required; module:Class, the module found in the function dir
    python = "python3"            # interpreter: a command on PATH (no '/') or an absolute path
    preload = []                  # modules imported by the base worker, in this order, no repeats
    gpus = 0                      # 0 or 1
    gpu_memory = "0"              # a size up to 1 TiB; must be "0" when gpus = 0
    timeout_s = 30                # per request, > 0 and at most 86400 (a day)
    load_timeout_s = 30           # optional: import, setup() and warm-up at deploy (and the base's
                                  # preload), > 0 and at most 3600; unset: torpord's
                                  # workers.load_timeout_s (30). Past it the worker is killed.
    memory_limit = "2GiB"         # optional: the instance's host memory, a size from 32 MiB to
                                  # 1 TiB; unset: torpord's workers.memory_limit. Past it the
                                  # kernel kills the worker (its request is answered 502).
    cpu_limit = 2                 # optional: CPU cores the instance may use, from 0.01 to 1024;
                                  # unset: torpord's workers.cpu_limit
    pids_limit = 1024             # optional: its processes and threads, from 16 to 65536; unset:
                                  # torpord's workers.pids_limit
    [[data]]                      # zero or more
    name = "weights"              # required; [A-Za-z_][A-Za-z0-9_.-]*, unique
    path = "weights.npy"          # required; relative, must stay inside the function dir
    size = "auto"                 # default "auto"; else a size (up to 1 PiB) equal to the file's
    access = "read-only"          # or "writable"
    # or, instead of path: data the platform loads from the node's object store (EDAS), in
    # parallel with the instance's start; size is then required (the object is checked
    # against it) and the key is in the tenant's space of the bucket (docs/data.md):
    # source = "s3://torpor-data/weights.bin"
    device = "host"               # or "cuda" (with gpus = 1 and path): the platform fills GPU
                                  # memory with the file while the instance starts, and
                                  # torpor.load(name, device="cuda") is a tensor view of it
                                  # (docs/sandboxes.md, "Platform-managed GPU data")
    [warmup]                      # optional
    request = { x = [0.0, 1.0] }  # required in [warmup]; any TOML value but dates and times
    [scaling]
    max_instances = 4             # integer from 1 to 1024
    requests_per_instance = 1     # integer from 1 to 1024
    standby = 0                   # integer from 0 to max_instances: instances kept restored
                                  # ahead of requests (torpord, cold_start = "restore")
    standby_gpu = "live"          # a GPU function's standby: "live" (its CUDA context kept on
                                  # the GPU; a request pays only its segments) or "released" (no
                                  # GPU memory while it waits; a request pays the driver's restore)
    sandbox = false               # true: run in a sandbox, one worker hosting every sandboxed
                                  # function of this tenant and workflow, a thread (and CUDA
                                  # stream) per request (docs/sandboxes.md)
    sandbox_memory = "8GiB"       # optional, only with sandbox = true: the memory a sandbox of
                                  # this function's group may give its functions (resident and
                                  # requests' peaks), a size from 1 MiB to 1 TiB; a request runs
                                  # only where its function's peak fits (docs/sandboxes.md,
                                  # "The memory pool"). Unset: a GPU's memory (gpus = 1), else
                                  # no bound
    pooled = true                 # only with sandbox = true: false keeps its cold starts out of
                                  # torpord's ready sandboxes (which run setup() again), for a
                                  # setup() that does not always make the same state
    [keepalive]                   # seconds, each from 0 to 31536000 (a year)
    gpu_release_s = 30
    hibernate_s = 120
    evict_s = 600
    memory_release_s = 2          # idle this long, a function gives its request pool's memory
                                  # back (torpor.mempool)
    [gpu]
    pack_weights = true           # move the weights into segments of their own (torpor.pack)
    shrink_context = true         # at the quiet point, the CUDA context's stack limit to 0: a
                                  # smaller driver checkpoint and restore (torpor.gpu.shrink_context)

Sizes are a TOML integer (bytes) or a string: a number and an optional unit, binary (KiB, MiB,
GiB, TiB) or decimal (B, kB, MB, GB, TB), e.g. "0", "512", "16MiB", "1.5 GiB". The result must be
a whole number of bytes.

Every number has a range (above), so that no value can overflow the daemon's arithmetic: a
value outside it is an error naming the range.

torpor.toml itself must be a regular file of at most 1 MiB, not a symlink (a symlink could make
the root-run daemon read any file of the node); it is opened without following links. The entry
module (module.py, or the package directory) must resolve inside the function dir, like data.

Declared data must exist when the spec is validated, as a regular file (symlinks are followed and
must stay inside the function dir). A declared size is checked exactly against the file, so a
stale weights file is caught at deploy rather than in setup(); `size = "auto"` (the default)
takes the file's size as it is.

Every problem is a SpecError whose message is one line: the key path, what is wrong, and the fix,
e.g. `torpor.toml: scaling.max_instances must be an integer from 1 to 1024, got "four"; write e.g.
max_instances = 4`. Unknown keys are errors too.

Command line (an interface: torpord runs it to validate a spec before it deploys it):

    python3 -m torpor.spec DIR

- exit 0: stdout is one line, the JSON form of the spec (below), then a newline.
- exit 1: stderr is one line, the SpecError's message; stdout is empty.
- exit 2: wrong usage (argparse's message on stderr).

The JSON form is also the `spec` field of the `load` frame the daemon sends to a worker. Keys, in
this order (sizes in bytes, durations in seconds as JSON numbers):

    {"dir": "/abs/path/of/DIR",            # resolved, absolute
     "name": str, "tenant": str, "workflow": str | null, "entry": "module:Class", "module": str, "class": str,
     "python": str, "preload": [str, ...], "gpus": 0|1, "gpu_memory": int, "timeout_s": number,
     "load_timeout_s": number | null,
     "memory_limit": int | null, "cpu_limit": number | null, "pids_limit": int | null,
     "data": [{"name": str, "path": str (relative, normalised), "abs_path": str, "size": int,
               "access": "read-only"|"writable", "source": "s3://…" (only when given; then
               path and abs_path are "")}, ...],
     "warmup": {"request": JSON} | null,
     "scaling": {"max_instances": int, "requests_per_instance": int, "standby": int,
                 "standby_gpu": "released"|"live", "sandbox": bool, "sandbox_memory": int|null,
                 "pooled": bool},
     "keepalive": {"gpu_release_s": number, "hibernate_s": number, "evict_s": number,
                   "memory_release_s": number},
     "gpu": {"pack_weights": bool, "shrink_context": bool}}
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import errno
import json
import math
import os
import re
import stat
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from torpor.errors import SpecError

SPEC_FILE = "torpor.toml"
ACCESS_MODES = ("read-only", "writable")
Access = Literal["read-only", "writable"]

NAME_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")
# A function's tenant when torpor.toml names none (torpord's crate::tenant holds the same).
DEFAULT_TENANT = "default"
DATA_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,127}")
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
ENTRY_RE = re.compile(rf"({IDENT}(?:\.{IDENT})*):({IDENT})")
MODULE_RE = re.compile(rf"{IDENT}(?:\.{IDENT})*")
SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")
SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KiB": 1 << 10,
    "MiB": 1 << 20,
    "GiB": 1 << 30,
    "TiB": 1 << 40,
    "kB": 10**3,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}

TOP_KEYS = (
    "name",
    "tenant",
    "workflow",
    "entry",
    "python",
    "preload",
    "gpus",
    "gpu_memory",
    "timeout_s",
    "load_timeout_s",
    "memory_limit",
    "cpu_limit",
    "pids_limit",
    "data",
    "warmup",
    "scaling",
    "keepalive",
    "gpu",
)
DATA_KEYS = ("name", "path", "source", "size", "access", "device")
DATA_DEVICES = ("host", "cuda")
WARMUP_KEYS = ("request",)
# The ranges of the numbers (docs/torpord.md, "Ranges"): each keeps the daemon's arithmetic on
# the value (durations, counts, byte sums) far from overflow.
MAX_TIMEOUT_S = 86_400  # a day
MAX_LOAD_TIMEOUT_S = 3_600  # an hour
MAX_KEEPALIVE_S = 31_536_000  # a year
MAX_INSTANCES = 1024
MAX_REQUESTS_PER_INSTANCE = 1024
MAX_GPU_MEMORY = 1 << 40  # 1 TiB
MAX_DATA_SIZE = 1 << 50  # 1 PiB
MAX_SPEC_BYTES = 1 << 20  # torpor.toml itself
# An instance's cgroup limits (torpord's crate::limits holds the same figures).
MIN_MEMORY_LIMIT = 32 << 20  # 32 MiB: less does not run the Python harness
MAX_MEMORY_LIMIT = 1 << 40  # 1 TiB
MIN_CPU_LIMIT = 0.01  # cores
MAX_CPU_LIMIT = 1024
MIN_PIDS_LIMIT = 16
MAX_PIDS_LIMIT = 65_536

SCALING_KEYS = (
    "max_instances", "requests_per_instance", "standby", "standby_gpu", "sandbox", "sandbox_memory", "pooled",
)
STANDBY_GPU = ("released", "live")
KEEPALIVE_KEYS = ("gpu_release_s", "hibernate_s", "evict_s", "memory_release_s")
MIN_SANDBOX_MEMORY = 1 << 20  # 1 MiB
GPU_KEYS = ("pack_weights", "shrink_context")


@dataclass(frozen=True)
class DataDecl:
    """One declared data file (EDAS): readable in setup() through torpor.load(name)."""

    name: str
    path: str  # relative to the function dir, normalised
    abs_path: Path
    size: int  # bytes
    access: Access
    # s3://BUCKET/KEY: torpord loads the object (path and abs_path are then "").
    source: str | None = None
    # "cuda": torpord fills GPU memory with it (platform-managed GPU data); "host": a file.
    device: str = "host"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "path": self.path,
            "abs_path": "" if self.source else str(self.abs_path),
            "size": self.size,
            "access": self.access,
        }
        if self.source:
            out["source"] = self.source
        if self.device != "host":
            out["device"] = self.device
        return out


@dataclass(frozen=True)
class Warmup:
    request: Any  # a JSON value


@dataclass(frozen=True)
class Scaling:
    max_instances: int = 4
    requests_per_instance: int = 1
    # Instances torpord keeps restored ahead of requests (docs/split.md, "Standby instances").
    standby: int = 0
    # What a GPU function's standby keeps on its GPU: "released" or "live".
    standby_gpu: str = "live"
    # Run in a sandbox shared by the sandboxed functions of the same tenant and workflow.
    sandbox: bool = False
    # The memory a sandbox may give its functions (bytes); None: a GPU's, or no bound.
    sandbox_memory: int | None = None
    # Cold starts may load it into a ready sandbox of torpord's pool (setup() run again).
    pooled: bool = True


@dataclass(frozen=True)
class Keepalive:
    gpu_release_s: float = 30
    hibernate_s: float = 120
    evict_s: float = 600
    # Idle this long, a function's request pool gives its memory back (torpor.mempool).
    memory_release_s: float = 2


@dataclass(frozen=True)
class Gpu:
    # With the device-memory hook on CUDA (split path), the harness moves the function's CUDA
    # weights into segments of their own after setup(), so instances can share them read-only
    # (torpor.pack, docs/split.md). false: leave them where setup() put them.
    pack_weights: bool = True
    # At every quiet point (the deploy's snapshot, a GPU release, a hibernation) the CUDA
    # context's per-thread stack limit goes to 0, so the driver's checkpoint is smaller; the
    # driver grows it again when a kernel needs it. false: leave the context's limits alone.
    shrink_context: bool = True


@dataclass(frozen=True)
class Spec:
    dir: Path
    name: str
    entry: str
    # Who owns the function: API tokens of another tenant cannot see it, and nothing it shares
    # (read-only GPU copies, cached segments, its base) is shared with another tenant.
    tenant: str = DEFAULT_TENANT
    # The workflow it belongs to (None: none); with scaling.sandbox, its sandbox group.
    workflow: str | None = None
    python: str = "python3"
    preload: tuple[str, ...] = ()
    gpus: int = 0
    gpu_memory: int = 0
    timeout_s: float = 30
    # None: the daemon's workers.load_timeout_s.
    load_timeout_s: float | None = None
    # The instance's cgroup limits; None: the daemon's workers.memory_limit, cpu_limit, pids_limit.
    memory_limit: int | None = None
    cpu_limit: float | None = None
    pids_limit: int | None = None
    data: tuple[DataDecl, ...] = ()
    warmup: Warmup | None = None
    scaling: Scaling = field(default_factory=Scaling)
    keepalive: Keepalive = field(default_factory=Keepalive)
    gpu: Gpu = field(default_factory=Gpu)

    @property
    def module(self) -> str:
        return self.entry.split(":", 1)[0]

    @property
    def class_name(self) -> str:
        return self.entry.split(":", 1)[1]

    def to_json(self) -> dict[str, Any]:
        """The JSON form described in the module doc (the `spec` field of the `load` frame)."""
        return {
            "dir": str(self.dir),
            "name": self.name,
            "tenant": self.tenant,
            "workflow": self.workflow,
            "entry": self.entry,
            "module": self.module,
            "class": self.class_name,
            "python": self.python,
            "preload": list(self.preload),
            "gpus": self.gpus,
            "gpu_memory": self.gpu_memory,
            "timeout_s": self.timeout_s,
            "load_timeout_s": self.load_timeout_s,
            "memory_limit": self.memory_limit,
            "cpu_limit": self.cpu_limit,
            "pids_limit": self.pids_limit,
            "data": [d.to_json() for d in self.data],
            "warmup": None if self.warmup is None else {"request": self.warmup.request},
            "scaling": {
                "max_instances": self.scaling.max_instances,
                "requests_per_instance": self.scaling.requests_per_instance,
                "standby": self.scaling.standby,
                "standby_gpu": self.scaling.standby_gpu,
                "sandbox": self.scaling.sandbox,
                "sandbox_memory": self.scaling.sandbox_memory,
                "pooled": self.scaling.pooled,
            },
            "keepalive": {
                "gpu_release_s": self.keepalive.gpu_release_s,
                "hibernate_s": self.keepalive.hibernate_s,
                "evict_s": self.keepalive.evict_s,
                "memory_release_s": self.keepalive.memory_release_s,
            },
            "gpu": {"pack_weights": self.gpu.pack_weights, "shrink_context": self.gpu.shrink_context},
        }


# ---------------------------------------------------------------------------------------------
# Helpers: each raises a SpecError naming the key path, the problem and the fix.


def _fail(key: str | None, problem: str, fix: str) -> SpecError:
    where = f"{key} " if key else ""
    return SpecError(f"{SPEC_FILE}: {where}{problem}; {fix}", key)


def _path(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _show(value: object) -> str:
    """A TOML value as it would be written, for 'got ...' in messages (shortened)."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
    elif isinstance(value, dict):
        text = "a table"
    elif isinstance(value, list):
        text = f"an array of {len(value)}"
    else:
        text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_keys(table: Mapping[str, Any], prefix: str, known: tuple[str, ...]) -> None:
    for key in table:
        if key in known:
            continue
        close = [k for k in known if k.startswith(key)] or difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean {close[0]}?" if close else "remove it"
        where = "the top level" if not prefix else "[[data]]" if prefix.startswith("data[") else f"[{prefix}]"
        raise _fail(
            _path(prefix, key),
            "is not a known key",
            f"{hint} (keys of {where}: {', '.join(known)})",
        )


def _table(parent: Mapping[str, Any], prefix: str, key: str) -> dict[str, Any] | None:
    value = parent.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _fail(
            _path(prefix, key),
            f"must be a table, got {_show(value)}",
            f"write it as [{key}] with its keys below",
        )
    return value


def _int(
    table: Mapping[str, Any], prefix: str, key: str, default: int, minimum: int, maximum: int | None = None
) -> int:
    if key not in table:
        return default
    value = table[key]
    bounds = f"≥ {minimum}" if maximum is None else f"from {minimum} to {maximum}"
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        raise _fail(
            _path(prefix, key),
            f"must be an integer {bounds}, got {_show(value)}",
            f"write e.g. {key} = {default if default >= minimum else minimum}",
        )
    return value


def _seconds(
    table: Mapping[str, Any], prefix: str, key: str, default: float, positive: bool, maximum: float
) -> float:
    if key not in table:
        return default
    value = table[key]
    rule = f"> 0 and ≤ {maximum:g}" if positive else f"from 0 to {maximum:g}"
    # Compared as given (an int can be far past a float's range: no float() before the check).
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    finite = number and (not isinstance(value, float) or math.isfinite(value))
    if finite and value <= maximum and (value > 0 if positive else value >= 0):
        return cast(float, value)  # an int stays one: the caller's TOML number as written
    raise _fail(
        _path(prefix, key),
        f"must be a number of seconds {rule}, got {_show(value)}",
        f"write e.g. {key} = {default:g}",
    )


def _bool(table: Mapping[str, Any], prefix: str, key: str, default: bool) -> bool:
    if key not in table:
        return default
    value = table[key]
    if not isinstance(value, bool):
        raise _fail(
            _path(prefix, key),
            f"must be true or false, got {_show(value)}",
            f"write {key} = {'true' if default else 'false'} (without quotes)",
        )
    return value


def _choice(table: Mapping[str, Any], prefix: str, key: str, default: str, choices: tuple[str, ...]) -> str:
    value = _str(table, prefix, key, default)
    if value not in choices:
        raise _fail(
            _path(prefix, key),
            f"must be {' or '.join(repr(c).replace(chr(39), chr(34)) for c in choices)}, got {_show(value)}",
            f'write {key} = "{default}"',
        )
    return value


def _str(table: Mapping[str, Any], prefix: str, key: str, default: str | None) -> str:
    full = _path(prefix, key)
    hint = _HINTS.get("data." + key if prefix.startswith("data[") else full, "a string")
    if key not in table:
        if default is None:
            raise _fail(full, "is missing", f'add {key} = "..." ({hint})')
        return default
    value = table[key]
    if not isinstance(value, str):
        raise _fail(
            full, f"must be a string, got {_show(value)}", f'write it in quotes: {key} = "..." ({hint})'
        )
    return value


_HINTS = {
    "name": "e.g. name = \"cpu-mlp\": lower-case letters, digits, '_', '.', '-'",
    "tenant": "e.g. tenant = \"team-a\": lower-case letters, digits, '_', '.', '-'",
    "workflow": "e.g. workflow = \"vision\": lower-case letters, digits, '_', '.', '-'",
    "entry": 'module:Class, e.g. entry = "model:MLP"',
    "python": 'e.g. python = "python3"',
    "data.name": 'e.g. name = "weights"',
    "data.path": 'relative to the function dir, e.g. path = "weights.npy"',
    "data.access": '"read-only" or "writable"',
    "data.source": 'an object of the node\'s object store, e.g. source = "s3://torpor-data/weights.bin"',
    "data.device": '"host" or "cuda"',
}


def parse_size(text: str | int) -> int:
    """A size ("16MiB", "4GiB", "0", 512) in bytes. Raises ValueError with the reason."""
    if isinstance(text, bool):
        raise ValueError("a boolean is not a size")
    if isinstance(text, int):
        if text < 0:
            raise ValueError("a size cannot be negative")
        return text
    if len(text) > 64:
        raise ValueError("too long for a size")
    m = SIZE_RE.fullmatch(text)
    if m is None:
        raise ValueError("not a number with an optional unit")
    number, unit = m.groups()
    if unit not in SIZE_UNITS:
        raise ValueError(f"unknown unit {unit!r} (units: {', '.join(u for u in SIZE_UNITS if u)})")
    scale = SIZE_UNITS[unit]
    if "." in number:
        whole, frac = number.split(".")
        numerator = int(whole + frac) * scale
        denominator: int = 10 ** len(frac)
        if numerator % denominator:
            raise ValueError("not a whole number of bytes")
        return numerator // denominator
    return int(number) * scale


def _size(
    table: Mapping[str, Any], prefix: str, key: str, default: int | None, allow_auto: bool, maximum: int
) -> int | None:
    """A size in bytes, at most `maximum`; None for "auto" (when allowed)."""
    if key not in table:
        return default
    value = table[key]
    if allow_auto and value == "auto":
        return None
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        try:
            size = parse_size(value)
            if size <= maximum:
                return size
            reason = f"more than the maximum, {_show_bytes(maximum)}"
        except ValueError as e:
            reason = str(e)
    else:
        reason = "not a string or integer"
    auto = ' or "auto"' if allow_auto else ""
    raise _fail(
        _path(prefix, key),
        f'must be a size like "16MiB", "4GiB" or "0"{auto} up to {_show_bytes(maximum)}, got {_show(value)} ({reason})',
        f'write e.g. {key} = "16MiB"',
    )


def _show_bytes(n: int) -> str:
    for unit, scale in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"


def _json_value(value: Any, key: str) -> Any:
    """A TOML value as JSON; dates and times have no JSON form."""
    if isinstance(value, dict):
        return {k: _json_value(v, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_json_value(v, f"{key}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, float) and not math.isfinite(value):
        raise _fail(key, f"is {value}, which JSON cannot carry", "use a finite number")
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        raise _fail(
            key, f"is a TOML date/time ({value}), which JSON cannot carry", "write it as a string in quotes"
        )
    return value


# ---------------------------------------------------------------------------------------------
# The parser


def parse_text(text: str, fdir: str | os.PathLike[str], check_files: bool = True) -> Spec:
    """Parse the text of a torpor.toml that belongs to the function dir `fdir`.

    With check_files (the default) the entry module and every declared data file must exist in
    `fdir`; without it, data sizes of "auto" resolve to 0 and nothing is looked up."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise _fail(None, f"is not valid TOML: {e}", "fix the syntax at that line") from None
    return parse_doc(doc, Path(fdir), check_files)


def parse_dir(fdir: str | os.PathLike[str], check_files: bool = True) -> Spec:
    """Read and parse DIR/torpor.toml."""
    root = Path(fdir)
    if not root.is_dir():
        raise _fail(
            None,
            f"cannot be read: {root} is not a directory",
            "pass the function directory that holds torpor.toml",
        )
    path = root / SPEC_FILE
    raw = _read_spec_file(path, root)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(None, f"is not valid UTF-8 (byte {e.start})", "save the file as UTF-8") from None
    return parse_text(text, root, check_files)


def _read_spec_file(path: Path, root: Path) -> bytes:
    """The bytes of torpor.toml: a regular file, not a symlink, at most MAX_SPEC_BYTES. The root-run
    daemon reads it for whoever deploys, so it must never follow a link to another file (nor
    quote one: errors name the file, never its content), nor block on a FIFO or read a device."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _fail(
            None, f"not found in {root}", f"create {path} (see docs/torpord.md for its keys)"
        ) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _fail(
                None,
                f"is a symlink ({path}); torpord reads only a regular file there",
                "replace the link with the file itself",
            ) from None
        raise _fail(None, f"cannot be read: {e.strerror} ({path})", "check the file's permissions") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise _fail(None, f"is not a regular file ({path})", "make torpor.toml a plain file")
        if st.st_size > MAX_SPEC_BYTES:
            raise _fail(
                None,
                f"is {st.st_size} bytes, more than the {MAX_SPEC_BYTES} bytes a spec may have ({path})",
                "keep data out of torpor.toml: declare it under [[data]]",
            )
        return f.read(MAX_SPEC_BYTES + 1)[:MAX_SPEC_BYTES]


def _entry_inside(root: Path, module: str) -> None:
    """The entry module's file or package (each level that exists) must resolve inside `root`,
    as declared data must: a symlink out of the function dir is refused."""
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        base = root.joinpath(*parts[:i])
        for candidate in (base.with_name(base.name + ".py"), base):
            if not os.path.lexists(candidate):
                continue
            try:
                real = candidate.resolve(strict=True)
            except (OSError, RuntimeError) as e:
                raise _fail(
                    "entry", f"names {candidate}, which cannot be resolved ({e})", "fix the path or the symlink"
                ) from None
            if not real.is_relative_to(root):
                raise _fail(
                    "entry",
                    f"names module {module}, whose {candidate.relative_to(root)} is a symlink that leads "
                    f"out of the function dir to {real}",
                    "copy the module into the function dir",
                )


def parse_doc(doc: Mapping[str, Any], fdir: Path, check_files: bool = True) -> Spec:
    """Validate an already-decoded TOML document."""
    root = fdir.resolve()
    _check_keys(doc, "", TOP_KEYS)

    name = _str(doc, "", "name", None)
    if not NAME_RE.fullmatch(name):
        raise _fail(
            "name",
            "must be 1-63 lower-case letters, digits, '_', '.' or '-', starting with a letter or digit, "
            f"got {_show(name)}",
            'write e.g. name = "cpu-mlp"',
        )

    tenant = _str(doc, "", "tenant", DEFAULT_TENANT)
    if not NAME_RE.fullmatch(tenant):
        raise _fail(
            "tenant",
            "must be 1-63 lower-case letters, digits, '_', '.' or '-', starting with a letter or digit, "
            f"got {_show(tenant)}",
            'write e.g. tenant = "team-a", or leave it out for the tenant "default"',
        )

    workflow: str | None = None
    if "workflow" in doc:
        workflow = _str(doc, "", "workflow", None)
        if not NAME_RE.fullmatch(workflow):
            raise _fail(
                "workflow",
                "must be 1-63 lower-case letters, digits, '_', '.' or '-', starting with a letter or digit, "
                f"got {_show(workflow)}",
                'write e.g. workflow = "vision", or leave it out',
            )

    entry = _str(doc, "", "entry", None)
    m = ENTRY_RE.fullmatch(entry)
    if m is None:
        raise _fail(
            "entry",
            f"must be module:Class (a Python module path, a colon, a class name), got {_show(entry)}",
            'write e.g. entry = "model:MLP" for class MLP in model.py',
        )
    if check_files:
        top = m.group(1).split(".")[0]
        if not (
            (root / f"{top}.py").is_file() or (root / top / "__init__.py").is_file() or (root / top).is_dir()
        ):
            raise _fail(
                "entry",
                f"names module {m.group(1)}, but neither {top}.py nor the package {top}/ is in {root}",
                "put the module in the function dir or fix entry",
            )
        _entry_inside(root, m.group(1))

    python = _str(doc, "", "python", "python3")
    if not python.strip() or any(c.isspace() for c in python):
        raise _fail(
            "python",
            f"must be one interpreter command without spaces, got {_show(python)}",
            'write e.g. python = "python3"',
        )
    if "/" in python and not os.path.isabs(python):
        # Relative to what? The daemon's working directory is no answer a spec can rely on.
        raise _fail(
            "python",
            f"must be a command on PATH (no '/') or an absolute path, got the relative path {_show(python)}",
            'write e.g. python = "python3" or python = "/opt/venv/bin/python3"',
        )

    preload = _preload(doc)

    gpus = _int(doc, "", "gpus", 0, 0, 1)
    gpu_memory = _size(doc, "", "gpu_memory", 0, allow_auto=False, maximum=MAX_GPU_MEMORY)
    assert gpu_memory is not None
    if gpus == 0 and gpu_memory != 0:
        raise _fail("gpu_memory", f"is {gpu_memory} bytes but gpus = 0", 'set gpus = 1 or gpu_memory = "0"')

    timeout_s = _seconds(doc, "", "timeout_s", 30, positive=True, maximum=MAX_TIMEOUT_S)
    load_timeout_s = (
        _seconds(doc, "", "load_timeout_s", 30, positive=True, maximum=MAX_LOAD_TIMEOUT_S)
        if "load_timeout_s" in doc
        else None
    )
    memory_limit = _memory_limit(doc)
    cpu_limit = _cpu_limit(doc)
    pids_limit = (
        _int(doc, "", "pids_limit", 1024, MIN_PIDS_LIMIT, MAX_PIDS_LIMIT) if "pids_limit" in doc else None
    )
    data = _data(doc, root, check_files)
    for i, d in enumerate(data):
        if d.device == "cuda" and gpus == 0:
            raise _fail(
                f"data[{i}].device",
                'is "cuda" but the function has gpus = 0',
                'set gpus = 1, or drop device to read the data on the host with torpor.load(name)',
            )

    warmup = None
    wt = _table(doc, "", "warmup")
    if wt is not None:
        _check_keys(wt, "warmup", WARMUP_KEYS)
        if "request" not in wt:
            raise _fail(
                "warmup.request", "is missing", "add request = { ... } under [warmup], or remove [warmup]"
            )
        warmup = Warmup(_json_value(wt["request"], "warmup.request"))

    st = _table(doc, "", "scaling") or {}
    _check_keys(st, "scaling", SCALING_KEYS)
    max_instances = _int(st, "scaling", "max_instances", Scaling.max_instances, 1, MAX_INSTANCES)
    standby = _int(st, "scaling", "standby", Scaling.standby, 0, MAX_INSTANCES)
    if standby > max_instances:
        raise _fail(
            "scaling.standby",
            f"is {standby}, more than max_instances = {max_instances} (standby instances count towards it)",
            f"lower standby to at most {max_instances} or raise max_instances",
        )
    scaling = Scaling(
        max_instances=max_instances,
        requests_per_instance=_int(
            st, "scaling", "requests_per_instance", Scaling.requests_per_instance, 1, MAX_REQUESTS_PER_INSTANCE
        ),
        standby=standby,
        standby_gpu=_choice(st, "scaling", "standby_gpu", Scaling.standby_gpu, STANDBY_GPU),
        sandbox=_bool(st, "scaling", "sandbox", Scaling.sandbox),
        sandbox_memory=_size(
            st, "scaling", "sandbox_memory", None, allow_auto=False, maximum=MAX_GPU_MEMORY
        ),
        pooled=_bool(st, "scaling", "pooled", Scaling.pooled),
    )
    if "pooled" in st and not scaling.sandbox:
        raise _fail(
            "scaling.pooled",
            "is set but sandbox = false (only a sandboxed function starts in a ready sandbox)",
            "set sandbox = true, or remove pooled",
        )
    if scaling.sandbox_memory is not None:
        if not scaling.sandbox:
            raise _fail(
                "scaling.sandbox_memory",
                "is set but sandbox = false (it bounds a sandbox's memory)",
                "set sandbox = true, or remove sandbox_memory",
            )
        if scaling.sandbox_memory < MIN_SANDBOX_MEMORY:
            raise _fail(
                "scaling.sandbox_memory",
                f"is {scaling.sandbox_memory} bytes, less than 1 MiB",
                'write a size from 1 MiB to 1 TiB, e.g. sandbox_memory = "8GiB"',
            )

    kt = _table(doc, "", "keepalive") or {}
    _check_keys(kt, "keepalive", KEEPALIVE_KEYS)
    keepalive = Keepalive(
        **{
            k: _seconds(kt, "keepalive", k, getattr(Keepalive, k), positive=False, maximum=MAX_KEEPALIVE_S)
            for k in KEEPALIVE_KEYS
        }
    )

    gt = _table(doc, "", "gpu") or {}
    _check_keys(gt, "gpu", GPU_KEYS)
    gpu = Gpu(
        pack_weights=_bool(gt, "gpu", "pack_weights", Gpu.pack_weights),
        shrink_context=_bool(gt, "gpu", "shrink_context", Gpu.shrink_context),
    )

    return Spec(
        dir=root,
        name=name,
        tenant=tenant,
        workflow=workflow,
        entry=entry,
        python=python,
        preload=preload,
        gpus=gpus,
        gpu_memory=gpu_memory,
        timeout_s=timeout_s,
        load_timeout_s=load_timeout_s,
        memory_limit=memory_limit,
        cpu_limit=cpu_limit,
        pids_limit=pids_limit,
        data=data,
        warmup=warmup,
        scaling=scaling,
        keepalive=keepalive,
        gpu=gpu,
    )


def _memory_limit(doc: Mapping[str, Any]) -> int | None:
    if "memory_limit" not in doc:
        return None
    size = _size(doc, "", "memory_limit", None, allow_auto=False, maximum=MAX_MEMORY_LIMIT)
    assert size is not None
    if size < MIN_MEMORY_LIMIT:
        raise _fail(
            "memory_limit",
            f"must be a size from {_show_bytes(MIN_MEMORY_LIMIT)} to {_show_bytes(MAX_MEMORY_LIMIT)}, got {_show(doc['memory_limit'])}",
            'write e.g. memory_limit = "2GiB"',
        )
    return size


def _cpu_limit(doc: Mapping[str, Any]) -> float | None:
    if "cpu_limit" not in doc:
        return None
    value = doc["cpu_limit"]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and (not isinstance(value, float) or math.isfinite(value)) and MIN_CPU_LIMIT <= value <= MAX_CPU_LIMIT:
        return cast(float, value)
    raise _fail(
        "cpu_limit",
        f"must be a number of CPU cores from {MIN_CPU_LIMIT:g} to {MAX_CPU_LIMIT}, got {_show(value)}",
        "write e.g. cpu_limit = 2 or cpu_limit = 0.5",
    )


def _preload(doc: Mapping[str, Any]) -> tuple[str, ...]:
    value = doc.get("preload", [])
    if not isinstance(value, list):
        raise _fail(
            "preload",
            f"must be an array of module names, got {_show(value)}",
            'write e.g. preload = ["numpy"]',
        )
    seen: list[str] = []
    for i, mod in enumerate(value):
        key = f"preload[{i}]"
        if not isinstance(mod, str) or not MODULE_RE.fullmatch(mod):
            raise _fail(
                key,
                f'must be a module name like "torch" or "torchvision.models", got {_show(mod)}',
                "fix or remove it",
            )
        if mod in seen:
            raise _fail(key, f"repeats {_show(mod)}", "list each module once")
        seen.append(mod)
    return tuple(seen)


def _data(doc: Mapping[str, Any], root: Path, check_files: bool) -> tuple[DataDecl, ...]:
    value = doc.get("data", [])
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise _fail(
            "data",
            f"must be an array of tables, got {_show(value)}",
            "declare each file under its own [[data]] header",
        )
    out: list[DataDecl] = []
    for i, table in enumerate(value):
        prefix = f"data[{i}]"
        _check_keys(table, prefix, DATA_KEYS)
        name = _str(table, prefix, "name", None)
        if not DATA_NAME_RE.fullmatch(name):
            raise _fail(
                f"{prefix}.name",
                f"must be a letter or '_' followed by letters, digits, '_', '.' or '-', got {_show(name)}",
                'write e.g. name = "weights"',
            )
        if any(d.name == name for d in out):
            raise _fail(f"{prefix}.name", f"repeats {_show(name)}", "give each [[data]] entry its own name")
        access = _str(table, prefix, "access", "read-only")
        if access not in ACCESS_MODES:
            raise _fail(
                f"{prefix}.access",
                f'must be "read-only" or "writable", got {_show(access)}',
                'write access = "read-only"',
            )
        device = _str(table, prefix, "device", "host")
        if device not in DATA_DEVICES:
            raise _fail(f"{prefix}.device", f'must be "host" or "cuda", got {_show(device)}', 'write device = "cuda"')
        if "source" in table:
            if device != "host":
                raise _fail(
                    f"{prefix}.device",
                    'is "cuda" with a source: platform-managed GPU data is filled from a file in the function dir only',
                    "declare the data with path, or drop device",
                )
            out.append(_source_data(table, prefix, name, access))
            continue
        raw_path = _str(table, prefix, "path", None)
        rel = _data_path(raw_path, f"{prefix}.path")
        declared = _size(table, prefix, "size", None, allow_auto=True, maximum=MAX_DATA_SIZE)
        abs_path = root / rel
        size = declared if declared is not None else 0
        if check_files:
            abs_path, actual = _data_file(root, rel, f"{prefix}.path")
            if declared is not None and declared != actual:
                raise _fail(
                    f"{prefix}.size",
                    f"is {declared} bytes but {rel} has {actual} bytes",
                    f'set size = "auto" or size = {actual}, or replace the file',
                )
            size = actual
        out.append(DataDecl(name=name, path=rel, abs_path=abs_path, size=size, access=access, device=device))  # type: ignore[arg-type]
    return tuple(out)


# An S3 bucket name (what S3 allows, lower case) and the key rules of parse_source.
BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
MAX_SOURCE_KEY = 512


def parse_source(uri: str) -> tuple[str, str]:
    """(bucket, key) of a data source `s3://BUCKET/KEY`. The key is relative to the tenant's
    data space in the bucket (torpord reads `<prefix>data/<tenant>/KEY`), so it must not climb
    out of it: no empty, "." or ".." segment, no leading "/", no backslash or control character,
    at most 512 bytes. Raises ValueError with the reason. (torpord checks the same again.)"""
    if not uri.startswith("s3://"):
        raise ValueError("it is not an s3:// URI")
    bucket, sep, key = uri[len("s3://") :].partition("/")
    if not BUCKET_RE.fullmatch(bucket):
        raise ValueError(f"{bucket!r} is not a bucket name (3 to 63 of a-z, 0-9, '.', '-')")
    if not sep or not key:
        raise ValueError("it names no key after the bucket")
    if len(key.encode()) > MAX_SOURCE_KEY:
        raise ValueError(f"its key is longer than {MAX_SOURCE_KEY} bytes")
    if any(ord(c) < 0x20 or c in "\\\x7f" for c in key):
        raise ValueError("its key holds a control character or a backslash")
    for seg in key.split("/"):
        if seg in ("", ".", ".."):
            raise ValueError(f"its key has an empty, '.' or '..' segment ({key!r}); keys stay in the tenant's space")
    return bucket, key


def _source_data(table: Mapping[str, Any], prefix: str, name: str, access: str) -> DataDecl:
    if "path" in table:
        raise _fail(
            f"{prefix}.path",
            "is set together with source",
            "keep source (torpord loads the object) or path (a file in the function dir), not both",
        )
    source = _str(table, prefix, "source", None)
    try:
        parse_source(source)
    except ValueError as e:
        raise _fail(
            f"{prefix}.source", f"must be s3://BUCKET/KEY, got {_show(source)} ({e})", 'write e.g. source = "s3://torpor-data/weights.bin"'
        ) from None
    if table.get("size", "auto") == "auto":
        raise _fail(
            f"{prefix}.size",
            "must be given with source: torpord checks the object against it",
            "write the object's size in bytes, e.g. size = 1048576",
        )
    size = _size(table, prefix, "size", None, allow_auto=False, maximum=MAX_DATA_SIZE)
    assert size is not None
    return DataDecl(name=name, path="", abs_path=Path(""), size=size, access=access, source=source)  # type: ignore[arg-type]


def _data_path(raw: str, key: str) -> str:
    if not raw or "\0" in raw:
        raise _fail(key, f"must be a file path, got {_show(raw)}", 'write e.g. path = "weights.npy"')
    if os.path.isabs(raw):
        raise _fail(
            key,
            f"must be relative to the function dir, got the absolute path {_show(raw)}",
            "copy the file into the function dir and name it relatively",
        )
    norm = os.path.normpath(raw)
    if norm == ".":
        raise _fail(key, f"names the function dir itself: {_show(raw)}", "name a file inside it")
    if norm == ".." or norm.startswith("../"):
        raise _fail(
            key,
            f"leaves the function dir: {_show(raw)}",
            "copy the file into the function dir and name it relatively",
        )
    return norm


def _data_file(root: Path, rel: str, key: str) -> tuple[Path, int]:
    path = root / rel
    try:
        real = path.resolve(strict=True)
    except FileNotFoundError:
        raise _fail(
            key, f"names {rel}, which does not exist in {root}", "create the file or fix the path"
        ) from None
    except (OSError, RuntimeError) as e:
        raise _fail(
            key, f"names {rel}, which cannot be resolved ({e})", "fix the path or the symlink"
        ) from None
    if not real.is_relative_to(root):
        raise _fail(
            key,
            f"names {rel}, a symlink that leads out of the function dir to {real}",
            "copy the file into the function dir",
        )
    try:
        st = real.stat()
    except OSError as e:
        raise _fail(
            key, f"names {rel}, which cannot be read ({e.strerror})", "check its permissions"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise _fail(
            key, f"names {rel}, which is not a regular file", "declare a file, not a directory or device"
        )
    if not os.access(real, os.R_OK):
        raise _fail(key, f"names {rel}, which is not readable", "make it readable (chmod a+r)")
    return path, st.st_size


# ---------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python3 -m torpor.spec",
        description="Validate DIR/torpor.toml; print its JSON form (exit 0) or one error line (exit 1).",
    )
    ap.add_argument("dir", help="the function directory that holds torpor.toml")
    args = ap.parse_args(argv)
    try:
        spec = parse_dir(args.dir)
    except SpecError as e:
        print(e, file=sys.stderr)
        return 1
    sys.stdout.write(json.dumps(spec.to_json(), ensure_ascii=False, allow_nan=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
