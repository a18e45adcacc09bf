"""Source of notebooks/01_quickstart.ipynb (run build.py to regenerate it)."""

from _nb import code, md

NAME = "01_quickstart"

CELLS = [
    md("""
    # Quickstart: a distributed PyTorch session in a notebook

    `infini_notebook` starts one process per rank (an ipyparallel engine), initialises
    `torch.distributed` on every one of them, and lets you run notebook cells on all ranks at
    once with each rank's output labeled. This notebook takes about ten minutes and runs on
    CPU ranks (gloo); on a GPU machine change one line: `%dist_start --gpus 8`.
    """),
    code("%load_ext infini_notebook"),
    md("""
    ## Start four ranks

    `--nprocs 4` starts four CPU ranks on the gloo backend. Each rank's namespace now holds
    `torch`, `dist` (`torch.distributed`), `rank`, `world_size`, `local_rank`, `device`, and
    the parallel `groups` and `mesh` (see the next tutorial). `%dist_start?` lists every flag.
    """),
    code("%dist_start --nprocs 4"),
    md("""
    ## Run a cell on every rank

    `%%dist` runs the cell on all ranks at the same time. Every line a rank prints comes
    back labeled with its rank.
    """),
    code("""
    %%dist
    print(f"hello from rank {rank} of {world_size} on {device}")
    """),
    md("""
    ## A collective

    Each rank fills a tensor with `rank + 1`; `all_reduce` sums them, so every rank ends
    with 1 + 2 + 3 + 4 = 10. The variables stay on the ranks for later cells.
    """),
    code("""
    %%dist
    x = torch.ones(4) * (rank + 1)
    dist.all_reduce(x)
    print("sum", x[0].item())
    """),
    md("""
    ## Only some ranks

    `--ranks` takes `0`, `0,2`, `1-3` or `all`. Collectives need every member of their
    group, so keep subset cells to local work (or to groups made of those ranks).
    """),
    code("""
    %%dist --ranks 0,2
    print("x is still here:", x.tolist())
    """),
    md("The value of a cell's last expression is shown per rank, as in a normal cell:"),
    code("""
    %%dist
    {"rank": rank, "norm": x.norm().item()}
    """),
    md("When ranks print the same thing, `--collapse` shows it once with all its ranks:"),
    code("""
    %%dist --collapse
    print("same everywhere:", x.sum().item())
    """),
    md("""
    ## When a rank fails

    An exception on any rank fails the cell (so *Run All* stops there) and shows that rank's
    traceback, labeled. The session stays usable: the next cell runs normally. (This cell is
    tagged `raises-exception` so that the notebook still runs top to bottom.)
    """),
    code(
        """
        %%dist
        if rank == 1:
            raise ValueError("something went wrong on rank 1 only")
        print("rank", rank, "is fine")
        """,
        "raises-exception",
    ),
    code("""
    %%dist
    print("still working on rank", rank)
    """),
    md("""
    ## Move data between the notebook and the ranks

    `%dist_pull NAME` brings a variable back as `{rank: value}` (tensors arrive on the CPU),
    ready to plot. `%dist_push NAME` sends a notebook variable to every rank.
    """),
    code("""
    %%dist
    local = torch.arange(5.0) * (rank + 1)
    """),
    code("""
    %dist_pull local
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    for r, values in local.items():
        ax.plot(values.numpy(), marker="o", label=f"rank {r}")
    ax.set_xlabel("index")
    ax.set_ylabel("value")
    ax.legend()
    plt.show()
    """),
    code("""
    scale = 0.5
    %dist_push scale
    """),
    code("""
    %%dist
    print(local * scale)
    """),
    md("""
    ## Auto mode

    Typing `%%dist` on top of every cell gets old. `%dist_auto on` makes every plain cell run
    on all ranks as a `%%dist` cell (like ipyparallel's `%autopx`); each such cell's output
    starts with `%%dist (auto)`, so you always see where it ran. Cells that start with a
    magic (`%dist_status`, `%dist_auto off`) still run here in the notebook, and stopping
    the session turns auto mode off by itself.
    """),
    code("%dist_auto on"),
    code("""
    print(f"rank {rank}: x = {x.tolist()}")
    """),
    code("%dist_auto off"),
    md("""
    ## Status and stop

    `%dist_status` shows a tile per rank: its process, device, coordinates in the layout and
    state (idle, busy, error, dead), and what the rank uses now (RSS and CPU % on a CPU rank;
    GPU memory used of total and utilization on a GPU rank), updated live while cells run.
    `%dist_stop` ends every process the session started (kernel shutdown and restart do too,
    even a killed kernel). Next: `02_parallel_groups` for tp, pp, dp and the rank grid.
    """),
    code("%dist_status"),
    code("""
    for r in dist_session.status():  # the same numbers as values: bytes, percent of a core
        print(f"rank {r.rank}: {r.state}, RSS {r.rss / 2**20:.0f} MiB, CPU {r.cpu_percent:.0f}%")
    """),
    code("%dist_stop"),
]
