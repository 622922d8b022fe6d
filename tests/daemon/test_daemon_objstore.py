"""Two torpord daemons on this machine, each with its own state directory, sharing one bucket of
a real SeaweedFS (docs/objstore.md, "torpord"): a deploy on A pushes the function; B pulls it
(only the chunks B lacks) on `POST …/pull` or on its first invoke and answers as A does; a
second function on the same base pulls fewer chunks; a split snapshot's sealed segment record travels with it, a record
rewritten in the bucket is refused and a corrupted segment chunk commits neither record; the hot set
(page profile) travels with the snapshot, sealed, and B's first restore serves it, a rewritten one is
refused and a missing one only costs the hot set; a push to a server that is down does not fail the deploy; a function not in the bucket is a 404; a corrupted chunk in the bucket and a
file the snapshot reopens that differs on the pulling node are refused; placement's facts."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import a_library, pids_with, wait_until
from objstore_server import Seaweed, free_ports, running_seaweed
from torpor import client

from .conftest import FUNCTIONS, Answer, Torpord

BUCKET = "cluster"
# Torpor's page server appends its counters here (B's only): hot_pages > 0 = a hot set served.
STATS = "TORPOR_PAGE_SERVER_STATS"


def function_dir(root: Path, name: str, body: str = "return {'name': NAME, 'x': request}", setup: str = "pass") -> Path:
    d = root / name
    d.mkdir()
    (d / "torpor.toml").write_text(f'name = "{name}"\nentry = "handler:F"\ntimeout_s = 30\n')
    (d / "handler.py").write_text(
        "import torpor\n"
        f"NAME = {name!r}\n\n"
        "@torpor.function\n"
        "class F:\n"
        "    def setup(self):\n"
        f"        {setup}\n\n"
        "    def __call__(self, request):\n"
        f"        {body}\n"
    )
    return d


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seaweed]:
    yield from running_seaweed(tmp_path_factory.mktemp("seaweedfs"), BUCKET)


def objstore_section(seaweed: Seaweed, root: Path, endpoint: str | None = None) -> str:
    config = seaweed.config(root, BUCKET)
    creds = root / f"{BUCKET}.credentials"
    assert config.exists() and creds.exists()
    return (
        f'[objstore]\nendpoint = "{endpoint or seaweed.endpoint}"\nbucket = "{BUCKET}"\n'
        f'credentials_file = "{creds}"\ncache_bytes = 1073741824\n'
    )


@pytest.fixture(scope="module")
def nodes(
    torpor_bin: Path, criu_ready: None, seaweed: Seaweed, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Torpord, Torpord]]:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    roots = [tmp_path_factory.mktemp(n) for n in ("node-a", "node-b")]
    env = {"TORPOR_HASH_CACHE": str(roots[0] / "file-hashes.json")}
    a = Torpord(torpor_bin, roots[0], config=objstore_section(seaweed, roots[0]), env=env)
    b = None
    try:
        # The nodes of a cluster share the snapshot key (docs/objstore.md, "Security").
        (roots[1] / "state").mkdir(mode=0o700)
        key = roots[1] / "state" / "snapshot.key"
        shutil.copyfile(a.state / "snapshot.key", key)
        os.chmod(key, 0o600)
        # B's own hash cache, as on a node of its own: its first pull must hash the files the
        # snapshot reopens (during the transfer: torpor_image::warm_reopened).
        b_env = {"TORPOR_HASH_CACHE": str(roots[1] / "file-hashes.json"), STATS: str(roots[1] / "page-server-stats.jsonl")}
        b = Torpord(torpor_bin, roots[1], config=objstore_section(seaweed, roots[1]), env=b_env)
        yield a, b
    finally:
        if b is not None:
            b.stop()
        a.stop()


def test_deploy_on_a_pushes_and_b_pulls_only_missing_chunks_and_answers_alike(
    nodes: tuple[Torpord, Torpord], tmp_path: Path
) -> None:
    a, b = nodes
    # numpy: native libraries installed from a wheel, whose RECORD holds their SHA-256.
    first = function_dir(tmp_path, "os-first", setup="import numpy")
    lines = a.deploy(first)
    pushed = lines[-1]["result"]["pushed"]
    assert isinstance(pushed, dict), pushed
    assert pushed["uploaded_chunks"] == pushed["chunks"] > 0, pushed

    before = client.Client(b.socket).placement("os-first")
    assert before.known is False and before.in_bucket is True and before.local_snapshot is False, before
    assert before.max_instances is None, before

    pulled = client.Client(b.socket).pull("os-first")
    assert pulled.function == "os-first" and pulled.pulled_chunks > 0 and pulled.pulled_bytes > 0, pulled
    # The record named the files the snapshot reopens (the interpreter, its libraries): B,
    # new to them, hashed them while the transfer ran, so the check after found them cached.
    assert pulled.phases is not None and pulled.phases["reopened_hashed_bytes"] > 1 << 20, pulled.phases
    assert pulled.phases["reopened_warm_s"] > 0, pulled.phases
    # numpy's libraries were not read: their installer's RECORD gave their hashes
    # (torpor_image's installer_record), and the check after accepted them.
    assert pulled.phases["reopened_recorded_bytes"] > 1 << 20, pulled.phases
    again = client.Client(b.socket).pull("os-first")
    assert again.pulled_bytes == 0 and again.pulled_chunks == 0, again

    after = client.Client(b.socket).placement("os-first")
    assert after.known and after.local_snapshot and after.in_bucket is True, after
    assert after.instances == 0 and after.queue_depth == 0 and after.starting == 0, after
    assert after.max_instances == 4, after  # the default scaling.max_instances (torpor.spec)

    ra, rb = a.invoke("os-first", {"v": [1, 2.5]}), b.invoke("os-first", {"v": [1, 2.5]})
    assert ra.status == rb.status == 200, (ra.body, rb.body)
    assert ra.body == rb.body
    # The two nodes' state directories differ: B binds its own where the snapshot's worker had
    # A's (torpor_snapshot::mounts::STATE_DIR_KEY), so the restored worker reaches B.
    assert rb.start == "restored", (rb.headers, b.log_text())

    warm = client.Client(b.socket).placement("os-first")
    assert warm.instances == 1 and warm.warm_idle == 1, warm

    # A second function on the same base: only what it adds travels, both ways.
    second = function_dir(tmp_path, "os-second", body="return {'second': request}")
    pushed2 = a.deploy(second)[-1]["result"]["pushed"]
    assert isinstance(pushed2, dict), pushed2
    assert 0 < pushed2["uploaded_chunks"] < pushed2["chunks"], pushed2
    # Pulled by the first invoke on B: any node serves any function.
    r = b.invoke("os-second", 7)
    assert r.status == 200 and r.json() == {"second": 7}, r.body
    log = b.log_text()
    assert "pulled from the object store" in log, log
    second_pull = [line for line in b.log.read_text().splitlines() if "os-second" in line and "pulled from the object store" in line]
    assert second_pull, log
    chunks = int(second_pull[-1].split("pulled_chunks=")[1].split()[0])
    assert 0 < chunks < pulled.pulled_chunks, second_pull[-1]


def test_a_function_not_in_the_bucket_is_404_on_pull_invoke_and_placement(nodes: tuple[Torpord, Torpord]) -> None:
    _, b = nodes
    with pytest.raises(client.ApiError) as e:
        client.Client(b.socket).pull("os-nowhere")
    assert e.value.status == 404 and "no function named" in e.value.message and "\n" not in e.value.message
    r = b.invoke("os-nowhere", 1)
    assert r.status == 404, r.body
    p = client.Client(b.socket).placement("os-nowhere")
    assert p.known is False and p.in_bucket is False and p.local_snapshot is False, p


def s3_put_via_filer(seaweed: Seaweed, key: str, data: bytes) -> None:
    """Overwrites object `key` of the bucket through the filer (what a writer to the bucket can do)."""
    c = http.client.HTTPConnection("127.0.0.1", seaweed.filer_port, timeout=30)
    c.request("PUT", f"/buckets/{BUCKET}/{key}", body=data)
    status = c.getresponse().status
    c.close()
    assert status in (200, 201, 204), status


def s3_get_via_filer(seaweed: Seaweed, key: str) -> bytes:
    """Object `key` of the bucket, read through the filer."""
    c = http.client.HTTPConnection("127.0.0.1", seaweed.filer_port, timeout=30)
    c.request("GET", f"/buckets/{BUCKET}/{key}")
    r = c.getresponse()
    body = r.read()
    c.close()
    assert r.status == 200, (key, r.status)
    return body


def test_a_corrupted_chunk_in_the_bucket_is_refused_and_nothing_is_registered(
    nodes: tuple[Torpord, Torpord], seaweed: Seaweed, tmp_path: Path
) -> None:
    a, b = nodes
    # Its own payload, so that it has chunks no other function holds.
    d = function_dir(tmp_path, "os-corrupt", setup="self.blob = bytes(range(256)) * 40000")
    lines = a.deploy(d)
    (snap,) = [x for x in lines if x.get("phase") == "snapshot_function"]
    # Where the push put each of the snapshot's chunks: (pack, offset, length). The daemon
    # pushes a function's files as snapshot `<id>.files` (torpord::bucket::files_id).
    locator = json.loads(s3_get_via_filer(seaweed, f"snapshots/{snap['snapshot']}.files/packs.json"))
    placed = {c[0]: (pack, c[1], c[2]) for pack, p in locator["packs"].items() for c in p["chunks"]}
    store_a = a.state / "chunks" / "chunks"
    store_b = b.state / "chunks" / "chunks"
    have_b = {p.name for p in store_b.rglob("*") if p.is_file()}
    only_a = [p.name for p in store_a.rglob("*") if p.is_file() and p.name not in have_b and p.name in placed]
    assert only_a, "no chunk of the new function is missing on B"
    victim = only_a[0]
    pack, offset, length = placed[victim]
    intact = s3_get_via_filer(seaweed, f"packs/{pack}.pack")
    raw = bytearray(intact)
    raw[offset + length - 1] ^= 0xFF
    s3_put_via_filer(seaweed, f"packs/{pack}.pack", bytes(raw))
    try:
        with pytest.raises(client.ApiError) as e:
            client.Client(b.socket).pull("os-corrupt")
        msg = e.value.message
        assert e.value.status == 502 and victim in msg and f"packs/{pack}.pack" in msg and "corrupt" in msg, msg
        assert client.Client(b.socket).placement("os-corrupt").known is False
    finally:
        # The bucket is the module's: the pack also holds chunks other functions share (a later
        # push finds them there and does not upload them again), so it is put back intact. CI
        # saw the split test's pull fail on a chunk of this corrupted pack.
        s3_put_via_filer(seaweed, f"packs/{pack}.pack", intact)


def s3_delete_via_filer(seaweed: Seaweed, key: str) -> None:
    c = http.client.HTTPConnection("127.0.0.1", seaweed.filer_port, timeout=30)
    c.request("DELETE", f"/buckets/{BUCKET}/{key}")
    status = c.getresponse().status
    c.close()
    assert status in (200, 202, 204), status


def page_server_stats(d: Torpord) -> list[dict[str, int]]:
    path = Path(d.env[STATS])
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def first_restore_stats(d: Torpord, name: str, arg: object) -> tuple[Answer, dict[str, int]]:
    """Invokes `name` (its first restore on `d`) and returns the answer and the counters of the
    page server that served it (appended once every page is in)."""
    before = len(page_server_stats(d))
    r = d.invoke(name, arg)
    assert r.status == 200 and r.start == "restored", (r.status, r.body, d.log_text())
    wait_until(lambda: len(page_server_stats(d)) > before, 30, "the restore's page server to end")
    [served] = page_server_stats(d)[before:]
    return r, served


def test_the_hot_set_travels_sealed_and_the_first_restore_on_b_serves_it(
    nodes: tuple[Torpord, Torpord], tmp_path: Path
) -> None:
    """A's deploy records the snapshot's page profile and its push puts it beside the snapshot;
    B's pull keeps it byte for byte, and B's first restore (lazy: a CPU function) copies it first
    as its hot set. Without the profile B's page server serves no hot page (the next test)."""
    a, b = nodes
    lines = a.deploy(function_dir(tmp_path, "os-hot"))
    profiled = [x for x in lines if x.get("phase") == "profile"]
    assert profiled and profiled[0]["ranges"] > 0, lines
    result = lines[-1]["result"]
    sid, pushed = result["snapshot"], result["pushed"]
    profile_a = (a.state / "profiles" / f"{sid}.pages").read_bytes()
    assert isinstance(pushed, dict) and pushed["profile_bytes"] > len(profile_a), pushed

    pulled = client.Client(b.socket).pull("os-hot")
    profile_b = b.state / "profiles" / f"{sid}.pages"
    assert profile_b.read_bytes() == profile_a
    assert profile_b.stat().st_mode & 0o777 == 0o600
    assert pulled.profile_bytes == len(profile_a), pulled
    assert not list(profile_b.parent.glob(f"{sid}.*pulled"))

    r, served = first_restore_stats(b, "os-hot", 5)
    assert r.json() == {"name": "os-hot", "x": 5}
    assert served["hot_pages"] > 0, served

    # The profile goes with the pulled function.
    rm = b.cli("rm", "os-hot")
    assert rm.returncode == 0, rm.stderr
    wait_until(lambda: not profile_b.exists(), 10, "the pulled profile to be removed with its snapshot")


def test_a_profile_rewritten_in_the_bucket_is_refused_and_nothing_is_registered(
    nodes: tuple[Torpord, Torpord], seaweed: Seaweed, tmp_path: Path
) -> None:
    """Someone with write access to the bucket but not the key flips bytes of the profile (same
    length): B's pull fails in one line naming the object, before it fetched a chunk; nothing is
    registered or left. Deleted from the bucket (as a push from before profiles travelled), the
    snapshot pulls and restores, serving no hot set."""
    a, b = nodes
    lines = a.deploy(function_dir(tmp_path, "os-hot-forged"))
    sid = lines[-1]["result"]["snapshot"]
    key = f"snapshots/{sid}/pages-profile"
    sealed = s3_get_via_filer(seaweed, key)
    forged = bytearray(sealed)
    for i in range(len(forged) - 8, len(forged) - 1):
        forged[i] ^= 0x01
    assert len(forged) == len(sealed) and forged != sealed
    s3_put_via_filer(seaweed, key, bytes(forged))
    with pytest.raises(client.ApiError) as e:
        client.Client(b.socket).pull("os-hot-forged")
    msg = e.value.message
    assert e.value.status == 502 and key in msg and "MAC does not match" in msg and "\n" not in msg, msg
    assert client.Client(b.socket).placement("os-hot-forged").known is False
    assert not (b.state / "snapshots" / sid).exists()
    assert not [p for p in (b.state / "snapshots").iterdir() if sid in p.name]
    assert not list((b.state / "profiles").glob(f"{sid}.*"))
    assert not (b.state / "chunks" / "refs" / f"{sid}.files.json").exists()

    s3_delete_via_filer(seaweed, key)
    r, served = first_restore_stats(b, "os-hot-forged", 2)
    assert r.json() == {"name": "os-hot-forged", "x": 2}
    assert served["hot_pages"] == 0, served
    assert not (b.state / "profiles" / f"{sid}.pages").exists()
    pulls = [x for x in b.log_text().splitlines() if "os-hot-forged" in x and "pulled from the object store" in x]
    assert pulls and "profile_bytes=0" in pulls[-1], pulls


def splitbuf_as(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    shutil.copytree(FUNCTIONS / "splitbuf", d)
    toml = d / "torpor.toml"
    toml.write_text(toml.read_text().replace('name = "splitbuf"', f'name = "{name}"'))
    return d


def test_a_split_snapshot_travels_with_its_sealed_segment_record(nodes: tuple[Torpord, Torpord], tmp_path: Path) -> None:
    a, b = nodes
    lines = a.deploy(splitbuf_as(tmp_path, "os-split"))
    (snap,) = [x for x in lines if x.get("phase") == "snapshot_function"]
    assert snap["split"] is True and snap["segments"] == 3, snap
    pushed = lines[-1]["result"]["pushed"]
    assert isinstance(pushed, dict) and pushed["chunks"] > 0, pushed
    pulled = client.Client(b.socket).pull("os-split")
    assert pulled.pulled_chunks > 0, pulled
    # The pull put the segments into B's host cache as they came (crate::split::prefill): the
    # first restore fills them from memory, not from the store the pull has just written.
    assert metric(b, 'torpor_restore_cache_bytes{cache="host"}') > 0, b.log_text()
    assert metric(b, 'torpor_restore_cache_requests_total{cache="host",result="hit"}') == 0
    # B's store holds A's record of the segments, sealed alike (the nodes share the key).
    sid = snap["snapshot"]
    record_a = (a.state / "chunks" / "refs" / f"{sid}.json").read_bytes()
    record_b = (b.state / "chunks" / "refs" / f"{sid}.json").read_bytes()
    assert record_a == record_b and b'"mac"' in record_b
    ra = a.invoke("os-split", {"op": "compute", "x": 3})
    rb = b.invoke("os-split", {"op": "compute", "x": 3})
    assert ra.status == rb.status == 200 and ra.json()["sha"] == rb.json()["sha"], (ra.body, rb.body)
    # Restored on B from the pulled record: its segments, at their addresses, from the host
    # cache the pull filled (the GPU cache, here memfds, was empty).
    assert rb.start == "restored" and "segments" in rb.timings, (rb.headers, b.log_text())
    assert metric(b, 'torpor_restore_cache_requests_total{cache="host",result="hit"}') >= 3, b.log_text()


def metric(node: Torpord, series: str) -> float:
    """The value of one series of `node`'s /metrics (0 when it has none)."""
    for line in node.request("GET", "/metrics").body.decode().splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def test_another_tenants_snapshot_travels_under_its_own_prefix_into_its_own_store(
    nodes: tuple[Torpord, Torpord], seaweed: Seaweed, tmp_path: Path
) -> None:
    """The same splitbuf, as tenant team-a's: pushed under `tenants/team-a/` in the bucket (its
    packs deduplicated against team-a's only, so every chunk goes up again though the default
    tenant's os-split holds the same bytes) and pulled into B's team-a store."""
    a, b = nodes
    d = splitbuf_as(tmp_path, "os-team-a")
    toml = d / "torpor.toml"
    toml.write_text(toml.read_text().replace('name = "os-team-a"\n', 'name = "os-team-a"\ntenant = "team-a"\n'))
    lines = a.deploy(d)
    (snap,) = [x for x in lines if x.get("phase") == "snapshot_function"]
    sid = snap["snapshot"]
    pushed = lines[-1]["result"]["pushed"]
    assert isinstance(pushed, dict) and pushed["uploaded_chunks"] == pushed["chunks"] > 0, pushed
    locator = json.loads(s3_get_via_filer(seaweed, f"tenants/team-a/snapshots/{sid}.files/packs.json"))
    assert locator["packs"], locator
    client.Client(b.socket).pull("os-team-a")
    record_a = (a.state / "chunks-tenants" / "team-a" / "refs" / f"{sid}.json").read_bytes()
    record_b = (b.state / "chunks-tenants" / "team-a" / "refs" / f"{sid}.json").read_bytes()
    assert record_a == record_b and b'"mac"' in record_b
    assert not (b.state / "chunks" / "refs" / f"{sid}.json").exists()
    rb = b.invoke("os-team-a", {"op": "compute", "x": 3})
    assert rb.status == 200 and rb.start == "restored" and "segments" in rb.timings, (rb.body, b.log_text())


def test_a_segment_record_rewritten_in_the_bucket_is_refused_and_nothing_is_registered(
    nodes: tuple[Torpord, Torpord], seaweed: Seaweed, tmp_path: Path
) -> None:
    a, b = nodes
    lines = a.deploy(splitbuf_as(tmp_path, "os-split-forged"))
    (snap,) = [x for x in lines if x.get("phase") == "snapshot_function"]
    sid = snap["snapshot"]
    record = (a.state / "chunks" / "refs" / f"{sid}.json").read_text()
    # Someone with write access to the bucket but not the key: the sizes say 1 byte more.
    forged = record.replace('"size":', '"size":1', 1)
    assert forged != record
    s3_put_via_filer(seaweed, f"snapshots/{sid}/sealed-record.json", forged.encode())
    with pytest.raises(client.ApiError) as e:
        client.Client(b.socket).pull("os-split-forged")
    assert e.value.status == 502, (e.value.status, e.value.message)
    assert "MAC" in e.value.message or "corrupt" in e.value.message, e.value.message
    assert client.Client(b.socket).placement("os-split-forged").known is False
    assert not (b.state / "snapshots" / sid).exists()


def test_a_corrupted_segment_chunk_fails_the_whole_pull_and_commits_neither_record(
    nodes: tuple[Torpord, Torpord], seaweed: Seaweed, tmp_path: Path
) -> None:
    """A split snapshot's files and segments travel in one pipeline and one commit
    (torpor_objstore::pull_snapshot): a segment chunk whose bytes do not match its id fails the
    whole pull in one line, and B's store commits neither the files' record nor the segments'
    (the files' chunks it fetched stay, unreferenced), no snapshot directory, nothing aside. With
    the pack repaired, the same pull completes and the function answers."""
    a, b = nodes
    d = splitbuf_as(tmp_path, "os-split-bad-seg")
    # Its own declared table: a segment chunk no other function holds.
    (d / "table.bin").write_bytes(os.urandom(12288))
    lines = a.deploy(d)
    (snap,) = [x for x in lines if x.get("phase") == "snapshot_function"]
    sid = snap["snapshot"]
    locator = json.loads(s3_get_via_filer(seaweed, f"snapshots/{sid}/sealed-packs.json"))
    placed = {c[0]: (pack, c[1], c[2]) for pack, p in locator["packs"].items() for c in p["chunks"]}
    have_b = {p.name for p in (b.state / "chunks" / "chunks").rglob("*") if p.is_file()}
    fresh = [c for c in placed if c not in have_b]
    assert fresh, "no segment chunk of the new function is missing on B"
    victim = fresh[0]
    pack, offset, length = placed[victim]
    intact = s3_get_via_filer(seaweed, f"packs/{pack}.pack")
    raw = bytearray(intact)
    raw[offset + length - 1] ^= 0xFF
    s3_put_via_filer(seaweed, f"packs/{pack}.pack", bytes(raw))
    refs = b.state / "chunks" / "refs"
    try:
        with pytest.raises(client.ApiError) as e:
            client.Client(b.socket).pull("os-split-bad-seg")
        msg = e.value.message
        assert e.value.status == 502 and victim in msg and f"packs/{pack}.pack" in msg, msg
        assert "\n" not in msg, msg
        assert client.Client(b.socket).placement("os-split-bad-seg").known is False
        assert not (refs / f"{sid}.json").exists() and not (refs / f"{sid}.files.json").exists()
        assert not (b.state / "snapshots" / sid).exists()
        assert not [p for p in (b.state / "snapshots").iterdir() if ".pull-" in p.name]
        assert not (b.state / "chunks" / "chunks" / victim[:2] / victim).exists()
    finally:
        s3_put_via_filer(seaweed, f"packs/{pack}.pack", intact)
    pulled = client.Client(b.socket).pull("os-split-bad-seg")
    assert pulled.pulled_chunks > 0, pulled
    assert (refs / f"{sid}.json").exists() and (refs / f"{sid}.files.json").exists()
    r = b.invoke("os-split-bad-seg", {"op": "compute", "x": 3})
    assert r.status == 200 and r.start == "restored", (r.body, b.log_text())


def test_a_pull_killed_while_it_writes_the_snapshot_aside_commits_nothing_and_the_next_pull_cleans_up(
    nodes: tuple[Torpord, Torpord], tmp_path: Path
) -> None:
    """torpord killed (-9) while its pull writes the snapshot directory aside (the pipeline's
    writers put the files' chunks into it as they come, into the store too; the commit not yet
    made): no record is committed and the directory is not in place. Restarted, the next pull
    removes what the killed one left aside, fetches only the chunks the killed one had not
    stored (those it stored were verified) and the function answers from it."""
    a, b = nodes
    d = function_dir(tmp_path, "os-killed", setup="import os; self.blob = os.urandom(96 << 20)")
    lines = a.deploy(d)
    (snap,) = [x for x in lines if x.get("phase") == "snapshot_function"]
    sid = snap["snapshot"]
    (result,) = [x["result"] for x in lines if "result" in x]
    total = result["pushed"]["chunks"]
    snapshots, refs = b.state / "snapshots", b.state / "chunks" / "refs"
    stored = b.state / "chunks" / "chunks"
    failed: list[BaseException] = []

    def pull() -> None:
        try:
            client.Client(b.socket).pull("os-killed")
        except BaseException as e:  # noqa: BLE001 (the daemon dies under it: any error)
            failed.append(e)

    puller = threading.Thread(target=pull)
    puller.start()
    deadline = time.monotonic() + 60
    aside: list[Path] = []
    # The directory aside, and some chunks stored: the kill falls inside the pipeline.
    while time.monotonic() < deadline and puller.is_alive():
        aside = list(snapshots.glob(f".{sid}.pull-*")) if snapshots.is_dir() else []
        if aside and stored.is_dir() and any(f for fan in stored.iterdir() for f in fan.iterdir()):
            break
        time.sleep(0.002)
    b.proc.kill()
    b.proc.wait()
    puller.join(timeout=30)
    assert aside, f"the pull never wrote its directory aside\n{b.log_text()}"
    assert failed, "the pull answered although its daemon was killed"
    assert not (snapshots / sid).exists()
    assert not (refs / f"{sid}.files.json").exists(), "a record committed before the directory was verified"
    assert [p for p in snapshots.glob(f".{sid}.pull-*")], "the kill came after the rename: the window was missed"
    b.restart()
    pulled = client.Client(b.socket).pull("os-killed")
    assert pulled.pulled_chunks < total, (pulled, total)
    assert not list(snapshots.glob(f".{sid}.pull-*")), list(snapshots.iterdir())
    assert (refs / f"{sid}.files.json").exists() and (snapshots / sid).is_dir()
    r = b.invoke("os-killed", 7)
    assert r.status == 200 and r.json() == {"name": "os-killed", "x": 7}, (r.status, r.body)


def chunk_files(store: Path) -> set[Path]:
    return {p for p in (store / "chunks").rglob("*") if p.is_file()}


def test_a_pull_answers_before_the_disk_and_a_daemon_killed_before_its_commit_settles_it(
    nodes: tuple[Torpord, Torpord], tmp_path: Path
) -> None:
    """The pull answers once every chunk is fetched, checked and written (the page cache), the
    directory written and verified; the records' syncfs runs after, in the background
    (docs/objstore.md, "Durability after the answer"). With that held back
    (`TORPORD_DELAY=pull-commit:60000`), a split function's pull answers with its records
    pending and its first invoke restores from them (segments included). torpord killed -9 in
    that window: restarted, it settles the records from their chunks, all whole, so they stand,
    and the function answers identically without a pull. A second function whose fresh chunk is
    damaged in that window (as a power loss could leave it): released at the restart with its
    function, and its next invoke pulls it again and answers as A does."""
    a, b = nodes
    ok = splitbuf_as(tmp_path, "os-deferred")
    (ok / "table.bin").write_bytes(os.urandom(12288))
    torn = splitbuf_as(tmp_path, "os-deferred-torn")
    (torn / "table.bin").write_bytes(os.urandom(12288))
    sids = {}
    for d in (ok, torn):
        (snap,) = [x for x in a.deploy(d) if x.get("phase") == "snapshot_function"]
        sids[d.name] = snap["snapshot"]
    store = b.state / "chunks"
    pending, refs = store / "pending", store / "refs"
    want = {"op": "compute", "x": 3}
    ra = {d.name: a.invoke(d.name, want) for d in (ok, torn)}
    assert all(r.status == 200 for r in ra.values()), {n: r.body for n, r in ra.items()}

    b.stop()
    b.env["TORPORD_DELAY"] = "pull-commit:60000"
    # Every chunk file written before the answer (the held ones are the next test's).
    config = b.config.read_text()
    b.config.write_text(config.replace("[objstore]\n", "[objstore]\nhold_bytes = 0\n", 1))
    b.restart()
    try:
        pulled = client.Client(b.socket).pull("os-deferred")
        assert pulled.pulled_chunks > 0, pulled
        sid = sids["os-deferred"]
        # Answered with both records written and both still waiting for their syncfs.
        assert sorted(p.name for p in pending.iterdir()) == sorted([sid, f"{sid}.files"]), list(pending.iterdir())
        assert (refs / f"{sid}.json").exists() and (refs / f"{sid}.files.json").exists()
        rb = b.invoke("os-deferred", want)
        assert rb.status == 200 and rb.start == "restored" and "segments" in rb.timings, (rb.body, b.log_text())
        assert rb.json()["sha"] == ra["os-deferred"].json()["sha"], (rb.body, ra["os-deferred"].body)
        assert (pending / sid).exists(), "the commit ran before the first start answered: the window was missed"

        before = chunk_files(store)
        client.Client(b.socket).pull("os-deferred-torn")
        tsid = sids["os-deferred-torn"]
        fresh = sorted(chunk_files(store) - before, key=lambda p: p.stat().st_size)
        assert fresh and (pending / tsid).exists(), (fresh, list(pending.iterdir()))
        victim = fresh[-1]
        raw = bytearray(victim.read_bytes())
        raw[-1] ^= 0xFF
        b.proc.kill()
        b.proc.wait()
        victim.write_bytes(bytes(raw))
    finally:
        del b.env["TORPORD_DELAY"]
        b.config.write_text(config)
    b.restart()
    # The API serves once the pulls left pending are settled.
    assert client.Client(b.socket).placement("os-deferred").known
    log = b.log.read_text(errors="replace")
    assert not list(pending.iterdir()), (list(pending.iterdir()), log)
    assert "every chunk is whole, its record stands" in log, log
    assert "did not reach the disk whole" in log and "os-deferred-torn" in log, log
    # Settled whole: registered still, nothing pulled again, the same answer.
    assert (refs / f"{sid}.json").exists() and (refs / f"{sid}.files.json").exists()
    again = client.Client(b.socket).pull("os-deferred")
    assert again.pulled_chunks == 0, again
    rb = b.invoke("os-deferred", want)
    assert rb.status == 200 and rb.json()["sha"] == ra["os-deferred"].json()["sha"], (rb.body, b.log_text())
    # Released: unknown here, so its invoke pulls it again (the damaged chunk moved aside and
    # fetched anew) and answers as A does.
    assert client.Client(b.socket).placement("os-deferred-torn").known is False
    assert not (b.state / "snapshots" / tsid).exists()
    rt = b.invoke("os-deferred-torn", want)
    assert rt.status == 200 and rt.json()["sha"] == ra["os-deferred-torn"].json()["sha"], (rt.body, b.log_text())
    assert (refs / f"{tsid}.json").exists() and victim.exists()


def test_a_pull_answers_before_writing_its_chunk_files_and_one_killed_before_them_is_pulled_again(
    nodes: tuple[Torpord, Torpord], tmp_path: Path
) -> None:
    """With `objstore.hold_bytes` (4 GiB by default) a pull holds the chunk files it fetched in
    memory and writes them into the store after its answer (docs/objstore.md, "Chunk files
    placed after the answer"). Held back (`TORPORD_DELAY=pull-commit:60000`): the pull answers
    with no new chunk file in the store, and the first invoke restores (segments included)
    from the directory and from memory, answering as A does. Killed -9 in that window, the
    daemon loses them: at its restart settle finds the records' chunks missing and releases
    the function, whose next invoke pulls it again and answers alike. Not held back, the
    chunk files are written soon after the answer, and nothing is held once the records are
    durable."""
    a, b = nodes
    held = splitbuf_as(tmp_path, "os-held")
    (held / "table.bin").write_bytes(os.urandom(12288))
    (snap,) = [x for x in a.deploy(held) if x.get("phase") == "snapshot_function"]
    sid = snap["snapshot"]
    later = function_dir(tmp_path, "os-held-later", body="return {'later': request}")
    a.deploy(later)
    store = b.state / "chunks"
    want = {"op": "compute", "x": 5}
    ra = a.invoke("os-held", want)
    assert ra.status == 200, ra.body

    b.stop()
    b.env["TORPORD_DELAY"] = "pull-commit:60000"
    b.restart()
    try:
        before = chunk_files(store)
        pulled = client.Client(b.socket).pull("os-held")
        assert pulled.pulled_chunks > 0, pulled
        assert pulled.phases is not None and pulled.phases["held_chunks"] > 0, pulled
        assert chunk_files(store) == before, "a chunk file was written before the answer"
        assert (store / "pending" / sid).exists()
        rb = b.invoke("os-held", want)
        assert rb.status == 200 and rb.start == "restored" and "segments" in rb.timings, (rb.body, b.log_text())
        assert rb.json()["sha"] == ra.json()["sha"], (rb.body, ra.body)
        assert chunk_files(store) == before, "the held chunks were written before the delay ended"
        b.proc.kill()
        b.proc.wait()
    finally:
        del b.env["TORPORD_DELAY"]
    b.restart()
    assert client.Client(b.socket).placement("os-held").known is False, b.log_text()
    log = b.log.read_text(errors="replace")
    assert "did not reach the disk whole" in log and "os-held" in log, log
    again = b.invoke("os-held", want)
    assert again.status == 200 and again.json()["sha"] == ra.json()["sha"], (again.body, b.log_text())

    # Not held back: written after the answer, then nothing held.
    before = chunk_files(store)
    pulled = client.Client(b.socket).pull("os-held-later")
    assert pulled.phases is not None and pulled.phases["held_chunks"] > 0, pulled
    deadline = time.monotonic() + 30
    while "a pull's records are durable" not in b.log_text().split("os-held-later", 1)[-1]:
        assert time.monotonic() < deadline, b.log_text()
        time.sleep(0.1)
    assert len(chunk_files(store) - before) >= pulled.phases["held_chunks"], (pulled, b.log_text())
    assert not list((store / "pending").iterdir())
    r = b.invoke("os-held-later", 9)
    assert r.status == 200 and r.json() == {"later": 9}, r.body


def test_a_reopened_file_that_differs_on_the_pulling_node_is_refused_naming_it(
    nodes: tuple[Torpord, Torpord], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    a, b = nodes
    # On the host's disk, readable by the workers' users: a worker's /tmp and /var/tmp are tmpfs
    # of its own, archived into the snapshot, so files under them are not reopened from the node.
    libdir = Path(tempfile.mkdtemp(prefix="torpor-portable-", dir="/var/lib"))
    libdir.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(libdir, ignore_errors=True))
    lib = libdir / "libtorporportable.so"
    shutil.copyfile(a_library(), lib)
    d = function_dir(tmp_path, "os-portable", setup=f"import ctypes; self.lib = ctypes.CDLL({str(lib)!r})")
    pushed = a.deploy(d)[-1]["result"]["pushed"]
    assert isinstance(pushed, dict), pushed
    # Same size, one byte changed: another build of the library on the pulling node.
    data = bytearray(lib.read_bytes())
    data[-1] ^= 0xFF
    lib.write_bytes(bytes(data))
    with pytest.raises(client.ApiError) as e:
        client.Client(b.socket).pull("os-portable")
    assert e.value.status == 409, e.value.message
    assert str(lib) in e.value.message and "cannot be restored on this node" in e.value.message, e.value.message
    assert "\n" not in e.value.message
    assert client.Client(b.socket).placement("os-portable").known is False
    assert not list((b.state / "snapshots").glob("fn-os-portable-*"))


def test_a_push_to_a_server_that_is_down_does_not_fail_the_deploy(
    torpor_bin: Path, criu_ready: None, seaweed: Seaweed, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    dead = f"http://127.0.0.1:{free_ports(1)[0]}"
    c = Torpord(
        torpor_bin,
        tmp_path,
        config=objstore_section(seaweed, tmp_path, endpoint=dead),
        env={"TORPOR_HASH_CACHE": str(tmp_path / "file-hashes.json")},
    )
    try:
        d = function_dir(tmp_path, "os-offline")
        result = c.deploy(d)[-1]["result"]
        assert isinstance(result["pushed"], str) and "cannot reach the object store" in result["pushed"], result
        r = c.invoke("os-offline", 3)
        assert r.status == 200 and r.json() == {"name": "os-offline", "x": 3}, r.body
        p = client.Client(c.socket).placement("os-offline")
        assert p.known and p.in_bucket is None, p
        with pytest.raises(client.ApiError) as e:
            client.Client(c.socket).push("os-offline")
        assert e.value.status == 502 and "cannot reach" in e.value.message, e.value.message
        assert "push to the object store failed" in c.log_text()
    finally:
        c.stop()
        assert not pids_with(f"{c.state}/")


def test_bad_objstore_config_stops_the_start_in_one_line(torpor_bin: Path, tmp_path: Path) -> None:
    import subprocess

    for section, words in [
        ('[objstore]\nbucket = "b"\ncredentials_file = "c"\n', "objstore.endpoint is missing"),
        ('[objstore]\nendpoint = "ftp://h"\nbucket = "b"\ncredentials_file = "c"\n', "objstore.endpoint"),
        ('[objstore]\nendpoint = "http://h"\nbucket = "b"\ncredentials_file = "c"\nsecret_access_key = "x"\n', "objstore.secret_access_key must not be"),
        ('[objstore]\nendpoint = "http://h"\nbucket = "b"\ncredentials_file = "c"\nprefix = "a"\n', "objstore.prefix"),
        ('[objstore]\nendpoint = "http://h"\nbucket = "b"\ncredentials_file = "c"\ncache_bytes = -1\n', "objstore.cache_bytes"),
        ('[objstore]\nendpoint = "http://h"\nbucket = "b"\ncredentials_file = "missing.credentials"\n', "missing.credentials"),
    ]:
        cfg = tmp_path / "torpord.toml"
        cfg.write_text(section)
        r = subprocess.run(
            [str(torpor_bin), "serve", "--config", str(cfg), "--state-dir", str(tmp_path / "state"), "--socket", str(tmp_path / "s.sock"), *(["--check"] if "missing.credentials" not in section else [])],
            capture_output=True, text=True, timeout=30, check=False,
        )
        assert r.returncode != 0, (section, r.stdout)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert any(words in line for line in lines), (section, r.stderr)
