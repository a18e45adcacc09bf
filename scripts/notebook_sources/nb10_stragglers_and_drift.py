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
    The first line is the answer: the rank that made the others wait, at how many of its
    collectives it arrived last, and how long its peers waited for it (each, and as a share
    of their cell). Here it is rank 3: each step it reached its dp group's first collective
    late (the gradient all-reduce, or a broadcast DDP makes in the forward pass), and rank 1,
    its dp peer, spent nearly all of its cell waiting for it. In the figure the ranks that
    waited are red; the one that made them wait is mostly grey (its loader shows as idle),
    so it carries the label "arrived last".

    The figure and the first table have a row per rank; its `wall_ms` is the rank's cell,
    from its first line to its end (its GPU work done, on GPUs), and it splits into four
    parts that add up to it, each counted once however many ops overlap:

    * **compute**: a CPU rank's ops on its cell's thread (a GPU rank: its kernels and
      copies on the GPU);
    * **wait**: inside a collective (or a send/recv) before its last peer arrived, from the
      moment the rank's part began to run (a gloo worker took it; on GPUs, the NCCL kernel
      started) to the last member's;
    * **communication**: the rest of those collectives and messages;
    * **idle**: everything else: Python between ops, sleeps, a data loader.

    Rank 3 is mostly idle (its loader); its dp peer, rank 1, waits about as long inside the
    gradient all-reduce, and the ranks of the other dp group do not wait at all. `top_ops`
    are the ops that took the rank's compute time, by self time (an op less the ops it
    called), with their share of it. `ops` and
    `matched` say how many collectives and messages the rank ran in the cell and how many
    were found on every member of their group (by group and sequence number, messages by
    peer and order): the wait is measured for those. When some cannot be matched (a rank
    left out with `--ranks`, more collectives than the Flight Recorder keeps on a thread it
    cannot place) their time counts as communication and the line under the figure says
    what the figures cover; a wait that could not be measured at all is left empty, never 0.
    The second table lists the collectives of this cell that cost the others the most
    waiting, with the rank that arrived last: rank 3, every step. `n` numbers a group's
    collectives within the cell from 1 (the session's own start-up collectives do not
    count), and the group is named as errors name it (`dp [ranks 1,3]`). The tables show
    milliseconds to 0.1; the DataFrames behind them keep full precision.

    `merged.json` opens in [Perfetto](https://ui.perfetto.dev) (or `chrome://tracing`):
    one process track per rank, on one clock, each rank's threads named, so the wait is
    visible as a long `gloo:all_reduce` on rank 1's worker thread ending together with
    rank 3's short one. Each rank's own trace is beside it, with the distributed information
    HTA reads. The same from code, with the tables as DataFrames:
    """),
    code("""
    import os
    prof = dist_session.profile("for _ in range(3):\\n    step()", out=traces + "/api", echo=False)
    print(prof.verdict)
    worst = prof.collectives.sort_values("wait_caused_ms", ascending=False)
    print("last to arrive:", sorted(set(worst.head(3)["last_rank"])))
    r = prof.ranks.set_index("rank")
    parts = r[["compute_ms", "wait_ms", "communication_ms", "idle_ms"]].sum(axis=1)
    print("the parts add up to each rank's cell:", bool((abs(parts - r["wall_ms"]) < 0.01).all()))
    matched = {k: f"{m} of {n}" for k, m, n in zip(r.index, r["matched"], r["ops"])}
    print("ops matched on every member:", matched)
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
