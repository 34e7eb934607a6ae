"""Resolving a prompt of many handles: the text between them is tokenized once per distinct
piece, and the segments are exactly the pieces' own token ids."""

from __future__ import annotations

import pytest

from inferscale_engine.engine import InferScaleEngine
from inferscale_engine.types import Span


@pytest.fixture(scope="module")
def engine(tiny_llama, tmp_path_factory):
    with InferScaleEngine(model=tiny_llama, device="cpu", max_model_len=2048, recompute=0,
                          store_path=tmp_path_factory.mktemp("pieces-store")) as eng:
        yield eng


def test_repeated_separators_are_tokenized_once_and_laid_out_as_their_ids(engine, monkeypatch):
    items = engine.memory.add_texts([f"fact number {i} about the garden" for i in range(6)], user_id="u")
    engine.memory.wait_for_encoding()
    handles = [engine.memory.handle(it.id, user_id="u") for it in items]
    prompt = "Facts:\n" + "\n".join(handles[:4]) + ", " + ", ".join(handles[4:]) + handles[0] + "\nQ?"
    calls: list[str] = []
    tokenize = engine.tokenize
    monkeypatch.setattr(engine, "tokenize", lambda text, **kw: calls.append(text) or tokenize(text, **kw))
    segments = engine.resolve(prompt, user_id="u")
    # The head, "\n", ", " and "\nQ?": the empty piece between side-by-side handles needs none.
    assert sorted(calls) == sorted(["Facts:\n", "\n", ", ", "\nQ?"])
    pieces = segments[0::2]
    assert all(isinstance(s, Span) for s in segments[1::2]) and len(pieces) == 8
    assert [list(p) for p in pieces[1:]] == [tokenize(t) for t in ["\n", "\n", "\n", ", ", ", ", "", "\nQ?"]]
