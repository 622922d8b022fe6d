#!/usr/bin/env bash
# Builds the Rust tests and examples that need a real GPU (the GPU machine has no Rust) and copies
# them into .gpu/native/, named <crate>-<target>, for `scripts/gpu-run.sh native` to run there.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu/native
rm -rf "$out"; mkdir -p "$out"
crates=(-p torpor-device -p torpor-cuda)
[ -d crates/torpor-hook ] && crates+=(-p torpor-hook)
# Test binaries: cargo prints each executable it built as JSON; keep the integration tests.
cargo test --release --no-run --message-format=json "${crates[@]}" 2>/dev/null |
  python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable") or not m["profile"]["test"]:
        continue
    kind = m["target"]["kind"][0]
    if kind not in ("test", "lib"):
        continue
    name = m["package_id"].split("#")[0].rsplit("/", 1)[-1] + "-" + m["target"]["name"]
    shutil.copy(m["executable"], sys.argv[1] + "/" + name)
    print("carry", name)
' "$out"
cargo build --release -q -p torpor-device --example fill_bw
cp target/release/examples/fill_bw "$out/fill_bw"
du -sh "$out"
