"""gloo ops from a rank's kineto trace (pure; the schema: kineto.py).

Collectives. Each ``gloo:*`` record function on a worker thread is one collective, from
when a worker took it (the rank's arrival) to its end. The trace does not say which group
it belongs to; the Flight Recorder does, with an entry per collective created as the work
was queued (ProcessGroupGloo::enqueue), numbered in its group. A group's work runs in that
order (its FIFO queue) on the group's own worker threads. So, first, which thread is whose:
each entry, in the order they were created, takes the first unused event of its name that
started after it, and each thread goes to the group most of its events went to. Then each
group's events (on its threads, in the order they started) are matched to its entries in
order: the n-th event runs the n-th entry, the first event of each entry's name that
started after it was created.

The recorder is a ring (TORCH_FR_BUFFER_SIZE entries): a cell with more collectives than
that keeps entries for the last ones only, and says how many it dropped. A group's events
are then matched from the last one back (the ring drops the oldest), and the earlier ones
numbered back from its first kept entry; only where every event ran on a thread of a known
group (a thread no kept entry names could hold any group's earlier work), else the earlier
ones stay unnamed: counted as communication, not matched, and the rows say so.

Point-to-point. gloo records no send/recv in the Flight Recorder; ``gloo:send`` and
``gloo:recv`` run on the calling thread until the work's ``wait()``. The group and peer
come from engine/p2p_log.py, which notes each ``ProcessGroup.send``/``recv`` as it is
called: the n-th call of a thread is its n-th send or recv event."""

from __future__ import annotations

import bisect
from collections import Counter

from . import kineto as k
from .comm_ops import CommOp, P2PCounter, collective_key

PREFIX = "gloo:"
P2P = ("gloo:send", "gloo:recv")
# An entry is created before a worker takes its work (a thread wakes in µs); the trace's
# clock and the recorder's agree to a few µs through the marks. Less than the shortest gap
# between one collective's start and the next one's creation (its own run, at least).
SLACK_US = 25.0
POST_SLACK_US = 1000.0  # a p2p note is matched by thread and order; time only bounds it


def ops(
    events: list[dict],
    rank: int,
    entries: list[dict],
    lost: int,
    calls: list[dict],
    wall_to_trace,
) -> list[CommOp]:
    """The rank's gloo collectives and sends/receives. ``entries``: the recorder's entries
    of the window; ``lost``: how many of the window's entries the ring dropped; ``calls``:
    the p2p log's notes."""
    worker, p2p = [], []
    for ev in events:
        if k.is_annotation(ev, PREFIX):
            (p2p if ev["name"].startswith(P2P) else worker).append(ev)
    return _collectives(worker, entries, lost, wall_to_trace) + _messages(
        p2p, calls, rank, wall_to_trace
    )


def _collectives(worker, entries, lost, wall_to_trace) -> list[CommOp]:
    worker.sort(key=lambda e: e["ts"])
    queues: dict[str, list[tuple[float, dict]]] = {}
    for entry in sorted(entries, key=lambda e: e.get("collective_seq_id", 0)):
        if not entry.get("is_p2p") and str(entry.get("profiling_name", "")).startswith(PREFIX):
            created = wall_to_trace(entry["time_created_ns"])
            queues.setdefault(entry["process_group"][0], []).append((created, entry))
    owner = _owners(worker, queues)
    unowned = any(ev.get("tid") not in owner for ev in worker)
    keys: dict[int, tuple] = {}
    descs: dict[int, str] = {}
    for group, queue in queues.items():
        mine = [ev for ev in worker if owner.get(ev.get("tid")) == group]
        pairs = _from_the_end(mine, queue) if lost else _in_time(mine, queue)
        for ev, entry in pairs:
            keys[id(ev)] = collective_key(group, entry["collective_seq_id"])
            descs[id(ev)] = str((entry.get("process_group") or ["", ""])[-1])
        if pairs and lost and not unowned:  # the ring dropped entries: number the rest back
            first = min(pairs, key=lambda p: p[0]["ts"])
            before = [ev for ev in mine if ev["ts"] < first[0]["ts"] and id(ev) not in keys]
            for back, ev in enumerate(reversed(before), start=1):
                keys[id(ev)] = collective_key(group, first[1]["collective_seq_id"] - back)
                descs[id(ev)] = descs[id(first[0])]
    return _ops(worker, keys, descs)


def _owners(worker, queues) -> dict:
    """Worker thread -> the group whose entries most of its events went with, each entry
    (in the order created) taking the first unused event of its name started after it."""
    starts: dict[str, list[float]] = {}
    events: dict[str, list[dict]] = {}
    for ev in worker:
        starts.setdefault(ev["name"], []).append(ev["ts"])
        events.setdefault(ev["name"], []).append(ev)
    used: set[int] = set()
    votes: dict = {}
    flat = [(created, group, entry) for group, q in queues.items() for created, entry in q]
    for created, group, entry in sorted(flat, key=lambda x: (x[0], x[1])):
        name = entry.get("profiling_name")
        i = bisect.bisect_left(starts.get(name, []), created - SLACK_US)
        candidates = events.get(name, [])
        while i < len(candidates) and id(candidates[i]) in used:
            i += 1
        if i < len(candidates):
            used.add(id(candidates[i]))
            votes.setdefault(candidates[i].get("tid"), Counter())[group] += 1
    return {tid: count.most_common(1)[0][0] for tid, count in votes.items()}


def _in_time(mine, queue) -> list[tuple[dict, dict]]:
    """The group's entries in order, each with the first later event of its name."""
    pairs, j = [], 0
    for created, entry in queue:
        i = j
        while i < len(mine) and not (
            mine[i]["name"] == entry.get("profiling_name") and mine[i]["ts"] >= created - SLACK_US
        ):
            i += 1
        if i < len(mine):
            pairs.append((mine[i], entry))
            j = i + 1
    return pairs


def _from_the_end(mine, queue) -> list[tuple[dict, dict]]:
    """The group's last events with its kept entries, last with last, while names agree."""
    pairs = []
    for ev, (_, entry) in zip(reversed(mine), reversed(queue)):
        if ev["name"] != entry.get("profiling_name"):
            break
        pairs.append((ev, entry))
    return pairs


def _messages(p2p, calls, rank, wall_to_trace) -> list[CommOp]:
    """Each send/recv event with the key of the call that made it (by thread and order)."""
    p2p.sort(key=lambda e: e["ts"])
    used: set[int] = set()
    keys: dict[int, tuple] = {}
    descs: dict[int, str] = {}
    counter = P2PCounter()
    for call in calls:
        peer = call.get("peer")
        if peer is None:  # recv from any source: the sender is known only at its end
            continue
        src, dst = (rank, peer) if call["op"] == "send" else (peer, rank)
        key = counter.key(call["group"], src, dst)
        posted = wall_to_trace(call["wall_ns"])
        for ev in p2p:
            if (
                id(ev) not in used
                and ev["name"] == f"gloo:{call['op']}"
                and ev.get("tid") == call.get("tid", ev.get("tid"))
                and ev["ts"] >= posted - POST_SLACK_US
            ):
                used.add(id(ev))
                keys[id(ev)] = key
                descs[id(ev)] = call.get("desc", "")
                break
    return _ops(p2p, keys, descs, p2p=True)


def _ops(events: list[dict], keys: dict, descs: dict, p2p: bool = False) -> list[CommOp]:
    """The events as CommOps: each with its match key and group, where one was found."""
    return [
        CommOp(
            name=ev["name"],
            start=ev["ts"],
            end=k.end(ev),
            keys=(keys[id(ev)],) if id(ev) in keys else (),
            group=descs.get(id(ev), ""),
            p2p=p2p,
        )
        for ev in events
    ]
