"""Source of notebooks/02_parallel_groups.ipynb (run build.py to regenerate and execute it)."""
# ruff: noqa: E501  (markdown tables and shell lines are notebook text)

from _nb import code, md, save

NAME = "02_parallel_groups"

CELLS = [
    md("""
    # Parallel groups: tp, cp, pp, dp and their combinations

    Training one model on many GPUs splits the work four ways, and each way needs its own
    *process group*, the set of ranks that talk to each other in a collective:

    | dim | splits | talks |
    |---|---|---|
    | **tp**, tensor parallel | each layer's weight matrices | all-reduce inside every layer |
    | **cp**, context parallel | the sequence | passes key/value blocks around a ring |
    | **pp**, pipeline parallel | the layers, into stages | sends activations stage to stage |
    | **dp**, data parallel | the batch; everything else is a copy | all-reduces gradients once per step |

    Every rank is in exactly one group of each kind. This notebook shows how the ranks are
    numbered into groups (pure arithmetic), how the *order string* changes who is whose
    neighbour, the rank grid widget, real groups on 8 CPU ranks proven by collectives, the
    `DeviceMesh`, and finally the same code as a `torchrun` script. It takes about ten
    minutes and runs on CPU ranks (gloo); on a GPU machine change the start line to
    `%dist_start --gpus 8 --tp 2 --pp 2`.
    """),
    code("%load_ext infini_notebook"),
    md("""
    ## 1. The layout is arithmetic

    `ParallelLayout` numbers the ranks; it starts no process and needs no torch, so you can
    plan a 1024-GPU job on a laptop. The sizes must multiply to the world size; `dp` is
    whatever is left (here 8 / (tp 2 x pp 2) = 2).
    """),
    code("""
    from infini_notebook.groups import ParallelLayout

    layout = ParallelLayout(8, tp=2, pp=2)
    print(layout.describe())
    for kind in ["tp", "dp", "pp"]:
        print(f"{kind} groups: {layout.groups(kind)}")
    """),
    md("""
    The order `tp-cp-dp-pp` lists the dims **fastest first**, like the digits of a number
    read from the right: here rank = tp + 2·dp + 4·pp (cp has size 1). So the tp groups are consecutive ranks (on a real cluster, GPUs in one
    node with the fast links that tp's many all-reduces need), dp groups step over tp
    (stride 2), and pp groups step over everything else (stride 4): the pipeline stages are
    the furthest apart, because only activations cross between them.

    Each rank's coordinates, and the way back:
    """),
    code("""
    for r in range(layout.world_size):
        print(f"rank {r}:", "  ".join(f"{d}={c}" for d, c in layout.coords(r).items()))

    layout.rank_of(tp=1, cp=0, dp=1, pp=1)
    """),
    md("""
    ### Combined groups

    Some collectives span two dims at once. A combined kind such as `cp-dp` is the set of
    ranks that differ only in cp and dp. With context parallelism, each cp rank saw a
    different slice of the sequence, so gradients are averaged over **cp and dp together**
    (Megatron's "data parallel group with context parallel"). `tp-pp` holds every piece of
    one model copy (Megatron's "model parallel group", e.g. for the global gradient norm).
    A layout with cp = 2 shows them:
    """),
    code("""
    layout_cp = ParallelLayout(8, tp=2, cp=2)
    print(layout_cp.describe())
    for kind in ["tp", "cp", "dp", "cp-dp", "tp-cp"]:
        print(f"{kind:6} {layout_cp.groups(kind)}")
    print("tp-pp of the first layout:", layout.groups("tp-pp"))
    print("every kind:", layout.kinds())
    """),
    md("""
    Dims in a kind can be written in any order (`"dp-cp"` is `"cp-dp"`). For ring attention
    each cp rank also needs its neighbours around the ring: `cp_ring(rank)` gives
    (send to, receive from), shown here for a cp group of 4:
    """),
    code("""
    ring = ParallelLayout(8, tp=2, cp=4)
    {r: ring.cp_ring(r) for r in ring.group_of(0, "cp")}
    """),
    md("""
    ## 2. The order string moves ranks

    The sizes say how many groups there are; the order says **which ranks** share one.
    Megatron-LM's default (`tp-cp-ep-dp-pp`, here without ep) makes pp the slowest dim.
    picotron builds its grid as `torch.arange(world).view(dp, pp, cp, tp)`, which is the
    order `tp-cp-pp-dp`: dp is the slowest dim. Same sizes, different neighbours:
    """),
    code("""
    megatron = ParallelLayout(8, tp=2, pp=2)  # order tp-cp-dp-pp, the default
    picotron = ParallelLayout(8, tp=2, pp=2, order="tp-cp-pp-dp")
    for kind in ["tp", "dp", "pp"]:
        print(f"{kind}:  Megatron {megatron.groups(kind)}   picotron {picotron.groups(kind)}")
    print("rank 2 in Megatron's order:", megatron.coords(2))
    print("rank 2 in picotron's order:", picotron.coords(2))
    """),
    md("""
    tp stays put (fastest in both), but dp and pp trade places. Put 4 ranks on each of two
    nodes: with Megatron's order, node 0 holds stage 0 of both model copies, so the gradient
    all-reduce (dp) stays inside a node and the pipeline sends cross nodes. With picotron's
    order, each node holds a whole model copy: pipeline traffic stays inside, the gradient
    all-reduce crosses nodes. Which is better depends on which traffic is heavier on your
    interconnect, and that is a one-word change: `--order tp-cp-pp-dp`.

    ## 3. The rank grid

    `%dist_groups` draws a layout: rows and columns are positions in groups (`tp rank 1`:
    the second rank of every tp group), the colours are the groups of one kind. In a live
    notebook, pick another kind in the
    dropdown or click a rank to outline all its groups. With `--world` it needs no session,
    so it is also a planning tool. Megatron's order, coloured by pp group:
    """),
    code("%dist_groups --world 8 --tp 2 --pp 2 --color-by pp"),
    md("picotron's order: the pp groups are now neighbours within a row."),
    code("%dist_groups --world 8 --tp 2 --pp 2 --order tp-cp-pp-dp --color-by pp"),
    md("""
    With `--ranks-per-host` the grid marks the groups that span hosts: here, with 8 ranks per
    node, every pp group crosses between the two nodes.
    """),
    code("%dist_groups --world 16 --tp 4 --pp 2 --ranks-per-host 8 --color-by pp"),
    md("""
    ## 4. Real groups on 8 ranks

    The same flags start a session. Each rank's namespace gets `layout`, `groups` (this
    rank's process groups) and `mesh`, built once at start. Eight processes take about
    20 seconds on a laptop.
    """),
    code("%dist_start --nprocs 8 --tp 2 --pp 2"),
    md("""
    The value of a cell's last expression is shown per rank, in rank order. `groups.coords`
    is the rank's place in the grid:
    """),
    code("""
    %%dist
    groups.coords
    """),
    md("""
    `print(groups)` lists a rank's groups and how each was made: a member-only `new_group`,
    `shared` when two kinds have the same ranks (cp is 1, so `cp-dp` *is* the dp group), a
    `self group` for kinds of size 1. Here is rank 5:
    """),
    code("""
    %%dist --ranks 5
    print(groups)
    """),
    md("""
    ### Collectives prove the memberships

    A list of ranks is a claim; a collective is proof. `all_gather_object` inside a group
    returns one value from each member, so gathering the global rank returns exactly the
    members, in group order. `groups.get(kind)` is the group of any kind (`groups.tp` is
    short for `groups.get("tp")`):
    """),
    code("""
    %%dist
    def members(group):
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, rank, group=group)
        return out

    {kind: members(groups.get(kind)) for kind in ["tp", "dp", "pp", "tp-pp"]}
    """),
    md("""
    The same with numbers: an `all_reduce` over `groups.dp` sums the ranks of one dp group
    only. `--collapse` prints identical lines once, labeled with every rank that printed
    them, so each dp group shows up as one line:
    """),
    code("""
    %%dist --collapse
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=groups.dp)
    print(f"dp group {groups.ranks_in('dp')} sums to {x.item():.0f}")
    """),
    md("""
    ### Pipeline neighbours, and `--where`

    A pipeline hands activations from stage to stage with point-to-point `send`/`recv`;
    `groups.pp_prev` and `groups.pp_next` are the global ranks of this rank's neighbouring
    stages (None at the ends). Every stage but the first receives, every stage but the last
    sends:
    """),
    code("""
    %%dist
    activation = torch.full((2,), float(rank)) if groups.is_first_stage else torch.empty(2)
    if not groups.is_first_stage:
        dist.recv(activation, src=groups.pp_prev)
    if not groups.is_last_stage:
        dist.send(activation, dst=groups.pp_next)
    """),
    md("""
    `%%dist --where pp=1` runs a cell on the ranks at those coordinates (the last stage here)
    instead of naming rank numbers, so it keeps working when the layout changes. Combine
    coordinates with commas: `--where pp=1,tp=0`.
    """),
    code("""
    %%dist --where pp=1
    print(f"stage {groups.pp_rank} received {activation.tolist()} from rank {groups.pp_prev}")
    """),
    md("""
    ### Groups of any ranks

    `groups.get_group(ranks)` makes a group of any ranks, for the experiment the layout did
    not foresee. Like `torch.distributed.new_group`, every rank must call it (run it with
    plain `%%dist`); non-members get `None`. A rank set that already exists is reused, not
    created again.
    """),
    code("""
    %%dist --collapse
    pg = groups.get_group([0, 3, 5])
    if pg is not None:
        out = [None] * 3
        dist.all_gather_object(out, rank, group=pg)
        print("ad-hoc group", out)
    """),
    md("""
    ## 5. The DeviceMesh

    `mesh` is a torch `DeviceMesh` over the four dims, slowest first (pp, dp, cp, tp),
    assembled from the very same groups, so `mesh["tp"]` and `groups.tp` are one
    communicator, not two. Sub-meshes by name are what torch's DTensor, FSDP2 and
    tensor-parallel APIs take (notebook 06 uses `mesh["tp"]`).
    """),
    code("""
    %%dist --ranks 5
    print(mesh)
    print("tp sub-mesh:", mesh["tp"])
    print("its group is groups.tp:", mesh["tp"].get_group() is groups.tp)
    print("coordinates:", {d: mesh.get_local_rank(d) for d in mesh.mesh_dim_names})
    """),
    md("""
    A DTensor sharded over `mesh["dp", "tp"]`: a 2 x 4 matrix split by rows over dp and by
    columns over tp, so each rank holds one 1 x 2 block, and the two pp stages hold the same
    blocks:
    """),
    code("""
    %%dist
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(8.0).reshape(2, 4)
    block = distribute_tensor(full, mesh["dp", "tp"], [Shard(0), Shard(1)])
    block.to_local()
    """),
    code("%dist_stop"),
    md("""
    ## 6. The same code as a torchrun script

    Nothing above is notebook-only. `init_parallel_groups()` is what each rank ran at
    `%dist_start`; in a script it reads the layout from the environment (`TP_SIZE`,
    `CP_SIZE`, `PP_SIZE`, `DP_SIZE`, `PARALLEL_ORDER`) next to the `RANK` and `WORLD_SIZE`
    that torchrun sets. The script repeats the membership proof and prints one report from
    rank 0:
    """),
    code("""
    import sys
    from pathlib import Path

    from IPython.display import Code

    script = Path("examples/parallel_groups_torchrun.py")
    if not script.exists():  # Jupyter started inside notebooks/
        script = ".." / script
    Code(filename=str(script), language="python")
    """),
    md("""
    `python -m torch.distributed.run` is `torchrun`. `--standalone` runs the rendezvous on
    this machine; `GLOO_SOCKET_IFNAME=lo` keeps gloo on loopback. The groups match the
    session's exactly:
    """),
    code("""
    !TP_SIZE=2 PP_SIZE=2 OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo {sys.executable} -m torch.distributed.run --standalone --nproc_per_node 8 {script}
    assert _exit_code == 0, "torchrun failed: see its output above"
    """),
    md("""
    ## Recap

    - `ParallelLayout(world, tp=, cp=, pp=, order=)` is the whole numbering: `groups(kind)`,
      `coords(rank)`, `rank_of(...)`, `ranks_where(...)`, for any single or combined kind.
    - The order string (fastest first) decides which ranks are neighbours: Megatron's
      `tp-cp-dp-pp` against picotron's `tp-cp-pp-dp`. `%dist_groups` draws either.
    - `%dist_start --tp 2 --pp 2` builds every group on every rank: `groups.tp`,
      `groups.get("cp-dp")`, `groups.pp_next`, `groups.get_group([...])`, and `mesh`.
    - `%%dist --where pp=1` runs a cell by coordinates; `--collapse` merges identical output.
    - `init_parallel_groups()` does the same under torchrun.

    Next: notebook 04 shows the store underneath every process group, and notebook 06 splits
    an MLP over `groups.tp` by hand and with torch's tensor-parallel API on `mesh["tp"]`.
    """),
]

if __name__ == "__main__":
    print(save(NAME, CELLS))
