"""The engine side of ``bench``: timed collectives and send/recv on every rank.

``engine_step`` runs one collective at one size on every rank, every group of the kind at
once; ``engine_p2p`` sends from one rank to each other rank. The kernel calls both through
``Session.apply``; ``timed`` is the one timer (CUDA events on a GPU, perf_counter on CPU).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..core.busbw import DTYPES, count_and_bytes


def engine_step(spec: dict) -> dict | None:
    """Run one (collective, group kind, size) on this rank, inside its group of the kind.

    Every rank calls it at once (``Session.apply``); groups of the kind run concurrently.
    Returns this rank's mean seconds per iteration, its group and (with check) wrong
    elements; None for a rank in no group of the kind."""
    import torch
    import torch.distributed as dist

    from . import bootstrap

    ns = bootstrap.user_namespace()
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
        wrong = _check(torch, spec, inp, out, run, n, i, count)
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


def timed(torch, device, body: Callable[[], object]) -> tuple[float, str]:
    """(seconds, timer name) that ``body()`` takes: CUDA events around it on a GPU (they time
    the stream, which the host only queues work on), perf_counter on CPU."""
    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        body()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, "cuda_event"
    t0 = time.perf_counter()
    body()
    return time.perf_counter() - t0, "perf_counter"


def _timed(torch, dist, run, iters: int, pg, device, world_too: bool) -> tuple[float, str]:
    """Seconds for ``iters`` runs of a collective, all groups starting together. On CPU the
    group meets at a barrier before the clock stops: gloo collectives return when this
    rank's part is done."""
    if world_too:
        dist.barrier()
    dist.barrier(group=pg)
    on_gpu = getattr(device, "type", "cpu") == "cuda"

    def body():
        for _ in range(iters):
            run()
        if not on_gpu:
            dist.barrier(group=pg)

    return timed(torch, device, body)


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


def _check(torch, spec: dict, inp, out, run, n: int, i: int, count: int) -> int:
    """Fill inputs, run once more, count output elements that differ from the expectation."""
    inp.copy_(_pattern(torch, i, inp.numel(), inp.device).to(inp.dtype))
    if out.data_ptr() != inp.data_ptr():
        out.zero_()
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

    from . import bootstrap

    ns = bootstrap.user_namespace()
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
    """Seconds per send (or receive) from ``peer``, between two pair handshakes."""

    def handshake():  # a pair barrier without creating a group per pair
        for sending in (first, not first):
            (dist.send if sending else dist.recv)(tiny, peer)

    def body():
        for _ in range(spec["iters"]):
            run()
        handshake()

    for _ in range(spec["warmup"]):
        run()
    handshake()
    return timed(torch, tiny.device, body)[0] / spec["iters"]
