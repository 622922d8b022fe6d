"""The baseline torpor is measured against: the driver's checkpoint API called by hand, as
CRIUgpu's authors and DESIGN.md's prototypes did, through ctypes from a separate process.

    python3 by_hand.py PID restore unlock     # prints {"restore": s, "unlock": s}
"""

from __future__ import annotations

import ctypes
import json
import sys
import time


def main() -> None:
    lib = ctypes.CDLL("libcuda.so.1")
    if lib.cuInit(0) != 0:
        sys.exit("cuInit failed")
    pid = int(sys.argv[1])
    took: dict[str, float] = {}
    for step in sys.argv[2:]:
        args = ctypes.create_string_buffer(64)  # restore/unlock args: 64 zeroed bytes
        fn = {"restore": lib.cuCheckpointProcessRestore, "unlock": lib.cuCheckpointProcessUnlock}[step]
        t = time.perf_counter()
        rc = fn(pid, args)
        took[step] = time.perf_counter() - t
        if rc != 0:
            sys.exit(f"cuCheckpointProcess {step} of {pid} failed: CUresult {rc}")
    print(json.dumps(took))


if __name__ == "__main__":
    main()
