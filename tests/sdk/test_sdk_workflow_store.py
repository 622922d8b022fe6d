"""torpor.workflow (workflow.toml: strict keys, names, edges, the order of the stages, one error
line naming the key and the fix) and torpor.store within a process (the same object, consumed
once, expiry, bad keys, shared=True without torpord's store)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from sdkd import worker_env

import torpor
from torpor import store
from torpor.errors import SpecError
from torpor.workflow import parse_dir


def write(tmp: Path, text: str) -> Path:
    (tmp / "workflow.toml").write_text(text)
    return tmp


def test_stages_are_ordered_after_their_inputs(tmp_path: Path) -> None:
    wf = parse_dir(
        write(
            tmp_path,
            'name = "w"\ntenant = "t"\n'
            '[[stage]]\nfunction = "c"\nafter = ["a", "b"]\n'
            '[[stage]]\nfunction = "b"\nafter = ["a"]\n'
            '[[stage]]\nfunction = "a"\n',
        )
    )
    assert wf["name"] == "w" and wf["tenant"] == "t"
    assert [s["function"] for s in wf["stages"]] == ["a", "b", "c"]
    assert wf["stages"][2]["after"] == ["a", "b"]
    assert parse_dir(write(tmp_path, 'name = "w"\n[[stage]]\nfunction = "a"\n'))["tenant"] == "default"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('name = "w"\n', "stage must be one or more [[stage]] tables"),
        ('name = "W"\n[[stage]]\nfunction = "a"\n', "name must be 1-63 lower-case"),
        ('name = "w"\nextra = 1\n[[stage]]\nfunction = "a"\n', "extra is not a workflow key"),
        ('name = "w"\n[[stage]]\nfunction = "a"\nwhen = 1\n', "stage[0].when is not a stage key"),
        ('name = "w"\n[[stage]]\nfunction = "a"\n[[stage]]\nfunction = "a"\n', "names a a second time"),
        ('name = "w"\n[[stage]]\nfunction = "a"\nafter = ["x"]\n', "comes after 'x', which is no stage"),
        ('name = "w"\n[[stage]]\nfunction = "a"\nafter = "b"\n', "must be a list of distinct stage names"),
        (
            'name = "w"\n[[stage]]\nfunction = "a"\nafter = ["b"]\n[[stage]]\nfunction = "b"\nafter = ["a"]\n',
            "edges form a cycle among a, b",
        ),
        ("name = \n", "is not valid TOML"),
    ],
)
def test_a_wrong_workflow_is_one_line_naming_the_key(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(SpecError) as e:
        parse_dir(write(tmp_path, text))
    msg = str(e.value)
    assert msg.startswith("workflow.toml: ") and says in msg and "\n" not in msg, msg


def test_the_command_line_prints_json_or_one_error_line(tmp_path: Path) -> None:
    env = worker_env("unused")
    ok = subprocess.run(
        [sys.executable, "-m", "torpor.workflow", write(tmp_path, 'name = "w"\n[[stage]]\nfunction = "a"\n')],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    assert ok.returncode == 0 and '"stages": [{"function": "a", "after": []}]' in ok.stdout, ok
    (tmp_path / "workflow.toml").unlink()
    bad = subprocess.run(
        [sys.executable, "-m", "torpor.workflow", tmp_path], capture_output=True, text=True, check=False, env=env
    )
    assert bad.returncode == 1 and bad.stderr.startswith("workflow.toml: not found in"), bad.stderr


def test_the_store_hands_the_same_object_once() -> None:
    store.clear()
    value = {"rows": [1, 2, 3]}
    torpor.put("k", value)
    assert torpor.get("k", keep=True) is value
    assert torpor.get("k") is value
    with pytest.raises(KeyError, match="consumed"):
        torpor.get("k")
    torpor.put("short", value, ttl_s=0.05)
    time.sleep(0.08)
    with pytest.raises(KeyError):
        torpor.get("short")
    assert store.keys() == []


def test_the_store_refuses_bad_keys_and_ttls_and_shared_outside_a_sandbox() -> None:
    for key in ("", "x" * 257, 3):
        with pytest.raises(TypeError):
            torpor.put(key, 1)  # type: ignore[arg-type,unused-ignore]
    for ttl in (0, -1, True, 1e9):
        with pytest.raises(ValueError):
            torpor.put("k", 1, ttl_s=ttl)
    with pytest.raises(RuntimeError, match="sandbox = true"):
        torpor.put("k", b"bytes", shared=True)
    # nodes: None or "all", and "all" only through torpord's store (shared=True).
    for nodes in ("ALL", "node-b", ["all"], True):
        with pytest.raises(ValueError, match='nodes is None'):
            torpor.put("k", b"bytes", shared=True, nodes=nodes)  # type: ignore[arg-type,unused-ignore]
    with pytest.raises(ValueError, match="pass shared=True"):
        torpor.put("k", b"bytes", nodes="all")
    with pytest.raises(TypeError, match="shared is True or False"):
        torpor.put("k", b"bytes", shared=1)  # type: ignore[arg-type,unused-ignore]
    assert store.keys() == []
