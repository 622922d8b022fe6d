"""bench/coldstart/split.py: its daemon configs (pure functions), and the whole procedure on the
CPU (`--models cpu`: host-backend segments; the "GPU cache" is memfd memory) with the real daemon,
workers and CRIU, checking the result JSON's structure, that every restore was fresh and that the
outputs of every run and path are identical."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest
from conftest import ROOT

COLDSTART = ROOT / "bench" / "coldstart"


def load(name: str) -> ModuleType:
    sys.path.insert(0, str(COLDSTART))
    spec = importlib.util.spec_from_file_location(f"coldstart_{name}", COLDSTART / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


split = load("split")
split_table = load("split_table")


def test_daemon_config_items_land_in_their_mode_and_table() -> None:
    extra = split.parse_daemon_config(
        ["restore_server.pages=lazy", "gpu-cache:restore_server.gpu_cache_bytes=1024", "log_level=debug"]
    )
    assert extra == {
        None: {"restore_server": {"pages": "lazy"}, "log_level": "debug"},
        "gpu-cache": {"restore_server": {"gpu_cache_bytes": 1024}},
    }
    gpu = split.mode_config("gpu-cache", True, extra)
    assert gpu["restore_server"] == {"host_cache_bytes": 8 << 30, "gpu_cache_bytes": 1024, "pages": "lazy"}
    assert split.mode_config("host-cache", False, extra)["restore_server"]["gpu_cache_bytes"] == 0
    assert split.mode_config("transparent", True, {})["split"] is False
    text = split.render_toml(gpu)
    # Top-level keys before any table, or they would land in it.
    assert text.index("log_level") < text.index("[restore_server]"), text
    import tomllib

    assert tomllib.loads(text) == gpu


def test_a_variant_runs_its_mode_with_its_own_config_after_the_mode() -> None:
    a = split.parse_args(
        [
            "--out", "x.json",
            "--modes", "burst8@serial,cold,burst8",
            "--daemon-config", "burst8:restore_server.gpu_restores=0",
            "--daemon-config", "burst8@serial:restore_server.gpu_restores=1",
        ]
    )
    assert a.modes == ["cold", "burst8", "burst8@serial"]
    assert split.mode_config("burst8", True, a.extra)["restore_server"]["gpu_restores"] == 0
    serial = split.mode_config("burst8@serial", True, a.extra)["restore_server"]
    # The mode's own keys and config, then the variant's on top.
    assert serial["gpu_restores"] == 1 and serial["gpu_cache_bytes"] == split.GPU_CACHE_BYTES
    assert "gpu_restores" not in split.mode_config("cold", True, a.extra)["restore_server"]


@pytest.mark.parametrize("modes", ["nosuch@x", "burst8@Bad", "burst8@"])
def test_a_bad_variant_is_refused(modes: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        split.parse_args(["--out", "x.json", "--modes", modes])
    assert "mode" in capsys.readouterr().err


@pytest.mark.parametrize(
    "item", ["nokey", "=1", "nosuchmode:split=true", "nosuch@x:split=true", "a.b.c=1", "restore_server.=1"]
)
def test_a_bad_daemon_config_item_is_refused(item: str) -> None:
    with pytest.raises(ValueError, match="--daemon-config"):
        split.parse_daemon_config([item])


@pytest.mark.parametrize("args", [["--cpu-weights-mib", "0"], ["--models", "gpt2-large", "--cpu-weights-mib", "64"]])
def test_cpu_weights_mib_takes_a_size_and_the_cpu_model(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        split.parse_args(["--models", "cpu", "--out", "x.json", *args])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--cpu-weights-mib takes a size >= 1 and --models cpu" in err, err
    assert split.parse_args(["--models", "cpu", "--out", "x.json", "--cpu-weights-mib", "64"]).cpu_weights_mib == 64


@pytest.mark.parametrize("args", [["--cpu-weights-parts", "3"], ["--cpu-weights-parts", "0"], ["--cpu-weights-mib", "64", "--cpu-weights-parts", "5"]])
def test_cpu_weights_parts_must_divide_the_weights(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        split.parse_args(["--models", "cpu", "--out", "x.json", *args])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--cpu-weights-parts takes a count >= 1 that divides --cpu-weights-mib" in err, err
    a = split.parse_args(["--models", "cpu", "--out", "x.json", "--cpu-weights-mib", "64", "--cpu-weights-parts", "8"])
    assert (a.cpu_weights_mib, a.cpu_weights_parts) == (64, 8)


def test_cpu_weight_parts_are_the_same_bytes_cut(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(split, "CPU_WEIGHTS_BYTES", 72 << 20)
    one = split.cpu_weight_parts(tmp_path / "w.bin", 1)
    four = split.cpu_weight_parts(tmp_path / "w.bin", 4)
    assert [f.stat().st_size for f in four] == [18 << 20] * 4
    assert b"".join(f.read_bytes() for f in four) == one[0].read_bytes()


def test_disk_read_names_a_missing_file(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(COLDSTART / "disk_read.py"), str(tmp_path / "absent")], capture_output=True, text=True, check=False
    )
    assert r.returncode == 2 and "no such file" in r.stderr.strip().splitlines()[-1], r.stderr


def test_the_cpu_smoke_run_measures_every_path_with_identical_outputs(
    torpor_bin: Path, criu_ready: None, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    out = tmp_path / "split.json"
    # The daemons' sockets live in the work dir: pytest's tmp_path may be too long for them.
    work = Path(tempfile.mkdtemp(prefix="split-", dir="/tmp"))
    r = subprocess.run(
        [
            sys.executable,
            str(COLDSTART / "split.py"),
            "--models", "cpu",
            "--runs", "2",
            # The held request outlasts the second restore on a loaded 2-core machine (else the
            # second request takes instance 1 once it is free: late binding).
            "--hold-s", "6",
            "--torpor", str(torpor_bin),
            "--work-dir", str(work),
            "--daemon-config", "queue.timeout_s=120",
            "--daemon-config", "second:log_level=debug",
            "--idle",
            "--out", str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr[-4000:]}\n(work dir kept: {work})"
    d = json.loads(out.read_text())
    assert d["benchmark"] == "coldstart-split" and d["errors"] == []
    summary = d["summary"]["cpu"]
    assert summary["cold"] == next(r for r in d["results"] if r["mode"] == "cold")["wall_s"]["median"] and summary["identical"] is True, summary
    assert summary["burst8_over_cold"] == round(summary["burst8"] / summary["cold"], 3), summary
    assert summary["burst8_all_up"] is not None and summary["burst8_all_up"] > 0, summary
    assert {"device", "kernel", "torpor_commit", "criu_version", "versions"} <= set(d["machine"])
    assert d["machine"]["criu_version"], d["machine"]
    assert 'log_level = "debug"' in d["settings"]["daemon_config"]["second"]
    assert "timeout_s = 120" in d["settings"]["daemon_config"]["transparent"]

    rows = {r["mode"]: r for r in d["results"]}
    assert list(rows) == [
        "transparent", "host-cache", "gpu-cache", "second", "standby", "standby-live", "cold", "cold-disk", "burst8",
        "pooled", "pooled-later",
    ]
    # The `-pooled` copy, deployed again before each run, started in a ready sandbox of the
    # live-context pool: the same answers.
    pooled = rows.pop("pooled")
    assert len(pooled["runs"]) == 2 and pooled["all_same"] and pooled["warmups"], pooled
    for run in pooled["runs"]:
        assert run["start"] == "pooled" and run["same"] and run["pool_ready_wait_s"] >= 0, run
        assert run["timings"]["pooled_load"] > 0, run["timings"]
    # Deployed once: its first start pooled, its second restored, and every later one the way
    # that was faster, the daemon having measured both (sandbox_pool.starts = "faster"): on the
    # CPU, with its 8 MiB of data read and hashed in setup(), often the restore (75-90 ms
    # against 90-130 ms here); where the two differ clearly, the faster one.
    later = rows.pop("pooled-later")
    assert [w["start"] for w in later["warmups"]] == ["pooled", "restored"], later["warmups"]
    assert len(later["runs"]) == 2 and later["all_same"], later
    # The daemon compares the last figure of each way, and each start replaces its way's: so a
    # run follows the figures as the runs before it left them (a pooled start slowed down by
    # this machine's load makes the next one restore), not the warm-ups' alone.
    known = {w["start"]: w["timings"]["start"] for w in later["warmups"]}
    for run in later["runs"]:
        assert run["start"] in ("pooled", "restored") and run["same"], run
        pooled_s, restored_s = known["pooled"], known["restored"]
        if pooled_s < restored_s / 2 or pooled_s > restored_s * 2:
            assert run["start"] == ("pooled" if pooled_s < restored_s else "restored"), (known, run)
        known[run["start"]] = run["timings"]["start"]
    standby = rows.pop("standby")
    # A CPU function has no GPU to keep live: the same fully restored idle instance.
    standby_live = rows.pop("standby-live")
    assert standby_live["all_same"] and all(r["start"] == "standby" for r in standby_live["runs"]), standby_live
    burst = rows.pop("burst8")
    for mode, row in rows.items():
        assert len(row["runs"]) == 2 and row["all_same"], (mode, row)
        assert row["wall_s"]["n"] == 2 and row["timings"]["restore"]["median"] > 0
        for run in row["runs"]:
            assert run["start"] == "restored" and run["same"], run
            assert run["stop"]["function"] == "cpu", run["stop"]
    assert all(set(run["fills"]) == {"gpu"} for run in rows["cold"]["runs"])
    # Nothing in memory: no cache, no stage area; segments read from the chunk store, and the
    # page cache dropped first (this machine lets root write /proc/sys).
    assert 'stage_bytes = 0' in d["settings"]["daemon_config"]["cold-disk"]
    for run in rows["cold-disk"]["runs"]:
        assert set(run["fills"]) == {"store"} and run["page_cache_dropped"] is True, run
    # 8 restores side by side, each one answered, every answer the reference; one GPU cache
    # (warmed by the model's own restores) and the first instance's read-only copies shared.
    assert len(burst["runs"]) == 2 and burst["all_same"], burst
    for run in burst["runs"]:
        assert len(run["answers"]) == 8 and run["start"] == "restored", run
        # Bound late: some answers may come from an instance another request's start made
        # ready first; all 8 instances still come up.
        assert sum(run["starts"].values()) == 8 and run["starts"].get("restored", 0) >= 1, run
        assert run["all_up_s"] is not None and run["first_answer_s"] <= run["wall_s"], run
        assert run["wall_s"] >= max(a["wall_s"] for a in run["answers"]) - 0.05, run
        assert set(run["fills"]) <= {"gpu", "shared"} and run["fills"]["gpu"]["segments"] >= 8, run["fills"]
    assert d["deploys"]["split"]["cpu-burst"]["snapshot_function"]["split"] is True
    # Where each path's segments came from, restore by restore.
    assert all(not run["fills"] for run in rows["transparent"]["runs"])
    assert "segments" not in rows["transparent"]["timings"]
    assert all(set(run["fills"]) == {"host"} for run in rows["host-cache"]["runs"])
    assert rows["gpu-cache"]["warmups"], "the GPU cache is warmed first"
    assert all(set(run["fills"]) == {"gpu"} for run in rows["gpu-cache"]["runs"])
    for run in rows["second"]["runs"]:
        # The read-only weights and table are the first instance's shared copies.
        assert run["fills"]["shared"]["segments"] == 2, run["fills"]
        assert run["live_instances"] == 2 and run["overlapped"], run
        assert run["devices"] == [0, 0], "one device here: both on it"
        assert run["held"]["start"] == "warm" and run["held"]["same"], run["held"]

    # A CPU function's standby is a fully restored idle instance: the request finds it ready
    # (no restore on its path), answers what a restore answers, and a new one replaces it.
    assert len(standby["runs"]) == 2 and standby["all_same"], standby
    for run in standby["runs"] + standby["warmups"]:
        assert run["start"] == "standby" and run["same"], run
        assert "restore" not in run["timings"] and run["standby_wait_s"] > 0, run
        assert run["stop"]["function"] == "cpu-standby" and run["stop"]["stopped"], run["stop"]
    assert d["deploys"]["split"]["cpu-standby"]["snapshot_function"]["split"] is True

    # --idle: what the node keeps while the function is idle, from the daemon's gauges.
    cold_idle = rows["cold"]["idle"]
    # The GPU cache ("GPU" memfd memory here) holds at least the 8 MiB of read-only weights.
    assert cold_idle["metrics"]['torpor_restore_cache_bytes{cache="gpu"}'] >= split.CPU_WEIGHTS_BYTES, cold_idle
    assert cold_idle["daemon_rss_bytes"] > 10 << 20 and cold_idle["metrics"].get('torpor_standby_instances{function="cpu"}', 0) == 0
    standby_idle = standby["idle"]
    assert standby_idle["metrics"]['torpor_standby_instances{function="cpu-standby"}'] == 1, standby_idle
    assert standby_idle["metrics"]['torpor_standby_host_memory_bytes{function="cpu-standby"}'] > 1 << 20, standby_idle

    split_deploy = d["deploys"]["split"]["cpu"]["snapshot_function"]
    assert split_deploy["split"] and split_deploy["segments"] == 3 and split_deploy["stop_s"] > 0
    assert d["deploys"]["transparent"]["cpu"]["snapshot_function"]["split"] is False
    assert d["deploys"]["split"]["cpu"]["sizes"]["store"]["logical"] >= split_deploy["segment_bytes"]
    [dedup] = d["dedup"]
    assert dedup["functions"] == ["cpu", "cpu-embed"]
    assert dedup["shared_bytes"] > 0 and dedup["dedup_ratio"] > 1.5, dedup
    assert d["outputs"]["cpu"]["identical_across_modes"] is True
    assert d["outputs"]["cpu"]["reference"]["seed"] == 1

    table = split_table.render(d)
    assert "| cpu | split, GPU cache |" in table and "| cpu | split, standby instance (GPU cache) |" in table
    assert "| cpu | split, GPU cache |" in table and "bit-identical" in table and "DIFFER" not in table
    assert "| cpu | cold (split, GPU cache, best config) |" in table and "| cpu | burst of 8 (all answered) |" in table
    assert not any(work.iterdir()), "the work dir is removed without --keep"
    work.rmdir()


def test_the_readme_quotes_the_rendered_cold_start_table_and_the_chart_renders(tmp_path: Path) -> None:
    """The README's cold-start table is split_table.py's headline of the newest full run's JSON,
    never typed by hand; the chart beside it renders from the same JSON."""
    d = json.loads((ROOT / "bench" / "results" / "split-bench-s49-h200.json").read_text())
    table = split_table.headline(d)
    readme = (ROOT / "README.md").read_text()
    assert table in readme, "re-render the README's cold-start table (split_table.py --headline)"
    assert "bench/results/split-bench-s49-h200.png" in readme
    assert "| GPT-2-Large |" in table.splitlines()[0]
    for later in (
        "split-bench-h100.json",
        "split-bench-burst-session15-h100.json",
        "split-bench-session15-h100.json",
        "split-bench-burst-s17-final-h100.json",
        "split-bench-llama8b-background-h100.json",
    ):
        doc = json.loads((ROOT / "bench" / "results" / later).read_text())
        assert split_table.headline(doc) in (ROOT / "README.md").read_text(), f"re-render {later}'s table"
    pytest.importorskip("matplotlib")
    png = tmp_path / "split.png"
    split_table.chart(d, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_parts_of_one_run_merge_and_parts_of_two_binaries_are_refused(tmp_path: Path) -> None:
    merge = load("split_merge")
    d = json.loads((ROOT / "bench" / "results" / "split-bench-h100.json").read_text())
    a = {**d, "results": [r for r in d["results"] if r["mode"] in ("transparent", "gpu-cache")]}
    b = {**d, "results": [r for r in d["results"] if r["mode"] in ("standby",)]}
    merged = merge.merge([b, a])
    assert [r["mode"] for r in merged["results"]] == ["transparent", "transparent", "gpu-cache", "gpu-cache", "standby", "standby"]
    assert merged["summary"]["gpt2-large"]["standby"] == next(
        r["wall_s"]["median"] for r in d["results"] if r["model"] == "gpt2-large" and r["mode"] == "standby"
    )
    assert merged["outputs"]["gpt2-large"]["identical_across_modes"] is True
    other = {**b, "machine": {**b["machine"], "torpor_commit": "0" * 40}}
    with pytest.raises(merge.MergeError, match="one machine and one binary"):
        merge.merge([a, other])


def test_the_residue_table_in_docs_is_the_rendering_of_the_h100_json() -> None:
    """docs/split.md's residue table is bench/coldstart/residue.py --table of the H100 JSON."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "coldstart" / "residue.py"), "--table", str(ROOT / "bench" / "results" / "residue-h100.json")],
        capture_output=True, text=True, check=True,
    )
    assert "| gpt2-large | stack0 |" in r.stdout, r.stdout
    assert r.stdout.strip() in (ROOT / "docs" / "split.md").read_text(), "re-render docs/split.md's residue table"


def test_the_runs_table_lists_every_run_of_a_mode_with_its_phases() -> None:
    d = {
        "results": [
            {"model": "m", "mode": "cold", "runs": [{"run": 0, "wall_s": 9.0, "timings": {"restore": 1.0}, "same": True}]},
            {
                "model": "m",
                "mode": "pooled",
                "runs": [
                    {"run": 0, "wall_s": 2.5, "timings": {"pooled_load": 2.4, "pooled_load.data": 2.0, "total": 2.5}, "same": True},
                    {"run": 1, "wall_s": 0.4, "timings": {"pooled_load": 0.3}, "same": False},
                ],
            },
        ]
    }
    lines = split_table.runs_table(d, "pooled").splitlines()
    assert lines[0] == "| model | run | request → first answer | `pooled_load` | `pooled_load.data` | outputs |"
    assert lines[2:] == ["| m | 0 | 2.500 | 2.400 | 2.000 | identical |", "| m | 1 | 0.400 | 0.300 | – | DIFFER |"]


def test_an_ab_pools_each_arms_runs_over_its_calls(tmp_path: Path) -> None:
    """bench/coldstart/split_ab.py: each arm's runs come from several split-bench JSON files
    (one device call alternates the arms); the medians are of every run of the arm, and a run
    whose answer differed from the reference is shown."""
    ab = load("split_ab")

    def call(name: str, walls: list[float], same: bool = True) -> str:
        runs = [{"wall_s": w, "same": same, "timings": {"restore.cuda_restore": w / 2}} for w in walls]
        doc = {"results": [{"model": "m", "mode": "cold", "runs": runs}, {"model": "m", "mode": "standby", "runs": []}]}
        path = tmp_path / name
        path.write_text(json.dumps(doc))
        return str(path)

    a = [call("a1.json", [0.5, 0.7]), call("a2.json", [0.6])]
    b = [call("b1.json", [0.4]), call("b2.json", [0.2, 0.3], same=False)]
    text = ab.table({"a": a, "b": b}, "cold")
    rows = {line.split(" | ")[1]: line for line in text.splitlines()[2:]}
    assert "0.600 (0.500-0.700, 3 runs) | - | 0.300 | - | bit-identical" in rows["a"], text
    assert "0.300 (0.200-0.400, 3 runs) | - | 0.150 | - | **differ**" in rows["b"], text
    assert ab.main(["a"]) == 2


def test_the_burst_table_names_each_settings_lines_and_takes_medians_of_its_runs(tmp_path: Path) -> None:
    burst_table = load("burst_table")
    base = "split = true\n[restore_server]\n"
    result = {
        "machine": {"gpus": [{}, {}], "device": "NVIDIA H200", "driver": "580", "torpor_commit": "abc"},
        "settings": {"daemon_config": {"burst8": base, "burst8@node": base + 'driver_lanes = "node"\n'}},
        "results": [
            {"model": "m", "mode": "cold", "runs": [{"wall_s": 0.5}]},
            {"model": "m", "mode": "burst8", "runs": [
                {"wall_s": w, "first_answer_s": w / 2, "all_up_s": 2 * w, "devices": {"0": 4, "1": 4}}
                for w in (1.0, 3.0, 2.0)
            ]},
            {"model": "m", "mode": "burst8@node", "runs": [
                {"wall_s": 0.8, "first_answer_s": 0.5, "all_up_s": None, "devices": {"0": 8}}
            ]},
        ],
    }
    path = tmp_path / "split-bench.json"
    path.write_text(json.dumps(result))
    lines = burst_table.table(path).splitlines()
    assert lines[2] == '| m | `burst8`: the run\'s defaults | 1.000 | 2.000 | 4.000 | {"0": 4, "1": 4} | 3 |', lines
    assert lines[3] == '| m | `burst8@node`: `driver_lanes = "node"` | 0.500 | 0.800 | – | {"0": 8} | 1 |', lines
    assert len(lines) == 6 and "2× NVIDIA H200" in lines[-1], lines


def test_the_burst_table_in_docs_split_md_is_what_its_json_says() -> None:
    burst_table = load("burst_table")
    assert burst_table.main(["--check", str(ROOT / "docs" / "split.md")]) == 0


def test_a_second_instance_placed_on_another_gpu_is_named_so_in_the_table() -> None:
    """On two H200s (session 53) the `second` mode's instance went to GPU 1, where nothing is
    shared: the row must not say "shared read-only" then. That run's JSON predates `devices`,
    so it is added here as the bench now records it."""
    table = load("split_table")
    d = json.loads((ROOT / "bench" / "results" / "split-bench-s53-peer-h200x2.json").read_text())
    (second,) = [r for r in d["results"] if r["mode"] == "second"]
    row = lambda: next(line for line in table.results_table(d) if "2nd instance" in line)  # noqa: E731
    assert "(shared read-only)" in row()
    for run in second["runs"]:
        run["devices"] = [0, 1]
    assert "(placed on another GPU)" in row(), row()
