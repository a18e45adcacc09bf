"""core/keep.py: --keep durations, session names and the lease's verdict (no processes)."""

from __future__ import annotations

import pytest

from infini_notebook.core.errors import DistUsageError
from infini_notebook.core.keep import (
    check_name,
    format_duration,
    kept_clause,
    lease_verdict,
    parse_duration,
)


@pytest.mark.parametrize(
    "text, seconds", [("90s", 90), ("10m", 600), ("2h", 7200), ("1d", 86400), ("45", 45)]
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0s", "-5m", "10 minutes", "2x"])
def test_bad_durations_name_the_form(text):
    with pytest.raises(DistUsageError, match="90s, 10m, 2h"):
        parse_duration(text)


def test_a_bare_keep_flag_says_how_to_write_a_duration():
    """``%dist_start --name a --keep`` (the duration forgotten): the same advice, not
    argparse's bare 'expected one argument'."""
    from IPython.core.magic_arguments import parse_argstring

    from infini_notebook.core.options import StartOptions
    from infini_notebook.core.plan_checks import make_plan
    from infini_notebook.magics import DistMagics

    args = parse_argstring(DistMagics.dist_start, "--nprocs 2 --name a --keep")
    options = StartOptions.from_args(args)
    with pytest.raises(DistUsageError, match="--keep needs a duration: write it as 90s, 10m"):
        make_plan(**{k: v for k, v in vars(options).items() if v is not None})


def test_the_keep_time_is_said_as_the_user_gave_it():
    assert kept_clause(parse_duration("2h")) == "waits 2h for a kernel once none drives it"
    assert kept_clause(parse_duration("90s")) == "waits 1m 30s for a kernel once none drives it"


def test_format_duration_keeps_two_units():
    assert format_duration(500) == "8m 20s"
    assert format_duration(7500) == "2h 5m"
    assert format_duration(0) == "0s"


def test_names():
    assert check_name("train-7b.v2") == "train-7b.v2"
    for bad in ("", "-x", "a b", "x" * 65, "a/b"):
        with pytest.raises(DistUsageError, match="cannot name a session"):
            check_name(bad)


def test_the_lease_holds_while_driven_or_within_its_keep_time():
    kept = {"keep_s": 60}
    assert lease_verdict(kept, True, None, 1000) == "hold"
    assert lease_verdict(kept, False, 1000, 1059) == "hold"
    assert lease_verdict(kept, False, 1000, 1060) == "end"
    assert lease_verdict(dict(kept, end=True), True, None, 1000) == "end"
    assert lease_verdict({}, False, 1000, 1000) == "end"  # an ordinary session's kernel died
