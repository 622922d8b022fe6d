"""What the packaging tests share: a fresh virtual environment, the package imported from it,
and a daemon started from some binary and waited for."""

from __future__ import annotations

import subprocess
import sys
import time
import tomllib
from pathlib import Path

from conftest import ROOT


def cargo_version() -> str:
    """The Cargo workspace's version, which every package carries."""
    return str(tomllib.loads((ROOT / "Cargo.toml").read_text())["workspace"]["package"]["version"])


def fresh_venv(d: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", d], check=True)
    return d


def pip_install(venv: Path, what: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [venv / "bin/pip", "install", "--quiet", "--disable-pip-version-check", what],
        capture_output=True,
        text=True,
        check=False,
    )


def imported_from(venv: Path, cwd: Path) -> Path:
    """Where the venv's interpreter imports `torpor` from, run from `cwd` (an empty directory, so
    that nothing of the checkout is on sys.path)."""
    r = subprocess.run(
        [venv / "bin/python", "-c", "import torpor, torpor.worker; print(torpor.__file__)"],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(r.stdout.strip())


def serve(
    argv: list[str | Path], sock: Path, log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """Starts `argv` (a `torpor serve`) and waits until it listens on `sock`."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log.open("wb"), env=env, cwd=cwd)
    deadline = time.monotonic() + 20
    while not sock.exists():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "torpord did not listen"
        time.sleep(0.02)
    return proc
