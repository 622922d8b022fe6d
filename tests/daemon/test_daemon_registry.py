"""Issue 13: a damaged registry refuses to start with one clear line, and is never reset.

Each case makes a registry the way a real daemon leaves it (started once, stopped), damages it one
way, and starts `torpor serve` on it: the daemon must exit 1 with one error line that names the
file, the cause and the fix, and leave the database file byte for byte as it was (nothing deleted,
nothing re-created). A missing or empty registry beside snapshots it would have named is refused
too: starting on it would make an empty registry, and the start-up sweep would remove them.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

FIX = "restore it from a backup, or move it and its -wal and -shm files aside"


def serve(binary: Path, root: Path, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    """`torpor serve` on `root/state`; stopped with SIGTERM once it listens (a start that works)."""
    sock = root / "torpord.sock"
    p = subprocess.Popen(
        [binary, "serve", "--state-dir", root / "state", "--socket", sock],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + timeout
    while p.poll() is None and not sock.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    if p.poll() is None:
        time.sleep(0.5)  # its signal handlers
        p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@pytest.fixture
def made(torpor_bin: Path, tmp_path: Path) -> Path:
    """A registry a daemon made and left (started once, stopped: its WAL checkpointed)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord runs as root")
    r = serve(torpor_bin, tmp_path)
    assert r.returncode == 0, r.stderr
    db = tmp_path / "state" / "registry.db"
    assert db.stat().st_size > 0
    return db


def digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def truncate(db: Path) -> None:
    os.truncate(db, 8192)


def garbage(db: Path) -> None:
    """Random bytes over every page but the header's (seeded: the same damage every run)."""
    with open(db, "r+b") as f:
        f.seek(4096)
        f.write(random.Random(0).randbytes(db.stat().st_size - 4096))


def not_a_database(db: Path) -> None:
    db.write_bytes(os.urandom(16384))


def future_schema(db: Path) -> None:
    c = sqlite3.connect(db)
    c.execute("UPDATE schema_version SET version = 99")
    c.commit()
    c.close()


def impossible_stage(db: Path) -> None:
    """A row no torpord writes, past the schema's CHECK (as a bit flip or a hand edit would)."""
    c = sqlite3.connect(db)
    c.execute("PRAGMA ignore_check_constraints = ON")
    c.execute("""INSERT INTO functions VALUES ('f', '/f', '{"name": "f"}', 'k', NULL, 'ready', 1, 1)""")
    c.execute("INSERT INTO instances VALUES ('f-1', 'f', 4242, 'frozen', NULL, 1, 1)")
    c.commit()
    c.close()


def impossible_pid(db: Path) -> None:
    """A live instance whose pid would make a recovery signal a whole process group."""
    c = sqlite3.connect(db)
    c.execute("""INSERT INTO functions VALUES ('f', '/f', '{"name": "f"}', 'k', NULL, 'ready', 1, 1)""")
    c.execute("INSERT INTO instances VALUES ('f-1', 'f', -1, 'warm', NULL, 1, 1)")
    c.commit()
    c.close()


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated": (truncate, "database disk image is malformed"),
    # Either SQLite's quick_check finds it, or (the schema spanning a damaged page) the open.
    "garbage": (garbage, "quick_check|database disk image is malformed"),
    "not_a_database": (not_a_database, "file is not a database"),
    # SQLite's quick_check re-checks the schema's CHECK constraints.
    "impossible_stage": (impossible_stage, "CHECK constraint failed in instances"),
    "impossible_pid": (impossible_pid, "has pid -1"),
}


def error_lines(r: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in r.stderr.splitlines() if line.startswith("torpor: error:")]


@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_registry_refuses_to_start_and_is_left_alone(torpor_bin: Path, made: Path, case: str) -> None:
    damage, cause = CASES[case]
    damage(made)
    before = digest(made)
    r = serve(torpor_bin, made.parent.parent)
    assert r.returncode == 1, r.stderr
    lines = error_lines(r)
    assert len(lines) == 1, r.stderr
    line = lines[0]
    assert f"registry {made} is damaged" in line, line
    assert re.search(cause, line), line
    assert FIX in line, line
    assert digest(made) == before, "the damaged registry was changed"
    # The same on every start: nothing was repaired or reset meanwhile.
    again = serve(torpor_bin, made.parent.parent)
    assert again.returncode == 1 and error_lines(again) == lines, again.stderr


def test_a_registry_from_the_future_is_refused(torpor_bin: Path, made: Path) -> None:
    future_schema(made)
    before = digest(made)
    r = serve(torpor_bin, made.parent.parent)
    assert r.returncode == 1, r.stderr
    (line,) = error_lines(r)
    assert f"registry {made} has schema version 99, newer than this torpord knows" in line, line
    assert "run the torpord that wrote it, or a newer one" in line, line
    assert digest(made) == before


@pytest.mark.parametrize("what", ["empty", "missing"])
def test_a_lost_registry_beside_snapshots_is_not_made_again(torpor_bin: Path, made: Path, what: str) -> None:
    snapshot = made.parent / "snapshots" / "fn-kept-1"
    snapshot.mkdir()
    (snapshot / "manifest.json").write_text("{}")
    for p in made.parent.glob("registry.db*"):
        p.unlink()
    if what == "empty":
        made.write_bytes(b"")
    r = serve(torpor_bin, made.parent.parent)
    assert r.returncode == 1, r.stderr
    (line,) = error_lines(r)
    assert f"registry {made} is {what}, but {made.parent / 'snapshots'} is not empty" in line, line
    assert "restore the registry from a backup, or move the state directory aside" in line, line
    assert snapshot.is_dir(), "a snapshot was swept"
    if what == "empty":
        assert made.stat().st_size == 0, "the empty registry was made again"
    else:
        assert not made.exists(), "the missing registry was made again"


def test_an_empty_state_directory_starts_with_a_new_registry(torpor_bin: Path, made: Path) -> None:
    """The first start, and one after an operator moved the old state aside, still work."""
    for p in made.parent.glob("registry.db*"):
        p.unlink()
    r = serve(torpor_bin, made.parent.parent)
    assert r.returncode == 0, r.stderr
    assert made.stat().st_size > 0
