"""Where a CRIU restore's or dump's time goes, read from its log (torpor writes both at -v4, with
timestamps).

CRIU's log lines start with `(SS.uuuuuu)`, the seconds since CRIU started. This prints the log's
span, the longest silences (the line before each gap is what was running), and the time between
a few milestones, so a slow restore on the GPU machine can be taken apart without CRIU's own
profiling:

    python3 bench/coldstart/criu_log_gaps.py restore-*.log [--top 25] [--min-ms 5]

A dump spends its time in many short steps, not in a few silences: `--steps` adds up the time
before each line by the step of memory dumping the line belongs to (criu/mem.c, page-pipe.c,
page-xfer.c: choosing the pages, the parasite draining them into pipes, writing them into the
image) and counts the parasite's round trips:

    python3 bench/coldstart/criu_log_gaps.py dump.log --steps
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

STAMP = re.compile(r"^\((\d+)\.(\d+)\)\s*(.*)$")
# Milestones of a restore (criu/cr-restore.c, criu/pie/restorer.c), in the order they come.
MILESTONES = (
    "Forking task",
    "Restoring resources",
    "Opening fdinfo",
    "Restore via sigreturn",
    "Running post-restore scripts",
    "Restore finished successfully",
)


# Steps of a dump's memory (criu/mem.c): the first prefix a line starts with names its step. The
# time since the line before is counted to it: CRIU logs each piece of work once it is done.
DUMP_STEPS = (
    ("choose pages", ("page-pipe: Add iov", "Pagemap generated", "pagemap-cache", "page-pipe: Will grow",
                      "page-pipe: Grow pipe", "Pagemap full")),
    ("drain into pipes (parasite)", ("PPB:", "Sent msg to daemon", "Wait for ack", "Fetched ack",
                                     "page-pipe: Page pipe", "page-pipe: * ", "page-pipe: \t")),
    ("write the image", ("page-xfer", "page-pipe: Clean up")),
)
ROUND_TRIP = "Wait for ack"


def step_of(text: str) -> str:
    for name, prefixes in DUMP_STEPS:
        if text.startswith(prefixes):
            return name
    return "everything else"


def steps(lines: list[tuple[float, str]]) -> dict[str, float]:
    """Seconds per step; the first line's own time (since CRIU started) counts to its step."""
    out: dict[str, float] = {}
    before = 0.0
    for t, text in lines:
        name = step_of(text)
        out[name] = out.get(name, 0.0) + (t - before)
        before = t
    return out


def parse(path: Path) -> list[tuple[float, str]]:
    out: list[tuple[float, str]] = []
    for line in path.read_text(errors="replace").splitlines():
        m = STAMP.match(line)
        if m:
            out.append((int(m.group(1)) + int(m.group(2)) / 10 ** len(m.group(2)), m.group(3)))
    return out


def report(path: Path, top: int, min_ms: float, by_step: bool = False) -> str:
    lines = parse(path)
    if not lines:
        return f"{path}: no timestamped lines"
    rows = [f"== {path.name}: {len(lines)} lines, {lines[-1][0] - lines[0][0]:.3f} s"]
    gaps = sorted(
        ((lines[i][0] - lines[i - 1][0], lines[i - 1], lines[i]) for i in range(1, len(lines))),
        key=lambda g: -g[0],
    )
    for gap, before, after in gaps[:top]:
        if gap * 1000 < min_ms:
            break
        rows.append(f"{gap * 1000:8.1f} ms  at {before[0]:8.3f}  {before[1][:110]}")
        rows.append(f"{'':12} then {after[0]:8.3f}  {after[1][:110]}")
    seen: list[tuple[str, float]] = []
    for name in MILESTONES:
        hit = next((t for t, text in lines if name in text), None)
        if hit is not None:
            seen.append((name, hit))
    if seen:
        rows.append("milestones: " + ", ".join(f"{n} {t:.3f}" for n, t in seen))
    if by_step:
        trips = sum(1 for _, text in lines if text.startswith(ROUND_TRIP))
        for name, secs in sorted(steps(lines).items(), key=lambda kv: -kv[1]):
            rows.append(f"step {name}: {secs:.3f} s")
        rows.append(f"parasite round trips: {trips}")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=25, help="the longest gaps to print")
    p.add_argument("--min-ms", type=float, default=5.0, help="leave out gaps shorter than this")
    p.add_argument("--steps", action="store_true", help="a dump's time by memory-dumping step")
    a = p.parse_args(argv)
    for path in a.logs:
        print(report(path, a.top, a.min_ms, a.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
