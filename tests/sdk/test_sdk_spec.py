"""torpor.toml parsing: a good spec, defaults, sizes, the JSON form, and every kind of error."""

from __future__ import annotations

import json
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
        "entry": "model:F",
        "module": "model",
        "class": "F",
        "python": "python3",
        "preload": [],
        "gpus": 0,
        "gpu_memory": 0,
        "timeout_s": 30,
        "data": [],
        "warmup": None,
        "scaling": {"max_instances": 4, "requests_per_instance": 1, "standby": 0},
        "keepalive": {"gpu_release_s": 30, "hibernate_s": 120, "evict_s": 600},
        "gpu": {"pack_weights": True},
    }


def test_standby_up_to_max_instances(tmp_path: Path) -> None:
    toml = 'name = "g"\nentry = "model:G"\ngpus = 1\n[scaling]\nmax_instances = 2\nstandby = 2\n'
    spec = parse_dir(make_dir(tmp_path, toml, {}))
    assert spec.scaling == Scaling(2, 1, 2)
    assert spec.to_json()["scaling"] == {"max_instances": 2, "requests_per_instance": 1, "standby": 2}


def test_gpu_pack_weights_can_be_turned_off(tmp_path: Path) -> None:
    toml = 'name = "g"\nentry = "model:G"\ngpus = 1\n[gpu]\npack_weights = false\n'
    spec = parse_dir(make_dir(tmp_path, toml, {}))
    assert spec.gpu == Gpu(pack_weights=False) and spec.to_json()["gpu"] == {"pack_weights": False}


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
        (BASE + "timeout_s = 0\n", "timeout_s", "> 0, got 0"),
        (BASE + 'timeout_s = "30"\n', "timeout_s", 'got "30"'),
        (BASE + "timeout_s = inf\n", "timeout_s", "got inf"),
        (
            BASE + '[scaling]\nmax_instances = "four"\n',
            "scaling.max_instances",
            'must be an integer ≥ 1, got "four"',
        ),
        (BASE + "[scaling]\nmax_instances = 0\n", "scaling.max_instances", "≥ 1, got 0"),
        (BASE + "[scaling]\nrequests_per_instance = 1.5\n", "scaling.requests_per_instance", "got 1.5"),
        (BASE + "[scaling]\nmax = 1\n", "scaling.max", "did you mean max_instances?"),
        (BASE + "[scaling]\nstandby = -1\n", "scaling.standby", "integer ≥ 0, got -1"),
        (BASE + '[scaling]\nstandby = "1"\n', "scaling.standby", 'got "1"'),
        (BASE + "[scaling]\nstandby = 5\n", "scaling.standby", "is 5, more than max_instances = 4"),
        (BASE + "[scaling]\nmax_instances = 1\nstandby = 2\n", "scaling.standby", "at most 1"),
        (BASE + "scaling = 3\n", "scaling", "must be a table"),
        (BASE + "[keepalive]\nhibernate_s = -1\n", "keepalive.hibernate_s", "≥ 0, got -1"),
        (BASE + "[keepalive]\nevict = 1\n", "keepalive.evict", "did you mean evict_s?"),
        (BASE + '[gpu]\npack_weights = "no"\n', "gpu.pack_weights", 'must be true or false, got "no"'),
        (BASE + "[gpu]\npack = false\n", "gpu.pack", "did you mean pack_weights?"),
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
    assert list(doc) == ["dir", "name", "entry", "module", "class", "python", "preload", "gpus", "gpu_memory",
                         "timeout_s", "data", "warmup", "scaling", "keepalive", "gpu"]  # fmt: skip
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
        'torpor.toml: scaling.max_instances must be an integer ≥ 1, got "four"; '
        "write e.g. max_instances = 4\n"
    )
    r = run_cli()
    assert r.returncode == 2 and "usage" in r.stderr
