"""Engines forked from the warm template (issue 22): distinct processes and random streams,
the template kept across hard restarts and replaced when gone, the usual launch when asked
for or when forking would be unsafe, a template warmed at %load_ext for the first start,
and nothing left after stop or a killed kernel."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
from conftest import SPARES, fresh_kernel, text_of, use_session

from infini_notebook.launch.template_launcher import FORKED

TWO = "--nprocs 2 --timeout 30"


def test_forked_engines_have_their_own_pids_and_random_streams(session4):
    assert session4.engines.how == "engines " + FORKED
    session4.run(
        "import os, random, numpy\n"
        "_draws = (os.getpid(), os.getppid(), torch.rand(1).item(), torch.initial_seed(), "
        "random.random(), numpy.random.rand())",
        echo=False,
    )
    draws = session4.pull("_draws")
    pids, parents, *streams = zip(*draws.values())
    assert len(set(pids)) == 4
    assert set(parents) == {session4.engines.template.process.pid}  # forked, not started by Popen
    for stream in streams:  # torch, its seed, random, numpy: a fresh draw on every rank
        assert len(set(stream)) == 4, streams


def test_forked_engines_share_the_templates_heap_and_can_still_import_debugpy(session4):
    """The template's objects are frozen out of the engines' collections (each collection
    would otherwise copy the template's heap into the child); its kernel came up without
    debugpy, which a cell can still import."""
    session4.run(
        "import gc, sys\n"
        "_before = ('debugpy' in sys.modules, gc.get_freeze_count())\n"
        "import debugpy\n"
        "_after = callable(debugpy.listen)",
        echo=False,
    )
    for (had_debugpy, frozen), imported in zip(
        session4.pull("_before").values(), session4.pull("_after").values()
    ):
        assert not had_debugpy and imported
        assert frozen > 100_000  # torch alone makes several hundred thousand objects


RANK_PIDS = "print(sorted(p.pid for p in dist_session.engines.pids.values()))"
# A hard restart and, with no pause, a cell that keeps the ranks busy until GATE is gone.
RESTART_THEN_BUSY = """\
get_ipython().run_line_magic("dist_restart", "--hard")
get_ipython().run_cell_magic(
    "dist", "--background", "import os, time\\nwhile os.path.exists(GATE):\\n    time.sleep(0.05)"
)"""


def test_spares_forked_once_idle_make_a_hard_restart_and_a_dead_template_is_replaced(
    kernel, tmp_path
):
    use_session(kernel, TWO)
    say = "print(dist_session.engines.template.process.pid, dist_session.engines.how)"
    first = text_of(kernel.run(say)).split()[0]
    spares = text_of(kernel.run(SPARES)).strip()  # forked once the session was idle
    assert spares  # use_session waited for them
    assert "· 2 spare engines for the next hard restart" in text_of(kernel.run("%dist_status"))
    before = text_of(kernel.run(RANK_PIDS)).strip()
    assert spares != before and len(eval(spares)) == 2

    gate = tmp_path / "gate"
    gate.touch()
    said = text_of(kernel.run(RESTART_THEN_BUSY.replace("GATE", repr(str(gate))), timeout=180))
    assert "Restarted (engines restarted)" in said
    assert text_of(kernel.run(RANK_PIDS)).strip() == spares
    kept, how = text_of(kernel.run(say)).split(" ", 1)
    assert kept == first and FORKED in how and "ahead of this restart" in how  # no new import
    assert not any(psutil.pid_exists(p) for p in eval(before))
    # No new spares while a cell keeps the ranks busy: their start would slow it.
    waiting = "import time; time.sleep(2); print(dist_session.engines.standby.launch.done())"
    assert text_of(kernel.run(waiting)).strip() == "False"
    gate.unlink()
    kernel.run("dist_session.background.join(30)")
    out = text_of(kernel.run("%%dist\nx = torch.ones(1); dist.all_reduce(x); print(x.item())"))
    assert "[rank 0] 2.0" in out and "[rank 1] 2.0" in out

    spares = [psutil.Process(p) for p in eval(text_of(kernel.run(SPARES)))]  # one dies:
    spares[0].kill()
    psutil.wait_procs(spares[:1], timeout=15)
    said = text_of(kernel.run("%dist_restart --hard", timeout=180))
    assert "ahead" not in text_of(kernel.run(say))  # new engines, at once (no wait for it)
    assert float(said.split(" in ")[1].split("s.")[0]) < 10, said
    assert psutil.wait_procs(spares, timeout=15)[1] == []  # its sibling is not left over
    out = text_of(kernel.run("%%dist\nx = torch.ones(1); dist.all_reduce(x); print(x.item())"))
    assert "[rank 0] 2.0" in out and "[rank 1] 2.0" in out

    spares = [psutil.Process(p) for p in eval(text_of(kernel.run(SPARES)))]  # again, and
    psutil.Process(int(first)).send_signal(signal.SIGKILL)  # then the template dies
    kernel.run("%dist_restart --hard", timeout=180)
    new, how = text_of(kernel.run(say)).split(" ", 1)
    assert new != first and FORKED in how and "ahead" not in how
    assert psutil.wait_procs(spares, timeout=15)[1] == []  # unusable: ended, not left over
    out = text_of(kernel.run("%%dist\nx = torch.ones(1); dist.all_reduce(x); print(x.item())"))
    assert "[rank 0] 2.0" in out and "[rank 1] 2.0" in out
    status = text_of(kernel.run("%dist_status"))
    assert "2 ranks: 2 idle · warm template RSS" in status  # its memory is reported
    kernel.run(SPARES)  # the new template's spares exist: stop must end them too
    status = text_of(kernel.run("%dist_status"))
    assert "· 2 spare engines for the next hard restart" in status
    procs = psutil.Process(int(new)).children(recursive=True) + [psutil.Process(int(new))]
    assert len(procs) == 1 + 4 * 2  # the template, engines and nannies: ranks and spares
    kernel.run("%dist_stop")
    assert psutil.wait_procs(procs, timeout=15)[1] == []


THREADS = (
    "%%dist\nimport os, numpy\nfrom threadpoolctl import threadpool_info\n"
    "print(torch.get_num_threads(), os.environ['OPENBLAS_NUM_THREADS'],"
    " sorted({p['num_threads'] for p in threadpool_info()}))"
)


def test_warm_and_cold_ranks_run_the_same_threads_and_say_so(kernel):
    """One rule on every start (issue 30, item 10): forked ranks (numpy's BLAS started in the
    template with one thread) and new processes (with one per CPU) alike."""
    use_session(kernel, None)
    lines = {}
    for flags in ("--threads 2", "--threads 2 --no-template"):
        out = text_of(kernel.run(f"%dist_start --nprocs 2 {flags}", timeout=180))
        assert "2 threads per rank" in out, out
        lines[flags] = sorted(text_of(kernel.run(THREADS), "stdout").splitlines())
        kernel.run("%dist_stop")
    assert lines["--threads 2"] == lines["--threads 2 --no-template"], lines
    assert lines["--threads 2"][0].endswith("] 2 2 [2]"), lines


def test_no_template_starts_engines_as_new_processes_and_says_so(kernel):
    use_session(kernel, None)
    out = text_of(kernel.run("%dist_start --nprocs 2 --no-template", timeout=180))
    assert "engines started as new processes (--no-template)" in out
    cmds = text_of(
        kernel.run(
            "import psutil\nprint([' '.join(psutil.Process(p.pid).cmdline()) "
            "for p in dist_session.engines.pids.values()])"
        )
    )
    assert cmds.count("-m ipyparallel.engine") == 2
    assert "None" in text_of(kernel.run("print(dist_session.engines.template.process)"))
    kernel.run("%dist_stop")


def test_the_template_refuses_to_fork_with_threads_or_cuda():
    """A forked child keeps only the forking thread (another's locks stay held for ever),
    and CUDA cannot be used in a child of a process that initialised it."""
    probe = (
        "import threading, time, torch\n"
        "from infini_notebook.launch.fork_safety import fork_refusal\n"
        "print('alone:', fork_refusal())\n"
        "torch.cuda.is_initialized = lambda: True\n"
        "print('cuda:', fork_refusal())\n"
        "threading.Thread(target=time.sleep, args=(3,), daemon=True).start()\n"
        "print('thread:', fork_refusal())\n"
    )
    env = {"OPENBLAS_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120
    ).stdout
    assert "alone: None" in out
    assert "cuda: the template has initialised CUDA" in out
    assert "thread: the template runs 2 threads" in out


WARMED = (
    "from infini_notebook.launch import prewarm\n"
    "_w = prewarm._warmed\n"
    "print(_w.template.pid, _w.watchdog.pid, _w.workdir) if _w else print('none')"
)
SAY_SESSION = (
    "_e = dist_session.engines\nprint(_e.template.process.pid, dist_session.folder.path, _e.how)"
)


def test_load_ext_warms_a_template_that_the_first_start_adopts():
    with fresh_kernel() as cells:
        template, watchdog, workdir = text_of(cells.run(WARMED)).split()
        waiting = text_of(cells.run("%dist_status", allow_error=True))
        flat = " ".join(waiting.split())  # error lines are wrapped for the notebook
        assert "A warm template waits for it (RSS" in flat  # its memory is reported
        cells.run("%dist_start --nprocs 2 --timeout 30", timeout=240)
        pid, folder, how = text_of(cells.run(SAY_SESSION)).split(" ", 2)
        assert (pid, folder) == (template, workdir) and FORKED in how  # adopted, not a new one
        assert "none" in text_of(cells.run(WARMED))  # the next start will not find it again
        out = text_of(cells.run("%%dist\nx = torch.ones(1); dist.all_reduce(x); print(x.item())"))
        assert "[rank 1] 2.0" in out
        procs = [psutil.Process(int(template)), psutil.Process(int(watchdog))]
        cells.run("%dist_stop")
        assert psutil.wait_procs(procs, timeout=15)[1] == []  # the session ended what it adopted
        assert not os.path.exists(workdir)


def test_a_start_with_another_environment_ends_the_warm_template_and_stop_ends_an_unused_one():
    with fresh_kernel() as cells:
        template, watchdog, workdir = text_of(cells.run(WARMED)).split()
        procs = [psutil.Process(int(template)), psutil.Process(int(watchdog))]
        cells.run("%dist_start --nprocs 2 --timeout 30 --env INFINI_TEST_VAR=1", timeout=240)
        pid, folder, how = text_of(cells.run(SAY_SESSION)).split(" ", 2)
        assert pid != template and folder != workdir and FORKED in how  # a template of its own
        assert psutil.wait_procs(procs, timeout=15)[1] == [] and not os.path.exists(workdir)
        cells.run("%dist_stop")
        cells.run("prewarm.warm()")  # as %load_ext does
        template, watchdog, workdir = text_of(cells.run(WARMED)).split()
        procs = [psutil.Process(int(template)), psutil.Process(int(watchdog))]
        assert "Ended the warm template" in text_of(cells.run("%dist_stop"))
        assert psutil.wait_procs(procs, timeout=15)[1] == [] and not os.path.exists(workdir)


def test_a_killed_kernel_leaves_nothing_of_a_warm_template():
    with fresh_kernel() as cells:
        template, watchdog, workdir = text_of(cells.run(WARMED)).split()
        kernel = psutil.Process(cells.kernel_pid)
        procs = kernel.children(recursive=True)
        assert {int(template), int(watchdog)} <= {p.pid for p in procs}
        kernel.kill()
        assert psutil.wait_procs(procs, timeout=15)[1] == []
        assert not os.path.exists(workdir)
