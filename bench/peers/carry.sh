#!/usr/bin/env bash
# Downloads into DIR the wheels of the peer benchmark's optional loaders for the GPU machine's
# Python (3.12, x86-64, no network there): Run:ai Model Streamer and fastsafetensors, pinned, and
# what they need that the GPU image lacks (humanize; numpy and torch are the image's own;
# fastsafetensors' typer is only its command line's, never imported by fastsafe_open).
# scripts/gpu-run.sh installs DIR's wheels aside (--target, then PYTHONPATH). `make gpu-carry`
# calls it. Usage: bench/peers/carry.sh DIR
set -euo pipefail
dir=${1:?usage: carry.sh DIR}
mkdir -p "$dir"
# Keep in step with bench/peers/loaders.py (PINNED).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dir" runai-model-streamer==0.16.1 fastsafetensors==0.5.0 humanize==4.12.3
# Each wheel's needs, checked against what is carried or on the image, so a new pin that needs
# more fails here rather than there.
python3 - "$dir" <<'PY'
import re, sys, zipfile
from pathlib import Path
have = {"torch", "numpy", "safetensors"}  # the GPU image's
wheels = sorted(Path(sys.argv[1]).glob("*.whl"))
names = {re.split(r"-", w.name)[0].lower().replace("_", "-") for w in wheels}
bad = []
for w in wheels:
    if not w.name.startswith(("runai_model_streamer", "fastsafetensors", "humanize")):
        continue
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:") and "extra ==" not in line:
                need = re.split(r"[ ;<>=!(~\[]", line.split(":", 1)[1].strip())[0].lower().replace("_", "-")
                if need not in have and need not in names and need != "typer":
                    bad.append(f"{w.name} needs {need}")
if bad:
    sys.exit("carry.sh: " + "; ".join(bad) + ": add it to the download")
PY
du -ch "$dir"/runai_model_streamer-* "$dir"/fastsafetensors-* "$dir"/humanize-* | tail -1
