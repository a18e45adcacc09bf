"""core/keep.py: --keep durations, session names and the lease's verdict (no processes)."""

from __future__ import annotations

import pytest

from infini_notebook.core.errors import DistUsageError
from infini_notebook.core.keep import check_name, format_duration, lease_verdict, parse_duration


@pytest.mark.parametrize(
    "text, seconds", [("90s", 90), ("10m", 600), ("2h", 7200), ("1d", 86400), ("45", 45)]
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0s", "-5m", "10 minutes", "2x"])
def test_bad_durations_name_the_form(text):
    with pytest.raises(DistUsageError, match="90s, 10m, 2h"):
        parse_duration(text)


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


def _fake_session(tmp_path, monkeypatch, name: str, watchdog: list, mode: int = 0o700):
    """A session folder as launch/keep.py writes it, in a temporary directory of its own."""
    import json
    import os
    import tempfile

    from infini_notebook.launch import keep
    from infini_notebook.launch.watchdog import FOLDER_PREFIX

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = tmp_path / f"{FOLDER_PREFIX}x"
    folder.mkdir()
    os.chmod(folder, mode)
    path = folder / keep.CONNECTION
    path.write_text(json.dumps({"name": name, "watchdog": watchdog}))
    os.chmod(path, 0o600)
    return folder


def test_a_stale_connection_file_is_one_line_and_removed(tmp_path, monkeypatch):
    from infini_notebook.launch import keep

    folder = _fake_session(tmp_path, monkeypatch, "old", [999999, 1.0])  # no such process
    with pytest.raises(DistUsageError, match=r"Cannot attach session 'old': stale"):
        keep.find("old")
    assert not folder.exists()
    assert keep.kept_sessions() == {}


def test_a_connection_file_others_can_read_is_refused(tmp_path, monkeypatch):
    import os

    import psutil

    from infini_notebook.launch import keep

    me = psutil.Process()
    _fake_session(tmp_path, monkeypatch, "open", [me.pid, me.create_time()], mode=0o755)
    with pytest.raises(DistUsageError, match="not this user's alone: refused"):
        keep.find("open")
    with pytest.raises(DistUsageError, match="No kept session is named 'nope'"):
        keep.find("nope")
    assert os.path.isdir(tmp_path)
