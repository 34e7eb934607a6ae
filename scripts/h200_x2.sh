#!/bin/bash
# Second device call, on the two-GPU kind: tiers (GPU 0) and TTFT (GPU 1) side by side, then TP=2.
#   run(command="bash scripts/h200_x2.sh", carry=[".gpu"], kind="nvidia-h200-x2")
set -uo pipefail
source .gpu/device-env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 scripts/make_configs.py /tmp/models > /dev/null
M=/tmp/models/llama-3.1-8b
COMMON="--model $M --dummy-weights --dtype bfloat16 --max-model-len 16384"
CUDA_VISIBLE_DEVICES=0 python3 -m inferscale_apps.bench tiers $COMMON --k 5,50 --repeats 10 \
    --json "$OUT/tiers-llama-3.1-8b.json" > "$OUT/tiers.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 python3 -m inferscale_apps.bench ttft $COMMON --ks 0,5,10,20,50,100,200 \
    --json "$OUT/ttft-llama-3.1-8b.json" --plot "$OUT/ttft-llama-3.1-8b.png" > "$OUT/ttft.log" 2>&1 &
wait
grep -E "^(tier|device|host|disk|prompt) " "$OUT/tiers.log"
grep -A30 "^mode" "$OUT/ttft.log" | grep -v "it/s"
python3 -m torch.distributed.run --nproc-per-node=2 scripts/h200_tp2.py $M "$OUT/tp2-llama-3.1-8b.json" > "$OUT/tp2.log" 2>&1
grep -v "INFO\|WARNING\|it/s" "$OUT/tp2.log" | tail -40
