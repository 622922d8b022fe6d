"""Renders a peer benchmark JSON (bench/peers/run.py or merge.py) as Markdown and as a chart,
never typed by hand:

    python3 bench/peers/table.py RESULT.json                 # the whole report
    python3 bench/peers/table.py --headline RESULT.json      # the README's table
    python3 bench/peers/table.py --readme README.md RESULT.json   # re-render the README's block
    python3 bench/peers/table.py --chart OUT.png RESULT.json # bars, log-scale seconds

The chart needs matplotlib (tests/requirements.txt has it; render it here from the JSON copied
back from the GPU machine).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from readme_block import NoBlock, replaced  # noqa: E402 (bench/ is put on the path above)

Json = dict[str, Any]

MODE_NAMES = {
    "scratch": "from scratch (exec → first answer), best loader, page cache warm",
    "scratch-disk": "… the same, page cache dropped",
    "pool": "pre-imported interpreter (torch + transformers imported, CUDA context ready)",
    "built-safetensors": 'pre-built process (model on the meta device, CUDA ready): safetensors `load_file(device="cuda")`',
    "built-runai": "… Run:ai Model Streamer (`SafetensorsStreamer`)",
    "built-fastsafetensors": "… fastsafetensors (`fastsafe_open`, no GDS)",
    "built-disk": "… best loader, page cache dropped",
    "transparent": "Torpor, torpord `split = false` (transparent)",
    "cold": "**Torpor cold** (split, weights in the GPU cache)",
    "cold-disk": "Torpor cold from disk (no cache, page cache dropped)",
    "standby": "Torpor standby",
}
MODEL_NAMES = {
    "gpt2-large": "GPT-2-Large, fp32",
    "llama-3b": "Llama-3.2-3B shape, bf16",
    "llama-8b": "Llama-3-8B shape, bf16",
    "tiny-gpt2": "tiny GPT-2 (CPU smoke)",
    "tiny-llama": "tiny Llama (CPU smoke)",
}
# The README's block, between these two lines, is table.py's --headline output.
BEGIN = "<!-- peers-table: rendered by bench/peers/table.py --readme README.md bench/results/peers-h100.json -->"
END = "<!-- /peers-table -->"


def models_of(d: Json) -> list[str]:
    out: list[str] = []
    for r in d["results"]:
        out += [r["model"]] if r["model"] not in out else []
    return out


def modes_of(d: Json) -> list[str]:
    present = {r["mode"] for r in d["results"]}
    return [m for m in MODE_NAMES if m in present]


def row(d: Json, model: str, mode: str) -> Json | None:
    return next((r for r in d["results"] if r["model"] == model and r["mode"] == mode), None)


def size(n: float | None) -> str:
    if n is None:
        return "?"
    if n == 0:
        return "0"
    if n >= 1e8:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def cell(r: Json | None) -> str:
    if r is None:
        return "–"
    if r.get("skipped"):
        return "skipped"
    if r.get("median") is None:
        return "failed" if r.get("error") else "–"
    return f"{r['median']:.2f} s"


def idle_cell(d: Json, model: str, mode: str) -> str:
    cost = (d.get("summary") or {}).get("resident_idle", {}).get(model, {}).get(mode)
    if not cost:
        return "–"
    if cost.get("host_bytes") == 0 and cost.get("gpu_bytes") == 0:
        return "nothing"
    return f"{size(cost.get('host_bytes'))} host, {size(cost.get('gpu_bytes'))} GPU"


def targets_line(d: Json) -> str:
    parts = []
    for t in (d.get("summary") or {}).get("targets") or []:
        if t["met"] is None:
            verdict = "not measured"
        elif t["met"]:
            verdict = f"**met** ({t['value_s']:.2f} s against {t['limit_s']:.2f} s)"
        else:
            verdict = f"**missed** by {t['by']:.1f}× ({t['value_s']:.2f} s against {t['limit_s']:.2f} s)"
        parts.append(f"{t['model']} {t['target']}: {verdict}")
    return "Targets: " + "; ".join(parts) + "." if parts else ""


def headline(d: Json) -> str:
    """Mode × model medians of start → first answer, with what each keeps while idle."""
    models = models_of(d)
    sizes = (d.get("settings") or {}).get("weights_bytes") or {}
    names = [MODEL_NAMES.get(m, m) + (f" ({size(sizes[m])})" if sizes.get(m) else "") for m in models]
    out = [
        "| how the instance starts | "
        + " | ".join(names)
        + " | "
        + " | ".join(f"kept while idle ({MODEL_NAMES.get(m, m).split(',')[0]})" for m in models)
        + " |",
        "|---|" + "---|" * (2 * len(models)),
    ]
    for mode in modes_of(d):
        cells = [cell(row(d, m, mode)) for m in models] + [idle_cell(d, m, mode) for m in models]
        out.append(f"| {MODE_NAMES[mode]} | " + " | ".join(cells) + " |")
    s = d.get("summary") or {}
    same = {True: "identical on every path", False: "**DIFFER**", None: "not compared"}[
        s.get("digests_identical") if any(v.get("identical") is not None for v in (s.get("digests") or {}).values()) else None
    ]
    m = d["machine"]
    runs = (d.get("settings") or {}).get("runs") or {}
    out += [
        "",
        f"{m.get('device') or 'no GPU'}, driver {m.get('driver')}, torch {(m.get('versions') or {}).get('torch')}, "
        f"commit {(m.get('torpor_commit') or 'unknown')[:12]}; medians of {', '.join(f'{k}: {v}' for k, v in runs.items())} "
        f"fresh starts; logits' digests {same}.",
    ]
    line = targets_line(d)
    if line:
        out += ["", line]
    return "\n".join(out)


def span(s: Json | None) -> str:
    return "–" if not s else f"{s['median']:.3f} ({s['min']:.3f}–{s['max']:.3f})"


def details(d: Json) -> list[str]:
    out = ["| model | mode | loader | runs | wall s, median (min–max) | phases (first run) | digest |", "|---|---|---|---|---|---|---|"]
    for r in d["results"]:
        if r.get("skipped"):
            out.append(f"| {r['model']} | {r['mode']} | {r.get('loader', '–')} | 0 | skipped: {r['skipped']} | | |")
            continue
        first = (r.get("runs") or [{}])[0]
        phases = first.get("phases") or first.get("timings") or {}
        ph = ", ".join(f"{k} {v:.3f}" for k, v in phases.items() if isinstance(v, (int, float)))
        digest = "–" if not r.get("digests") else ("same" if r.get("digests_identical") else "DIFFER") + f" {r['digests'][0][:12]}"
        err = f" error: {r['error'].splitlines()[0][:120]}" if r.get("error") else ""
        out.append(
            f"| {r['model']} | {r['mode']} | {r.get('loader', 'torpord')} | {len(r.get('runs') or [])} | {span(r.get('wall_s'))}{err} | {ph} | {digest} |"
        )
    return out


def render(d: Json) -> str:
    out = [headline(d), "", *details(d)]
    if d.get("errors"):
        out += ["", "Errors: " + "; ".join(e.splitlines()[0][:200] for e in d["errors"])]
    return "\n".join(out)


def readme_block(d: Json) -> str:
    return f"{BEGIN}\n{headline(d)}\n{END}"


def update_readme(readme: Path, d: Json) -> None:
    try:
        readme.write_text(replaced(readme.read_text(), BEGIN, END, headline(d)))
    except NoBlock as e:
        raise SystemExit(f"{readme}: {e}") from None
    except OSError as e:
        raise SystemExit(f"table.py: {e}") from None


def chart(d: Json, png: str) -> None:
    """One group per model, one bar per mode (median, min–max whiskers), log-scale seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models, modes = models_of(d), modes_of(d)
    fig, ax = plt.subplots(figsize=(max(7.0, 3.2 * len(models)), 4.6))
    width = 0.85 / max(1, len(modes))
    cmap = plt.get_cmap("tab20")
    for k, mode in enumerate(modes):
        xs, ys, lo, hi = [], [], [], []
        for i, model in enumerate(models):
            r = row(d, model, mode)
            if r is None or not r.get("wall_s"):
                continue
            s = r["wall_s"]
            xs.append(i + k * width)
            ys.append(s["median"])
            lo.append(s["median"] - s["min"])
            hi.append(s["max"] - s["median"])
        if xs:
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=mode, color=cmap(k % 20))
    ax.set_yscale("log")
    ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(models))])
    ax.set_xticklabels([MODEL_NAMES.get(m, m) for m in models])
    ax.set_ylabel("start → first answer, s (median, min–max; log)")
    m = d["machine"]
    ax.set_title(f"Peers: ways to start the same model, {m.get('device') or 'no GPU'}, commit {(m.get('torpor_commit') or '?')[:8]}", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    usage = "usage: table.py [--headline | --chart OUT.png | --readme README.md] RESULT.json"
    if not argv:
        print(usage, file=sys.stderr)
        return 2
    try:
        d = json.loads(Path(argv[-1]).read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"table.py: cannot read {argv[-1]}: {e}", file=sys.stderr)
        return 1
    if argv[:1] == ["--chart"] and len(argv) == 3:
        chart(d, argv[1])
    elif argv[:1] == ["--readme"] and len(argv) == 3:
        update_readme(Path(argv[1]), d)
    elif argv[:1] == ["--headline"] and len(argv) == 2:
        print(headline(d))
    elif len(argv) == 1:
        print(render(d))
    else:
        print(usage, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
