"""Split snapshots through the real daemon, real workers (with the device-memory hook) and real
CRIU, on the host backend (docs/split.md).

tests/daemon/functions/splitbuf keeps its weights in a torpor.buffer() segment, read-only data
in a sealed segment and a scratch buffer it writes on every request. The daemon captures the
three segments into the chunk store at deploy (the weights found read-only by the warm-up
probe, the data read-only by declaration) and its restore server maps them back at the same
addresses.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import alive

from .conftest import FUNCTIONS, Torpord

SPLITBUF = FUNCTIONS / "splitbuf"
WEIGHTS_SIZE = 16 * 4096


def expected_sha(x: int) -> str:
    weights = bytes((i * 31 + 7) % 251 for i in range(WEIGHTS_SIZE))
    h = hashlib.sha256(weights)
    h.update((SPLITBUF / "table.bin").read_bytes())
    h.update(str(x).encode())
    return h.hexdigest()


def snapshot_line(lines: list[dict[str, Any]]) -> dict[str, Any]:
    (line,) = [x for x in lines if x.get("phase") == "snapshot_function"]
    return line


def record(torpord: Torpord, snapshot: str) -> dict[str, Any]:
    path = torpord.state / "chunks" / "refs" / f"{snapshot}.json"
    return dict(json.loads(path.read_text()))


def twin(tmp_path: Path, name: str) -> Path:
    """A copy of splitbuf deployed under another name: the same segments' contents."""
    d = tmp_path / name
    shutil.copytree(SPLITBUF, d)
    toml = d / "torpor.toml"
    toml.write_text(toml.read_text().replace('name = "splitbuf"', f'name = "{name}"'))
    return d


@pytest.fixture
def fresh(torpor_bin: Path, criu_ready: None, tmp_path: Path) -> Any:
    """A daemon of its own (its caches and store start empty)."""
    import os

    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    (tmp_path / "daemon").mkdir()
    d = Torpord(torpor_bin, tmp_path / "daemon")
    try:
        yield d
    finally:
        d.stop()


def restart(torpord: Torpord) -> None:
    """Stops the daemon (its instances go, and with them the caches and shared copies) and
    starts it again on the same state."""
    torpord.stop()
    torpord.restart()


def test_a_split_deploy_restores_bit_identical_at_the_same_addresses(torpord: Torpord) -> None:
    lines = torpord.deploy(SPLITBUF)
    snap = snapshot_line(lines)
    assert snap["split"] is True, snap
    assert (snap["segments"], snap["readonly_segments"]) == (3, 2), snap
    assert 0 < snap["stop_s"] <= snap["s"] + 1, snap

    first = torpord.invoke("splitbuf", {"op": "compute", "x": 5})
    assert first.status == 200 and first.start == "restored", (first.status, first.body, torpord.log_text())
    assert first.json()["sha"] == expected_sha(5)
    assert "segments" in first.timings, first.timings
    # The worker's own time in the hook's map calls, a part of hello → every segment mapped.
    assert 0 < first.timings["segments.map"] <= first.timings["segments"], first.timings

    info = torpord.invoke("splitbuf", {"op": "info"}).json()
    addrs, maps = info["addrs"], info["maps"]
    # Each segment is a memfd the restore server filled, mapped where it was at the snapshot.
    for name, perms in [("weights", "r--s"), ("table", "r--s"), ("scratch", "rw-s")]:
        m = maps[name]
        assert m["start"] == addrs[name] and "memfd:torpor-segment" in m["path"], (name, m)
        assert m["perms"] == perms, (name, m)
    # The addresses are those the snapshot's record in the chunk store names.
    names = {r["name"] for r in record(torpord, snap["snapshot"])["recipes"]}
    assert names == {"segments.json"} | {f"segment-{a:x}" for a in addrs.values()}, names


def test_two_instances_map_one_read_only_copy(torpord: Torpord) -> None:
    if not torpord.instances("splitbuf"):
        torpord.deploy(SPLITBUF)
    answers: list[Any] = [None, None]

    def call(i: int) -> None:
        answers[i] = torpord.invoke("splitbuf", {"op": "info", "sleep": 1.5})

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a, b = (x.json()["maps"] for x in answers)
    assert all(x.status == 200 for x in answers), [x.body for x in answers]
    # Two instances: their writable scratch memory is their own ...
    assert a["scratch"]["inode"] != b["scratch"]["inode"], (a, b)
    # ... and both map one physical copy of each read-only segment.
    assert a["weights"]["inode"] == b["weights"]["inode"], (a, b)
    assert a["table"]["inode"] == b["table"]["inode"], (a, b)
    metrics = torpord.request("GET", "/metrics").body.decode()
    assert "torpor_restore_shared_bytes " in metrics and "torpor_restore_shared_bytes 0\n" not in metrics


def test_a_corrupted_chunk_fails_the_restored_instance_with_a_clear_error_and_the_next_is_booted(fresh: Torpord) -> None:
    snap = snapshot_line(fresh.deploy(SPLITBUF))["snapshot"]
    addrs = fresh.invoke("splitbuf", {"op": "info"}).json()["addrs"]
    want = fresh.invoke("splitbuf", {"op": "compute", "x": 1}).json()["sha"]
    # The store is read only when the caches miss: start again with empty caches.
    restart(fresh)
    (weights,) = [r for r in record(fresh, snap)["recipes"] if r["name"] == f"segment-{addrs['weights']:x}"]
    chunk_id = weights["chunks"][0]["id"]
    chunk = fresh.state / "chunks" / "chunks" / chunk_id[:2] / chunk_id
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0xFF
    chunk.write_bytes(bytes(data))

    # The instance takes the request before its segments are filled: the fill fails, the
    # instance is removed (always from its pool: the hand-over waits until it joined), and the
    # request is answered with the segment and the chunk; restores of the snapshot pause (a retry
    # would read the same store), so the next instance is booted.
    r = fresh.invoke("splitbuf", {"op": "compute", "x": 1})
    assert r.status == 502, (r.status, r.body, fresh.log_text())
    message = r.json()["error"]
    assert f"segment at {addrs['weights']:#x}" in message and chunk_id[:16] in message, message
    r = fresh.invoke("splitbuf", {"op": "compute", "x": 1})
    assert r.status == 200 and r.start == "booted", (r.status, r.body, fresh.log_text())
    assert r.json()["sha"] == want, (r.json(), want)
    warning = [line for line in fresh.log_text().splitlines() if "booting an instance instead" in line]
    assert warning, fresh.log_text()
    assert f"segment at {addrs['weights']:#x}" in warning[0] and chunk_id[:16] in warning[0], warning
    metrics = fresh.request("GET", "/metrics").body.decode()
    assert 'torpor_restore_fallbacks_total{function="splitbuf"} 1' in metrics


def test_gc_after_rm_keeps_the_chunks_another_function_holds(fresh: Torpord, tmp_path: Path) -> None:
    replaced = snapshot_line(fresh.deploy(SPLITBUF))["snapshot"]
    store = fresh.state / "chunks"
    assert (store / "refs" / f"{replaced}.json").exists()
    # A redeploy replaces the function snapshot and releases the old one's record.
    a = snapshot_line(fresh.deploy(SPLITBUF))["snapshot"]
    assert not (store / "refs" / f"{replaced}.json").exists()
    b = snapshot_line(fresh.deploy(twin(tmp_path, "splitbuf-twin")))["snapshot"]
    # Dedup between two functions on one base: the twin shares its segments with splitbuf.
    r = fresh.cli("inspect", "--json", fresh.state / "snapshots" / b, "--store", store)
    assert r.returncode == 0, r.stderr
    usage = json.loads(r.stdout)["store"]
    assert usage["shared_with"].get(a, 0) >= WEIGHTS_SIZE + 3 * 4096, usage

    r = fresh.cli("rm", "splitbuf")
    assert r.returncode == 0, r.stderr
    assert not (store / "refs" / f"{a}.json").exists()
    r = fresh.cli("inspect", "--json", fresh.state / "snapshots" / b, "--store", store)
    assert json.loads(r.stdout)["store"]["missing_chunks"] == 0, r.stdout
    # With empty caches, the twin's segments come from the store, whole.
    restart(fresh)
    got = fresh.invoke("splitbuf-twin", {"op": "compute", "x": 2})
    assert got.status == 200 and got.json()["sha"] == expected_sha(2), (got.status, got.body)

    r = fresh.cli("rm", "splitbuf-twin")
    assert r.returncode == 0, r.stderr
    assert list((store / "chunks").glob("*/*")) == [], "chunks left after every split snapshot went"
    # No instance maps a shared read-only copy any more: the daemon let them go.
    deadline = time.monotonic() + 10
    while "torpor_restore_shared_bytes 0\n" not in fresh.request("GET", "/metrics").body.decode():
        assert time.monotonic() < deadline, "shared copies outlived every instance mapping them"
        time.sleep(0.1)


def test_a_hibernated_split_instance_wakes_with_its_memory(torpord: Torpord, tmp_path: Path) -> None:
    fdir = twin(tmp_path, "splitbuf-sleepy")
    toml = fdir / "torpor.toml"
    toml.write_text(toml.read_text() + "\n[keepalive]\ngpu_release_s = 1\nhibernate_s = 1\nevict_s = 600\n")
    torpord.deploy(fdir)
    first = torpord.invoke("splitbuf-sleepy", {"op": "compute", "x": 7}).json()
    deadline = time.monotonic() + 30
    while [i["stage"] for i in torpord.instances("splitbuf-sleepy")] != ["hibernated"]:
        assert time.monotonic() < deadline, torpord.log_text()
        time.sleep(0.1)
    (hib,) = [p.name for p in (torpord.state / "snapshots").glob("hib-splitbuf-sleepy-*")]
    # Its segments went to the chunk store under the hibernation snapshot's id.
    names = {r["name"] for r in record(torpord, hib)["recipes"]}
    assert len(names) == 4 and "segments.json" in names, names
    woken = torpord.invoke("splitbuf-sleepy", {"op": "compute", "x": 7})
    assert woken.status == 200 and woken.start == "restored", (woken.status, woken.body)
    # The same process state (its call count goes on) and the same bytes.
    assert woken.json() == {"sha": expected_sha(7), "calls": first["calls"] + 1}
    # The hibernation snapshot served: directory and chunk-store record are gone.
    deadline = time.monotonic() + 10
    while (torpord.state / "chunks" / "refs" / f"{hib}.json").exists():
        assert time.monotonic() < deadline, "the hibernation's record was not released"
        time.sleep(0.1)


def test_a_function_without_segments_takes_the_transparent_path(torpord: Torpord) -> None:
    snap = snapshot_line(torpord.deploy(FUNCTIONS / "echoer"))
    assert snap["split"] is False, snap
    assert not (torpord.state / "chunks" / "refs" / f"{snap['snapshot']}.json").exists()
    r = torpord.invoke("echoer", {"say": "hi"})
    assert r.status == 200 and r.start == "restored", (r.status, r.body)
    assert "segments" not in r.timings


def test_split_false_turns_the_split_path_off(fresh: Torpord) -> None:
    fresh.stop()
    fresh.config.write_text("split = false\n" + fresh.config.read_text())
    fresh.restart()
    snap = snapshot_line(fresh.deploy(FUNCTIONS / "echoer"))
    assert snap["split"] is False, snap
    # Workers get no hook: torpor.buffer() is refused at setup, with the reason.
    r = fresh.cli("deploy", "--json", SPLITBUF)
    assert r.returncode != 0
    last = json.loads(r.stdout.splitlines()[-1])
    assert last["phase"] == "load" and "TORPOR_HOOK_LIB" in last["error"], last


def test_a_split_instance_left_in_gpu_released_by_a_lost_daemon_is_not_readopted(fresh: Torpord) -> None:
    """A split instance in gpu_released has given its segments back, and their saved contents
    lived in the daemon: a daemon started after a crash cannot map them back, so it kills the
    instance instead of re-adopting it. (No GPU here: the stage is set in the registry while the
    daemon is down, as a crash in gpu_released would leave it.)"""
    fresh.deploy(SPLITBUF)
    r = fresh.invoke("splitbuf", {"op": "compute", "x": 1})
    assert r.status == 200 and r.start == "restored", (r.status, r.body, fresh.log_text())
    (inst,) = fresh.instances("splitbuf")
    fresh.wait_pages_in()  # else it is dropped for its lazy pages, not for the stage
    fresh.proc.send_signal(signal.SIGKILL)
    fresh.proc.wait()
    assert alive(inst["pid"]), "the worker must outlive its lost daemon"
    db = sqlite3.connect(fresh.state / "registry.db")
    with db:
        db.execute("UPDATE instances SET stage = 'gpu_released' WHERE id = ?", (inst["id"],))
    db.close()
    fresh.restart()
    deadline = time.monotonic() + 15
    while alive(inst["pid"]) or "went with the earlier torpord" not in fresh.log_text():
        assert time.monotonic() < deadline, f"the instance was not dropped\n{fresh.log_text()}"
        time.sleep(0.05)
    assert fresh.instances("splitbuf") == []
    again = fresh.invoke("splitbuf", {"op": "compute", "x": 2})
    assert again.status == 200 and again.start == "restored", (again.status, again.body)
    assert again.json()["sha"] == expected_sha(2)


def test_a_hook_library_under_tmp_still_reaches_the_workers(torpor_bin: Path, criu_ready: None, tmp_path: Path) -> None:
    """Workers have a /tmp of their own, so a hook library under the host's /tmp (a checkout or
    a build there) is not where the daemon found it: the daemon gives them a copy in its state
    directory. Before, every split deploy from such a build failed at quiesce ("cannot load the
    device-memory hook …: No such file or directory")."""
    import os

    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    lib = Path(os.environ["TORPOR_HOOK_LIB"])
    under_tmp = Path("/tmp") / f"torpor-hook-test-{os.getpid()}" / lib.name
    under_tmp.parent.mkdir(exist_ok=True)
    shutil.copy(lib, under_tmp)
    (tmp_path / "daemon").mkdir()
    d = Torpord(torpor_bin, tmp_path / "daemon", env={"TORPOR_HOOK_LIB": str(under_tmp)})
    try:
        snap = snapshot_line(d.deploy(SPLITBUF))
        assert snap["split"] is True, snap
        r = d.invoke("splitbuf", {"op": "compute", "x": 3})
        assert r.status == 200 and r.json()["sha"] == expected_sha(3), (r.status, r.body)
        status = d.request("GET", "/v1/status").json()
        assert status["hook"]["library"] == str(under_tmp), status["hook"]
        assert status["hook"]["worker_copy"].startswith(str(d.state)), status["hook"]
    finally:
        d.stop()
        shutil.rmtree(under_tmp.parent, ignore_errors=True)


def test_a_read_only_segment_in_the_gpu_cache_is_mapped_not_copied(fresh: Torpord) -> None:
    """With nothing live, a cold restore whose read-only segments are in the GPU cache maps the
    cache's (sealed) memory itself: restore after restore, the instance's weights are the same
    physical pages, so their cost does not grow with the model; its writable segment is a copy
    of its own each time."""
    fresh.deploy(SPLITBUF)

    def cold_restore() -> dict[str, Any]:
        fresh.stop_instances("splitbuf")
        a = fresh.invoke("splitbuf", {"op": "info"})
        assert a.status == 200 and a.start == "restored", (a.status, a.body, fresh.log_text())
        maps: dict[str, Any] = a.json()["maps"]
        return maps

    def gpu_hits() -> float:
        text = fresh.request("GET", "/metrics").body.decode()
        line = 'torpor_restore_cache_requests_total{cache="gpu",result="hit"} '
        return float(next(x for x in text.splitlines() if x.startswith(line)).split()[-1])

    # The store fills the host cache, a host-cache hit fills the GPU cache.
    maps = [cold_restore() for _ in range(3)]
    before = gpu_hits()
    maps += [cold_restore(), cold_restore()]
    assert gpu_hits() - before >= 6, "three segments per restore, each from the GPU cache"
    last, prev = maps[-1], maps[-2]
    for seg in ("weights", "table"):
        assert last[seg]["perms"] == "r--s", last[seg]
        assert last[seg]["inode"] == prev[seg]["inode"], (seg, prev[seg], last[seg])
    assert last["scratch"]["inode"] != prev["scratch"]["inode"], (prev["scratch"], last["scratch"])
    answer = fresh.invoke("splitbuf", {"op": "compute", "x": 7})
    assert answer.status == 200 and answer.json()["sha"] == expected_sha(7)


def test_a_restore_filled_by_its_hello_sends_the_first_request_after_its_map_frames(
    torpor_bin: Path, criu_ready: None, tmp_path: Path
) -> None:
    """When every segment is filled by the worker's hello (the caches; tiny segments even from
    the store), the map frames are all that is left: the first request goes after them
    (`maps_first`, how long it waited), so its forward never runs while the driver maps
    (docs/split.md). Held here with TORPORD_DELAY=map-frames: the request waits out the hold."""
    import os

    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    d = Torpord(torpor_bin, tmp_path / "daemon", env={"TORPORD_DELAY": "map-frames:700"})
    try:
        d.deploy(SPLITBUF)
        for _ in range(2):
            d.stop_instances("splitbuf")
            first = d.invoke("splitbuf", {"op": "compute", "x": 3})
            assert first.status == 200 and first.start == "restored", (first.status, first.body, d.log_text())
            assert first.json()["sha"] == expected_sha(3)
            assert first.timings.get("maps_first", 0) >= 0.6, first.timings
            # Sent after the last map frame: the worker had every segment when it started it.
            assert first.timings["segments"] <= first.timings["total"], first.timings
            warm = d.invoke("splitbuf", {"op": "compute", "x": 4})
            assert warm.status == 200 and warm.start == "warm" and "maps_first" not in warm.timings, warm.timings
    finally:
        d.stop()
