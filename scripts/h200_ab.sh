#!/bin/bash
# Two builds side by side on one lent GPU (device tool): bench ttft and bench throughput of an
# earlier commit, checked out as a worktree in $BASE, against this tree, alternating per step so
# drift hits both alike; then this tree's fused-kernel check and CUDA tests.
#   git worktree add --detach .base <commit>    (here, once; .base is git-ignored)
#   run(command="BASE=.base bash scripts/h200_ab.sh", carry=[".gpu", ".base"])
# STEPS (default "ttft throughput kernel cudatests"), KS (5,50,200), REPEATS (20), USERS (100).
set -uo pipefail
source .gpu/device-env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BASE=${BASE:?set BASE to the worktree of the earlier build}
python3 scripts/make_configs.py /tmp/models > /dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
ARGS="--model /tmp/models/llama-3.1-8b --dummy-weights --dtype bfloat16"
here=$PWD
for step in ${STEPS:-ttft throughput kernel cudatests}; do
  for build in base main; do
    root=$here; [ "$build" = base ] && root=$here/$BASE
    case $step in kernel|cudatests) [ "$build" = base ] && continue ;; esac
    echo "== $step $build $(git -C "$root" rev-parse --short HEAD 2>/dev/null) $(date +%T)"
    cd "$root" || exit 1
    export PYTHONPATH=/tmp/site:$root
    case $step in
      ttft) python3 -m inferscale_apps.bench ttft $ARGS --max-model-len 16384 --ks "${KS:-5,50,200}" \
          --repeats "${REPEATS:-20}" --json "$OUT/ttft-$build.json" > "$OUT/ttft-$build.log" 2>&1
        grep -v "it/s" "$OUT/ttft-$build.log" | grep -E "^(none|prompt|inject|floor|k|[0-9])" ;;
      throughput) python3 -m inferscale_apps.bench throughput $ARGS --max-model-len 8192 --users "${USERS:-100}" \
          --k 50 --json "$OUT/throughput-$build.json" > "$OUT/throughput-$build.log" 2>&1
        grep -E "^(mode|prompt|inject)" "$OUT/throughput-$build.log" ;;
      kernel) python3 -m inferscale_apps.bench.kernel --ks 5,50,200 --json "$OUT/kernel.json" 2>&1 | tail -5 ;;
      cudatests) python3 -m pytest -q -p no:cacheprovider tests/test_memory_tiers.py tests/test_kv_exchange.py \
          tests/test_injection_streams.py tests/test_injection_table.py "tests/test_query_encoder.py::test_half_precision_query_graph_finds_what_fp32_finds" \
          2>&1 | tail -4 ;;
    esac
    cd "$here" || exit 1
  done
done
