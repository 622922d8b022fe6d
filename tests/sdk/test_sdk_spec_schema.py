"""One definition of the function spec: spec.py's JSON (`python3 -m torpor.spec`, what torpord
reads at deploy) must fit python/torpor/spec.schema.json, which torpord's FunctionSpec generates
(crates/torpord/src/spec.rs). A key added on one side only fails here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from sdkd import PYTHON_DIR, ROOT
from torpor.spec import SpecError, parse_dir, parse_text

SCHEMA = json.loads((PYTHON_DIR / "torpor" / "spec.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
DIRS = sorted(
    p.parent
    for base, pattern in (
        ("examples", "*/torpor.toml"),
        # A workflow's stages: examples/vision-workflow/detect, examples/vision-bert/detect, ...
        ("examples", "*/*/torpor.toml"),
        ("tests/sdk/functions", "*/torpor.toml"),
        ("tests/daemon/functions", "*/torpor.toml"),
    )
    for p in (ROOT / base).glob(pattern)
)


def spec_json(fdir: Path) -> dict[str, Any] | None:
    """spec.py's JSON for `fdir`, or None where spec.py refuses it (a test's bad spec)."""
    try:
        return parse_dir(fdir, check_files=False).to_json()
    except SpecError:
        return None


def test_there_are_functions_to_check() -> None:
    assert len(DIRS) >= 10, DIRS


@pytest.mark.parametrize("fdir", DIRS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_spec_spec_py_accepts_fits_the_daemons_definition(fdir: Path) -> None:
    doc = spec_json(fdir)
    if doc is None:
        pytest.skip(f"{fdir.name}: spec.py refuses it (a test of bad specs)")
    errors = [e.message for e in VALIDATOR.iter_errors(doc)]
    assert not errors, f"{fdir}: {errors} (change crates/torpord/src/spec.rs and regenerate, or spec.py)"


def test_every_optional_table_filled_in_fits_too(tmp_path: Path) -> None:
    (tmp_path / "w.bin").write_bytes(b"abc")
    spec = parse_text(
        """
name = "full"
entry = "model:M"
python = "python3"
preload = ["json"]
gpus = 1
gpu_memory = "1GiB"
timeout_s = 2.5
[[data]]
name = "w"
path = "w.bin"
[warmup]
request = {x = [1.0, 2], s = "t"}
[scaling]
max_instances = 2
requests_per_instance = 3
standby = 1
[keepalive]
gpu_release_s = 1
hibernate_s = 2
evict_s = 3
[gpu]
pack_weights = false
""",
        tmp_path,
        check_files=False,
    )
    VALIDATOR.validate(spec.to_json())


def test_a_key_the_daemon_does_not_define_fails() -> None:
    doc = spec_json(ROOT / "examples" / "cpu-mlp")
    assert doc is not None
    doc["scaling"]["burst"] = 2
    assert not VALIDATOR.is_valid(doc)
    del doc["scaling"]["burst"]
    del doc["timeout_s"]
    assert not VALIDATOR.is_valid(doc)
