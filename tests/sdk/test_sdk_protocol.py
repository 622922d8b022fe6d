"""The worker and torpord speak one protocol: python/torpor/protocol.schema.json, generated from
torpord's frame types (crates/torpord/src/protocol.rs), against which a real worker's frames are
checked here (and in every SDK test, by sdkd.Conn)."""

from __future__ import annotations

import re
from typing import Any

import jsonschema
import pytest
from sdkd import (
    FROM_WORKER,
    ROOT,
    SCHEMA,
    TINYMLP,
    TO_WORKER,
    Daemon,
    Spawner,
    check_from_worker,
)
from torpor import worker
from torpor.spec import parse_dir


def types_of(direction: str) -> set[str]:
    return {v["properties"]["type"]["const"] for v in SCHEMA[direction]["oneOf"]}


def send_checked(conn: Any, frame: dict[str, Any]) -> None:
    """Sends a frame the daemon's types describe (and asserts that they do)."""
    TO_WORKER.validate(frame)
    conn.send(frame)


def test_the_schema_is_the_workers_protocol() -> None:
    assert SCHEMA["protocol"] == worker.PROTOCOL
    # Every frame torpord may send is one the worker takes, and the other way round.
    assert types_of("to_worker") == set(worker.SERVES) | set(worker.AFTER_SPLIT_QUIET) | set(worker.AFTER_LOAD)
    # Every frame type the worker sends is one torpord's types know.
    sent = set(re.findall(r'"type": "([a-z_]+)"', (ROOT / "python/torpor/worker.py").read_text()))
    sent -= {"ResultError"}  # an error document's type, not a frame's
    assert sent <= types_of("from_worker"), sent - types_of("from_worker")


def test_a_real_worker_takes_the_daemons_frames_and_sends_only_described_ones(
    spawn: Spawner, daemon: Daemon
) -> None:
    w = spawn("--role", "base")
    c = daemon.accept()
    assert c.expect("hello")["protocol"] == worker.PROTOCOL
    assert c.expect("ready")["ok"] is True
    spec = parse_dir(TINYMLP)
    send_checked(
        c,
        {
            "type": "load",
            "spec": spec.to_json(),
            "dir": str(spec.dir),
            "data": {d.name: str(d.abs_path) for d in spec.data},
        },
    )
    assert c.expect("ready", timeout=30)["ok"] is True, w.stderr()
    send_checked(c, {"type": "attached", "reattach_s": 5.0})
    send_checked(c, {"type": "invoke", "id": 1, "request": {"x": [1.0, 2.0, 3.0, 4.0]}, "timeout_s": 5.0})
    assert c.expect("started")["id"] == 1
    result = c.expect("result")
    assert result["ok"] is True and result["id"] == 1, result
    # A user error is a result too, with the error document the schema describes.
    send_checked(c, {"type": "invoke", "id": 2, "request": {"fail": "boom"}, "timeout_s": 5.0})
    c.expect("started")
    failed = c.expect("result")
    assert failed["ok"] is False and failed["error"]["type"] == "ValueError", failed
    send_checked(c, {"type": "quiesce"})
    assert c.expect("quiet")["type"] == "quiet"
    assert c.at_eof()


@pytest.mark.parametrize(
    ("frame", "why"),
    [
        ({"type": "started", "id": 1, "at": 0.5}, "a field torpord's types do not list"),
        ({"type": "hullo", "pid": 1}, "a type torpord does not take"),
        ({"type": "result", "id": "1", "ok": True}, "an id that is not an integer"),
        ({"type": "ready"}, "no ok"),
    ],
)
def test_a_frame_the_schema_does_not_describe_fails_the_check(frame: dict[str, Any], why: str) -> None:
    with pytest.raises(AssertionError, match="does not describe"):
        check_from_worker(frame)
    assert not FROM_WORKER.is_valid(frame), why


def test_the_daemons_frames_are_checked_too() -> None:
    with pytest.raises(jsonschema.ValidationError):
        TO_WORKER.validate({"type": "invoke", "id": 1, "request": {}})  # no timeout_s
    with pytest.raises(jsonschema.ValidationError):
        TO_WORKER.validate({"type": "unmap", "vas": ["0x1000"]})
    TO_WORKER.validate({"type": "map", "va": 4096, "size": 8192, "readonly": True, "fd": True})
