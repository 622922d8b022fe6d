"""`pip install ./python` into a fresh virtual environment gives a working, typed SDK.

The SDK is installed the way a user installs it (pip, isolated build), then used from the venv's
own interpreter, away from the repository: it must import from site-packages, parse a real
function spec, and be seen as typed by mypy (PEP 561: py.typed shipped with the package)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from .installs import cargo_version, fresh_venv, imported_from, pip_install

ROOT = Path(__file__).resolve().parents[2]

TYPED_USE = """\
import torpor

@torpor.function
class Model:
    def setup(self) -> None:
        self.weights: bytes = torpor.load_bytes("weights")

    def __call__(self, request: object) -> dict[str, int]:
        return {"n": len(self.weights)}
"""

# load_bytes returns bytes: mypy must say so, which it only can if it reads the package's types.
# What pip says when it cannot reach a package index (offline machines).
NO_INDEX = re.compile(
    r"No matching distribution found for hatchling|Failed to establish a new connection|Temporary failure in name resolution"
)

MISTYPED_USE = 'import torpor\nn: int = torpor.load_bytes("weights")\n'


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = fresh_venv(tmp_path_factory.mktemp("sdk-venv") / "venv")
    r = pip_install(d, ROOT / "python")
    if r.returncode != 0 and NO_INDEX.search(r.stderr):
        # The GPU machine has no network: pip cannot fetch the build backend (hatchling) there.
        pytest.skip(f"no package index reachable for the build backend: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, f"pip install ./python failed:\n{r.stdout}\n{r.stderr}"
    return d


def test_the_installed_sdk_imports_from_the_venv_and_parses_a_spec(venv: Path, tmp_path: Path) -> None:
    assert imported_from(venv, tmp_path).is_relative_to(venv)
    spec = subprocess.run(
        [venv / "bin/python", "-m", "torpor.spec", ROOT / "examples/cpu-mlp"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert spec.returncode == 0, spec.stderr
    assert json.loads(spec.stdout)["name"] == "cpu-mlp"
    bad = subprocess.run(
        [venv / "bin/python", "-m", "torpor.spec", tmp_path],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 1 and "torpor.toml" in bad.stderr, bad.stderr


def test_the_installed_sdk_is_typed(venv: Path, tmp_path: Path) -> None:
    if subprocess.run([sys.executable, "-m", "mypy", "--version"], capture_output=True, check=False).returncode:
        pytest.skip("mypy is not installed here (make pytest installs it)")
    assert any(venv.glob("lib/python3*/site-packages/torpor/py.typed")), "py.typed was not installed"

    def mypy(source: str) -> subprocess.CompletedProcess[str]:
        f = tmp_path / "use.py"
        f.write_text(source)
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "mypy",
                "--strict",
                "--no-incremental",
                "--python-executable",
                venv / "bin/python",
                f,
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=False,
        )

    ok = mypy(TYPED_USE)
    assert ok.returncode == 0, ok.stdout
    wrong = mypy(MISTYPED_USE)
    assert wrong.returncode == 1, wrong.stdout
    assert re.search(r'expression has type "bytes", variable has type "int"', wrong.stdout), wrong.stdout


def test_the_python_packages_carry_the_workspace_version() -> None:
    # The wheel's version comes from Cargo itself (maturin); the SDK's pyproject states it.
    project = tomllib.loads((ROOT / "python/pyproject.toml").read_text())["project"]
    assert project["version"] == cargo_version(), "python/pyproject.toml: bump it with the Cargo workspace"
