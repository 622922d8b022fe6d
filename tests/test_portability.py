"""Snapshot portability (issue 12, item 2): the files a restore maps again by path (the
executable, Python, its libraries) are recorded with their size and hash, and a restore on a
node whose copy differs is refused with one line naming the file."""

from __future__ import annotations

import shutil
from pathlib import Path

from conftest import Torpor, Workers, a_library


def test_restore_refuses_a_changed_library_and_names_it(
    torpor: Torpor, workers: Workers, tmp_path: Path
) -> None:
    lib = tmp_path / "libtorportest.so"
    shutil.copyfile(a_library(), lib)
    original = lib.read_bytes()
    w = workers.server(load_lib=lib)
    assert w.ask("incr") == "1"
    snap = tmp_path / "snap"
    torpor.ok("snapshot", "--pid", w.init_pid, "--out", snap)
    w.wait_gone()

    reopened = torpor.inspect_json(snap).get("reopened_files")
    assert isinstance(reopened, list), "manifest records no reopened_files"
    paths = {f["path"] for f in reopened}
    assert str(lib) in paths, paths
    assert any("python" in p for p in paths), paths

    # Same size, one byte changed: what another build on another node looks like.
    changed = bytearray(original)
    changed[-1] ^= 0xFF
    lib.write_bytes(bytes(changed))
    line = torpor.fails("restore", snap, "--detach")
    assert str(lib) in line and "cannot be restored on this node" in line, line

    lib.unlink()
    line = torpor.fails("restore", snap, "--detach")
    assert str(lib) in line, line

    lib.write_bytes(original)
    r = workers.restore(snap, endpoint=w.endpoint)
    assert r.ask("get") == "1"
