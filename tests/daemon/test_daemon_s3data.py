"""Platform-loaded data (EDAS; docs/data.md) against a real SeaweedFS and a real torpord:
declared data with `source = "s3://…"` is loaded by the daemon while the instance starts and
handed to setup() as a memfd (sealed when read-only: a write through it is refused); a request's
`{"$ref": "s3://…"}` reaches the handler as bytes; torpor.dump writes a result back in the
background; a missing object, a size that differs and a key that climbs out of the tenant's
space are each one error naming the cause."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from objstore_server import Seaweed, running_seaweed

from .conftest import Torpord

BUCKET = "edas"
WEIGHTS = os.urandom(3 << 20) + b"end"  # a few MiB: several reads, one object

HANDLER = '''
import hashlib
import torpor


@torpor.function
class F:
    def setup(self):
        self.weights = torpor.load_bytes("weights")
        # A segment of the device-memory hook, read from the memfd (kept after the memfd closes).
        self.view = torpor.load("weights", buffer=True)
        try:
            with open(torpor.load("weights"), "r+b") as f:
                f.write(b"x")
            self.readonly = "written"
        except OSError as e:
            self.readonly = f"refused ({e.errno})"
        with open(torpor.load("scratch"), "r+b") as f:
            f.write(b"Z")  # writable data is the instance's own copy
            f.seek(0)
            self.scratch = f.read().decode()

    def __call__(self, request):
        out = {"sha": hashlib.sha256(self.weights).hexdigest(), "readonly": self.readonly,
               "scratch": self.scratch, "view_sha": hashlib.sha256(self.view).hexdigest(),
               "view_readonly": self.view.readonly}
        if "input" in request:
            out["input"] = [type(request["input"]).__name__, hashlib.sha256(request["input"]).hexdigest()]
            out["nested"] = request["nested"][1]["deep"].decode()
        if "dump" in request:
            t = time.perf_counter()
            torpor.dump("out", {"echo": request["dump"]})
            out["dump_s"] = time.perf_counter() - t
        if "dump_readonly" in request:
            torpor.dump("weights", b"x")
        if "late" in request:
            torpor.load_bytes("weights")
        return out
'''


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seaweed]:
    yield from running_seaweed(tmp_path_factory.mktemp("seaweedfs-edas"), BUCKET)


def start_node(torpor_bin: Path, seaweed: Seaweed, root: Path, *extra: str) -> Torpord:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    seaweed.config(root, BUCKET)
    section = (
        f'[objstore]\nendpoint = "{seaweed.endpoint}"\nbucket = "{BUCKET}"\n'
        f'credentials_file = "{root / (BUCKET + ".credentials")}"\n'
    )
    return Torpord(torpor_bin, root, *extra, config=section)


@pytest.fixture(scope="module")
def node(torpor_bin: Path, criu_ready: None, seaweed: Seaweed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Torpord]:
    d = start_node(torpor_bin, seaweed, tmp_path_factory.mktemp("edas-node"))
    try:
        yield d
    finally:
        d.stop()


def function_dir(root: Path, name: str, data: str) -> Path:
    d = root / name
    d.mkdir()
    (d / "torpor.toml").write_text(f'name = "{name}"\nentry = "handler:F"\ntimeout_s = 30\n{data}')
    (d / "handler.py").write_text("import time\n" + HANDLER)
    return d


def data_entries(weights_size: int = len(WEIGHTS), weights_key: str = "models/w.bin") -> str:
    return (
        f'[[data]]\nname = "weights"\nsource = "s3://{BUCKET}/{weights_key}"\nsize = {weights_size}\n'
        f'[[data]]\nname = "scratch"\nsource = "s3://{BUCKET}/scratch.txt"\nsize = 64\naccess = "writable"\n'
        f'[[data]]\nname = "out"\nsource = "s3://{BUCKET}/results/out.json"\nsize = 4096\naccess = "writable"\n'
    )


def upload(seaweed: Seaweed) -> None:
    # Tenant "default"'s space in the bucket: data/default/.
    seaweed.put_object(BUCKET, "data/default/models/w.bin", WEIGHTS)
    seaweed.put_object(BUCKET, "data/default/scratch.txt", b"abc")
    seaweed.put_object(BUCKET, "data/default/results/out.json", b"{}")
    seaweed.put_object(BUCKET, "data/default/inputs/x.bin", b"\x00\x01input")
    seaweed.put_object(BUCKET, "data/default/inputs/y.txt", b"deep one")


def deploy_fails(node: Torpord, fdir: Path) -> str:
    r = node.cli("deploy", fdir)
    assert r.returncode != 0, r.stdout
    return r.stderr.strip()


def test_declared_data_refs_and_dump_go_through_the_object_store(node: Torpord, seaweed: Seaweed, tmp_path: Path) -> None:
    upload(seaweed)
    lines = node.deploy(function_dir(tmp_path, "edas-a", data_entries()))
    load = next(line for line in lines if line.get("phase") == "load")
    # The loads ran while the base booted; the deploy reports both figures.
    assert load["data_s"] > 0 and 0 <= load["data_wait_s"] <= load["data_s"] + 1.0, load

    r = node.invoke("edas-a", {"input": {"$ref": f"s3://{BUCKET}/inputs/x.bin"},
                               "nested": [0, {"deep": {"$ref": f"s3://{BUCKET}/inputs/y.txt"}}],
                               "dump": [1, "two"]})
    assert r.status == 200, (r.body, node.log_text())
    out = r.json()
    assert out["sha"] == out["view_sha"] == hashlib.sha256(WEIGHTS).hexdigest(), out
    assert out["view_readonly"] is True, out
    # Read-only data is a sealed memfd: the write through a reopened descriptor is refused.
    assert out["readonly"].startswith("refused"), out
    assert out["scratch"] == "Zbc", out
    assert out["input"] == ["bytes", hashlib.sha256(b"\x00\x01input").hexdigest()], out
    assert out["nested"] == "deep one", out
    assert out["dump_s"] < 0.5, out  # the handler did not wait for the store

    deadline = time.monotonic() + 20
    while True:
        got = seaweed.get_object(BUCKET, "data/default/results/out.json")
        if got is not None and got != b"{}":
            break
        assert time.monotonic() < deadline, node.log_text()
        time.sleep(0.1)
    assert json.loads(got) == {"echo": [1, "two"]}
    assert "torpor.dump written" in node.log_text()
    metrics = node.request("GET", "/metrics").body.decode()
    assert 'torpor_dumps_total{function="edas-a",outcome="written"} 1' in metrics, metrics[-2000:]
    assert 'torpor_dumps_total{function="edas-a",outcome="failed"} 0' in metrics

    # Access modes and the data's lifetime are checked in the handler.
    r = node.invoke("edas-a", {"dump_readonly": 1})
    assert r.status == 500 and "read-only" in r.json()["error"]["message"], r.body
    r = node.invoke("edas-a", {"late": 1})
    assert r.status == 500 and "setup() and the warm-up" in r.json()["error"]["message"], r.body


def test_a_missing_reference_or_one_out_of_the_tenants_space_is_one_error(node: Torpord, seaweed: Seaweed, tmp_path: Path) -> None:
    upload(seaweed)
    node.deploy(function_dir(tmp_path, "edas-b", data_entries()))
    r = node.invoke("edas-b", {"input": {"$ref": f"s3://{BUCKET}/inputs/nowhere.bin"}})
    assert r.status == 404, r.body
    msg = r.json()["error"]
    assert "data/default/inputs/nowhere.bin" in msg and "\n" not in msg, msg
    r = node.invoke("edas-b", {"input": {"$ref": f"s3://{BUCKET}/../functions/edas-b.json"}})
    assert r.status == 422 and "'..' segment" in r.json()["error"], r.body
    r = node.invoke("edas-b", {"input": {"$ref": "s3://another-bucket/x"}})
    assert r.status == 422 and f"this node's object store is bucket {BUCKET}" in r.json()["error"], r.body


def test_a_missing_object_or_a_wrong_size_fails_the_deploy_naming_the_key(node: Torpord, seaweed: Seaweed, tmp_path: Path) -> None:
    upload(seaweed)
    err = deploy_fails(node, function_dir(tmp_path, "edas-c", data_entries(weights_key="models/missing.bin")))
    assert "no object data/default/models/missing.bin in bucket edas" in err, err
    assert len(err.splitlines()) == 1, err
    err = deploy_fails(node, function_dir(tmp_path, "edas-d", data_entries(weights_size=len(WEIGHTS) - 1)))
    assert "has more than" in err and "data/default/models/w.bin" in err, err
    err = deploy_fails(node, function_dir(tmp_path, "edas-e", data_entries(weights_size=len(WEIGHTS) + 1)))
    assert f"has {len(WEIGHTS)} bytes, but {len(WEIGHTS) + 1} are declared" in err, err
    err = deploy_fails(node, function_dir(tmp_path, "edas-f", data_entries(weights_key="../functions/x.json")))
    assert "data[0].source" in err and "'..' segment" in err, err


def test_a_booted_cold_start_loads_the_data_again(
    torpor_bin: Path, criu_ready: None, seaweed: Seaweed, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """`--cold-start boot` (no snapshot at invoke): each boot fetches the objects while the
    worker launches, and setup() sees the store's current object."""
    upload(seaweed)
    d = start_node(torpor_bin, seaweed, tmp_path_factory.mktemp("edas-boot"), "--cold-start", "boot")
    try:
        d.deploy(function_dir(tmp_path, "edas-boot", data_entries()))
        r = d.invoke("edas-boot", {})
        assert r.status == 200 and r.start == "booted", (r.status, r.body, d.log_text())
        assert r.json()["sha"] == hashlib.sha256(WEIGHTS).hexdigest() and r.json()["scratch"] == "Zbc", r.body
        # A new object of the same size: the next boot loads it.
        replaced = bytes(reversed(WEIGHTS))
        seaweed.put_object(BUCKET, "data/default/models/w.bin", replaced)
        assert d.cli("stop", "edas-boot").returncode == 0
        deadline = time.monotonic() + 30
        while any(i.get("pid") for i in d.instances("edas-boot")):
            assert time.monotonic() < deadline, d.instances("edas-boot")
            time.sleep(0.1)
        r = d.invoke("edas-boot", {})
        assert r.status == 200 and r.start == "booted", (r.status, r.body)
        assert r.json()["sha"] == hashlib.sha256(replaced).hexdigest(), r.body
    finally:
        d.stop()
        seaweed.put_object(BUCKET, "data/default/models/w.bin", WEIGHTS)


def test_without_an_objstore_or_in_another_bucket_the_deploy_fails_before_it_starts(
    node: Torpord, torpor_bin: Path, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    err = deploy_fails(node, function_dir(tmp_path, "edas-g", data_entries().replace(f"s3://{BUCKET}/models", "s3://elsewhere/models")))
    assert "deploy failed in validate" in err and f"this node's object store is bucket {BUCKET}" in err, err
    plain = Torpord(torpor_bin, tmp_path_factory.mktemp("edas-plain"))
    try:
        err = deploy_fails(plain, function_dir(tmp_path, "edas-h", data_entries()))
        assert "deploy failed in validate" in err and "has no [objstore] in torpord.toml" in err, err
        assert len(err.splitlines()) == 1, err
    finally:
        plain.stop()


def test_a_memfd_setup_keeps_open_travels_in_the_snapshot(node: Torpord, seaweed: Seaweed, tmp_path: Path) -> None:
    """docs/data.md: a file setup() keeps open on the data keeps the memfd, and CRIU stores it
    (sealed) in the snapshot: the restored instance still reads it."""
    upload(seaweed)
    d = function_dir(tmp_path, "edas-open", data_entries())
    (d / "handler.py").write_text(
        "import torpor\n\n@torpor.function\nclass F:\n"
        "    def setup(self):\n        self.f = open(torpor.load('weights'), 'rb')\n\n"
        "    def __call__(self, request):\n        self.f.seek(len(self.f.read()) - 3)\n"
        "        return {'tail': self.f.read().decode()}\n"
    )
    node.deploy(d)
    r = node.invoke("edas-open", {})
    assert r.status == 200 and r.start == "restored", (r.status, r.body, node.log_text())
    assert r.json() == {"tail": "end"}, r.body


SANDBOXED = "[scaling]\nsandbox = true\n"

PLAIN_HANDLER = '''
import torpor


@torpor.function
class G:
    def setup(self):
        pass

    def __call__(self, request):
        return {"plain": True}
'''


def test_a_sandbox_member_gets_its_data_again_when_a_newcomer_loads_it(node: Torpord, seaweed: Seaweed, tmp_path: Path) -> None:
    """A sandboxed function that declares data from the object store, deployed first; a second
    function of its group deployed after it loads it next to itself, running its setup() again,
    which reads the data: the daemon fetches it for that load too. Both then answer from one
    sandbox, the first with its object's bytes."""
    upload(seaweed)
    first = function_dir(tmp_path, "edas-sb-data", data_entries() + SANDBOXED)
    node.deploy(first)
    second = tmp_path / "edas-sb-plain"
    second.mkdir()
    (second / "torpor.toml").write_text(f'name = "edas-sb-plain"\nentry = "handler:G"\ntimeout_s = 30\n{SANDBOXED}')
    (second / "handler.py").write_text(PLAIN_HANDLER)
    node.deploy(second)
    a = node.invoke("edas-sb-data", {})
    assert a.status == 200, (a.status, a.body, node.log_text())
    assert a.json()["sha"] == hashlib.sha256(WEIGHTS).hexdigest() and a.json()["readonly"].startswith("refused"), a.body
    b = node.invoke("edas-sb-plain", {})
    assert b.status == 200 and b.json() == {"plain": True}, (b.status, b.body)
    # One sandbox serves both: the group's host holds the two functions.
    (host,) = node.instances("edas-sb-plain") or node.instances("edas-sb-data")
    assert host["pid"], host


DUMPER = '''
import torpor
from torpor import data


@torpor.function
class D:
    def setup(self):
        pass

    def __call__(self, request):
        if "forge" in request:
            # What hostile code can do: call the harness's sink naming another function.
            data._dump_sink(request["forge"], "out", b"forged")
            return {"forged": True}
        torpor.dump("out", {"by": request["by"]})
        return {"note": torpor.load_bytes("note").decode()}
'''


def dumper_dir(root: Path, name: str, note: str) -> Path:
    d = root / name
    d.mkdir()
    (d / "note.txt").write_text(note)
    (d / "torpor.toml").write_text(
        f'name = "{name}"\nentry = "handler:D"\ntimeout_s = 30\n'
        '[[data]]\nname = "note"\npath = "note.txt"\n'
        f'[[data]]\nname = "out"\nsource = "s3://{BUCKET}/results/{name}.json"\nsize = 4096\naccess = "writable"\n'
        + SANDBOXED
    )
    (d / "handler.py").write_text(DUMPER)
    return d


def wait_object(seaweed: Seaweed, key: str, node: Torpord, unlike: bytes = b"{}") -> bytes:
    deadline = time.monotonic() + 20
    while True:
        got = seaweed.get_object(BUCKET, key)
        if got is not None and got != unlike:
            return got
        assert time.monotonic() < deadline, node.log_text()
        time.sleep(0.1)


def test_each_function_of_a_sandbox_reads_and_dumps_its_own_data(node: Torpord, seaweed: Seaweed, tmp_path: Path) -> None:
    """Two sandboxed functions declare data under the same names (`note`, a file; `out`, an
    object): each request reads its own function's file and torpor.dump writes its own
    function's object, though one worker hosts both. A dump frame that names a function outside
    the sandbox (hostile code calling the harness's sink) is refused and counted."""
    upload(seaweed)
    for name in ("sb-d1", "sb-d2"):
        seaweed.put_object(BUCKET, f"data/default/results/{name}.json", b"{}")
    node.deploy(dumper_dir(tmp_path, "sb-d1", "one"))
    node.deploy(dumper_dir(tmp_path, "sb-d2", "two"))  # the host: it loads sb-d1 after itself
    for name, note in (("sb-d1", "one"), ("sb-d2", "two")):
        r = node.invoke(name, {"by": name})
        assert r.status == 200 and r.json() == {"note": note}, (name, r.status, r.body, node.log_text())
        got = wait_object(seaweed, f"data/default/results/{name}.json", node)
        assert json.loads(got) == {"by": name}, (name, got)
    (host,) = node.instances("sb-d2") or node.instances("sb-d1")
    assert host["function"] == "sb-d2", host

    # edas-a's object, outside the sandbox: a forged dump never reaches it.
    seaweed.put_object(BUCKET, "data/default/results/out.json", b"{}")
    node.deploy(function_dir(tmp_path, "edas-victim", data_entries()))
    r = node.invoke("sb-d1", {"forge": "edas-victim"})
    assert r.status == 200, (r.status, r.body)
    deadline = time.monotonic() + 20
    while 'torpor_dumps_total{function="sb-d2",outcome="refused"} 1' not in node.request("GET", "/metrics").body.decode():
        assert time.monotonic() < deadline, node.log_text()
        time.sleep(0.1)
    assert "not in its sandbox" in node.log_text()
    assert seaweed.get_object(BUCKET, "data/default/results/out.json") == b"{}"
