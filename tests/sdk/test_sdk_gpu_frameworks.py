"""torpor.gpu without a GPU: memory defaults, limits, and the driver warm-up on the fake driver."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from torpor import gpu

ROOT = Path(__file__).resolve().parents[2]


def test_prepare_environment_turns_preallocation_off_and_keeps_user_settings() -> None:
    env: dict[str, str] = {}
    assert gpu.prepare_environment(env) == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    user = {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}
    assert gpu.prepare_environment(user) == {}
    assert user["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    sized = {"TORPOR_GPU_MEMORY": str(8 << 30), "TORPOR_GPU_TOTAL_MEMORY": str(80 << 30)}
    assert gpu.prepare_environment(sized)["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.100"


def test_no_framework_means_no_limit_and_no_framework() -> None:
    for name in gpu.FRAMEWORKS:
        if name in sys.modules:
            pytest.skip(f"{name} is imported in this interpreter")
    assert gpu.framework() is None
    assert gpu.limit_memory(1 << 30) == {}
    assert gpu.limit_memory(0) == {}


def test_driver_warm_up_and_sync_on_the_fake_driver(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for tests/fakes/fake_libcuda.c")
    lib = tmp_path / "libcuda.so.1"
    src = ROOT / "tests" / "fakes" / "fake_libcuda.c"
    subprocess.run([cc, "-shared", "-fPIC", "-DFAKE_CUDA_VMM", "-o", str(lib), str(src)], check=True)
    code = (
        "import os\n"
        "from torpor import gpu\n"
        "assert gpu.warm() == 'driver'\n"
        "assert gpu.sync() is True\n"
        "print('ok')\n"
    )
    env = {"TORPOR_LIBCUDA": str(lib), "PYTHONPATH": str(ROOT / "python"), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_driver_warm_up_names_a_missing_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORPOR_LIBCUDA", str(tmp_path / "absent.so"))
    with pytest.raises(RuntimeError, match="warms CUDA through the driver, but .*absent.so cannot be loaded"):
        gpu.Driver.load()


def test_shrink_context_sets_the_current_contexts_stack_limit_to_zero(tmp_path: Path) -> None:
    """torpor.gpu.shrink_context() at the quiet point: the stack limit of the context current on
    this thread goes to 0 (the fake driver logs the call and reads the limit back); with no
    current context it does nothing and says so."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake libcuda")
    lib = tmp_path / "libcuda.so.1"
    src = ROOT / "tests" / "fakes" / "fake_libcuda.c"
    subprocess.run([cc, "-shared", "-fPIC", "-DFAKE_CUDA_VMM", "-o", str(lib), str(src)], check=True)
    log = tmp_path / "cuda.log"
    code = (
        "import ctypes\n"
        "from torpor import gpu\n"
        "lib = ctypes.CDLL(gpu.os.environ['TORPOR_LIBCUDA'])\n"
        "assert gpu.shrink_context() is False, 'no context is current yet'\n"
        "assert gpu.warm() == 'driver'\n"
        "v = ctypes.c_size_t()\n"
        "assert lib.cuCtxGetLimit(ctypes.byref(v), 0) == 0 and v.value == 1024\n"
        "assert gpu.shrink_context() is True\n"
        "assert lib.cuCtxGetLimit(ctypes.byref(v), 0) == 0 and v.value == 0\n"
        "print('ok')\n"
    )
    env = {
        "TORPOR_LIBCUDA": str(lib),
        "FAKE_CUDA_LOG": str(log),
        "PYTHONPATH": str(ROOT / "python"),
        "PATH": "/usr/bin:/bin",
    }
    r = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    assert any(ln.split()[0::2] == ["limit", "0=0"] for ln in log.read_text().splitlines()), log.read_text()


def test_shared_anonymous_bytes_counts_what_crius_restore_copies_and_nothing_else() -> None:
    """torpor.gpu.shared_anonymous_bytes: resident shared anonymous memory (how the driver maps
    pinned host memory; CRIU restores it by copying), not private memory nor a shared file."""
    import mmap
    import tempfile

    base = gpu.shared_anonymous_bytes()
    shared = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    shared.write(b"s" * (6 << 20))  # 6 of its 8 MiB resident
    private = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    private.write(b"p" * (4 << 20))
    with tempfile.TemporaryFile() as f:
        f.truncate(4 << 20)
        on_file = mmap.mmap(f.fileno(), 4 << 20, flags=mmap.MAP_SHARED)
        on_file.write(b"f" * (4 << 20))
        assert gpu.shared_anonymous_bytes() - base == 6 << 20
        on_file.close()
    shared.close()
    private.close()
    assert gpu.shared_anonymous_bytes() == base
    assert gpu.shared_anonymous_bytes(2**22 + 7) == 0  # no such process: nothing to count
