"""Collective bandwidth per parallel group, with nccl-tests' semantics.

    df = bench.run_bench(session, ["all_reduce", "all_gather"], groups=["world", "tp"],
                         sizes="4K:1G")

Three layers, as the rest of the package:

- pure (no torch, no pandas at import): size parsing, nccl-tests' byte counting and bus
  bandwidth factors, the group partitions of a kind, per-rank replies -> rows, the text table;
- engine side: ``engine_step`` (one collective at one size on every rank, every group of the
  kind at once) and ``engine_p2p`` (send/recv from one rank to each other rank), called by
  the kernel through ``Session.apply``;
- kernel side: ``run_bench`` / ``run_p2p`` loop over steps (one apply each, so an interrupt
  stops between steps) and return pandas DataFrames.

Figures of the results (``plot_busbw``, ``p2p_heatmap``) are in ``viz``.

nccl-tests conventions, from its ``*GetCollByteCount`` / ``*GetBw`` functions:
``size`` is max(send, receive) bytes of one rank; ``count`` is the elements argument of the
collective; for all_gather, reduce_scatter and all_to_all the per-rank count is the requested
count / n, rounded down to 16 bytes; time is the mean per iteration after warm-up, averaged
over the group's ranks; algbw = size / time (1 GB = 1e9 B); busbw = algbw x factor.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from .errors import DistUsageError
from .ranks import format_ranks

if TYPE_CHECKING:
    import pandas as pd

COLLECTIVES: tuple[str, ...] = (
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
    "send_recv",
)  # fmt: skip
# Collectives that split the buffer in n equal blocks (nccl-tests' per-rank count).
SPLIT = frozenset({"all_gather", "reduce_scatter", "all_to_all"})
COLUMNS: tuple[str, ...] = (
    "collective", "group", "ranks", "group_size", "size_bytes", "count", "dtype", "time_us",
    "algbw_gbps", "busbw_gbps",
)  # fmt: skip
# canonical torch name -> element size; aliases include nccl-tests' type names
DTYPES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "int8": 1, "uint8": 1, "int32": 4, "int64": 8,
}  # fmt: skip
DTYPE_ALIASES: dict[str, str] = {
    "float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16",
    "bf16": "bfloat16", "double": "float64", "fp64": "float64", "int": "int32",
    "long": "int64", "char": "int8",
}  # fmt: skip
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}  # nccl-tests: K = 1024
GB = 1e9


# --------------------------------------------------------------------------- pure part


def parse_size(text: str | int) -> int:
    """``"4K"`` -> 4096, ``"1G"`` -> 2**30, ``"512"`` -> 512 (K, M, G are powers of 1024)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)(?:i?[bB])?\s*", str(text))
        if m is None:
            raise DistUsageError(
                f"Bad size {text!r}: use bytes with an optional K, M or G suffix, like 4K or 1G."
            )
        value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value < 1:
        raise DistUsageError(f"Size {text!r} is below one byte: use sizes like 1K or 4M.")
    return value


def parse_sizes(text: str | int | Sequence[int | str], factor: float = 2.0) -> list[int]:
    """``"4K:1G"`` -> [4096, 8192, ..., 2**30], each ``factor`` times the previous (as
    nccl-tests' -b/-e/-f); ``"1M"`` -> [1048576]; a list is taken as the sizes themselves."""
    if isinstance(text, (list, tuple)):
        return sorted({parse_size(s) for s in text})
    lo_text, sep, hi_text = str(text).partition(":")
    lo = parse_size(lo_text)
    hi = parse_size(hi_text) if sep else lo
    if hi < lo:
        raise DistUsageError(f"Sizes {text!r} go down: write MIN:MAX with MIN <= MAX, like 4K:1G.")
    if not factor > 1:
        raise DistUsageError(f"--factor {factor} must be above 1 (2 doubles the size each step).")
    sizes = [lo]
    while True:
        nxt = max(sizes[-1] + 1, int(sizes[-1] * factor))  # always move, even for factor ~1
        if nxt > hi:
            return sizes
        sizes.append(nxt)


def resolve_dtype(name: str) -> str:
    """Canonical torch dtype name for ``name`` (``float``, ``bf16``, ``half`` ...)."""
    key = str(name).lower().removeprefix("torch.")
    key = DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise DistUsageError(
            f"Unknown dtype {name!r}: use one of {', '.join(DTYPES)} (or float, half, bf16)."
        )
    return key


def count_and_bytes(collective: str, size_bytes: int, itemsize: int, n: int) -> tuple[int, int]:
    """nccl-tests' (count, size) for a requested size on a group of ``n`` ranks.

    count: the collective's element count (per rank, per block for the split collectives);
    size: max(send, receive) bytes of one rank, the number the table and algbw use."""
    count = size_bytes // itemsize
    if collective in SPLIT:
        align = max(1, 16 // itemsize)  # nccl-tests rounds each rank's block down to 16 bytes
        per_rank = (count // n) // align * align
        return per_rank, per_rank * n * itemsize
    return count, count * itemsize


def bus_factor(collective: str, n: int) -> float:
    """busbw / algbw (nccl-tests' PERFORMANCE.md): the fraction of the data each link
    carries, so busbw compares with the hardware's peak whatever the group size."""
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in SPLIT:
        return (n - 1) / n
    if collective in ("broadcast", "reduce", "send_recv"):
        return 1.0
    raise DistUsageError(f"Unknown collective {collective!r}: use {', '.join(COLLECTIVES)}.")


def bandwidths(collective: str, size_bytes: int, time_s: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1 GB = 1e9 bytes) for ``size_bytes`` moved in ``time_s``."""
    algbw = size_bytes / GB / time_s if time_s > 0 else math.inf
    return algbw, algbw * bus_factor(collective, n)


def check_collectives(names: Iterable[str] | None) -> list[str]:
    names = list(names or ["all_reduce"])
    if names == ["all"]:
        return list(COLLECTIVES)
    bad = [c for c in names if c not in COLLECTIVES]
    if bad:
        hint = " (p2p is a mode of its own: %dist_bench p2p)" if "p2p" in bad else ""
        raise DistUsageError(
            f"Unknown collective {bad[0]!r}: use {', '.join(COLLECTIVES)} or all{hint}."
        )
    return list(dict.fromkeys(names))


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
        return layout.normalize_kind(kind)
    except ValueError:
        raise DistUsageError(
            f"Unknown group kind {kind!r}. Use world, chunks:N (runs of N consecutive ranks) or "
            f"a kind of the layout ({layout.describe()}): {', '.join(layout.kinds())}. "
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
    corrupt_rank: int | None = None,
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
        "corrupt_rank": corrupt_rank,  # tests only: perturb this rank's input before the check
    }


def aggregate(step: dict, replies: dict[int, dict | None]) -> list[dict]:
    """Per-rank replies of one step -> one row per group (time averaged over its ranks,
    wrong elements summed, as nccl-tests does)."""
    by_group: dict[tuple[int, ...], list[dict]] = {}
    for _, reply in sorted(replies.items()):
        if reply:
            by_group.setdefault(tuple(reply["ranks"]), []).append(reply)
    rows = []
    for members, got in sorted(by_group.items()):
        n = len(members)
        count, size = count_and_bytes(step["collective"], step["size"], DTYPES[step["dtype"]], n)
        time_s = sum(r["time_s"] for r in got) / len(got)
        algbw, busbw = bandwidths(step["collective"], size, time_s, n)
        row = {
            "collective": step["collective"],
            "group": step["kind"],
            "ranks": members,
            "group_size": n,
            "size_bytes": size,
            "count": count,
            "dtype": step["dtype"],
            "time_us": time_s * 1e6,
            "algbw_gbps": algbw,
            "busbw_gbps": busbw,
        }
        if step["check"]:
            row["wrong"] = sum(int(r["wrong"] or 0) for r in got)
        rows.append(row)
    return rows


def to_frame(rows: list[dict], check: bool = False, **attrs: Any) -> pd.DataFrame:
    import pandas as pd

    columns = list(COLUMNS) + (["wrong"] if check else [])
    df = pd.DataFrame(rows, columns=columns)
    df.attrs.update(attrs)
    return df


def format_table(df: pd.DataFrame) -> str:
    """nccl-tests' table, one block per (collective, group kind), with its average busbw."""
    if df.empty:
        return "# no results"
    check = "wrong" in df.columns
    head = (
        f"# {'size':>10}  {'count':>12}  {'type':>8}  {'ranks':>12}  {'time':>9}  "
        f"{'algbw':>7}  {'busbw':>7}" + (f"  {'#wrong':>6}" if check else "")
    )
    units = (
        f"# {'(B)':>10}  {'(elements)':>12}  {'':>8}  {'':>12}  {'(us)':>9}  "
        f"{'(GB/s)':>7}  {'(GB/s)':>7}"
    )
    lines: list[str] = []
    attrs = df.attrs
    for (coll, kind), block in df.groupby(["collective", "group"], sort=False):
        sizes = sorted(set(block["group_size"]))
        lines += [
            f"# {coll} on {kind} groups of {'/'.join(map(str, sizes))} ranks"
            + (f", {attrs['iters']} iters, {attrs['warmup']} warm-up" if "iters" in attrs else "")
            + (f", timer {attrs['timer']}" if attrs.get("timer") else ""),
            head,
            units,
        ]
        for r in block.itertuples(index=False):
            line = (
                f"  {r.size_bytes:>10}  {r.count:>12}  {r.dtype:>8}  "
                f"{format_ranks(list(r.ranks)):>12}  {r.time_us:>9.1f}  "
                f"{r.algbw_gbps:>7.2f}  {r.busbw_gbps:>7.2f}"
            )
            lines.append(line + (f"  {r.wrong:>6}" if check else ""))
        lines.append(f"# Avg bus bandwidth    : {block['busbw_gbps'].mean():.4g} GB/s\n")
    return "\n".join(lines).rstrip("\n")


def p2p_frame(times: dict[tuple[int, int], list[float]], world: int, size: int) -> pd.DataFrame:
    """{(src, dst): [seconds per iteration, from src and dst]} -> src x dst GB/s matrix."""
    import numpy as np
    import pandas as pd

    bw = np.full((world, world), np.nan)
    for (s, d), ts in times.items():
        bw[s, d] = size / GB / (sum(ts) / len(ts))
    df = pd.DataFrame(bw, index=pd.Index(range(world), name="src"))
    df.columns = pd.Index(range(world), name="dst")
    df.attrs["size_bytes"] = size
    return df


# --------------------------------------------------------------------------- engine side


def engine_step(spec: dict) -> dict | None:
    """Run one (collective, group kind, size) on this rank, inside its group of the kind.

    Every rank calls it at once (``Session.apply``); groups of the kind run concurrently.
    Returns this rank's mean seconds per iteration, its group and (with check) wrong
    elements; None for a rank in no group of the kind."""
    import torch
    import torch.distributed as dist

    from . import engine

    ns = engine.user_namespace()
    rank = dist.get_rank()
    pg, members = _my_group(ns["groups"], spec["kind"], spec["partition"], rank)
    if members is None:
        return None
    n, i = len(members), members.index(rank)
    dtype = getattr(torch, spec["dtype"])
    count, _ = count_and_bytes(spec["collective"], spec["size"], DTYPES[spec["dtype"]], n)
    inp, out = _buffers(torch, spec["collective"], n, count, dtype, ns["device"])
    run = _launcher(dist, spec["collective"], inp, out, pg, members, i)
    for _ in range(spec["warmup"]):
        run()
    world_too = len(members) < dist.get_world_size()  # so that all groups start together
    elapsed, timer = _timed(torch, dist, run, spec["iters"], pg, ns["device"], world_too)
    wrong = None
    if spec["check"]:
        wrong = _check(torch, spec, inp, out, run, n, i, count, rank)
    return {"ranks": members, "time_s": elapsed / spec["iters"], "wrong": wrong, "timer": timer}


def _my_group(groups, kind: str, partition: list[list[int]], rank: int):
    """This rank's (process group, members) for ``kind``; creating groups is collective, so
    every rank makes the same calls in the same order."""
    members = next((g for g in partition if rank in g), None)
    if kind == "world":
        return groups.world, members
    if kind.startswith("chunks:"):
        pg = None
        for chunk in partition:  # get_group: ad-hoc groups from the same registry, reused
            got = groups.get_group(chunk)
            if rank in chunk:
                pg = got
        return pg, members
    return groups.get(kind), members


def _buffers(torch, collective: str, n: int, count: int, dtype, device):
    """(input, output) as nccl-tests sizes them; in-place collectives share one buffer.
    Zeros, so that repeated sums stay finite while timing."""

    def zeros(k):
        return torch.zeros(k, dtype=dtype, device=device)

    if collective in ("all_reduce", "broadcast", "reduce"):
        buf = zeros(count)
        return buf, buf
    if collective == "all_gather":
        return zeros(count), zeros(n * count)
    if collective == "reduce_scatter":
        return zeros(n * count), zeros(count)
    if collective == "all_to_all":
        return zeros(n * count), zeros(n * count)
    return zeros(count), zeros(count)  # send_recv


def _launcher(dist, collective: str, inp, out, pg, members: list[int], i: int):
    """A no-argument function running the collective once on this rank's group."""
    root = members[0]  # nccl-tests' default root is 0 (in the group)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    n = len(members)
    if collective == "all_reduce":
        return lambda: dist.all_reduce(out, group=pg)
    if collective == "all_gather":
        return lambda: all_gather(out, inp, group=pg)
    if collective == "reduce_scatter":
        return lambda: reduce_scatter(out, inp, group=pg)
    if collective == "broadcast":
        return lambda: dist.broadcast(out, src=root, group=pg)
    if collective == "reduce":
        return lambda: dist.reduce(out, dst=root, group=pg)
    if collective == "all_to_all":
        return lambda: dist.all_to_all_single(out, inp, group=pg)
    if n == 1:  # a ring of one sends to itself: a copy (gloo refuses self-sends)
        return lambda: out.copy_(inp)
    nxt, prv = members[(i + 1) % n], members[(i - 1) % n]

    def send_recv():
        ops = [dist.P2POp(dist.isend, inp, nxt, pg), dist.P2POp(dist.irecv, out, prv, pg)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return send_recv


def _timed(torch, dist, run, iters: int, pg, device, world_too: bool) -> tuple[float, str]:
    """Seconds for ``iters`` runs: CUDA events on a GPU, perf_counter between barriers on
    CPU (gloo collectives return when this rank's part is done)."""
    if world_too:
        dist.barrier()
    dist.barrier(group=pg)
    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, "cuda_event"
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    dist.barrier(group=pg)
    return time.perf_counter() - t0, "perf_counter"


def _pattern(torch, j: int, length: int, device, offset: int = 0):
    """Rank j's check data: small integers, distinct per rank and position, exact in every
    dtype for small groups (so sums compare exactly or within a rounding tolerance)."""
    k = torch.arange(offset, offset + length, dtype=torch.int64, device=device)
    return (k + 3 * j) % 7 + 1 + j


def _expected(torch, collective: str, n: int, i: int, count: int, device):
    """What this rank's output must hold (int64), or None where nothing is defined."""

    def p(j, length, offset=0):
        return _pattern(torch, j, length, device, offset)

    if collective == "all_reduce":
        return sum(p(j, count) for j in range(n))
    if collective == "reduce":
        return sum(p(j, count) for j in range(n)) if i == 0 else None
    if collective == "broadcast":
        return p(0, count)
    if collective == "all_gather":
        return torch.cat([p(j, count) for j in range(n)])
    if collective == "reduce_scatter":
        return sum(p(j, count, i * count) for j in range(n))
    if collective == "all_to_all":
        return torch.cat([p(j, count, i * count) for j in range(n)])
    return p((i - 1) % n, count)  # send_recv: from the previous rank of the ring


def _check(torch, spec: dict, inp, out, run, n: int, i: int, count: int, rank: int) -> int:
    """Fill inputs, run once more, count output elements that differ from the expectation."""
    inp.copy_(_pattern(torch, i, inp.numel(), inp.device).to(inp.dtype))
    if out.data_ptr() != inp.data_ptr():
        out.zero_()
    if rank == spec["corrupt_rank"] and inp.numel():
        inp.view(-1)[0] += 1  # after the expectation is fixed: the check must catch it
    run()
    expected = _expected(torch, spec["collective"], n, i, count, out.device)
    if expected is None:
        return 0
    if out.dtype.is_floating_point:
        # reductions may round in low precision: allow n roundings of the dtype
        tol = torch.finfo(out.dtype).eps * max(n, 1)
        got = out.to(torch.float64)
        bad = ~torch.isclose(got, expected.to(out.dtype).to(torch.float64), rtol=tol, atol=0)
    else:
        bad = out != expected.to(out.dtype)  # integer sums wrap the same way in both
    return int(bad.sum().item())


def engine_p2p(spec: dict) -> dict[int, float]:
    """Rank ``spec["src"]`` sends to every other rank in turn; each pair times its transfer
    (seconds per iteration, this rank's view). Ranks return {peer: seconds}."""
    import torch
    import torch.distributed as dist

    from . import engine

    ns = engine.user_namespace()
    device, rank, world = ns["device"], dist.get_rank(), dist.get_world_size()
    src = spec["src"]
    dtype = getattr(torch, spec["dtype"])
    buf = torch.zeros(spec["size"] // DTYPES[spec["dtype"]], dtype=dtype, device=device)
    tiny = torch.zeros(1, dtype=dtype, device=device)
    out = {}
    for dst in range(world):
        if dst == src or rank not in (src, dst):
            continue
        peer = dst if rank == src else src
        run = _p2p_op(dist.send if rank == src else dist.recv, buf, peer)
        out[dst] = _time_pair(torch, dist, run, tiny, peer, rank == src, spec)
    return out


def _p2p_op(op, buf, peer: int):
    return lambda: op(buf, peer)


def _time_pair(torch, dist, run, tiny, peer: int, first: bool, spec: dict) -> float:
    def handshake():  # a pair barrier without creating a group per pair
        for sending in (first, not first):
            (dist.send if sending else dist.recv)(tiny, peer)

    for _ in range(spec["warmup"]):
        run()
    handshake()
    iters = spec["iters"]
    if tiny.device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            run()
        handshake()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    handshake()
    return (time.perf_counter() - t0) / iters


# --------------------------------------------------------------------------- kernel side


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
    corrupt_rank: int | None = None,
) -> pd.DataFrame:
    """Sweep ``collectives`` x group kinds x sizes on every rank of ``session``.

    collectives: names from COLLECTIVES or "all" (default all_reduce); groups: "world"
    (default), kinds of the session's layout ("tp", "cp-dp" ...) or "chunks:N"; sizes:
    "MIN:MAX" stepping by ``factor`` (default 4K:1G on GPUs, 1K:1M on CPU). Returns one row
    per (collective, group, size) with nccl-tests' size, count, time, algbw and busbw.
    ``check`` adds a ``wrong`` column; ``corrupt_rank`` (tests) perturbs that rank's input.
    ``progress(done, total, what)`` is told after every step (viz.Progress draws it).
    """
    collectives = check_collectives([collectives] if isinstance(collectives, str) else collectives)
    layout = session.layout
    kinds = [normalize_group_kind(layout, k) for k in _as_list(groups, "world")]
    _check_counts(iters, warmup)
    dtype = resolve_dtype(dtype)
    size_list = parse_sizes(sizes or _default_sizes(session), factor)
    if corrupt_rank is not None and not 0 <= corrupt_rank < session.world_size:
        raise DistUsageError(f"corrupt_rank {corrupt_rank} is not a rank of this session.")
    steps = [
        make_step(coll, kind, group_partition(layout, kind), size, dtype=dtype, iters=iters,
                  warmup=warmup, check=check, corrupt_rank=corrupt_rank)
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
        backend=session.plan.backend,
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
    df.attrs.update(iters=iters, warmup=warmup, dtype=dtype, backend=session.plan.backend)
    return df


def p2p_by_locality(matrix: pd.DataFrame, hosts: Sequence[str]) -> dict[str, float]:
    """Mean send bandwidth (GB/s) of intra-node and of inter-node pairs."""
    sums: dict[str, list[float]] = {"intra-node": [], "inter-node": []}
    for src in matrix.index:
        for dst in matrix.columns:
            value = matrix.loc[src, dst]
            if src != dst and value == value:  # skip the diagonal and NaN
                kind = "intra-node" if hosts[src] == hosts[dst] else "inter-node"
                sums[kind].append(float(value))
    return {k: sum(v) / len(v) for k, v in sums.items() if v}


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
