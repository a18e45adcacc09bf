"""--gpus by count or by id, and the GPU each rank gets: pure, milliseconds."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infini_notebook.core.devices import gpu_count, parse_gpu_ids, requested_gpus, visible_entry
from infini_notebook.core.errors import DistUsageError
from infini_notebook.core.options import count_or_ids, flag_specs
from infini_notebook.core.plan_checks import make_plan

EIGHT = [str(i) for i in range(8)]


@pytest.mark.parametrize(
    "spec, ids",
    [
        ("4,5,6,7", (4, 5, 6, 7)),
        ("2-5", (2, 3, 4, 5)),
        ("0,2-3", (0, 2, 3)),
        ("7,6", (7, 6)),  # the order given is the rank order
        ("3,", (3,)),  # one GPU by id; "3" is three GPUs
        (" 1, 2 ", (1, 2)),
        ("4-4", (4,)),
    ],
)
def test_id_specs_parse(spec, ids):
    assert parse_gpu_ids(spec) == ids
    assert requested_gpus(spec) == ids and gpu_count(spec) == len(ids)


def test_a_count_stays_a_count():
    assert [requested_gpus(v) for v in (4, "4", " 4 ", None)] == [4, 4, 4, None]
    assert requested_gpus([4, 5]) == (4, 5) and requested_gpus((3,)) == (3,)
    assert (count_or_ids("8"), count_or_ids("4,5"), count_or_ids("-1")) == (8, "4,5", -1)


def test_the_flag_takes_a_count_or_ids():
    parser = argparse.ArgumentParser()
    for flag, kw in flag_specs():
        parser.add_argument(flag, **kw)
    assert parser.parse_args(["--gpus", "8"]).gpus == 8
    assert parser.parse_args(["--gpus", "4,5,6,7"]).gpus == "4,5,6,7"
    assert parser.parse_args(["--gpus", "2-5"]).gpus == "2-5"


def test_ranks_use_the_listed_gpus_in_order():
    plan = make_plan(gpus="4,5,6,7", visible_gpus=EIGHT)
    assert (plan.world_size, plan.backend, plan.gpus) == (4, "nccl", ("4", "5", "6", "7"))
    assert [plan.cuda_devices(r) for r in range(4)] == [("4,5,6,7", r) for r in range(4)]
    assert [plan.physical_gpu(r) for r in range(4)] == ["4", "5", "6", "7"]


def test_ids_count_the_kernels_visible_gpus():
    # The kernel runs with CUDA_VISIBLE_DEVICES=2,3,6,7: id 1 is GPU 3, id 3 is GPU 7
    plan = make_plan(gpus="1,3", visible_gpus=["2", "3", "6", "7"])
    assert plan.cuda_devices(1) == ("3,7", 1)
    assert [plan.physical_gpu(r) for r in range(2)] == ["3", "7"]
    uuids = make_plan(gpus="1-1", visible_gpus=["GPU-aa", "GPU-bb"])
    assert uuids.physical_gpu(0) == "GPU-bb"


@given(st.data())
def test_each_rank_gets_the_visible_entry_its_id_names(data):
    visible = data.draw(st.lists(st.integers(0, 63), min_size=1, max_size=16, unique=True))
    visible = [str(v) for v in visible]
    ids = data.draw(st.permutations(list(range(len(visible)))))
    ids = ids[: data.draw(st.integers(1, len(ids)))]
    plan = make_plan(gpus=",".join(map(str, ids)) + ",", visible_gpus=visible)
    chosen = [visible[i] for i in ids]
    assert plan.world_size == len(ids) and list(plan.gpus) == chosen
    for rank in range(len(ids)):
        assert plan.cuda_devices(rank) == (",".join(chosen), rank)
        assert plan.physical_gpu(rank) == chosen[rank]


@given(st.integers(0, 40), st.integers(0, 40))
def test_a_range_is_every_id_from_first_to_last(first, length):
    assert parse_gpu_ids(f"{first}-{first + length}") == tuple(range(first, first + length + 1))


@given(st.integers(1, 8), st.integers(0, 7))
def test_the_count_path_is_unchanged(n, extra):
    visible = EIGHT[: max(n, extra)]
    by_int, by_text = (
        make_plan(gpus=n, visible_gpus=visible),
        make_plan(gpus=str(n), visible_gpus=visible),
    )
    assert by_int == by_text and by_int.gpus == tuple(visible[:n])
    assert [by_int.physical_gpu(r) for r in range(n)] == visible[:n]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(gpus="0,0", nccl_version=(2, 11, 4)), ["NCCL >= 2.12", "NCCL 2.11.4", "gloo"]),
        (dict(gpus="0,0", gpu_memory_fraction=1.5), ["above 0", "at most 1", "0.45"]),
        (dict(gpus="0,0", gpu_memory_fraction=0.0), ["above 0"]),
        (dict(nprocs=2, gpu_memory_fraction=0.5), ["CPU ranks", "--gpus"]),
        (dict(gpus="0,0", gpu_memory_fraction=0.9), ["2 ranks on one GPU", "at most 0.50"]),
        (dict(gpus="0,1,0,0", gpu_memory_fraction=0.4), ["3 ranks on one GPU", "1.20"]),
        (dict(gpus="4,5,6,7", visible_gpus=EIGHT[:4]), ["no GPU 4", "ids 0-3", "0,1,2,3"]),
        (dict(gpus="0-99999"), ["no GPU 99999"]),
        (dict(gpus=""), ["Bad --gpus", "--gpus 4,5,6,7"]),
        (dict(gpus="a,b"), ["Bad --gpus"]),
        (dict(gpus="1,,2"), ["Bad --gpus"]),
        (dict(gpus=",1"), ["Bad --gpus"]),
        (dict(gpus="1-"), ["Bad --gpus"]),
        (dict(gpus="-1,2"), ["Bad --gpus"]),
        (dict(gpus="1.5"), ["Bad --gpus"]),
        (dict(gpus="5-2"), ["low to high", "2-5"]),
        (dict(gpus="0,1", nprocs=2), ["2 ranks", "drop --nprocs"]),
        (dict(gpus="0,1", visible_gpus=[]), ["CUDA sees none", "--nprocs 2"]),
        (dict(gpus="0-3", layout={"tp": 3}), ["Bad parallel layout", "4"]),
        (dict(gpus=0), ["at least 1", "--gpus 0,"]),
        (dict(gpus="0"), ["at least 1"]),
        (dict(gpus="9"), ["more GPUs than the 8 visible"]),
    ],
)
def test_bad_gpu_specs_are_refused_with_the_fix(kwargs, words):
    kwargs.setdefault("visible_gpus", EIGHT)
    with pytest.raises(DistUsageError) as e:
        make_plan(**kwargs)
    for w in words:
        assert w in str(e.value)
    assert "\n" not in str(e.value)


def test_ids_are_refused_where_each_host_picks_its_gpus():
    ssh = dict(launcher="ssh", hosts="a:2,b:2", bind_address="10.0.0.1")
    with pytest.raises(DistUsageError, match="CUDA_VISIBLE_DEVICES=4,5 .each host"):
        make_plan(gpus="4-5", **ssh)
    with pytest.raises(DistUsageError, match="--gpus-per-node 2"):
        make_plan(launcher="slurm", nnodes=2, gpus="0,1", bind_address="10.0.0.1")
    plan = make_plan(gpus="2", **ssh)  # a count still means GPU ranks there
    assert plan.backend == "nccl" and plan.physical_gpu(3) is None


def test_cpu_ranks_have_no_physical_gpu():
    assert make_plan(nprocs=2, visible_gpus=EIGHT).physical_gpu(1) is None


def test_a_rank_whose_host_chose_its_gpus_names_its_own():
    assert visible_entry("4,5,6,7", 2) == "6"
    assert visible_entry(None, 3) == "3"  # nothing narrows the host's GPUs
    assert visible_entry("GPU-aa, GPU-bb", 1) == "GPU-bb"


def test_status_and_ready_line_name_the_physical_gpu():
    from infini_notebook.core.state import RankState
    from infini_notebook.viz.status_render import device_label

    rs = RankState(rank=0, pid=1, host="h", device="cuda:0", device_name="H100", state="idle")
    assert device_label(rs) == "cuda:0 H100"
    rs.gpu = "5"
    assert device_label(rs) == "cuda:0 (GPU 5) H100"


def test_the_ready_line_names_gpus_and_threads_per_rank():
    from infini_notebook.core.state import RankState
    from infini_notebook.groups import ParallelLayout
    from infini_notebook.viz.status_render import ready_text

    rows = [
        RankState(r, 1, "h", f"cuda:{r}", "H100", "idle", gpu=str(4 + r), threads=8)
        for r in range(4)
    ]
    assert ready_text("nccl", rows, "engines forked") == (
        "4 ranks ready (nccl; GPUs 4,5,6,7; 8 threads per rank; engines forked)."
    )
    cpu = [RankState(r, 1, "h", "cpu", "cpu", "idle", threads=1) for r in range(2)]
    assert ready_text("gloo", cpu, "x") == "2 ranks ready (gloo; 1 thread per rank; x)."
    layout = ParallelLayout(4, tp=2).sizes_text()  # issue 40 item 9: the layout, as %dist_groups
    assert ready_text("nccl", rows, "forked", layout) == (
        "4 ranks ready (tp 2 x dp 2; nccl; GPUs 4,5,6,7; 8 threads per rank; forked)."
    )
    assert ParallelLayout(8, tp=2, pp=2).sizes_text() == "tp 2 x dp 2 x pp 2"
    assert ParallelLayout(2).sizes_text() == "dp 2" and ParallelLayout(1).sizes_text() == "dp 1"


# --- several ranks on one GPU (--gpus 0,0) ------------------------------------------------


def test_a_gpu_listed_twice_is_shared_by_two_ranks_that_see_it_once():
    """CUDA (and torch's _parse_visible_devices) read a repeated CUDA_VISIBLE_DEVICES entry
    as the end of the list, so ranks that share a GPU see it once, as cuda:0 here."""
    plan = make_plan(gpus="0,0", visible_gpus=EIGHT, nccl_version=(2, 28, 9))
    assert (plan.world_size, plan.backend, plan.gpus) == (2, "nccl", ("0", "0"))
    assert [plan.cuda_devices(r) for r in range(2)] == [("0", 0), ("0", 0)]
    assert [plan.physical_gpu(r) for r in range(2)] == ["0", "0"]
    assert plan.shared_gpus == {"0": (0, 1)}


def test_ranks_on_two_shared_gpus_see_both_in_first_use_order():
    plan = make_plan(gpus="3,3,1,1", visible_gpus=EIGHT, nccl_version=(2, 28, 9))
    assert [plan.cuda_devices(r) for r in range(4)] == [
        ("3,1", 0),
        ("3,1", 0),
        ("3,1", 1),
        ("3,1", 1),
    ]
    assert [plan.physical_gpu(r) for r in range(4)] == ["3", "3", "1", "1"]
    assert plan.shared_gpus == {"3": (0, 1), "1": (2, 3)}


def test_one_rank_per_gpu_keeps_cuda_local_rank_and_no_nccl_settings():
    plan = make_plan(gpus=4, visible_gpus=EIGHT, nccl_version=(2, 28, 9))
    assert [plan.cuda_devices(r) for r in range(4)] == [("0,1,2,3", r) for r in range(4)]
    assert plan.shared_gpus == {} and plan.sharing_env(0, "s") == {}


def test_ranks_sharing_a_gpu_get_distinct_nccl_host_ids_per_slot():
    """NCCL's duplicate-GPU check compares host hash and bus id: ranks on one GPU need
    distinct NCCL_HOSTIDs, ranks on distinct GPUs may share one (and keep P2P)."""
    plan = make_plan(gpus="0,0,1,1", visible_gpus=EIGHT, nccl_version=(2, 28, 9))
    envs = [plan.sharing_env(r, "sess") for r in range(4)]
    ids = [e["NCCL_HOSTID"] for e in envs]
    assert ids[0] != ids[1] and ids[2] != ids[3]  # the two ranks of each GPU differ
    assert ids[0] == ids[2] and ids[1] == ids[3]  # one id per slot
    assert all("sess" in i for i in ids)  # another session's ids differ
    assert all(e["NCCL_NET"] == "Socket" and e["NCCL_NVLS_ENABLE"] == "0" for e in envs)
    other = make_plan(gpus="0,0", visible_gpus=EIGHT, nccl_version=(2, 28, 9))
    assert other.sharing_env(0, "other")["NCCL_HOSTID"] != ids[0]


def test_a_new_nccl_shares_a_gpu_by_its_own_switch():
    plan = make_plan(gpus="0,0", visible_gpus=EIGHT, nccl_version=(2, 30, 0))
    assert plan.sharing_env(1, "s") == {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    older = make_plan(gpus="0,0", visible_gpus=EIGHT, nccl_version=(2, 29, 7))
    assert "NCCL_HOSTID" in older.sharing_env(1, "s")


def test_gloo_ranks_may_share_a_gpu_without_nccl_settings():
    plan = make_plan(gpus="0,0", backend="gloo", visible_gpus=EIGHT, nccl_version=(2, 5, 0))
    assert plan.gpus == ("0", "0") and plan.sharing_env(0, "s") == {}


def test_memory_fraction_is_kept_for_the_ranks():
    plan = make_plan(gpus="0,0", gpu_memory_fraction=0.45, visible_gpus=EIGHT)
    assert plan.gpu_memory_fraction == 0.45
    assert make_plan(gpus=1, visible_gpus=EIGHT).gpu_memory_fraction is None


def test_sharing_reaches_the_engine_environment():
    """What the kernel sends is what the rank's environment gets, a user's --env kept."""
    from infini_notebook.engine import bootstrap

    cfg = {"nccl_sharing": {"NCCL_HOSTID": "a", "NCCL_NET": "Socket"}}
    env = bootstrap.sharing_environment(cfg, {"NCCL_NET": "IB"})
    assert env == {"NCCL_HOSTID": "a"}
    # a cluster that sets NCCL_HOSTID per pod: ours is appended, else every rank had one id
    env = bootstrap.sharing_environment(cfg, {"NCCL_HOSTID": "node17"})
    assert env == {"NCCL_HOSTID": "node17-a", "NCCL_NET": "Socket"}


def test_the_ready_line_and_status_say_which_ranks_share_which_gpu():
    from infini_notebook.core.state import RankState
    from infini_notebook.viz.status_render import ready_text, status_summary

    rows = [
        RankState(r, 1, "h", f"cuda:{r // 2}", "H100", "idle", gpu=str(r // 2), threads=4)
        for r in range(4)
    ]
    shared = "GPU 0: ranks 0-1; GPU 1: ranks 2-3, shared: correctness, not speed"
    assert ready_text("nccl", rows, "forked") == (
        f"4 ranks ready (nccl; GPUs 0,1; 4 threads per rank; {shared}; forked)."
    )
    assert shared in status_summary(rows)
    alone = [RankState(0, 1, "h", "cuda:0", "H100", "idle", gpu="0")]
    assert "shared" not in ready_text("nccl", alone, "x") + status_summary(alone)


def test_bench_figures_on_shared_gpus_say_they_are_not_the_hardwares():
    import pandas as pd

    from infini_notebook.core.busbw import format_table, p2p_summary
    from infini_notebook.kernel.bench import shared_gpu_caveat
    from infini_notebook.viz.bench_plots import p2p_heatmap, plot_busbw

    plan = make_plan(gpus="0,0", visible_gpus=EIGHT, nccl_version=(2, 28, 9))
    caveat = shared_gpu_caveat(plan)
    assert caveat.startswith("ranks share GPU 0 (ranks 0-1): not the hardware's bandwidth")
    assert shared_gpu_caveat(make_plan(gpus=2, visible_gpus=EIGHT)) == ""
    row = dict(collective="all_reduce", group="world", group_size=2, ranks=(0, 1),
               size_bytes=1024, count=256, dtype="float32", time_us=10.0, algbw_gbps=0.1,
               busbw_gbps=0.1)  # fmt: skip
    df = pd.DataFrame([row])
    df.attrs["caveat"] = caveat
    assert format_table(df).splitlines()[0] == f"# {caveat}"
    assert plot_busbw(df)._suptitle.get_text() == caveat
    matrix = pd.DataFrame([[float("nan"), 1.0], [1.0, float("nan")]])
    matrix.attrs["caveat"] = caveat
    assert p2p_summary(matrix, ["h", "h"]).splitlines()[0] == caveat
    assert p2p_heatmap(matrix)._suptitle.get_text() == caveat
