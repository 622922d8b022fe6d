"""The communication store between nodes (docs/sandboxes.md, "The communication store"): two
torpord daemons on this machine, each with its own state directory, sharing one bucket of a real
SeaweedFS, with sandboxed CPU functions of one tenant on each. A value put with shared=True,
nodes="all" on A is uploaded by A's daemon and got on B (the same bytes; a NumPy array with its
dtype and shape), once: a second get on either node finds nothing, and so do the bucket's
listing and another tenant on B; keep=True leaves it; a get on A consumes the bucket's copy too;
an expired value is not returned;
a put whose upload fails (the bucket unreachable) stores nothing and says so in one line; a daemon without [objstore] refuses nodes="all" in one line.
CUDA values too, with tests/fakes as each daemon's GPU (the fake driver's VMM memory is memfd
memory, so the daemons' copies run their real code): a CUDA value put on A with nodes="all" is
got on B as a CUDA value copied up onto B's GPU (source "bucket"), once; a function without a GPU
on B is refused in one line and the value stays; a get on B whose GPU copy fails consumes
nothing; a get on A maps A's own memory (source "stored") and consumes the bucket's copy.
The tests run in file order and share the daemons."""

from __future__ import annotations

import http.client
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FakeCuda
from objstore_server import Seaweed, free_ports

from .conftest import Answer, Torpord, fake_gpu_env, two_daemons
from .test_daemon_objstore import BUCKET, objstore_section, seaweed  # noqa: F401 (fixture)
from .test_daemon_sandbox import make_function
from .test_daemon_store_fake_gpu import daemon_memory_inodes, pattern
from .test_daemon_store_fake_gpu import make_function as make_gpu_function


def ok(a: Answer) -> dict[str, Any]:
    assert a.status == 200, (a.status, a.body)
    return dict(a.json())


def key_error(a: Answer) -> bool:
    return a.status == 500 and bool(a.json()["error"]["type"] == "KeyError")


def store_objects(sw: Seaweed, tenant: str) -> list[str]:
    """The names of the bucket's store objects of `tenant` (the filer's listing)."""
    c = http.client.HTTPConnection(sw.ip, sw.filer_port, timeout=30)
    try:
        c.request("GET", f"/buckets/{BUCKET}/store/{tenant}/?limit=1000", headers={"Accept": "application/json"})
        r = c.getresponse()
        body = r.read()
    finally:
        c.close()
    if r.status == 404:
        return []
    assert r.status == 200, (r.status, body[:200])
    return sorted(Path(e["FullPath"]).name for e in json.loads(body).get("Entries") or [])


@pytest.fixture(scope="module")
def nodes(
    torpor_bin: Path,
    criu_ready: None,
    seaweed: Seaweed,  # noqa: F811 (the fixture imported above)
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Torpord, Torpord]]:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    roots = (tmp_path_factory.mktemp("store-node-a"), tmp_path_factory.mktemp("store-node-b"))
    fns = tmp_path_factory.mktemp("store-nodes-fns")
    with two_daemons(torpor_bin, roots, (objstore_section(seaweed, roots[0]), objstore_section(seaweed, roots[1]))) as (a, b):
        a.deploy(make_function(fns, "xs-a", "team-a", "put"))
        b.deploy(make_function(fns, "xs-b", "team-a", "get"))
        b.deploy(make_function(fns, "xs-other", "team-b", "get"))
        yield a, b


def test_a_value_put_for_every_node_on_a_is_got_once_on_b(nodes: tuple[Torpord, Torpord], seaweed: Seaweed) -> None:  # noqa: F811
    a, b = nodes
    ok(a.invoke("xs-a", {"op": "share", "key": "frame/1", "array": True, "nodes": "all"}))
    # Uploaded before the put answered: a record and the bytes, neither named by the key.
    objects = store_objects(seaweed, "team-a")
    assert len(objects) == 2 and sum(o.endswith(".json") for o in objects) == 1, objects
    assert not any("frame" in o for o in objects), objects
    # Another tenant on B finds nothing (its prefix is its own), and nothing is consumed.
    assert key_error(b.invoke("xs-other", {"op": "get_shared", "key": "frame/1"}))
    want = [[float(4 * r + c) for c in range(4)] for r in range(3)]
    kept = ok(b.invoke("xs-b", {"op": "get_shared", "key": "frame/1", "keep": True}))
    assert kept["type"] == "ndarray" and kept["value"] == want, kept
    assert kept["dtype"] == "<f4" and kept["shape"] == [3, 4] and kept["writeable"] is False, kept
    got = ok(b.invoke("xs-b", {"op": "get_shared", "key": "frame/1"}))
    assert got["value"] == want and got["dtype"] == "<f4" and got["shape"] == [3, 4], got
    # Consumed for every node: B again, A (which still held its copy), and the bucket.
    assert key_error(b.invoke("xs-b", {"op": "get_shared", "key": "frame/1"}))
    assert key_error(a.invoke("xs-a", {"op": "get_shared", "key": "frame/1"}))
    assert store_objects(seaweed, "team-a") == []


def test_a_get_on_the_putting_node_consumes_the_buckets_copy_too(nodes: tuple[Torpord, Torpord], seaweed: Seaweed) -> None:  # noqa: F811
    a, b = nodes
    ok(a.invoke("xs-a", {"op": "share", "key": "frame/2", "n": 40, "nodes": "all"}))
    assert ok(a.invoke("xs-a", {"op": "get_shared", "key": "frame/2", "keep": True}))["value"] == list(range(40))
    assert ok(a.invoke("xs-a", {"op": "get_shared", "key": "frame/2"}))["value"] == list(range(40))
    assert key_error(b.invoke("xs-b", {"op": "get_shared", "key": "frame/2"}))
    assert store_objects(seaweed, "team-a") == []
    # A value put without nodes stays A's: B does not find it, A still does.
    ok(a.invoke("xs-a", {"op": "share", "key": "frame/3", "n": 8}))
    assert key_error(b.invoke("xs-b", {"op": "get_shared", "key": "frame/3"}))
    assert ok(a.invoke("xs-a", {"op": "get_shared", "key": "frame/3"}))["value"] == list(range(8))


def test_an_expired_value_is_not_returned_and_its_objects_go(nodes: tuple[Torpord, Torpord], seaweed: Seaweed) -> None:  # noqa: F811
    a, b = nodes
    ok(a.invoke("xs-a", {"op": "share", "key": "frame/4", "n": 8, "nodes": "all", "ttl_s": 1}))
    assert len(store_objects(seaweed, "team-a")) == 2
    time.sleep(1.5)
    assert key_error(b.invoke("xs-b", {"op": "get_shared", "key": "frame/4"}))
    # Seen expired by B: deleted.
    assert store_objects(seaweed, "team-a") == []


def test_a_second_put_replaces_the_value_for_every_node_and_leaves_no_old_bytes(nodes: tuple[Torpord, Torpord], seaweed: Seaweed) -> None:  # noqa: F811
    a, b = nodes
    ok(a.invoke("xs-a", {"op": "share", "key": "frame/5", "n": 4, "nodes": "all"}))
    ok(b.invoke("xs-b", {"op": "share", "key": "frame/5", "n": 6, "nodes": "all"}))
    assert len(store_objects(seaweed, "team-a")) == 2
    # A held the first value; the bucket says B's replaced it.
    assert ok(a.invoke("xs-a", {"op": "get_shared", "key": "frame/5"}))["value"] == list(range(6))
    assert key_error(b.invoke("xs-b", {"op": "get_shared", "key": "frame/5"}))
    assert store_objects(seaweed, "team-a") == []


def test_without_objstore_nodes_all_is_refused_in_one_line(torpor_bin: Path, criu_ready: None, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    d = Torpord(torpor_bin, tmp_path / "plain")
    try:
        d.deploy(make_function(tmp_path, "xs-plain", "team-a", "put"))
        a = d.invoke("xs-plain", {"op": "share", "key": "frame/6", "nodes": "all"})
        assert a.status == 500, a.body
        message = a.json()["error"]["message"]
        assert "configure [objstore]" in message and "\n" not in message, message
        # Nothing was stored: the key keeps what it held (nothing).
        assert key_error(d.invoke("xs-plain", {"op": "get_shared", "key": "frame/6"}))
        bad = d.invoke("xs-plain", {"op": "share", "key": "frame/6", "nodes": "some"})
        assert bad.status == 500 and 'nodes is None (this node) or "all"' in bad.json()["error"]["message"], bad.body
    finally:
        d.stop()


def test_a_put_whose_upload_fails_stores_nothing_and_the_key_keeps_its_value(
    torpor_bin: Path, criu_ready: None, seaweed: Seaweed, tmp_path: Path  # noqa: F811
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    dead = f"http://127.0.0.1:{free_ports(1)[0]}"
    d = Torpord(torpor_bin, tmp_path, config=objstore_section(seaweed, tmp_path, endpoint=dead))
    try:
        d.deploy(make_function(tmp_path, "xs-offline", "team-a", "put"))
        ok(d.invoke("xs-offline", {"op": "share", "key": "frame/7", "n": 5}))
        bad = d.invoke("xs-offline", {"op": "share", "key": "frame/7", "n": 9, "nodes": "all"})
        assert bad.status == 500, bad.body
        message = bad.json()["error"]["message"]
        assert "cannot reach the object store" in message and "the key is unchanged" in message, message
        assert "\n" not in message, message
        # Not stored here either: the key still holds the value put before.
        assert ok(d.invoke("xs-offline", {"op": "get_shared", "key": "frame/7", "keep": True}))["value"] == list(range(5))
        # A miss cannot ask the bucket: the get fails with that line rather than a KeyError.
        miss = d.invoke("xs-offline", {"op": "get_shared", "key": "frame/8"})
        assert miss.status == 500 and "cannot reach the object store" in miss.json()["error"]["message"], miss.body
    finally:
        d.stop()


@pytest.fixture(scope="module")
def gpu_nodes(
    torpor_bin: Path,
    criu_ready: None,
    fake_cuda: FakeCuda,
    seaweed: Seaweed,  # noqa: F811 (the fixture imported above)
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Torpord, Torpord]]:
    """Two daemons with a fake GPU each and the same bucket: sandboxed gpus = 1 functions of
    team-g on both, and one without a GPU on B."""
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    roots = (tmp_path_factory.mktemp("gpu-node-a"), tmp_path_factory.mktemp("gpu-node-b"))
    fns = tmp_path_factory.mktemp("gpu-nodes-fns")
    match = f"torpor.worker:{64 << 20}"
    envs = (fake_gpu_env(roots[0], fake_cuda, FAKE_NVML_PROCS_MATCH=match), fake_gpu_env(roots[1], fake_cuda, FAKE_NVML_PROCS_MATCH=match))
    # No spares: the tests count each daemon's GPU memory one value at a time.
    no_spare = "\n[store]\ngpu_spare = false\n"
    configs = (objstore_section(seaweed, roots[0]) + no_spare, objstore_section(seaweed, roots[1]) + no_spare)
    with two_daemons(torpor_bin, roots, configs, envs) as (a, b):
        a.deploy(make_gpu_function(fns, "xg-a", "team-g", "a"))
        b.deploy(make_gpu_function(fns, "xg-b", "team-g", "b"))
        b.deploy(make_gpu_function(fns, "xg-cpu", "team-g", "c", gpu=False))
        yield a, b


def gpu_put(d: Torpord, fn: str, key: str, n: int, seed: int) -> dict[str, Any]:
    return ok(d.invoke(fn, {"op": "put", "key": key, "n": n, "seed": seed, "nodes": "all"}))


def test_a_cuda_value_put_for_every_node_on_a_is_got_once_on_b_s_gpu(gpu_nodes: tuple[Torpord, Torpord], seaweed: Seaweed) -> None:  # noqa: F811
    a, b = gpu_nodes
    before = daemon_memory_inodes(a)
    gpu_put(a, "xg-a", "act/1", 100_000, 3)
    # Uploaded before the put answered, and held in A's daemon's GPU memory as well.
    assert len(store_objects(seaweed, "team-g")) == 2
    held = daemon_memory_inodes(a) - before
    assert len(held) == 1, "A's daemon holds the value's GPU memory"
    # B's function without a GPU: refused in one line, and nothing is consumed.
    cpu = b.invoke("xg-cpu", {"op": "get", "key": "act/1"})
    assert cpu.status == 500, cpu.body
    message = cpu.json()["error"]["message"]
    assert "gpus = 1" in message and "stays stored" in message and "\n" not in message, message
    assert len(store_objects(seaweed, "team-g")) == 2
    # B's GPU function: a CUDA value on its GPU, copied up from the bucket's bytes, read-only.
    kept = ok(b.invoke("xg-b", {"op": "get", "key": "act/1", "keep": True}))
    assert kept["type"] == "CudaArray" and kept["source"] == "bucket", kept
    assert bytes.fromhex(kept["data"]) == pattern(100_000, 3)
    assert kept["interface"]["shape"] == [100_000] and kept["interface"]["typestr"] == "|u1", kept
    assert kept["mapping"]["perms"].startswith("r-") and kept["memset_rc"] != 0, kept
    got = ok(b.invoke("xg-b", {"op": "get", "key": "act/1"}))
    assert got["source"] == "bucket" and bytes.fromhex(got["data"]) == pattern(100_000, 3), got
    # Consumed for every node: the bucket, B, and A (whose copy was stale; its memory goes).
    assert store_objects(seaweed, "team-g") == []
    assert key_error(b.invoke("xg-b", {"op": "get", "key": "act/1"}))
    assert key_error(a.invoke("xg-a", {"op": "get", "key": "act/1", "keep": True}))
    assert not (daemon_memory_inodes(a) & held), "A's stale copy's GPU memory is still the daemon's"


def test_a_get_on_b_whose_gpu_copy_fails_consumes_nothing(gpu_nodes: tuple[Torpord, Torpord], seaweed: Seaweed) -> None:  # noqa: F811
    a, b = gpu_nodes
    gpu_put(a, "xg-a", "act/2", 40_000, 13)
    switch = Path(b.env["TORPOR_LIBCUDA"]).parent / "FAKE_CUDA_MEM_CREATE_RESULT"
    switch.write_text("2\n")  # B's driver: out of memory for the copy
    try:
        failed = b.invoke("xg-b", {"op": "get", "key": "act/2"})
    finally:
        switch.unlink()
    assert failed.status == 500 and not key_error(failed), failed.body
    assert len(store_objects(seaweed, "team-g")) == 2, "a get that failed consumed the bucket's copy"
    got = ok(b.invoke("xg-b", {"op": "get", "key": "act/2"}))
    assert got["source"] == "bucket" and bytes.fromhex(got["data"]) == pattern(40_000, 13), got
    assert store_objects(seaweed, "team-g") == []


def test_a_get_on_the_putting_node_maps_its_own_memory_and_consumes_the_buckets_copy(gpu_nodes: tuple[Torpord, Torpord], seaweed: Seaweed) -> None:  # noqa: F811
    a, b = gpu_nodes
    before = daemon_memory_inodes(a)
    gpu_put(a, "xg-a", "act/3", 5000, 21)
    held = daemon_memory_inodes(a) - before
    own = ok(a.invoke("xg-a", {"op": "get", "key": "act/3"}))
    assert own["source"] == "stored" and own["mapping"]["inode"] in held, own
    assert bytes.fromhex(own["data"]) == pattern(5000, 21)
    assert store_objects(seaweed, "team-g") == []
    assert key_error(b.invoke("xg-b", {"op": "get", "key": "act/3"}))
    # A second put replaces the value for every node; B gets the newer bytes.
    gpu_put(a, "xg-a", "act/4", 3000, 1)
    gpu_put(a, "xg-a", "act/4", 3000, 2)
    assert len(store_objects(seaweed, "team-g")) == 2, "the replaced value's bytes stayed in the bucket"
    newer = ok(b.invoke("xg-b", {"op": "get", "key": "act/4"}))
    assert bytes.fromhex(newer["data"]) == pattern(3000, 2)
    assert key_error(a.invoke("xg-a", {"op": "get", "key": "act/4"}))
