"""Which GPU does the driver say VMM memory is on, in a process restored onto another GPU?

torpord restores a cold start onto the GPU with the fewest instances by passing the driver GPU
pairs that swap the deploy's GPU 0 and the chosen one under the process (docs/torpord.md,
"Several GPUs"). On a node of two H200s (session 54) a sandbox restored onto GPU 1 failed to use
a value of the communication store: torch made its tensor through `__cuda_array_interface__`,
asked the driver which GPU the pointer was on, and put the tensor on cuda:1. This probe takes
that apart in a plain process: a child initialises torch on cuda:0 and waits; `torpor snapshot`
and `torpor restore --gpu 0=1` move it onto GPU 1; the child then makes VMM memory on its
ordinal 0, exports and maps it as torpord's memory is mapped (torpor.store_gpu's `_Mapping`),
and records what the driver answers for it and what torch makes of it, through the array
interface and through DLPack (torpor.dlpack). Run before the snapshot too, for reference.

    TORPOR_BIN=... python3 bench/sandbox/placed_pointer_probe.py --out F.json   # root, 2 GPUs, CRIU

Writes JSON: the machine, and per phase (`before`: the booted process; `after`: restored onto
GPU 1) the context's device, the UUIDs of ordinals 0 and 1, the pointer ordinal the driver gives
for a torch allocation and for the VMM mapping, and each way of wrapping the mapping as a tensor
(its device and a kernel's sum, or the error).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9


def child(out: Path, go: Path) -> None:
    """The probed process: torch on cuda:0, a first look, then waits for `go`."""
    sys.path.insert(0, str(ROOT / "python"))
    # The driver's VMM structs, as bench/hook/map_cost.py declares them.
    sys.path.insert(0, str(ROOT / "bench" / "hook"))
    import torch
    from map_cost import AllocationProp, AllocFlags, MemLocation
    from torpor import dlpack, store_gpu

    cuda = ctypes.CDLL("libcuda.so.1")
    torch.ones(4, device="cuda").sum().item()

    def pointer_ordinal(ptr: int) -> list[int]:
        o = ctypes.c_int(-1)
        rc = cuda.cuPointerGetAttribute(ctypes.byref(o), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ctypes.c_uint64(ptr))
        return [rc, o.value]

    def uuid(ordinal: int) -> str:
        b = (ctypes.c_ubyte * 16)()
        return bytes(b).hex() if cuda.cuDeviceGetUuid_v2(b, ordinal) == 0 else "?"

    def attempt(f: Any) -> str:
        try:
            return str(f())
        except BaseException as e:  # the record is the point
            return "error: " + "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()[0]

    def look(vmm: bool) -> dict[str, Any]:
        r: dict[str, Any] = {}
        d = ctypes.c_int(-1)
        cuda.cuCtxGetDevice(ctypes.byref(d))
        r["context_device"] = d.value
        r["uuids"] = [uuid(0), uuid(1)]
        x = torch.ones(4, device="cuda")
        r["torch_allocation_pointer_ordinal"] = pointer_ordinal(x.data_ptr())
        if not vmm:
            # An exported fd and a VMM mapping cannot be checkpointed: the first look has none.
            return r
        prop = AllocationProp(1, 1, MemLocation(1, 0), None, AllocFlags())
        size = ctypes.c_size_t()
        cuda.cuMemGetAllocationGranularity(ctypes.byref(size), ctypes.byref(prop), 0)
        handle = ctypes.c_uint64()
        assert cuda.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(prop), ctypes.c_uint64(0)) == 0
        fd = ctypes.c_int(-1)
        assert cuda.cuMemExportToShareableHandle(ctypes.byref(fd), handle, 1, ctypes.c_uint64(0)) == 0
        mapping = store_gpu._Mapping(fd.value, size.value, 0, writable=True)
        assert mapping.va is not None
        va, n = mapping.va, size.value
        r["vmm_pointer_ordinal"] = pointer_ordinal(va)

        class Interface:
            __cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (va, False), "version": 3, "strides": None}

        def summed(t: Any) -> str:
            return f"{t.device} sum={int(t.sum().item())}"

        # DLPack first: a kernel's illegal address is sticky and would end the context.
        r["dlpack_cuda0"] = attempt(lambda: summed(dlpack.torch_tensor(va, (n,), "uint8", 0, mapping)))
        r["array_interface_to_cuda"] = attempt(lambda: summed(torch.as_tensor(Interface(), device="cuda")))
        r["array_interface_as_is"] = attempt(lambda: summed(torch.as_tensor(Interface())))
        return r

    (out.parent / (out.name + ".before")).write_text(json.dumps(look(False)))
    while not go.exists():
        time.sleep(0.05)
    out.write_text(json.dumps(look(True)))


def machine() -> dict[str, str]:
    def run(*cmd: str) -> str:
        r = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
        return r.stdout.strip()

    return {
        "gpus": run("nvidia-smi", "--query-gpu=index,name,uuid,driver_version", "--format=csv,noheader"),
        "torch": run(sys.executable, "-c", "import torch; print(torch.__version__)"),
        "commit": os.environ.get("TORPOR_COMMIT", run("git", "-C", str(ROOT), "rev-parse", "HEAD")),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def wait_for(path: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"placed_pointer_probe: {path} did not appear within {seconds:.0f} s")
        time.sleep(0.1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--child", nargs=2, metavar=("OUT", "GO"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(Path(args.child[0]), Path(args.child[1]))
        return
    torpor = os.environ.get("TORPOR_BIN", str(ROOT / "target" / "release" / "torpor"))
    if not os.access(torpor, os.X_OK):
        p.error(f"no torpor binary at {torpor}: build it (cargo build --release) or set TORPOR_BIN")
    work = Path(tempfile.mkdtemp(prefix="placed-pointer-"))
    out, go, snap = work / "look.json", work / "go", work / "snap"
    started = subprocess.run(
        [torpor, "run", "--log", str(work / "child.log"), "--", sys.executable, __file__, "--out", "-", "--child", str(out), str(go)],
        capture_output=True, text=True, check=True,
    )
    pid = started.stdout.strip()
    wait_for(work / "look.json.before", 300)
    steps = {}
    for name, cmd in (
        ("snapshot", [torpor, "snapshot", "--unkeyed", "--pid", pid, "--out", str(snap)]),
        ("restore", [torpor, "restore", "--unkeyed", str(snap), "--gpu", "0=1", "--detach"]),
    ):
        r = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600)
        steps[name] = {"rc": r.returncode, "stderr": r.stderr.strip().splitlines()[-1:] or [""]}
        if r.returncode != 0:
            raise SystemExit(f"placed_pointer_probe: torpor {name} failed: {r.stderr.strip()}")
    go.touch()
    wait_for(out, 120)
    doc = {
        "what": "the driver's pointer ordinal for VMM memory, and torch tensors over it, in a process restored onto GPU 1",
        "machine": machine(),
        "steps": steps,
        "before": json.loads((work / "look.json.before").read_text()),
        "after": json.loads(out.read_text()),
    }
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["after"], indent=1))


if __name__ == "__main__":
    main()
