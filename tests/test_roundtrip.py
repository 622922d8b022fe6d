"""Snapshot a running CPU process, kill it, restore it: it carries on where it stopped."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import Torpor, Workers, error_line, manifest_files, nspid


def data_lines(path: Path) -> list[int]:
    """Sequence numbers of the lines the server appended to its data file."""
    return [int(line.split()[0]) for line in path.read_text().splitlines()]


def test_restored_process_continues_memory_file_and_sockets(
    torpor: Torpor, workers: Workers, tmp_path: Path
) -> None:
    w = workers.server()
    assert [w.ask("incr") for _ in range(3)] == ["1", "2", "3"]
    digest = w.ask("digest")
    before_file = w.ask_json("file")
    before_pid = w.ask_json("pid")
    inner_pid = nspid(w.child_pid)[-1]
    assert before_pid["pid"] == inner_pid

    snap = tmp_path / "snap"
    torpor.ok("snapshot", "--pid", w.init_pid, "--out", snap)
    assert snap.is_dir()
    w.wait_gone()  # without --leave-running the source is gone

    r = workers.restore(snap, endpoint=w.endpoint)
    assert r.init_pid != w.init_pid
    assert r.ask("get") == "3"
    assert r.ask("digest") == digest, "memory differs after restore"
    assert r.ask("incr") == "4"
    assert r.ask("digest") != digest

    # Same PID inside its namespace; the init is PID 1 there.
    assert r.ask_json("pid")["pid"] == inner_pid
    assert nspid(r.child_pid)[-1] == inner_pid
    assert nspid(r.init_pid)[-1] == 1

    # The held fd goes on appending to the same file, numbering continues without a gap.
    after_file = r.ask_json("file")
    assert isinstance(after_file["written"], int) and isinstance(before_file["written"], int)
    assert after_file["written"] > before_file["written"]
    assert after_file["size"] == after_file["written"]
    data = Path(workers.base / "server.data")
    assert data.stat().st_size == after_file["written"]
    seqs = data_lines(data)
    assert seqs == list(range(1, len(seqs) + 1)), f"data file lines out of sequence: {seqs}"

    # TCP inside the restored network namespace.
    assert r.ask_netns("incr", tcp=True) == "5"
    assert r.ask("get") == "5"


def test_verify_and_inspect(torpor: Torpor, workers: Workers, tmp_path: Path) -> None:
    w = workers.server()
    w.ask("incr")
    snap = tmp_path / "snap"
    summary = torpor.ok("snapshot", "--pid", w.init_pid, "--out", snap)
    assert summary.stdout.strip(), "snapshot prints a summary on stdout"

    v = torpor.ok("verify", snap)
    assert "ok" in v.stdout.lower()

    text = torpor.ok("inspect", snap).stdout
    assert "stateful_server.py" in text, f"inspect does not show the command:\n{text}"

    doc = torpor.inspect_json(snap)
    files = manifest_files(doc)
    # The manifest and its MAC (the writer's seal of the manifest) are never listed.
    assert (snap / "manifest.mac").is_file(), "the snapshot is not sealed"
    on_disk = {str(p.relative_to(snap)) for p in snap.rglob("*") if p.is_file()} - {"manifest.json", "manifest.mac"}
    listed = {str(f["path"]) for f in files}
    assert listed == on_disk, f"manifest lists {sorted(listed ^ on_disk)} differently from the directory"
    for f in files:
        assert isinstance(f["blake3"], str) and len(f["blake3"]) == 64, f
        assert f["size"] == (snap / str(f["path"])).stat().st_size
    assert "stateful_server.py" in json.dumps(doc)


def test_restore_without_detach_waits_and_returns_exit_status(
    torpor: Torpor, workers: Workers, tmp_path: Path
) -> None:
    w = workers.server(data_file=False)
    assert w.ask("incr") == "1"
    snap = tmp_path / "snap"
    torpor.ok("snapshot", "--pid", w.init_pid, "--out", snap)
    w.wait_gone()

    p, out, err = workers.popen_torpor("restore", snap)
    assert w.ask("get", wait=30) == "1"
    assert p.poll() is None, "restore without --detach must wait for the restored tree"
    assert w.ask("exit", "7") == "bye"
    code = p.wait(timeout=30)
    assert code == 7, f"restore exited {code}, expected the program's 7\n{err.read_text()}"

    # The snapshot is reusable: a second restore works after the first has gone.
    r = workers.restore(snap, endpoint=w.endpoint)
    assert r.ask("get") == "1"
    assert r.ask("incr") == "2"


def test_restore_of_missing_directory_fails_cleanly(torpor: Torpor, tmp_path: Path) -> None:
    line = error_line(torpor("restore", tmp_path / "nope", "--detach"))
    assert "nope" in line
