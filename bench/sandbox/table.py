"""The README's table and chart of issue 11 (sandboxes), rendered from bench/results, never typed:

    python3 bench/sandbox/table.py                      # print the table
    python3 bench/sandbox/table.py --readme README.md   # replace the README's block
    python3 bench/sandbox/table.py --check README.md    # exit 1 when the block differs
    python3 bench/sandbox/table.py --chart bench/results/sandbox-memory-h100.png

Its figures: `memory_ratio_8fn` of bench/sandbox/run.py's memory runs at three function sizes
(MEMORY_FILES), beside the ceiling a sandbox of one process's context would reach (a sandbox
saves the other contexts, not the functions' weights: 8 (C + W) / (C + 8 W), with C a process's
memory less its weights); the pooled start, the hand-offs and the store from the full run
(SANDBOX_FILE); big models' later cold starts in a ready sandbox (POOLED_BIG_FILE); a workflow
end to end through the store and through JSON (WORKFLOW_FILE); the small
function's p99 under a large load from the PCIe run (PCIE_FILE);
throughput on the bench/serverless traces, a sandbox against processes (SERVERLESS_FILE).
A missing file or figure is an error, never a blank.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from readme_block import readme_cli, replaced  # noqa: E402 (bench/ is put on the path above)

RESULTS = ROOT / "bench" / "results"
BEGIN = "<!-- sandbox-table: rendered by bench/sandbox/table.py --readme README.md -->"
END = "<!-- /sandbox-table -->"
MEMORY_FILES = ("sandbox-s39-w16-h100.json", "sandbox-s39-w32-h100.json", "sandbox-s39-w64-h100.json")
SANDBOX_FILE = "sandbox-s45-h200.json"
PCIE_FILE = "sandbox-pcie-h100.json"
# The bench/serverless traces, one sandbox against one process per concurrent request.
SERVERLESS_FILE = "serverless-sandbox-s35-h100.json"
# The hand-off to another sandbox alone (`--handoff-only --handoff-runs 15`), twice in one call.
HANDOFF_FILES = ("sandbox-handoff-s39-1-h100.json", "sandbox-handoff-s39-2-h100.json")
# Big models started in a ready sandbox (bench/coldstart/split.py --modes cold,pooled-later).
POOLED_BIG_FILE = "split-bench-s44-pooled-later-h200.json"
# A workflow end to end, the communication store against JSON (bench/sandbox/workflow.py).
WORKFLOW_FILE = "sandbox-workflow-s45-h200.json"
POOLED_BIG_MODELS = {"gpt2-large": "GPT-2-Large", "resnet152": "ResNet-152"}
# The function's own parts of a pooled start; the rest of the answer's time is Torpor's.
OWN_PHASES = ("pooled_load.import", "pooled_load.setup", "pooled_load.warmup", "handler")

Json = dict[str, Any]


def load(name: str) -> Json:
    doc: Json = json.loads((RESULTS / name).read_text())
    return doc


def mib(x: float) -> str:
    return f"{x:,.0f}".replace(",", " ") + " MiB"


def memory(d: Json) -> tuple[int, float, float, float, float, float]:
    """(weights a function in MiB, processes' MiB, sandbox's MiB, ratio, ratio once idle,
    ceiling): the ceiling is the ratio against a sandbox as large as one process's context and
    the functions' weights."""
    n, w = int(d["settings"]["functions"]), int(d["settings"]["weights_mib"])
    procs, sandbox = float(d["processes"]["gpu_mib"]), float(d["sandbox"]["gpu_mib"])
    context = procs / n - w
    s = d["summary"]
    return w, procs, sandbox, float(s[f"memory_ratio_{n}fn"]), float(s[f"memory_ratio_{n}fn_idle"]), procs / (context + n * w)


def met(ok: bool) -> str:
    return "met" if ok else "**missed**"


def table() -> str:
    rows = [
        "| figure (issue 11) | target | Torpor | against | file |",
        "|---|---|---|---|---|",
    ]
    for name in MEMORY_FILES:
        w, procs, sandbox, ratio, idle, ceiling = memory(load(name))
        rows.append(
            f"| `memory_ratio_8fn`, functions of {w} MiB | ≥ 5 | {ratio:.2f} ({idle:.2f} idle; ceiling "
            f"{ceiling:.2f}): {met(ratio >= 5)} | 8 processes {mib(procs)}, one sandbox {mib(sandbox)} "
            f"| `{name}` |"
        )
    s = load(SANDBOX_FILE)["summary"]
    handoffs = load(SANDBOX_FILE)["sandbox"]["handoff"]["other_sandbox_gpu"]
    rows += [
        f"| `pooled_start_s` | ≤ 0.05 s + setup | {s['pooled_start_s']:.4f} s ({s['pooled_starts']}): "
        f"{met(s['pooled_start_s'] <= 0.05)} | a cold restore {s['cold_restore_start_s']:.3f} s | `{SANDBOX_FILE}` |",
        f"| `handoff_100mb_ms`, one sandbox | ≤ 1 ms | {s['handoff_100mb_ms']:.3f} ms: "
        f"{met(s['handoff_100mb_ms'] <= 1)} | a sealed memfd (`shared=True`, host) {s['handoff_100mb_shared_ms']:.1f} ms "
        f"| `{SANDBOX_FILE}` |",
        f"| hand-off of 100 MB to another sandbox, one GPU ({len(handoffs)} runs) "
        f"| ≤ 1 ms | best "
        f"{s['handoff_100mb_other_sandbox_ms']:.2f} ms, median {s['handoff_100mb_other_sandbox_median_ms']:.2f} ms: "
        f"{met(s['handoff_100mb_other_sandbox_median_ms'] <= 1)} | the get alone "
        f"{s['handoff_100mb_other_sandbox_get_ms']:.2f} ms | `{SANDBOX_FILE}` |",
    ]
    for name in HANDOFF_FILES:
        h = load(name)
        runs, hs = h["settings"]["handoff_runs"], h["summary"]
        rows.append(
            f"| the same alone ({runs} runs) | ≤ 1 ms | best {hs['handoff_100mb_other_sandbox_ms']:.2f} ms, median "
            f"{hs['handoff_100mb_other_sandbox_median_ms']:.2f} ms: {met(hs['handoff_100mb_other_sandbox_median_ms'] <= 1)} "
            f"| the get alone {hs['handoff_100mb_other_sandbox_get_ms']:.2f} ms | `{name}` |"
        )
    rows += pooled_big()
    w = load(WORKFLOW_FILE)
    for kib in w["settings"]["sizes_kib"]:
        k, size = str(kib), (f"{kib} KiB" if kib < 1024 else f"{kib // 1024} MiB")
        rows.append(
            f"| workflow end to end, {size} between its 3 stages | measured | "
            f"{w['summary']['workflow_store_ms'][k]:.1f} ms through the store | through JSON "
            f"{w['summary']['workflow_json_ms'][k]:.1f} ms | `{WORKFLOW_FILE}` |"
        )
    traces = load(SERVERLESS_FILE)
    by = {(r["mode"], r["pattern"]): r for r in traces["results"]}
    for pattern in traces["settings"]["patterns"]:
        sb, pr = by[("sandbox", pattern)], by[("restore", pattern)]
        rows.append(
            f"| throughput on the `{pattern}` trace ({traces['settings']['clients']} clients, "
            f"{sb['function']}) | measured | {sb['summary']['throughput_rps']:.2f} req/s, "
            f"{sb['gpu_memory_gib_s']:.1f} GiB·s of GPU memory | processes: {pr['summary']['throughput_rps']:.2f} "
            f"req/s, {pr['gpu_memory_gib_s']:.1f} GiB·s | `{SERVERLESS_FILE}` |"
        )
    p = load(PCIE_FILE)["summary"]
    rows.append(
        f"| `small_p99_ratio` (a small cold start during a 3 GiB load) | ≤ 1.2 | {p['small_p99_ratio']:.2f}: "
        f"{met(p['small_p99_ratio'] <= 1.2)} | without the scheduler {p['small_p99_ratio_without']:.2f} "
        f"| `{PCIE_FILE}` |"
    )
    return "\n".join(rows)


def pooled_big() -> list[str]:
    """A row per big model of POOLED_BIG_FILE: its later cold starts in a ready sandbox (the
    median answer), and of it what is not the function's own import, setup(), warm-up and
    request: what issue 11's "≤ 50 ms + the function's setup" bounds."""
    d = load(POOLED_BIG_FILE)
    rows = []
    for model, shown in POOLED_BIG_MODELS.items():
        row = next(r for r in d["results"] if r["model"] == model and r["mode"] == "pooled-later")
        runs = [r for r in row["runs"] if r["start"] == "pooled"]
        if not runs:
            raise ValueError(f"{POOLED_BIG_FILE}: no pooled run of {model}")
        total = statistics.median(r["wall_s"] for r in runs)
        beyond = statistics.median(r["wall_s"] - sum(r["timings"][k] for k in OWN_PHASES) for r in runs)
        rows.append(
            f"| `pooled_start_s`, {shown} (weights as views, a later cold start) | ≤ 0.05 s + setup | "
            f"{total:.3f} s, of which {beyond:.3f} s beyond its import, setup, warm-up and request "
            f"({len(runs)} of {len(row['runs'])}): {met(beyond <= 0.05)} | a cold restore "
            f"{d['summary'][model]['cold']:.3f} s | `{POOLED_BIG_FILE}` |"
        )
    return rows


def rendered(text: str) -> str:
    """`text` with its block between BEGIN and END replaced by the table."""
    return replaced(text, BEGIN, END, table())


def chart(png: Path) -> None:
    """Bars: the GPU memory of 8 processes and of one sandbox at each function size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    got = [memory(load(name)) for name in MEMORY_FILES]
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    xs = range(len(got))
    ax.bar([x - 0.2 for x in xs], [g[1] for g in got], 0.4, label="8 processes")
    ax.bar([x + 0.2 for x in xs], [g[2] for g in got], 0.4, label="one sandbox")
    for x, g in zip(xs, got, strict=True):
        ax.annotate(f"{g[3]:.2f}×", (x + 0.2, g[2]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{g[0]} MiB a function" for g in got])
    ax.set_ylabel("GPU memory (NVML), MiB")
    m = load(MEMORY_FILES[0])["machine"]
    ax.set_title(f"8 functions of one tenant, {m.get('device')}, commit {str(m.get('commit'))[:8]}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    return readme_cli(argv, doc=__doc__, script="bench/sandbox/table.py", what="issue 11's table",
                      rendered=rendered, shown=table, chart=chart)


if __name__ == "__main__":
    sys.exit(main())
