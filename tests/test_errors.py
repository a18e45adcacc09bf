"""Errors and values as a user meets them (issue 12, items 9 and 10): one clear message each,
and magics that produce data return it. Real kernel, real engines, real stores."""

from __future__ import annotations

import os
import socket

import psutil
import pytest
from conftest import text_of

from infini_notebook import cluster
from infini_notebook.core.errors import DistCellError, DistUsageError
from infini_notebook.launch.watchdog import MARK


def error_text(cell) -> str:
    return "\n".join("\n".join(o.traceback) for o in cell.outputs if o.output_type == "error")


@pytest.fixture
def ranks2(kernel):
    """The module's kernel with a 2-rank session (started if an earlier test did not)."""
    kernel.run(
        "from infini_notebook import cluster\n"
        "if cluster.current() is None:\n"
        "    get_ipython().run_line_magic('dist_start', '--nprocs 2 --timeout 20')",
        timeout=180,
    )
    return kernel


def test_pull_returns_the_values_and_a_bare_pull_does_not_flood(ranks2):
    ranks2.run("%%dist\nx = rank * 10\nbig = list(range(100_000))")
    out = text_of(ranks2.run("vals = %dist_pull x\nprint(vals == {0: 0, 1: 10}, x == vals)"))
    assert "True True" in out
    bare = text_of(ranks2.run("%dist_pull big"))
    assert "0: [0, 1, 2" in bare and "1: [0, 1, 2" in bare  # shown, one short line per rank
    assert len(bare) < 1000
    assert "100000 99999" in text_of(ranks2.run("print(len(big[1]), big[1][-1])"))  # kept whole


def test_bench_returns_its_dataframe(ranks2):
    out = text_of(
        ranks2.run(
            "df = %dist_bench all_reduce --sizes 1K:4K --iters 2 --warmup 1\n"
            "print(type(df).__name__, len(df), sorted(df['size_bytes']))"
        )
    )
    assert "DataFrame 3 [1024, 2048, 4096]" in out


def test_a_bare_bench_line_shows_its_numbers_once_not_again_as_a_value(ranks2):
    cell = ranks2.run("%dist_bench all_reduce --sizes 1K --iters 2 --warmup 1")
    assert [o for o in cell.outputs if o.output_type == "execute_result"] == []
    assert "# all_reduce on the world group of 2 ranks, 2 iters" in text_of(cell)


def test_pushing_an_unpicklable_value_names_it(ranks2):
    cell = ranks2.run(
        "import threading\nlock = threading.Lock()\n%dist_push lock", allow_error=True
    )
    err = error_text(cell)
    assert "DistUsageError" in err
    assert "cannot send `lock` to the ranks: _thread.lock cannot be pickled" in err
    assert "Traceback" not in err and "pickle.py" not in err


def test_a_users_timeout_error_is_not_called_a_broken_process_group(ranks2):
    err = error_text(ranks2.run("%%dist\nraise TimeoutError('my deadline')", allow_error=True))
    assert "ranks 0-1: TimeoutError: my deadline" in err
    assert "process groups" not in err and "%dist_restart" not in err
    assert "[rank 1] ok" in text_of(ranks2.run("%%dist\nprint('ok')"))


def test_a_rank_that_dies_mid_cell_is_named_once_with_its_exit_code(ranks2):
    cell = ranks2.run(
        "%%dist\nimport os\nif rank == 1:\n    os._exit(3)\nprint('ok', rank)", allow_error=True
    )
    err = error_text(cell)
    assert "[rank 0] ok 0" in text_of(cell, "stdout")
    assert "rank 1 died (exit code 3)" in err and "--hard" in err
    assert err.count("rank 1 died") == 1
    assert "EngineError" not in err and "Traceback" not in err
    ranks2.run("%dist_restart --hard", timeout=180)
    assert "[rank 1] back" in text_of(ranks2.run("%%dist\nprint('back')"))


# ----- the API alone: each starts its own small session (not the shared one) ----------------
def new_session(**options) -> cluster.Session:
    return cluster.Session(cluster.plan_from_options(**options))


def test_a_local_start_failure_shows_the_cause_not_host_advice():
    session = new_session(nprocs=1, env=["PYTHONHOME=/nonexistent"])  # python cannot start
    with pytest.raises(DistCellError) as e:
        session.start()
    assert "engine 0 exited while starting (exit code 1)" in e.value.summary
    assert "Fatal Python error" in e.value.report  # the engine's own words
    assert "reachable" not in e.value.summary and "--env" in e.value.summary
    assert "Nothing is left running" in e.value.summary
    # Nothing of this session's: the processes it started carry its mark. (Comparing all
    # of pytest's children failed when a shared kernel's session changed meanwhile.)
    assert [p for p in psutil.Process().children(recursive=True) if _marked(p, session)] == []


def _marked(proc: psutil.Process, session) -> bool:
    try:
        mark = proc.environ().get(MARK)
        return mark == session.folder.profile_dir and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_store_on_a_non_loopback_address_warns():
    # 192.0.2.1 is TEST-NET-1, never this machine's: the warning comes, then the bind fails,
    # so nothing here ever listens beyond loopback.
    session = new_session(nprocs=1, init_method=f"tcp://192.0.2.1:{free_loopback_port()}")
    with pytest.warns(UserWarning, match="no authentication"), pytest.raises(DistUsageError):
        session.start()


def test_a_store_on_loopback_does_not_warn(recwarn):
    with socket.create_server(("127.0.0.1", 0)) as taken:  # the bind fails: port in use
        port = taken.getsockname()[1]
        with pytest.raises(DistUsageError, match="Pick a free port"):
            new_session(nprocs=1, init_method=f"tcp://127.0.0.1:{port}").start()
    assert not [w for w in recwarn if "authentication" in str(w.message)]


def test_stop_removes_only_a_file_store_it_created(tmp_path):
    made = tmp_path / "made_by_session"
    session = new_session(nprocs=1, init_method=f"file://{made}").start()
    assert os.path.exists(made)
    session.stop()
    assert not os.path.exists(made)
    mine = tmp_path / "users_file"
    mine.write_text("")  # the user's own (empty) file: used, and left where it was
    session = new_session(nprocs=1, init_method=f"file://{mine}").start()
    session.stop()
    assert os.path.exists(mine)


def test_the_advice_after_ranks_died_reads_right_for_one_and_for_several():
    from infini_notebook.kernel.recovery import replace_advice

    assert replace_advice({2: "x"}).startswith("%dist_restart --ranks 2 starts a new rank 2;")
    several = replace_advice({0: "x", 2: "y", 3: "z"})
    assert several.startswith("%dist_restart --ranks 0,2,3 starts new ranks 0,2-3;"), several
