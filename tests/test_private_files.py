"""%%dist_profile's folder where another user was first (issue 44.5): the folder and files the
kernel writes (kernel/private_files.py) are this user's alone, no link is followed at a name
written, and nothing someone else made is used. The attack runs as uid 65534 in a working
folder every user may write in, as a team's scratch folder or /tmp is."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time

import pytest
from conftest import text_of, use_session
from other_user import OTHER_UID, as_other, needs_root

from infini_notebook.core.errors import DistUsageError
from infini_notebook.kernel import private_files


@pytest.fixture
def shared():
    """A working folder every user may write in, and a file of ours elsewhere (the target)."""
    work = tempfile.mkdtemp(prefix="work-", dir="/tmp")
    os.chmod(work, 0o777)
    victim = tempfile.mkdtemp(prefix="victim-", dir="/tmp")
    target = os.path.join(victim, "notes.txt")
    with open(target, "w") as f:
        f.write("mine\n")
    yield work, target
    shutil.rmtree(work)
    shutil.rmtree(victim)


def mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _plant(work: str, leaves: list[str], target: str) -> str:
    """As uid 65534: dist_profile/ and the folders a profile may pick, links inside to
    ``target``, all writable by everyone."""
    os.mkdir(os.path.join(work, "dist_profile"), 0o777)
    for leaf in leaves:
        folder = os.path.join(work, "dist_profile", leaf)
        os.mkdir(folder, 0o777)
        for name in ("merged.json", *(f"rank{r}.json" for r in range(4))):
            os.symlink(target, os.path.join(folder, name))
    return "planted"


def test_a_new_folder_and_its_files_are_private(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = private_files.make_folder("dist_profile/In[3]-20250101-120000", fresh=True)
    assert folder == "dist_profile/In[3]-20250101-120000"
    assert mode("dist_profile") == 0o700 and mode(folder) == 0o700
    path = private_files.write_text(folder, "merged.json", "{}")
    assert open(path).read() == "{}" and mode(path) == 0o600
    assert os.listdir(folder) == ["merged.json"]  # no temporary file left
    # the same name again (two profiles in one second): a new folder beside it
    again = private_files.make_folder("dist_profile/In[3]-20250101-120000", fresh=True)
    assert again != folder and os.path.basename(again).startswith("In[3]-20250101-120000-")
    assert mode(again) == 0o700


def test_a_link_at_a_file_name_is_replaced_not_followed(tmp_path):
    target = tmp_path / "target"
    target.write_text("mine\n")
    out = tmp_path / "out"
    folder = private_files.make_folder(str(out), fresh=False)  # --out DIR: made, 0700
    assert mode(folder) == 0o700
    (out / "rank0.json").symlink_to(target)
    private_files.write_text(folder, "rank0.json", "trace")
    assert target.read_text() == "mine\n" and (out / "rank0.json").read_text() == "trace"
    assert not (out / "rank0.json").is_symlink()


@needs_root
def test_a_named_folder_of_another_user_is_refused(shared):
    work, _ = shared
    theirs = os.path.join(work, "theirs")
    assert as_other(os.mkdir, theirs, 0o777) is None
    with pytest.raises(DistUsageError, match=f"belongs to uid {OTHER_UID}, not to this user"):
        private_files.make_folder(theirs, fresh=False)


CELL_NAME = "from infini_notebook.kernel.execution import cell_name\nprint(cell_name())"


@pytest.fixture(scope="module")
def kernel2(kernel):
    use_session(kernel, "--nprocs 2")
    return kernel


@needs_root
def test_a_profile_folder_another_user_made_first_is_not_used(kernel2, shared):
    """As the attack was: in a shared working folder, another user made dist_profile/ and
    the folders the next %%dist_profile may pick (its cell's name and the next minute's
    times), with links inside to a file of ours. The traces go to a new folder of ours; the
    file and their folders are untouched."""
    work, target = shared
    k = kernel2
    name = text_of(k.run(f"import os\nos.chdir({work!r})\n{CELL_NAME}")).strip()
    number = int(name[3:-1]) + 1  # the next cell's
    now = time.time()
    stamps = {time.strftime("%Y%m%d-%H%M%S", time.localtime(now + i)) for i in range(60)}
    leaves = [f"In{number}-{s}" for s in sorted(stamps)]
    assert as_other(_plant, work, leaves, target) == "planted"
    try:
        shown = text_of(k.run("%%dist_profile\nx = 1", timeout=180))
        assert f"In{number}-" in shown, shown  # the cell's name was the one foreseen
    finally:
        k.run(f"os.chdir({os.getcwd()!r})")
    assert open(target).read() == "mine\n"
    theirs = os.path.join(work, "dist_profile")
    assert sorted(os.listdir(theirs)) == leaves  # nothing of ours in their folder
    for leaf in leaves:
        inside = os.listdir(os.path.join(theirs, leaf))
        assert all(os.path.islink(os.path.join(theirs, leaf, n)) for n in inside)
    (ours,) = [n for n in os.listdir(work) if n != "dist_profile"]
    assert ours.startswith(f"dist_profile-In{number}-") and mode(os.path.join(work, ours)) == 0o700
    files = os.listdir(os.path.join(work, ours))
    assert sorted(files) == ["merged.json", "rank0.json", "rank1.json"]
    assert all(mode(os.path.join(work, ours, f)) == 0o600 for f in files)


def test_a_rank_writes_its_trace_and_its_part_of_the_merged_one(tmp_path):
    """engine/profiling.write on a rank: on the kernel's host into its folder (0600), else
    the texts go back; the events are moved to the rank's track by the offset it is sent."""
    import json

    from infini_notebook.engine import profiling

    events = [{"ph": "X", "name": "aten::mm", "ts": 10.0, "dur": 2.0, "pid": 77, "tid": 1},
              {"ph": "M", "name": "thread_name", "pid": 77, "tid": 1, "args": {}}]  # fmt: skip
    text = json.dumps({"traceEvents": events})
    folder = tmp_path / "out"
    folder.mkdir(mode=0o700)
    profiling._state["done"] = (text, [dict(e) for e in events])
    got = profiling.write(3, str(folder), 5.5, 0)
    assert (folder / "rank3.json").read_text() == text and mode(str(folder / "rank3.json")) == 0o600
    fragment = open(got["fragment_file"]).read()
    assert json.loads(f"[{fragment}]") == [dict(events[0], pid=3, ts=15.5)]
    profiling._state["done"] = (text, [dict(e) for e in events])
    remote = profiling.write(3, None, 5.5, 0)
    assert remote["trace"] == text and json.loads(f"[{remote['fragment']}]")[0]["ts"] == 15.5
    assert "done" not in profiling._state


def _plant_cell_folder(path: str, forged: str) -> str:
    os.mkdir(path, 0o777)
    return "planted"


@needs_root
def test_a_debugged_cells_source_is_never_written_into_a_folder_another_user_made():
    """The debugger writes a rank's cell text where ipykernel compiles it
    (/tmp/ipykernel_<pid>, engine/rank_debug.cell_file): a name every user can predict
    and make first. Made by uid 65534, it is refused in one line; nothing is written."""
    from ipykernel.compiler import get_tmp_directory

    from infini_notebook.engine import rank_debug

    folder = get_tmp_directory()
    if os.path.exists(folder):
        pytest.skip(f"{folder} exists already")
    assert as_other(_plant_cell_folder, folder, "x") == "planted"
    try:
        with pytest.raises(DistUsageError, match="belongs to uid 65534"):
            rank_debug.cell_file("x = 1\n", "%%dist\nx = 1\n")
        assert os.listdir(folder) == []
    finally:
        as_other(os.rmdir, folder)
    path = rank_debug.cell_file("x = 1\n", "%%dist\nx = 1\n")  # its own folder: written
    try:
        assert open(path).read() == "%%dist\nx = 1\n"
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    finally:
        shutil.rmtree(os.path.dirname(path))


@needs_root
def test_a_debugged_cells_file_is_refused_in_a_tmpdir_others_may_write_without_sticky_bit(
    monkeypatch,
):
    """There another user may rename our ipykernel_<pid> folder and put theirs in its
    place (the attack review did): the debugger and tracebacks would read their text as
    the cell. Refused in one line, before anything is written; /tmp (sticky) serves."""
    from infini_notebook.engine import rank_debug
    from infini_notebook.engine.remote_start import Refused

    shared = tempfile.mkdtemp(prefix="ww-", dir="/tmp")
    os.chmod(shared, 0o777)  # world-writable, no sticky bit
    monkeypatch.setattr(tempfile, "tempdir", shared)
    try:
        with pytest.raises(Refused, match="is not safe"):
            rank_debug.cell_file("x = 1\n", "%%dist\nx = 1\n")
        assert os.listdir(shared) == []
    finally:
        shutil.rmtree(shared)
