"""The front end's reader of vLLM's server-sent events (``inferscale_engine.remote``), fed the
bytes as a socket may deliver them: events split anywhere, several in one read."""

from __future__ import annotations

import asyncio
import json

import pytest

from inferscale_engine.errors import InferScaleError
from inferscale_engine.testing import sse_events


class _Content:
    """aiohttp's ``StreamReader`` as ``sse_events`` reads it: ``iter_any()`` yields what arrived."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def iter_any(self):
        for piece in self.pieces:
            yield piece


def _read(pieces: list[bytes]) -> list[dict]:
    async def collect() -> list[dict]:
        return [event async for event in sse_events(_Content(pieces))]

    return asyncio.run(collect())


EVENTS = [{"choices": [{"text": "Hello", "token_ids": [1, 2]}]}, {"choices": [{"text": " there", "token_ids": [3]}]},
          {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 7}}}]
STREAM = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in EVENTS) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("size", [1, 3, 17, len(STREAM)])
def test_events_split_anywhere_are_read_whole(size):
    assert _read([STREAM[i : i + size] for i in range(0, len(STREAM), size)]) == EVENTS


def test_a_stream_cut_before_done_is_an_error():
    with pytest.raises(InferScaleError, match="closed the stream"):
        _read([STREAM[: STREAM.index(b"data: [DONE]")]])
