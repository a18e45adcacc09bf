"""Issue 48: kept sessions are entered by name in this user's private place
(launch/private_place.py), never found by globbing a folder others can write; every file of
a session folder is read without following a link or waiting on a FIFO, and checked on the
open file; nothing is unpickled. Attacks run as uid 65534 (tests/other_user.py) in /tmp and in
a world-writable folder without the sticky bit. No ranks here: fake session folders."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import stat
import tempfile
import time

import psutil
import pytest
from other_user import as_other, needs_root

from infini_notebook.core.errors import DistUsageError
from infini_notebook.core.plan import plan_to_json
from infini_notebook.engine import own_files
from infini_notebook.launch import kept_sessions, private_place
from infini_notebook.launch.machine import plan_from_options
from infini_notebook.launch.watchdog import FOLDER_PREFIX, MARK


@pytest.fixture
def short_tmp():
    """A folder with a short path: a session's socket lives under the place, and pytest's
    own (under xdist: /tmp/pytest-of-root/pytest-N/popen-gw0/test_name0) is too long."""
    path = tempfile.mkdtemp(prefix="pp", dir="/tmp")
    yield pathlib.Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def place(short_tmp, monkeypatch):
    path = short_tmp / "place"
    monkeypatch.setenv(private_place.ENV, str(path))
    return path


def _me() -> list:
    me = psutil.Process()
    return [me.pid, me.create_time()]


def _fake_session(place, name: str, watchdog: list, tag: str = "x", **data):
    """A session folder as launch/keep.py writes it, entered in the private place."""
    base = private_place.place()
    folder = os.path.join(base, f"{FOLDER_PREFIX}{tag}")
    os.mkdir(folder, 0o700)
    plan = plan_to_json(plan_from_options(None, nprocs=2, name=name, keep="1m"))
    body = {"name": name, "watchdog": watchdog, "created": 1.0, "keep_s": 60, "plan": plan}
    kept_sessions.write_private(
        os.path.join(folder, kept_sessions.CONNECTION), json.dumps(body | data).encode()
    )
    private_place.register(name, folder)
    return folder


def test_a_live_session_is_found_by_name_with_its_plan_and_nothing_else_is(place):
    folder = _fake_session(place, "train", _me())
    found = kept_sessions.find("train")
    assert found.workdir == folder and found.plan.world_size == 2 and found.plan.name == "train"
    assert list(kept_sessions.kept_sessions()) == ["train"]
    with pytest.raises(DistUsageError, match="No kept session is named 'nope'. Kept sessions: t"):
        kept_sessions.find("nope")
    assert stat.S_IMODE(os.stat(private_place.place()).st_mode) == 0o700


def test_a_stale_session_is_one_line_and_removed_with_what_it_left(place):
    """Its watchdog killed: what it left (the controller and the template do not watch it)
    is ended, and its /dev/shm folder removed, with its folder and its entry."""
    import secrets
    import subprocess

    tag = secrets.token_hex(4)
    folder = _fake_session(place, "old", [999999, 1.0], tag=tag, created=time.time() - 5)
    env = dict(os.environ, **{MARK: os.path.join(folder, "profile")})
    left = subprocess.Popen(["sleep", "60"], env=env)  # a controller nobody ends
    shm = f"/dev/shm/{os.path.basename(folder)}-{tag}"
    os.mkdir(shm, 0o700)
    try:
        with pytest.raises(DistUsageError, match=r"Cannot attach session 'old': stale.*removed"):
            kept_sessions.find("old")
        assert left.wait(10) is not None
        assert not os.path.exists(folder) and not os.path.exists(shm)
        assert private_place.names() == [] and kept_sessions.kept_sessions() == {}
    finally:
        left.kill()
        if os.path.isdir(shm):
            os.rmdir(shm)


def test_a_folder_swapped_after_its_entry_is_refused(place):
    folder = _fake_session(place, "train", _me())
    os.rename(folder, folder + "-moved")
    os.mkdir(folder, 0o700)  # same name, another inode
    with pytest.raises(DistUsageError, match="not the folder the session was registered with"):
        kept_sessions.find("train")
    os.rmdir(folder)
    os.symlink(folder + "-moved", folder)  # a link to the real one
    with pytest.raises(DistUsageError, match="symbolic link"):
        kept_sessions.find("train")


@pytest.mark.parametrize("kind", ["fifo", "zero", "link", "mode", "pickle"])
def test_connection_data_that_is_not_ours_is_refused_at_once_in_one_line(place, kind, tmp_path):
    """A FIFO (it would hang a reader), a link to /dev/zero (it would fill memory), a link to
    a file of ours, a file others may read, an old pickled plan: each refused within 1 s."""
    folder = _fake_session(place, "bad", _me())
    path = os.path.join(folder, kept_sessions.CONNECTION)
    os.remove(path)
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "zero":
        os.symlink("/dev/zero", path)
    elif kind == "link":
        (tmp_path / "real.json").write_text("{}")
        os.symlink(tmp_path / "real.json", path)
    elif kind == "mode":
        with open(path, "w") as f:
            f.write("{}")
        os.chmod(path, 0o644)
    else:  # a plan as the old code wrote it: never unpickled
        kept_sessions.write_private(path, b"\x80\x04cos\nsystem\n.")
    t0 = time.monotonic()
    with pytest.raises(DistUsageError) as e:
        kept_sessions.find("bad")
    assert time.monotonic() - t0 < 1.0
    assert "\n" not in str(e.value) and "Cannot attach session 'bad'" in str(e.value)
    assert kept_sessions.kept_sessions() == {}


def test_two_kernels_claiming_one_name_at_once_one_wins(place):
    """The name is claimed with O_EXCL before the start: of 8 processes racing, one gets
    it and the others get one line; a claim whose kernel is gone is stale."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    go, done = ctx.Event(), ctx.Event()
    results = ctx.Queue()

    def racer():
        go.wait()
        try:
            kept_sessions.claim_name("race")
            results.put("won")
            done.wait(60)  # a kernel still starting it, until every racer has tried
        except DistUsageError as e:
            results.put(str(e))

    procs = [ctx.Process(target=racer) for _ in range(8)]
    for p in procs:
        p.start()
    go.set()
    said = [results.get(timeout=30) for _ in procs]
    done.set()
    for p in procs:
        p.join(10)
    assert said.count("won") == 1, said
    lost = [s for s in said if s != "won"]
    assert all("is being started by kernel pid" in s and "\n" not in s for s in lost), lost
    kept_sessions.claim_name("race")  # its kernel ended: the claim is stale, the name free
    kept_sessions.release_name("race")
    assert private_place.names() == []


def test_writes_never_go_through_a_planted_link(place, tmp_path):
    folder = _fake_session(place, "w", _me())
    target = tmp_path / "target"
    target.write_text("untouched")
    # every temporary name a writer could use is a link: the write goes around them
    for i in range(64):
        os.symlink(target, os.path.join(folder, f".lease.json.{i:08x}"))
    kept_sessions.write_private(os.path.join(folder, "lease.json"), b'{"a": 1}')
    assert target.read_text() == "untouched"
    assert json.loads(own_files.read(os.path.join(folder, "lease.json"), 100)) == {"a": 1}
    os.remove(os.path.join(folder, "lease.json"))
    os.symlink(target, os.path.join(folder, "lease.json"))
    kept_sessions.write_private(os.path.join(folder, "lease.json"), b"{}")  # replaces the link
    assert target.read_text() == "untouched"
    assert not os.path.islink(os.path.join(folder, "lease.json"))


# ----- as another user -------------------------------------------------------------------------
@pytest.fixture
def shared_folder():
    """Folders in /tmp that uid 65534 can write (``mode``: 0o777 without the sticky bit, or
    0o1777), removed afterwards whatever was planted there."""
    import secrets
    import shutil
    from pathlib import Path

    made = []

    def make(mode: int) -> Path:
        path = Path(f"/tmp/inb-attack-{secrets.token_hex(4)}")
        path.mkdir()
        os.chmod(path, mode)
        made.append(path)
        return path

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def _plant(folder: str, payload_marker: str) -> str:
    """uid 65534: a session folder of its own in ``folder``, with a keep.json naming the
    victim's session, a FIFO, a link to /dev/zero and a pickle that would make a file."""
    import pickle  # noqa: F401 (the attacker's own payload)

    os.umask(0)
    evil = os.path.join(folder, f"{FOLDER_PREFIX}evil")
    os.makedirs(evil, 0o700, exist_ok=True)
    body = {"name": "train", "watchdog": [1, 0.0], "created": 1.0, "keep_s": 60}
    with open(os.path.join(evil, "keep.json"), "w") as f:
        json.dump(body, f)
    with open(os.path.join(evil, "plan.pickle"), "wb") as f:
        f.write(b"cos\nsystem\n(S'touch " + payload_marker.encode() + b"'\ntR.")
    fifo = os.path.join(folder, f"{FOLDER_PREFIX}fifo")
    os.makedirs(fifo, 0o777, exist_ok=True)
    if not os.path.exists(os.path.join(fifo, "keep.json")):
        os.mkfifo(os.path.join(fifo, "keep.json"), 0o666)
    zero = os.path.join(folder, f"{FOLDER_PREFIX}zero")
    os.makedirs(zero, 0o777, exist_ok=True)
    if not os.path.lexists(os.path.join(zero, "keep.json")):
        os.symlink("/dev/zero", os.path.join(zero, "keep.json"))
    return evil


def _swap_links(folder: str, victim: str, own: str, rounds: int) -> int:
    """uid 65534: a link in ``folder`` named as a session folder, re-pointed ``rounds``
    times between the victim's folder and its own."""
    link = os.path.join(folder, f"{FOLDER_PREFIX}swap")
    for i in range(rounds):
        tmp = f"{link}.{i}"
        os.symlink(victim if i % 2 else own, tmp)
        os.replace(tmp, link)
    return rounds


@needs_root
@pytest.mark.parametrize("shared", ["sticky", "no-sticky"])
def test_planted_sessions_links_and_fifos_in_tmp_are_never_seen(place, shared_folder, shared):
    """The attacks of issue 48 in /tmp-like folders, as uid 65534, while this user lists,
    finds and attaches: nothing planted is listed or adopted, no FIFO hangs, no pickle runs,
    and a link race of 1,000 swaps changes nothing (the private place is not in there)."""
    import threading

    ww = shared_folder(0o1777 if shared == "sticky" else 0o777)
    marker = str(ww / "pwned")
    os.environ["TMPDIR"] = str(ww)  # where the old code looked
    try:
        evil = as_other(_plant, str(ww), marker)
        assert isinstance(evil, str), evil
        folder = _fake_session(place, "train", _me())
        racing = threading.Thread(target=as_other, args=(_swap_links, str(ww), folder, evil, 1000))
        racing.start()
        t0 = time.monotonic()
        while racing.is_alive():
            assert list(kept_sessions.kept_sessions()) == ["train"]
            assert kept_sessions.find("train").workdir == folder
        racing.join()
        assert time.monotonic() - t0 < 60
        assert not os.path.exists(marker)  # the pickle never ran
        assert kept_sessions.find("train").workdir.startswith(str(place))
    finally:
        del os.environ["TMPDIR"]


@needs_root
def test_a_private_place_others_could_replace_is_refused(shared_folder, monkeypatch):
    """The place itself: in a folder others may write without the sticky bit, or made first
    by another user, it is refused in one line naming the fix."""
    ww = shared_folder(0o777)
    monkeypatch.setenv(private_place.ENV, str(ww / "place"))
    with pytest.raises(DistUsageError, match=r"may be written by others and is not sticky.*Set"):
        private_place.place()
    sticky = shared_folder(0o1777)
    as_other(os.mkdir, str(sticky / "place"), 0o700)
    monkeypatch.setenv(private_place.ENV, str(sticky / "place"))
    with pytest.raises(DistUsageError, match="belongs to uid 65534"):
        private_place.place()
    as_other(os.rmdir, str(sticky / "place"))
    as_other(os.mkdir, str(sticky / "theirs"), 0o700)
    as_other(os.symlink, str(sticky / "theirs"), str(sticky / "place"))  # followed, then
    with pytest.raises(DistUsageError, match="belongs to uid 65534"):  # what it names checked
        private_place.place()


def test_the_template_socket_is_checked_before_any_request(tmp_path):
    """A link or a plain file where the template's socket should be: no request is sent."""
    import socket

    from infini_notebook.launch import template_client

    real = tmp_path / "real.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(real))
    server.listen(1)
    server.setblocking(False)
    link = tmp_path / "template.sock"
    os.symlink(real, link)
    with pytest.raises(template_client.TemplateUnavailable, match="symbolic link"):
        template_client.request(str(link), {"op": "fork", "env": {"SECRET": "x"}}, timeout=2)
    with pytest.raises(BlockingIOError):
        server.accept()  # nobody connected
    plain = tmp_path / "plain.sock"
    plain.write_text("")
    with pytest.raises(template_client.TemplateUnavailable, match="not a socket"):
        template_client.request(str(plain), {"op": "fork"}, timeout=2)
    server.close()


def test_the_place_is_made_0700_all_the_way_whatever_the_umask(short_tmp, monkeypatch):
    """With a group-writable umask (002, a common default) the folders made on the way were
    0775, and every later use of the place was refused as writable by others."""
    tmp_path = short_tmp
    monkeypatch.setenv(private_place.ENV, str(tmp_path / "a" / "b" / "p"))
    old = os.umask(0o002)
    try:
        first = private_place.place()
        assert private_place.place() == first  # and again
    finally:
        os.umask(old)
    for folder in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "p"):
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700, folder


def test_sessions_that_are_ending_are_not_listed(place):
    """Issue 48: %dist_sessions listed sessions that had just ended ("ends in 0s, 0 B"): one
    told to end, and one detached past its keep time, are not live."""
    from infini_notebook.launch.watchdog import DETACHED, LEASE

    ending = _fake_session(place, "ending", _me(), tag="e")
    kept_sessions.write_private(
        os.path.join(ending, LEASE), json.dumps({"keep_s": 60, "end": True}).encode()
    )
    late = _fake_session(place, "late", _me(), tag="l")
    kept_sessions.write_private(os.path.join(late, LEASE), json.dumps({"keep_s": 60}).encode())
    kept_sessions.write_private(os.path.join(late, DETACHED), repr(time.time() - 61).encode())
    waiting = _fake_session(place, "waiting", _me(), tag="w")
    kept_sessions.write_private(os.path.join(waiting, LEASE), json.dumps({"keep_s": 60}).encode())
    kept_sessions.write_private(os.path.join(waiting, DETACHED), repr(time.time() - 30).encode())
    assert list(kept_sessions.kept_sessions()) == ["waiting"]
    row = kept_sessions.describe(kept_sessions.find("waiting"))
    assert row["driver"].startswith("detached, ends in 2") or "ends in 3" in row["driver"], row


@needs_root
def test_engines_refuse_a_shared_tmpdir_without_the_sticky_bit(shared_folder, monkeypatch):
    """From the attack review: an mpiexec or Slurm engine (and autoreload's copy on another
    host) made its folder in TMPDIR and used it by path; in a folder others may write without
    the sticky bit, uid 65534 renamed it away and put one with its ipengine_config.py in its
    place. Such a TMPDIR is refused in one line; /tmp (sticky) serves."""
    import tempfile

    from infini_notebook.engine import remote_start

    monkeypatch.setattr(tempfile, "tempdir", str(shared_folder(0o777)))
    with pytest.raises(remote_start.Refused, match="not sticky.*set TMPDIR"):
        remote_start.prepare("make", {})
    monkeypatch.setattr(tempfile, "tempdir", str(shared_folder(0o1777)))
    folder, args = remote_start.prepare("make", {})
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700 and args
    os.rmdir(folder)
