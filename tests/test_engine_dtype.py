"""The dtype a CPU engine runs a bfloat16 model in.

vLLM's CPU platform runs such a model in bfloat16 on every x86 CPU, emulated (~4.5× slower) where
the CPU lacks AVX-512 BF16: the engine's ``dtype="auto"`` takes float32 there, and a dtype named
outright is kept.
"""

from __future__ import annotations

import platform

import pytest
import torch
from tiny_models import build_tiny_model

from inferscale_engine import InferScaleEngine
from inferscale_engine.vllm_compat import cpu_emulates_bfloat16

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the rule is x86's"),
]


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("bf16") / "tiny-llama-bf16", "llama", dtype="bfloat16"))


def _served_dtype(model: str, **options: str) -> torch.dtype:
    with InferScaleEngine(model=model, device="cpu", max_model_len=256, recompute=0, **options) as engine:
        assert engine.generate("Caroline adopted a dog", max_tokens=4).text
        return engine.dtype


def test_auto_runs_bfloat16_natively_or_in_float32(bf16_model: str) -> None:
    assert _served_dtype(bf16_model) == (torch.float32 if cpu_emulates_bfloat16() else torch.bfloat16)


def test_a_named_dtype_is_kept(bf16_model: str) -> None:
    assert _served_dtype(bf16_model, dtype="bfloat16") == torch.bfloat16
