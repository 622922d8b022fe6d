"""`make demo` (scripts/demo.py) on the CPU example, so that the demo cannot rot: a real torpord,
a real deploy, every step of the demo, and nothing left running afterwards."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, pids_with


def test_the_runtime_demo_runs_every_step_on_the_cpu_example(torpor_bin: Path, criu_ready: None) -> None:
    r = subprocess.run(
        [sys.executable, ROOT / "scripts/demo.py", "--cpu"],
        env={**os.environ, "TORPOR_BIN": str(torpor_bin)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = r.stdout
    assert r.returncode == 0, f"{out}\n{r.stderr}"
    assert "deployed cpu-mlp" in out, out
    assert re.search(r"^1\. from-scratch boot: +booted ", out, re.MULTILINE), out
    assert re.search(r"^2\. cold start \(snapshot\): +restored .* identical output", out, re.MULTILINE), out
    assert re.search(r"^3\. warm call: +warm .* identical output", out, re.MULTILINE), out
    burst = re.search(r"^4\. 3 requests at once: +(.*) identical output", out, re.MULTILINE)
    assert burst is not None and "restored" in burst.group(1), out
    for stage in ("hibernated", "evicted"):
        assert re.search(rf"^ +idle +[\d.]+ s: .*\b{stage}\b", out, re.MULTILINE), out
    assert re.search(r"^6\. wake from evicted: +restored .* identical output", out, re.MULTILINE), out
    assert re.search(r'^ +torpor_starts_total\{function="cpu-mlp",kind="restored"\} [1-9]', out, re.MULTILINE), out
    assert "no process or mount left" in out, out
    temp = re.search(r"state (/tmp/torpor-demo-[^/]+)/state", out)
    assert temp is not None, out
    assert not Path(temp.group(1)).exists()
    assert pids_with(temp.group(1)) == []
