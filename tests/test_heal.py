"""%dist_heal (issue 51): after rank 2 is killed and replaced, it gets the named objects
from its healthy dp replica (rank 0), over the process group. In a real kernel on 4 CPU
ranks (tp 2 x dp 2: dp groups [0, 2] and [1, 3]), one session and one replacement for the
module. Oracle: every rank's value pulled into the kernel and compared deeply (torch.equal
on every tensor of a state dict) with its dp replica's, the bytes each line reports
against the tensors' sizes computed here, and %dist_diff saying identical."""

from __future__ import annotations

import re
import time

import pytest
from conftest import message, text_of, use_session

pytestmark = pytest.mark.timeout(300)

SESSION = "--nprocs 4 --tp 2 --timeout 10"

SETUP = """%%dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
torch.manual_seed(0)
model = torch.nn.Linear(4, 3)
opt = torch.optim.Adam(model.parameters(), lr=0.1)
model(torch.randn(2, 4)).sum().backward(); opt.step()
wrapped = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.ReLU())
wrapped.register_buffer('seen', torch.arange(3))
x = torch.randn(1000, dtype=torch.float64)
cfg = {'lr': 0.1, 'layers': [4, 3], 'name': 'run 1'}
d = distribute_tensor(torch.randn(4, 4), mesh['dp'], [Replicate()])
w = distribute_tensor(torch.randn(4, 4), mesh['tp'], [Shard(0)])
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
net = Net()"""
NET = SETUP[SETUP.index("class Net") : SETUP.index("net = Net()")]

# Deep equality in the kernel: modules and optimizers by their state dicts, every tensor by
# dtype, shape and torch.equal, containers by key and index, plain values by ==.
ORACLE = """
import torch
def same(a, b):
    if isinstance(a, (torch.nn.Module, torch.optim.Optimizer)):
        return type(a) is type(b) and same(a.state_dict(), b.state_dict())
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b
def replicas(name):
    v = dist_session.pull(name)
    return same(v[2], v[0]), same(v[3], v[1])
def tensor_bytes(name, rank=0):
    v = dist_session.pull(name)[rank]
    if isinstance(v, (torch.nn.Module, torch.optim.Optimizer)):
        v = v.state_dict()
    ts = [v] if isinstance(v, torch.Tensor) else []
    ts += [t for t in v.values() if isinstance(t, torch.Tensor)] if isinstance(v, dict) else []
    for s in (v.get('state', {}).values() if isinstance(v, dict) else []):
        ts += [t for t in s.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in ts)
"""


@pytest.fixture(scope="module")
def replaced(kernel):
    """The objects made on every rank, then rank 2 killed (SIGKILL) and replaced."""
    use_session(kernel, SESSION)
    kernel.run(SETUP)
    kernel.run(ORACLE)
    kernel.run(
        "import os, signal, time\nos.kill(dist_session.status()[2].pid, signal.SIGKILL)\n"
        "while dist_session.status()[2].state != 'died': time.sleep(0.05)"
    )
    DEAD.append(message(kernel.run("%dist_heal model", allow_error=True)))
    out = text_of(kernel.run("%dist_restart --ranks 2"))
    assert "rank 2 replaced" in out, out
    return kernel


DEAD: list[str] = []  # what %dist_heal said while rank 2 was dead


def test_a_dead_rank_is_replaced_before_it_is_healed(replaced):
    assert DEAD == [
        "Cannot heal: rank 2 died (killed by SIGKILL). %dist_restart --ranks 2 starts a new "
        "rank 2; the others keep their variables (%dist_restart --hard restarts all). Then "
        "%dist_heal model."
    ]


def lines(kernel, magic: str) -> tuple[list[str], float]:
    """The lines a magic printed, and the cell's wall time seen from here."""
    t0 = time.perf_counter()
    out = text_of(kernel.run(magic))
    return out.strip().splitlines(), time.perf_counter() - t0


def value(kernel, code: str):
    import ast

    return ast.literal_eval(text_of(kernel.run(f"print(repr(({code})))")).strip())


def reported(line: str) -> tuple[int, float]:
    """(bytes, seconds) a heal line reports."""
    m = re.search(r": ([\d.]+) (B|kB|MB) in ([\d.]+) (ms|s)", line)
    assert m, line
    n = float(m[1]) * {"B": 1, "kB": 1e3, "MB": 1e6}[m[2]]
    return round(n), float(m[3]) * (1e-3 if m[4] == "ms" else 1)


def test_a_module_and_its_optimizer_are_healed_in_place(replaced):
    k = replaced
    # the new rank 2 makes its own (stale) model, as rerunning the model's cell would
    k.run("%%dist --ranks 2\ntorch.manual_seed(7)\nmodel = torch.nn.Linear(4, 3)")
    assert value(k, "replicas('model')") == (False, True)  # the oracle sees the difference
    (healed, refused), wall = lines(k, "%dist_heal model opt --from dp")
    assert healed.startswith("healed model (Linear) over dp from rank 0 to rank 2: "), healed
    n, seconds = reported(healed)
    assert n == value(k, "tensor_bytes('model')") == (12 + 3) * 4
    assert 0 < seconds < wall
    assert refused == (
        "opt is missing on rank 2: create the optimizer there first (as on rank 0, over the "
        "healed model's parameters), then %dist_heal opt"
    )
    k.run("%%dist --ranks 2\nopt = torch.optim.Adam(model.parameters(), lr=0.1)")
    [line], _ = lines(k, "%dist_heal opt")
    assert line.startswith("healed opt (Adam) over dp from rank 0 to rank 2: "), line
    assert reported(line)[0] == value(k, "tensor_bytes('opt')") > 0
    assert value(k, "replicas('model'), replicas('opt')") == ((True, True), (True, True))
    # the healed optimizer drives the healed parameters (in place: same objects): one more
    # step of the same data on every rank keeps the replicas identical
    k.run(
        "%%dist\nopt.zero_grad(); model(torch.ones(2, 4)).sum().backward(); opt.step()\n"
        "assert all(any(p is q for q in model.parameters()) for g in opt.param_groups "
        "for p in g['params'])"
    )
    assert value(k, "replicas('model')") == (True, True)
    diff = text_of(k.run("%dist_diff [model,opt] --group dp"))
    assert "identical across 2 dp groups" in diff and "differ" not in diff, diff


def test_missing_names_are_made_on_the_new_rank(replaced):
    k = replaced
    healed, _ = lines(k, "%dist_heal wrapped x cfg d")
    assert healed[0].startswith("healed wrapped (Sequential) over dp from rank 0 to rank 2: ")
    assert healed[0].endswith("; rebuilt on rank 2 from the pickled module"), healed[0]
    assert healed[1].startswith("healed x (Tensor) over dp from rank 0 to rank 2: ")
    assert reported(healed[1])[0] == value(k, "tensor_bytes('x')") == 8000
    assert healed[2].startswith("healed cfg (dict) over dp from rank 0 to rank 2: ")
    assert healed[3].startswith("healed d (DTensor) over dp from rank 0 to rank 2: ")
    assert all(h.endswith("new on rank 2") for h in healed[1:]), healed
    k.run("%%dist\nd_local = d.to_local()\nd_mesh = d.device_mesh.mesh.tolist(), d.placements")
    for name in ("wrapped", "x", "cfg", "d_local"):
        assert value(k, f"replicas({name!r})") == (True, True), name
    meshes = value(k, "{r: str(m) for r, m in dist_session.pull('d_mesh').items()}")
    assert meshes[2] == meshes[0] == "([0, 2], (Replicate(),))", meshes
    diff = text_of(k.run("%dist_diff [wrapped,x,cfg,d] --group dp"))
    assert "identical across 2 dp groups" in diff and "differ" not in diff, diff
    again, _ = lines(k, "%dist_heal x")
    assert again == [
        "x: nothing to heal over dp (every rank holds it and none was replaced since it was "
        "last healed; --to N heals rank N anyway)"
    ]
    [forced], _ = lines(k, "%dist_heal x --to 3")
    assert forced.startswith("healed x (Tensor) over dp from rank 1 to rank 3: 8.0 kB in "), forced


def test_a_tp_shard_is_refused_over_tp_and_healed_from_its_dp_replica(replaced):
    k = replaced
    refused, _ = lines(k, "%dist_heal w --from tp")
    assert refused == [
        "w is sharded over tp (Shard(dim=0) on mesh dim tp): no replica to heal from; "
        "load it from a checkpoint"
    ]
    assert "NameError" in text_of(k.run("%%dist --ranks 2\nw", allow_error=True))
    # rank 0 holds the same tp part (tp coordinate 0) as rank 2 would: a replica over dp
    [healed], _ = lines(k, "%dist_heal w --from dp")
    assert healed.startswith("healed w (DTensor) over dp from rank 0 to rank 2: 32 B"), healed
    k.run("%%dist\nw_local = w.to_local()")
    assert value(k, "replicas('w_local')") == (True, True)


def test_a_module_of_a_class_from_a_notebook_cell_needs_that_cell_on_the_new_rank(replaced):
    k = replaced
    [failed], _ = lines(k, "%dist_heal net")
    assert failed == (
        "healing net (Net) over dp from rank 0 to rank 2 failed: on rank 2, Can't get "
        "attribute 'Net' on <module '__main__'>: run the cell that defines it on rank 2 "
        "first (%%dist --ranks 2), then %dist_heal net"
    )
    k.run("%%dist --ranks 2\n" + NET)
    [healed], _ = lines(k, "%dist_heal net")
    assert healed.startswith("healed net (Net) over dp from rank 0 to rank 2: "), healed
    k.run("%%dist\nnet_sd = net.state_dict()")  # the kernel has no class Net to unpickle
    assert value(k, "replicas('net_sd')") == (True, True)
