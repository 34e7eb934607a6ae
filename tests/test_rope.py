"""Chunked RoPE against vLLM's own rotary modules: rotating stored keys by a position delta
equals applying the model's rotary embedding at the serving position."""

from __future__ import annotations

import pytest
import torch

from inferscale_engine.rope import RopeTable, rotate

HEAD = 64


def _rope(style: str, partial: float = 1.0):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params = {"rope_theta": 500000.0, "rope_type": "default", "partial_rotary_factor": partial}
    if style == "llama3":
        params.update(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=256)
    if style == "yarn":
        params.update(rope_type="yarn", factor=4.0, original_max_position_embeddings=512)
    with set_current_vllm_config(VllmConfig()):
        return get_rope(HEAD, 4096, is_neox_style=style != "gptj", rope_parameters=params, dtype=torch.float32)


def _apply(rope, positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """vLLM's rotation of ``keys`` ([n, heads, head]) at ``positions``."""
    n, heads, _ = keys.shape
    query = torch.zeros(n, heads * HEAD)
    _, k = rope.forward_native(positions, query, keys.reshape(n, heads * HEAD).clone())
    return k.view(n, heads, HEAD)


@pytest.mark.parametrize("style,partial", [("default", 1.0), ("llama3", 1.0), ("gptj", 1.0), ("default", 0.5), ("yarn", 1.0)])
def test_delta_rotation_matches_model_rope(style, partial):
    rope = _rope(style, partial)
    table = RopeTable.from_module(rope)
    torch.manual_seed(0)
    raw = torch.randn(40, 2, HEAD)
    encoded_at = torch.arange(40) + 7  # encoded after 7 context tokens
    served_at = torch.arange(40) + 1500  # served much later
    stored = _apply(rope, encoded_at, raw)
    moved = rotate(stored[None], served_at - encoded_at, table)[0]
    assert torch.allclose(moved, _apply(rope, served_at, raw), atol=2e-4, rtol=1e-4)
    # Backwards too: a fact served earlier than it was encoded.
    back = rotate(moved[None], encoded_at - served_at, table)[0]
    assert torch.allclose(back, stored, atol=2e-4, rtol=1e-4)


def test_zero_delta_is_bit_identical_and_unrotated_keys_differ():
    rope = _rope("llama3")
    table = RopeTable.from_module(rope)
    keys = torch.randn(3, 12, 2, HEAD, dtype=torch.bfloat16)
    deltas = torch.tensor([0, 5] * 6)
    out = rotate(keys, deltas, table)
    assert torch.equal(out[:, 0::2], keys[:, 0::2])
    assert not torch.allclose(out[:, 1::2].float(), keys[:, 1::2].float(), atol=1e-2)


def test_delta_beyond_table_is_refused():
    table = RopeTable.from_module(_rope("default"))
    with pytest.raises(ValueError, match="exceeds"):
        rotate(torch.randn(1, 1, 1, HEAD), torch.tensor([table.max_delta + 1]), table)


@pytest.mark.parametrize("style,partial", [("gptj", 1.0), ("default", 0.5)])
def test_rotation_by_layer_chunks_equals_one_pass_and_leaves_the_input_alone(style, partial, monkeypatch):
    """On a CPU the rotation goes a few layers at a time (cache-sized): the same bits as one pass."""
    import inferscale_engine.rope as rope_module

    table = RopeTable.from_module(_rope(style, partial))
    torch.manual_seed(0)
    keys = torch.randn(7, 40, 2, HEAD)  # 7 layers
    before = keys.clone()
    deltas = torch.randint(-300, 300, (40,))
    whole = rotate(keys, deltas, table)
    monkeypatch.setattr(rope_module, "CPU_CHUNK_ELEMS", 2 * keys[0].numel())  # chunks of 2, 2, 2, 1
    assert torch.equal(rotate(keys, deltas, table), whole)
    assert torch.equal(keys, before)  # rotated in a copy: stored KV is read, never written
    assert torch.equal(rotate(keys[3], deltas, table), whole[3])  # one layer, no layer axis


def _rotated_in_a_copy(keys: torch.Tensor, deltas: torch.Tensor, table: RopeTable) -> torch.Tensor:
    """The rotation as every dtype but fp32 runs it: an fp32 copy rotated in place, copied back."""
    idx = deltas.abs()
    cos = table.cos[idx][:, None, :]
    sin = (table.sin[idx] * torch.sign(deltas).unsqueeze(-1))[:, None, :]
    rd = table.rotary_dim
    out = keys.clone()
    x = keys[..., :rd].to(torch.float32, copy=True)
    x1, x2 = (x[..., : rd // 2], x[..., rd // 2 :]) if table.is_neox_style else (x[..., 0::2], x[..., 1::2])
    new_x1 = (x1 * cos).addcmul_(x2, sin, value=-1)
    x2.mul_(cos).addcmul_(x1, sin)
    x1.copy_(new_x1)
    out[..., :rd] = x
    return out


@pytest.mark.parametrize("style,partial", [("default", 1.0), ("gptj", 1.0), ("default", 0.5)])
def test_fp32_keys_rotated_straight_into_the_output_keep_the_bits_of_a_copy(style, partial):
    """fp32 keys skip the working copy; every bit is what rotating a copy gives."""
    table = RopeTable.from_module(_rope(style, partial))
    torch.manual_seed(1)
    keys = torch.randn(3, 50, 2, HEAD)
    deltas = torch.randint(1, 900, (50,))
    assert torch.equal(rotate(keys, deltas, table), _rotated_in_a_copy(keys, deltas, table))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_deltas_of_either_sign_and_zero_rotate_as_a_copy_does(dtype):
    """Host deltas take numpy's way to their angles (no torch call per check): the same bits as
    the torch reference, backwards rotations and unmoved rows included, whatever their int dtype."""
    table = RopeTable.from_module(_rope("llama3"))
    torch.manual_seed(2)
    keys = torch.randn(3, 60, 2, HEAD).to(dtype)
    deltas = torch.randint(-900, 900, (60,))
    deltas[::7] = 0
    want = _rotated_in_a_copy(keys, deltas, table)
    still = deltas == 0
    want[:, still] = keys[:, still]
    assert torch.equal(rotate(keys, deltas, table), want)
    assert torch.equal(rotate(keys, deltas.int(), table), want)
    assert rotate(keys, torch.zeros(60, dtype=torch.int64), table) is keys
