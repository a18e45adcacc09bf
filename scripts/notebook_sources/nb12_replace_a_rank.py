"""Source of notebooks/12_replace_a_rank.ipynb (run build.py to regenerate it)."""

from _nb import code, md

NAME = "12_replace_a_rank"

CELLS = [
    md("""
    # A failed rank costs only that rank

    A rank can die in the middle of training: the out-of-memory killer, a segfault in an
    extension, a CUDA error that takes the process down. Restarting every rank would throw
    away what every other rank holds: the model that took minutes to load, the optimizer's
    state. Here one rank of a 4-rank data-parallel training run is killed between steps;
    `%dist_restart --ranks 2` starts a new rank 2 alone, `%dist_heal` gives it the model
    and optimizer a healthy replica holds, and training goes on. Its losses are then
    checked against the same training in one process.

    About a minute, on 4 CPU ranks.
    """),
    code("%load_ext infini_notebook"),
    code("%dist_start --nprocs 4"),
    md("""
    The model, the data and one training step. Every rank starts from the same weights
    (a fixed seed); each step's batch of 16 samples is split four ways, and DDP averages
    the gradients, so the four ranks together take the steps one process would take on
    whole batches. This cell only defines things: it can run again on every rank.
    """),
    code("""
    %%dist
    import os

    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    STEPS = 8


    def make_model():
        torch.manual_seed(0)  # the same weights on every rank
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))


    def batch(step):
        \"\"\"A step's whole batch: 16 samples of 32 features, and their targets.\"\"\"
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
        return x, x.sum(dim=1, keepdim=True)


    def train_step(net, opt, step, part=True):
        \"\"\"One Adam step; with part, on this rank's quarter, the loss averaged over ranks.\"\"\"
        x, y = batch(step)
        if part:
            x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        loss = F.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss = loss.detach()
        if part:
            dist.all_reduce(loss)
            loss /= world_size
        return loss.item()
    """),
    code("""
    %%dist
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ddp = DDP(model)
    losses = [train_step(ddp, opt, step) for step in range(4)]
    print(f"after 4 steps: loss {losses[-1]:.4f}")
    """),
    md("""
    Rank 2 dies as the others start step 4: its process is gone without a word, as after
    the out-of-memory killer. The others, waiting for it in DDP's gradient all_reduce, are
    released within a second, and the cell fails naming rank 2 and what to run. Their step 4
    never reached the optimizer: they still hold the model and optimizer of step 3.
    """),
    code(
        """
    %%dist
    if rank == 2:
        os._exit(9)
    train_step(ddp, opt, 4)
    """,
        "raises-exception",
    ),
    md("""
    `%dist_restart --ranks 2` starts a new engine for rank 2 alone and makes every rank's
    process groups anew; ranks 0, 1 and 3 keep their processes and variables. The new rank 2
    has an empty namespace:
    """),
    code("%dist_restart --ranks 2"),
    code("""
    %%dist
    print("model" in globals(), len(losses) if "losses" in globals() else None)
    """),
    md("""
    The new rank runs the definitions again (in a notebook you would run that cell once
    more; here its text, from the kernel's history, runs on rank 2), and makes its own model
    and optimizer, with the wrong state. `%dist_heal` then gives it the state of a healthy
    replica: the model's parameters, the optimizer's state (Adam's moments and step counts)
    and the list of losses, sent from rank 0 over the dp group by a broadcast, not through
    the notebook.
    """),
    code("""
    raw = get_ipython().history_manager.input_hist_raw  # the cells as typed
    definitions = next(c for c in raw if c.startswith("%%dist\\nimport os"))
    dist_session.run(definitions.split("\\n", 1)[1], ranks=[2]);
    """),
    code("""
    %%dist --ranks 2
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    """),
    code("%dist_heal model opt losses --from dp"),
    md("""
    The replicas are identical again, by value (`%dist_diff` compares every parameter and
    every optimizer tensor across the dp group):
    """),
    code("%dist_diff [model,opt] --group dp"),
    md("""
    DDP was built on the old process groups: every rank wraps the model again (DDP's
    constructor also checks that the ranks start from the same weights). Training goes on
    from step 4:
    """),
    code("""
    %%dist
    ddp = DDP(model)
    losses += [train_step(ddp, opt, step) for step in range(4, STEPS)]
    print(f"after {STEPS} steps: loss {losses[-1]:.4f}")
    """),
    md("""
    The check: the same model trained in one process, on whole batches, with no failure.
    Each step's loss of the run above (killed, replaced and healed) equals it:
    """),
    code("""
    %%dist --ranks 0
    reference = make_model()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    expected = [train_step(reference, ref_opt, step, part=False) for step in range(STEPS)]
    same = all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(losses, expected))
    print(f"{len(losses)} losses, equal to one process's: {same}")
    """),
    md("""
    ## Summary

    - A rank that dies is named with its exit code within a second; its waiting peers are
      released, and the message names `%dist_restart --ranks N`.
    - `%dist_restart --ranks N` replaces those ranks only (a warm fork: a fraction of a
      second); everything the other ranks hold stays.
    - `%dist_heal NAME ... --from dp` gives the new rank what a replica in its group holds,
      over the process group. What has no replica there (a tensor-parallel shard, FSDP
      shards) is named in one line: load it from a checkpoint.
    - Re-create what was built on the old process groups (DDP, FSDP, your own DeviceMesh).
    """),
    code("%dist_stop"),
]
