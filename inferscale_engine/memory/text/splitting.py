"""Rule-based splitting of one message into independent facts, so each is its own memory.

"My dog is called Rex and I live in Lisbon." stored whole is one embedding for two topics: the
query "where do I live?" scored it 0.236 (issue 24), below facts about nothing related. Split,
each part is found by its own topic and injected on its own.

The rules are deliberately conservative; a part is split off only when it reads as a fact by
itself:

* sentences (``.`` ``!`` ``?`` followed by a space) and ``;`` separate clauses;
* ``and`` / ``but`` (optionally ``, and also`` ...) separate clauses when the clause after it
  starts with its own subject that refers to nobody earlier (I, my, we, our, the, a name):
  "... and she lives in Rome" stays with the sentence that says who "she" is;
* both sides must have a verb (from a list of common ones, a contraction after a pronoun, or a
  pronoun subject followed by a word), so "My friends Tom and I went hiking" and lists
  ("I like tea and coffee") stay whole;
* a piece that fails these tests is joined back to its neighbour: no text is ever dropped.

No model is involved (fast, deterministic, testable); Mem0-style model extraction is
``add(..., infer=True)`` in :mod:`inferscale_engine.memory.text.extraction`.
"""

from __future__ import annotations

import re

__all__ = ["split_facts"]

#: Subjects a clause can start with and still be understood alone.
_SELF_SUBJECTS = frozenset("i i'm i've i'd i'll my we we're we've we'd our the".split())
#: Pronouns that refer back to something said before: a clause starting with one stays attached.
_ANAPHORIC = frozenset("he she they it his her their its he's she's they're it's this that these those "
                       "him them there's".split())
#: Words that point back to something said before ("... and I love it", "... and my wife does too").
_REFERS_BACK = frozenset("it them him there that this these those too either same both".split())
_PRONOUN_SUBJECTS = frozenset("i we you he she they".split())
_VERBS = frozenset("""
    am is are was were be been being have has had having do does did will would can could shall should
    may might must live lives lived work works worked like likes liked love loves loved hate hates hated
    prefer prefers preferred play plays played drive drives drove own owns owned speak speaks spoke study
    studies studied teach teaches taught go goes went come comes came need needs needed want wants wanted
    enjoy enjoys enjoyed eat eats ate drink drinks drank use uses used know knows knew called named born
    moved move moves got get gets keep keeps kept take takes took make makes made run runs ran read reads
    write writes wrote watch watches watched visit visits visited support supports supported turned turns
    became become becomes started start starts finished has collect collects collected ride rides rode wear
    wears wore grew grow grows bought buy buys sold sell sells met meet meets married lost won feel feels felt
    think thinks thought believe believes remember remembers
""".split())
_CONTRACTIONS = ("'m", "'re", "'ve", "'ll", "'d", "’m", "’re", "’ve", "’ll", "’d")

_SENTENCE_END = re.compile(r"(?<=[.!?;])\s+")
# "and"/"but" between clauses, with an optional comma and "also"/"then"/"besides" after it.
_CONJUNCTION = re.compile(r",?\s+(?:and|but)\s+(?:(?:also|then|besides|now),?\s+)?", re.IGNORECASE)
_WORD = re.compile(r"[\w'’]+")


#: "that" after these introduces what follows ("remember that my ..."), it points back to nothing.
_SAYING = frozenset("remember know think note believe mind say said sure forget".split())


def _words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def _pointers(words: list[str]) -> set[str]:
    """The words of ``words`` that point back to something said before."""
    return {w for i, w in enumerate(words) if w in _REFERS_BACK and not (w == "that" and i and words[i - 1] in _SAYING)}


def _has_verb(words: list[str]) -> bool:
    if any(w in _VERBS for w in words):
        return True
    if any(w.endswith(_CONTRACTIONS) for w in words):
        return True
    if any(w.endswith(("'s", "’s")) and w[:-2] in _PRONOUN_SUBJECTS | {"it", "that", "name", "there"} for w in words):
        return True
    # "I ride ...", "we cycle ...": a pronoun subject directly followed by a word is a verb phrase.
    if len(words) >= 2 and words[0] in _PRONOUN_SUBJECTS and words[1] not in ("and", "or"):
        return True
    # "my wife teaches": a possessive, a noun, then a verb-looking word.
    return len(words) >= 3 and words[0] in ("my", "our") and not words[1].endswith(("'s", "’s")) \
        and re.fullmatch(r"[a-z]+(?:s|ed)", words[2]) is not None


def _stands_alone(clause: str) -> bool:
    """A fact by itself: a verb, at least three words, and no word pointing back."""
    words = _words(clause)
    return len(words) >= 3 and words[0] not in _ANAPHORIC and not _pointers(words) and _has_verb(words)


def _points_back(sentence: str) -> bool:
    words = _words(sentence)
    return bool(words) and (words[0] in _ANAPHORIC or bool(_pointers(words)))


def _own_subject(clause: str) -> bool:
    """Starts with a subject of its own (so "and" joins two clauses, not two objects)."""
    words = _words(clause)
    if not words:
        return False
    first = _WORD.search(clause)
    named = first is not None and first.group(0)[0].isupper() and words[0] not in _ANAPHORIC
    return words[0] in _SELF_SUBJECTS or named


def _finish(part: str, end: str) -> str:
    part = part.strip().rstrip(",;")
    if not part:
        return part
    part = part[0].upper() + part[1:]
    if part[-1] not in ".!?":
        part += end
    return part


def _split_sentence(sentence: str) -> list[str]:
    """Clauses of one sentence joined by and/but, each standing alone."""
    end = sentence.rstrip()[-1:] if sentence.rstrip()[-1:] in ("!", "?") else "."
    body = sentence.strip().rstrip(".!?;").strip()
    parts: list[str] = []
    last = 0
    for m in _CONJUNCTION.finditer(body):
        left, right = body[last:m.start()], body[m.end():]
        if _own_subject(right) and _stands_alone(left) and _stands_alone(_next_clause(right)):
            parts.append(left)
            last = m.end()
    parts.append(body[last:])
    if len(parts) == 1:
        sentence = sentence.strip()
        return [sentence[:-1] + "." if sentence.endswith(";") else sentence]
    return [_finish(p, end) for p in parts]


def _next_clause(text: str) -> str:
    """``text`` up to its next and/but (what a split would make the following part)."""
    m = _CONJUNCTION.search(text)
    return text[:m.start()] if m else text


def split_facts(text: str) -> list[str]:
    """The independent facts of ``text``, in order; ``[text.strip()]`` when it is one.

    >>> split_facts("My dog is called Rex and I live in Lisbon.")
    ['My dog is called Rex.', 'I live in Lisbon.']
    >>> split_facts("My sister is Maria and she lives in Rome.")
    ['My sister is Maria and she lives in Rome.']
    """
    text = text.strip()
    if not text:
        return []
    pieces: list[str] = []
    for sentence in _SENTENCE_END.split(text):
        if not sentence.strip():
            continue
        # A sentence that does not stand alone ("Ugh, long day.", "She lives in Rome.", "Dr.")
        # goes with its neighbour: with the previous one if it points back, else the next one.
        if pieces and (not _stands_alone(pieces[-1]) or not _stands_alone(sentence) and _points_back(sentence)):
            pieces[-1] = f"{pieces[-1]} {sentence.strip()}"
        else:
            pieces.append(sentence.strip())
    if len(pieces) > 1 and not _stands_alone(pieces[-1]):
        last = pieces.pop()
        pieces[-1] = f"{pieces[-1]} {last}"
    parts = [part for piece in pieces for part in _split_sentence(piece) if part]
    return [p[0].upper() + p[1:] for p in parts] if len(parts) > 1 else [text]
