"""--gpus by count or by id, and the GPU each rank gets: pure, milliseconds."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infini_notebook.core.devices import gpu_count, parse_gpu_ids, requested_gpus, visible_entry
from infini_notebook.core.errors import DistUsageError
from infini_notebook.core.options import count_or_ids, flag_specs
from infini_notebook.core.plan import make_plan

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
        (dict(gpus="4,4"), ["lists GPU 4 twice", "once"]),
        (dict(gpus="2-4,3"), ["lists GPU 3 twice"]),
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
