#!/usr/bin/env bash
# Downloads, as wheels for the GPU machine's Python (3.12, x86-64), the test dependencies of
# tests/requirements.txt that its image lacks (it has pytest and hypothesis, not jsonschema), so
# the whole pytest suite collects there; scripts/gpu-run.sh installs them aside with --target.
# Usage: scripts/gpu-carry-wheels.sh DIR
set -euo pipefail
dir=${1:?usage: gpu-carry-wheels.sh DIR}
mkdir -p "$dir"
# jsonschema and what it needs beyond the image's own packages (attrs, typing-extensions).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dir" 'jsonschema>=4.18' jsonschema-specifications referencing rpds-py
ls "$dir"
