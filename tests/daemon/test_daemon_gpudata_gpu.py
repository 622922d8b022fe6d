"""Platform-managed GPU data on the GPU (docs/sandboxes.md, "Platform-managed GPU data"): a
function declares its weights `device = "cuda"`; torpord fills GPU memory with the file through
the fair PCIe scheduler while the worker starts, the worker maps it, and
torpor.load(name, device="cuda") is a tensor on that memory (no copy of the function's own),
which a module's weights may view without weight packing copying them.
Skipped without PyTorch and a CUDA device."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import pytest

from .conftest import Torpord
from .test_daemon_placement import two_at_once
from .test_daemon_migrate_gpu import gpus

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch")

MODEL = '''
import torch
import torpor


@torpor.function
class F:
    def setup(self) -> None:
        self.raw = torpor.load("w", device="cuda")
        self.w = self.raw.view(torch.float32)
        self.ptr = self.raw.data_ptr()
        # A module's weight over the data, as torpor.assign makes them: weight packing
        # (torpor.pack) must leave it there, not copy it into an allocator segment.
        self.net = torch.nn.Module()
        self.net.weight = torch.nn.Parameter(self.w, requires_grad=False)

    def __call__(self, request):
        again = torpor.load("w", device="cuda") if request.get("again") else self.raw
        return {
            "sum": float(self.w.sum()),
            "n": int(self.w.numel()),
            "device": str(self.raw.device),
            "same_memory": again.data_ptr() == self.ptr,
            "weight_in_data": self.net.weight.data_ptr() == self.ptr,
            "first": [float(x) for x in self.w[:4].tolist()],
        }
'''


def write(tmp_path: Path, n: int, name: str = "gpudata", mod: int = 7, extra: str = "") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "model.py").write_text(MODEL)
    (d / "w.bin").write_bytes(struct.pack(f"<{n}f", *[float(i % mod) for i in range(n)]))
    (d / "torpor.toml").write_text(
        f'name = "{name}"\nentry = "model:F"\npreload = ["torch"]\ngpus = 1\ngpu_memory = "1GiB"\n'
        'load_timeout_s = 300\n' + extra + '[[data]]\nname = "w"\npath = "w.bin"\ndevice = "cuda"\n'
        + ("[scaling]\nsandbox = true\n" if extra else "")
    )
    return d


def test_declared_weights_arrive_as_platform_filled_gpu_memory(cuda: None, torpord: Torpord, tmp_path: Path) -> None:
    n = 3 << 20  # 12 MiB of float32: not a multiple of nothing in particular, padded by torpord
    d = write(tmp_path, n)
    lines = torpord.deploy(d)
    assert any(line.get("phase") == "load" for line in lines), lines
    want = float(sum(i % 7 for i in range(n)))
    for _ in range(2):  # the deploy's instance or a restored one: the data is a segment by then
        a = torpord.invoke("gpudata", {"again": True})
        assert a.status == 200, (a.status, a.body, torpord.log_text())
        v = a.json()
        assert v["device"].startswith("cuda") and v["n"] == n, v
        assert v["sum"] == want and v["first"] == [0.0, 1.0, 2.0, 3.0], v
        assert v["same_memory"] is True and v["weight_in_data"] is True, v
    metrics = torpord.request("GET", "/metrics").body.decode()
    assert 'torpor_pcie_bytes_total{device="cuda0"}' in metrics, metrics[-2000:]


def test_two_functions_of_a_sandbox_each_get_their_own_gpu_weights(cuda: None, torpord: Torpord, tmp_path: Path) -> None:
    """Two sandboxed functions of one tenant declare weights under one name with different
    values: the second's deploy fills the first's for its load beside it, and after a cold
    start of the sandbox each function computes on its own weights, in one process."""
    n = 1 << 20
    tenant = 'tenant = "team-gd"\n'
    torpord.deploy(write(tmp_path, n, "sbgd-a", 7, tenant))
    torpord.deploy(write(tmp_path, n, "sbgd-b", 5, tenant))
    for name, mod in (("sbgd-a", 7), ("sbgd-b", 5)):
        r = torpord.invoke(name, {"again": True})
        assert r.status == 200, (name, r.status, r.body, torpord.log_text())
        v = r.json()
        assert v["device"].startswith("cuda") and v["same_memory"] is True, v
        assert v["sum"] == float(sum(i % mod for i in range(n))), (name, v)
    (inst,) = torpord.instances("sbgd-b") or torpord.instances("sbgd-a")
    assert inst["function"] == "sbgd-b", inst


LATE = '''
import time

import torch
import torpor


@torpor.function
class F:
    def setup(self) -> None:
        pass

    def __call__(self, request):
        time.sleep(float(request.get("sleep", 0)))
        # The view made now, in the instance as restored (on whichever GPU it was placed).
        w = torpor.load("w", device="cuda").view(torch.float32)
        return {"sum": float(w.sum()), "n": int(w.numel()), "device": str(w.device)}
'''


def test_weights_first_loaded_in_a_request_work_on_every_gpu_of_the_node(
    cuda: None, torpord: Torpord, tmp_path: Path
) -> None:
    """Two instances at once on a node of two GPUs, one restored onto GPU 1 (the driver's pairs
    swap it under the process's cuda:0): each makes its tensor over the data in a request, and
    it is on its cuda:0 where the memory is mapped, not on cuda:1 where the driver places the
    pointer in such a process (torpor.dlpack)."""
    g = gpus()
    if len(g) < 2 or g[0][0] != g[1][0]:
        pytest.skip(f"needs two GPUs of one model (nvidia-h200-x2); nvidia-smi lists {g}")
    n = 1 << 20
    d = tmp_path / "gdlate"
    d.mkdir()
    (d / "model.py").write_text(LATE)
    (d / "w.bin").write_bytes(struct.pack(f"<{n}f", *[float(i % 3) for i in range(n)]))
    (d / "torpor.toml").write_text(
        'name = "gdlate"\nentry = "model:F"\npreload = ["torch"]\ngpus = 1\ngpu_memory = "1GiB"\n'
        'load_timeout_s = 300\n[scaling]\nmax_instances = 2\n'
        '[[data]]\nname = "w"\npath = "w.bin"\ndevice = "cuda"\n'
    )
    torpord.deploy(d)
    answers = two_at_once(torpord, "gdlate", {"sleep": 2}, stagger_s=0.3, timeout=300)
    want = float(sum(i % 3 for i in range(n)))
    for a in answers:
        assert a.status == 200, (a.status, a.body, torpord.log_text()[-4000:])
        assert a.json() == {"sum": want, "n": n, "device": "cuda:0"}, a.body
    assert sorted(int(i["device"]) for i in torpord.instances("gdlate")) == [0, 1], torpord.instances("gdlate")
