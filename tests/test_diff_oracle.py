"""%dist_diff against an oracle (issue 39): on 4 CPU ranks (gloo, tp 2 x dp 2), modules in
DDP (over dp), FSDP2 (fully_shard over dp), TP (parallelize_module over tp) and their Adam
optimizers. The oracle gathers every rank's full tensors (a DTensor's ``full_tensor()``)
and compares them with ``torch.equal``: a plain tensor within its group, a DTensor's whole
tensor on every rank. The tool's verdict must be the oracle's, for identical replicas and
for one element changed on one rank."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(600)

SETUP = """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 6))


def train(model, opt, seed):
    torch.manual_seed(seed)
    model(torch.randn(5, 8)).sum().backward()
    opt.step()
    opt.zero_grad()


ddp = DDP(build(), process_group=groups.dp)
ddp_opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
train(ddp, ddp_opt, seed=groups.dp_rank)  # each dp rank its own batch
fsdp = fully_shard(build(), mesh=groups.mesh["dp"])
fsdp_opt = torch.optim.Adam(fsdp.parameters(), lr=0.01)
train(fsdp, fsdp_opt, seed=groups.dp_rank)
plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
tp = parallelize_module(build(), groups.mesh["tp"], plan)
tp_opt = torch.optim.Adam(tp.parameters(), lr=0.01)
train(tp, tp_opt, seed=7)  # the same batch on the ranks of a tp group
world_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("everyone",))
spread = DTensor.from_local(torch.full((2,), float(rank)), world_mesh, [Shard(0)])


def flat(obj, prefix=""):
    if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
        obj = obj.state_dict()
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flat(v, f"{prefix}[{i}]"))
    return out


def oracle(obj, kind):
    '''leaf -> (ranks whose full tensor differs, the largest difference): a plain tensor
    against its kind group's first rank, a DTensor's full tensor against rank 0's.'''
    out = {}
    for path, v in sorted(flat(obj).items()):
        full = v.full_tensor() if isinstance(v, DTensor) else v.detach()
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, full.cpu())
        sets = [list(range(len(every)))] if isinstance(v, DTensor) else groups.layout.groups(kind)
        pairs = [(g[0], r) for g in sets for r in g[1:]]
        differ = sorted({r for a, r in pairs if not torch.equal(every[a], every[r])})
        largest = max(float((every[a].double() - every[r].double()).abs().max()) for a, r in pairs)
        out[path] = (differ, largest)
    return out
"""


@pytest.fixture(scope="module")
def session(session4):
    """The suite's shared API session (4 ranks, tp 2 x dp 2): one process holds one session,
    and starting another costs seconds on 2 cores."""
    session4.run(SETUP, echo=False)
    yield session4
    # SETUP seeds every rank alike (identical replicas); later tests of this shared session
    # expect each rank's own random stream again
    session4.run("torch.seed()", echo=False)


def check(session, name: str, kind: str = "dp"):
    """The tool's (line, rows) and the oracle's differing leaves: checked to agree."""
    text, df = session.diff(name, kind)
    session.run(f"_truth = oracle({name}, {kind!r})", echo=False)
    truth = session.pull("_truth")[0]
    differ = {path: found for path, found in truth.items() if found[0]}
    assert set(df.leaf) == set(differ), (text, df.to_dict("records"), differ)
    for row in df.itertuples():
        assert row.max_abs_diff == differ[row.leaf][1], (row, differ)
    return text, df.to_dict("records"), differ


CASES = [  # name, the drifted tensor on rank 3 (a DTensor's local shard), its leaf
    ("ddp", "ddp.module[0].weight", "module.0.weight"),
    ("ddp_opt", "ddp_opt.state[ddp.module[2].bias]['exp_avg']", "state.3.exp_avg"),
    ("fsdp", "fsdp[0].weight.to_local()", "0.weight"),
    ("fsdp_opt", "fsdp_opt.state[fsdp[2].weight]['exp_avg_sq'].to_local()", "state.2.exp_avg_sq"),
    ("tp", "tp[2].weight.to_local()", "2.weight"),
    ("tp_opt", "tp_opt.state[tp[0].bias]['exp_avg'].to_local()", "state.1.exp_avg"),
]


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_identical_replicas_are_identical_for_the_tool_and_the_oracle(session, name):
    text, rows, differ = check(session, name)
    assert rows == [] and differ == {}
    assert text.startswith("all "), text
    if name.startswith("fsdp"):  # sharded over dp: dp group 1's copy against dp group 0's
        assert "sharded over each dp group: each group's whole tensor compared" in text, text
    if name.startswith("tp"):  # the ranks of a dp group hold the same tp shard
        assert "compared between ranks holding the same part" in text, text


@pytest.mark.parametrize(("name", "tensor", "leaf"), CASES)
def test_one_element_changed_on_rank_3_is_found_where_the_oracle_finds_it(
    session, name, tensor, leaf
):
    session.run(
        f"_t = {tensor}\n_saved = _t.clone()\nwith torch.no_grad():\n    _t.view(-1)[1] += 0.25",
        ranks=[3],
        echo=False,
    )
    try:
        text, rows, differ = check(session, name)
    finally:
        session.run("with torch.no_grad():\n    _t.copy_(_saved)", ranks=[3], echo=False)
    assert list(differ) == [leaf] and 3 in differ[leaf][0], differ
    assert [(r["leaf"], r["ranks"]) for r in rows] == [(leaf, "rank 3")], rows
    # rank 3's reference: its dp group's first rank (1), or for FSDP2 (each dp group holds
    # each shard once) the rank of dp group 0 holding the same shard (2)
    assert rows[0]["compared_with"] == ("rank 2" if name.startswith("fsdp") else "rank 1"), rows
    assert text.startswith("1 difference in 1 of 2 dp groups"), text
    what = rows[0]["what"]
    if name.startswith("fsdp"):
        assert what == "values differ from dp group 0 (ranks 0,2)", what
    else:
        assert what == "values differ", what


def test_tp_compared_over_tp_compares_each_tp_groups_whole_tensor(session):
    """Over tp, a TP weight is held once per group (its shards): each tp group's whole
    tensor is compared with tp group 0's; the replicated biases within the group."""
    text, rows, _ = check(session, "tp", "tp")
    assert rows == [] and "3 DTensors sharded over each tp group" in text, text
    assert "1 DTensor compared between ranks holding the same part" in text, text
    session.run("_t = tp[0].weight.to_local()\n_saved = _t.clone()", ranks=[3], echo=False)
    session.run("with torch.no_grad():\n    _t[0, 0] = 5.0", ranks=[3], echo=False)
    try:
        text, rows, _ = check(session, "tp", "tp")
    finally:
        session.run("with torch.no_grad():\n    _t.copy_(_saved)", ranks=[3], echo=False)
    assert [(r["group"], r["ranks"], r["what"]) for r in rows] == [
        ("tp group 1 (ranks 2-3)", "rank 3", "values differ from tp group 0 (ranks 0-1)")
    ], rows


def test_a_dtensor_with_one_copy_in_the_world_is_said_not_compared(session):
    text, rows, _ = check(session, "spread")
    assert rows == [], rows
    assert text == (
        "nothing to compare across 2 dp groups (1 DTensor with each part on one rank only: "
        "not compared)"
    ), text


def test_leaves_the_old_checks_crashed_on_or_called_identical(session):
    """A bf16 view at an odd byte offset and fp8 (crashed), int64 past 2**53 and a long
    numpy array (called identical): each change on rank 3 is found and measured."""
    session.run(
        "import numpy as np\n"
        "odd = {'bf16': torch.arange(20, dtype=torch.bfloat16)[1:9],\n"
        "       'fp8': torch.ones(4).to(torch.float8_e4m3fn),\n"
        "       'big': torch.tensor([2**53, 5]), 'arr': np.arange(10000)}",
        echo=False,
    )
    text, _ = session.diff("odd")
    assert text == "all 3 tensors and 1 other value identical across 2 dp groups", text
    session.run(
        "odd['bf16'][2] = 99\nodd['fp8'][0] = 2.0\nodd['big'][0] += 1\nodd['arr'][5000] = -1",
        ranks=[3],
        echo=False,
    )
    _, df = session.diff("odd")
    got = {r["leaf"]: (r["ranks"], r["max_abs_diff"]) for r in df.to_dict("records")}
    assert got["bf16"] == ("rank 3", 96.0) and got["fp8"] == ("rank 3", 1.0), got
    assert got["big"] == ("rank 3", 1), got
    assert got["arr"] == ("rank 3", 5001), got  # |5000 - (-1)|
    where = df.set_index("leaf").loc["arr", "what"]
    assert where == "values differ at 1 of 10000 elements, first at [5000]", where
