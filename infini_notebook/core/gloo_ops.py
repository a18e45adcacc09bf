"""gloo ops from a rank's kineto trace (pure; the schema: kineto.py).

Collectives. Each ``gloo:*`` record function on a worker thread is one collective, from
when a worker took it (the rank's arrival) to its end. The trace does not say which group
it belongs to; the Flight Recorder does, with an entry per collective created as the work
was queued (ProcessGroupGloo::enqueue), in the group's order. A group's work runs in that
order on its own worker threads (its FIFO queue), so the entries are matched to the events
in time: an event is its group's next entry of the same name created before it started,
and the thread it ran on belongs to that group from then on.

The recorder is a ring (TORCH_FR_BUFFER_SIZE entries): a cell with more collectives than
that keeps entries for the last ones only. The earlier events of a group, on threads known
to be its own, are then numbered back from its first kept entry; only where every such
event is on a thread whose group is known, else they stay unnamed (counted as
communication, not matched).

Point-to-point. gloo records no send/recv in the Flight Recorder; ``gloo:send`` and
``gloo:recv`` run on the calling thread until the work's ``wait()``. The group and peer
come from engine/p2p_log.py, which notes each ``ProcessGroup.send``/``recv`` as it is
called: the n-th call of a thread is its n-th send or recv event."""

from __future__ import annotations

from . import kineto as k
from .comm_ops import CommOp, P2PCounter, collective_key

PREFIX = "gloo:"
P2P = ("gloo:send", "gloo:recv")
LOOKAHEAD = 8  # entries of a group an event may skip (work queued and never run)
SLACK_US = 1000.0  # an entry is created before its work starts; the clocks agree to µs


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
    queues: dict[str, list[dict]] = {}
    for entry in sorted(entries, key=lambda e: e.get("collective_seq_id", 0)):
        if not entry.get("is_p2p") and str(entry.get("profiling_name", "")).startswith(PREFIX):
            queues.setdefault(entry["process_group"][0], []).append(entry)
    owner: dict = {}  # worker thread -> its group
    named: dict[int, tuple[str, dict]] = {}  # id(event) -> (group, entry)
    for ev in sorted(worker, key=lambda e: e["ts"]):
        choice = _next_entry(ev, queues, owner, wall_to_trace)
        if choice is not None:
            group, i = choice
            named[id(ev)] = (group, queues[group].pop(i))
            owner[ev.get("tid")] = group
    keys = {i: collective_key(g, e["collective_seq_id"]) for i, (g, e) in named.items()}
    descs = {i: str((e.get("process_group") or ["", ""])[-1]) for i, (_, e) in named.items()}
    if lost:
        keys.update(_numbered_back(worker, named, owner))
    return [
        CommOp(
            name=ev["name"],
            start=ev["ts"],
            end=k.end(ev),
            keys=(keys[id(ev)],) if id(ev) in keys else (),
            group=descs.get(id(ev), ""),
        )
        for ev in worker
    ]


def _next_entry(ev, queues, owner, wall_to_trace) -> tuple[str, int] | None:
    """The group and index of the entry ``ev`` runs: among the groups that may own its
    thread (its own group, once known), the next entry of its name, created before it
    started; of several groups, the one whose entry is oldest."""
    best = None
    for group, queue in queues.items():
        if owner.get(ev.get("tid"), group) != group:
            continue
        for i, entry in enumerate(queue[:LOOKAHEAD]):
            if entry.get("profiling_name") != ev["name"]:
                continue
            created = wall_to_trace(entry["time_created_ns"])
            if created <= ev["ts"] + SLACK_US and (best is None or created < best[0]):
                best = (created, group, i)
            break
    return None if best is None else (best[1], best[2])


def _numbered_back(worker, named, owner) -> dict[int, tuple]:
    """Keys for the events the ring lost the entries of, counted back from each group's
    first kept entry: only where every unnamed event ran on a thread of a known group."""
    unnamed = [ev for ev in worker if id(ev) not in named]
    if any(ev.get("tid") not in owner for ev in unnamed):
        return {}
    first: dict[str, tuple[float, int]] = {}
    for ev in worker:
        if id(ev) in named:
            group, entry = named[id(ev)]
            seq = entry["collective_seq_id"]
            if group not in first or ev["ts"] < first[group][0]:
                first[group] = (ev["ts"], seq)
    keys = {}
    for group, (ts, seq) in first.items():
        earlier = [ev for ev in unnamed if owner[ev.get("tid")] == group and ev["ts"] < ts]
        for back, ev in enumerate(sorted(earlier, key=lambda e: -e["ts"]), start=1):
            keys[id(ev)] = collective_key(group, seq - back)
    return keys


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
                and ev["ts"] >= posted - SLACK_US
            ):
                used.add(id(ev))
                keys[id(ev)] = key
                descs[id(ev)] = call.get("desc", "")
                break
    return [
        CommOp(
            name=ev["name"],
            start=ev["ts"],
            end=k.end(ev),
            keys=(keys[id(ev)],) if id(ev) in keys else (),
            group=descs.get(id(ev), ""),
            p2p=True,
        )
        for ev in p2p
    ]
