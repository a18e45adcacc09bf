"""Kept sessions (issue 42): a session started with --name NAME --keep DURATION outlives its
kernel (Jupyter's restart, a SIGKILL), a new kernel of the same user attaches it with its
variables and groups, one kernel drives it at a time, and one nobody attaches ends itself
completely. Real kernels through jupyter_client, as conftest.py starts them."""

from __future__ import annotations

import os
import secrets
import signal
import time

import psutil
import pytest
from conftest import fresh_kernel, session_processes, text_of
from jupyter_core.utils import run_sync

from infini_notebook.launch.watchdog import LEASE, read_json

pytestmark = pytest.mark.timeout(600)


# Kernel code: until every rank runs line 4 of the background cell (its sleep: the
# editor's line, %%dist is line 1).
IN_THE_CELL = """\
import time as _t
_deadline = _t.monotonic() + 30
while not all("line 4 in <module>" in d for d in dist_session.stacks().values()):
    assert _t.monotonic() < _deadline, dist_session.stacks()
    _t.sleep(0.1)"""


def wait_until_gone(folder: str, timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (left := session_processes(folder)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def detached_ticks(path: str) -> dict[int, float]:
    """The ``tick I TIME`` lines of the section written for a cell an earlier kernel left
    running (kernel/left_output.py), by I."""
    text = open(path).read()
    head = "started by an earlier kernel: all its output from its start"
    assert text.count(head) == 1, text[-2000:]
    section = text.split(head, 1)[1].split("=====\n", 1)[1]
    return {
        int(w[1]): float(w[2]) for w in map(str.split, section.splitlines()) if w[:1] == ["tick"]
    }


def restart(cells) -> None:
    """Jupyter's restart (a dead kernel too), and the extension loaded in the new one."""
    run_sync(cells.client.km.restart_kernel)(now=True)
    run_sync(cells.client.kc.wait_for_ready)(timeout=60)
    cells.run("%load_ext infini_notebook")


def folder_of(cells) -> str:
    return text_of(cells.run("print(dist_session.folder.path)")).strip()


def test_a_kept_session_survives_restart_and_kill_and_is_driven_by_one_kernel():
    name = f"kt-{secrets.token_hex(3)}"
    with fresh_kernel() as first, fresh_kernel() as second:
        first.run(f"%dist_start --nprocs 2 --tp 2 --name {name} --keep 2m", timeout=180)
        first.run("%%dist\nx = rank * 10 + 1")
        folder = folder_of(first)
        before = {p.pid for p in session_processes(folder)}
        assert len(before) >= 5  # watchdog, store host, template, controller, 2 engines

        # Jupyter's restart signals the kernel's whole process group: nothing kept dies
        old_kernel = first.kernel_pid
        run_sync(first.client.km.restart_kernel)(now=True)
        run_sync(first.client.kc.wait_for_ready)(timeout=60)
        assert not psutil.pid_exists(old_kernel) or old_kernel != first.kernel_pid
        assert before <= {p.pid for p in session_processes(folder)}  # (spares may join)
        first.run("%load_ext infini_notebook")
        listed = text_of(first.run("%dist_sessions"))
        assert name in listed and "detached, ends in 1m" in listed, listed
        row = text_of(
            first.run(f"df = %dist_sessions\nprint(df[df.name == {name!r}].iloc[0].to_dict())")
        )
        assert "'ranks': 2" in row and "'backend': 'gloo'" in row, row
        said = text_of(first.run(f"%dist_attach {name}"))
        assert f"Attached session {name!r}: 2 ranks (gloo)" in said and "was detached" in said
        out = text_of(
            first.run(
                "%%dist\nt = torch.ones(1) * x\ndist.all_reduce(t, group=groups.tp)\n"
                "print('x', x, 'sum', t.item())"
            )
        )
        assert "[rank 0] x 1 sum 12.0" in out and "[rank 1] x 11 sum 12.0" in out, out
        status = text_of(first.run("%dist_status"))
        assert "\n   1 " in status and status.count("idle") >= 2, status

        # a second kernel is refused while the first lives, in one line naming it
        taken = text_of(
            second.run(f"%dist_start --nprocs 2 --name {name} --keep 1m", allow_error=True)
        )
        assert f"A kept session named {name!r} runs already" in taken
        refused = text_of(second.run(f"%dist_attach {name}", allow_error=True))
        assert f"live kernel pid {first.kernel_pid}" in refused and "--force" in refused
        assert "Traceback" not in refused
        listed = text_of(second.run("%dist_sessions"))
        assert name in listed and f"kernel pid {first.kernel_pid}" in listed
        said = text_of(second.run(f"%dist_attach {name} --force"))
        assert f"taken over from kernel pid {first.kernel_pid}" in said
        assert "[rank 1] 11" in text_of(second.run("%%dist\nprint(x)"))
        lost = text_of(first.run("%%dist\nprint(x)", allow_error=True))
        assert "no longer drives session" in lost and f"kernel pid {second.kernel_pid}" in lost
        kept_on = text_of(first.run("%dist_stop"))  # not "No session is running."
        assert "no longer drives" in kept_on and "Nothing was stopped" in kept_on, kept_on

        # SIGKILL of the driving kernel while a cell runs: the cell goes on, the first
        # kernel attaches again (no --force), sees it, its stacks, and interrupts it
        second.run(
            "%%dist --background\nimport time\n"
            "for i in range(600):\n    time.sleep(0.1); print('tick', i, time.time(), flush=True)"
        )
        second.run(IN_THE_CELL)  # the kill must not beat the cell to the ranks
        killed = psutil.Process(second.kernel_pid)
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        killed_at = time.time()
        time.sleep(1)  # ticks nobody listens to
        said = text_of(first.run(f"%dist_attach {name}"))
        assert "was detached" in said and "still runs on ranks 0-1" in said, said
        # what the cell printed while no kernel was attached is in the per-rank files
        path = os.path.join(folder, "output", "rank1.stdout")
        ticks = detached_ticks(path)
        assert list(ticks) == list(range(len(ticks))), list(ticks)[:5]  # from its start, no gap
        assert max(ticks.values()) > killed_at, "nothing printed while detached was kept"
        # ... and what it prints after the attach is added as it comes (at each command
        # that checks the ranks still in it, %dist_status here)
        deadline = time.monotonic() + 20
        while len(grown := detached_ticks(path)) <= len(ticks):
            assert time.monotonic() < deadline, len(grown)
            first.run("%dist_status")
            time.sleep(0.2)
        assert "line 4 in <module>" in text_of(first.run("%dist_stacks"))  # the sleep
        assert "stuck" in text_of(first.run("%dist_status"))
        assert "Interrupted ranks [0, 1]" in text_of(first.run("%dist_interrupt"))
        deadline = time.monotonic() + 30
        while "[rank 0] 1" not in (out := text_of(first.run("%%dist\nprint(x)", allow_error=True))):
            assert time.monotonic() < deadline, out
            time.sleep(0.2)
        # ... until the interrupt ended it
        later = detached_ticks(path)
        assert list(later) == list(range(len(later))) and len(later) >= len(grown), len(later)

        # a kernel killed in the middle of %dist_attach (here while it waits for the ranks'
        # answers: rank 1 is paused) leaves the session attachable, without --force
        rank1 = psutil.Process(int(text_of(first.run("print(dist_session.ranks[1].pid)"))))
        restart(first)
        victim = first.kernel_pid
        first.client.kc.execute(f"%dist_attach {name}")  # not waited for
        rank1.suspend()
        try:
            lease = os.path.join(folder, LEASE)
            deadline = time.monotonic() + 60
            while ((read_json(lease) or {}).get("holder") or [0])[0] != victim:
                assert time.monotonic() < deadline, read_json(lease)
                time.sleep(0.005)
            time.sleep(0.5)  # joined the store and the controller: waiting for rank 1
            os.kill(victim, signal.SIGKILL)
        finally:
            rank1.resume()
        restart(first)
        said = text_of(first.run(f"%dist_attach {name}"))
        assert "was detached" in said and "Traceback" not in said, said
        assert "[rank 1] 11" in text_of(first.run("%%dist\nprint(x)"))

        # %dist_export has the cells of every kernel that drove it, before the restart too
        script = os.path.join(folder, "exported.py")
        first.run(f"%dist_export {script}")
        text = open(script).read()
        assert "x = rank * 10 + 1" in text and "dist.all_reduce(t, group=groups.tp)" in text

        first.run("%dist_stop")
        assert wait_until_gone(folder, 15) == []
        assert not os.path.exists(folder)


def test_a_kept_session_nobody_attaches_ends_itself_and_names_are_checked():
    name = f"kt-{secrets.token_hex(3)}"
    with fresh_kernel() as cells:
        out = text_of(cells.run(f"%dist_attach {name}", allow_error=True))
        assert f"No kept session is named {name!r}" in out and "Traceback" not in out
        out = text_of(cells.run("%dist_start --nprocs 2 --keep 10m", allow_error=True))
        assert "--keep and --name go together" in out
        # a rank that died while detached shows as died; a hard restart brings it back
        cells.run(f"%dist_start --nprocs 2 --name {name} --keep 1m", timeout=180)
        folder = folder_of(cells)
        rank1 = int(text_of(cells.run("print(dist_session.ranks[1].pid)")))
        # JupyterLab's Restart interrupts the kernel before it asks it to shut down: the
        # cell that runs (not in the background) goes on all the same
        began = os.path.join(folder, "began")
        cells.client.kc.execute(
            f"%%dist\nimport time\nopen(f'{began}{{rank}}', 'w').close()\n"
            "for i in range(600):\n    time.sleep(0.1); print('tick', i)"
        )
        deadline = time.monotonic() + 60
        while not all(os.path.exists(f"{began}{r}") for r in (0, 1)):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        run_sync(cells.client.km.restart_kernel)(now=False)
        run_sync(cells.client.kc.wait_for_ready)(timeout=60)
        psutil.Process(rank1).kill()
        cells.run("%load_ext infini_notebook")
        said = text_of(cells.run(f"%dist_attach {name}"))
        assert "rank 1 died while detached" in said and "still runs on rank 0" in said, said
        assert "died" in text_of(cells.run("%dist_status"))
        cells.run("%dist_restart --hard", timeout=180)
        out = text_of(cells.run("%%dist\nt = torch.ones(1)\ndist.all_reduce(t)\nprint(t.item())"))
        assert "[rank 1] 2.0" in out, out
        cells.run("%dist_stop")
        assert wait_until_gone(folder, 15) == []

        # nobody attaches within its keep time: it ends itself, completely
        cells.run(f"%dist_start --nprocs 2 --name {name} --keep 5s", timeout=180)
        folder = folder_of(cells)
        kernel = psutil.Process(cells.kernel_pid)
        t0 = time.monotonic()
        kernel.send_signal(signal.SIGKILL)
        kernel.wait(10)
        assert wait_until_gone(folder, 40) == []
        assert time.monotonic() - t0 > 4  # it waited its keep time for a kernel
        assert not os.path.exists(folder)


HARD_ROUNDS = int(os.environ.get("INFINI_HARD_ROUNDS", "2"))  # 20 in the stress run


def test_a_hard_restart_after_attach_keeps_the_session():
    """Issue 48: `%dist_restart --hard` right after `%dist_attach` failed 6 of 6 ("'<' not
    supported between instances of 'dict' and 'int'") and ended the kept session when the
    earlier kernel had made its spare engines. Each round: the driving kernel's spares are
    there, Jupyter restarts the kernel, the new one attaches and restarts hard; in turn
    with nothing else, with a rank that died while detached, and with autoreload on."""
    from conftest import SPARES

    name = f"kh-{secrets.token_hex(3)}"
    with attacker_in_tmpdir(name) as attack, fresh_kernel() as cells:
        cells.run(f"%dist_start --nprocs 2 --name {name} --keep 2m", timeout=180)
        folder = folder_of(cells)
        for round in range(HARD_ROUNDS):
            # the earlier kernel's spares every round; a rank dead while detached and
            # autoreload on every other one
            case = ("spares", "a dead rank, autoreload")[round % 2]
            spares = text_of(cells.run(SPARES, timeout=90)).strip()
            assert spares.startswith("[") and spares != "[]", spares  # the earlier kernel's
            if "autoreload" in case:
                cells.run("%dist_autoreload on")
            rank1 = int(text_of(cells.run("print(dist_session.ranks[1].pid)")))
            cells.run("%%dist\nkept = rank")
            attack.start(folder)  # 1,000 link swaps while the kernel restarts and attaches
            restart(cells)
            if "dead" in case:
                psutil.Process(rank1).kill()
            said = text_of(cells.run(f"%dist_attach {name}"))
            assert "was detached" in said, said
            if "dead" in case:
                assert "rank 1 died while detached" in said, said
                # issue 51: the dead rank alone replaced after attach; rank 0 keeps its state
                out = text_of(cells.run("%dist_restart --ranks 1", timeout=180))
                assert "rank 1 replaced, the others kept their variables" in out, out
                check = "t = torch.ones(1)\ndist.all_reduce(t)\nprint(t.item(), 'kept' in dir())"
                out = text_of(cells.run(f"%%dist\n{check}"))
                assert "[rank 0] 2.0 True" in out and "[rank 1] 2.0 False" in out, out
            out = text_of(cells.run("%dist_restart --hard", timeout=180, allow_error=True))
            assert "Restarted (engines restarted)" in out, (case, out)
            out = text_of(
                cells.run("%%dist\nt = torch.ones(1)\ndist.all_reduce(t)\nprint(t.item())")
            )
            assert "[rank 0] 2.0" in out and "[rank 1] 2.0" in out, (case, out)
            if "autoreload" in case:
                assert "autoreload on" in said, said
                assert "on" in text_of(cells.run("print(dist_session.autoreload_state())"))
                cells.run("%dist_autoreload off")
        # a hard restart that fails (here: injected as its engines come up) says which step
        # and keeps the kept session; the next one works
        cells.run(
            "from infini_notebook.launch import startup as _st\n_up = _st.bring_up\n"
            "def _fail(*a, **k):\n    raise RuntimeError('injected')\n_st.bring_up = _fail"
        )
        out = text_of(cells.run("%dist_restart --hard", allow_error=True))
        assert "Hard restart failed while bringing up the new engines" in out, out
        assert "injected" in out and f"The kept session {name!r} stays" in out, out
        cells.run("_st.bring_up = _up")
        assert name in text_of(cells.run("%dist_sessions"))
        out = text_of(cells.run("%dist_restart --hard", timeout=180))
        assert "Restarted (engines restarted)" in out, out
        listed = text_of(cells.run("%dist_sessions"))
        assert name in listed and f"kernel pid {cells.kernel_pid}" in listed, listed
        assert listed.count(name) == 1 and "evil" not in listed, listed
        cells.run("%%dist\nsecret_token = 'hunter2'")  # into history.jsonl: ours alone
        attack.check(folder)
        cells.run("%dist_stop")
        assert wait_until_gone(folder, 15) == []


class attacker_in_tmpdir:
    """uid 65534 in the kernel's TMPDIR, a world-writable folder without the sticky bit:
    a planted session folder named like ours (keep.json naming our session, a pickled plan
    that would run a command, a FIFO keep.json, a /dev/zero link), and a link re-pointed
    between our folder and theirs, 1,000 times a round, while the kernel lists, attaches
    and restarts. The old code globbed TMPDIR for sessions: it adopted such links, sent
    cells' sources into the attacker's folder and unpickled their plan."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        import tempfile
        import threading

        from other_user import OTHER_UID, as_other

        if os.geteuid() != 0:
            pytest.skip("needs root to act as a second user (uid 65534)")
        self.ww = tempfile.mkdtemp(prefix="inb-ww-", dir="/tmp")
        os.chmod(self.ww, 0o777)
        self.marker = os.path.join(self.ww, "pwned")
        self.old = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = self.ww  # the kernels started from here inherit it
        self.evil = as_other(_plant_session, self.ww, self.name, self.marker)
        assert isinstance(self.evil, str), self.evil
        self.stop_event = threading.Event()
        self.uid = OTHER_UID
        return self

    def start(self, ours: str) -> None:
        import threading

        from other_user import as_other

        def race():
            as_other(_swap_link, self.ww, ours, self.evil, 1000, timeout=120)

        if getattr(self, "thread", None) is not None:
            self.thread.join(120)
        self.thread = threading.Thread(target=race, daemon=True)
        self.thread.start()

    def check(self, ours: str) -> None:
        assert not os.path.exists(self.marker), "the planted pickle ran"
        assert not ours.startswith(self.ww) and os.stat(ours).st_uid == os.geteuid()
        planted = sorted(os.listdir(self.evil))
        assert planted == ["keep.json", "plan.pickle"], planted  # nothing written there
        assert b"hunter2" not in b"".join(
            open(os.path.join(self.evil, f), "rb").read() for f in planted
        )

    def __exit__(self, *exc):
        import shutil

        self.stop_event.set()
        if getattr(self, "thread", None) is not None:
            self.thread.join(150)
        if self.old is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = self.old
        shutil.rmtree(self.ww, ignore_errors=True)


def _plant_session(ww: str, name: str, marker: str) -> str:
    import json

    from infini_notebook.launch.watchdog import FOLDER_PREFIX

    evil = os.path.join(ww, f"{FOLDER_PREFIX}evil")
    os.mkdir(evil, 0o777)
    with open(os.path.join(evil, "keep.json"), "w") as f:
        json.dump({"name": name, "watchdog": [1, 0.0], "created": 1.0, "keep_s": 60}, f)
    with open(os.path.join(evil, "plan.pickle"), "wb") as f:
        f.write(b"cos\nsystem\n(S'touch " + marker.encode() + b"'\ntR.")
    for kind in ("fifo", "zero"):
        other = os.path.join(ww, f"{FOLDER_PREFIX}{kind}")
        os.mkdir(other, 0o777)
        if kind == "fifo":
            os.mkfifo(os.path.join(other, "keep.json"), 0o666)
        else:
            os.symlink("/dev/zero", os.path.join(other, "keep.json"))
    return evil


def _swap_link(ww: str, ours: str, theirs: str, rounds: int) -> int:
    from infini_notebook.launch.watchdog import FOLDER_PREFIX

    link = os.path.join(ww, f"{FOLDER_PREFIX}swap")
    for i in range(rounds):
        os.symlink(ours if i % 2 else theirs, f"{link}.tmp")
        os.replace(f"{link}.tmp", link)
    return rounds


def test_two_kernels_starting_one_name_at_once_one_wins(tmp_path):
    """Issue 48: two kernels that started --name X at the same moment could both succeed
    (the name was claimed only after the start). Both cells are sent before either runs."""
    name = f"kr-{secrets.token_hex(3)}"
    code = (
        "import infini_notebook\n"
        "try:\n"
        f"    dist_session = infini_notebook.start(nprocs=2, name={name!r}, keep='1m')\n"
        "    said = 'started'\n"
        "except Exception as e:\n"
        "    said = f'{type(e).__name__}: {e}'\n"
        "open({path!r}, 'w').write(said)\n"
    )
    with fresh_kernel() as a, fresh_kernel() as b:
        paths = [str(tmp_path / "a"), str(tmp_path / "b")]
        for cells, path in zip((a, b), paths):
            cells.client.kc.execute(code.replace("{path!r}", repr(path)))  # not waited for
        deadline = time.monotonic() + 120
        while not all(os.path.exists(p) and open(p).read() for p in paths):
            assert time.monotonic() - deadline < 0, [os.path.exists(p) for p in paths]
            time.sleep(0.1)
        said = [open(p).read() for p in paths]
        assert sorted(s == "started" for s in said) == [False, True], said
        lost = next(s for s in said if s != "started")
        assert lost.startswith("DistUsageError: A kept session named") and "\n" not in lost, lost
        assert "is being started by kernel pid" in lost or "runs already" in lost, lost
        winner = (a, b)[said.index("started")]
        winner.run("dist_session.stop()")
