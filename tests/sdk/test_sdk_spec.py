"""torpor.toml parsing: a good spec, defaults, sizes, the JSON form, and every kind of error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sdkd import TINYMLP, worker_env
from torpor.errors import SpecError
from torpor.spec import Gpu, Keepalive, Scaling, parse_dir, parse_size

DOC_EXAMPLE = """
name = "cpu-mlp"
entry = "model:MLP"
python = "python3"
preload = ["numpy"]
gpus = 0
gpu_memory = "0"
timeout_s = 30
[[data]]
name = "weights"
path = "weights.npy"
size = "16MiB"
access = "read-only"
[warmup]
request = { x = [0.0, 1.0] }
[scaling]
max_instances = 4
requests_per_instance = 1
[keepalive]
gpu_release_s = 30
hibernate_s = 120
evict_s = 600
"""


def make_dir(tmp: Path, toml: str, files: dict[str, int] | None = None) -> Path:
    d = tmp / "fn"
    d.mkdir(exist_ok=True)
    (d / "torpor.toml").write_text(toml)
    (d / "model.py").write_text("")
    for name, size in (files if files is not None else {"weights.npy": 16 << 20}).items():
        p = d / name
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as f:
            f.truncate(size)
    return d


def error_of(tmp: Path, toml: str, files: dict[str, int] | None = None) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_dir(make_dir(tmp, toml, files))
    return info.value


def test_the_documented_example_parses(tmp_path: Path) -> None:
    spec = parse_dir(make_dir(tmp_path, DOC_EXAMPLE))
    assert spec.name == "cpu-mlp" and spec.module == "model" and spec.class_name == "MLP"
    assert spec.preload == ("numpy",) and spec.gpus == 0 and spec.gpu_memory == 0 and spec.timeout_s == 30
    (d,) = spec.data
    assert (d.name, d.path, d.size, d.access) == ("weights", "weights.npy", 16 << 20, "read-only")
    assert d.abs_path == (tmp_path / "fn" / "weights.npy").resolve()
    assert spec.warmup is not None and spec.warmup.request == {"x": [0.0, 1.0]}
    assert spec.scaling == Scaling(4, 1) and spec.keepalive == Keepalive(30, 120, 600)


def test_defaults(tmp_path: Path) -> None:
    spec = parse_dir(make_dir(tmp_path, 'name = "f"\nentry = "model:F"\n', {}))
    assert spec.to_json() == {
        "dir": str((tmp_path / "fn").resolve()),
        "name": "f",
        "tenant": "default",
        "workflow": None,
        "entry": "model:F",
        "module": "model",
        "class": "F",
        "python": "python3",
        "preload": [],
        "gpus": 0,
        "gpu_memory": 0,
        "timeout_s": 30,
        "load_timeout_s": None,
        "memory_limit": None,
        "cpu_limit": None,
        "pids_limit": None,
        "data": [],
        "warmup": None,
        "scaling": {
            "max_instances": 4,
            "requests_per_instance": 1,
            "standby": 0,
            "standby_gpu": "live",
            "sandbox": False,
            "sandbox_memory": None,
            "pooled": True,
        },
        "keepalive": {"gpu_release_s": 30, "hibernate_s": 120, "evict_s": 600, "memory_release_s": 2},
        "gpu": {"pack_weights": True, "shrink_context": True},
    }


def test_standby_up_to_max_instances(tmp_path: Path) -> None:
    toml = 'name = "g"\nentry = "model:G"\ngpus = 1\n[scaling]\nmax_instances = 2\nstandby = 2\n'
    spec = parse_dir(make_dir(tmp_path, toml, {}))
    assert spec.scaling == Scaling(2, 1, 2)
    (tmp_path / "released").mkdir()
    assert spec.to_json()["scaling"] == {"max_instances": 2, "requests_per_instance": 1, "standby": 2, "standby_gpu": "live", "sandbox": False, "sandbox_memory": None, "pooled": True}
    released = parse_dir(make_dir(tmp_path / "released", toml + 'standby_gpu = "released"\n', {}))
    assert released.to_json()["scaling"]["standby_gpu"] == "released"


def test_gpu_pack_weights_can_be_turned_off(tmp_path: Path) -> None:
    toml = 'name = "g"\nentry = "model:G"\ngpus = 1\n[gpu]\npack_weights = false\n'
    spec = parse_dir(make_dir(tmp_path, toml, {}))
    assert spec.gpu == Gpu(pack_weights=False) and spec.to_json()["gpu"] == {"pack_weights": False, "shrink_context": True}
    (tmp_path / "keep").mkdir()
    keep = parse_dir(make_dir(tmp_path / "keep", 'name = "g"\nentry = "model:G"\ngpus = 1\n[gpu]\nshrink_context = false\n', {}))
    assert keep.to_json()["gpu"] == {"pack_weights": True, "shrink_context": False}


def test_size_auto_takes_the_file_size_and_gpu_memory(tmp_path: Path) -> None:
    toml = (
        'name = "g"\nentry = "pkg.mod:Cls"\ngpus = 1\ngpu_memory = "4GiB"\n'
        '[[data]]\nname = "a"\npath = "sub/../sub/a.bin"\naccess = "writable"\n'
        '[[data]]\nname = "b"\npath = "b.bin"\nsize = "auto"\n'
    )
    d = make_dir(tmp_path, toml, {"sub/a.bin": 1234, "b.bin": 0})
    (d / "pkg").mkdir()
    spec = parse_dir(d)
    assert spec.gpu_memory == 4 << 30 and spec.module == "pkg.mod"
    assert [(x.name, x.path, x.size, x.access) for x in spec.data] == [
        ("a", "sub/a.bin", 1234, "writable"),
        ("b", "b.bin", 0, "read-only"),
    ]


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("0", 0),
        ("512", 512),
        ("16MiB", 16 << 20),
        ("4GiB", 4 << 30),
        ("1.5 GiB", 3 << 29),
        ("2kB", 2000),
        ("3GB", 3 * 10**9),
        (7, 7),
    ],
)
def test_sizes(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "MiB", "-1", "1.3B", "16 mib", "4 GiBs", "1e3", "0x10"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


BASE = 'name = "f"\nentry = "model:F"\n'
W = '[[data]]\nname = "weights"\npath = "weights.npy"\n'


@pytest.mark.parametrize(
    ("toml", "key", "words"),
    [
        ('name = "f"\n', "entry", "is missing"),
        ('entry = "model:F"\n', "name", "is missing"),
        ('name = "Bad Name"\nentry = "model:F"\n', "name", "lower-case"),
        ('name = 3\nentry = "model:F"\n', "name", "must be a string, got 3"),
        ('name = "f"\nentry = "model.F"\n', "entry", "must be module:Class"),
        ('name = "f"\nentry = "other:F"\n', "entry", "neither other.py nor the package other/"),
        (BASE + "nmae = 1\n", "nmae", "did you mean name?"),
        (BASE + "colour = 1\n", "colour", "remove it"),
        (BASE + 'python = "python 3"\n', "python", "without spaces"),
        (BASE + 'preload = "numpy"\n', "preload", "must be an array"),
        (BASE + 'preload = ["numpy", "numpy"]\n', "preload[1]", "repeats"),
        (BASE + 'preload = ["numpy", "9lives"]\n', "preload[1]", "module name"),
        (BASE + "gpus = 2\n", "gpus", "integer from 0 to 1, got 2"),
        (BASE + "gpus = true\n", "gpus", "got true"),
        (BASE + 'gpu_memory = "4GiB"\n', "gpu_memory", "but gpus = 0"),
        (BASE + 'gpus = 1\ngpu_memory = "4 gigs"\n', "gpu_memory", "unknown unit"),
        (BASE + "timeout_s = 0\n", "timeout_s", "> 0 and ≤ 86400, got 0"),
        (BASE + 'timeout_s = "30"\n', "timeout_s", 'got "30"'),
        (BASE + "timeout_s = inf\n", "timeout_s", "got inf"),
        (
            BASE + '[scaling]\nmax_instances = "four"\n',
            "scaling.max_instances",
            'must be an integer from 1 to 1024, got "four"',
        ),
        (BASE + "[scaling]\nmax_instances = 0\n", "scaling.max_instances", "from 1 to 1024, got 0"),
        (BASE + "[scaling]\nrequests_per_instance = 1.5\n", "scaling.requests_per_instance", "got 1.5"),
        (BASE + "[scaling]\nmax = 1\n", "scaling.max", "did you mean max_instances?"),
        (BASE + "[scaling]\nstandby = -1\n", "scaling.standby", "integer from 0 to 1024, got -1"),
        (BASE + '[scaling]\nstandby = "1"\n', "scaling.standby", 'got "1"'),
        (BASE + "[scaling]\nstandby = 5\n", "scaling.standby", "is 5, more than max_instances = 4"),
        (BASE + "[scaling]\nmax_instances = 1\nstandby = 2\n", "scaling.standby", "at most 1"),
        (BASE + '[scaling]\nstandby_gpu = "hot"\n', "scaling.standby_gpu", 'must be "released" or "live", got "hot"'),
        (BASE + "[scaling]\nstandby_gpu = 1\n", "scaling.standby_gpu", "must be a string"),
        (BASE + "scaling = 3\n", "scaling", "must be a table"),
        (BASE + "[keepalive]\nhibernate_s = -1\n", "keepalive.hibernate_s", "from 0 to 3.1536e+07, got -1"),
        (BASE + "[keepalive]\nevict = 1\n", "keepalive.evict", "did you mean evict_s?"),
        (BASE + '[gpu]\npack_weights = "no"\n', "gpu.pack_weights", 'must be true or false, got "no"'),
        (BASE + "[gpu]\npack = false\n", "gpu.pack", "did you mean pack_weights?"),
        (BASE + "[gpu]\nshrink_context = 0\n", "gpu.shrink_context", "must be true or false, got 0"),
        (BASE + "gpu = 1\n", "gpu", "must be a table"),
        (BASE + "[warmup]\n", "warmup.request", "is missing"),
        (BASE + "[warmup]\nrequest = { at = 1979-05-27T07:32:00Z }\n", "warmup.request.at", "date/time"),
        (BASE + "[warmup]\nrequest = [nan]\n", "warmup.request[0]", "JSON cannot carry"),
        (BASE + "[warmup]\nrequest = 1\nrepeat = 2\n", "warmup.repeat", "is not a known key"),
        (BASE + "data = 1\n", "data", "array of tables"),
        (BASE + '[[data]]\npath = "weights.npy"\n', "data[0].name", "is missing"),
        (BASE + '[[data]]\nname = "1w"\npath = "weights.npy"\n', "data[0].name", "must be a letter"),
        (BASE + W + W, "data[1].name", 'repeats "weights"'),
        (BASE + '[[data]]\nname = "w"\n', "data[0].path", "is missing"),
        (BASE + '[[data]]\nname = "w"\npath = "/etc/passwd"\n', "data[0].path", "absolute path"),
        (BASE + '[[data]]\nname = "w"\npath = "../x"\n', "data[0].path", "leaves the function dir"),
        (BASE + '[[data]]\nname = "w"\npath = "a/../../x"\n', "data[0].path", "leaves the function dir"),
        (BASE + '[[data]]\nname = "w"\npath = "nope.bin"\n', "data[0].path", "does not exist"),
        (BASE + '[[data]]\nname = "w"\npath = "."\n', "data[0].path", "the function dir itself"),
        (BASE + W + 'size = "1MiB"\n', "data[0].size", "is 1048576 bytes but weights.npy has 16777216 bytes"),
        (BASE + W + "size = true\n", "data[0].size", "must be a size"),
        (BASE + W + 'access = "rw"\n', "data[0].access", 'got "rw"'),
        (BASE + W + "mode = 1\n", "data[0].mode", "keys of [[data]]"),
    ],
)
def test_errors_name_the_key(tmp_path: Path, toml: str, key: str, words: str) -> None:
    e = error_of(tmp_path, toml)
    msg = str(e)
    assert e.key == key, msg
    assert msg.startswith(f"torpor.toml: {key} "), msg
    assert words in msg, msg
    assert "\n" not in msg and "; " in msg, f"one line with a fix after '; ': {msg}"


def test_file_level_errors(tmp_path: Path) -> None:
    e = error_of(tmp_path, 'name = "f"\nentry = ')
    assert e.key is None and "is not valid TOML" in str(e) and "fix the syntax" in str(e)
    with pytest.raises(SpecError, match="not found in"):
        parse_dir(tmp_path)
    with pytest.raises(SpecError, match="is not a directory"):
        parse_dir(tmp_path / "nothing-here")
    d = make_dir(tmp_path, "")
    (d / "torpor.toml").write_bytes(b'name = "\xff"\n')
    with pytest.raises(SpecError, match="not valid UTF-8"):
        parse_dir(d)


def test_symlinks_must_stay_inside(tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x")
    d = make_dir(tmp_path, BASE + '[[data]]\nname = "w"\npath = "link.bin"\n', {})
    (d / "link.bin").symlink_to(outside)
    with pytest.raises(SpecError, match="symlink that leads out of the function dir") as info:
        parse_dir(d)
    assert info.value.key == "data[0].path"
    (d / "link.bin").unlink()
    (d / "real.bin").write_bytes(b"abc")
    (d / "link.bin").symlink_to("real.bin")
    assert parse_dir(d).data[0].size == 3
    (d / "link.bin").unlink()
    (d / "link.bin").mkdir()
    with pytest.raises(SpecError, match="not a regular file"):
        parse_dir(d)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torpor.spec", *args],
        capture_output=True,
        text=True,
        env=worker_env("unused"),
        timeout=30,
    )


def test_cli_prints_one_json_line_or_one_error_line(tmp_path: Path) -> None:
    r = run_cli(str(TINYMLP))
    assert r.returncode == 0 and r.stderr == "", r
    assert r.stdout.endswith("\n") and r.stdout.count("\n") == 1
    doc = json.loads(r.stdout)
    assert doc == parse_dir(TINYMLP).to_json()
    assert list(doc) == ["dir", "name", "tenant", "workflow", "entry", "module", "class", "python", "preload", "gpus", "gpu_memory",
                         "timeout_s", "load_timeout_s", "memory_limit", "cpu_limit", "pids_limit", "data", "warmup", "scaling", "keepalive", "gpu"]  # fmt: skip
    assert doc["data"] == [
        {
            "name": "weights",
            "path": "weights.f32",
            "abs_path": str(TINYMLP / "weights.f32"),
            "size": 268,
            "access": "read-only",
        }
    ]
    d = make_dir(tmp_path, BASE + '[scaling]\nmax_instances = "four"\n')
    r = run_cli(str(d))
    assert r.returncode == 1 and r.stdout == "", r
    assert r.stderr == (
        'torpor.toml: scaling.max_instances must be an integer from 1 to 1024, got "four"; '
        "write e.g. max_instances = 4\n"
    )
    r = run_cli()
    assert r.returncode == 2 and "usage" in r.stderr


# Every number of torpor.toml at its limits and just beyond (issue 20: `gpu_release_s = 1e300`
# panicked torpord, `timeout_s = 1e308` made every invoke fail, `max_instances = 2^63-1` passed).
# (key path, TOML text of the largest accepted value, of values refused, the range's words)
LIMITS = [
    ("timeout_s", "86400", ["86400.5", "1e308", "99999999999999999999", "1" + "0" * 400, "0", "-1"], "≤ 86400"),
    ("load_timeout_s", "3600", ["3601", "1e300", "0", "-0.5", "nan"], "≤ 3600"),
    ("gpu_memory", '"1TiB"', ['"1025GiB"', str(2**63 - 1), '"' + "9" * 70 + '"'], "up to 1 TiB"),
    ("scaling.max_instances", "1024", ["1025", str(2**63 - 1), "0"], "from 1 to 1024"),
    ("scaling.requests_per_instance", "1024", ["1025", str(2**63 - 1), "0"], "from 1 to 1024"),
    ("scaling.standby", "1024", [str(2**63 - 1), "-1"], "from 0 to 1024"),
    ("keepalive.gpu_release_s", "31536000", ["31536001", "1e300", "-1"], "from 0 to 3.1536e+07"),
    ("keepalive.hibernate_s", "31536000", ["31536000.5", "1e300", "-1"], "from 0 to 3.1536e+07"),
    ("keepalive.evict_s", "31536000", ["31536001", "1e300", "-1"], "from 0 to 3.1536e+07"),
    ("memory_limit", '"1TiB"', ['"1025GiB"', '"31MiB"', "0", str(2**63 - 1), '"lots"'], "1 TiB"),
    ("cpu_limit", "1024", ["1025", "0", "0.009", "-1", "nan", "inf", "1e300", '"2"'], "from 0.01 to 1024"),
    ("pids_limit", "65536", ["65537", "15", "0", str(2**63 - 1)], "from 16 to 65536"),
    ("data[0].size", '"auto"', ['"1025TiB"', str(2**63 - 1)], "up to 1 PiB"),
]


def _limit_toml(key: str, value: str) -> str:
    table, _, leaf = key.rpartition(".")
    extra = "gpus = 1\n" if key == "gpu_memory" else ""
    if key == "scaling.standby":
        # standby ≤ max_instances: let max_instances allow the largest standby.
        return BASE + f"[scaling]\nmax_instances = 1024\nstandby = {value}\n"
    if table == "data[0]":
        return BASE + W + f"size = {value}\n"
    if table:
        return BASE + extra + f"[{table}]\n{leaf} = {value}\n"
    return BASE + extra + f"{leaf} = {value}\n"


@pytest.mark.parametrize(("key", "largest", "refused", "words"), LIMITS, ids=[k for k, *_ in LIMITS])
def test_every_number_is_bounded(tmp_path: Path, key: str, largest: str, refused: list[str], words: str) -> None:
    spec = parse_dir(make_dir(tmp_path, _limit_toml(key, largest)))
    json.dumps(spec.to_json(), allow_nan=False)
    for value in refused:
        e = error_of(tmp_path, _limit_toml(key, value))
        msg = str(e)
        assert e.key == key, f"{value}: {msg}"
        assert words in msg, f"{value}: {msg}"
        assert "\n" not in msg and len(msg) < 400, f"{value}: one short line: {msg}"


def test_load_timeout_is_carried_or_left_to_the_daemon(tmp_path: Path) -> None:
    assert parse_dir(make_dir(tmp_path, BASE)).to_json()["load_timeout_s"] is None
    spec = parse_dir(make_dir(tmp_path, BASE + "load_timeout_s = 2.5\n"))
    assert spec.to_json()["load_timeout_s"] == 2.5


def test_limits_are_carried_or_left_to_the_daemon(tmp_path: Path) -> None:
    spec = parse_dir(make_dir(tmp_path, BASE + 'memory_limit = "256MiB"\ncpu_limit = 0.5\npids_limit = 64\n'))
    j = spec.to_json()
    assert (j["memory_limit"], j["cpu_limit"], j["pids_limit"]) == (256 << 20, 0.5, 64)
    e = error_of(tmp_path, BASE + 'memory_limit = "16MiB"\n')
    assert str(e) == (
        'torpor.toml: memory_limit must be a size from 32 MiB to 1 TiB, got "16MiB"; write e.g. memory_limit = "2GiB"'
    ), e


def test_the_tenant_is_a_name_and_defaults_to_default(tmp_path: Path) -> None:
    assert parse_dir(make_dir(tmp_path, BASE)).to_json()["tenant"] == "default"
    assert parse_dir(make_dir(tmp_path, BASE + 'tenant = "team-a.1"\n')).to_json()["tenant"] == "team-a.1"
    for bad in ['"Team"', '"../x"', '""', '"a b"', '"a|b"', '"-a"', '"' + "a" * 64 + '"', "1", "true"]:
        e = error_of(tmp_path, BASE + f"tenant = {bad}\n")
        msg = str(e)
        assert e.key == "tenant", f"{bad}: {msg}"
        assert msg.startswith("torpor.toml: tenant "), f"{bad}: {msg}"
        assert "\n" not in msg and len(msg) < 400, f"{bad}: {msg}"


def test_python_is_a_command_or_an_absolute_path(tmp_path: Path) -> None:
    e = error_of(tmp_path, BASE + 'python = "../../usr/bin/python3"\n')
    assert e.key == "python" and "relative path" in str(e) and "absolute path" in str(e), e
    e = error_of(tmp_path, BASE + 'python = "bin/python3"\n')
    assert e.key == "python", e
    assert parse_dir(make_dir(tmp_path, BASE + 'python = "/usr/bin/python3"\n')).python == "/usr/bin/python3"
    assert parse_dir(make_dir(tmp_path, BASE + 'python = "python3.11"\n')).python == "python3.11"


def test_an_entry_module_symlinked_out_of_the_dir_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.py"
    outside.write_text("")
    d = make_dir(tmp_path, 'name = "f"\nentry = "handler:F"\n', {})
    (d / "handler.py").symlink_to(outside)
    e = error_of(tmp_path, 'name = "f"\nentry = "handler:F"\n', {})
    assert e.key == "entry" and "symlink that leads out of the function dir" in str(e), e
    # A package directory, and a module inside one, are checked too.
    (d / "handler.py").unlink()
    (tmp_path / "pkg").mkdir()
    (d / "pkg").symlink_to(tmp_path / "pkg")
    e = error_of(tmp_path, 'name = "f"\nentry = "pkg.mod:F"\n', {})
    assert e.key == "entry" and "pkg" in str(e), e
    (d / "pkg").unlink()
    (d / "pkg").mkdir()
    (d / "pkg" / "mod.py").symlink_to(outside)
    e = error_of(tmp_path, 'name = "f"\nentry = "pkg.mod:F"\n', {})
    assert e.key == "entry" and "pkg/mod.py" in str(e), e
    # A link that stays inside is fine.
    (d / "pkg" / "mod.py").unlink()
    (d / "pkg" / "real.py").write_text("")
    (d / "pkg" / "mod.py").symlink_to("real.py")
    parse_dir(make_dir(tmp_path, 'name = "f"\nentry = "pkg.mod:F"\n', {}))


def test_a_symlinked_or_special_torpor_toml_is_never_read(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text('name = "leaked-secret-line"\nthis is = not toml at all\n')
    d = make_dir(tmp_path, "", {})
    (d / "torpor.toml").unlink()
    (d / "torpor.toml").symlink_to(secret)
    with pytest.raises(SpecError, match="is a symlink") as info:
        parse_dir(d)
    assert "leaked" not in str(info.value) and "line 2" not in str(info.value)
    (d / "torpor.toml").unlink()
    os.mkfifo(d / "torpor.toml")  # would block a reader forever
    with pytest.raises(SpecError, match="not a regular file"):
        parse_dir(d)
    (d / "torpor.toml").unlink()
    with open(d / "torpor.toml", "wb") as f:
        f.truncate((1 << 20) + 1)
    with pytest.raises(SpecError, match="more than the 1048576 bytes"):
        parse_dir(d)


def test_a_source_is_an_s3_key_in_the_tenants_space_with_a_size(tmp_path: Path) -> None:
    base = 'name = "f"\nentry = "model:F"\n[[data]]\nname = "w"\n'
    for sub in ("ok", "file", *(f"bad{i}" for i in range(8))):
        (tmp_path / sub).mkdir()
    d = make_dir(tmp_path / "ok", base + 'source = "s3://torpor-data/models/w.bin"\nsize = "1KiB"\naccess = "writable"\n')
    (entry,) = parse_dir(d).to_json()["data"]
    assert entry == {"name": "w", "path": "", "abs_path": "", "size": 1024, "access": "writable",
                     "source": "s3://torpor-data/models/w.bin"}
    # A file entry carries no source key at all (specs of before stay byte-identical).
    d2 = make_dir(tmp_path / "file", base + 'path = "w.bin"\n', {"w.bin": 3})
    assert "source" not in parse_dir(d2).to_json()["data"][0]
    for i, (body, key, words) in enumerate([
        ('source = "s3://torpor-data/w.bin"\n', "data[0].size", "must be given with source"),
        ('source = "s3://torpor-data/w.bin"\nsize = "auto"\n', "data[0].size", "must be given with source"),
        ('source = "s3://torpor-data/a/../../functions/f.json"\nsize = 3\n', "data[0].source", "'..' segment"),
        ('source = "s3://torpor-data//w"\nsize = 3\n', "data[0].source", "'..' segment"),
        ('source = "s3://torpor-data/"\nsize = 3\n', "data[0].source", "no key"),
        ('source = "https://x/w"\nsize = 3\n', "data[0].source", "not an s3:// URI"),
        ('source = "s3://A_B/w"\nsize = 3\n', "data[0].source", "not a bucket name"),
        ('source = "s3://torpor-data/w"\npath = "w.bin"\nsize = 3\n', "data[0].path", "not both"),
    ]):
        e = error_of(tmp_path / f"bad{i}", base + body, {"w.bin": 3})
        assert str(e).startswith(f"torpor.toml: {key} "), e
        assert words in str(e) and "\n" not in str(e), e


def test_outside_a_worker_source_data_and_dump_say_why_not(tmp_path: Path) -> None:
    import torpor
    from torpor import data
    from torpor.errors import DataError

    d = make_dir(tmp_path, 'name = "f"\nentry = "model:F"\n[[data]]\nname = "out"\nsource = "s3://b-b/o"\nsize = 8\naccess = "writable"\n'
                 '[[data]]\nname = "ro"\nsource = "s3://b-b/r"\nsize = 8\n')
    torpor.use_dir(d)
    try:
        with pytest.raises(DataError, match="torpord loads for setup"):
            torpor.load_bytes("out")
        with pytest.raises(DataError, match="no request is running"):
            torpor.dump("out", b"12")
        with pytest.raises(DataError, match="more than the 8 allowed"):
            torpor.dump("out", b"123456789")
        with pytest.raises(DataError, match="read-only"):
            torpor.dump("ro", b"1")
        sent: list[tuple[str, str, bytes]] = []
        data.set_dump_sink(lambda f, n, b: sent.append((f, n, b)))
        try:
            torpor.dump("out", {"a": 1})
            torpor.dump("out", "é")
        finally:
            data.set_dump_sink(None)
        # use_dir binds as no function in particular: the worker names its own.
        assert sent == [("", "out", b'{"a":1}'), ("", "out", "é".encode())]
    finally:
        data.unbind()
    assert data.with_refs({"x": [{"$ref": "s3://b-b/k", "data": "QUJD"}], "y": {"$ref": "s3://b-b/k"}}) == {
        "x": [b"ABC"], "y": {"$ref": "s3://b-b/k"}}


def test_platform_managed_gpu_data_is_declared_strictly(tmp_path: Path) -> None:
    head = 'name = "f"\nentry = "model:F"\n'
    entry = '[[data]]\nname = "w"\npath = "weights.npy"\n'
    spec = parse_dir(make_dir(tmp_path, head + "gpus = 1\n" + entry + 'device = "cuda"\n'))
    (d,) = spec.data
    assert d.device == "cuda" and d.to_json()["device"] == "cuda"
    assert "device" not in parse_dir(make_dir(tmp_path, head + entry)).data[0].to_json()
    e = error_of(tmp_path, head + entry + 'device = "cuda"\n')
    assert str(e).startswith("torpor.toml: data[0].device ") and "gpus = 0" in str(e) and "set gpus = 1" in str(e), e
    e = error_of(tmp_path, head + "gpus = 1\n" + entry + 'device = "gpu"\n')
    assert 'must be "host" or "cuda"' in str(e), e
    e = error_of(tmp_path, head + 'gpus = 1\n[[data]]\nname = "w"\nsource = "s3://b-b/o"\nsize = 8\ndevice = "cuda"\n')
    assert "from a file in the function dir only" in str(e), e
    assert "\n" not in str(e)
    # A sandboxed function's GPU data is filled for it like any other's (docs/sandboxes.md).
    sandboxed = parse_dir(make_dir(tmp_path, head + "gpus = 1\n" + entry + 'device = "cuda"\n[scaling]\nsandbox = true\n'))
    assert sandboxed.scaling.sandbox and sandboxed.data[0].device == "cuda"


def test_outside_a_worker_gpu_data_says_why_not_and_the_host_path_works(tmp_path: Path) -> None:
    """On a machine without a GPU (or outside a worker) device="cuda" is one clear error; the
    file stays readable the host way."""
    import torpor
    from torpor import data
    from torpor.errors import DataError

    d = make_dir(
        tmp_path,
        'name = "f"\nentry = "model:F"\ngpus = 1\n[[data]]\nname = "w"\npath = "weights.npy"\ndevice = "cuda"\n'
        '[[data]]\nname = "h"\npath = "h.bin"\n',
        {"weights.npy": 4096, "h.bin": 16},
    )
    torpor.use_dir(d)
    try:
        assert torpor.load("w") == d / "weights.npy"
        assert len(torpor.load_bytes("w")) == 4096
        cases = [
            (lambda: torpor.load("w", device="cuda"), "no GPU memory was filled for it in this process"),
            (lambda: torpor.load("h", device="cuda"), 'is not declared device = "cuda"'),
            (lambda: torpor.load("w", device="tpu"), 'device is "host" (the default) or "cuda"'),  # type: ignore[call-overload]
            (lambda: torpor.load("w", buffer=True, device="cuda"), "pick one"),  # type: ignore[call-overload]
        ]
        for call, words in cases:
            with pytest.raises(DataError) as info:
                call()
            assert words in str(info.value) and "\n" not in str(info.value), info.value
    finally:
        data.unbind()


def test_workflow_and_sandbox(tmp_path: Path) -> None:
    toml = 'name = "f"\nentry = "model:F"\nworkflow = "vision"\n[scaling]\nsandbox = true\n'
    spec = parse_dir(make_dir(tmp_path, toml, {}))
    assert spec.workflow == "vision" and spec.scaling.sandbox is True
    doc = spec.to_json()
    assert doc["workflow"] == "vision" and doc["scaling"]["sandbox"] is True
    for sub in ("a", "b", "c"):
        (tmp_path / sub).mkdir()
    e = error_of(tmp_path / "a", 'name = "f"\nentry = "model:F"\n[scaling]\nsandbox = 1\n', {})
    assert "scaling.sandbox must be true or false" in str(e)
    e = error_of(tmp_path / "b", 'name = "f"\nentry = "model:F"\nworkflow = "A B"\n', {})
    assert str(e).startswith("torpor.toml: workflow must be 1-63 lower-case letters"), str(e)
    e = error_of(tmp_path / "c", 'name = "f"\nentry = "model:F"\nworkflow = 3\n', {})
    assert "workflow must be a string" in str(e)


def test_a_sandboxed_function_may_keep_out_of_the_ready_sandboxes(tmp_path: Path) -> None:
    toml = 'name = "f"\nentry = "model:F"\n[scaling]\nsandbox = true\npooled = false\n'
    spec = parse_dir(make_dir(tmp_path, toml, {}))
    assert spec.scaling.pooled is False and spec.to_json()["scaling"]["pooled"] is False
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    e = error_of(tmp_path / "a", 'name = "f"\nentry = "model:F"\n[scaling]\npooled = false\n', {})
    assert "scaling.pooled is set but sandbox = false" in str(e) and "\n" not in str(e), str(e)
    e = error_of(tmp_path / "b", 'name = "f"\nentry = "model:F"\n[scaling]\nsandbox = true\npooled = "no"\n', {})
    assert "scaling.pooled must be true or false" in str(e), str(e)


def test_sandbox_memory_and_memory_release(tmp_path: Path) -> None:
    toml = (
        'name = "f"\nentry = "model:F"\n[scaling]\nsandbox = true\nsandbox_memory = "8GiB"\n'
        "[keepalive]\nmemory_release_s = 0.5\n"
    )
    spec = parse_dir(make_dir(tmp_path, toml, {}))
    assert spec.scaling.sandbox_memory == 8 << 30 and spec.keepalive.memory_release_s == 0.5
    doc = spec.to_json()
    assert doc["scaling"]["sandbox_memory"] == 8 << 30 and doc["keepalive"]["memory_release_s"] == 0.5
    for sub in ("a", "b", "c", "d"):
        (tmp_path / sub).mkdir()
    e = error_of(tmp_path / "a", 'name = "f"\nentry = "model:F"\n[scaling]\nsandbox_memory = "1GiB"\n', {})
    assert "scaling.sandbox_memory is set but sandbox = false" in str(e) and "\n" not in str(e), str(e)
    e = error_of(tmp_path / "b", 'name = "f"\nentry = "model:F"\n[scaling]\nsandbox = true\nsandbox_memory = "4KiB"\n', {})
    assert "less than 1 MiB" in str(e), str(e)
    e = error_of(tmp_path / "c", 'name = "f"\nentry = "model:F"\n[scaling]\nsandbox = true\nsandbox_memory = "lots"\n', {})
    assert str(e).startswith("torpor.toml: scaling.sandbox_memory"), str(e)
    e = error_of(tmp_path / "d", 'name = "f"\nentry = "model:F"\n[keepalive]\nmemory_release_s = -1\n', {})
    assert str(e).startswith("torpor.toml: keepalive.memory_release_s"), str(e)
