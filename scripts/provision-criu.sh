#!/usr/bin/env bash
# Provision CRIU >= 4.1 (>= 4.2 on Linux >= 6.16) for Torpor into a private prefix, without touching the system.
#
# Usage:
#   scripts/provision-criu.sh                    provision (fast no-op when already done)
#   scripts/provision-criu.sh --force            provision again even if already done
#   scripts/provision-criu.sh --download-only DIR   only fetch the .deb closure into DIR
#
# Where: $TORPOR_CRIU_PREFIX, else ${XDG_DATA_HOME:-$HOME/.local/share}/torpor/criu ($PREFIX).
#   $PREFIX/ready     written last, only after `criu check` passed (key=value lines: version, mode,
#                     program); a half-done provisioning has no ready file and never counts.
#   $PREFIX/root      the unpacked Debian packages (mode=private)
#   $PREFIX/bin/criu  a wrapper for humans; programs run the packaged loader directly (see below)
#   $PREFIX/debs      the fetched .debs; $PREFIX/apt the private apt state
#
# How:
#   1. A system `criu` reporting >= 4.1 whose `criu check` says "Looks good" is used as is: only the
#      ready marker is written (mode=system, program=its path).
#   2. Otherwise the .debs of Debian's criu and its library closure are unpacked with `dpkg -x`:
#      from $TORPOR_CRIU_DEBS (a directory of .debs, for machines without network), else fetched
#      with apt through a private setup (own sources.list, lists and cache; the system's apt
#      configuration and state are never written).
#   3. The private criu always runs through the packaged loader with the packaged libraries:
#      mixing the system's ld.so with the newer packaged libc via LD_LIBRARY_PATH is undefined.
#
# Environment:
#   TORPOR_CRIU_PREFIX   install prefix (default above)
#   TORPOR_CRIU_DEBS     directory of .debs to unpack instead of downloading
#   TORPOR_CRIU_SUITE    Debian suite to fetch from (default: forky, Debian 14 "testing", CRIU 4.2.x).
#                        Not trixie (Debian 13, CRIU 4.1.1): CRIU < 4.2 cannot dump a process holding
#                        a TCP or UDP socket on Linux >= 6.16 (criu#2718), and 4.2 is not in trixie.
#   TORPOR_CRIU_MIRROR   Debian mirror (default: http://deb.debian.org/debian)
#   TORPOR_CRIU_KEYRING  keyring that signs the suite (default: Debian's archive keyring)
set -euo pipefail

# kernel_at_least MAJOR MINOR: the running kernel is that version or newer.
kernel_at_least() {
    local k kmajor kminor
    k=$(uname -r)
    kmajor=${k%%.*}
    k=${k#*.}
    kminor=${k%%[!0-9]*}
    [ "$kmajor" -gt "$1" ] || { [ "$kmajor" -eq "$1" ] && [ "$kminor" -ge "$2" ]; }
}
# Linux 6.16 refuses SO_PASSCRED on INET sockets; CRIU < 4.2 then fails to dump any TCP/UDP socket.
readonly MIN_MAJOR=4
if kernel_at_least 6 16; then readonly MIN_MINOR=2; else readonly MIN_MINOR=1; fi
readonly TRIPLET=x86_64-linux-gnu LOADER_NAME=ld-linux-x86-64.so.2
PREFIX=${TORPOR_CRIU_PREFIX:-${XDG_DATA_HOME:-$HOME/.local/share}/torpor/criu}
SUITE=${TORPOR_CRIU_SUITE:-forky}
MIRROR=${TORPOR_CRIU_MIRROR:-http://deb.debian.org/debian}
KEYRING=${TORPOR_CRIU_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}

say() { echo "provision-criu: $*" >&2; }
die() { echo "provision-criu: error: $*" >&2; exit 1; }

usage() {
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

FORCE=0
DOWNLOAD_DIR=
while [ $# -gt 0 ]; do
    case $1 in
        --force) FORCE=1 ;;
        --download-only)
            [ $# -ge 2 ] || die "--download-only needs a directory; run: $0 --download-only DIR"
            DOWNLOAD_DIR=$2
            shift
            ;;
        -h | --help) usage ;;
        *) die "unknown argument '$1'; run: $0 --help" ;;
    esac
    shift
done

ROOT=$PREFIX/root
LIBDIRS=$ROOT/usr/lib/$TRIPLET:$ROOT/lib/$TRIPLET
LOADER=$ROOT/usr/lib/$TRIPLET/$LOADER_NAME
PRIVATE_CRIU=$ROOT/usr/sbin/criu

# new_enough VERSION: MAJOR.MINOR >= the minimum.
new_enough() {
    local major=${1%%.*} rest=${1#*.}
    local minor=${rest%%.*}
    [ "$major" -gt "$MIN_MAJOR" ] || { [ "$major" -eq "$MIN_MAJOR" ] && [ "$minor" -ge "$MIN_MINOR" ]; }
}

# value KEY FILE: the value of a key=value line.
value() { sed -n "s/^$1=//p" "$2" | head -n 1; }

# Fast path: ready marker present and its program still there -> done, silently.
if [ -z "$DOWNLOAD_DIR" ] && [ "$FORCE" = 0 ] && [ -f "$PREFIX/ready" ] && new_enough "$(value version "$PREFIX/ready")"; then
    case $(value mode "$PREFIX/ready") in
        system) [ -x "$(value program "$PREFIX/ready")" ] && exit 0 ;;
        private) [ -x "$PRIVATE_CRIU" ] && [ -x "$LOADER" ] && exit 0 ;;
    esac
fi

[ "$(uname -m)" = x86_64 ] || die "only x86_64 is supported (this is $(uname -m)); install CRIU >= $MIN_MAJOR.$MIN_MINOR yourself and set TORPOR_CRIU"

# criu_version CMD...: prints "MAJOR.MINOR.SUBLEVEL" from `CMD --version` ("Version: 4.1.1").
criu_version() {
    "$@" --version 2>/dev/null | sed -n 's/^Version: *\([0-9][0-9]*\)\.\([0-9][0-9]*\)\(\.\([0-9][0-9]*\)\)\{0,1\}.*/\1.\2.\4/p' | sed 's/\.$/.0/' | head -n 1
}

apt_private() {
    local dir=$1
    shift
    apt-get -q \
        -o Dir::Etc::sourcelist="$dir/sources.list" -o Dir::Etc::sourceparts=- \
        -o Dir::Etc::preferences=/dev/null -o Dir::Etc::preferencesparts="$dir/empty.d" \
        -o Dir::State::Lists="$dir/lists" -o Dir::Cache="$dir/cache" \
        -o Dir::State::status=/dev/null \
        -o APT::Architecture=amd64 -o APT::Architectures=amd64 \
        -o APT::Sandbox::User=root \
        "$@"
}

apt_cache_private() {
    local dir=$1
    shift
    apt-cache \
        -o Dir::Etc::sourcelist="$dir/sources.list" -o Dir::Etc::sourceparts=- \
        -o Dir::Etc::preferences=/dev/null -o Dir::Etc::preferencesparts="$dir/empty.d" \
        -o Dir::State::Lists="$dir/lists" -o Dir::Cache="$dir/cache" \
        -o Dir::State::status=/dev/null \
        -o APT::Architecture=amd64 -o APT::Architectures=amd64 \
        "$@"
}

# fetch_debs DIR: download criu and its library closure from $SUITE into DIR.
fetch_debs() {
    local out=$1 apt=$PREFIX/apt
    command -v apt-get >/dev/null || die "apt-get not found; on a machine without apt, set TORPOR_CRIU_DEBS to a directory of .debs fetched elsewhere with --download-only"
    [ -r "$KEYRING" ] || die "Debian archive keyring $KEYRING not found; install debian-archive-keyring, set TORPOR_CRIU_KEYRING, or set TORPOR_CRIU_DEBS"
    mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/empty.d" "$out"
    echo "deb [signed-by=$KEYRING] $MIRROR $SUITE main" >"$apt/sources.list"
    say "updating the private apt lists for Debian $SUITE"
    apt_private "$apt" update >"$apt/update.log" 2>&1 ||
        { tail -n 5 "$apt/update.log" >&2; die "apt-get update for Debian $SUITE failed (log $apt/update.log); check network access to $MIRROR or set TORPOR_CRIU_DEBS"; }
    # apt-get update exits 0 when a fetch fails; no package index means it did.
    if ! compgen -G "$apt/lists/*_Packages*" >/dev/null; then
        grep -E '^(E|W|Err):' "$apt/update.log" | tail -n 3 >&2
        die "could not fetch the Debian $SUITE package index from $MIRROR (log $apt/update.log); check network access, or set TORPOR_CRIU_DEBS"
    fi
    local pkgs
    pkgs=$(apt_cache_private "$apt" depends --recurse --no-recommends --no-suggests --no-conflicts \
        --no-breaks --no-replaces --no-enhances criu | grep -v '^[ <]' | sort -u) ||
        die "apt-cache found no criu in Debian $SUITE; set TORPOR_CRIU_SUITE to a suite that has CRIU >= $MIN_MAJOR.$MIN_MINOR"
    say "downloading criu and $(($(echo "$pkgs" | wc -l) - 1)) libraries into $out"
    rm -f "$out"/*.deb
    # apt-get download writes into the current directory.
    # shellcheck disable=SC2086 # one package name per word
    (cd "$out" && apt_private "$apt" download $pkgs) >"$apt/download.log" 2>&1 ||
        { tail -n 5 "$apt/download.log" >&2; die "apt-get download failed (log $apt/download.log); check network access to $MIRROR or set TORPOR_CRIU_DEBS"; }
}

if [ -n "$DOWNLOAD_DIR" ]; then
    fetch_debs "$DOWNLOAD_DIR"
    set -- "$DOWNLOAD_DIR"/*.deb
    say "done: $# .debs in $DOWNLOAD_DIR (use with TORPOR_CRIU_DEBS=$DOWNLOAD_DIR)"
    exit 0
fi

[ "$(id -u)" = 0 ] || die "must run as root: 'criu check' needs CAP_SYS_ADMIN to verify the install; run: sudo $0"

mkdir -p "$PREFIX"
rm -f "$PREFIX/ready" "$PREFIX/ready.tmp"

# 1. A new enough, working system CRIU.
SYSTEM_CRIU=$(PATH=$PATH:/usr/sbin:/usr/local/sbin:/sbin command -v criu || true)
if [ -n "$SYSTEM_CRIU" ]; then
    version=$(criu_version "$SYSTEM_CRIU")
    if [ -n "$version" ] && new_enough "$version" && out=$("$SYSTEM_CRIU" check 2>&1) && grep -q "Looks good" <<<"$out"; then
        printf 'version=%s\nmode=system\nprogram=%s\n' "$version" "$SYSTEM_CRIU" >"$PREFIX/ready.tmp"
        mv "$PREFIX/ready.tmp" "$PREFIX/ready"
        say "using the system CRIU $version at $SYSTEM_CRIU"
        exit 0
    fi
    say "system CRIU at $SYSTEM_CRIU (version ${version:-unknown}) is not usable; provisioning a private one"
fi

# 2. The .debs: carried ones, or fetched.
if [ -n "${TORPOR_CRIU_DEBS:-}" ]; then
    DEBS=$TORPOR_CRIU_DEBS
    ls "$DEBS"/criu_*.deb >/dev/null 2>&1 || die "TORPOR_CRIU_DEBS=$DEBS holds no criu_*.deb; fetch them with: $0 --download-only $DEBS"
    say "using the .debs in $DEBS"
else
    DEBS=$PREFIX/debs
    fetch_debs "$DEBS"
fi

# 3. Unpack aside, then swap in.
command -v dpkg-deb >/dev/null || die "dpkg-deb not found; install dpkg, or install CRIU >= $MIN_MAJOR.$MIN_MINOR yourself and set TORPOR_CRIU"
say "unpacking into $ROOT"
rm -rf "$ROOT.new"
mkdir -p "$ROOT.new"
for deb in "$DEBS"/*.deb; do
    dpkg-deb -x "$deb" "$ROOT.new" || die "unpacking $deb failed; delete it and run $0 again"
done
rm -rf "$ROOT"
mv "$ROOT.new" "$ROOT"
[ -x "$LOADER" ] || die "no loader at $LOADER after unpacking; the .debs lack libc6: fetch a full closure with $0 --download-only DIR"
[ -x "$PRIVATE_CRIU" ] || die "no criu at $PRIVATE_CRIU after unpacking; the .debs lack criu: fetch a full closure with $0 --download-only DIR"

CRIU=("$LOADER" --library-path "$LIBDIRS" "$PRIVATE_CRIU")
mkdir -p "$PREFIX/bin"
cat >"$PREFIX/bin/criu.tmp" <<EOF
#!/bin/sh
# Runs Torpor's private CRIU through its packaged loader and libraries (scripts/provision-criu.sh).
exec "$LOADER" --library-path "$LIBDIRS" "$PRIVATE_CRIU" "\$@"
EOF
chmod 0755 "$PREFIX/bin/criu.tmp"
mv "$PREFIX/bin/criu.tmp" "$PREFIX/bin/criu"

# 4. Verify, then mark ready.
version=$(criu_version "${CRIU[@]}")
[ -n "$version" ] || { "${CRIU[@]}" --version >&2 || true; die "the private CRIU does not run (output above); delete $PREFIX and run $0 again"; }
new_enough "$version" || die "Debian $SUITE has CRIU $version, Torpor needs >= $MIN_MAJOR.$MIN_MINOR; set TORPOR_CRIU_SUITE to a newer suite"
say "checking CRIU $version against this kernel"
if ! out=$("${CRIU[@]}" check 2>&1) || ! grep -q "Looks good" <<<"$out"; then
    echo "$out" | tail -n 10 >&2
    die "'criu check' failed for CRIU $version on Linux $(uname -r) (last lines above); fix the kernel feature it names, or try a newer CRIU with TORPOR_CRIU_SUITE"
fi
printf 'version=%s\nmode=private\nprogram=%s\n' "$version" "$PRIVATE_CRIU" >"$PREFIX/ready.tmp"
mv "$PREFIX/ready.tmp" "$PREFIX/ready"
say "CRIU $version ready in $PREFIX (run it as $PREFIX/bin/criu)"
