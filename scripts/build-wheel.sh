#!/usr/bin/env bash
# Builds the wheel (root pyproject.toml, maturin): the `torpor` binary, the Python SDK and the
# device-memory hook libtorpor_hook.so, which the hook's crate builds as a cdylib that maturin's
# "bin" bindings do not package. The hook is copied into the package (python/torpor/, ignored by
# git) and pyproject.toml's `include` puts it in the wheel, where the installed daemon finds it
# beside the SDK it gives its workers (crates/torpord/src/split/mod.rs, find_hook_lib).
#
# usage: scripts/build-wheel.sh [PROFILE [OUT]]   (PROFILE: release (default) or dev)
set -euo pipefail
cd "$(dirname "$0")/.."
profile=${1:-release}
out=${2:-target/wheels}
python=${PYTHON:-python3}
case "$profile" in
    dev) dir=target/debug ;;
    *) dir=target/$profile ;;
esac
cargo build --profile "$profile" -p torpor-hook --lib
# Written aside and renamed, so a concurrent build never packs a half-written library.
install -m 0755 "$dir/libtorpor_hook.so" python/torpor/.libtorpor_hook.so.$$
mv -f python/torpor/.libtorpor_hook.so.$$ python/torpor/libtorpor_hook.so
"$python" -m maturin build --profile "$profile" --out "$out"
