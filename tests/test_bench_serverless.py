"""bench/serverless reads GPU memory·seconds from /metrics over every stage label, `starting`
included, and records the per-stage breakdown (pure functions of a metrics delta); its sandbox
mode deploys the function sandboxed with as many requests at once, and a short replay of both
modes runs on this machine with a CPU function."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from conftest import ROOT

GIB = 1 << 30


def load(name: str) -> ModuleType:
    path = ROOT / "bench" / "serverless" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"serverless_{name}", path)
    assert spec and spec.loader, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


run = load("run")
table = load("table")


def test_the_total_is_the_sum_over_every_stage_starting_included() -> None:
    delta = {
        'torpor_gpu_memory_byte_seconds_total{function="f",stage="starting"}': 6 * GIB,
        'torpor_gpu_memory_byte_seconds_total{function="f",stage="warm"}': 4 * GIB,
        'torpor_gpu_memory_byte_seconds_total{function="f",stage="hibernating"}': GIB // 2,
        'torpor_instance_stage_seconds_total{function="f",stage="starting"}': 3.0,
        'torpor_starts_total{function="f",kind="booted"}': 2.0,
    }
    assert run.gib_seconds_by_stage(delta) == {"hibernating": 0.5, "starting": 6.0, "warm": 4.0}
    assert run.gib_seconds(delta) == 10.5
    assert run.stage_seconds(delta) == {"starting": 3.0}
    row = {"gpu_memory_gib_s": 10.5, "gpu_memory_gib_s_by_stage": run.gib_seconds_by_stage(delta)}
    assert table.gib_s(row) == "10.5 (6.0 starting)"


def test_a_daemon_without_the_stage_label_or_the_series_still_reads() -> None:
    old = {'torpor_gpu_memory_byte_seconds_total{function="f"}': 2 * GIB}
    assert run.gib_seconds_by_stage(old) == {"all": 2.0}
    assert run.gib_seconds(old) == 2.0
    assert table.gib_s({"gpu_memory_gib_s": 2.0}) == "2.0"
    assert run.gib_seconds({'torpor_starts_total{function="f",kind="warm"}': 1.0}) is None
    assert run.gib_seconds(None) is None
    assert table.gib_s({"gpu_memory_gib_s": None}) == "n/a"


def test_the_sandboxed_copy_runs_as_many_requests_at_once_in_one_sandbox(tmp_path: Path) -> None:
    assert run.sandboxed_scaling({"scaling": {"max_instances": 4, "requests_per_instance": 1}}) == (
        "sandbox = true\nmax_instances = 1\nrequests_per_instance = 4\n"
    )
    assert run.sandboxed_scaling({}).endswith("requests_per_instance = 4\n")
    copy = run.function_copy(ROOT / "examples" / "cpu-mlp", tmp_path / "cpu-mlp", (1.0, 3.0, 15.0), sandbox=True)
    spec = tomllib.loads((copy / "torpor.toml").read_text())
    assert spec["scaling"] == {"sandbox": True, "max_instances": 1, "requests_per_instance": 4}, spec
    assert spec["keepalive"] == {"gpu_release_s": 1.0, "hibernate_s": 3.0, "evict_s": 15.0}, spec
    # The source is hard-linked, not written through.
    assert "sandbox" not in (ROOT / "examples" / "cpu-mlp" / "torpor.toml").read_text()


def test_the_graphed_modes_deploy_the_entry_they_are_given(tmp_path: Path) -> None:
    src = tmp_path / "resnet152"
    shutil.copytree(ROOT / "examples" / "resnet152", src, ignore=shutil.ignore_patterns("weights.*"))
    (src / "weights.safetensors").write_bytes(b"")  # its weights: only their presence is checked here
    copy = run.function_copy(src, tmp_path / "r", None, sandbox=True, entry="model:ResNet152Graphed")
    spec = tomllib.loads((copy / "torpor.toml").read_text())
    assert spec["entry"] == "model:ResNet152Graphed" and spec["scaling"]["sandbox"] is True, spec
    assert tomllib.loads((src / "torpor.toml").read_text())["entry"] == "model:ResNet152"
    assert table.mode_label("sandbox-graphs") == "restore, sandboxed, CUDA graphs"
    assert table.mode_label("restore-graphs") == "restore, CUDA graphs" and table.mode_label("boot") == "boot"


def test_answered_per_second_spans_the_first_send_to_the_last_answer() -> None:
    records = [
        {"status": 200, "latency_s": 0.5, "sent_s": 1.0, "start": "restored"},
        {"status": 200, "latency_s": 0.1, "sent_s": 2.9, "start": "warm"},
        {"status": 502, "latency_s": 0.1, "sent_s": 3.5, "start": "warm"},
    ]
    assert run.summarise(records)["throughput_rps"] == 1.0
    assert run.summarise([])["throughput_rps"] is None


# cpu-mlp's own entry: on a CPU machine a graphed mode deploys it as it is (torpor.graphed would
# capture nothing there); what the run checks is the mode's wiring.
CPU_MLP_ENTRY = tomllib.loads((ROOT / "examples" / "cpu-mlp" / "torpor.toml").read_text())["entry"]


def test_a_sandboxed_replay_against_processes_on_this_machine(torpor_bin: Path, criu_ready: None, tmp_path: Path) -> None:
    out = tmp_path / "serverless.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "serverless" / "run.py"), "--compare", "--function-dir",
         str(ROOT / "examples" / "cpu-mlp"), "--duration", "4", "--patterns", "periodic", "--modes",
         "restore,sandbox,sandbox-graphs", "--graphed-entry", CPU_MLP_ENTRY, "--clients", "2",
         "--out", str(out)],
        capture_output=True, text=True, check=False, timeout=300, env=dict(os.environ, TORPOR_BIN=str(torpor_bin)),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["settings"]["clients"] == 2
    by_mode = {x["mode"]: x for x in doc["results"]}
    assert set(by_mode) == {"restore", "sandbox", "sandbox-graphs"}
    assert doc["settings"]["graphed_entry"] == CPU_MLP_ENTRY
    for x in by_mode.values():
        s = x["summary"]
        assert s["ok"] == s["requests"] > 0 and s["mode_violations"] == 0, s
        assert s["throughput_rps"] and s["throughput_rps"] > 0, s
        assert s["handler_p50_s"] and s["handler_p50_s"] > 0, s
    # Only the sandboxed deploy loads its group into the sandbox.
    assert "load_sandbox" in by_mode["sandbox"]["deploy"]["phases"]
    assert "load_sandbox" not in by_mode["restore"]["deploy"]["phases"]
    assert "| restore, sandboxed |" in table.render(doc)
    assert "| restore, sandboxed, CUDA graphs |" in table.render(doc)
    # A graphed mode without the entry it deploys is refused before any daemon starts.
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "serverless" / "run.py"), "--compare", "--function-dir",
         str(ROOT / "examples" / "cpu-mlp"), "--modes", "sandbox-graphs", "--out", str(tmp_path / "no.json")],
        capture_output=True, text=True, check=False, timeout=60, env=dict(os.environ, TORPOR_BIN=str(torpor_bin)),
    )
    assert r.returncode != 0 and "mode sandbox-graphs needs --graphed-entry" in r.stderr, r.stderr


@pytest.mark.parametrize(
    "name",
    [
        "serverless-sandbox-h100.json", "serverless-sandbox-s35-before-h200.json", "serverless-sandbox-s35-h100.json",
        "serverless-graphs-s36-a-h100.json", "serverless-graphs-s36-b-h100.json", "serverless-graphs-s37-h100.json",
    ],
)
def test_the_docs_quote_the_sandbox_runs_as_the_table_renders_them(name: str) -> None:
    doc = json.loads((ROOT / "bench" / "results" / name).read_text())
    assert table.render(doc) in (ROOT / "docs" / "sandboxes.md").read_text()


def test_clients_superpose_independent_traces_of_one_shape() -> None:
    traces = load("traces")
    one = traces.generate("bursty", 30.0, 5)
    assert traces.superposed("bursty", 30.0, 5, 1) == one
    three = traces.superposed("bursty", 30.0, 5, 3)
    parts = [traces.generate("bursty", 30.0, s).arrivals_s for s in (5, 6, 7)]
    assert three.arrivals_s == sorted(t for p in parts for t in p)
    assert three.params["clients"] == 3 and three.duration_s == 30.0
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "serverless" / "run.py"), "--compare", "--function-dir",
         str(ROOT / "examples" / "cpu-mlp"), "--clients", "0"],
        capture_output=True, text=True, check=False, timeout=60,
    )
    assert r.returncode == 1 and "--clients must be at least 1" in r.stderr.strip().splitlines()[-1], r.stderr


@pytest.mark.parametrize(
    ("listing", "dirty"),
    [(" M crates/torpord/src/runtime/keepalive.rs\n", True), ("", False), ("1", True), ("false", False)],
)
def test_the_machine_reads_the_carried_git_status_as_dirty_or_clean(
    monkeypatch: pytest.MonkeyPatch, listing: str, dirty: bool
) -> None:
    # What `make gpu-carry` writes to .gpu/dirty (`git status --porcelain`), as gpu-run.sh passes it.
    monkeypatch.setenv("TORPOR_COMMIT", "0" * 40)
    monkeypatch.setenv("TORPOR_DIRTY", listing)
    assert run.machine(Path("/bin/true"))["torpor_dirty"] is dirty
