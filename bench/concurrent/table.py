"""The README's tables of issue 10, rendered from the JSON files in `bench/results/`, never typed
by hand: concurrent snapshots and live migrations (`bench/concurrent/measure.py`), and training
throughput with periodic checkpoints (`bench/checkpoint/train.py`).

    python3 bench/concurrent/table.py                      # print the table
    python3 bench/concurrent/table.py --readme README.md   # replace the README's block
    python3 bench/concurrent/table.py --check README.md    # exit 1 when the block differs

Each row names where it was measured and reads its figures from its files' `summary` (and, for
a migration's stop, the daemon's answers in `runs`); a row whose file is missing is an error.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from readme_block import readme_cli, replaced  # noqa: E402 (bench/ is put on the path above)

RESULTS = ROOT / "bench" / "results"
BEGIN = "<!-- concurrent-table: rendered by bench/concurrent/table.py --readme README.md -->"
END = "<!-- /concurrent-table -->"
TRAIN_BEGIN = "<!-- training-table: rendered by bench/concurrent/table.py --readme README.md -->"
TRAIN_END = "<!-- /training-table -->"

Json = dict[str, Any]


def sec(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f} s"


def load(name: str) -> Json:
    doc: Json = json.loads((RESULTS / name).read_text())
    return doc


@dataclass(frozen=True)
class Row:
    where: str
    what: str
    files: tuple[str, ...]
    # (stop-the-world or baseline, concurrent) from the loaded files, in `files` order.
    cells: Callable[..., tuple[str, str]]


def hibernation(d: Json) -> tuple[str, str]:
    s = d["summary"]
    return sec(s["stop_s_stop_the_world"]), sec(s["stop_s"])


def deploy_stop(d: Json) -> tuple[str, str]:
    s = d["summary"]
    return sec(s["deploy_stop_s_stop_the_world"]), sec(s["deploy_stop_s"])


def stop_steps(d: Json) -> tuple[str, str]:
    """The concurrent hibernation's stop by step (medians; `phases` of its log line)."""
    p = d["summary"]["stop_phases_s"]
    return "–", (
        f"quiesce {sec(p['quiesce'])}, segments {sec(p['segments'])}, snapshot {sec(p['snapshot'])} "
        f"(CRIU's dump {sec(p['snapshot.criu_dump'])}, driver checkpoint {sec(p['snapshot.cuda_checkpoint'])}, "
        f"hashes {sec(p['snapshot.hash_and_write'])})"
    )


def cpu_migration(d: Json) -> tuple[str, str]:
    s = d["summary"]
    stops = [r["daemon"]["stop_s"] for r in d["runs"]]
    return "–", (
        f"{sec(s['migration_downtime_s'], 3)}, {sec(s['migration_downtime_s_median'], 3)} "
        f"({min(stops):.2f}–{sec(max(stops))} stopped)"
    )


def residue(s: Json) -> float:
    p = s["stop_phases_median_s"]
    return float(p["residue_checkpoint_s"] + p["residue_restore_s"])


def shrink_ab(on: Json, off: Json) -> tuple[str, str]:
    a, b = on["summary"], off["summary"]
    return "–", (
        f"{sec(a['migration_downtime_s'])}, {sec(a['migration_downtime_s_median'])}; {sec(residue(a))} "
        f"({sec(b['migration_downtime_s_median'])} median, {sec(residue(b))} residue without `shrink_context`)"
    )


def precopy(s: Json, how: str) -> str:
    return f"{sec(s['precopy_s_median'], 3 if s['precopy_s_median'] < 0.1 else 2)} ({s['precopy_gbps_median']:.{0 if s['precopy_gbps_median'] >= 10 else 1}f} GB/s, {how})"


def peer_ab(on: Json, off: Json) -> tuple[str, str]:
    a, b = on["summary"], off["summary"]
    return (
        f"{precopy(b, 'through host memory')}; {sec(b['migration_total_s'])}",
        f"{precopy(a, 'GPU to GPU')}; {sec(a['migration_total_s'])}",
    )


def big_model(d: Json) -> tuple[str, str]:
    s = d["summary"]
    return "–", (
        f"{sec(s['migration_downtime_s'])}, {sec(s['migration_downtime_s_median'])}; "
        f"{sec(s['precopy_s_median'])} ({s['precopy_gbps_median']:.0f} GB/s); {sec(s['migration_total_s'])}"
    )


def released(d: Json) -> tuple[str, str]:
    """The hibernation of a gpu_released instance: resumed first against kept released."""
    s = d["summary"]
    a, b = s["stop_phases_s_resumed_first"], s["stop_phases_s"]
    return (
        f"{sec(s['stop_s_resumed_first'])} (resume {sec(a['gpu_resume'])}, CRIU's dump {sec(a['snapshot.criu_dump'])}, "
        f"driver checkpoint {sec(a['snapshot.cuda_checkpoint'])})",
        f"{sec(s['stop_s'])} (CRIU's dump {sec(b['snapshot.criu_dump'])}, no driver call)",
    )


def released_arms(*docs: Json) -> tuple[str, str]:
    """The same as `released`, the runs of one arm's calls pooled (an A/B alternating in one
    call): each stop's median, and the median of what was outside CRIU's dump and the driver."""

    def cell(mode: str) -> str:
        runs = [r for d in docs for r in d["modes"][mode]["runs"]]
        criu_or_driver = ("snapshot.criu_dump", "snapshot.cuda_checkpoint", "gpu_resume")
        outside = [r["stop_s"] - sum(r["phases"].get(k, 0.0) for k in criu_or_driver) for r in runs]
        dumps = [r["phases"]["snapshot.criu_dump"] for r in runs]
        return (
            f"{sec(statistics.median(r['stop_s'] for r in runs))} (CRIU's dump {sec(statistics.median(dumps))}, "
            f"{min(dumps):.2f}–{max(dumps):.2f} s; outside it and the driver {sec(statistics.median(outside), 3)})"
        )

    return cell("resumed-first"), cell("released")


ROWS = (
    Row("dev machine, CPU function, 20 MB of segments", "hibernation stop (median)",
        ("concurrent-checkpoint-hibernate-cpu.json",), hibernation),
    Row("same", "deploy snapshot's stop", ("concurrent-checkpoint-hibernate-cpu.json",), deploy_stop),
    Row("same, two host devices", "live migration: longest gap between answers (worst, median of 3)",
        ("migration-cpu.json",), cpu_migration),
    Row("H100, GPT-2-Large (session 12, 3 runs a side)", "hibernation stop (median)",
        ("concurrent-checkpoint-h100.json",), hibernation),
    Row("same", "deploy snapshot's stop", ("concurrent-checkpoint-h100.json",), deploy_stop),
    Row("H100, GPT-2-Large (session 26, one call, 3 runs a side): before, e2babf1", "hibernation stop (median)",
        ("concurrent-checkpoint-s26-final-before-h100.json",), hibernation),
    Row("same call: after, 2bc954b (flushed after the stop; `gc.freeze` at quiet points)", "hibernation stop (median)",
        ("concurrent-checkpoint-s26-final-after-h100.json",), hibernation),
    Row("same", "the concurrent stop's steps (median)", ("concurrent-checkpoint-s26-final-after-h100.json",), stop_steps),
    Row("same", "deploy snapshot's stop", ("concurrent-checkpoint-s26-final-after-h100.json",), deploy_stop),
    Row("H200 ×2, GPT-2-Large (session 22, 4 moves a side)",
        "migration downtime (worst, median); the stop's residue move",
        ("migration-h200x2.json", "migration-h200x2-noshrink.json"), shrink_ab),
    Row("H200 ×2, GPT-2-Large (session 23, one call, `peer_copy` off / on)",
        "migration's pre-copy of 3.15 GB (median); whole migration (worst)",
        ("migration-s23-peeron-h200x2.json", "migration-s23-peeroff-h200x2.json"), peer_ab),
    Row("H200 ×2, `llama-13b` bf16, 26.2 GB (session 23, 4 moves)",
        "migration downtime (worst, median); pre-copy (median); whole migration (worst)",
        ("migration-s23-llama13b-h200x2.json",), big_model),
    Row("H200 ×2, `llama-13b` bf16 (session 42, 4 moves, 164f628)",
        "migration downtime (worst, median); pre-copy (median); whole migration (worst)",
        ("migration-s42-llama13b-h200x2.json",), big_model),
    Row("H200, GPT-2-Large from gpu_released (session 42, one call, 3 runs a side): "
        "left resumed first (`hibernate_released = false`), right kept released",
        "hibernation stop (median)", ("hibernation-released-s42-h200.json",), released),
    Row("H200, GPT-2-Large from gpu_released (session 50, one call, arms alternating, 4 runs an arm): "
        "before, 9e30d24; left resumed first, right kept released",
        "hibernation stop (median)",
        ("hibernation-released-s50-prep2-1-before-h200.json", "hibernation-released-s50-prep2-3-before-h200.json"),
        released_arms),
    Row("same call: after, d4ca79f (no page-table walks before the dump where they cannot matter)",
        "hibernation stop (median)",
        ("hibernation-released-s50-prep2-2-after-h200.json", "hibernation-released-s50-prep2-4-after-h200.json"),
        released_arms),
)


# Training runs (bench/checkpoint/train.py): where, and the file; the iteration time is read.
TRAIN_ROWS = (
    ("dev machine, numpy MLP", "concurrent-checkpoint-cpu.json"),
    ("dev machine, numpy MLP, longer steps", "concurrent-checkpoint-cpu-100ms.json"),
    ("H100, PyTorch transformer", "checkpoint-train-h100.json"),
    ("H200, PyTorch transformer (session 45)", "checkpoint-train-s45-h200.json"),
)


def training_row(where: str, name: str) -> str:
    d = load(name)
    modes = d["modes"]
    none, stw, conc = modes["none"], modes["stop_the_world"], modes.get("concurrent") or {}
    iteration = f"{1000 / none['iters_per_s']:.0f} ms"
    world = (
        f"{stw['iters_per_s']:.1f} it/s ({stw['overhead_pct']:.1f} % overhead, "
        f"stop {sec(statistics.median(stw['stop_s']))})"
    )
    if conc.get("ok"):
        concurrent = f"{conc['iters_per_s']:.1f} it/s ({conc['overhead_pct']:.1f} % overhead)"
    elif "soft-dirty" in (d["summary"].get("concurrent_unavailable") or ""):
        concurrent = "refused: the kernel has no soft-dirty tracking"
    else:
        concurrent = "failed: " + str(d["summary"].get("concurrent_unavailable"))
    return f"| {where}, {iteration} | {none['iters_per_s']:.1f} it/s | {world} | {concurrent} | `bench/results/{name}` |"


def render_training() -> str:
    lines = [
        "| where, iteration | none | stop-the-world | concurrent | file |",
        "|---|---|---|---|---|",
    ]
    lines += [training_row(where, name) for where, name in TRAIN_ROWS]
    return "\n".join(lines)


def render() -> str:
    lines = [
        "| where | what | stop-the-world | concurrent | file |",
        "|---|---|---|---|---|",
    ]
    for row in ROWS:
        docs = [load(f) for f in row.files]
        before, after = row.cells(*docs)
        files = f"`bench/results/{row.files[0]}`" + "".join(f", `{f}`" for f in row.files[1:])
        lines.append(f"| {row.where} | {row.what} | {before} | {after} | {files} |")
    return "\n".join(lines)


def rendered(text: str) -> str:
    """`text` with both tables' blocks rendered anew."""
    text = replaced(text, BEGIN, END, render())
    return replaced(text, TRAIN_BEGIN, TRAIN_END, render_training())


def main(argv: list[str]) -> int:
    return readme_cli(argv, doc=__doc__, script="bench/concurrent/table.py", what="a table of issue 10",
                      rendered=rendered, shown=lambda: render() + "\n\n" + render_training())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

