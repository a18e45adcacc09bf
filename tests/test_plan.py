"""Flag validation, rank specs and output labeling: pure, milliseconds."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infini_notebook.core.errors import DistUsageError
from infini_notebook.core.output import (
    StreamLabeler,
    error_report,
    error_summary,
    group_identical,
    settle,
)
from infini_notebook.core.plan import is_loopback
from infini_notebook.core.plan_checks import make_plan, parse_init_method
from infini_notebook.core.ranks import format_ranks, parse_ranks, rank_label


# ----- plan ------------------------------------------------------------------------------
def test_nprocs_gives_gloo_cpu_ranks():
    plan = make_plan(nprocs=4, visible_gpus=[])
    assert (plan.world_size, plan.backend, plan.gpus) == (4, "gloo", ())
    assert plan.threads is None  # each rank's rule, on its host (see the threads tests)
    assert plan.init_method.kind == "env" and plan.init_method.host == "127.0.0.1"


def test_gpus_gives_nccl_one_gpu_per_rank():
    plan = make_plan(gpus=2, visible_gpus=["0", "1", "2"])
    assert (plan.world_size, plan.backend, plan.gpus) == (2, "nccl", ("0", "1"))


def test_no_size_uses_all_visible_gpus():
    assert make_plan(visible_gpus=["3", "5"]).gpus == ("3", "5")


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(gpus=2, visible_gpus=[]), ["CUDA sees none", "--nprocs 2"]),
        (dict(gpus=4, visible_gpus=["0", "1"]), ["more GPUs than the 2 visible"]),
        (dict(nprocs=0), ["at least 1"]),
        (dict(nprocs=-3), ["at least 1"]),
        (dict(gpus=0, visible_gpus=["0"]), ["at least 1"]),
        (dict(nprocs=2, backend="mpi"), ["Unknown --backend", "auto, nccl, gloo"]),
        (dict(nprocs=2, backend="nccl"), ["nccl"]),
        (dict(visible_gpus=[]), ["--nprocs"]),
        (dict(gpus=1, nprocs=2, visible_gpus=["0"]), ["not both"]),
        (dict(nprocs=2, timeout=0), ["--timeout"]),
        (dict(nprocs=4, layout={"tp": 3}), ["Bad parallel layout", "4"]),
        (dict(nprocs=2, init_method="http://x"), ["Unknown --init-method"]),
    ],
)
def test_bad_options_are_refused_with_the_fix(kwargs, words):
    with pytest.raises(DistUsageError) as e:
        make_plan(**kwargs)
    for w in words:
        assert w in str(e.value)


def test_init_methods_parse():
    assert parse_init_method("tcp://127.0.0.1:29500").port == 29500
    assert parse_init_method("file:///tmp/x").path == "/tmp/x"
    assert parse_init_method(None).url == "env://"
    with pytest.raises(DistUsageError, match="host and a port"):
        parse_init_method("tcp://127.0.0.1")
    with pytest.raises(DistUsageError, match="three slashes"):
        parse_init_method("file://tmp/x")
    with pytest.raises(DistUsageError, match="does not exist"):
        parse_init_method("file:///no/such/dir/x")


@pytest.mark.parametrize("url", ["tcp://h:70000", "tcp://h:port"])
def test_bad_tcp_port_names_the_valid_range(url):
    with pytest.raises(DistUsageError, match="from 1 to 65535") as e:
        make_plan(nprocs=2, init_method=url)
    assert url in str(e.value) and "\n" not in str(e.value)


def test_loopback_addresses():
    assert is_loopback("127.0.0.1") and is_loopback("127.0.0.2") and is_loopback("localhost")
    assert is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    assert not is_loopback("node1")  # a name: may resolve to anything


def test_each_rank_sees_its_nodes_gpus_and_its_own_is_cuda_local_rank():
    # --gpus 2 on a node with GPUs 3, 5, 7 visible: ranks see the chosen two, in rank order
    plan = make_plan(gpus=2, visible_gpus=["3", "5", "7"])
    assert [plan.cuda_devices(r) for r in range(2)] == [("3,5", 0), ("3,5", 1)]
    assert make_plan(nprocs=2, visible_gpus=["0"]).cuda_devices(1) is None  # CPU ranks


@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
def test_cuda_local_rank_is_the_ranks_gpu_on_every_node(slots, data):
    hosts = ",".join(f"node{i}:{n}" for i, n in enumerate(slots))
    plan = make_plan(launcher="ssh", hosts=hosts, gpus=1, bind_address="10.0.0.1")
    places = plan.placement.rank_places(plan.world_size)
    rank = data.draw(st.integers(0, plan.world_size - 1))
    visible, index = plan.cuda_devices(rank)
    node, local_rank, local_world = places[rank]
    assert index == local_rank  # torch.cuda.set_device(LOCAL_RANK) picks this rank's GPU
    assert visible is None  # the host's own CUDA_VISIBLE_DEVICES stays (#20 item 5)
    assert local_world == slots[node]


def test_ranks_on_other_hosts_use_only_the_gpus_their_host_gave_them():
    from infini_notebook.core.plan import launcher_device

    # Slurm gave this job GPUs 4-7 of a shared node: local rank 2 is the third of those
    # (device 2 within CUDA_VISIBLE_DEVICES), never physical GPU 2 of another job
    assert launcher_device("4,5,6,7", 2, 4) == 2
    assert launcher_device(None, 3, 4) == 3  # nothing set: the host's GPUs, torchrun's way
    assert launcher_device("6", 3, 4) == 0  # one GPU bound to each task
    with pytest.raises(DistUsageError, match="gives 2 GPUs"):
        launcher_device("4,5", 2, 4)
    with pytest.raises(DistUsageError, match="gives 0 GPUs"):
        launcher_device("", 0, 2)


def test_engine_environment_carries_torchrun_layout_and_gpu_variables():
    from infini_notebook.engine.bootstrap import engine_environment
    from infini_notebook.groups import ParallelLayout

    plan = make_plan(gpus=4, visible_gpus=["1", "2", "3", "4"], layout={"tp": 2, "zero1": 1})
    cfg = {
        "rank": 3, "local_rank": 3, "world_size": 4, "local_world_size": 4, "group_rank": 0,
        "master_addr": "127.0.0.1", "master_port": 4711, "threads": 1, "attempt": 2,
        "layout": plan.layout, "cuda": plan.cuda_devices(3),
    }  # fmt: skip
    env = engine_environment(cfg)
    assert env["CUDA_VISIBLE_DEVICES"] == "1,2,3,4" and env["LOCAL_RANK"] == "3"
    # init_parallel_groups() without arguments reads these back as the session's layout
    assert ParallelLayout.from_env(env=env) == ParallelLayout(**plan.layout)
    assert (env["TP_SIZE"], env["DP_SIZE"], env["ZERO1_SIZE"]) == ("2", "2", "1")
    # a user's own env:// init connects to the kernel's store instead of hosting one
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert env["TORCHELASTIC_RESTART_COUNT"] == "2"
    assert "CUDA_VISIBLE_DEVICES" not in engine_environment({**cfg, "cuda": None})


# ----- ranks -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, ranks",
    [
        ("0", [0]),
        ("0,2", [0, 2]),
        ("1-3", [1, 2, 3]),
        ("all", [0, 1, 2, 3]),
        (None, [0, 1, 2, 3]),
        ("3,0-1", [0, 1, 3]),
        (2, [2]),
    ],
)
def test_parse_ranks(spec, ranks):
    assert parse_ranks(spec, 4) == ranks


@pytest.mark.parametrize("spec", ["4", "a", "3-1", "-1", "0,,x"])
def test_bad_rank_specs(spec):
    with pytest.raises(DistUsageError):
        parse_ranks(spec, 4)


@given(st.sets(st.integers(0, 63), min_size=1))
def test_format_then_parse_round_trips(ranks):
    assert parse_ranks(format_ranks(sorted(ranks)), 64) == sorted(ranks)


def test_labels():
    assert rank_label([2]) == "[rank 2]"
    assert rank_label([0, 1, 2, 3, 6]) == "[ranks 0-3,6]"


# ----- output ----------------------------------------------------------------------------
def test_labeler_emits_only_complete_new_lines():
    lab = StreamLabeler()
    assert lab.feed("stdout", {0: "a\nb", 1: ""}) == "[rank 0] a\n"
    assert lab.feed("stdout", {0: "c\n", 1: "x\n"}) == "[rank 0] bc\n[rank 1] x\n"
    assert lab.feed("stdout", {0: "tail", 1: ""}, final=True) == "[rank 0] tail\n"


def test_carriage_returns_replace_the_line_and_only_its_last_state_is_kept():
    lab = StreamLabeler()
    # a progress line in pieces as iopub batches them: one piece may end mid-update
    assert lab.feed("stderr", {0: "\r 10%|#", 1: "\rstep 0"}) == ""
    assert lab.live() == "[rank 0]  10%|#\n[rank 1] step 0\n"
    assert lab.feed("stderr", {0: "  |\r 50%|#####|\r", 1: "\rstep 1\rstep 2"}) == ""
    assert lab.live() == "[rank 0]  50%|#####|\n[rank 1] step 2\n"  # a bare \r waits
    out = lab.feed("stderr", {0: "\r100%|##########|\n", 1: " done\n"})
    assert out == "[rank 0] 100%|##########|\n[rank 1] step 2 done\n"
    assert lab.live() == ""  # ended lines leave the live display
    assert lab.feed("stderr", {0: "abc\r\n", 1: "x\ry"}, final=True) == (
        "[rank 0] abc\n[rank 1] y\n"
    )


def test_plain_unfinished_lines_are_not_live():
    lab = StreamLabeler()
    assert lab.feed("stdout", {0: "no newline yet"}) == "" and lab.live() == ""
    assert settle("a\rb\nc\r\nd\re") == "b\nc\ne"


def test_collapse_groups_identical_text():
    lab = StreamLabeler(collapse=True)
    out = lab.feed("stdout", {0: "same\n", 1: "same\n", 2: "other\n", 3: "same\n"})
    assert out == "[ranks 0-1,3] same\n[rank 2] other\n"


def test_flood_is_capped_with_a_note():
    lab = StreamLabeler(max_lines=3)
    out = lab.feed("stdout", {1: "".join(f"{i}\n" for i in range(1000))})
    assert out.count("[rank 1]") == 4 and "capped at 3 lines" in out
    assert "session.last.stdout[1]" in out
    assert lab.feed("stdout", {1: "".join(f"{i}\n" for i in range(1000, 2000))}) == ""


def test_identical_tracebacks_are_shown_once():
    report = error_report({0: "Trace A", 1: "Trace A", 2: "Trace B"})
    assert report.count("Trace A") == 1 and "[ranks 0-1]" in report and "[rank 2]" in report
    assert group_identical({3: "x", 1: "x"}) == [([1, 3], "x")]
    summary = error_summary({1: "ValueError: bad"}, [0, 1, 2, 3])
    assert summary == "rank 1: ValueError: bad (ranks 0,2-3 finished)"


def test_tracebacks_differing_only_in_cell_number_are_grouped():
    report = error_report({0: "Cell In[3], line 1\nNameError", 2: "Cell In[7], line 1\nNameError"})
    assert report.startswith("[ranks 0,2]\nCell In[3]")


def test_main_thread_stack_keeps_the_cell_frames_only():
    from infini_notebook.core.output import main_thread_stack

    dump = (
        'Thread 0x1 (most recent call first):\n  File "threading.py", line 1 in wait\n\n'
        "Current thread 0x2 (most recent call first):\n"
        '  File "torch/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
        '  File "/tmp/ipykernel_1/2.py", line 2 in <module>\n'
        '  File "IPython/core/interactiveshell.py", line 3577 in run_code\n'
        '  File "ipyparallel/engine/kernel.py", line 1 in do_execute\n'
    )
    stack = main_thread_stack(dump)
    assert "all_reduce" in stack and "ipykernel_1/2.py" in stack
    assert "run_code" not in stack and "threading.py" not in stack
    idle = 'Current thread 0x2:\n  File "selectors.py", line 468 in select\n  File "x.py", line 1'
    assert main_thread_stack(idle).startswith("idle")


def test_stack_dump_taken_on_a_helper_thread_reads_as_the_cell_thread():
    from infini_notebook.engine.rank_services import as_seen_by_thread

    dump = (
        'Thread 0x00000000000000aa (most recent call first):\n  File "cell.py", line 2 in f\n\n'
        'Thread 0x00000000000000bb (most recent call first):\n  File "t.py", line 1 in w\n\n'
        "Current thread 0x00000000000000cc (most recent call first):\n"
        '  File "engine.py", line 9 in _dump_stacks\n'
    )
    seen = as_seen_by_thread(dump, main=0xAA, helper=0xCC)
    assert seen.startswith("Current thread 0x00000000000000aa") and "in f" in seen
    assert "Thread 0x00000000000000bb" in seen and "_dump_stacks" not in seen


def test_backends_stay_on_loopback_and_nccl_errors_raise_unless_the_user_says_otherwise():
    from infini_notebook.engine.bootstrap import backend_defaults

    env = backend_defaults({}, "lo")
    assert env == {
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "lo",  # NCCL too, not only gloo (#20 item 3)
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",  # a timed-out collective raises (item 4)
    }
    users = {"NCCL_SOCKET_IFNAME": "ib0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    assert backend_defaults(users, "lo") == {"GLOO_SOCKET_IFNAME": "lo"}
    # a session across hosts: the interfaces are the user's choice (--env)
    assert backend_defaults({}, None) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def test_recovery_advice_follows_the_backend_and_nccl_error_handling():
    from infini_notebook.core.plan import soft_restart_fails

    assert soft_restart_fails(make_plan(nprocs=2), {}) is None  # gloo: the ranks live on
    nccl = make_plan(gpus=2, visible_gpus=["0", "1"])
    assert soft_restart_fails(nccl, {}) is None  # the session's own setting (2)
    torn = soft_restart_fails(nccl, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    assert torn == "with TORCH_NCCL_ASYNC_ERROR_HANDLING=3 NCCL tears a timed-out rank down"
    given = make_plan(gpus=2, visible_gpus=["0", "1"], env=["TORCH_NCCL_ASYNC_ERROR_HANDLING=0"])
    assert "leaves the GPU work hanging" in soft_restart_fails(given, {})


def test_a_cyclic_distribution_across_hosts_is_refused():
    from infini_notebook.launch.launchers import check_placement

    plan = make_plan(launcher="slurm", nnodes=2, gpus_per_node=2, bind_address="10.0.0.5")

    def ident(host, local):
        return {"hostname": host, "launcher_local_rank": str(local)}

    check_placement([ident("a", 0), ident("a", 1), ident("b", 0), ident("b", 1)], plan)  # block
    cyclic = [ident("a", 0), ident("b", 0), ident("a", 1), ident("b", 1)]
    with pytest.raises(DistUsageError, match="Rank 1 runs on b as local rank 0.*block"):
        check_placement(cyclic, plan)
    # a launcher that names no local rank (ssh): the hosts are checked
    no_local = [{"hostname": h} for h in ("a", "b", "a", "b")]
    with pytest.raises(DistUsageError, match="The ranks of host 0 run on a, b"):
        check_placement(no_local, plan)


def test_one_remote_host_makes_a_multi_host_session():
    one_remote = make_plan(launcher="mpi", hosts="node1:8", bind_address="10.0.0.5")
    assert one_remote.placement.multi_host  # engines there cannot watch the kernel's pid
    assert not make_plan(launcher="mpi", nprocs=2).placement.multi_host  # this host only


def test_ranks_are_never_told_to_connect_to_0_0_0_0():
    from infini_notebook.launch.launchers import cluster_options

    one = ["127.0.0.1", "10.0.0.5"]
    remote = {"launcher": "ssh", "hosts": "a:1,b:1"}
    plan = make_plan(**remote, bind_address="0.0.0.0", host_addresses=one)
    assert (plan.controller_address, plan.store_address) == ("10.0.0.5", "10.0.0.5")
    assert cluster_options(plan, "/p")["controller_location"] == "10.0.0.5"
    assert cluster_options(plan, "/p")["controller_ip"] == "0.0.0.0"  # still listens on all
    # docs/multinode.md's tcp://0.0.0.0:PORT: ranks get the bind address
    tcp = make_plan(
        **remote, bind_address="10.0.0.7", init_method="tcp://0.0.0.0:29500", host_addresses=one
    )
    assert tcp.store_address == "10.0.0.7" and tcp.init_method.host == "0.0.0.0"
    with pytest.raises(DistUsageError, match="several: 10.0.0.5, 192.168.1.2.*--bind-address"):
        make_plan(**remote, bind_address="0.0.0.0", host_addresses=[*one, "192.168.1.2"])
    local = make_plan(nprocs=2, init_method="tcp://0.0.0.0:29500", host_addresses=one)
    assert local.store_address == "127.0.0.1"  # ranks on this host


# ----- threads per rank (issue 30, item 10) ---------------------------------------------
def test_threads_per_rank_share_the_hosts_cpus_unless_given():
    from infini_notebook.engine.threads import per_rank as threads_for

    assert threads_for({"local_world_size": 4}, cpus=8) == 2
    assert threads_for({"local_world_size": 16}, cpus=8) == 1  # never 0
    assert threads_for({"local_world_size": 4, "threads": 3}, cpus=8) == 3
    assert make_plan(nprocs=2, threads=3, visible_gpus=[]).threads == 3
    with pytest.raises(DistUsageError, match="at least 1 thread"):
        make_plan(nprocs=2, threads=0, visible_gpus=[])


def test_a_cell_error_shows_its_root_cause_on_its_own_line_and_each_part_whole_below():
    """Issue 40 items 5 and 7: each part of the summary on its own line. Issue 50: no line
    is broken at a width of ours (JupyterLab wraps at the notebook's width, and broke our
    100-column lines again mid-word in a narrower notebook: "re-cre" / "ate")."""
    from infini_notebook.core.errors import DistCellError, DistInterrupted, DistUsageError
    from infini_notebook.kernel.recovery import rebuild_after_release

    class Rebuilt:  # a session whose soft restart works
        def restart(self, after_failure):
            pass

    waited = (
        "ranks 0,2-3 were waiting for rank 1 in the cell's 1st all_reduce (#3 on the world "
        "group) at In[7], line 6: released."
    )
    advice = rebuild_after_release(Rebuilt())
    summary = f"rank 1: ValueError: boom; {waited} {advice}"
    shown = DistCellError(summary, "[rank 1]\ntrace")._render_traceback_()
    assert shown == [
        "[rank 1]",
        "trace",
        "\x1b[0;31mDistCellError\x1b[0m: rank 1: ValueError: boom",
        f"  {waited}",
        f"  {advice}",
    ]
    assert len(advice) > 100 and "re-create" in advice  # the sentence that was cut in two
    long = "The process groups are not whole: a collective timed out. Run %dist_restart first. "
    usage = DistUsageError(long * 3)._render_traceback_()
    assert usage == [f"\x1b[0;31mDistUsageError\x1b[0m: {long * 3}"]  # one line, whole
    stop = DistInterrupted(summary)._render_traceback_()
    assert stop == [f"\x1b[0;31mKeyboardInterrupt\x1b[0m: {summary}"]
