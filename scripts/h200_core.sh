#!/bin/bash
# Engine-core measurements on the lent H200 (device tool):
#   run(command="STEPS='kernel query exactness ttft' bash scripts/h200_core.sh", carry=[".gpu"])
#   run(command="STEPS='tiers throughput' bash scripts/h200_core.sh", carry=[".gpu"])
# Random-weight Llama-3.1-8B shape (load_format=dummy), bf16, vLLM 0.26.0, CUDA graphs as the
# engine sets them up (full graphs, kept after its start-up check: cuda_graphs.py).
#   run(command="STEPS='diskraw tiers' bash scripts/h200_core.sh", carry=[".gpu"])  (cold memories: issue 25)
# STEPS picks what runs (default: all but knob — TTFT with the quality knob, KV injection with its
# last R facts prefilled, R in $RECOMPUTE — and the diagnostics graphcheck — each graph mode against
# eager, one process each — graphab — vLLM's default piecewise graphs, for the A/B — cacheab —
# injected prompts kept in vLLM's prefix cache (prefix_cache_injected), for the A/B — mp — TTFT
# multiprocess against in-process and 100-user throughput multiprocess — profile,
# promote and hosttier, in this order, ~9 min: more than one call may run, hence the two calls
# above). Also: promoteprof (a promotion's host time per function), promotesplit (a tier read's
# host time per method of the tiers: host and device tier, right away and after idle), mpretain (multiprocess k=50
# with 4 GiB staged), mpsplit (a multiprocess and an in-process k=50 request's time, part by part;
# py-spy over vLLM's processes fell minutes behind and slowed the run past the call's limit), cudatests (the
# CUDA tests of the tiers, exchange, injection streams and table, and retrieval), tierspromo (a promotion's host time, full slab
# against room on it, the tiers alone), coldtext (a cold request against prompt injection of the same
# texts, call to answer, through the public API: scripts/profile_cold_plan.py on the Llama shape with
# SmolLM2's tokenizer; carry .carry/smollm2-tokenizer, a copy of the prepared SmolLM2 folder's
# config and tokenizer files; vLLM's prefix cache off: the two requests have the same tokens, so
# whichever ran second would be served from the first's blocks), tokenrecompute (recompute_tokens' cost
# and distance to the prompt on the CUDA path, scripts/token_recompute_cost.py, the rows in vLLM's forward pass
# and in a pass of their own: PASSES; forwardrecompute: the forward-pass rows' CUDA tests; forwardcost: their cost
# in the default full graphs beside the separate pass, under piecewise graphs with the host split, and with the
# knob's R on top: PASSES; carry .carry/smollm2-tokenizer as for coldtext), retrievalvariants (scripts/h200_retrieval_variants.py: one
# query's retrieval warm, 20 ms after the last call, and after other GPU work). TIERS_REPEATS sets the
# tiers repeats.
set -uo pipefail
source .gpu/device-env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-kernel query exactness ttft tiers throughput}
python3 scripts/make_configs.py /tmp/models > /dev/null  # outside $OUT: few files come back
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
M=/tmp/models/llama-3.1-8b
ARGS="--model $M --dummy-weights --dtype bfloat16"
for step in $STEPS; do
  echo "== $step $(date +%T)"
  case $step in
    kernel) python3 -m inferscale_apps.bench.kernel --ks 5,50,200 --json "$OUT/kernel.json" 2>&1 | tail -4 ;;
    query) python3 scripts/h200_query_encoder.py 2>&1 | tail -4 ;;
    exactness) python3 -m inferscale_apps.bench exactness $ARGS --max-model-len 4096 \
        --json "$OUT/exactness-llama8b.json" > "$OUT/exactness.log" 2>&1; tail -4 "$OUT/exactness.log" ;;
    ttft) python3 -m inferscale_apps.bench ttft $ARGS --max-model-len 16384 --ks ${KS:-0,5,10,20,50,100,200} \
        --repeats ${REPEATS:-20} --json "$OUT/ttft-llama-3.1-8b.json" --plot "$OUT/ttft-llama-3.1-8b.png" > "$OUT/ttft.log" 2>&1
      tail -30 "$OUT/ttft.log" | grep -v "it/s" ;;
    tiers) python3 -m inferscale_apps.bench tiers $ARGS --max-model-len 8192 --k 50 --repeats ${TIERS_REPEATS:-30} \
        --json "$OUT/tiers-llama-3.1-8b.json" > "$OUT/tiers.log" 2>&1; tail -9 "$OUT/tiers.log" ;;
    diskraw) # the disk itself, for the tiers' disk rows (cold and warm, one stream and 16)
      bash scripts/disk_raw.sh /tmp/diskraw 2>&1 | tee "$OUT/disk-raw.txt" ;;
    throughput) python3 -m inferscale_apps.bench throughput $ARGS --max-model-len 8192 --users 1,10,50,100 --k 50 \
        --json "$OUT/throughput-llama-3.1-8b.json" > "$OUT/throughput.log" 2>&1; tail -10 "$OUT/throughput.log" ;;
    knob) python3 -m inferscale_apps.bench ttft $ARGS --max-model-len 16384 --ks ${KS:-10,20,50,60} \
        --repeats ${REPEATS:-20} --recompute ${RECOMPUTE:-2,4,8,16} --json "$OUT/ttft-recompute-llama-3.1-8b.json" \
        > "$OUT/knob.log" 2>&1
      tail -40 "$OUT/knob.log" | grep -v "it/s" ;;
    graphcheck) python3 scripts/h200_graph_check.py "$M" --dummy-weights 2>&1 | grep "^{" | tee "$OUT/graphcheck.jsonl" ;;
    graphab) python3 -m inferscale_apps.bench ttft $ARGS --max-model-len 16384 --ks 0,50,200 \
        --engine-option 'compilation_config={"cudagraph_mode":"FULL_AND_PIECEWISE"}' \
        --json "$OUT/ttft-llama-3.1-8b-piecewise.json" > "$OUT/graphab.log" 2>&1
      tail -12 "$OUT/graphab.log" | grep -v "it/s" ;;
    cacheab) python3 -m inferscale_apps.bench ttft $ARGS --max-model-len 16384 --ks ${KS:-0,50,200} \
        --repeats ${REPEATS:-20} --engine-option prefix_cache_injected=true \
        --json "$OUT/ttft-llama-3.1-8b-prefix-cached.json" > "$OUT/cacheab.log" 2>&1
      tail -12 "$OUT/cacheab.log" | grep -v "it/s" ;;
    mp) python3 scripts/h200_mp.py "$M" "$OUT" ${MP_MODES:-} > "$OUT/mp.log" 2>&1
      grep -E "^(multiprocess|inprocess) |Error|error" "$OUT/mp.log" | tail -40 ;;
    mpsplit) # where a k=50 request's time goes, multiprocess against in-process (vLLM's own timestamps)
      python3 scripts/h200_mp_split.py "$M" 2>&1 | grep -E "^(multiprocess|inprocess) |Error" | tee "$OUT/mp-split.txt" ;;
    mpretain) # multiprocess k=50 with every staged span kept for reuse: no staging copies
      MP_KS=50 MP_REPEATS=20 MP_THROUGHPUT=0 MP_STAGED_GIB=4 python3 scripts/h200_mp.py "$M" "$OUT" multiprocess \
        > "$OUT/mpretain.log" 2>&1; grep -E "^multiprocess " "$OUT/mpretain.log" | tail -8 ;;
    cudatests) # the CUDA tests: tiers, exchange, injection streams and table, retrieval's query graph and index
      python3 -m pytest -q -p no:cacheprovider tests/test_memory_tiers.py tests/test_kv_exchange.py \
        tests/test_injection_streams.py tests/test_injection_table.py tests/test_query_encoder.py \
        tests/test_memory_search.py "tests/test_token_recompute.py::test_cuda_graph_replays_give_the_first_runs_rows" \
        "tests/test_token_recompute.py::test_fused_attention_sees_what_the_chunked_one_sees" -m "not minilm" 2>&1 | tail -6 ;;
    retrievalvariants) # one query's retrieval by encoder precision; warm, paused, after other GPU work
      python3 scripts/h200_retrieval_variants.py 2>&1 | tee "$OUT/retrieval-variants.txt" | grep -E "^(fp|tf|bf)|Error" ;;
    profile) python3 scripts/h200_profile.py "$M" 2>&1 | grep "k=" ;;
    promote) python3 scripts/h200_promote.py 50 2>&1 | grep -E "k=|copies" ;;
    tierspromo) python3 scripts/tiers_promotion.py cuda 50 2>&1 | tee "$OUT/tiers-promotion.txt" ;;
    coldtext) python3 scripts/make_configs.py /tmp/models --tokenizer .carry/smollm2-tokenizer > /dev/null
      python3 scripts/profile_cold_plan.py --model /tmp/models/llama-3.1-8b-text --device cuda --dummy-weights \
        --disk-bps 0 --k ${KS:-50,200} --repeats ${REPEATS:-30} --ttft --check --no-prefix-cache --json "$OUT/cold-text.json" 2>&1 \
        | grep -E "^(k=|disk|Traceback|[A-Za-z]*Error)" | tee "$OUT/cold-text.txt" ;;
    tokenrecompute) # recompute_tokens on the CUDA path: cost at k=5/50 and each row's distance to the prompt
      python3 scripts/make_configs.py /tmp/models --tokenizer .carry/smollm2-tokenizer > /dev/null
      for pass in ${PASSES:-forward separate}; do  # the rows in vLLM's forward pass, or a pass of their own
        python3 scripts/token_recompute_cost.py --model /tmp/models/llama-3.1-8b-text --device cuda --dummy-weights \
          --dtype bfloat16 --k ${KS:-5,50} --repeats ${REPEATS:-20} $([ $pass = separate ] && echo --separate-pass) \
          2>&1 | grep -E "^\{|Traceback|Error" | tee -a "$OUT/token-recompute.jsonl"
      done ;;
    forwardrecompute) # the rows riding vLLM's forward pass: their CUDA tests, one in-process engine a pytest
      # process (never the cpu params on this vLLM build); ~5 min, so their cost is a step of its own
      for t in "test_forward_recompute.py::test_rows_ride_the_forward_pass_as_the_separate_pass_computes_them[cuda-full]" \
               "test_forward_recompute.py::test_rows_ride_the_forward_pass_as_the_separate_pass_computes_them[cuda-default]" \
               "test_forward_recompute.py::test_rows_ride_the_forward_pass_as_the_separate_pass_computes_them[cuda-v1]" \
               "test_forward_recompute.py::test_requests_recomputed_in_one_step_each_get_their_own_rows[cuda]" \
               "test_token_recompute.py::test_cuda_graph_replays_give_the_first_runs_rows"; do
        python3 -m pytest -q -p no:cacheprovider -s "tests/$t" > "$OUT/pytest.log" 2>&1
        grep -E "^cuda |in_forward=|Error|assert" "$OUT/pytest.log" | tail -4; grep -E "passed|failed|error" "$OUT/pytest.log" | tail -1
      done ;;
    forwardcost) # their cost, PASSES of: full (the engine's default full graphs, the rows sequences of vLLM's
      # own attention), separate (a pass of their own, same card), piecewise (piecewise graphs, with the rows'
      # host time per layer: --profile), knob (full graphs, header:5 alone and on top of the knob's R=KNOB_R)
      python3 scripts/make_configs.py /tmp/models --tokenizer .carry/smollm2-tokenizer > /dev/null
      for pass in ${PASSES:-full separate piecewise knob}; do
        python3 scripts/token_recompute_cost.py --model /tmp/models/llama-3.1-8b-text --device cuda --dummy-weights \
          --dtype bfloat16 --k ${KS:-5,50} --repeats ${REPEATS:-10} $([ $pass = separate ] && echo --separate-pass) \
          $([ $pass = piecewise ] && echo --cudagraph-mode FULL_AND_PIECEWISE --profile "$OUT/forward-recompute-host-split.json") \
          $([ $pass = knob ] && echo --recompute 0,${KNOB_R:-4} --rules header:5) \
          2>&1 | grep -E "^\{|Traceback|Error" | tee -a "$OUT/token-recompute-forward.jsonl"
      done ;;
    promoteprof) python3 scripts/h200_promote.py 50 --cprofile 2>&1 | tail -26 ;;
    promotesplit) python3 scripts/h200_promote.py 50 --split 2>&1 | grep -E "^k=|^    " | tee "$OUT/promote-split.txt" ;;
    hosttier) python3 scripts/h200_hosttier.py "$M" 50 2>&1 | grep "^k=" ;;
  esac
done
