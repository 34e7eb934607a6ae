"""Fact encoding inside the serving vLLM engine (no second copy of the weights).

An encode request is an ordinary one-token prefill of ``[context][fact]...`` whose capture
ranges tell the connector which rows to keep. What goes in front of a fact (its context, or
the facts before it in a sliding chunk) is decided by :mod:`inferscale_engine.memory.text.context`.
"""

from __future__ import annotations

import queue
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from inferscale_engine.types import EncodeWindow

if TYPE_CHECKING:
    # Runtime imports live in encode_windows: importing this module must not pay for vLLM.
    from inferscale_engine.connector.exchange import KVExchange
    from inferscale_engine.kv import FactKV
    from inferscale_engine.loop import Loop


def encode_windows(
    loop: Loop,
    exchange: KVExchange,
    windows: Sequence[EncodeWindow],
    *,
    max_model_len: int,
    inline: bool = False,
    progress: bool = False,
    keys: Sequence[Sequence[str | None]] | None = None,
) -> list[list[FactKV]]:
    """Run every window through vLLM in one batch; return the KV of each range, in order.
    vLLM's workers write each range's rows into room reserved in ``exchange``; ``inline``:
    the plans travel as objects (vLLM runs in this process). ``keys``: per window, per range,
    the span key its KV will be served under, if known: the exchange keeps that room staged for
    it (:meth:`~inferscale_engine.connector.exchange.KVExchange.take_capture`)."""
    from vllm import SamplingParams

    from inferscale_engine import vllm_compat as compat
    from inferscale_engine.connector.plan import CapturePlan, CaptureRange, SharedKV

    for w in windows:
        if not w.ranges or any(n <= 0 for _, n in w.ranges):
            raise ValueError("every encode range needs at least one token")
        if len(w.token_ids) >= max_model_len:
            raise ValueError(
                f"encode window of {len(w.token_ids)} tokens does not fit max_model_len={max_model_len}"
            )
    if keys is not None and [len(k) for k in keys] != [len(w.ranges) for w in windows]:
        raise ValueError("keys need one entry per range of every window")
    ids = [[uuid.uuid4().hex for _ in w.ranges] for w in windows]
    rooms = {}
    for w, cids in zip(windows, ids):
        for cid, (_, n) in zip(cids, w.ranges):
            rooms[cid] = exchange.reserve_capture(n)
    segments = exchange.descriptors({loc.segment for loc in rooms.values()})

    done: queue.SimpleQueue = queue.SimpleQueue()
    params = []
    try:
        for i, (w, cids) in enumerate(zip(windows, ids)):
            kv = SharedKV(exchange.geometry, {c: rooms[c] for c in cids}, segments)
            plan = CapturePlan(tuple(CaptureRange(c, s, n) for c, (s, n) in zip(cids, w.ranges)), kv)
            sp = SamplingParams(max_tokens=1, temperature=0.0, skip_clone=True,
                                extra_args={"kv_transfer_params": plan.to_params(inline=inline)})
            params.append(sp)
            # A fresh salt keeps vLLM's prefix cache from skipping rows we must see computed.
            prompt = compat.token_prompt(list(w.token_ids), f"encode-{cids[0]}")

            def listener(out: Any, t: float, i: int = i) -> None:
                if _final(out):
                    done.put((i, out))

            loop.submit(prompt, sp, listener)
        errors = []
        for _ in tqdm(range(len(windows)), desc="encoding", unit="window", disable=not progress):
            i, out = done.get()
            if isinstance(out, BaseException):
                errors.append(out)
        if errors:
            raise errors[0]
        names = keys if keys is not None else [[None] * len(w.ranges) for w in windows]
        return [
            [exchange.take_capture(rooms.pop(c), position=s, keep_as=key)
             for c, (s, _), key in zip(cids, w.ranges, window_keys)]
            for w, cids, window_keys in zip(windows, ids, names)
        ]
    finally:
        for room in rooms.values():  # what was not taken: an error, or requests still running
            exchange.release_capture(room)


def _final(out: object) -> bool:
    return isinstance(out, BaseException) or bool(getattr(out, "finished", False))
