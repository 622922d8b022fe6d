"""The communication store's GPU values on a real GPU (docs/sandboxes.md, "The communication
store"): a torch tensor put with shared=True in one sandbox of a tenant arrives bit-identical in
another sandbox of the tenant as a CUDA tensor of its dtype and shape over the daemon's memory,
mapped read-only (a memset through it is refused by the driver and changes nothing, and the
context works on), also once the memory made ahead after a put was filled by the next put of
its size; with two GPUs, a tensor put on GPU 1 reaches a sandbox on GPU 0 by a copy GPU
to GPU (peer access) or through host memory. Skipped without PyTorch and a CUDA device; the
two-GPU case without two. Between nodes: two daemons sharing a bucket of SeaweedFS on loopback
(skipped where `weed` cannot be had), a tensor put with nodes="all" on A arrives bit-identical
on B's GPU through the bucket, once. The fake-GPU twins of these tests are
test_daemon_store_fake_gpu.py and test_daemon_store_nodes.py."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from objstore_server import Seaweed, running_seaweed

from .conftest import FUNCTIONS, Answer, Torpord, two_daemons
from .test_daemon_objstore import BUCKET, objstore_section

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch")


def torch_gpus() -> int:
    r = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"], capture_output=True, text=True, timeout=120, check=False
    )
    return int(r.stdout.strip() or 0)


def make_function(root: Path, name: str, workflow: str) -> Path:
    d = root / name
    shutil.copytree(FUNCTIONS / "store_gpu", d, ignore=shutil.ignore_patterns("__pycache__"))
    text = (d / "torpor.toml").read_text()
    text = text.replace('name = "store_gpu"', f'name = "{name}"\ntenant = "team-g"\nworkflow = "{workflow}"\npreload = ["torch"]')
    (d / "torpor.toml").write_text(text.replace('gpu_memory = "64MiB"', 'gpu_memory = "4GiB"'))
    return d


@pytest.fixture(scope="module")
def deployed(cuda: None, torpord: Torpord, tmp_path_factory: pytest.TempPathFactory) -> Torpord:
    root = tmp_path_factory.mktemp("store-gpu-real")
    for name, workflow in (("sgr-put", "a"), ("sgr-get", "b")):
        torpord.deploy(make_function(root, name, workflow))
    return torpord


@pytest.fixture(scope="module")
def roomy_seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seaweed]:
    """A bucket with room for real PyTorch functions: each deploy pushes its snapshot (a CUDA
    process's image, hundreds of MB), and the other fixture's 256 MB filled up on the H100 before
    the 100 MB value was uploaded (session 26: the store answered the value's PUT with an error)."""
    yield from running_seaweed(tmp_path_factory.mktemp("seaweedfs-gpu"), BUCKET, volumes=16, volume_mb=1024)


def ok(a: Answer, d: Torpord) -> dict[str, Any]:
    assert a.status == 200, (a.status, a.body, d.log_text()[-4000:])
    out: dict[str, Any] = a.json()
    return out


def pcie_bytes(d: Torpord, device: str) -> float:
    text = d.request("GET", "/metrics").body.decode()
    m = re.search(rf'^torpor_pcie_bytes_total{{device="{device}"}} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint8"])
def test_a_tensor_arrives_bit_identical_and_read_only_in_another_sandbox(deployed: Torpord, dtype: str) -> None:
    n = 25_000_000 if dtype == "float32" else 1_000_003  # 100 MB once; an odd size too
    key = f"real/{dtype}"
    p = ok(deployed.invoke("sgr-put", {"op": "put_torch", "key": key, "n": n, "seed": 7, "dtype": dtype}), deployed)
    g = ok(deployed.invoke("sgr-get", {"op": "get_torch", "key": key}), deployed)
    assert g["process"] != p["process"], "another sandbox: another process"
    assert g["type"] == "Tensor" and g["dtype"] == f"torch.{dtype}" and g["shape"] == [n], g
    assert g["device"] == "cuda:0", g
    if torch_gpus() >= 2:
        # Placement spreads the two sandboxes over GPUs 0 and 1: the getter runs restored onto
        # GPU 1 (its cuda:0), where the value came GPU to GPU, and its tensor is on its cuda:0,
        # where the mapping is (torpor.dlpack: __cuda_array_interface__ put it on cuda:1 there).
        assert sorted(devices(deployed, "sgr-put") + devices(deployed, "sgr-get")) == [0, 1]
    assert g["digest"] == p["digest"], "the bytes changed on the way"
    # A write through the read-only mapping fails cleanly: an error code, nothing written, and
    # the context goes on working.
    assert g["memset_rc"] != 0, g
    assert g["digest_after"] == p["digest"]
    assert g["sum"] == g["sum"], "a kernel read the mapping"
    gone = deployed.invoke("sgr-get", {"op": "get_torch", "key": key})
    assert gone.status == 500 and gone.json()["error"]["type"] == "KeyError", gone.body


def devices(d: Torpord, name: str) -> list[int]:
    """The GPUs (the node's ordinals) of `name`'s instances, as the daemon lists them."""
    return [int(i["device"]) for i in d.instances(name)]


def test_a_tensor_put_in_a_sandbox_placed_on_gpu_1_arrives_in_one_on_gpu_0(deployed: Torpord) -> None:
    """The other way round: the putter runs restored onto GPU 1 (its cuda:0), so its copy into
    torpord's memory runs there, and the getter on GPU 0 gets it GPU to GPU."""
    if torch_gpus() < 2:
        pytest.skip("needs two GPUs")
    # Both sandboxes up, sgr-put's first (GPU 0), then sgr-get's (GPU 1).
    ok(deployed.invoke("sgr-put", {"op": "put_torch", "key": "real/warm", "n": 1000, "seed": 1}), deployed)
    ok(deployed.invoke("sgr-get", {"op": "get_torch", "key": "real/warm"}), deployed)
    assert devices(deployed, "sgr-put") == [0] and devices(deployed, "sgr-get") == [1]
    n = 3_000_001
    p = ok(deployed.invoke("sgr-get", {"op": "put_torch", "key": "real/from1", "n": n, "seed": 11}), deployed)
    assert p["device"] == "cuda:0", p
    g = ok(deployed.invoke("sgr-put", {"op": "get_torch", "key": "real/from1"}), deployed)
    assert g["device"] == "cuda:0" and g["shape"] == [n] and g["digest"] == p["digest"], (p, g)
    assert g["memset_rc"] != 0 and g["digest_after"] == p["digest"], g


def spare_bytes(d: Torpord) -> float:
    text = d.request("GET", "/metrics").body.decode()
    m = re.search(r'^torpor_store_gpu_spare_bytes{device="cuda0"} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def test_the_next_put_of_a_size_fills_the_memory_made_ahead_for_it(deployed: Torpord) -> None:
    n = 4_000_000  # 16 MB of float32
    first = ok(deployed.invoke("sgr-put", {"op": "put_torch", "key": "real/s1", "n": n, "seed": 1}), deployed)
    # After the put, memory of its size is made ready on the GPU for the next one.
    deadline = time.monotonic() + 10
    while spare_bytes(deployed) < n * 4:
        assert time.monotonic() < deadline, "no spare was made after the put"
        time.sleep(0.05)
    second = ok(deployed.invoke("sgr-put", {"op": "put_torch", "key": "real/s2", "n": n, "seed": 2}), deployed)
    for key, p in (("real/s1", first), ("real/s2", second)):
        g = ok(deployed.invoke("sgr-get", {"op": "get_torch", "key": key}), deployed)
        assert g["digest"] == p["digest"] and g["memset_rc"] != 0 and g["digest_after"] == p["digest"], (key, g)
    assert first["digest"] != second["digest"]


def test_a_tensor_on_another_gpu_is_copied_gpu_to_gpu(deployed: Torpord) -> None:
    if torch_gpus() < 2:
        pytest.skip("needs two GPUs")
    # The putter's cuda:1 is the node's other GPU than its own; the value goes GPU to GPU when
    # the getter is on another GPU than that one, and is handed over as it is when on the same.
    (put_on,) = devices(deployed, "sgr-put")
    (get_on,) = devices(deployed, "sgr-get")
    before = pcie_bytes(deployed, "cuda0")
    p = ok(deployed.invoke("sgr-put", {"op": "put_torch", "key": "real/peer", "n": 4_000_000, "seed": 9, "device": 1}), deployed)
    assert p["device"] == "cuda:1"
    g = ok(deployed.invoke("sgr-get", {"op": "get_torch", "key": "real/peer"}), deployed)
    assert g["device"] == "cuda:0" and g["digest"] == p["digest"], (p, g)
    print(f"put from GPU {put_on} onto its cuda:1, got on GPU {get_on}")
    r = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.can_device_access_peer(0, 1))"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    if r.stdout.strip() == "True":
        # Peer to peer: no host→device transfer through cuda0's scheduler.
        assert pcie_bytes(deployed, "cuda0") == before
    else:
        assert pcie_bytes(deployed, "cuda0") > before


def test_a_tensor_put_for_every_node_arrives_bit_identical_on_another_nodes_gpu(
    cuda: None,
    torpor_bin: Path,
    criu_ready: None,
    roomy_seaweed: Seaweed,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    seaweed = roomy_seaweed
    roots = (tmp_path_factory.mktemp("store-gpu-node-a"), tmp_path_factory.mktemp("store-gpu-node-b"))
    fns = tmp_path_factory.mktemp("store-gpu-nodes-fns")
    with two_daemons(torpor_bin, roots, (objstore_section(seaweed, roots[0]), objstore_section(seaweed, roots[1]))) as (a, b):
        a.deploy(make_function(fns, "sgn-put", "a"))
        b.deploy(make_function(fns, "sgn-get", "b"))
        n = 25_000_000  # 100 MB of float32
        p = ok(a.invoke("sgn-put", {"op": "put_torch", "key": "nodes/1", "n": n, "seed": 5, "nodes": "all"}), a)
        g = ok(b.invoke("sgn-get", {"op": "get_torch", "key": "nodes/1"}), b)
        assert g["type"] == "Tensor" and g["dtype"] == "torch.float32" and g["shape"] == [n], g
        assert g["device"] == "cuda:0" and g["digest"] == p["digest"], g
        assert g["memset_rc"] != 0 and g["digest_after"] == p["digest"], g
        assert g["sum"] == g["sum"], "a kernel read the mapping"
        # Consumed for every node.
        gone = a.invoke("sgn-put", {"op": "get_torch", "key": "nodes/1"})
        assert gone.status == 500 and gone.json()["error"]["type"] == "KeyError", gone.body
