"""``split_facts``: one message with two topics becomes two memories; anything that would not
read as a fact on its own stays whole (no engine needed)."""

from __future__ import annotations

import pytest

from inferscale_engine.memory import split_facts  # the path docs/memory.md gives


@pytest.mark.parametrize(("text", "parts"), [
    # independent clauses, each with its own subject
    ("My dog is called Rex and I live in Lisbon.", ["My dog is called Rex.", "I live in Lisbon."]),
    ("I live in Berlin, but my brother lives in Paris", ["I live in Berlin.", "My brother lives in Paris."]),
    ("I work as a nurse; my husband is a pilot.", ["I work as a nurse.", "My husband is a pilot."]),
    ("Rex is my dog and Kiwi is my parrot.", ["Rex is my dog.", "Kiwi is my parrot."]),
    ("My wife works as a teacher and we have two kids.", ["My wife works as a teacher.", "We have two kids."]),
    ("I went to Paris and then I flew to Rome.", ["I went to Paris.", "I flew to Rome."]),
    ("My dog is Rex. I live in Lisbon. I am a nurse.", ["My dog is Rex.", "I live in Lisbon.", "I am a nurse."]),
    ("My dog is Rex. What's the weather like?", ["My dog is Rex.", "What's the weather like?"]),
    ("Please remember that my dog is Rex and I live in Lisbon.",
     ["Please remember that my dog is Rex.", "I live in Lisbon."]),
])
def test_two_topics_become_two_facts(text, parts):
    assert split_facts(text) == parts


@pytest.mark.parametrize("text", [
    "My sister is Maria and she lives in Rome.",    # "she" needs the first clause
    "I live in Lisbon and I love it.",              # "it" too
    "I live in Lisbon and my sister does too.",
    "My car is red. I bought it in 2020.",
    "My friends Tom and I went hiking.",            # "and" joins two subjects
    "Tom and I are friends.",
    "I like tea and coffee.",                       # ... or two objects
    "I have a cat and a dog.",
    "Ugh, long day. My car, a blue Toyota, broke down again on the way home.",  # chatter stays with its fact
    "Haha yes, and by the way my son Leo just turned seven.",
    "I'm allergic to peanuts, so no peanut snacks for me.",
    "Dr. Smith is my doctor.",
    "Please remember: my bicycle is painted bright orange.",
    "my dog is called rex",                          # a single fact is kept exactly as typed
])
def test_one_fact_stays_whole(text):
    assert split_facts(text) == [text]


def test_no_text_is_lost():
    text = "Hi. My parrot is called Kiwi and I live in Porto; my brother Tom lives in Madrid. Ok."
    parts = split_facts(text)
    assert len(parts) == 3
    def words(t: str) -> list[str]:
        return [w.strip(".,;") for w in t.lower().split()]

    assert words(" ".join(parts)) == [w for w in words(text) if w != "and"]  # only the "and" that joined them goes


def test_blank():
    assert split_facts("   ") == []
