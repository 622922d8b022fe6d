"""workflow.toml, a workflow spec: functions and the edges between them (docs/sandboxes.md).

    name = "vision-text"          # required; a name like a function's
    tenant = "team-a"             # default "default"; every stage's function must be this tenant's
    [[stage]]                     # one or more, each a deployed function (at most 64 stages)
    function = "detect"           # required; a function name
    [[stage]]
    function = "classify"
    after = ["detect"]            # the stages whose values it takes (default: none, a root)

`torpor deploy DIR` with DIR/workflow.toml (and no torpor.toml) deploys the workflow;
`torpor invoke --workflow NAME` (POST /v1/workflows/NAME/invoke) runs it as one request: each
stage in the order of the edges; a root stage gets the request, a stage after one other gets
that stage's value, a stage after several gets an object {stage: value}; the answer is the
value of the one stage nothing comes after (several: an object {stage: value}). When every
stage is a sandboxed function of this workflow and tenant (scaling.sandbox = true,
workflow = NAME), the whole request runs in one sandbox, so stages hand big intermediates to
each other through torpor.put / torpor.get without a copy and pass only keys as values.

Command line (torpord runs it to validate a workflow before it records it):

    python3 -m torpor.workflow DIR

exit 0: stdout is one line of JSON {"dir", "name", "tenant", "stages": [{"function", "after"}]}
with the stages in an order that runs each after the ones it takes; exit 1: stderr is one line
naming the key, the problem and the fix.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import tomllib
from pathlib import Path
from typing import Any

from torpor.errors import SpecError
from torpor.spec import DEFAULT_TENANT, NAME_RE

WORKFLOW_FILE = "workflow.toml"
MAX_BYTES = 1 << 20
MAX_STAGES = 64
TOP_KEYS = ("name", "tenant", "stage")
STAGE_KEYS = ("function", "after")


def _fail(key: str | None, problem: str, fix: str) -> SpecError:
    where = f"{key} " if key else ""
    return SpecError(f"{WORKFLOW_FILE}: {where}{problem}; {fix}", key)


def _name(table: dict[str, Any], key: str, where: str, default: str | None) -> str:
    if key not in table:
        if default is None:
            raise _fail(where, "is missing", f'add {key} = "..." (lower-case letters, digits, \'_\', \'.\', \'-\')')
        return default
    value = table[key]
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise _fail(
            where,
            f"must be 1-63 lower-case letters, digits, '_', '.' or '-', starting with a letter or digit, got {value!r}",
            f'write e.g. {key} = "detect"',
        )
    return value


def _read(root: Path) -> str:
    path = root / WORKFLOW_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _fail(None, f"not found in {root}", f"create {path} (see docs/sandboxes.md)") from None
    except OSError as e:
        raise _fail(None, f"cannot be read: {e.strerror} ({path})", "make it a regular file, not a symlink") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_BYTES:
            raise _fail(None, f"must be a regular file of at most {MAX_BYTES} bytes ({path})", "fix the file")
        raw = f.read(MAX_BYTES + 1)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(None, f"is not valid UTF-8 (byte {e.start})", "save the file as UTF-8") from None


def parse_text(text: str, root: Path) -> dict[str, Any]:
    """The JSON form of a workflow.toml's text (module doc); SpecError when it is wrong."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise _fail(None, f"is not valid TOML ({e})", "fix the syntax") from None
    for key in doc:
        if key not in TOP_KEYS:
            raise _fail(key, "is not a workflow key", f"use only {', '.join(TOP_KEYS)}")
    name = _name(doc, "name", "name", None)
    tenant = _name(doc, "tenant", "tenant", DEFAULT_TENANT)
    raw = doc.get("stage")
    if not isinstance(raw, list) or not raw or not all(isinstance(s, dict) for s in raw):
        raise _fail("stage", "must be one or more [[stage]] tables", 'add [[stage]] with function = "..."')
    if len(raw) > MAX_STAGES:
        raise _fail("stage", f"has {len(raw)} stages, more than {MAX_STAGES}", "split the workflow")
    stages: dict[str, list[str]] = {}
    for i, s in enumerate(raw):
        where = f"stage[{i}]"
        for key in s:
            if key not in STAGE_KEYS:
                raise _fail(f"{where}.{key}", "is not a stage key", f"use only {', '.join(STAGE_KEYS)}")
        fn = _name(s, "function", f"{where}.function", None)
        if fn in stages:
            raise _fail(f"{where}.function", f"names {fn} a second time", "give each function one stage")
        after = s.get("after", [])
        if not isinstance(after, list) or not all(isinstance(a, str) for a in after) or len(set(after)) != len(after):
            raise _fail(f"{where}.after", f"must be a list of distinct stage names, got {after!r}", 'write e.g. after = ["detect"]')
        stages[fn] = list(after)
    for fn, after in stages.items():
        for a in after:
            if a not in stages:
                raise _fail(f"stage {fn}", f"comes after {a!r}, which is no stage", f"add a [[stage]] for {a} or fix after")
    # Kahn's algorithm, keeping the written order among ready stages.
    order: list[str] = []
    done: set[str] = set()
    while len(order) < len(stages):
        ready = [fn for fn, after in stages.items() if fn not in done and all(a in done for a in after)]
        if not ready:
            cycle = sorted(fn for fn in stages if fn not in done)
            raise _fail("stage", f"edges form a cycle among {', '.join(cycle)}", "remove an after so the stages form a DAG")
        order.append(ready[0])
        done.add(ready[0])
    return {
        "dir": str(root),
        "name": name,
        "tenant": tenant,
        "stages": [{"function": fn, "after": stages[fn]} for fn in order],
    }


def parse_dir(wdir: str | os.PathLike[str]) -> dict[str, Any]:
    root = Path(wdir)
    if not root.is_dir():
        raise _fail(None, f"cannot be read: {root} is not a directory", "pass the directory that holds workflow.toml")
    root = root.resolve()
    return parse_text(_read(root), root)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python3 -m torpor.workflow",
        description="Validate DIR/workflow.toml; print its JSON form (exit 0) or one error line (exit 1).",
    )
    ap.add_argument("dir", help="the directory that holds workflow.toml")
    args = ap.parse_args(argv)
    try:
        wf = parse_dir(args.dir)
    except SpecError as e:
        print(e, file=sys.stderr)
        return 1
    sys.stdout.write(json.dumps(wf, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
