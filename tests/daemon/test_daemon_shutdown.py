"""A graceful stop of torpord (SIGTERM) does not wait for background work it can abandon: the
host cache being pinned at start (`restore_server.pin_host_cache_at_start`; 4 GiB took ~2 s on
the H100), here made to last 60 s by the fake driver (tests/fakes, FAKE_CUDA_HOST_ALLOC_SLEEP_MS)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from conftest import FakeCuda

from .conftest import Torpord, fake_gpu_env


def test_a_stop_right_after_start_does_not_wait_for_the_host_cache_pin(torpor_bin: Path, fake_cuda: FakeCuda, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord's state directory and workers")
    env = fake_gpu_env(tmp_path, fake_cuda, FAKE_CUDA_HOST_ALLOC_SLEEP_MS="60000")
    config = "[restore_server]\npin_host_cache_at_start = true\nhost_cache_bytes = 67108864\n"
    d = Torpord(torpor_bin, tmp_path, env=env, config=config)
    try:
        # The fake GPU opens at once; then the pin sleeps in the fake's cuMemHostAlloc.
        time.sleep(1.0)
        assert "GPUs opened" not in d.log_text(), "the pin ended before the stop: nothing tested"
        t = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        rc = d.proc.wait(timeout=45)
        took = time.monotonic() - t
        assert rc == 0, d.log_text()[-3000:]
        assert took < 10, f"the stop took {took:.1f} s: it waited for the pin"
    finally:
        d.stop()
