"""Source of notebooks/07_data_parallel_checkpoints.ipynb (run build.py to regenerate it)."""

from _nb import code, md

NAME = "07_data_parallel_checkpoints"

# Run twice: before the hard restart, and after it (new engines start with an empty namespace).
DEFINITIONS = """
%%dist --collapse
import os
import tempfile

import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

LR = 1e-3
DATA = groups.get("cp-dp")  # every rank that holds different tokens: dp x cp


def make_model():
    torch.manual_seed(0)  # the same weights on every rank, in every run
    return nn.Sequential(
        nn.Linear(512, 4096), nn.GELU(), nn.Linear(4096, 512),
        nn.Linear(512, 4096), nn.GELU(), nn.Linear(4096, 512),
    ).to(device)


def batch(step):
    \"\"\"The whole batch of a step (a data set of two batches, in turn): 4 sequences of
    8 tokens of 512 features, and the targets.\"\"\"
    x = torch.randn(4, 8, 512, generator=torch.Generator().manual_seed(step % 2))
    return x.to(device), x.flip(-1).to(device)  # learn to reverse the features


def my_part(t):
    \"\"\"This rank's tokens: its dp share of the sequences, its cp share of each sequence.\"\"\"
    t = t.chunk(groups.dp_size, dim=0)[groups.dp_rank]
    return t.chunk(groups.cp_size, dim=1)[groups.cp_rank]


def train(model, opt, steps, group=None):
    \"\"\"Adam steps; with a group, on this rank's tokens, the loss averaged over the group.\"\"\"
    losses = []
    for step in steps:
        x, y = batch(step)
        if group is not None:
            x, y = my_part(x), my_part(y)
        loss = F.mse_loss(model(x.reshape(-1, 512)), y.reshape(-1, 512))
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss = loss.detach()
        if group is not None:  # equal shares: the mean of the means is the whole mean
            dist.all_reduce(loss, group=group)
            loss /= dist.get_world_size(group)
        losses.append(loss.item())
    return losses


def reference(steps=5):
    \"\"\"The same model trained in one process on whole batches: losses, first gradients.\"\"\"
    ref = make_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    losses = train(ref, opt, range(1))
    grads = [p.grad.clone() for p in ref.parameters()]
    return losses + train(ref, opt, range(1, steps)), grads


def full(t):  # a whole tensor from a DTensor shard (FSDP), or the tensor itself
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def same(got, want, rtol=1e-5, atol=1e-6):
    return all(torch.allclose(full(g), w, rtol=rtol, atol=atol) for g, w in zip(got, want))


def grads(model):
    return [p.grad for p in model.parameters()]


def show(losses, want):
    match = same([torch.tensor(losses)], [torch.tensor(want)])
    print("losses", [round(x, 4) for x in losses], "match:", match)


def state_mib(model, opt):
    \"\"\"What this rank holds of parameters, gradients and Adam's two moments, in MiB.\"\"\"
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    tensors += [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]  # a shard's
    return sum(t.nbytes for t in local) / 2**20


CKPT = os.path.join(tempfile.gettempdir(), f"nb07-checkpoint-{os.environ['MASTER_PORT']}")
print(f"rank {rank}: dp {groups.dp_rank}, cp {groups.cp_rank}, data {groups.ranks_in('cp-dp')}")
"""

CELLS = [
    md("""
    # Data parallelism: DDP, FSDP2 sharding and checkpoints that survive a restart

    Data parallelism (dp) runs one copy of the model per rank, each on its own share of the
    batch, and averages the gradients so that every copy takes the same step. It is the
    outermost dimension of nearly every large training job. This notebook:

    1. trains with **DDP** (`DistributedDataParallel`): every rank holds the whole model,
       gradients are all-reduced;
    2. trains with **FSDP2** (`fully_shard`): every rank holds a quarter of the parameters,
       gradients and optimizer state, and gathers layers only while it computes them; the
       memory per rank drops;
    3. saves a **distributed checkpoint** (DCP, one file per rank), hard-restarts the session
       (new processes, nothing kept), loads it and trains on to the same losses as a run that
       never stopped.

    Every step is checked against the same model trained in one process. About ten minutes,
    on 4 CPU ranks; on GPUs start with `%dist_start --gpus 4 --cp 2` and nothing else changes.
    """),
    code("%load_ext infini_notebook"),
    md("""
    Four ranks with cp = 2 leave dp = 2. Context parallelism (cp, notebook 09) splits each
    *sequence* over the cp ranks, so the batch here is cut twice: its sequences over dp,
    each sequence's tokens over cp. All four ranks see different tokens, and the model here
    works token by token, so the gradients must be averaged over all four: over the **dp ×
    cp** group, `groups.get("cp-dp")`. With cp = 1 that group is `groups.dp`.
    """),
    code("%dist_start --nprocs 4 --cp 2"),
    md("""
    The live tiles of `%dist_status` show each rank's memory (RSS on CPU ranks, device
    memory on GPUs). The kernel reads the same numbers with `session.status()`; a small
    helper prints them, to compare before and after sharding:
    """),
    code("""
    import time
    import infini_notebook

    def memory(when):
        time.sleep(2.5)  # the tiles refresh about once a second
        tiles = infini_notebook.current().status()
        used = {s.rank: (s.memory_used or s.rss) / 2**20 for s in tiles}
        print(f"{when:<24}" + "  ".join(f"rank {r}: {m:5.0f} MiB" for r, m in used.items()))
    """),
    md("""
    ## The model, the data, and the one-process reference

    An 8.4-million-parameter MLP (32 MiB of float32 weights), the same on every rank from the
    same seed. Each step's batch is made from the step number, so every rank can build the
    whole batch and take its share with `my_part`, and `reference()` trains the same model
    on whole batches in one process: the numbers every parallel run below must reproduce.
    """),
    code(DEFINITIONS),
    md("""
    What the ranks use now, with every module of this notebook imported (the baseline for
    the memory figures below):
    """),
    code('memory("fresh ranks")'),
    code("""
    %%dist --collapse
    ref_losses, ref_grads = reference()
    print("one-process losses:", [round(x, 4) for x in ref_losses])
    """),
    md("""
    ## DDP: the whole model on every rank, gradients all-reduced

    `DistributedDataParallel(model, process_group=...)` all-reduces (averages) the gradients
    over the group during `backward()`. The group has to hold every rank that saw different
    data. Wrap it on `groups.dp` alone and each cp pair never averages its two halves of the
    sequences: the gradients are wrong, with no error anywhere. On `groups.get("cp-dp")` they
    match the one-process gradients (within `rtol=1e-5, atol=1e-6`, float rounding of sums
    taken in another order):
    """),
    code("""
    %%dist --collapse
    wrong = DDP(make_model(), process_group=groups.dp)
    train(wrong, torch.optim.AdamW(wrong.parameters(), lr=LR), range(1), DATA)
    print("DDP on groups.dp:             gradients match:", same(grads(wrong), ref_grads))
    del wrong

    ddp = DDP(make_model(), process_group=DATA)
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    losses = train(ddp, opt, range(1), DATA)
    print('DDP on groups.get("cp-dp"):   gradients match:', same(grads(ddp), ref_grads))
    losses += train(ddp, opt, range(1, 3), DATA)
    show(losses, ref_losses[:3])
    print(f"this rank holds {state_mib(ddp, opt):.1f} MiB of weights, gradients and Adam state")
    """),
    md("""
    Every rank holds all 128 MiB: the weights, their gradients and Adam's two moments, four
    times 32 MiB. The tiles show it on top of what each fresh process had (RSS also counts
    DDP's gradient buckets, activations, the reference model and what the allocator keeps
    for reuse, so it grows by more):
    """),
    code('memory("after DDP")'),
    md("""
    ## FSDP2: each rank holds a quarter

    `fully_shard(module, mesh=...)` replaces each parameter by a `DTensor` sharded along its
    first dim over the mesh: every rank keeps a quarter of every weight, and so a quarter of
    its gradient and optimizer state. In the forward and backward passes each layer's
    weights are all-gathered just before use and freed after, and gradients are
    reduce-scattered: each rank receives the average for its own quarter. Sharding each
    Linear, then the whole model, lets FSDP free one layer's gathered weights before the
    next one is gathered.

    The mesh is the dp × cp group as a 1-D `DeviceMesh` (`DeviceMesh.from_group` wraps the
    existing group and creates nothing). With cp = 1 you would pass `mesh["dp"]`.
    """),
    code("""
    %%dist --collapse
    del ddp, opt
    dp_cp = DeviceMesh.from_group(DATA, device.type, mesh_dim_names=("dp_cp",))
    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=dp_cp)
    fully_shard(model, mesh=dp_cp)
    w = model[0].weight
    print(f"model[0].weight: {type(w).__name__} {w.placements}, whole {tuple(w.shape)}, "
          f"here {tuple(w.to_local().shape)}")

    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = train(model, opt, range(1), DATA)
    print("FSDP gradients match:", same(grads(model), ref_grads))
    losses += train(model, opt, range(1, 3), DATA)
    show(losses, ref_losses[:3])
    print(f"this rank holds {state_mib(model, opt):.1f} MiB of weights, gradients and Adam state")
    """),
    md("""
    Same losses and gradients (`full_tensor()` gathers a sharded gradient to compare it), and
    32 MiB per rank instead of 128. Look at the `here` shape: 1024 of the 4096 rows. The
    tiles would not show it yet: the allocator keeps the memory DDP freed, for reuse. Fresh
    processes are a fairer comparison, and the hard restart below gives us some.

    ## A distributed checkpoint

    `get_state_dict` returns the model's and the optimizer's state as DTensors (each rank its
    quarter, under the parameter names of the unsharded model), and `dcp.save` writes every
    rank's part in parallel, one file per rank plus the metadata that says which piece of
    which tensor is where. The losses so far go in too, as a plain tensor (saved once).

    The folder is named after the session's store port (`MASTER_PORT`), so it is the same
    after a restart of this session and different for the next one. On several hosts it
    must be on a shared filesystem.
    """),
    code("""
    %%dist --collapse
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state, "losses": torch.tensor(losses)}
    dcp.save(state, checkpoint_id=CKPT)
    print("saved after 3 steps:", sorted(os.listdir(CKPT)))
    """),
    md("""
    ## Hard restart: new processes, nothing kept

    `%dist_restart --hard` ends the four engines and starts new ones on the same layout;
    every variable is gone (the tiles are back to fresh processes). Only the checkpoint on
    disk remains.
    """),
    code("%dist_restart --hard"),
    md("""
    The new ranks need the definitions again (in a live notebook: run that cell once more);
    then the tiles are back to fresh processes:
    """),
    code(DEFINITIONS),
    code('memory("after the restart")'),
    md("""
    Build the sharded model and its optimizer as before, then load: `dcp.load` fills the
    state dict in place, each rank reading just its quarter of each tensor (whatever the
    sharding was at save time: DCP reshards on load), and `set_state_dict` puts it into the
    model and into Adam. Two more steps continue the run:
    """),
    code("""
    %%dist --collapse
    dp_cp = DeviceMesh.from_group(DATA, device.type, mesh_dim_names=("dp_cp",))
    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=dp_cp)
    fully_shard(model, mesh=dp_cp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state, "losses": torch.zeros(3)}
    dcp.load(state, checkpoint_id=CKPT)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = state["losses"].tolist() + train(model, opt, range(3, 5), DATA)
    print(f"this rank holds {state_mib(model, opt):.1f} MiB of weights, gradients and Adam state")
    """),
    code('memory("FSDP, resumed")'),
    md("""
    Compare with the tiles after DDP, both from a fresh start. On CPU ranks the difference
    is small or nothing: RSS counts much more than these tensors (the unsharded model built
    before `fully_shard`, the whole gradients of a layer during its backward, gloo's and
    DCP's buffers, and whatever the allocator keeps for reuse), so a 96 MiB saving drowns.
    The cells' own count (128 against 32 MiB) is what sharding saves per rank. On GPUs the
    tiles show device memory, and there the saving shows.

    ## The check: the same run as one process

    The five losses (three before the restart, read back from the checkpoint, and two
    after) against `reference()`, the same five steps in one process, within `rtol=1e-5`.
    The last gradients too: step 4's, gathered from the shards, against the reference's:
    """),
    code("""
    %%dist --collapse
    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    ref_losses = train(ref, ref_opt, range(5))
    print("resumed FSDP:", [round(x, 4) for x in losses])
    print("one process: ", [round(x, 4) for x in ref_losses])
    print("losses match:", same([torch.tensor(losses)], [torch.tensor(ref_losses)]))
    print("step 4 gradients match:", same(grads(model), grads(ref)))
    """),
    md("""
    Remove the checkpoint (rank 0 alone: one folder), and stop.
    """),
    code("""
    %%dist --ranks 0
    import shutil

    shutil.rmtree(CKPT)
    print("checkpoint removed:", not os.path.exists(CKPT))
    """),
    code("%dist_stop"),
    md("""
    ## Recap

    - The gradient-averaging group is every rank that saw different data: dp × cp
      (`groups.get("cp-dp")`) when cp splits the sequences, `groups.dp` when cp = 1. A
      wrong group trains without an error; only a check against one process shows it.
    - `DDP(model, process_group=group)`: whole model per rank, all-reduced gradients.
    - `fully_shard(layer, mesh=...)` per layer, then on the model: each rank holds
      1/N of parameters, gradients and optimizer state (128 to 32 MiB here); a 1-D mesh over
      any group is `DeviceMesh.from_group(group, device.type)`.
    - `dcp.save` / `dcp.load` with `get_state_dict` / `set_state_dict`: a sharded checkpoint,
      written and read in parallel, that resumes training to the same losses after every
      process was replaced.
    """),
]
