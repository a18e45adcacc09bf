"""Source of notebooks/10_stragglers_and_drift.ipynb (run build.py to regenerate it)."""

from _nb import code, md

NAME = "10_stragglers_and_drift"

CELLS = [
    md("""
    # Finding a straggler and a drifted replica

    Two questions come up in every distributed job, and neither prints itself:

    * **Which rank is slow, and how long do the others wait for it?** `torch.profiler`
      writes one trace per rank, each on its own clock. `%%dist_profile` runs a cell under
      the profiler on every rank and merges the traces into **one timeline**, a track per
      rank on one clock, with a table of who arrived last at each collective.
    * **Are my replicas still the same?** A rank-dependent branch or a missed all-reduce
      makes data-parallel replicas drift apart silently. `%dist_diff` compares a model
      (or any tensor, state dict or optimizer) across the replicas, without moving it.

    Four CPU ranks, `tp 2 x dp 2`; on GPUs start with `--gpus 4` instead.
    """),
    code("%load_ext infini_notebook"),
    code("%dist_start --nprocs 4 --tp 2"),
    md("""
    ## 1. A straggler

    A small data-parallel training loop. Rank 3's data comes from a slow loader (here a
    `sleep`), so at every step it reaches the gradient all-reduce late, and the other
    ranks wait inside the all-reduce for it. `%%dist_profile` runs the cell as `%%dist`
    does (the same output and errors) and writes the traces to `--out`:
    """),
    code("""
    import tempfile
    traces = tempfile.mkdtemp()
    """),
    code("""
    %%dist
    import time
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 8)), process_group=groups.dp)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        if rank == 3:
            time.sleep(0.2)  # a slow data loader on rank 3
        torch.manual_seed(100 + rank)
        opt.zero_grad()
        model(torch.randn(32, 64)).pow(2).mean().backward()  # DDP all-reduces the gradients
        opt.step()
    """),
    code("""
    %%dist_profile --out $traces
    for _ in range(3):
        step()
    print("3 steps done")
    """),
    md("""
    The figure has a row per rank: time computing, communicating, **waiting inside a
    collective for the last peer to arrive**, and idle (Python between ops, sleeps). Rank
    3 is mostly idle (its loader); its dp peer, rank 1, waits about as long inside the
    gradient all-reduce. The second table lists the collectives that cost the others the
    most waiting, with the rank that arrived last: rank 3, every step.

    `merged.json` opens in [Perfetto](https://ui.perfetto.dev) (or `chrome://tracing`):
    one process track per rank, on one clock, so the wait is visible as a long
    `gloo:all_reduce` on rank 1 ending together with rank 3's short one. Each rank's own
    trace is beside it, with the distributed information HTA reads. The same from code,
    with the tables as DataFrames:
    """),
    code("""
    import os
    prof = dist_session.profile("for _ in range(3):\\n    step()", out=traces + "/api", echo=False)
    worst = prof.collectives.sort_values("wait_caused_ms", ascending=False)
    print("last to arrive:", sorted(set(worst.head(3)["last_rank"])))
    print("files:", sorted(os.path.basename(p) for p in prof.files.values()))
    """),
    md("""
    ## 2. A drifted replica

    The replicas of a data-parallel group must hold the same parameters after every step.
    Right now they do; `%dist_diff` compares `model` within each dp group by checksums
    computed where the tensors live (only a few bytes per tensor travel):
    """),
    code("%dist_diff model"),
    md("""
    Now a bug: a rank-dependent branch that updates a weight on rank 3 only (think of a
    learning-rate warm-up read from a per-rank config). Nothing fails; the replicas just
    stop being replicas:
    """),
    code("""
    %%dist
    if rank == 3:
        with torch.no_grad():
            model.module[2].weight.mul_(1.01)
    step()
    """),
    code("%dist_diff model"),
    md("""
    One tensor differs, in one dp group: `module.2.weight` on rank 3, compared with rank 1
    (`compared_with`: the group's first rank), with the largest difference. `d = %dist_diff
    model` keeps the
    table as a DataFrame; `--atol 1e-6` ignores differences that small. Tensor-parallel
    shards are different by design, so compare them with `--group tp` only when they
    should be equal, and `--group world` compares every rank.

    A fix: copy the first replica's parameters over its group, then check again:
    """),
    code("""
    %%dist
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=groups.ranks_in("dp")[0], group=groups.dp)
    """),
    code("%dist_diff model"),
    code("%dist_stop"),
]
