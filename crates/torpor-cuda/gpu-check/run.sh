#!/bin/bash
# Checks torpor-cuda against the real driver on a GPU machine: a process without CUDA, a missing
# pid, and a PyTorch process (target.py) taken through lock, checkpoint, restore (remapped onto
# the same GPU) and unlock, each step a separate run of the cuda_probe example, as the CLI would.
#
# Build the probe where cargo is (`cargo build -p torpor-cuda --example cuda_probe`), take it to
# the GPU machine with the tree, and run `bash crates/torpor-cuda/gpu-check/run.sh` from the
# repository root; CUDA_PROBE overrides the probe's path. Needs python3 with PyTorch there.
# Read the output: every step prints `ok ...` or `error <Debug> | <Display>`, and target.py ends
# with `identical True` when its GPU data survived both checkpoint/restore rounds.
P=$(realpath "${CUDA_PROBE:-target/debug/examples/cuda_probe}")
cd "$(dirname "$0")"
trap 'kill $S 2>/dev/null; rm -f busy stop target.out' EXIT
t() { local s=$(date +%s%N); "$@"; echo "   ($(( ($(date +%s%N) - s) / 1000000 )) ms)"; }
rm -f busy stop
t $P info
sleep 100 & S=$!
echo "--- sleep (not CUDA) pid $S"; t $P state $S; t $P lock $S 1000; t $P tid $S
echo "--- missing pid"; t $P state 2147483647; t $P lock 2147483647 10
echo "--- pid 0"; t $P state 0
python3 -u target.py > target.out 2>&1 & T=$!
for i in $(seq 1 300); do grep -q ready target.out && break; sleep 0.1; done
cat target.out
echo "--- torch pid $T"; t $P state $T; t $P tid $T; t $P unlock $T; t $P checkpoint $T
touch busy; sleep 1
echo "--- busy"; t $P lock $T 1; t $P state $T
t $P lock $T 10000; t $P state $T; t $P lock $T 10
t $P checkpoint $T; t $P state $T; t $P unlock $T
t $P info
t $P restore $T remap; t $P state $T; t $P unlock $T; t $P state $T
sleep 1
echo "--- second round, restore without pairs"
t $P lock $T 10000; t $P checkpoint $T; t $P restore $T; t $P unlock $T; t $P state $T
touch stop; wait $T; cat target.out
kill $S
