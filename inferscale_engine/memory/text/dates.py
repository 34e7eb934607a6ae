"""Relative dates made absolute at write time.

A memory says "I went to a support group yesterday"; asked months later "when did she go?",
the model must work the date out from the date the memory was written, and a small model reading
injected KV mostly copies "yesterday" instead (docs/benchmarks-locomo.md, "Dates").
:func:`resolve_relative_dates` writes the date next to the expression, once, when the memory is
stored: "yesterday (7 May 2023)".

Only expressions with one reading are resolved: "last Saturday" is the latest Saturday before
the day, "last week" the calendar week (Monday first) before its week. Expressions whose reading
depends on the speaker ("next Friday" said on a Monday, "next weekend", "this Friday", "in two
days" as a duration, "a few days ago", "the last week" meaning the past seven days) are left as
they are. English only; no locale is consulted, so the result is the same on every machine.

:func:`parse_session_date` reads LoCoMo's session dates ("1:56 pm on 8 May, 2023").
"""

from __future__ import annotations

import datetime as dt
import re

__all__ = ["parse_session_date", "resolve_relative_dates"]

MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December")
WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
NUMBERS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
           "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12}

_MONTH_NUMBER = {m.lower(): i for i, m in enumerate(MONTHS, 1)} | {m[:3].lower(): i for i, m in enumerate(MONTHS, 1)}
_SESSION_DATE = re.compile(
    r"\s*(\d{1,2}):(\d{2})\s*([ap])\.?m\.?\s+on\s+(\d{1,2})\s+([A-Za-z]+)\.?,?\s+(\d{4})\s*", re.IGNORECASE)

_COUNT = r"(?P<n>\d{1,3}|" + "|".join(NUMBERS) + r")"
_POSSESSIVE = r"(?:['\u2019]s)?"
# One alternation, longest phrases first: at a given position "the day before yesterday" wins over
# "yesterday", and re.sub never rescans what it inserted.
_EXPRESSION = re.compile(
    r"(?<![\w-])(?:"
    r"(?P<day_before>the day before yesterday)"
    r"|(?P<day_after>the day after tomorrow)"
    r"|(?P<ago>" + _COUNT + r" (?P<unit>day|week|month|year)s? ago)"
    r"|(?<!the )(?P<last_weekday>last (?P<weekday>" + "|".join(WEEKDAYS) + r"))"
    r"|(?<!the )(?P<last_weekend>(?:last|this past) weekend)"
    r"|(?<!the )(?P<this_weekend>this weekend)"
    r"|(?<!the )(?P<relative>(?P<which>last|this|next) (?P<span>week|month|year))"
    r"|(?P<yesterday>yesterday|last night)"
    r"|(?P<today>today|tonight|this morning|this afternoon|this evening)"
    r"|(?P<tomorrow>tomorrow)"
    r")" + _POSSESSIVE + r"(?![\w-])",
    re.IGNORECASE,
)
# "twenty two days ago" is not "two days ago".
_TENS_BEFORE = re.compile(r"(?:twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety|hundred)[\s-]+$",
                          re.IGNORECASE)
# What follows an expression that was already resolved: a parenthesis ending in a year. Every
# annotation this module writes has that shape, so a second pass leaves the first one's alone.
_ANNOTATED = re.compile(r"\s*\([^()]*\b\d{4}\)")


def parse_session_date(text: str) -> dt.datetime:
    """The moment a LoCoMo session date names: ``"1:56 pm on 8 May, 2023"`` ->
    ``datetime(2023, 5, 8, 13, 56)`` (naive, as the dataset gives no time zone).

    Raises:
        ValueError: ``text`` is not of that form.
    """
    m = _SESSION_DATE.fullmatch(text)
    month = _MONTH_NUMBER.get(m.group(5).lower()) if m else None
    if m is None or month is None:
        raise ValueError(f"not a session date like '1:56 pm on 8 May, 2023': {text!r}")
    hour, minute = int(m.group(1)), int(m.group(2))
    if not 1 <= hour <= 12:
        raise ValueError(f"not a 12-hour time: {text!r}")
    hour = hour % 12 + (12 if m.group(3).lower() == "p" else 0)
    return dt.datetime(int(m.group(6)), month, int(m.group(4)), hour, minute)


def resolve_relative_dates(text: str, when: dt.date | dt.datetime) -> str:
    """``text`` with the absolute date written after each relative date expression it can
    resolve against ``when`` (the day the text was written): "yesterday" -> "yesterday (7 May
    2023)", "last week" -> "last week (the week of 1 May 2023)", "last month" -> "last month
    (April 2023)". Expressions already followed by such a parenthesis are left alone, so a
    second call changes nothing; text without a resolvable expression comes back unchanged.
    """
    day = when.date() if isinstance(when, dt.datetime) else when

    def annotate(m: re.Match[str]) -> str:
        if _ANNOTATED.match(m.string, m.end()) or (
                m.group("ago") and _TENS_BEFORE.search(m.string, max(0, m.start() - 12), m.start())):
            return m.group(0)
        absolute = _resolve(m, day)
        return m.group(0) if absolute is None else f"{m.group(0)} ({absolute})"

    return _EXPRESSION.sub(annotate, text)


def _resolve(m: re.Match[str], day: dt.date) -> str | None:
    if m.group("yesterday"):
        return _day(day - dt.timedelta(days=1))
    if m.group("today"):
        return _day(day)
    if m.group("tomorrow"):
        return _day(day + dt.timedelta(days=1))
    if m.group("day_before"):
        return _day(day - dt.timedelta(days=2))
    if m.group("day_after"):
        return _day(day + dt.timedelta(days=2))
    if m.group("last_weekday"):
        back = (day.weekday() - WEEKDAYS.index(m.group("weekday").lower())) % 7 or 7
        return _day(day - dt.timedelta(days=back))
    if m.group("last_weekend"):
        # On a Saturday or Sunday the weekend under way is "this weekend": last is the one before.
        back = (day.weekday() - 5) % 7 if day.weekday() < 5 else day.weekday() - 5 + 7
        return f"the weekend of {_day(day - dt.timedelta(days=back))}"
    if m.group("this_weekend"):
        saturday = day + dt.timedelta(days=5 - day.weekday())
        return f"the weekend of {_day(saturday)}"
    if m.group("ago"):
        n = _count(m.group("n"))
        return _shift(day, m.group("unit").lower(), -n) if n else None
    step = {"last": -1, "this": 0, "next": 1}[m.group("which").lower()]
    return _shift(day, m.group("span").lower(), step)


def _shift(day: dt.date, unit: str, n: int) -> str:
    """The day, week, month or year ``n`` units away from ``day``'s."""
    if unit == "day":
        return _day(day + dt.timedelta(days=n))
    if unit == "week":
        monday = day - dt.timedelta(days=day.weekday()) + dt.timedelta(weeks=n)
        return f"the week of {_day(monday)}"
    if unit == "month":
        year, month = divmod(day.year * 12 + day.month - 1 + n, 12)
        return f"{MONTHS[month]} {year}"
    return str(day.year + n)


def _count(word: str) -> int:
    return int(word) if word.isdigit() else NUMBERS[word.lower()]


def _day(day: dt.date) -> str:
    return f"{day.day} {MONTHS[day.month - 1]} {day.year}"
