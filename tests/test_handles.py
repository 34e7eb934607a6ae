"""Handle format: parsing, splitting and MAC checks, property-based."""

from __future__ import annotations

import hmac
import re
import secrets
from dataclasses import FrozenInstanceError, fields

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale_engine.errors import ForgedHandleError, MalformedHandleError
from inferscale_engine.handles import HANDLE_PATTERN, Handle, HandleCodec, find_handles, split_on_handles

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
    codec.verify(handle, owner)  # remembered as genuine for its owner only
    if other != owner:
        with pytest.raises(ForgedHandleError):
            codec.verify(handle, other)


@given(fact_ids, users, st.integers(0, 15), st.sampled_from("0123456789abcdef"))
def test_altered_handles_are_refused(fid, user, pos, char):
    handle = codec.make(user, fid)
    codec.verify(handle, user)  # remembered: an altered copy must still be checked
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


def _handles_by_definition(text):
    """Handles as defined: every run of "<<mem:", then no '<', '>' or whitespace, then ">>", in
    order without overlap; each a well-formed handle, else the text is malformed (None)."""
    found = []
    for m in re.finditer(r"<<mem:([^<>\s]*)>>", text):
        strict = HANDLE_PATTERN.fullmatch(m.group(0))
        if strict is None:
            return None
        found.append((strict.group(1), strict.group(2), m.start(), m.end()))
    return found


handle_shaped = st.lists(st.sampled_from(["<<mem:", ">>", "<", ">", ":", " ", "\n", "m", "0" * 16, "f" * 16, "A",
                                          "<<mem:" + "0" * 16 + ":" + "f" * 16 + ">>"]), max_size=12).map("".join)


@settings(max_examples=500)
@given(handle_shaped)
def test_handles_found_are_those_the_definition_finds(text):
    expected = _handles_by_definition(text)
    if expected is None:
        with pytest.raises(MalformedHandleError):
            find_handles(text)
    else:
        assert [(h.fact_id, h.mac, h.start, h.end) for h in find_handles(text)] == expected


@given(st.lists(st.tuples(plain, fact_ids), min_size=1, max_size=4), users)
def test_handles_found_are_the_handles_the_constructor_makes(parts, user):
    # find_handles fills Handle's slots itself, without __init__: each one is still equal (and
    # hashes equal) to the Handle its fields make, and as frozen.
    text = "".join(p + codec.make(user, fid) for p, fid in parts)
    # What it fills: a field or a __post_init__ added to Handle must be added there too.
    assert [f.name for f in fields(Handle)] == ["fact_id", "mac", "start", "end"]
    assert not hasattr(Handle, "__post_init__")
    for h in find_handles(text):
        made = Handle(h.fact_id, h.mac, h.start, h.end)
        assert type(h) is Handle and h == made and hash(h) == hash(made) and repr(h) == repr(made)
        assert text[h.start:h.end] == h.text and len(h.fact_id) == 16 and len(h.mac) == 16
        with pytest.raises(FrozenInstanceError):
            h.start = 0  # type: ignore[misc]


@pytest.mark.parametrize("bad", ["<<mem:>>", "<<mem:xyz:abc>>", "<<mem:" + "0" * 16 + ">>", "<<mem:" + "A" * 16 + ":" + "0" * 16 + ">>"])
def test_malformed_handles_are_reported(bad):
    with pytest.raises(MalformedHandleError):
        find_handles(f"before {bad} after")


@pytest.fixture
def hmacs(monkeypatch):
    """Every HMAC computed (a remembered handle costs none)."""
    calls: list[bytes] = []
    digest = hmac.digest

    def counted(key, msg, name):
        calls.append(msg)
        return digest(key, msg, name)

    monkeypatch.setattr(hmac, "digest", counted)
    return calls


def test_a_genuine_handle_is_checked_once_then_remembered(hmacs):
    codec = HandleCodec(secrets.token_bytes(32))
    handle = codec.make("alice", "0" * 16)
    hmacs.clear()
    for _ in range(3):
        assert codec.verify(handle, "alice") == "0" * 16
        assert codec.verify(find_handles(handle)[0], "alice") == "0" * 16
    assert len(hmacs) == 1


def test_forged_and_other_users_handles_are_refused_every_time_after_the_genuine_one_was_remembered(hmacs):
    codec = HandleCodec(secrets.token_bytes(32))
    handle = codec.make("alice", "0" * 16)
    codec.verify(handle, "alice")
    fact, mac = handle[6:-2].split(":")
    forged = f"<<mem:{fact}:{'0' * 16 if mac != '0' * 16 else '1' * 16}>>"
    other_fact = f"<<mem:{'1' * 16}:{mac}>>"  # the genuine MAC on another fact
    hmacs.clear()
    for _ in range(3):
        for text, user in [(forged, "alice"), (other_fact, "alice"), (handle, "bob"), (handle, "alice ")]:
            with pytest.raises(ForgedHandleError):
                codec.verify(text, user)
    assert len(hmacs) == 3 * 4  # a refusal is never remembered: each attempt is checked again
    assert codec.verify(handle, "alice") == "0" * 16


def test_another_codec_remembers_nothing_of_this_ones_verdicts():
    # What a store reopened after `inferscale memory rotate-secret` does: a new codec, a new secret.
    old = HandleCodec(secrets.token_bytes(32))
    handle = old.make("alice", "0" * 16)
    old.verify(handle, "alice")
    with pytest.raises(ForgedHandleError):
        HandleCodec(secrets.token_bytes(32)).verify(handle, "alice")


def test_remembered_handles_are_bounded_least_recently_used_first(hmacs):
    codec = HandleCodec(secrets.token_bytes(32), remember=2)
    a, b, c = (codec.make("alice", str(i) * 16) for i in range(3))
    for handle in (a, b, a, c):  # c pushes out b, the least recently used
        codec.verify(handle, "alice")
    hmacs.clear()
    codec.verify(a, "alice")
    codec.verify(c, "alice")
    assert hmacs == []
    codec.verify(b, "alice")
    assert len(hmacs) == 1
