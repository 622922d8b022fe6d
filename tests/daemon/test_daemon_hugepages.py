"""`restore_server.transparent_hugepage` (crates/torpord/src/hugepages.rs): the daemon sets the
node's THP mode to `always` while it runs, reports it in /metrics, restores through it, and puts
the admin's mode back when it stops; with the default (`leave`) it changes nothing and says in
its log what the mode costs restores."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from .conftest import FUNCTIONS, Torpord

ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def mode() -> str:
    return next(w[1:-1] for w in ENABLED.read_text().split() if w.startswith("["))


@pytest.fixture
def node_mode() -> str:
    if not ENABLED.exists():
        pytest.skip("this kernel has no transparent huge pages")
    before = mode()
    if before == "always":
        pytest.skip("the node's mode is always already: nothing to set or put back")
    yield before
    ENABLED.write_text(before)  # whatever the test did


def test_always_is_set_while_the_daemon_runs_and_put_back_after(
    torpor_bin: Path, criu_ready: None, tmp_path: Path, node_mode: str
) -> None:
    d = Torpord(torpor_bin, tmp_path, config='[restore_server]\ntransparent_hugepage = "always"\n')
    try:
        assert mode() == "always"
        metrics = d.request("GET", "/metrics").body.decode()
        assert 'torpor_node_transparent_hugepage{enabled="always"} 1' in metrics
        fdir = tmp_path / "sleepy"
        shutil.copytree(FUNCTIONS / "sleepy", fdir)
        d.deploy(fdir)
        # A restore under "always": the instance answers as a fresh one does.
        d.cli("stop", "sleepy")
        r = d.invoke("sleepy", {"add": 2})
        assert r.status == 200 and r.start == "restored" and r.json() == {"calls": 1, "total": 2}, r.body
    finally:
        d.stop()
    assert mode() == node_mode, "the daemon must put the admin's mode back"
    assert "transparent huge pages set back" in d.log_text()


def test_the_default_leaves_the_mode_and_says_what_it_costs(
    torpor_bin: Path, criu_ready: None, tmp_path: Path, node_mode: str
) -> None:
    d = Torpord(torpor_bin, tmp_path)
    try:
        assert mode() == node_mode
        metrics = d.request("GET", "/metrics").body.decode()
        assert f'torpor_node_transparent_hugepage{{enabled="{node_mode}"}} 1' in metrics
        assert 'transparent_hugepage = \\"always\\"' in d.log_text() or 'transparent_hugepage = "always"' in d.log_text()
    finally:
        d.stop()
    assert mode() == node_mode
