"""The one LoCoMo reader (no model needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inferscale_apps.bench.locomo_data import default_data_path, load_locomo, speaker_user

LOCOMO = default_data_path() if default_data_path().exists() else Path(__file__).parent / "data" / "locomo_excerpt.json"


def test_turns_of_the_first_conversation():
    (conv,) = load_locomo(LOCOMO, conversations=1)
    assert conv.speakers == ("Caroline", "Melanie")
    first = conv.turns[0]
    assert (first.speaker, first.dia_id, first.session) == ("Caroline", "D1:1", 1)
    assert first.memory == "[1:56 pm on 8 May, 2023] Caroline: Hey Mel! Good to see you! How have you been?"
    assert {t.speaker for t in conv.turns} == {"Caroline", "Melanie"}
    assert any(" [shares " in t.text for t in conv.turns)
    assert speaker_user("locomo", conv.sample_id, "Caroline") == f"locomo-{conv.sample_id}-Caroline"
    assert speaker_user("", "conv 1", "Mel B") == "conv_1-Mel_B"


def test_photo_caption_and_sessions(tmp_path):
    sample = {
        "sample_id": "s",
        "conversation": {
            "speaker_a": "Ann", "speaker_b": "Bo",
            "session_1_date_time": " d1 ",
            "session_1": [{"speaker": "Bo", "dia_id": "D1:1", "text": "Look!", "blip_caption": "a cat"},
                          {"speaker": "Ann", "dia_id": "D1:2", "text": "  "}],
            "session_2_date_time": "d2",
            "session_2": [{"speaker": "Ann", "dia_id": "D2:1", "text": "Hi"}],
        },
    }
    path = tmp_path / "l.json"
    path.write_text(json.dumps([sample]))
    (conv,) = load_locomo(path)
    assert [(t.memory, t.session) for t in conv.turns] == [("[d1] Bo: Look! [shares a cat]", 1), ("[d2] Ann: Hi", 2)]
    assert conv.questions == []


@pytest.mark.parametrize("data", [{"not": "a list"}, [{"conversation": {"speaker_a": "A"}}], [3]])
def test_bad_files_are_value_errors(tmp_path, data):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="LoCoMo|conversation"):
        load_locomo(path)


def test_categories_keep_only_those_questions():
    (conv,) = load_locomo(LOCOMO, conversations=1, categories=[2])
    (every,) = load_locomo(LOCOMO, conversations=1)
    assert conv.questions and {q.category for q in conv.questions} == {2}
    assert conv.questions == [q for q in every.questions if q.category == 2]  # same indexes: cached answers match
    with pytest.raises(ValueError, match="categories"):
        load_locomo(LOCOMO, conversations=1, categories=[5])


def test_resolve_dates_against_the_session_date(tmp_path):
    sample = {
        "sample_id": "s",
        "conversation": {
            "speaker_a": "Ann", "speaker_b": "Bo",
            "session_1_date_time": "1:56 pm on 8 May, 2023",
            "session_1": [{"speaker": "Bo", "dia_id": "D1:1", "text": "I ran last Saturday.", "blip_caption": "a race"},
                          {"speaker": "Ann", "dia_id": "D1:2", "text": "Nice!"}],
            "session_2_date_time": "10:37 am on 2 January, 2024",
            "session_2": [{"speaker": "Ann", "dia_id": "D2:1", "text": "I moved last month."}],
        },
    }
    path = tmp_path / "l.json"
    path.write_text(json.dumps([sample]))
    (conv,) = load_locomo(path, resolve_dates=True)
    assert [t.memory for t in conv.turns] == [
        "[1:56 pm on 8 May, 2023] Bo: I ran last Saturday (6 May 2023). [shares a race]",
        "[1:56 pm on 8 May, 2023] Ann: Nice!",
        "[10:37 am on 2 January, 2024] Ann: I moved last month (December 2023).",
    ]
    assert [t.text for t in load_locomo(path)[0].turns][0] == "I ran last Saturday. [shares a race]"
