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


def _fake_session(
    tmp_path, monkeypatch, name: str, watchdog: list, mode: int = 0o700, tag: str = "x", **data
):
    """A session folder as launch/keep.py writes it, in a temporary directory of its own."""
    import json
    import os
    import tempfile

    from infini_notebook.launch import keep
    from infini_notebook.launch.watchdog import FOLDER_PREFIX

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = tmp_path / f"{FOLDER_PREFIX}{tag}"
    folder.mkdir()
    os.chmod(folder, mode)
    path = folder / keep.CONNECTION
    path.write_text(json.dumps({"name": name, "watchdog": watchdog, **data}))
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


def test_a_stale_session_leaves_no_process_and_no_shared_memory(tmp_path, monkeypatch):
    """Its watchdog killed: what it left (the controller and the template do not watch it)
    is ended, and its /dev/shm folder removed, with its folder, when it is found stale."""
    import os
    import secrets
    import subprocess
    import time

    from infini_notebook.launch import keep
    from infini_notebook.launch.watchdog import MARK

    tag = secrets.token_hex(4)
    folder = _fake_session(
        tmp_path, monkeypatch, "left", [999999, 1.0], tag=tag, created=time.time() - 5
    )
    env = dict(os.environ, **{MARK: str(folder / "profile")})
    left = subprocess.Popen(["sleep", "60"], env=env)  # a controller nobody ends
    shm = f"/dev/shm/{folder.name}-{tag}"
    os.mkdir(shm, 0o700)
    try:
        assert keep.kept_sessions() == {}
        assert left.wait(10) is not None
        assert not folder.exists() and not os.path.exists(shm)
    finally:
        left.kill()
        if os.path.isdir(shm):
            os.rmdir(shm)


def test_a_folder_of_another_user_does_not_hide_a_session_of_mine(tmp_path, monkeypatch):
    import os
    import pickle

    import psutil

    from infini_notebook.launch import keep

    me = psutil.Process()
    alive = [me.pid, me.create_time()]
    theirs = _fake_session(tmp_path, monkeypatch, "train", alive, mode=0o755, tag="a")
    mine = _fake_session(tmp_path, monkeypatch, "train", alive, tag="b", created=1.0, keep_s=60)
    (mine / keep.PLAN).write_bytes(pickle.dumps({"plan": 1}))
    os.chmod(mine / keep.PLAN, 0o600)
    monkeypatch.setattr(keep, "_candidates", lambda: [str(theirs), str(mine)])
    assert keep.find("train").workdir == str(mine)
    monkeypatch.setattr(keep, "_candidates", lambda: [str(theirs)])
    with pytest.raises(DistUsageError, match="not this user's alone: refused"):
        keep.find("train")


def test_stop_by_name_does_not_wait_on_a_watchdog_nobody_reaps(tmp_path, monkeypatch):
    """The watchdog of a session still driven by its first kernel is that kernel's child:
    once it ended it stays a zombie while the kernel lives. %dist_stop NAME returns."""
    import os
    import pickle
    import subprocess
    import sys
    import time

    import psutil

    from infini_notebook.launch import keep

    parent = subprocess.Popen(  # the kernel: starts the watchdog and never reaps it
        [sys.executable, "-c", "import subprocess, time\n"
         "print(subprocess.Popen(['sleep', '0.5']).pid, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        watchdog = psutil.Process(int(parent.stdout.readline()))
        folder = _fake_session(
            tmp_path, monkeypatch, "zomb", [watchdog.pid, watchdog.create_time()],
            created=1.0, keep_s=60,
        )  # fmt: skip
        (folder / keep.PLAN).write_bytes(pickle.dumps({"plan": 1}))
        os.chmod(folder / keep.PLAN, 0o600)
        t0 = time.monotonic()
        keep.stop("zomb", timeout=20)
        assert time.monotonic() - t0 < 5
        assert watchdog.status() == psutil.STATUS_ZOMBIE
    finally:
        parent.kill()
        parent.wait()
