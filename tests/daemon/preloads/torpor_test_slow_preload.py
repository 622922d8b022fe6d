"""A test-only preload (tests/daemon/test_daemon_sandbox_pool.py puts this directory on the
daemon's PYTHONPATH): imported by a `--role function` worker (what torpord launches for its
live-context pool), it sleeps $TORPOR_TEST_SLOW_PRELOAD_S seconds, as torch's import and the
CUDA warm-up take seconds on a GPU node; imported by a base (a deploy's) it returns at once, so
deploys stay fast."""

import os
import sys
import time

_argv = sys.argv[1:]
if "--role" in _argv[:-1] and _argv[_argv.index("--role") + 1] == "function":
    time.sleep(float(os.environ.get("TORPOR_TEST_SLOW_PRELOAD_S", "0")))
