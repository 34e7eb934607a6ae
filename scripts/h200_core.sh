#!/bin/bash
# Engine-core measurements on the lent H200 (device tool), one call:
#   run(command="bash scripts/h200_core.sh", carry=[".gpu"])
# Random-weight Llama-3.1-8B shape (load_format=dummy), bf16, vLLM 0.26.0, CUDA graphs on.
set -uo pipefail
source .gpu/device-env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 scripts/make_configs.py "$OUT/models"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
M=$OUT/models/llama-3.1-8b
python3 -m inferscale_engine.bench.kernel --ks 5,50,200 --json "$OUT/kernel.json" 2>&1 | tail -5
python3 -m inferscale_engine.bench exactness --model "$M" --dummy-weights --dtype bfloat16 --max-model-len 4096 \
    --json "$OUT/exactness-llama8b.json" > "$OUT/exactness.log" 2>&1; tail -4 "$OUT/exactness.log"
python3 -m inferscale_engine.bench ttft --model "$M" --dummy-weights --dtype bfloat16 --max-model-len 8192 \
    --ks ${KS:-0,5,50} --repeats ${REPEATS:-20} --json "$OUT/ttft-llama8b.json" --plot "$OUT/ttft-llama8b.png" > "$OUT/ttft.log" 2>&1
tail -14 "$OUT/ttft.log"
