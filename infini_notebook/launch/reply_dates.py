"""The date in each rank's reply, read without dateutil.

ipyparallel's client turns every execute reply's ``started`` time into a datetime through
``ipyparallel.util._parse_date`` (``Client._extract_metadata``, ipyparallel 9.2), which
calls ``dateutil.parser.parse``: about 17 % of the client IO thread's busy time at 256
simulated ranks (py-spy, benchmarks/bench_scale.py; docs/scale.md). The strings are the
ISO 8601 forms its own pattern (``util.ISO8601_PAT``) admits, which the standard library's
``datetime.fromisoformat`` reads (Python >= 3.11) to the same value; anything it does not
read goes to the stock parser, so every input gives the stock instant and UTC offset (the
tzinfo is a ``datetime.timezone``, where dateutil gives its own ``tzutc``/``tzoffset``)."""

from __future__ import annotations

from datetime import datetime

from ..core import internals

_PARTS = ("_parse_date", "ISO8601_PAT", "_ensure_tzinfo")  # private: ipyparallel.util


def stock(util):
    """ipyparallel's own parser, whether or not ours is installed over it."""
    return getattr(util._parse_date, "stock", util._parse_date)


def make_parser(util):
    """A drop-in for ``util._parse_date``: None and non-dates as they are, dates as the
    stock parser gives them (aware datetimes; a naive one made local by
    ``util._ensure_tzinfo``, with its warning)."""
    stock_parse, pattern, ensure_tz = stock(util), util.ISO8601_PAT, util._ensure_tzinfo

    def parse_date(s):
        if not isinstance(s, str) or not pattern.match(s):
            return stock_parse(s)  # None, or a string that stays a string
        try:
            dt = datetime.fromisoformat(s)
        except ValueError:  # a form this Python's fromisoformat lacks
            return stock_parse(s)
        return dt if dt.tzinfo else ensure_tz(dt)

    parse_date.stock = stock_parse  # also what marks it as ours
    return parse_date


def install() -> None:
    """Put the fast parser in ipyparallel.util (once per process); stock if its parts moved."""
    from ipyparallel import util

    if util._parse_date is not stock(util):  # installed already
        return
    if internals.usable(util, _PARTS, "ipyparallel", "reply dates without dateutil"):
        util._parse_date = make_parser(util)
