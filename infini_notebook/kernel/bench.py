"""Collective bandwidth per parallel group, with nccl-tests' semantics: the kernel side.

    df = bench.run_bench(session, ["all_reduce", "all_gather"], groups=["world", "tp"],
                         sizes="4K:1G")

Three layers, as the rest of the package:

- pure, in ``busbw``: size parsing, nccl-tests' byte counting and bus bandwidth factors,
  per-rank replies -> rows, the text table (re-exported here);
- engine side, in ``engine/bench_kernels.py``: ``engine_step`` and ``engine_p2p``, called by
  the kernel through ``Session.apply``;
- kernel side, here: the group partitions of a kind, ``run_bench`` / ``run_p2p`` loop over
  steps (one apply each, so an interrupt stops between steps) and return pandas DataFrames.

Figures of the results (``plot_busbw``, ``p2p_heatmap``) are in ``viz``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from ..core.busbw import (
    COLLECTIVES,
    COLUMNS,
    DTYPE_ALIASES,
    DTYPES,
    GB,
    SPLIT,
    aggregate,
    bandwidths,
    bus_factor,
    check_collectives,
    count_and_bytes,
    format_table,
    p2p_by_locality,
    p2p_frame,
    p2p_summary,
    parse_size,
    parse_sizes,
    resolve_dtype,
    to_frame,
)
from ..core.errors import DistUsageError
from ..core.ranks import format_ranks
from ..engine.bench_kernels import engine_p2p, engine_step

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "COLLECTIVES", "COLUMNS", "DTYPE_ALIASES", "DTYPES", "GB", "SPLIT", "aggregate",
    "bandwidths", "bus_factor", "check_collectives", "count_and_bytes", "engine_p2p",
    "engine_step", "format_table", "group_partition", "make_step", "normalize_group_kind",
    "p2p_by_locality", "p2p_frame", "p2p_report", "p2p_summary", "parse_size", "parse_sizes",
    "resolve_dtype", "run_bench", "run_p2p", "to_frame",
]  # fmt: skip


def normalize_group_kind(layout, kind: str) -> str:
    """``world``, ``chunks:N`` or a kind of ``layout`` in its canonical spelling (dp-cp ->
    cp-dp)."""
    kind = str(kind).strip()
    if kind == "world":
        return kind
    if kind.startswith("chunks:"):
        n = kind.partition(":")[2]
        if not n.isdigit() or int(n) < 1:
            raise DistUsageError(f"Bad group {kind!r}: write chunks:N with N >= 1, like chunks:8.")
        return f"chunks:{int(n)}"
    try:
        return layout.kind_label(kind)  # all four dims: "world"
    except ValueError:
        kinds = ", ".join(dict.fromkeys(map(layout.kind_label, layout.kinds())))
        raise DistUsageError(
            f"Unknown group kind {kind!r}. Use world, chunks:N (runs of N consecutive ranks) or "
            f"a kind of the layout ({layout.describe()}): {kinds}. "
            "Collectives go before --group: %dist_bench all_reduce --group tp dp"
        ) from None


def group_partition(layout, kind: str) -> list[list[int]]:
    """Every group of ``kind`` (normalized): they cover all ranks and run at once."""
    world = layout.world_size
    if kind == "world":
        return [list(range(world))]
    if kind.startswith("chunks:"):  # InternLM's nettest groups; the last may be shorter
        n = int(kind.partition(":")[2])
        return [list(range(s, min(s + n, world))) for s in range(0, world, n)]
    return [list(g) for g in layout.groups(kind)]


def make_step(
    collective: str,
    kind: str,
    partition: list[list[int]],
    size: int,
    *,
    dtype: str = "float32",
    iters: int = 20,
    warmup: int = 5,
    check: bool = False,
) -> dict:
    """What ``engine_step`` runs: plain data, pickled to every rank."""
    return {
        "collective": collective,
        "kind": kind,
        "partition": partition,
        "size": size,
        "dtype": dtype,
        "iters": iters,
        "warmup": warmup,
        "check": check,
    }


def run_bench(
    session,
    collectives: Iterable[str] | str | None = None,
    groups: Iterable[str] | str | None = None,
    sizes: str | Sequence[int | str] | None = None,
    *,
    factor: float = 2.0,
    iters: int = 20,
    warmup: int = 5,
    dtype: str = "float32",
    check: bool = False,
    progress: Callable[[int, int, str], None] | None = None,
) -> pd.DataFrame:
    """Sweep ``collectives`` x group kinds x sizes on every rank of ``session``.

    collectives: names from COLLECTIVES or "all" (default all_reduce); groups: "world"
    (default), kinds of the session's layout ("tp", "cp-dp" ...) or "chunks:N"; sizes:
    "MIN:MAX" stepping by ``factor`` (default 4K:1G on GPUs, 1K:1M on CPU). Returns one row
    per (collective, group, size) with nccl-tests' size, count, time, algbw and busbw.
    ``check`` adds a ``wrong`` column: output elements that differ from the expectation.
    ``progress(done, total, what)`` is told after every step (viz.Progress draws it).
    """
    collectives = check_collectives([collectives] if isinstance(collectives, str) else collectives)
    session.require_whole()
    layout = session.layout
    kinds = [normalize_group_kind(layout, k) for k in _as_list(groups, "world")]
    _check_counts(iters, warmup)
    dtype = resolve_dtype(dtype)
    size_list = parse_sizes(sizes or _default_sizes(session), factor)
    steps = [
        make_step(coll, kind, group_partition(layout, kind), size, dtype=dtype, iters=iters,
                  warmup=warmup, check=check)
        for kind in dict.fromkeys(kinds) for coll in collectives for size in size_list
    ]  # fmt: skip
    rows, timers = [], set()
    for i, step in enumerate(steps):
        if progress:
            progress(i, len(steps), f"{step['collective']} {step['kind']} {step['size']} B")
        replies = session.apply(engine_step, step)
        timers.update(r["timer"] for r in replies.values() if r)
        rows += aggregate(step, replies)
    if progress:
        progress(len(steps), len(steps), "steps done")
    return to_frame(
        rows, check, iters=iters, warmup=warmup, timer="/".join(sorted(timers)),
        backend=session.plan.backend, caveat=shared_gpu_caveat(session.plan),
    )  # fmt: skip


def run_p2p(
    session,
    size: str | int | None = None,
    *,
    iters: int = 20,
    warmup: int = 5,
    dtype: str = "float32",
    progress: Callable[[int, int, str], None] | None = None,
) -> pd.DataFrame:
    """Send bandwidth (GB/s) for every ordered pair of ranks: a src x dst DataFrame, NaN on
    the diagonal. Pairs run one at a time, so each measures its link alone."""
    session.require_whole()
    _check_counts(iters, warmup)
    dtype = resolve_dtype(dtype)
    nbytes = parse_sizes(size or _default_p2p_size(session))[-1]
    nbytes -= nbytes % DTYPES[dtype]
    if nbytes == 0:
        raise DistUsageError(f"p2p size {size!r} is below one {dtype} element.")
    if session.world_size < 2:
        raise DistUsageError("p2p needs at least 2 ranks: start the session with more.")
    times: dict[tuple[int, int], list[float]] = {}
    spec = {"size": nbytes, "iters": iters, "warmup": warmup, "dtype": dtype}
    for src in range(session.world_size):
        if progress:
            progress(src, session.world_size, f"sending from rank {src}")
        for got in session.apply(engine_p2p, dict(spec, src=src)).values():
            for peer, seconds in got.items():
                times.setdefault((src, peer), []).append(seconds)
    if progress:
        progress(session.world_size, session.world_size, "pairs done")
    df = p2p_frame(times, session.world_size, nbytes)
    df.attrs.update(
        iters=iters, warmup=warmup, dtype=dtype, backend=session.plan.backend,
        caveat=shared_gpu_caveat(session.plan),
    )  # fmt: skip
    return df


def shared_gpu_caveat(plan) -> str:
    """Ranks sharing a GPU time-slice it and talk over loopback sockets: their figures say
    nothing about the hardware. Labeled, not refused: the sweep still checks correctness
    (--check) and shows which links work."""
    shared = plan.shared_gpus
    if not shared:
        return ""
    gpus = ", ".join(f"GPU {gpu} (ranks {format_ranks(list(rs))})" for gpu, rs in shared.items())
    return f"ranks share {gpus}: not the hardware's bandwidth, a correctness check"


def p2p_report(session, matrix: pd.DataFrame) -> tuple[str, list[str]]:
    """What ``%dist_bench p2p`` prints for ``run_p2p``'s matrix, and each rank's host (the
    heatmap fences hosts with them)."""
    hosts = [rs.host for rs in session.status()]
    return p2p_summary(matrix, hosts), hosts


def _as_list(value, default: str) -> list[str]:
    if value is None:
        return [default]
    return [value] if isinstance(value, str) else list(value) or [default]


def _check_counts(iters: int, warmup: int) -> None:
    if iters < 1 or warmup < 0:
        raise DistUsageError(f"--iters {iters} / --warmup {warmup}: need iters >= 1, warmup >= 0.")


def _default_sizes(session) -> str:
    return "4K:1G" if session.plan.backend == "nccl" else "1K:1M"


def _default_p2p_size(session) -> str:
    return "64M" if session.plan.backend == "nccl" else "1M"
