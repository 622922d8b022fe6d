"""Fuzzing workflow.toml's parser, python/torpor/workflow.py (issue 13 item 5): a tenant writes this
file and torpord runs the parser on it (`python3 -m torpor.workflow DIR`) before it records a
workflow. Tool: Hypothesis, derandomized, as for torpor.toml (tests/sdk/test_fuzz_spec.py, whose
mutations this reuses); a longer campaign: TORPOR_FUZZ_EXAMPLES=20000 (docs/fuzzing.md).

Inputs: examples/vision-workflow/workflow.toml mutated, plus stage graphs generated whole (names,
`after` lists with unknown, repeated and self references, cycles, more than 64 stages), parsed
from a real directory (parse_dir: the file read with its checks, then the TOML and every key).
Properties: it returns the JSON form or raises SpecError whose message is one line; never another
exception; a JSON form names valid names only, lists each stage once, and orders every stage after
the stages it takes (a DAG); parsing is deterministic. Summary line: `FUZZ {...}`, appended to
TORPOR_FUZZ_REPORT when set.
"""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torpor.errors import SpecError
from torpor.spec import NAME_RE
from torpor.workflow import MAX_STAGES, parse_dir

from .test_fuzz_spec import EXAMPLES, mutate, mutation, report

ROOT = Path(__file__).resolve().parents[2]
SEEDS = [p.read_bytes() for p in sorted(ROOT.glob("examples/*/workflow.toml"))]
RESULTS = {"executions": 0, "parsed": 0}

NAMES = st.sampled_from(["detect", "classify", "caption", "a", "b", "..", "A", "x" * 80, "", "d/e", "f\x00"])


@st.composite
def graphs(draw: st.DrawFn) -> bytes:
    """A workflow.toml written whole: stages whose `after` lists may name anything."""
    n = draw(st.integers(0, MAX_STAGES + 2))
    names = [draw(NAMES) if draw(st.booleans()) else f"s{i}" for i in range(n)]
    lines = [f"name = {json.dumps(draw(NAMES))}"]
    if draw(st.booleans()):
        lines.append(f"tenant = {json.dumps(draw(NAMES))}")
    for name in names:
        after = draw(st.lists(st.sampled_from([*names, "ghost"]) if names else st.just("ghost"), max_size=4))
        lines += ["[[stage]]", f"function = {json.dumps(name)}", f"after = {json.dumps(after)}"]
    return "\n".join(lines).encode()


workflow_bytes = st.one_of(
    st.builds(mutate, st.sampled_from(SEEDS), st.lists(mutation, max_size=8)),
    graphs(),
    st.binary(max_size=200),
)


@settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(text=workflow_bytes)
# Inputs that must always be refused, replayed first: a cycle, a stage after itself, a name that
# walks a path, no stage at all.
@example(text=b'name = "w"\n[[stage]]\nfunction = "a"\nafter = ["b"]\n[[stage]]\nfunction = "b"\nafter = ["a"]\n')
@example(text=b'name = "w"\n[[stage]]\nfunction = "a"\nafter = ["a"]\n')
@example(text=b'name = ".."\n[[stage]]\nfunction = "a"\n')
@example(text=b'name = "w"\n')
# And one that must parse (the properties of a parsed workflow are checked on it every run).
@example(text=b'name = "w"\n[[stage]]\nfunction = "a"\n[[stage]]\nfunction = "b"\nafter = ["a"]\n')
def test_fuzz_workflow_parser(text: bytes, tmp_path_factory: object) -> None:
    RESULTS["executions"] += 1
    wdir = Path(getattr(tmp_path_factory, "getbasetemp")()) / "wf"
    wdir.mkdir(exist_ok=True)
    (wdir / "workflow.toml").write_bytes(text)
    try:
        doc = parse_dir(wdir)
    except SpecError as e:
        assert str(e) and "\n" not in str(e), repr(str(e))
        return
    assert NAME_RE.fullmatch(doc["name"]) and NAME_RE.fullmatch(doc["tenant"]), doc
    order = [s["function"] for s in doc["stages"]]
    assert order and len(order) == len(set(order)) <= MAX_STAGES, order
    for i, s in enumerate(doc["stages"]):
        assert NAME_RE.fullmatch(s["function"]), s
        assert all(a in order[:i] for a in s["after"]), (s, order)
    assert json.loads(json.dumps(doc)) == parse_dir(wdir)
    RESULTS["parsed"] += 1


def test_fuzz_workflow_summary() -> None:
    """One summary line of the campaign above (it ran first: pytest keeps file order)."""
    # The properties of a parsed workflow were checked, not only refusals (the example above
    # parses; how many generated inputs do depends on Hypothesis's version).
    assert RESULTS["parsed"] >= 1, RESULTS
    report("sdk_workflow", RESULTS)
