"""Each rank's reply date, read without dateutil (launch/reply_dates.py): the same value
as ipyparallel's own parser for every string its ISO 8601 pattern admits, and the stock
result for everything else."""

from __future__ import annotations

import warnings
from datetime import datetime, timedelta, timezone

from hypothesis import given, settings
from hypothesis import strategies as st
from ipyparallel import util

from infini_notebook.launch import reply_dates

stock = reply_dates.stock(util)  # ipyparallel's own (dateutil)
FAST = reply_dates.make_parser(util)


@st.composite
def iso_strings(draw):
    """Dates as engines and controllers write them, in every form ISO8601_PAT admits."""
    dt = draw(st.datetimes(min_value=datetime(1970, 1, 2), max_value=datetime(2200, 1, 1)))
    text = dt.strftime("%Y-%m-%dT%H:%M:%S")
    digits = draw(st.integers(0, 6))
    if digits:
        text += "." + f"{dt.microsecond:06d}"[:digits]
    zone = draw(st.sampled_from(["Z", "colon", "plain"]))
    if zone == "Z":
        return text + "Z"
    minutes = draw(st.integers(-14 * 60, 14 * 60))
    sign, hours, mins = "+" if minutes >= 0 else "-", abs(minutes) // 60, abs(minutes) % 60
    return text + f"{sign}{hours:02d}{':' if zone == 'colon' else ''}{mins:02d}"


@settings(max_examples=500, deadline=None)
@given(iso_strings())
def test_every_iso_form_gives_the_stock_value_and_offset(s):
    ours, theirs = FAST(s), stock(s)
    assert ours == theirs and ours.utcoffset() == theirs.utcoffset(), (s, ours, theirs)


def test_none_plain_words_and_near_dates_stay_as_they_are():
    for s in [None, "", "idle", "2026-11-28", "2026-11-28T07:30", "2026-11-28T07:30:00.1234567Z",
              "2026-11-28 07:30:00Z", "not 2026-11-28T07:30:00Z"]:  # fmt: skip
        assert FAST(s) == stock(s) == s


def test_a_naive_date_is_made_local_as_the_stock_parser_does():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # both warn: "Interpreting naive datetime as local"
        ours, theirs = FAST("2026-11-28T07:30:00.5"), stock("2026-11-28T07:30:00.5")
    assert ours == theirs and ours.tzinfo is not None


def test_install_puts_it_in_ipyparallel_once_and_the_reply_metadata_uses_it():
    reply_dates.install()
    fast = util._parse_date
    reply_dates.install()
    assert util._parse_date is fast and fast is not stock and fast.stock is stock
    started = fast("2026-11-28T07:30:00.250000Z")
    assert started == datetime(2026, 11, 28, 7, 30, 0, 250000, tzinfo=timezone.utc)
    assert started - fast("2026-11-28T08:30:00.250000+01:00") == timedelta(0)
