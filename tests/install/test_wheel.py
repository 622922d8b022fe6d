"""The wheel (root pyproject.toml, maturin "bin" bindings) gives the CLI and the SDK in one
`pip install`: built here with the dev profile by scripts/build-wheel.sh (`make wheel` builds the
same wheel in release), installed into a fresh venv, and used from there: the binary on the venv's
PATH, the package in its site-packages, and a real deploy and invoke through `torpor serve` run
from the venv, which must find the SDK and the device-memory hook beside itself (no
TORPOR_PYTHONPATH, no TORPOR_HOOK_LIB, no checkout on any path)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, pids_with

from .installs import cargo_version, fresh_venv, imported_from, pip_install, serve

REQUEST = {"x": [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]}


def env_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(e.decode(errors="replace").split("=", 1) for e in raw.split(b"\0") if b"=" in e)


def workers_of(state: Path) -> list[int]:
    """Processes whose environment names a worker socket in `state`: the daemon's workers."""
    return [
        int(p)
        for p in os.listdir("/proc")
        if p.isdigit() and env_of(int(p)).get("TORPOR_WORKER_SOCKET", "").startswith(f"{state}/")
    ]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("cargo") is None:
        pytest.skip("no Rust toolchain here (the GPU machine): the wheel is built where cargo is")
    if subprocess.run([sys.executable, "-m", "maturin", "--version"], capture_output=True, check=False).returncode:
        pytest.skip("maturin is not installed here (make pytest installs it)")
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run(
        ["bash", ROOT / "scripts/build-wheel.sh", "dev", out],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (built,) = out.glob("torpor-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path) -> Iterator[Path]:
    # Not under /tmp: torpord's workers get a /tmp of their own (docs/mounts.md), so an
    # interpreter there is out of their reach (and refused at launch with one line).
    root = Path(tempfile.mkdtemp(prefix="torpor-wheel-venv-", dir="/var/tmp"))
    try:
        d = fresh_venv(root / "venv")
        r = pip_install(d, wheel)
        assert r.returncode == 0, r.stdout + r.stderr
        yield d
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_wheel_holds_the_binary_and_the_typed_package(wheel: Path) -> None:
    version = cargo_version()
    assert wheel.name.startswith(f"torpor-{version}-")
    names = zipfile.ZipFile(wheel).namelist()
    assert f"torpor-{version}.data/scripts/torpor" in names
    for module in ("__init__.py", "worker.py", "spec.py", "py.typed", "libtorpor_hook.so"):
        assert f"torpor/{module}" in names, names
    # The hook is the one the workspace builds (an ELF shared object exporting the C API the SDK
    # binds), not a stale or empty file.
    hook = zipfile.ZipFile(wheel).read("torpor/libtorpor_hook.so")
    assert hook[:4] == b"\x7fELF" and b"torpor_hook_abi_version" in hook, len(hook)


def test_one_install_gives_the_cli_and_the_sdk(venv: Path, tmp_path: Path) -> None:
    torpor = venv / "bin/torpor"
    r = subprocess.run([torpor, "--version"], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == f"torpor {cargo_version()}"
    assert imported_from(venv, tmp_path).is_relative_to(venv)


def test_the_installed_daemon_deploys_and_invokes_with_the_installed_sdk(venv: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    torpor = venv / "bin/torpor"
    fdir = tmp_path / "cpu-mlp"
    shutil.copytree(ROOT / "examples/cpu-mlp", fdir, ignore=shutil.ignore_patterns("__pycache__"))
    state, sock, log = tmp_path / "state", tmp_path / "torpord.sock", tmp_path / "torpord.log"
    # Nothing of the checkout: the daemon must find the SDK in the venv's site-packages, and the
    # workers run the venv's interpreter, which has no access to the repository's python/.
    # Nor the checkout's hook: the daemon must find the one the wheel installed in the package.
    dropped = ("TORPOR_PYTHONPATH", "PYTHONPATH", "TORPOR_SOCKET", "TORPOR_HOOK_LIB", "LD_PRELOAD")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    # cwd: the daemon's own directory is not the checkout either.
    daemon = serve([torpor, "serve", "--state-dir", state, "--socket", sock], sock, log, env, cwd=tmp_path)
    try:
        env["TORPOR_SOCKET"] = str(sock)
        installed_hook = imported_from(venv, tmp_path).parent / "libtorpor_hook.so"
        r = subprocess.run([torpor, "status", "--json"], capture_output=True, text=True, env=env, check=True)
        hook = json.loads(r.stdout)["hook"]
        assert hook["library"] == str(installed_hook), hook
        assert hook["missing"] is None and hook["split"] and hook["gpu_workers"] == "segments", hook
        r = subprocess.run([torpor, "status"], capture_output=True, text=True, env=env, check=True)
        assert f"hook        {installed_hook} (split on" in r.stdout, r.stdout
        r = subprocess.run([torpor, "deploy", fdir], capture_output=True, text=True, env=env, check=False)
        assert r.returncode == 0, r.stdout + r.stderr + log.read_text()[-3000:]
        r = subprocess.run(
            [torpor, "invoke", "cpu-mlp", "-v", "--data", json.dumps(REQUEST)],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        assert r.returncode == 0, r.stderr + log.read_text()[-3000:]
        assert "start: restored" in r.stderr
        assert json.loads(r.stdout)["label"] in range(4)
        # The live worker was given the venv's site-packages as its SDK.
        paths = [env_of(pid).get("PYTHONPATH", "") for pid in workers_of(state)]
        assert paths, "no live worker found"
        for p in paths:
            assert Path(p.split(":")[0]).is_relative_to(venv / "lib"), p
        # And the installed hook (split snapshots: `torpor.buffer()` works in its workers), as the
        # copy in the state directory that their mount namespace reaches.
        hooks = {env_of(pid).get("TORPOR_HOOK_LIB") for pid in workers_of(state)}
        assert len(hooks) == 1, hooks
        (copy,) = hooks
        assert copy is not None and Path(copy).is_relative_to(state), copy
        assert Path(copy).read_bytes() == installed_hook.read_bytes()
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
        for pid in pids_with(f"{state}/"):
            os.kill(pid, signal.SIGKILL)
