"""The shipped service files: packaging/torpord.toml (the default config) and
packaging/systemd/torpord.service, checked against the real daemon."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT

from .installs import serve

CONFIG = ROOT / "packaging/torpord.toml"
UNIT = ROOT / "packaging/systemd/torpord.service"


def unit_entries() -> dict[str, str]:
    """KEY=VALUE lines of the unit (no key repeats in it)."""
    out = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", "[")):
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
    return out


def test_the_default_config_parses_with_the_daemon_and_states_the_defaults(torpor_bin: Path) -> None:
    r = subprocess.run(
        [torpor_bin, "serve", "--config", CONFIG, "--check"], capture_output=True, text=True, check=False
    )
    assert r.returncode == 0, r.stderr
    c = json.loads(r.stdout)
    assert c["file"] == str(CONFIG)
    assert c["state_dir"] == "/var/lib/torpor" and c["socket"] == "/run/torpor/torpord.sock"
    assert c["keepalive"] == {"gpu_release_s": 30.0, "hibernate_s": 120.0, "evict_s": 600.0}
    assert c["queue"] == {"length": 64, "timeout_s": 30.0}
    assert c["reattach_s"] == 60.0 and c["tcp"] is None


def test_check_refuses_a_bad_key_with_one_line(torpor_bin: Path, tmp_path: Path) -> None:
    bad = tmp_path / "torpord.toml"
    bad.write_text(CONFIG.read_text().replace("length = 64", "lenght = 64"))
    r = subprocess.run([torpor_bin, "serve", "--config", bad, "--check"], capture_output=True, text=True, check=False)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == f"torpor: error: {bad}: queue.lenght is not a known key\n"


def test_the_daemon_starts_with_the_default_config(torpor_bin: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord takes its state directory as root")
    sock = tmp_path / "torpord.sock"
    log = tmp_path / "torpord.log"
    # The shipped file, with the state and the socket moved to the test's directory by flags.
    proc = serve(
        [torpor_bin, "serve", "--config", CONFIG, "--state-dir", tmp_path / "state", "--socket", sock], sock, log
    )
    try:
        r = subprocess.run(
            [torpor_bin, "status", "--json", "--socket", sock], capture_output=True, text=True, check=False
        )
        assert r.returncode == 0, r.stderr
        status = json.loads(r.stdout)
        assert status["config_file"] == str(CONFIG)
        assert status["keepalive"] == {"gpu_release_s": 30.0, "hibernate_s": 120.0, "evict_s": 600.0}
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, log.read_text()
    assert not sock.exists()


def test_the_unit_runs_the_daemon_on_the_default_config_and_its_directories() -> None:
    e = unit_entries()
    argv = shlex.split(e["ExecStart"])
    assert argv[1:] == ["serve", "--config", "/etc/torpor/torpord.toml"], argv
    text = CONFIG.read_text()
    # The directories systemd creates are the config's defaults.
    assert f'socket = "/run/{e["RuntimeDirectory"]}/torpord.sock"' in text
    assert f'state_dir = "/var/lib/{e["StateDirectory"]}"' in text
    assert e["KillMode"] == "process" and e["KillSignal"] == "SIGTERM"


def test_systemd_accepts_the_unit(torpor_bin: Path, tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    # verify checks that ExecStart's binary exists: point it at the one under test.
    unit = tmp_path / "torpord.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/torpor", str(torpor_bin)))
    r = subprocess.run(["systemd-analyze", "verify", unit], capture_output=True, text=True, check=False)
    # verify exits 0 on some problems (an unknown value is "ignored"): any message is one.
    assert r.returncode == 0 and r.stderr.strip() == "" and r.stdout.strip() == "", r.stderr + r.stdout
