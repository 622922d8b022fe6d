#!/usr/bin/env bash
# What a restore that does not answer is waiting on: for every process whose command line matches
# the pattern (default: torpor's daemon, workers, page server and CRIU), its state, parent, and each
# thread's name, state, wait channel and kernel stack. Run as root (kernel stacks need it).
#
#   scripts/stuck-dump.sh ['PATTERN']            # once, to stdout
#   scripts/stuck-dump.sh --watch LOG SECS OUT   # while LOG grows: dump to OUT.N each time LOG
#                                                # has not changed for SECS seconds
set -u
dump() {
  local pat=$1
  date -u +'== %H:%M:%S'
  for p in $(pgrep -f "$pat"); do
    [ -d "/proc/$p" ] || continue
    echo "== pid $p: $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-240)"
    grep -E '^(State|PPid|Threads|VmRSS)' "/proc/$p/status" 2>/dev/null | tr '\n' ' '
    echo
    for t in /proc/"$p"/task/*; do
      [ -d "$t" ] || continue
      echo "-- tid ${t##*/} $(cat "$t/comm" 2>/dev/null) state $(awk '{print $3}' "$t/stat" 2>/dev/null) wchan $(cat "$t/wchan" 2>/dev/null)"
      head -14 "$t/stack" 2>/dev/null | sed 's/^/     /'
    done
  done
}

pattern='torpor|criu|torpor\.worker'
if [ "${1:-}" = --watch ]; then
  log=$2 quiet=$3 out=$4 n=0 last=""
  while :; do
    sleep "$quiet"
    now=$(stat -c %s:%Y "$log" 2>/dev/null || echo none)
    if [ "$now" = "$last" ]; then
      n=$((n + 1))
      dump "$pattern" >"$out.$n" 2>&1
    fi
    last=$now
  done
fi
dump "${1:-$pattern}"
