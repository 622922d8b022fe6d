"""Fixtures for the SDK tests (helpers in sdkd.py): a listening daemon socket and worker spawner."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sdkd import Daemon, Spawner  # noqa: E402


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path / "workers.sock")
    try:
        yield d
    finally:
        d.close()


@pytest.fixture
def spawn(tmp_path: Path, daemon: Daemon) -> Iterator[Spawner]:
    s = Spawner(tmp_path, daemon)
    try:
        yield s
    finally:
        s.cleanup()


@pytest.fixture(scope="module")
def cuda() -> None:
    """Skips unless torch sees a CUDA device (the GPU machine's tests)."""
    r = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if r.stdout.strip() != "True":
        pytest.skip(f"needs a CUDA device visible to torch ({r.stdout.strip() or r.stderr.strip()[-200:]})")
