"""NCCL ops from a rank's kineto trace (pure; the schema: kineto.py).

Each ``nccl:*`` record function on a CPU thread is one op as the rank enqueued it. It ends
at enqueue, so its span is not the op's: the op's span is that of the NCCL kernels it
launched, on the GPU (a kernel is the op's when its launch, found by correlation id, lies
inside the record function), else kineto's ``gpu_user_annotation`` copy of the record
function (the span of all GPU work launched inside it). Arrival is the kernel's start: the
moment the rank's GPU reached the collective and began waiting for its peers.

Its keys come from the ``record_param_comms`` events the thread recorded for it (the one
around it, or, for a coalesced batch, those since the thread's previous ``nccl:*`` op): the
group's name, and "Seq" for a collective; the peer for a send or recv. Where a torch
before 2.13 writes no "Seq", the Flight Recorder entry created inside the record function
(same name) gives it."""

from __future__ import annotations

import bisect

from . import kineto as k
from .comm_ops import CommOp, P2PCounter, collective_key

PREFIX = "nccl:"
SKIPPED = ("wait",)  # record_param_comms of Work.wait(): no op of its own
FR_SLACK_US = 50.0  # the entry is created inside the record function; clocks to µs


def ops(
    events: list[dict],
    rank: int,
    entries: list[dict],
    wall_to_trace,
    group_ranks: dict[str, list[int]],
) -> tuple[list[CommOp], int]:
    """The rank's NCCL ops with a GPU span, and how many ``nccl:*`` ops had none (no CUDA
    activity recorded for them)."""
    annotations: dict = {}
    params: dict = {}
    launches: dict = {}
    gpu_copies: dict = {}
    kernels = []
    for ev in events:
        if not k.is_span(ev):
            continue
        cat = ev.get("cat")
        if k.is_annotation(ev, PREFIX):
            annotations.setdefault(ev.get("tid"), []).append(ev)
        elif cat == "cpu_op" and ev.get("name") == k.PARAM_COMMS:
            params.setdefault(ev.get("tid"), []).append(ev)
        elif cat in k.LAUNCHES and "correlation" in k.args(ev):
            launches[k.args(ev)["correlation"]] = ev
        elif cat == "gpu_user_annotation" and str(ev.get("name", "")).startswith(PREFIX):
            gpu_copies[k.args(ev).get("External id")] = ev
        elif k.is_nccl_kernel(ev):
            kernels.append(ev)
    for evs in (*annotations.values(), *params.values()):
        evs.sort(key=lambda e: e["ts"])
    spans = _kernel_spans(kernels, launches, annotations)
    counter = P2PCounter()
    out, unmeasured = [], 0
    for tid, anns in annotations.items():
        previous_end = float("-inf")
        for ann in anns:
            mine = [
                p
                for p in params.get(tid, [])
                if previous_end < p["ts"] <= k.end(ann)
                and k.args(p).get("Collective name") not in SKIPPED
            ]
            previous_end = k.end(ann)
            span = spans.get(id(ann)) or _copy_span(gpu_copies, ann)
            keys = _keys(ann, mine, rank, entries, wall_to_trace, group_ranks, counter)
            if span is None:
                unmeasured += 1
                continue
            out.append(
                CommOp(
                    name=ann["name"],
                    start=span[0],
                    end=span[1],
                    keys=keys,
                    group=_group_desc(mine),
                    p2p=any(key[0] == "p" for key in keys),
                )
            )
    return out, unmeasured


def _kernel_spans(kernels, launches, annotations) -> dict[int, tuple[float, float]]:
    """id(record function) -> the span of the NCCL kernels launched inside it."""
    starts = {tid: [a["ts"] for a in anns] for tid, anns in annotations.items()}
    spans: dict[int, tuple[float, float]] = {}
    for kernel in kernels:
        launch = launches.get(k.args(kernel).get("correlation"))
        if launch is None or launch.get("tid") not in annotations:
            continue
        anns = annotations[launch["tid"]]
        # the last nccl:* record function to start before the launch (they never nest)
        i = bisect.bisect_right(starts[launch["tid"]], launch["ts"]) - 1
        if i < 0 or not anns[i]["ts"] <= launch["ts"] <= k.end(anns[i]):
            continue
        a, b = spans.get(id(anns[i]), (float("inf"), float("-inf")))
        spans[id(anns[i])] = (min(a, kernel["ts"]), max(b, k.end(kernel)))
    return spans


def _copy_span(gpu_copies: dict, ann: dict) -> tuple[float, float] | None:
    copy = gpu_copies.get(k.args(ann).get("External id"))
    return None if copy is None else (copy["ts"], k.end(copy))


def _keys(ann, params, rank, entries, wall_to_trace, group_ranks, counter) -> tuple:
    keys = []
    for p in params:
        a = k.args(p)
        group = str(a.get("Process Group Name", ""))
        name = a.get("Collective name")
        if name in ("send", "recv"):
            peer = a.get("Dst Rank" if name == "send" else "Src Rank")
            if peer is None:  # the group's ranks were not known to the recorder
                ranks = group_ranks.get(group) or []
                peer = ranks[a["Rank"]] if 0 <= a.get("Rank", -1) < len(ranks) else None
            if peer is not None:
                src, dst = (rank, peer) if name == "send" else (peer, rank)
                keys.append(counter.key(group, src, dst))
        elif "Seq" in a:
            keys.append(collective_key(group, a["Seq"]))
    if not keys:  # no "Seq" (torch < 2.13): the Flight Recorder's entry for it
        entry = _entry_inside(ann, entries, wall_to_trace)
        if entry is not None:
            keys.append(collective_key(entry["process_group"][0], entry["collective_seq_id"]))
    return tuple(dict.fromkeys(keys))  # a coalesced group's ops share its seq


def _entry_inside(ann, entries, wall_to_trace) -> dict | None:
    for entry in entries:
        if entry.get("is_p2p") or entry.get("profiling_name") != ann["name"]:
            continue
        t = wall_to_trace(entry["time_created_ns"])
        if ann["ts"] - FR_SLACK_US <= t <= k.end(ann) + FR_SLACK_US:
            return entry
    return None


def _group_desc(params) -> str:
    for p in params:
        desc = k.args(p).get("Process Group Description")
        if desc:
            return str(desc)
    return ""
