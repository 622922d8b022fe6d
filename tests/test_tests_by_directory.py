"""scripts/tests-by-directory.py: the GPU runs' pytest arguments, one directory's paths together
(pytest 9.1.1 on the GPU machine lost tests/sdk/conftest.py's fixtures for a tests/sdk file
given after a tests/ file that followed another tests/sdk file)."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

SCRIPT = ROOT / "scripts/tests-by-directory.py"


def run(*args: str) -> list[str]:
    r = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=30, check=True)
    return r.stdout.split()


def test_a_directorys_paths_go_together_where_its_first_was_in_the_order_given() -> None:
    # The order of session 54's call that errored, and what it becomes.
    given = ["tests/daemon/test_daemon_gpudata_gpu.py", "tests/sdk/test_sdk_graphs_gpu.py",
             "tests/sdk/test_sdk_gpu_frameworks.py", "tests/test_pack_gpu.py", "tests/test_hook_gpu.py",
             "tests/sdk/test_sdk_gpu.py"]
    assert run(*given) == [given[0], given[1], given[2], given[5], given[3], given[4]]


def test_node_ids_directories_and_an_order_already_grouped_are_kept() -> None:
    given = ["tests/sdk/test_a.py::test_x", "tests/test_b.py", "tests/sdk/test_c.py::test_y[1/2]", "tests"]
    assert run(*given) == [given[0], given[2], given[1], given[3]]
    grouped = ["tests/sdk/test_a.py", "tests/sdk/test_c.py", "tests/test_b.py"]
    assert run(*grouped) == grouped
    assert run("tests") == ["tests"]
