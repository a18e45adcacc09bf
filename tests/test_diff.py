"""%dist_diff (issue 31): are the replicas still the same? In a real kernel on 4 CPU ranks,
tp 2 x dp 2: DDP replicas, a parameter nudged on one rank, tp shards that differ by design,
a NaN, a name missing on a rank, plain values compared by equality."""

from __future__ import annotations

import pytest
from conftest import message, text_of, use_session

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
    assert rows.strip() == (
        "[{'group': 'dp group 1 (ranks 1,3)', 'leaf': '2.bias', 'ranks': 'rank 3', "
        "'compared_with': 'rank 1', 'max_abs_diff': 0.5, 'what': 'values differ'}]"
    ), rows
    shown = kernel.run("%dist_diff net")
    assert text_of(shown).splitlines() == [  # the line, then the table, without an index
        "1 difference in 1 of 2 dp groups (of 4 tensors each)",
        "                 group   leaf  ranks compared_with  max_abs_diff          what",
        "dp group 1 (ranks 1,3) 2.bias rank 3        rank 1           0.5 values differ",
    ], text_of(shown)
    assert "all 4 tensors" in text_of(kernel.run("%dist_diff net --atol 0.6"))
    kernel.run("%%dist --ranks 3\nwith torch.no_grad():\n    net[2].bias[1] -= 0.5")


def test_tp_shards_differ_by_design_and_only_across_tp(kernel, four):
    assert text_of(kernel.run("%dist_diff shard")).strip() == (
        "1 tensor identical across 2 dp groups"
    )
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
    assert "'leaf': 'x', 'ranks': 'rank 2', 'compared_with': '-'" in rows, rows  # named
    assert "'what': 'NaN present'" in rows, rows
    # and its values differ from rank 0's: where one holds a NaN, by NaN
    assert "'compared_with': 'rank 0', 'max_abs_diff': nan, 'what': 'values differ'" in rows


def test_a_nan_does_not_hide_values_that_differ(kernel, four):
    """A tensor holding NaN was only said 'NaN present': rank 3's other elements differing
    from rank 1's went unsaid. The NaN both hold at one place is no difference there."""
    kernel.run("%%dist\nz = torch.tensor([1.0, float('nan'), 3.0])\nif rank == 3:\n    z[2] = 3.5")
    kernel.run("d = %dist_diff z")
    got = text_of(kernel.run("print(sorted((r, w, str(m)) for r, w, m in zip(d.ranks, d.what, "
                             "d.max_abs_diff)))"))  # fmt: skip
    z1, z3 = (dist_pull_value(kernel, "z", r) for r in (1, 3))
    import torch

    oracle = float((z3 - z1).abs().nan_to_num(0).max())  # NaN on both at [1]
    assert oracle == 0.5
    assert f"('rank 3', 'values differ', '{oracle}')" in got, got
    assert "('ranks 0,2', 'NaN present', 'nan')" in got, got
    assert "('ranks 1,3', 'NaN present', 'nan')" in got, got
    assert torch.equal(z1.isnan(), z3.isnan())


def dist_pull_value(kernel, name: str, rank: int):
    """``name`` on ``rank``, pulled into the test through a pickle file."""
    import pickle
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".pkl") as f:
        kernel.run(
            f"import pickle\nwith open({f.name!r}, 'wb') as _f:\n"
            f"    pickle.dump(dist_session.pull({name!r}, ranks=[{rank}]), _f)"
        )
        got = pickle.load(open(f.name, "rb"))
    return got[rank]


def test_missing_names_and_plain_values(kernel, four):
    kernel.run("%%dist\nif rank != 1:\n    only_some = 1\ncfg = {'lr': 0.1, 'step': rank % 2}")
    err = message(kernel.run("%dist_diff only_some", allow_error=True))
    assert "'only_some' cannot be read on every rank (rank 1: NameError" in err, err
    err = message(kernel.run("%dist_diff no_such_name", allow_error=True))
    assert "(ranks 0-3: NameError: name 'no_such_name' is not defined)" in err, err
    assert err.count("NameError") == 1, err  # once, not once per rank
    said = text_of(kernel.run("d = %dist_diff cfg --group world"))
    rows = text_of(kernel.run("print(d.to_dict('records'))"))
    assert "'group': 'world group 0 (ranks 0-3)'" in rows and "world group" in said, rows
    assert "tp-cp" not in rows + said  # the group of all ranks is "world", not its dims
    assert "'leaf': 'step', 'ranks': 'ranks 1,3'" in rows and "compared by equality" in rows, rows


# --------------------------------------------------------------------------- pure parts


TRIALS, WIDTH = 100_000, 16


def _trials(dtype, change: str, seed: int):
    """TRIALS rows of WIDTH elements of ``dtype`` and the same rows changed: a random
    permutation, signs flipped, one bit flipped, or the last bit moved +1/-1/-1/+1 over
    four elements. Returns (base, changed) as the words the checksum reads."""
    import torch

    from infini_notebook.engine.tensor_hash import words

    g = torch.Generator().manual_seed(seed)
    shape = (TRIALS, WIDTH)
    if dtype == torch.bool:
        base = torch.rand(shape, generator=g) < 0.5
    elif dtype.is_floating_point:
        base = torch.randn(shape, generator=g).to(dtype)
    else:
        base = torch.randint(-9, 10, shape, generator=g, dtype=dtype)
    if change == "permutation":
        changed = base.gather(1, torch.rand(shape, generator=g).argsort(dim=1))
    elif change == "sign flips":
        flip = torch.rand(shape, generator=g) < 0.25
        changed = base ^ flip if dtype == torch.bool else torch.where(flip, -base, base)
    else:
        w = words(base).view(shape).to(torch.int64, copy=True)
        rows = torch.arange(TRIALS)
        at = torch.rand(shape, generator=g).argsort(dim=1)
        if change == "bit flip":
            bits = 1 if dtype == torch.bool else 8 * base.element_size()
            w[rows, at[:, 0]] ^= 1 << torch.randint(0, bits, (TRIALS,), generator=g)
        else:  # the last bit's drift
            for k, step in enumerate((1, -1, -1, 1)):
                w[rows, at[:, k]] += step
        return words(base).view(shape), w.to(words(base).dtype)
    return words(base).view(shape), words(changed).view(shape)


CHANGES = ("permutation", "sign flips", "bit flip", "last-bit drift")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "int32", "bool"])
def test_the_device_checksum_has_no_collision_in_1e5_changes_of_each_kind(dtype):
    """The checksum that runs on a GPU (engine/tensor_hash.py), run here on CPU tensors
    10**5 times per kind of change: every changed tensor has another checksum."""
    import torch

    from infini_notebook.engine.tensor_hash import hash_sums

    dtype = getattr(torch, dtype)
    for seed, change in enumerate(CHANGES):
        if dtype == torch.bool and change == "last-bit drift":
            continue
        base, changed = _trials(dtype, change, seed)
        really = (base != changed).any(dim=1).tolist()
        assert sum(really) > TRIALS // 2, change  # most trials change something
        before, after = hash_sums(base), hash_sums(changed)
        collisions = sum(1 for b, a, r in zip(before, after, really) if r and a == b)
        assert collisions == 0, (dtype, change, collisions)
        assert all(a == b for b, a, r in zip(before, after, really) if not r)


def test_the_reported_collisions_are_gone_on_both_paths():
    """issue 39: each pair collided under the old sums of 32-bit words modulo 2**31-1."""
    import torch

    from infini_notebook.engine.tensor_hash import checksum, device_checksum, words

    g = torch.Generator().manual_seed(1)
    mask = torch.rand(16, generator=g) < 0.5
    x = torch.randn(64, generator=g)
    drift = x.clone()
    for i, step in zip((3, 10, 20, 40), (1, -1, -1, 1)):
        drift.view(torch.int32)[i] += step
    pairs = [
        (torch.tensor([1.0, 2, 2, 1]), torch.tensor([2.0, 1, 1, 2])),
        (torch.tensor([3, 5, 9, 7]), torch.tensor([5, 3, 7, 9])),
        (torch.tensor([1], dtype=torch.int32), torch.tensor([-1], dtype=torch.int32)),
        (x, drift),
        (mask, mask.flip(0) if not torch.equal(mask, mask.flip(0)) else ~mask),
    ]
    for a, b in pairs:
        assert device_checksum(words(a)) != device_checksum(words(b)), (a, b)
        assert checksum(a) != checksum(b), (a, b)
        assert device_checksum(words(a)) == device_checksum(words(a.clone()))


def test_the_cpu_and_device_checksums_give_the_same_verdicts():
    """The CPU path (SHA-1 of the words) and the device path (hashes summed) read the same
    words: for the same pairs, both say 'same' or both say 'different'."""
    import torch

    from infini_notebook.engine.tensor_hash import checksum, device_checksum

    for seed, change in enumerate(CHANGES):
        base, changed = _trials(torch.float32, change, seed)
        for i in range(300):
            for a, b in ((base[i], changed[i]), (base[i], base[i].clone())):
                same_cpu = checksum(a) == checksum(b)
                assert same_cpu == (device_checksum(a) == device_checksum(b)), (change, i)
                assert same_cpu == torch.equal(a, b)


def test_the_hash_is_murmur3_fmix64_in_wrapping_int64():
    """The torch ops give the reference 64-bit arithmetic (multiplication wraps, shifts are
    logical), the premise of the sums' collision chance."""
    import torch

    from infini_notebook.engine.tensor_hash import _mix

    def fmix64(k):
        m = (1 << 64) - 1
        k ^= k >> 33
        k = (k * 0xFF51AFD7ED558CCD) & m
        k ^= k >> 33
        k = (k * 0xC4CEB9FE1A85EC53) & m
        return k ^ (k >> 33)

    values = [0, 1, -1, 2**62 + 12345, -(2**63), 2**63 - 1, 0x123456789ABCDEF]
    mixed = _mix(torch.tensor(values)).tolist()
    assert [m % 2**64 for m in mixed] == [fmix64(v % 2**64) for v in values]


def _every_dtype():
    import torch

    return sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


@pytest.mark.parametrize("dtype", [str(d).replace("torch.", "") for d in _every_dtype()])
def test_every_dtype_torch_has_is_described_changed_measured_and_sent(dtype):
    """Whole tensors, views at an odd byte offset, strided views and 0-d tensors of every
    dtype: described (checksum, NaN/Inf), a one-byte change seen on both paths, the
    difference measured or None (no arithmetic for it), and the bytes sent rebuilt."""
    import torch

    from infini_notebook.engine.replica_check import (
        as_bytes,
        describe,
        from_bytes,
        largest_difference,
        local,
    )
    from infini_notebook.engine.tensor_hash import checksum, device_checksum, words

    dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    if dtype in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4):
        values = torch.randn(12, generator=g)
        t = torch.quantize_per_tensor(values, 0.1, 3 if dtype != torch.qint32 else 0, dtype)
        other = torch.quantize_per_tensor(values + 1, 0.1, 3 if dtype != torch.qint32 else 0, dtype)
    else:
        size = torch.empty(0, dtype=dtype).element_size()
        raw = torch.randint(0, 2 if dtype == torch.bool else 256, (12 * size,), generator=g)
        raw = raw.to(torch.uint8)
        t = raw.view(dtype)
        changed = raw.clone()
        changed[size + 1 if size > 1 else 1] ^= 1
        other = changed.view(dtype)
    for view in (t, t[1:5], t[::3], t[2]):
        d = describe(view)
        assert d["dtype"] == str(dtype).replace("torch.", "") and len(d["sum"]) > 8
        sent = from_bytes(as_bytes(local(view)).clone(), local(view))
        assert torch.equal(words(sent), words(local(view)))
    assert checksum(t) != checksum(other)
    assert device_checksum(words(local(t))) != device_checksum(words(local(other)))
    diff = largest_difference(local(t)[1:5], local(other)[1:5])
    assert diff is None or diff != 0 or diff != diff  # measured, NaN or not measurable


def test_integers_past_2_53_differ_by_their_exact_difference():
    import torch

    from infini_notebook.engine.replica_check import largest_difference

    big = torch.tensor([2**53, 7], dtype=torch.int64)
    assert largest_difference(big + 1, big) == 1  # through float64 it was 0: "identical"
    extremes = torch.tensor([2**63 - 1]), torch.tensor([-(2**63)])
    assert largest_difference(*extremes) == 2**64 - 1
    top = torch.tensor([2**64 - 1], dtype=torch.uint64), torch.tensor([1], dtype=torch.uint64)
    assert largest_difference(*top) == 2**64 - 2


def test_numpy_arrays_are_compared_by_their_bytes_not_their_repr():
    """A long array's repr elides its middle: one change in np.arange(10000) was missed."""
    import numpy as np

    from infini_notebook.engine.replica_check import describe

    a = np.arange(10000)
    b = a.copy()
    b[5000] = -1
    assert repr(a) == repr(b)
    assert describe(a)["sum"] != describe(b)["sum"]
    assert describe(a)["sum"] == describe(a.copy())["sum"]
    assert describe(a)["sum"] != describe(a.astype(np.int32))["sum"]
    objects = np.array([{"x": 1}] * 3000, dtype=object)
    changed = objects.copy()
    changed[1500] = {"x": 2}
    assert describe(objects)["sum"] != describe(changed)["sum"]


def test_an_unreadable_name_is_one_line_per_distinct_error():
    from infini_notebook.core.replica_diff import unreadable

    same = {r: "NameError: name 'x' is not defined" for r in range(4)}
    assert unreadable("x", same) == (
        "'x' cannot be read on every rank (ranks 0-3: NameError: name 'x' is not defined)."
    )
    mixed = {0: "KeyError: 'a'", 1: "NameError: n", 2: "KeyError: 'a'"}
    assert unreadable("d", mixed) == (
        "'d' cannot be read on every rank (ranks 0,2: KeyError: 'a'; rank 1: NameError: n)."
    )


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
    assert result.transfers == [] and result.tensors == {"w", "b", "n"}
    assert {r.leaf: r.against for r in result.rows} == {"b": {1: 0}, "n": {}, "extra": {}}


def test_the_table_names_the_leaf_and_what_each_rank_was_compared_with():
    """Issue 40 item 2: a plain tensor's leaf is its name; each row says which rank the
    differing ranks were compared with ('-' for what is wrong on its own, as NaN)."""
    from infini_notebook.core.replica_diff import COLUMNS, compare, summary, table

    def t(sum_, nan=False):
        return {"kind": "tensor", "shape": [2], "dtype": "float32", "device": "cpu",
                "sum": sum_, "nan": nan}  # fmt: skip

    leaves = {0: {"": t("a")}, 1: {"": t("a")}, 2: {"": t("a")}, 3: {"": t("b")}}
    result = compare(leaves, [[0, 2], [1, 3]], "dp")
    assert COLUMNS == ("group", "leaf", "ranks", "compared_with", "max_abs_diff", "what")
    assert table(result.rows, "w") == [
        ("dp group 1 (ranks 1,3)", "w", "rank 3", "rank 1", None, "values differ")
    ]
    assert summary(result, result.rows, "dp", 2) == (
        "1 difference in 1 of 2 dp groups (of 1 tensor each)"
    )
    leaves[2] = {"": t("a", nan=True)}
    nan = compare(leaves, [[0, 2], [1, 3]], "dp")
    row = ("dp group 0 (ranks 0,2)", "w", "rank 2", "-", None, "NaN present")
    assert table(nan.rows, "w")[0] == row
    clean = compare({r: {"": t("a")} for r in range(4)}, [[0, 2], [1, 3]], "dp")
    assert summary(clean, clean.rows, "dp", 2) == "1 tensor identical across 2 dp groups"
    values = {r: {"step": {"kind": "int", "sum": "1", "value": "1"}} for r in range(2)}
    only = compare(values, [[0, 1]], "world")
    assert summary(only, only.rows, "world", 1) == "1 value identical across 1 world group"


def _dtensor(sum_, layout, part):
    return {"kind": "tensor", "shape": [8, 4], "dtype": "float32", "device": "cpu",
            "sum": sum_, "layout": layout, "part": part}  # fmt: skip


def test_dtensor_shards_are_compared_only_with_the_same_shard():
    """tp 2 x dp 2 (dp groups 0,2 and 1,3). FSDP2 over dp: each dp group holds one copy,
    compared part by part with dp group 0's. TP over tp, compared over dp: the ranks of a
    dp group hold the same tp shard. A shard is never compared with another shard."""
    from infini_notebook.core.replica_diff import compare, summary

    dp_groups = [[0, 2], [1, 3]]
    fsdp = {
        r: {"w": _dtensor(f"s{r // 2}", "Shard(dim=0) over dp=2", f"dp={r // 2}")} for r in range(4)
    }
    same = compare(fsdp, dp_groups, "dp")
    assert same.rows == [] and same.dtensors == {"w": "groups"}
    assert summary(same, same.rows, "dp", 2) == (
        "1 tensor identical across 2 dp groups (1 DTensor sharded over each dp group: "
        "each group's whole tensor compared with the first group's)"
    )
    fsdp[3]["w"] = dict(fsdp[3]["w"], sum="drifted")
    drifted = compare(fsdp, dp_groups, "dp")
    assert [(r.group, r.ranks, r.what) for r in drifted.rows] == [
        ("dp group 1 (ranks 1,3)", [3], "values differ from dp group 0 (ranks 0,2)")
    ]
    assert drifted.transfers == [("w", 2, 3, True)]  # rank 2 holds dp=1 in dp group 0

    tp = {r: {"w": _dtensor(f"t{r % 2}", "Shard(dim=0) over tp=2", f"tp={r % 2}"),
              "b": _dtensor("bias", "Replicate() over tp=2", "")} for r in range(4)}  # fmt: skip
    tp[3]["w"] = dict(tp[3]["w"], sum="drifted")
    result = compare(tp, dp_groups, "dp")
    assert [(r.group, r.leaf, r.ranks, r.what) for r in result.rows] == [
        ("dp group 1 (ranks 1,3)", "w", [3], "values differ")
    ]
    assert result.transfers == [("w", 1, 3, True)] and result.dtensors == {
        "w": "parts",
        "b": "parts",
    }


def test_a_dtensor_held_once_in_all_is_not_called_identical():
    from infini_notebook.core.replica_diff import compare, summary

    world = {
        r: {"x": _dtensor(f"s{r}", "Shard(dim=0) over world=4", f"world={r}")} for r in range(4)
    }
    result = compare(world, [[0, 1, 2, 3]], "world")
    assert result.rows == [] and result.dtensors == {"x": "once"}
    assert summary(result, result.rows, "world", 1) == (
        "nothing to compare across 1 world group (1 DTensor with each part on one rank only: "
        "not compared)"
    )
    world[1]["x"] = dict(world[1]["x"], layout="Replicate() over world=4", part="")
    rows = compare(world, [[0, 1, 2, 3]], "world").rows
    assert [(r.ranks, r.what) for r in rows] == [
        ([1], "layout differs: Shard(dim=0) over world=4, Replicate() over world=4")
    ]


TWIN = """
import json, sys
import torch, torch.distributed as dist
from infini_notebook.engine.replica_check import measure
from infini_notebook.groups import ParallelLayout, init_parallel_groups

rank = int(sys.argv[1])
store = dist.TCPStore("127.0.0.1", int(sys.argv[2]), 2, rank == 0)
dist.init_process_group("cpu:gloo", store=store, rank=rank, world_size=2)
groups = init_parallel_groups(ParallelLayout(2))  # not "gloo": no twin until asked
before = len(groups._cpu_twins)
found = {"step": torch.tensor(3.0 + rank / 2)}
got = measure(found, [("step", 0, 1, True)], groups, cpu=True)
print(json.dumps([groups.backend, before, len(groups._cpu_twins), got]))
dist.destroy_process_group()
"""


def test_cpu_leaves_go_over_a_gloo_twin_built_on_first_use_by_every_rank():
    """The NCCL case (a backend that is not plain gloo, so CPU leaves need a twin),
    emulated by two real processes on 'cpu:gloo': measuring a CPU leaf builds the world's
    gloo twin on both ranks (collective) and sends over it."""
    import json
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": repo}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TWIN, str(r), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert results[0] == ["cpu:gloo", 0, 1, {}], results
    assert results[1] == ["cpu:gloo", 0, 1, {"step": 0.5}], results


def test_conjugate_negative_and_quantized_views_are_described_by_their_values():
    """Review of issue 39: a conjugate or negative-bit view crashed the checksum; quantized
    tensors of another scale were called identical (only their integers were hashed)."""
    import torch

    from infini_notebook.engine.replica_check import describe

    x = torch.tensor([1 + 2j, 3 - 1j])
    assert describe(x.conj())["sum"] == describe(x.conj().resolve_conj())["sum"]
    assert describe(x.conj())["sum"] != describe(x)["sum"]
    neg = torch._neg_view(torch.tensor([1.0, -2.0]))
    assert describe(neg)["sum"] == describe(torch.tensor([-1.0, 2.0]))["sum"]
    a = torch.quantize_per_tensor(torch.tensor([1.0, 2.0]), 0.1, 0, torch.qint8)
    b = torch.quantize_per_tensor(torch.tensor([2.0, 4.0]), 0.2, 0, torch.qint8)
    assert torch.equal(a.int_repr(), b.int_repr())  # the same integers ...
    assert describe(a)["sum"] != describe(b)["sum"]  # ... are not the same values


def test_plain_objects_are_not_told_apart_by_their_addresses():
    """Nor called identical: an object with no fields and no == of its own equals only
    itself, so it is not compared (issue 50); one with a == is compared by its repr."""
    from infini_notebook.engine.replica_check import describe

    class Config:
        pass

    class Named:
        def __eq__(self, other):
            return type(other) is Named

        def __repr__(self):
            return f"<Named at {hex(id(self))}>"

    assert describe(Config()) == {"kind": "opaque", "value": "Config", "sum": "Config"}
    assert describe(Named())["sum"] == describe(Named())["sum"]
    import torch  # equal only to themselves, but their reprs say what they are

    assert describe(torch.float32)["kind"] == describe(Config)["kind"] == "value"
    assert describe(torch.float32)["sum"] != describe(torch.bfloat16)["sum"]
    assert describe(lambda: 0)["kind"] == "opaque"  # "<function <lambda> at 0x...>"


# ---------------------------------------------------------------- plain values (issue 50)


def _described(value):
    from infini_notebook.engine.replica_check import describe, leaves

    return {path: describe(v) for path, v in leaves(value).items()}


def test_generators_are_compared_by_their_state():
    import random

    import numpy as np
    import torch

    def state(g):
        return _described(g)[""]["sum"]

    torch_gen = torch.Generator().manual_seed(0)
    assert state(torch_gen) == state(torch.Generator().manual_seed(0))
    assert state(torch_gen) != state(torch.Generator().manual_seed(1))
    drawn = torch.Generator().manual_seed(0)
    torch.rand(1, generator=drawn)  # the same seed, drawn further
    assert state(drawn) != state(torch_gen)
    assert state(np.random.default_rng(3)) == state(np.random.default_rng(3))
    assert state(np.random.default_rng(3)) != state(np.random.default_rng(4))
    assert state(np.random.RandomState(3)) != state(np.random.RandomState(4))
    assert state(random.Random(5)) == state(random.Random(5)) != state(random.Random(6))
    described = _described(np.random.default_rng(3))[""]
    assert described["value"].startswith("numpy PCG64 seed 3 state "), described
    assert described["differs"] == "state differs (numpy PCG64, compared by bit_generator.state)"
    assert _described(random.SystemRandom())[""]["kind"] == "opaque"  # no state to compare


def test_sets_and_dicts_are_compared_by_content_whatever_their_order():
    words = [f"w{i}" for i in range(30)]
    forward, backward = set(words), set()
    for w in reversed(words):
        backward.add(w)
    assert _described(forward) == _described(backward)
    assert _described(frozenset(words)) != _described(forward)  # another type
    assert _described({"a": 1, "b": {2}}) == _described({"b": {2}, "a": 1})  # by key
    one = _described(forward)[""]
    assert one["value"].startswith("{'w0', 'w1', 'w10'") and "compared by content" in one["differs"]
    assert _described({frozenset({"b", "a"}): 1}) == {"frozenset({'a', 'b'})": _described(1)[""]}


def test_objects_with_fields_are_compared_field_by_field_with_their_tensors_as_tensors():
    import collections
    import dataclasses
    import threading

    import torch

    @dataclasses.dataclass
    class Cfg:
        lr: float
        w: torch.Tensor
        cache: dict = dataclasses.field(default_factory=dict, compare=False)

    Point = collections.namedtuple("Point", "x t")

    class Holder:
        def __init__(self, t):
            self.t = t
            self.lock = threading.Lock()
            self.me = self  # a cycle: a reference to where it is, not a walk without end

    class Slotted:
        __slots__ = ("a", "b")

        def __init__(self):
            self.a = 1  # b never set: not a field

    cfg = _described(Cfg(0.1, torch.ones(3), {"x": 1}))
    assert {p: d["kind"] for p, d in cfg.items()} == {"": "type", "lr": "value", "w": "tensor"}
    assert cfg["w"] == _described(torch.ones(3))[""]
    assert _described(Cfg(0.1, torch.ones(3))) == cfg  # the field == ignores, ignored
    assert _described(Cfg(0.1, torch.zeros(3)))["w"]["sum"] != cfg["w"]["sum"]
    point = _described(Point(1, torch.ones(2)))
    assert sorted(point) == ["", "t", "x"] and point[""]["value"] == "test_diff.Point"
    holder = _described(Holder(torch.ones(2)))
    assert holder["lock"] == {"kind": "opaque", "value": "_thread.lock", "sum": "_thread.lock"}
    assert holder["me"]["value"] == "<the object at the top>"
    assert _described(Slotted()) == {"": _described(Slotted())[""], "a": _described(1)[""]}


def test_the_comparison_names_types_opaque_values_and_array_positions():
    from infini_notebook.core.replica_diff import Row, compare, measured, summary, table

    def value(sum_, **more):
        return {"kind": "value", "sum": sum_, "value": sum_, **more}

    def array(sum_, dtype="<f8", **more):
        return {"kind": "ndarray", "shape": [10], "dtype": dtype, "device": "cpu", "sum": sum_,
                **more}  # fmt: skip

    gen = {"differs": "state differs (torch.Generator, compared by get_state())"}
    leaves = {
        r: {
            "": {"kind": "type", "value": f"T{r}", "sum": f"m.T{r}"},
            "g": value(f"g{r}", **gen),
            "lock": {"kind": "opaque", "value": "_thread.lock", "sum": "_thread.lock"},
            "a": array(f"a{r}"),
            "o": array(f"o{r}", "|O", sendable=False, differs="values differ (an object array)"),
        }
        for r in range(2)
    }
    result = compare(leaves, [[0, 1]], "dp")
    what = {r.leaf: r.what for r in result.rows}
    assert what == {
        "": "type differs: T0, T1",
        "g": "state differs (torch.Generator, compared by get_state()): g0, g1",
        "a": "values differ",
        "o": "values differ (an object array)",
    }
    assert result.transfers == [("a", 0, 1, True)]  # an object array has no bytes to send
    assert result.opaque == {"lock": "_thread.lock"} and result.values == {"g", "a", "o"}
    row = next(r for r in result.rows if r.leaf == "a")
    measured(row, [{"count": 3, "of": 10, "first": [7], "max": 3.0}])
    assert (row.what, row.max_abs_diff) == ("values differ at 3 of 10 elements, first at [7]", 3.0)
    assert summary(result, result.rows, "dp", 1, "x") == (
        "4 differences in 1 of 1 dp group (of 3 values each) "
        "(not compared: lock (_thread.lock) has no value equality)"
    )
    assert table([row], "x")[0][1] == "a"
    two = Row("g", "a", [1, 3], "values differ")
    where = [{"count": 1, "of": 1, "first": [], "max": None}, {"count": 2, "of": 4,
             "first": [0, 1], "max": 2}]  # fmt: skip
    measured(two, where)
    assert two.what == "values differ: rank 1 at 1 of 1 element; rank 3 at 2 of 4 elements, " \
        "first at [0, 1]" and two.max_abs_diff is None  # fmt: skip
    alone = compare({r: {"": leaves[r]["lock"]} for r in range(2)}, [[0, 1]], "dp")
    assert summary(alone, alone.rows, "dp", 1, "h") == (
        "nothing to compare across 1 dp group (not compared: h (_thread.lock) has no value "
        "equality)"
    )


def test_where_two_numpy_arrays_differ():
    import numpy as np

    from infini_notebook.engine.plain_values import array_difference

    a = np.arange(12).reshape(3, 4)
    b = a.copy()
    b[1, 2], b[2, 0] = -5, 9
    assert array_difference(b, a) == {"count": 2, "of": 12, "first": [1, 2], "max": 11}
    big = np.array([2**62, 1], dtype=np.int64)
    assert array_difference(big + 1, big)["max"] == 1  # exact past 2**53
    words = np.array(["a", "b", "c"]), np.array(["a", "x", "c"])
    assert array_difference(*words) == {"count": 1, "of": 3, "first": [1], "max": None}
    read_only = np.broadcast_to(np.float32(1.5), (4,))
    assert array_difference(read_only, np.zeros(4, np.float32))["max"] == 1.5
