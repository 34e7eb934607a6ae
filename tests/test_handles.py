"""Handle format: parsing, splitting and MAC checks, property-based."""

from __future__ import annotations

import secrets

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferscale_engine.errors import ForgedHandleError, MalformedHandleError
from inferscale_engine.handles import HandleCodec, find_handles, split_on_handles

codec = HandleCodec(secrets.token_bytes(32))
fact_ids = st.text("0123456789abcdef", min_size=16, max_size=16)
users = st.text(min_size=1, max_size=40)
# Text that cannot form a handle by itself (no '<<mem:').
plain = st.text().filter(lambda t: "<<mem:" not in t and not t.endswith("<<mem") and not t.endswith("<"))


@given(st.lists(st.tuples(plain, fact_ids), max_size=6), plain, users)
def test_split_round_trips_and_finds_every_handle(parts, last, user):
    handles = [codec.make(user, fid) for _, fid in parts]
    text = "".join(p + h for (p, _), h in zip(parts, handles)) + last
    pieces, found = split_on_handles(text)
    assert [h.text for h in found] == handles
    assert len(pieces) == len(found) + 1
    rebuilt = pieces[0] + "".join(h.text + p for h, p in zip(found, pieces[1:]))
    assert rebuilt == text
    assert all(codec.verify(h, user) == fid for h, (_, fid) in zip(found, parts))


@given(fact_ids, users, users)
def test_handle_of_one_user_is_refused_for_another(fid, owner, other):
    handle = codec.make(owner, fid)
    if other != owner:
        with pytest.raises(ForgedHandleError):
            codec.verify(handle, other)


@given(fact_ids, users, st.integers(0, 15), st.sampled_from("0123456789abcdef"))
def test_altered_handles_are_refused(fid, user, pos, char):
    handle = codec.make(user, fid)
    body = handle[6:-2]  # 'fact:mac'
    i = pos if pos < 16 else pos + 1
    altered_body = body[:i] + char + body[i + 1 :]
    if altered_body != body:
        with pytest.raises(ForgedHandleError):
            codec.verify("<<mem:" + altered_body + ">>", user)


def test_another_store_secret_cannot_mint_handles():
    handle = HandleCodec(secrets.token_bytes(32)).make("alice", "0" * 16)
    with pytest.raises(ForgedHandleError):
        codec.verify(handle, "alice")


@pytest.mark.parametrize("bad", ["<<mem:>>", "<<mem:xyz:abc>>", "<<mem:" + "0" * 16 + ">>", "<<mem:" + "A" * 16 + ":" + "0" * 16 + ">>"])
def test_malformed_handles_are_reported(bad):
    with pytest.raises(MalformedHandleError):
        find_handles(f"before {bad} after")
