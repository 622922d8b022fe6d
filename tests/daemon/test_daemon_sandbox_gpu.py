"""Sandboxes on the GPU (issue 11; docs/sandboxes.md): examples/vision-workflow's GPU variant
(torch on CUDA, made by its make_weights.py --gpu) deployed through the real daemon: its three
stages share one sandbox (one CUDA context, a stream per request thread) and hand CUDA tensors
to each other through the store; the answer equals the NumPy variant's on the CPU. Skipped
without PyTorch and a CUDA device."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import Torpord

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch")

ROOT = Path(__file__).resolve().parents[2]
VISION = ROOT / "examples" / "vision-workflow"

# The three stages run in this process with the NumPy backend: the expected answer.
EXPECTED = """
import importlib, json, sys
from pathlib import Path
import torpor
out = None
value = {"seed": 3, "request": "expected"}
for stage in ("detect", "classify", "describe"):
    d = Path(sys.argv[1]) / stage
    torpor.use_dir(d)
    sys.path.insert(0, str(d))
    for m in ("model", "common"):
        sys.modules.pop(m, None)
    mod = importlib.import_module("model")
    cls = next(v for v in vars(mod).values() if getattr(v, "__torpor_function__", False))
    f = cls()
    f.setup()
    sys.path.pop(0)
    value = f(value)
print(json.dumps(value))
"""


def test_the_gpu_vision_workflow_runs_in_one_sandbox_and_matches_the_cpu(cuda: None, torpord: Torpord, tmp_path: Path) -> None:
    gpu = tmp_path / "vision-gpu"
    subprocess.run([sys.executable, VISION / "make_weights.py", "--gpu", gpu], check=True, timeout=120)
    env = dict(os.environ, VISION_WORKFLOW_BACKEND="numpy", PYTHONPATH=str(ROOT / "python"))
    r = subprocess.run([sys.executable, "-c", EXPECTED, VISION], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    expected = json.loads(r.stdout)
    for stage in ("detect", "classify", "describe"):
        lines = torpord.deploy(gpu / stage)
        assert any(line.get("phase") == "load" for line in lines), lines
    r = torpord.cli("deploy", "--json", gpu)
    assert r.returncode == 0 and json.loads(r.stdout)["one_sandbox"] is True, (r.stdout, r.stderr)
    a = torpord.request("POST", "/v1/workflows/vision-text/invoke", {"seed": 3, "request": "gpu"})
    assert a.status == 200, (a.status, a.body, torpord.log_text())
    got = a.json()
    assert a.timings["sandbox"] == 1.0
    assert got["caption"] == expected["caption"] and got["topic"] == expected["topic"], (got, expected)
    assert got["boxes"] == expected["boxes"]
    for t, p in expected["scores"].items():
        assert math.isclose(got["scores"][t], p, abs_tol=2e-3), (got["scores"], expected["scores"])
    # Warm: the same sandbox answers again.
    again = torpord.request("POST", "/v1/workflows/vision-text/invoke", {"seed": 3})
    assert again.status == 200 and again.json()["caption"] == expected["caption"]


VISION_BERT = ROOT / "examples" / "vision-bert"


def test_the_vision_bert_workflow_answers_in_one_sandbox_as_its_stages_do_alone(
    cuda: None, torpord: Torpord, tmp_path: Path
) -> None:
    """examples/vision-bert, real models on the GPU: Faster R-CNN (MobileNetV3 320 FPN) →
    ResNet-50 on its crops → a BERT-base text classifier on the labels' caption, weights made by
    its make_weights.py. Deployed stage by stage, then as a workflow: one sandbox, the crops (a
    CUDA tensor) handed through the store, and the answer the stages give run one after the
    other in one process without torpord (run_local.py)."""
    pytest.importorskip("torchvision")
    pytest.importorskip("transformers")
    d = tmp_path / "vision-bert"
    shutil.copytree(VISION_BERT, d, ignore=shutil.ignore_patterns("__pycache__", "weights.safetensors", "vocab.txt"))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    subprocess.run([sys.executable, d / "make_weights.py"], check=True, timeout=600, env=env)
    r = subprocess.run(
        [sys.executable, d / "run_local.py", '{"seed": 3, "request": "local"}'],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert r.returncode == 0, r.stderr
    expected = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(expected["labels"]) == 4 and expected["topic"] in expected["scores"], expected
    for stage in ("detect", "classify", "describe"):
        lines = torpord.deploy(d / stage)
        assert any(line.get("phase") == "load" for line in lines), lines
    # The last deploy's sandbox holds all three: its own weights packed at its load, and the
    # two stages loaded beside it after its warm-up packed too, beside its request pool (until
    # session 48 they were refused for it, so their weights were never shared read-only).
    phases = {line["phase"]: line for line in lines if "phase" in line}
    assert phases["load"].get("packed", {}).get("whole") is True, phases["load"]
    members = phases["load_sandbox"]
    assert sorted(members["packed"]) == ["vision-bert-classify", "vision-bert-detect"], members
    assert all(p["whole"] and p["bytes"] > 0 for p in members["packed"].values()), members
    r = torpord.cli("deploy", "--json", d)
    assert r.returncode == 0 and json.loads(r.stdout)["one_sandbox"] is True, (r.stdout, r.stderr)
    for rid in ("first", "again"):
        a = torpord.request("POST", "/v1/workflows/vision-bert/invoke", {"seed": 3, "request": rid})
        assert a.status == 200, (a.status, a.body, torpord.log_text())
        got = a.json()
        assert a.timings["sandbox"] == 1.0, a.timings
        assert got["request"] == rid
        for key in ("caption", "topic", "labels", "objects", "tokens"):
            assert got[key] == expected[key], (key, got, expected)
        for box, want in zip(got["boxes"], expected["boxes"], strict=True):
            assert all(math.isclose(a_, b_, abs_tol=0.011) for a_, b_ in zip(box, want, strict=True)), (got["boxes"], expected["boxes"])
        for t, p in expected["scores"].items():
            assert math.isclose(got["scores"][t], p, abs_tol=1e-4), (got["scores"], expected["scores"])
    # Another image, another answer: the stages compute on what they are given.
    other = torpord.request("POST", "/v1/workflows/vision-bert/invoke", {"seed": 4})
    assert other.status == 200 and other.json()["boxes"] != expected["boxes"], other.body


GPU_MEMORY_FN = '''
import time
import torch
import torpor

@torpor.function
class Hold:
    def setup(self) -> None:
        self.weights = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")  # 64 MiB, resident

    def __call__(self, request):
        held = torch.empty(int(request["mib"]) << 20, dtype=torch.uint8, device="cuda").fill_(1)
        time.sleep(float(request.get("s", 0)))
        return {"sum": int(held[:: 1 << 20].sum().item())}
'''


def hold_function(
    root: Path, name: str, warmup_mib: int, sandbox_memory: str, tenant: str | None = None, extra: str = "",
    tail: str = "",
) -> Path:
    """GPU_MEMORY_FN deployed as `name`: sandboxed, one sandbox of 4 request threads."""
    d = root / name
    d.mkdir()
    (d / "hold.py").write_text(GPU_MEMORY_FN)
    (d / "torpor.toml").write_text(
        f'name = "{name}"\ntenant = "{tenant or name}"\nentry = "hold:Hold"\npreload = ["torch"]\ngpus = 1\n'
        f'gpu_memory = "2GiB"\n{extra}[warmup]\nrequest = {{ mib = {warmup_mib} }}\n[scaling]\nmax_instances = 1\n'
        f'requests_per_instance = 4\nsandbox = true\nsandbox_memory = "{sandbox_memory}"\n{tail}'
    )
    return d


def test_requests_of_one_torch_function_run_at_once_in_its_sandbox(
    cuda: None, torpor_bin: Path, criu_ready: None, tmp_path: Path
) -> None:
    """Four requests of one PyTorch function at once in its sandbox all answer, side by side. In
    session 34 three of four such requests of a sandboxed ResNet-152 were never answered: every
    request of a function allocated through the function's one torch.cuda.MemPool, which PyTorch
    lets one thread at a time use, and the harness left a request unanswered when its pool raised
    (bench/results/serverless-sandbox-h100.json; now a pool per running request)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    d = hold_function(tmp_path, "gpu-many", warmup_mib=16, sandbox_memory="4GiB", extra="timeout_s = 20\n")
    torpord = Torpord(torpor_bin, tmp_path / "daemon", queue_timeout_s=30)
    try:
        torpord.deploy(d)
        assert torpord.invoke("gpu-many", {"mib": 16}).status == 200
        with ThreadPoolExecutor(4) as pool:
            t0 = time.monotonic()
            answers = list(pool.map(lambda i: torpord.invoke("gpu-many", {"mib": 64, "s": 2}), range(4)))
            took = time.monotonic() - t0
        assert [a.status for a in answers] == [200] * 4, [(a.status, a.body[:300]) for a in answers]
        assert all(a.json() == {"sum": 64} for a in answers)
        # Side by side in one sandbox, not one after another.
        assert took < 6, took
        assert len({i["id"] for i in torpord.instances("gpu-many")}) == 1
    finally:
        torpord.stop()


def test_the_cuda_memory_pool_measures_admits_and_gives_back(
    cuda: None, torpor_bin: Path, criu_ready: None, tmp_path: Path
) -> None:
    """torpor.mempool's CUDA backend (torch.cuda.MemPools of the function's own) through the daemon:
    the model from the warm-up, the pool after a request, given back at idle, and a second
    request that does not fit beside the first waiting for it (docs/sandboxes.md, "The memory
    pool")."""
    d = hold_function(
        tmp_path, "gpu-hold", warmup_mib=512, sandbox_memory="1GiB", tenant="gpu-mem",
        tail="[keepalive]\nmemory_release_s = 1\n",
    )
    # Its own daemon: the second request waits in the queue for the first one's memory (2 s),
    # longer than the shared daemon's queue timeout.
    torpord = Torpord(torpor_bin, tmp_path / "daemon", queue_timeout_s=20)
    try:
        memory_pool_case(torpord, d)
    finally:
        torpord.stop()


def memory_pool_case(torpord: Torpord, d: Path) -> None:
    import re
    import time
    from concurrent.futures import ThreadPoolExecutor

    lines = torpord.deploy(d)
    memory = next(line for line in lines if line.get("phase") == "load")["memory"]
    assert memory["backend"] == "cuda", memory
    assert memory["resident"] >= 64 << 20 and memory["request_peak"] >= 512 << 20, memory

    def pool_bytes() -> int:
        text = torpord.request("GET", "/metrics").body.decode()
        found = [int(float(m.group(1))) for m in re.finditer(
            r'^torpor_sandbox_memory_bytes\{[^}]*function="gpu-hold"[^}]*kind="pool"[^}]*\} (\S+)$', text, re.M)]
        return max(found, default=0)

    # Restored first, so that the wait below is the memory pool's admission, not the restore.
    warm = torpord.invoke("gpu-hold", {"mib": 16})
    assert warm.status == 200 and warm.json() == {"sum": 16}, (warm.status, warm.body)
    with ThreadPoolExecutor(2) as pool:
        t0 = time.monotonic()
        first = pool.submit(torpord.invoke, "gpu-hold", {"mib": 512, "s": 2})
        time.sleep(0.5)
        second = torpord.invoke("gpu-hold", {"mib": 512})
        took = time.monotonic() - t0
        assert first.result().status == 200 and second.status == 200, (first.result().body, second.body)
    # 64 MiB + 2 × 512 MiB is over the 1 GiB sandbox: the second waited for the first.
    assert took >= 2.0, took
    assert pool_bytes() >= 512 << 20
    deadline = time.monotonic() + 15
    while pool_bytes() > 0:
        assert time.monotonic() < deadline, pool_bytes()
        time.sleep(0.2)


def test_one_function_s_idle_release_waits_for_another_s_request_to_leave_its_pool(
    cuda: None, torpor_bin: Path, criu_ready: None, tmp_path: Path
) -> None:
    """Two functions in one sandbox: A's pool goes idle (memory_release_s) while B's request
    allocates through B's pool. Emptying a pool then aborts the worker (PyTorch's
    `captures_underway.empty()` assert, found in session 36), which failed B's request with 502;
    now A's release waits until no request is in a pool (torpor.mempool.GATE), then runs."""
    import re
    import threading
    import time

    a = hold_function(tmp_path, "gate-a", warmup_mib=16, sandbox_memory="4GiB", tenant="gate",
                      tail="[keepalive]\nmemory_release_s = 0.5\n")
    b = hold_function(tmp_path, "gate-b", warmup_mib=16, sandbox_memory="4GiB", tenant="gate")
    torpord = Torpord(torpor_bin, tmp_path / "daemon", queue_timeout_s=30)

    def pool_bytes(name: str) -> int:
        text = torpord.request("GET", "/metrics").body.decode()
        found = [int(float(m.group(1))) for m in re.finditer(
            rf'^torpor_sandbox_memory_bytes{{[^}}]*function="{name}"[^}}]*kind="pool"[^}}]*}} (\S+)$', text, re.M)]
        return max(found, default=0)

    try:
        torpord.deploy(a)
        lines = torpord.deploy(b)
        assert any(line.get("phase") == "load_sandbox" for line in lines), lines
        first = torpord.invoke("gate-a", {"mib": 64})
        assert first.status == 200 and first.json() == {"sum": 64}, (first.status, first.body)
        out: dict[str, object] = {}
        long = threading.Thread(target=lambda: out.update(b=torpord.invoke("gate-b", {"mib": 16, "s": 4})))
        long.start()
        time.sleep(2.0)  # A idle past its 0.5 s, B's request in its pool throughout
        assert pool_bytes("gate-a") >= 64 << 20, "A's pool was emptied while B's request ran"
        long.join(60)
        got = out["b"]
        assert got.status == 200 and got.json() == {"sum": 16}, (got.status, got.body, torpord.log_text())  # type: ignore[attr-defined]
        deadline = time.monotonic() + 15
        while pool_bytes("gate-a") > 0:
            assert time.monotonic() < deadline, (pool_bytes("gate-a"), torpord.log_text())
            time.sleep(0.2)
        again = torpord.invoke("gate-a", {"mib": 8})
        assert again.status == 200 and again.start == "warm", (again.status, again.start, again.body)
    finally:
        torpord.stop()


def test_a_gpu_function_s_first_start_loads_into_a_ready_sandbox(
    cuda: None, torpor_bin: Path, criu_ready: None, tmp_path: Path
) -> None:
    """The live-context pool on the GPU (docs/sandboxes.md, "The live-context pool"): a ready
    sandbox (torch imported, CUDA context warm) takes a GPU function's first start; its answer
    is right, and how long it took is in the timings (bench/sandbox/run.py measures it against
    a cold restore)."""
    import re
    import time

    daemon = Torpord(torpor_bin, tmp_path / "pool-daemon", config="[sandbox_pool]\nsize = 1\n")
    try:
        d = tmp_path / "gpu-pooled"
        d.mkdir()
        (d / "hold.py").write_text(GPU_MEMORY_FN)
        (d / "torpor.toml").write_text(
            'name = "gpu-pooled"\ntenant = "gpu-pool"\nentry = "hold:Hold"\npreload = ["torch"]\ngpus = 1\n'
            'gpu_memory = "1GiB"\n[warmup]\nrequest = { mib = 16 }\n[scaling]\nsandbox = true\n'
        )
        daemon.deploy(d)
        deadline = time.monotonic() + 120
        while not re.search(
            r'^torpor_sandbox_pool_ready\{tenant="gpu-pool"\} 1$',
            daemon.request("GET", "/metrics").body.decode(),
            re.M,
        ):
            assert time.monotonic() < deadline, daemon.log_text()
            time.sleep(0.2)
        # The ready sandbox loaded the kernels common requests use before it was counted ready.
        warmed = re.search(r"a ready sandbox launched and warmed.*", daemon.log_text())
        runs = re.search(r"warm_requests=(\d+)", warmed.group(0) if warmed else "")
        assert runs and int(runs.group(1)) > 0, daemon.log_text()
        a = daemon.invoke("gpu-pooled", {"mib": 16})
        assert a.status == 200 and a.start == "pooled", (a.status, a.start, a.body, daemon.log_text())
        assert a.json() == {"sum": 16}, a.body
        print("pooled GPU start:", a.timings)
    finally:
        daemon.stop()


GRAPHED_FN = '''
import hashlib
import torch
import torpor


@torpor.function
class Graphed:
    def setup(self) -> None:
        torch.manual_seed(0)
        nn = torch.nn
        self.eager = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(32, 10),
        ).cuda().eval()
        self.model = torpor.graphed(self.eager, torch.zeros(2, 3, 32, 32, device="cuda"), instances=2)

    def __call__(self, request):
        gen = torch.Generator().manual_seed(int(request["seed"]))
        x = torch.randn(int(request.get("batch", 2)), 3, 32, 32, generator=gen).cuda()
        y = self.model(x)
        with torch.inference_mode():
            same = torch.equal(y, self.eager(x))
        return {"digest": hashlib.sha256(y.cpu().numpy().tobytes()).hexdigest(), "same": same,
                "stats": self.model.stats()}
'''


@pytest.mark.parametrize("path", ["split", "transparent"])
def test_a_graphed_function_replays_in_its_sandbox_after_a_gpu_release_and_a_hibernation(
    cuda: None, torpor_bin: Path, criu_ready: None, tmp_path: Path, path: str
) -> None:
    """torpor.graphed (docs/sandboxes.md, "CUDA graphs") through torpord: the graphs captured in
    setup() are in the function snapshot; restored, released in place and resumed, hibernated and
    woken, the sandbox's replays equal its eager model bit for bit, requests at once included,
    and a shape not captured runs eager."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    d = tmp_path / "graphed"
    d.mkdir()
    (d / "model.py").write_text(GRAPHED_FN)
    (d / "torpor.toml").write_text(
        'name = "graphed"\ntenant = "graphs"\nentry = "model:Graphed"\npreload = ["torch"]\ngpus = 1\n'
        'gpu_memory = "1GiB"\n[warmup]\nrequest = { seed = 0 }\n[scaling]\nsandbox = true\nmax_instances = 1\n'
        "requests_per_instance = 4\n[keepalive]\ngpu_release_s = 2\nhibernate_s = 6\nevict_s = 600\n"
    )
    config = "split_gpu = false\n" if path == "transparent" else ""
    torpord = Torpord(torpor_bin, tmp_path / "daemon", config=config, queue_timeout_s=30)

    def stage_is(stage: str) -> None:
        deadline = time.monotonic() + 60
        while [i["stage"] for i in torpord.instances("graphed")] != [stage]:
            assert time.monotonic() < deadline, (torpord.instances("graphed"), torpord.log_text())
            time.sleep(0.05)

    def replays(seed: int, batch: int = 2) -> tuple[str, int, int]:
        a = torpord.invoke("graphed", {"seed": seed, "batch": batch}, timeout=180)
        assert a.status == 200, (a.status, a.body, torpord.log_text())
        out = a.json()
        assert out["same"] is True, out
        return out["digest"], out["stats"]["replays"], out["stats"]["eager"]

    try:
        lines = torpord.deploy(d)
        snap = next(line for line in lines if line.get("phase") == "snapshot_function")
        assert snap["split"] is (path == "split"), snap
        first, n, eager = replays(1)
        with ThreadPoolExecutor(4) as pool:
            at_once = list(pool.map(lambda s: replays(s), [1, 2, 3, 1]))
        assert at_once[0][0] == at_once[3][0] == first and len({a[0] for a in at_once}) == 3, at_once
        assert max(a[1] for a in at_once) == n + 4, at_once
        _, n2, eager2 = replays(4, batch=3)
        assert eager2 == eager + 1 and n2 == n + 4, (n, n2, eager, eager2)
        stage_is("gpu_released")
        assert replays(1)[0] == first
        stage_is("gpu_released")
        stage_is("hibernated")
        woken, n3, _ = replays(1)
        assert woken == first and n3 > n2, (n2, n3)
        assert "cannot resume the GPU" not in torpord.log_text()
    finally:
        torpord.stop()
