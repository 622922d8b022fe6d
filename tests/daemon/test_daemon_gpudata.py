"""Platform-managed GPU data (docs/sandboxes.md, "Platform-managed GPU data") through the real
daemon, real workers and real CRIU, with tests/fakes as the GPU (the fake driver's VMM memory
is memfd memory, so the daemon's cuda backend, the hook and the worker run their real code on
it): a gpus = 1 function declares `device = "cuda"` data; torpord fills GPU memory with the file
through the PCIe scheduler of cuda0 while the worker starts, the worker maps it into a segment
before setup(), the function reads the bytes at that address, and a restored instance has them
too (the segment comes back from the restore server)."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FakeCuda

from .conftest import Torpord, fake_gpu_env

READER = '''
import ctypes
import torpor
from torpor import data


@torpor.function
class F:
    def setup(self) -> None:
        self.g = data.gpu_data("w")

    def __call__(self, request: dict) -> dict:
        # The fake driver's device memory is host memory: read it where it is mapped.
        return {"data": ctypes.string_at(self.g.va, self.g.size).hex(), "va": self.g.va,
                "padded": self.g.padded, "pid": __import__("os").getpid()}
'''

PAYLOAD = bytes(range(256)) * 40  # 10 KiB: padded to the fake GPU's 2 MiB granularity


@pytest.fixture
def daemon(torpor_bin: Path, criu_ready: None, fake_cuda: FakeCuda, tmp_path: Path) -> Iterator[Torpord]:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    root = tmp_path / "daemon"
    root.mkdir()
    env = fake_gpu_env(root, fake_cuda, FAKE_NVML_PROCS_MATCH=f"torpor.worker:{64 << 20}")
    d = Torpord(torpor_bin, root, env=env)
    try:
        yield d
    finally:
        d.stop()


def pcie_bytes(d: Torpord, device: str) -> int:
    text = d.request("GET", "/metrics").body.decode()
    m = re.search(rf'^torpor_pcie_bytes_total{{device="{device}"}} (\S+)$', text, re.MULTILINE)
    return int(float(m.group(1))) if m else 0


def test_declared_cuda_data_is_filled_by_torpord_and_mapped_into_the_worker(daemon: Torpord, tmp_path: Path) -> None:
    fdir = tmp_path / "gpudata"
    fdir.mkdir()
    (fdir / "model.py").write_text(READER)
    (fdir / "w.bin").write_bytes(PAYLOAD)
    (fdir / "torpor.toml").write_text(
        'name = "gpudata"\nentry = "model:F"\ngpus = 1\ngpu_memory = "64MiB"\n'
        '[[data]]\nname = "w"\npath = "w.bin"\ndevice = "cuda"\n'
    )
    lines = daemon.deploy(fdir)
    snap = [x for x in lines if x.get("phase") == "snapshot_function"]
    assert snap and snap[0].get("split") is True, lines
    # The data is a read-only segment of the function snapshot (declared: mapped read-only).
    assert snap[0]["segments"] >= 1 and snap[0]["readonly_segments"] >= 1, snap
    assert pcie_bytes(daemon, "cuda0") >= 2 << 20, "the fill went through cuda0's scheduler"
    a = daemon.invoke("gpudata", {})
    assert a.status == 200 and a.start == "restored", (a.status, a.body, daemon.log_text())
    v = a.json()
    assert bytes.fromhex(v["data"]) == PAYLOAD and v["padded"] == 2 << 20, v


SANDBOXED = "[scaling]\nsandbox = true\n"


def gpu_function(root: Path, name: str, payload: bytes, extra: str = "") -> Path:
    fdir = root / name
    fdir.mkdir()
    (fdir / "model.py").write_text(READER)
    (fdir / "w.bin").write_bytes(payload)
    (fdir / "torpor.toml").write_text(
        f'name = "{name}"\nentry = "model:F"\ntenant = "team-g"\ngpus = 1\ngpu_memory = "64MiB"\n'
        '[[data]]\nname = "w"\npath = "w.bin"\ndevice = "cuda"\n' + extra
    )
    return fdir


def test_each_function_of_a_sandbox_gets_its_own_gpu_data(daemon: Torpord, tmp_path: Path) -> None:
    """Two sandboxed functions of one tenant declare GPU data under the same name with different
    bytes. The second's deploy loads the first into its worker (crate::runtime::sandbox), filling
    the first's data for that load too; a cold start restores the sandbox with both segments, and
    each function reads its own bytes at its own address, in one process."""
    other = bytes(reversed(PAYLOAD)) + b"tail"
    daemon.deploy(gpu_function(tmp_path, "sbg-a", PAYLOAD, SANDBOXED))
    lines = daemon.deploy(gpu_function(tmp_path, "sbg-b", other, SANDBOXED))
    snap = next(x for x in lines if x.get("phase") == "snapshot_function")
    assert snap["readonly_segments"] >= 2, snap  # both functions' data, in the host's snapshot
    a = daemon.invoke("sbg-a", {})
    assert a.status == 200 and a.start == "restored", (a.status, a.body, daemon.log_text())
    b = daemon.invoke("sbg-b", {})
    assert b.status == 200, (b.status, b.body, daemon.log_text())
    va, vb = a.json(), b.json()
    assert bytes.fromhex(va["data"]) == PAYLOAD and bytes.fromhex(vb["data"]) == other, (va, vb)
    assert va["pid"] == vb["pid"] and va["va"] != vb["va"], (va, vb)


def test_a_pooled_sandbox_maps_the_function_s_gpu_data(torpor_bin: Path, criu_ready: None, fake_cuda: FakeCuda, tmp_path: Path) -> None:
    """A sandboxed function's first start on the node loads into a ready sandbox
    (`[sandbox_pool]`): its GPU data is filled and mapped there before its setup()."""
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    root = tmp_path / "daemon"
    root.mkdir()
    env = fake_gpu_env(root, fake_cuda, FAKE_NVML_PROCS_MATCH=f"torpor.worker:{64 << 20}")
    d = Torpord(torpor_bin, root, env=env, config="[sandbox_pool]\nsize = 1\n")
    try:
        d.deploy(gpu_function(tmp_path, "sbg-pooled", PAYLOAD, SANDBOXED))
        deadline = time.monotonic() + 60
        while not re.search(r'^torpor_sandbox_pool_ready\{tenant="team-g"\} 1$', d.request("GET", "/metrics").body.decode(), re.M):
            assert time.monotonic() < deadline, f"no ready sandbox\n{d.log_text()}"
            time.sleep(0.1)
        r = d.invoke("sbg-pooled", {})
        assert r.status == 200 and r.start == "pooled", (r.status, r.start, r.body, d.log_text())
        assert bytes.fromhex(r.json()["data"]) == PAYLOAD, r.body
    finally:
        d.stop()
