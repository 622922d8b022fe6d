"""Fuzzing torpor.toml's parser, python/torpor/spec.py (issue 13 item 5): a tenant writes this file
and the daemon runs the parser on it at every deploy. Tool: Hypothesis (a maintained property-based
testing and fuzzing library, already a test dependency), derandomized so that `make test` runs the
same bounded campaign every time; a longer one: TORPOR_FUZZ_EXAMPLES=20000 (docs/fuzzing.md).

Inputs: the real torpor.toml files of examples/ mutated (bytes flipped, inserted, deleted; tokens
that break parsers: `..`, NUL, huge numbers, nesting), parsed from a real function directory
(parse_dir: the file read with its checks, then the TOML and every key). Properties: it returns a
Spec or raises SpecError whose message is one line; never another exception (which the daemon would
report as a crash of the SDK); a Spec's JSON names a valid function and only data inside the
function's directory, and parsing is deterministic (the same text, the same JSON). Summary line:
`FUZZ {...}`, appended to TORPOR_FUZZ_REPORT when set.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torpor.errors import SpecError
from torpor.spec import NAME_RE, parse_dir

ROOT = Path(__file__).resolve().parents[2]
SEEDS = [p.read_bytes() for p in sorted(ROOT.glob("examples/*/torpor.toml"))]
TOKENS = [b"..", b"../../etc/passwd", b"/", b"\x00", b"\\u0000", b"-1", b"1e999", b"nan", b"inf",
          b"18446744073709551616", b"9223372036854775808", b'"', b"'''", b"[[data]]", b"[", b"]",
          b"=", b"\n", b"{", b"}", b"\xff\xfe", b"0x7fffffffffffffff", b"1e308", b"[[[[[[[[[[[[[[[["]
EXAMPLES = int(os.environ.get("TORPOR_FUZZ_EXAMPLES", "400"))
RESULTS = {"executions": 0}

mutation = st.one_of(
    st.tuples(st.just("flip"), st.floats(0, 1), st.integers(0, 7)),
    st.tuples(st.just("insert"), st.floats(0, 1), st.binary(min_size=1, max_size=12)),
    st.tuples(st.just("token"), st.floats(0, 1), st.sampled_from(TOKENS)),
    st.tuples(st.just("delete"), st.floats(0, 1), st.integers(1, 40)),
    st.tuples(st.just("truncate"), st.floats(0, 1), st.just(0)),
)


def mutate(seed: bytes, mutations: list[tuple[str, float, int | bytes]]) -> bytes:
    data = bytearray(seed)
    for kind, where, arg in mutations:
        at = min(int(where * (len(data) + 1)), len(data))
        if kind == "flip" and data and isinstance(arg, int):
            data[min(at, len(data) - 1)] ^= 1 << arg
        elif kind in ("insert", "token") and isinstance(arg, bytes):
            data[at:at] = arg
        elif kind == "delete" and isinstance(arg, int):
            del data[at : at + arg]
        elif kind == "truncate":
            del data[at:]
    return bytes(data)


toml_bytes = st.one_of(
    st.builds(mutate, st.sampled_from(SEEDS), st.lists(mutation, max_size=8)),
    st.binary(max_size=200),
)


def function_dir(tmp: Path) -> Path:
    """A real function directory: the cpu-mlp example's files and a data file of the size it declares."""
    fdir = tmp / "fn"
    if not fdir.exists():
        shutil.copytree(ROOT / "examples" / "cpu-mlp", fdir)
        (fdir / "weights.f32").write_bytes(b"\0" * 2704)
    return fdir


@settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(text=toml_bytes)
# Inputs that must always be refused, replayed first every run: a NUL in a data path, a data path
# that leaves the function's directory, a name that walks a path.
@example(text=b'name = "x"\nentry = "model:MLP"\n[[data]]\nname = "w"\npath = "a\\u0000b"\nsize = "1B"\n')
@example(text=b'name = "x"\nentry = "model:MLP"\n[[data]]\nname = "w"\npath = "../../etc/passwd"\nsize = "auto"\n')
@example(text=b'name = ".."\nentry = "model:MLP"\n')
def test_fuzz_spec_parser(text: bytes, tmp_path_factory: object) -> None:
    RESULTS["executions"] += 1
    tmp = Path(getattr(tmp_path_factory, "getbasetemp")())
    fdir = function_dir(tmp)
    (fdir / "torpor.toml").write_bytes(text)
    try:
        spec = parse_dir(fdir)
    except SpecError as e:
        assert str(e) and "\n" not in str(e), repr(str(e))
        return
    doc = spec.to_json()
    assert NAME_RE.fullmatch(doc["name"]), doc["name"]
    for d in doc["data"]:
        resolved = Path(d["abs_path"]).resolve()
        assert resolved.is_relative_to(fdir.resolve()), d
        assert "\0" not in d["path"]
    assert json.loads(json.dumps(doc)) == parse_dir(fdir).to_json()


def report(target: str, results: dict[str, int]) -> None:
    """One summary line of a campaign (`FUZZ {...}`, appended to TORPOR_FUZZ_REPORT when set)."""
    line = json.dumps({"target": target, "cases": EXAMPLES, "executions": results["executions"], "findings": 0})
    print(f"FUZZ {line}")
    path = os.environ.get("TORPOR_FUZZ_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    assert results["executions"] >= min(EXAMPLES, 100), results


def test_fuzz_spec_summary() -> None:
    """One summary line of the campaign above (it ran first: pytest keeps file order)."""
    report("sdk_spec", RESULTS)
