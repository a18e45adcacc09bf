"""%dist_diff (issue 31): are the replicas still the same? In a real kernel on 4 CPU ranks,
tp 2 x dp 2: DDP replicas, a parameter nudged on one rank, tp shards that differ by design,
a NaN, a name missing on a rank, plain values compared by equality."""

from __future__ import annotations

import pytest
from conftest import text_of, use_session

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def four(kernel):
    use_session(kernel, "--nprocs 4 --tp 2")
    kernel.run(
        "%%dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "torch.manual_seed(0)\nnet = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),"
        " torch.nn.Linear(16, 4))\nddp = DDP(net, process_group=groups.dp)\n"
        "opt = torch.optim.SGD(ddp.parameters(), lr=0.1)\n"
        "torch.manual_seed(rank)\nloss = ddp(torch.randn(5, 8)).sum()\n"
        "loss.backward(); opt.step()\n"
        "shard = torch.full((3,), float(groups.tp_rank))"
    )


def test_identical_ddp_replicas_are_reported_clean(kernel, four):
    out = text_of(kernel.run("%dist_diff ddp"))
    assert out.strip() == "all 4 tensors identical across 2 dp groups", out


def test_a_parameter_nudged_on_rank_3_is_named_with_its_difference(kernel, four):
    kernel.run("%%dist --ranks 3\nwith torch.no_grad():\n    net[2].bias[1] += 0.5")
    kernel.run("diffs = %dist_diff net")
    rows = text_of(kernel.run("print(diffs.to_dict('records'))"))
    assert "'group': 'dp group 1 (ranks 1,3)', 'leaf': '2.bias', 'ranks': 'rank 3'" in rows, rows
    assert "'max_abs_diff': 0.5" in rows and "'what': 'values differ'" in rows
    assert "dp group 0" not in rows
    assert "1 difference in 1 of 2 dp groups" in text_of(kernel.run("%dist_diff net"))
    assert "all 4 tensors" in text_of(kernel.run("%dist_diff net --atol 0.6"))
    kernel.run("%%dist --ranks 3\nwith torch.no_grad():\n    net[2].bias[1] -= 0.5")


def test_tp_shards_differ_by_design_and_only_across_tp(kernel, four):
    assert "all 1 tensors identical across 2 dp groups" in text_of(kernel.run("%dist_diff shard"))
    out = text_of(kernel.run("%dist_diff shard --group tp"))
    assert "2 differences in 2 of 2 tp groups" in out, out


def test_a_kind_whose_groups_are_built_on_first_use(kernel, four):
    """tp-dp groups do not exist until asked for: building them is collective, so every
    rank takes part in the measuring, also those whose group is clean."""
    kernel.run("%%dist\nv = torch.zeros(3)\nif rank == 3:\n    v[0] = 2.0")
    kernel.run("d = %dist_diff v --group tp-dp", timeout=120)
    rows = text_of(kernel.run("print(d.to_dict('records'))"))
    assert "'ranks': 'rank 3'" in rows and "'max_abs_diff': 2.0" in rows, rows


def test_nan_on_one_rank_is_reported(kernel, four):
    kernel.run("%%dist\nx = torch.ones(4)\nif rank == 2:\n    x[1] = float('nan')")
    kernel.run("d = %dist_diff x")
    rows = text_of(kernel.run("print(d.to_dict('records'))"))
    assert "'ranks': 'rank 2'" in rows and "'what': 'NaN present'" in rows, rows


def test_missing_names_and_plain_values(kernel, four):
    kernel.run("%%dist\nif rank != 1:\n    only_some = 1\ncfg = {'lr': 0.1, 'step': rank % 2}")
    err = text_of(kernel.run("%dist_diff only_some", allow_error=True), "error")
    assert "'only_some' cannot be read on every rank (rank 1: NameError" in err, err
    kernel.run("d = %dist_diff cfg --group world")
    rows = text_of(kernel.run("print(d.to_dict('records'))"))
    assert "'leaf': 'step', 'ranks': 'ranks 1,3'" in rows and "compared by equality" in rows, rows


# --------------------------------------------------------------------------- pure parts


def test_the_on_device_checksum_sees_moved_and_changed_values():
    import torch

    from infini_notebook.engine.replica_check import checksum, device_checksum

    t = torch.arange(1000, dtype=torch.float32)
    raw = t.view(torch.uint8)
    base = device_checksum(raw)  # the GPU path, run on the CPU
    swapped = t.clone()
    swapped[[3, 7]] = swapped[[7, 3]]
    assert device_checksum(swapped.view(torch.uint8)) != base  # same sum, other places
    assert device_checksum(t.clone().view(torch.uint8)) == base
    assert checksum(t) == checksum(t.clone()) != checksum(swapped)
    assert checksum(torch.zeros(2, dtype=torch.bfloat16)) != checksum(torch.zeros(3))


def test_compare_finds_each_kind_of_difference():
    from infini_notebook.core.replica_diff import compare

    def t(sum_, shape=(2,), nan=False):
        return {"kind": "tensor", "shape": list(shape), "dtype": "float32", "sum": sum_, "nan": nan}

    leaves = {
        0: {"w": t("a"), "b": t("x"), "n": t("k")},
        1: {"w": t("a"), "b": t("x", (3,)), "n": t("k", nan=True), "extra": t("z")},
    }
    result = compare(leaves, [[0, 1]], "dp")
    what = {r.leaf: (r.ranks, r.what) for r in result.rows}
    assert what == {
        "b": ([1], "shape differs: [2], [3]"),
        "n": ([1], "NaN present"),
        "extra": ([0], "missing on these ranks"),
    }
    assert result.measure == [] and result.tensors == 3
