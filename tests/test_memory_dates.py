"""Relative dates resolved at write time (inferscale_engine.memory.text.dates; issue 36), and
the store option that applies it (``resolve_dates``)."""

from __future__ import annotations

import datetime as dt

import pytest

from inferscale_engine.config import EngineConfig, MemoryConfig
from inferscale_engine.memory import MemoryStore
from inferscale_engine.memory.text.dates import parse_session_date, resolve_relative_dates
from inferscale_engine.memory.text.embedder import Embedder

MON_8_MAY_2023 = dt.date(2023, 5, 8)
SAT_6_MAY_2023 = dt.date(2023, 5, 6)
SUN_31_DEC_2023 = dt.date(2023, 12, 31)
MON_1_JAN_2024 = dt.date(2024, 1, 1)
FRI_1_MAR_2024 = dt.date(2024, 3, 1)  # after a leap day

RESOLVED = [
    # (written on, text, expected)
    (MON_8_MAY_2023, "I went to a support group yesterday.", "I went to a support group yesterday (7 May 2023)."),
    (MON_8_MAY_2023, "Yesterday was great", "Yesterday (7 May 2023) was great"),
    (MON_8_MAY_2023, "yesterday's party", "yesterday's (7 May 2023) party"),
    (MON_8_MAY_2023, "last night", "last night (7 May 2023)"),
    (MON_8_MAY_2023, "the day before yesterday", "the day before yesterday (6 May 2023)"),
    (MON_8_MAY_2023, "today", "today (8 May 2023)"),
    (MON_8_MAY_2023, "tonight", "tonight (8 May 2023)"),
    (MON_8_MAY_2023, "this morning", "this morning (8 May 2023)"),
    (MON_8_MAY_2023, "tomorrow", "tomorrow (9 May 2023)"),
    (MON_8_MAY_2023, "the day after tomorrow", "the day after tomorrow (10 May 2023)"),
    (MON_8_MAY_2023, "two days ago", "two days ago (6 May 2023)"),
    (MON_8_MAY_2023, "2 days ago", "2 days ago (6 May 2023)"),
    (MON_8_MAY_2023, "a day ago", "a day ago (7 May 2023)"),
    (MON_8_MAY_2023, "last Saturday", "last Saturday (6 May 2023)"),
    (MON_8_MAY_2023, "last Monday", "last Monday (1 May 2023)"),  # said on a Monday: a week back
    (MON_8_MAY_2023, "last Sunday", "last Sunday (7 May 2023)"),
    (MON_8_MAY_2023, "last week", "last week (the week of 1 May 2023)"),
    (MON_8_MAY_2023, "this week", "this week (the week of 8 May 2023)"),
    (MON_8_MAY_2023, "next week", "next week (the week of 15 May 2023)"),
    (MON_8_MAY_2023, "two weeks ago", "two weeks ago (the week of 24 April 2023)"),
    (MON_8_MAY_2023, "a week ago", "a week ago (the week of 1 May 2023)"),
    (MON_8_MAY_2023, "last month", "last month (April 2023)"),
    (MON_8_MAY_2023, "this month", "this month (May 2023)"),
    (MON_8_MAY_2023, "next month", "next month (June 2023)"),
    (MON_8_MAY_2023, "3 months ago", "3 months ago (February 2023)"),
    (MON_8_MAY_2023, "last year", "last year (2022)"),
    (MON_8_MAY_2023, "this year", "this year (2023)"),
    (MON_8_MAY_2023, "next year", "next year (2024)"),
    (MON_8_MAY_2023, "five years ago", "five years ago (2018)"),
    (MON_8_MAY_2023, "this weekend", "this weekend (the weekend of 13 May 2023)"),
    (MON_8_MAY_2023, "last weekend", "last weekend (the weekend of 6 May 2023)"),
    (MON_8_MAY_2023, "this past weekend", "this past weekend (the weekend of 6 May 2023)"),
    # On a weekend, "this weekend" is the one under way and "last weekend" the one before.
    (SAT_6_MAY_2023, "this weekend", "this weekend (the weekend of 6 May 2023)"),
    (SAT_6_MAY_2023, "last weekend", "last weekend (the weekend of 29 April 2023)"),
    (SAT_6_MAY_2023, "last Saturday", "last Saturday (29 April 2023)"),
    (SUN_31_DEC_2023, "this weekend", "this weekend (the weekend of 30 December 2023)"),
    (SUN_31_DEC_2023, "last weekend", "last weekend (the weekend of 23 December 2023)"),
    # Across month and year ends.
    (SUN_31_DEC_2023, "tomorrow", "tomorrow (1 January 2024)"),
    (SUN_31_DEC_2023, "next week", "next week (the week of 1 January 2024)"),
    (SUN_31_DEC_2023, "next month", "next month (January 2024)"),
    (SUN_31_DEC_2023, "last Sunday", "last Sunday (24 December 2023)"),
    (MON_1_JAN_2024, "yesterday", "yesterday (31 December 2023)"),
    (MON_1_JAN_2024, "last Saturday", "last Saturday (30 December 2023)"),
    (MON_1_JAN_2024, "two days ago", "two days ago (30 December 2023)"),
    (MON_1_JAN_2024, "last week", "last week (the week of 25 December 2023)"),
    (MON_1_JAN_2024, "last month", "last month (December 2023)"),
    (MON_1_JAN_2024, "last year", "last year (2023)"),
    (MON_1_JAN_2024, "13 months ago", "13 months ago (December 2022)"),
    (FRI_1_MAR_2024, "yesterday", "yesterday (29 February 2024)"),
    (FRI_1_MAR_2024, "last Thursday", "last Thursday (29 February 2024)"),
    # Several in one text, each on its own.
    (MON_8_MAY_2023, "Last week I ran; yesterday I rested; next month I race.",
     "Last week (the week of 1 May 2023) I ran; yesterday (7 May 2023) I rested; next month (June 2023) I race."),
]

UNTOUCHED = [
    "I painted a lake sunrise.",
    "over the last week I ran every day",  # the past seven days, not a calendar week
    "The last month has been hard",
    "a few days ago",
    "a couple of days ago",
    "next Friday",  # this week's or the next one's: it depends on the speaker
    "this Friday",
    "next weekend",
    "I finished it in two days",
    "twenty two days ago",  # not "two days ago"
    "I love Saturdays",
    "Tomorrowland was fun",
    "a last-minute change",
    "",
]


@pytest.mark.parametrize(("when", "text", "expected"), RESOLVED)
def test_resolves_relative_dates(when, text, expected):
    assert resolve_relative_dates(text, when) == expected


@pytest.mark.parametrize(("when", "text", "expected"), RESOLVED)
def test_resolving_twice_changes_nothing(when, text, expected):
    assert resolve_relative_dates(expected, when) == expected
    # Nor does resolving what was written on another day: an annotation is never annotated again.
    assert resolve_relative_dates(expected, when + dt.timedelta(days=40)) == expected


@pytest.mark.parametrize("text", UNTOUCHED)
def test_leaves_what_it_cannot_resolve(text):
    assert resolve_relative_dates(text, MON_8_MAY_2023) == text


def test_takes_a_datetime_as_its_day():
    assert resolve_relative_dates("yesterday", dt.datetime(2023, 5, 8, 23, 59)) == "yesterday (7 May 2023)"


@pytest.mark.parametrize(("text", "expected"), [
    ("1:56 pm on 8 May, 2023", dt.datetime(2023, 5, 8, 13, 56)),
    ("10:37 am on 27 June, 2023", dt.datetime(2023, 6, 27, 10, 37)),
    ("12:09 am on 13 September, 2023", dt.datetime(2023, 9, 13, 0, 9)),
    ("12:30 pm on 1 Jan, 2024", dt.datetime(2024, 1, 1, 12, 30)),
])
def test_parses_locomo_session_dates(text, expected):
    assert parse_session_date(text) == expected


@pytest.mark.parametrize("text", ["8 May 2023", "13:56 pm on 8 May, 2023", "1:56 pm on 8 Mai, 2023",
                                  "1:56 pm on 31 February, 2023", ""])
def test_refuses_what_is_no_session_date(text):
    with pytest.raises(ValueError):
        parse_session_date(text)


# ---------------------------------------------------------------------- the store option


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder()


MONTH_NAMES = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
               "November", "December")


def _written_on(timestamp: str, days: int = 0) -> str:
    """``timestamp``'s UTC day moved by ``days``, as the store writes it."""
    day = dt.datetime.fromisoformat(timestamp).astimezone(dt.UTC).date() + dt.timedelta(days=days)
    return f"{day.day} {MONTH_NAMES[day.month - 1]} {day.year}"


def test_store_with_resolve_dates_stores_the_date_of_its_own_write(tmp_path, embedder):
    with MemoryStore.from_config(None, MemoryConfig(path=tmp_path, embedder=embedder, resolve_dates=True)) as store:
        [item] = store.add("I went to a support group yesterday.", user_id="u")
        assert item.memory == f"I went to a support group yesterday ({_written_on(item.created_at, -1)})."
        [added] = store.add_texts(["We hike tomorrow"], user_id="u")
        assert added.memory == f"We hike tomorrow ({_written_on(added.created_at, 1)})"
        updated = store.update(item.id, "She moves next month, she said today.", user_id="u")
        assert updated.memory.endswith(f"today ({_written_on(updated.updated_at)}).")
        assert "next month (" in updated.memory
        # Stored so: listed, searched and reopened with the date.
        assert sorted(i.memory for i in store.get_all(user_id="u")) == sorted([updated.memory, added.memory])
        assert store.search("hike", user_id="u", k=1)[0].memory == added.memory
    with MemoryStore(None, tmp_path, embedder=embedder) as reopened:
        assert sorted(i.memory for i in reopened.get_all(user_id="u")) == sorted([updated.memory, added.memory])


def test_store_leaves_text_alone_by_default(tmp_path, embedder):
    with MemoryStore(None, tmp_path, embedder=embedder) as store:
        assert [i.memory for i in store.add("I went to a support group yesterday.", user_id="u")] == \
            ["I went to a support group yesterday."]
        assert [i.memory for i in store.add_texts(["last week (the week of 1 May 2023)"], user_id="u")] == \
            ["last week (the week of 1 May 2023)"]


def test_engine_config_and_command_line_reach_the_stores_option():
    from inferscale_apps.cli import build_parser, engine_kwargs

    assert MemoryConfig.for_engine(EngineConfig(resolve_dates=True)).resolve_dates is True
    assert MemoryConfig.for_engine(EngineConfig()).resolve_dates is False
    assert engine_kwargs(build_parser().parse_args(["serve", "--resolve-dates"]))["resolve_dates"] is True
    # Unset, the flag leaves --engine-option resolve_dates=... as it is.
    args = build_parser().parse_args(["serve", "--engine-option", "resolve_dates=true"])
    assert engine_kwargs(args)["resolve_dates"] is True
    assert "resolve_dates" not in engine_kwargs(build_parser().parse_args(["serve"]))
