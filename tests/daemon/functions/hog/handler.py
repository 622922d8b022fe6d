"""Hog: holds `mib` MiB of touched memory for `sleep_s` seconds, and says which cgroups it is in.

    {"mib": N, "sleep_s": S} -> {"cgroup": the lines of /proc/self/cgroup, "mib": N}
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torpor


@torpor.function
class Hog:
    def setup(self) -> None:
        pass

    def __call__(self, request: Any) -> Any:
        mib = int(request.get("mib", 0))
        held = bytearray(mib << 20)
        # Touch every page: an untouched bytearray of zeros may not be charged yet.
        for i in range(0, len(held), 4096):
            held[i] = 1
        time.sleep(float(request.get("sleep_s", 0)))
        return {"cgroup": Path("/proc/self/cgroup").read_text().splitlines(), "mib": mib}
