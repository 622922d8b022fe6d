#!/usr/bin/env bash
# Packs this machine's perf (Debian's linux-perf) with the shared libraries it links, for the GPU
# machine, which has no perf and no network (docs/gpu-machine.md, "Profiling there"). The C
# library and loader are left out: the GPU machine's glibc is newer and serves them.
#   scripts/perf-bundle.sh OUT.tar.xz
# On the GPU machine: tar -xJf OUT.tar.xz -C /tmp/pb, then run
#   LD_LIBRARY_PATH=/tmp/pb/perfb/lib /tmp/pb/perfb/perf ...
set -euo pipefail
out=${1:?usage: scripts/perf-bundle.sh OUT.tar.xz}
perf=$(command -v perf || true)
if [ -z "$perf" ]; then
    echo "perf-bundle: no perf here: apt-get install linux-perf, then run this again" >&2
    exit 1
fi
# Debian's /usr/bin/perf may be a wrapper script choosing perf_X.Y for the running kernel.
if ! head -c4 "$perf" | grep -q ELF; then
    perf=$(ls /usr/bin/perf_* 2>/dev/null | sort -V | tail -1)
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/perfb/lib"
cp "$perf" "$work/perfb/perf"
ldd "$perf" | awk '/=> \//{print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
        libc.so.*|libm.so.*|ld-linux*|libpthread.so.*|libdl.so.*|librt.so.*) ;;
        *) cp -L "$lib" "$work/perfb/lib/" ;;
    esac
done
tar -C "$work" -cJf "$out" perfb
echo "perf-bundle: $out ($(du -h "$out" | cut -f1))"
