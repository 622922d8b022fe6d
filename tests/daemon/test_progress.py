"""Long steps show a spinner with the elapsed time on a terminal, and nothing more when stderr is
not one: `torpor deploy` against the live daemon and `torpor snapshot`, with stderr on a pty."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from conftest import kill_tree

from .conftest import FUNCTIONS, Torpord


def on_a_terminal(argv: list[str | Path], env: dict[str, str]) -> tuple[int, str, str]:
    """Runs argv with stderr on a pseudo-terminal; returns its status, stdout and the terminal's text."""
    master, slave = os.openpty()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL, env=env)
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    out = proc.stdout.read().decode() if proc.stdout else ""
    return proc.wait(timeout=120), out, seen.decode(errors="replace")


def test_deploy_shows_a_spinner_only_on_a_terminal(torpord: Torpord) -> None:
    env = dict(os.environ, TORPOR_SOCKET=str(torpord.socket))
    code, out, tty = on_a_terminal([torpord.binary, "deploy", FUNCTIONS / "echoer"], env)
    assert code == 0, out + tty
    assert "deployed echoer" in out and "snapshot_function" in out, out
    # The spinner's line: the step, then its elapsed time (indicatif's "0s").
    assert "deploy echoer:" in tty and "next phase" in tty, repr(tty)
    assert re.search(r"next phase (\x1b\[2m)?\d+s", tty), repr(tty)
    # Not a terminal: the same command prints nothing on stderr.
    piped = torpord.cli("deploy", FUNCTIONS / "echoer")
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr


def test_snapshot_shows_a_spinner_on_a_terminal(torpord: Torpord, tmp_path: Path) -> None:
    env = dict(os.environ)
    run = subprocess.run(
        [torpord.binary, "run", "--log", tmp_path / "sleep.log", "--", "sleep", "600"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    pid = int(run.stdout)
    try:
        out_dir = tmp_path / "snap"
        code, out, tty = on_a_terminal([torpord.binary, "snapshot", "--pid", str(pid), "--out", out_dir], env)
        assert code == 0, out + tty
        assert out.startswith(f"snapshot {out_dir}:"), out
        assert f"snapshot of pid {pid} into {out_dir}" in tty, repr(tty)
    finally:
        kill_tree(pid)
