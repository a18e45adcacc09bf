"""Source of notebooks/03_collective_bandwidth.ipynb (run build.py to regenerate it)."""

from _nb import code, md

NAME = "03_collective_bandwidth"

CELLS = [
    md("""
    # Collective bandwidth: algbw, busbw and what the curves say

    Is this machine's interconnect as fast as it should be? Is the tp group really on
    NVLink? Is one link slow? `%dist_bench` answers with the numbers
    [nccl-tests](https://github.com/NVIDIA/nccl-tests) prints, the ones every GPU cluster
    is compared by, measured **per parallel group** of your layout, inside the session you
    work in. This notebook explains the two bandwidths (algbw and busbw), sweeps message
    sizes for each group kind, plots them, draws the rank-to-rank heatmap, and ends with how
    to read the numbers on a CPU laptop and on a GPU node. About ten minutes, on 4 CPU ranks
    (gloo); on GPUs start with `%dist_start --gpus 8 --tp 2` and nothing else changes.
    """),
    code("%load_ext infini_notebook"),
    md("""
    ## 1. Counting bytes the way nccl-tests does

    For each message size, every rank runs the collective a few times to warm up, then
    `--iters` times under a timer; the time is the mean per iteration, averaged over the
    ranks of the group. Two bandwidths come from it, in GB/s with 1 GB = 10⁹ bytes (sizes
    like `4K` or `1M` are powers of 1024, as in nccl-tests):

    - **size**: the bytes one rank sends or receives, whichever is larger. For all_reduce
      it is the buffer; for all_gather it is the *gathered* buffer (n blocks), for
      reduce_scatter the input (n blocks), rounded so each block is a multiple of 16 bytes.
    - **algbw** = size / time: the speed the *user* sees (how fast a buffer of this size
      gets reduced, gathered ...).
    - **busbw** = algbw × a factor that depends on the collective and the group size n:

    | collective | busbw / algbw | why |
    |---|---|---|
    | all_reduce | 2(n-1)/n | a reduce-scatter then an all-gather: 2(n-1)/n of the buffer per rank |
    | all_gather, reduce_scatter, all_to_all | (n-1)/n | the n-1 blocks that are not its own |
    | broadcast, reduce, send_recv | 1 | the buffer crosses each link once |

    **Why busbw exists.** algbw of an all-reduce *falls* as the group grows, even on perfect
    hardware, because each byte of the result costs more traffic when there are more ranks.
    busbw multiplies that traffic back in, so it measures the speed of the **links**. On
    a well-run system it approaches the link's hardware bandwidth (NVLink, InfiniBand) and
    stays there whatever n is, which makes 2 ranks comparable with 8, all_reduce with
    all_gather, and your cluster with a spec sheet. The factors come from `bench`, the
    module behind `%dist_bench`:
    """),
    code("""
    from infini_notebook.kernel import bench

    sizes = (2, 4, 8, 64)
    print(f"{'busbw/algbw':<15}" + "".join(f"{'n=' + str(n):>8}" for n in sizes))
    for coll in bench.COLLECTIVES:
        print(f"{coll:<15}" + "".join(f"{bench.bus_factor(coll, n):>8.3f}" for n in sizes))
    """),
    md("""
    A worked example: an 8-rank all_reduce of 256 MiB that takes 1.2 ms per iteration.
    algbw is what you would compute by hand; busbw is what nccl-tests would print, and the
    number to hold against the hardware: NVLink 4 carries 450 GB/s each way per H100.
    """),
    code("""
    size = 256 * 2**20
    algbw, busbw = bench.bandwidths("all_reduce", size, 1.2e-3, n=8)
    print(f"algbw {algbw:.0f} GB/s, busbw {busbw:.0f} GB/s (x{bench.bus_factor('all_reduce', 8)})")

    # split collectives round the size so that each rank's block is a multiple of 16 bytes
    count, nbytes = bench.count_and_bytes("all_gather", 1000, 4, 3)  # 1000 B of float32, 3 ranks
    print(f"all_gather, 1000 B asked on 3 ranks: {count} elements per rank, size {nbytes} B")
    """),
    md("""
    ## 2. A sweep per group kind

    Four CPU ranks with tp = 2: the tp groups are ranks [0, 1] and [2, 3], the dp groups
    [0, 2] and [1, 3] (see the parallel-groups tutorial). On a GPU node the layout puts tp
    on neighbouring GPUs, because tp all-reduces inside every layer and needs the fastest
    links.
    """),
    code("%dist_start --nprocs 4 --tp 2"),
    md("""
    `%dist_bench all_reduce --group world tp dp` runs the all_reduce for each size on each
    group kind. All groups of one kind run **at the same time** (both tp pairs at once), as
    they would in training, so a shared link shows up as a slower group. The output is
    nccl-tests' table, one block per (collective, group kind) with one row per group, then a
    figure: busbw against size, one line per kind, the band spanning the groups of a kind
    when they differ. `df = %dist_bench ...` keeps the rows as a pandas DataFrame.

    Sizes stay small here (`--sizes 4K:16M`, doubling each step) so the sweep takes seconds
    on CPU; on GPUs use the default, 4K:1G, because busbw there only levels off at tens to
    hundreds of megabytes.
    """),
    code("df = %dist_bench all_reduce --group world tp dp --sizes 4K:16M"),
    md("""
    Reading it:

    - **Small messages are slow.** Every collective pays a fixed cost (here: Python, gloo's
      bookkeeping, loopback TCP round trips and four ranks taking turns on the cores; on
      GPUs: a kernel launch and a few µs of link latency). Up to about a megabyte the time
      column barely moves, so bandwidth grows in proportion to size: the left part of the
      curve measures latency, not links.
    - **Large messages show the links.** From a few megabytes on, time grows with size and
      busbw levels off. That plateau is the number to compare; here it is the speed at which
      this machine copies bytes through loopback sockets.
    - **world against tp and dp.** busbw corrects for the bytes a bigger group moves, not for
      its extra steps: a ring over 4 ranks takes 2(n-1) = 6 steps where a pair takes 2, and
      each step pays the fixed cost. So at small sizes world trails the pairs; at large sizes,
      where bytes dominate, the lines should come together.
    - **tp against dp.** Both are pairs, and on CPU ranks every pair talks through the same
      loopback, so they differ only by noise. On a GPU node this is where layout shows: tp on
      NVLink neighbours, dp possibly across nodes.
    - **The bands.** Two groups of a kind run at once and share the machine (two cores for
      four ranks here), as they would share a PCIe switch or a NIC; the band is their
      spread.

    ## 3. The rows as a DataFrame

    Every row is one group at one size, with nccl-tests' columns. `time_us` is the mean
    per iteration; `ranks` are the group's members:
    """),
    code("df.head()"),
    md("""
    The bandwidths are no more than the formulas of section 1 applied to `size_bytes` and
    `time_us`; the first row, recomputed by hand:
    """),
    code("""
    row = df.iloc[0]
    algbw = row.size_bytes / (row.time_us * 1e-6) / 1e9
    n = row.group_size
    print(f"{row.collective} on {row.ranks}: {row.size_bytes} B in {row.time_us:.1f} us")
    print(f"algbw {algbw:.4f} GB/s (table {row.algbw_gbps:.4f}), "
          f"busbw {algbw * 2 * (n - 1) / n:.4f} GB/s (table {row.busbw_gbps:.4f})")
    """),
    md("""
    Ordinary pandas answers the usual questions. busbw per group kind (columns) and size
    (rows), averaged over the groups of a kind:
    """),
    code("""
    table = df.groupby(["size_bytes", "group"]).busbw_gbps.mean().unstack("group")
    table.round(3)
    """),
    md("""
    And the one that matters most: are the groups of a kind alike? A group much slower
    than its siblings is a bad link or a busy rank. The spread at the largest size:
    """),
    code("""
    largest = df[df.size_bytes == df.size_bytes.max()]
    largest.groupby("group").busbw_gbps.agg(["min", "max", "mean"]).round(3)
    """),
    md("""
    ## 4. Every collective

    `all` sweeps the seven collectives of nccl-tests. `--factor 4` steps the size by 4
    instead of 2, for a quicker look. The figure gets one panel per collective.
    """),
    code("df_all = %dist_bench all --sizes 16K:1M --factor 4"),
    md("""
    At the largest size, algbw and busbw side by side. algbw mixes two things: how fast the
    links are and how much traffic the collective needs per byte of result (an all_reduce
    moves about twice what an all_gather does). busbw takes the second out, so on hardware
    where bandwidth is the limit, all collectives land near the same busbw. (At 1 MB on
    CPU the fixed costs still dominate, so expect them to scatter.)
    """),
    code("""
    top = df_all[df_all.size_bytes == df_all.size_bytes.max()]
    top[["collective", "group_size", "size_bytes", "time_us", "algbw_gbps", "busbw_gbps"]].round(3)
    """),
    md("""
    ## 5. Checking the results: `--check`

    A fast collective that computes the wrong sum is worse than a slow one. `--check` fills
    each rank's input with a known pattern after the timing, runs the collective once more
    and counts the output elements that differ from the expected result, in a `#wrong`
    column (nccl-tests' `-c`). Anything but 0 points at a broken link, driver or library.

    `--group chunks:N` makes groups of N consecutive ranks without any layout (the last
    chunk may be shorter), like the per-node tests of InternLM's nettest: `chunks:8` on a
    multi-node job tests each node of 8 GPUs on its own. (With 4 ranks, `chunks:2` happens to
    give the tp pairs.)
    """),
    code(
        "checked = %dist_bench all_reduce all_gather reduce_scatter --group chunks:2 "
        "--sizes 256K --check"
    ),
    md("""
    ## 6. Rank to rank: `%dist_bench p2p`

    Collectives mix all links; one slow link hides among them. `%dist_bench p2p` sends a
    buffer from each rank to every other rank, **one pair at a time**, and shows a
    sender × receiver matrix of GB/s. A slow link is one dark cell; a slow rank a dark row
    and column; on a multi-node job, the blocks along the diagonal are the nodes.
    """),
    code("p2p = %dist_bench p2p --sizes 1M"),
    md("""
    Before blaming a link, measure again. `bench.run_p2p` is the function behind the magic;
    dividing a second run by the first shows how much each cell moves on its own:
    """),
    code("""
    again = bench.run_p2p(dist_session, "1M", progress=False)
    (again / p2p).round(1)
    """),
    md("""
    On four CPU ranks sharing two cores the cells move by factors of several between runs:
    a dark cell here is the operating system's scheduler, not a link, and the next run puts
    it elsewhere. A real slow link is dark in every run, in the same place. On GPUs the
    runs agree within a few percent and one dark cell is worth a look (`nvidia-smi topo -m`
    shows how the two GPUs are connected).
    """),
    md("""
    ## 7. The interactive view

    `viz.bench_view` puts benchmark rows in one widget: pick the collective, the group kind,
    and busbw or algbw, and the figure redraws; the p2p heatmap sits below. It takes any
    DataFrame of `%dist_bench` (join several with `pd.concat`). A static render, such as
    this page on GitHub, shows the figures and a table of each curve's best busbw instead.
    """),
    code("""
    from infini_notebook import viz

    viz.bench_view(df, p2p=p2p)
    """),
    md("""
    ## 8. Reading the numbers

    **On CPU ranks (this notebook)**, gloo sends every byte through loopback TCP sockets:
    memory copies in and out of the operating system's buffers, no network at all, with
    all ranks sharing a few cores. Expect a few GB/s at most, latencies of tens to hundreds
    of µs, and noise of tens of percent from run to run. The CPU numbers test the tool and
    teach the method, they say nothing about a GPU cluster; don't compare them with one.

    **On a GPU node** (`--gpus 8`, NCCL, timed with CUDA events) the same commands measure
    the hardware. Rough figures for large messages (≥ 256 MB; nccl-tests' all_reduce busbw,
    your system will differ):

    | where the group lives | expect busbw of roughly |
    |---|---|
    | H100 SXM, NVLink 4 / NVSwitch, inside a node | 350-480 GB/s |
    | A100 SXM, NVLink 3, inside a node | 200-240 GB/s |
    | GPUs on PCIe without NVLink | 10-25 GB/s |
    | across nodes, one 400 Gb/s InfiniBand NIC per GPU | 40-48 GB/s |
    | across nodes, one 200 Gb/s NIC per GPU | 20-24 GB/s |

    How to use them:

    - Look at the **flat right end** of each curve; the left end is latency (a few µs for
      NVLink, more across nodes).
    - A **tp group** should reach the NVLink row. If it looks like the PCIe or the
      InfiniBand row, tp spans nodes or the GPUs lack NVLink: fix `--order`, or the
      placement of ranks on nodes.
    - **dp and pp groups** often cross nodes; their ceiling is the network row, and that
      is why the default order keeps tp fastest and pp slowest.
    - Groups of one kind should agree within a few percent; the `min`/`max` spread of
      section 3 and the p2p heatmap find the odd one out.
    - A `#wrong` other than 0 is never noise.
    """),
    code("%dist_stop"),
    md("""
    ## Summary

    - **algbw** = size / time, what a user of the collective sees. **busbw** = algbw ×
      2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter, all_to_all) or 1
      (broadcast, reduce, send_recv): the link speed, comparable across group sizes and
      with the hardware's peak.
    - `%dist_bench COLLECTIVE ... --group world tp dp ... --sizes MIN:MAX` sweeps per group
      kind, all groups of a kind at once; `all` for every collective; `chunks:N` for runs
      of N consecutive ranks; `--check` counts wrong elements; `df = %dist_bench ...` keeps
      the DataFrame.
    - `%dist_bench p2p` finds the one slow link; `viz.bench_view(df, p2p=...)` browses it
      all.
    - Read the flat right end of each curve; on CPU the numbers teach the method, on GPUs
      they measure NVLink and the network.
    """),
]
