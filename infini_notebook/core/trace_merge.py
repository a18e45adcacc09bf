"""The ranks' traces as one Chrome/Perfetto trace (pure): a process track per rank, on the
kernel's clock (timeline.py aligns them), time 0 at the earliest event.

Each rank keeps its own threads and GPU streams (kineto's pid is the process for CPU
threads and the device for streams; both become the rank's track) with their names
(``thread_name``/``thread_sort_index`` metadata). Flow ids (``ph`` s/t/f: launch to
kernel, forward to backward) are kineto's correlation ids, numbered per process, so the
same id on two ranks would join them with an arrow: each rank's are numbered anew, after
the ranks before it (``flow_bases``).

The work is split so that no process walks another's events: each rank shifts its own
(``shift``, engine/profiling.py) and writes them as a fragment of the event list
(``fragment``) once the kernel sent its shift; the kernel writes the header, each rank's
track metadata and streams the fragments in (``write``). ``merged`` does the same in
memory."""

from __future__ import annotations

import json

from . import kineto as k
from .rank_trace import summary


def zero_us(traces) -> float:
    """The earliest kept event on the kernel's clock (the merged trace's time 0)."""
    firsts = [summary(t).first_ts + t.shift_us for t in traces if summary(t).first_ts is not None]
    return min(firsts, default=0.0)


def flow_bases(traces) -> dict[int, int]:
    """Rank -> the number its flow ids start after (the earlier ranks' flows)."""
    bases, n = {}, 0
    for t in traces:
        bases[t.rank] = n
        n += summary(t).flows
    return bases


def shift(events: list[dict], rank: int, by_us: float, flow_base: int) -> list[dict]:
    """The events the merged trace keeps (not metadata), moved in place to the rank's
    track, ``by_us`` later (to the kernel's clock, less time 0), flows numbered from
    ``flow_base`` + 1 in the order they first appear."""
    kept = [e for e in events if "ts" in e and e.get("ph") != "M"]
    flows: dict = {}
    for e in kept:
        e["pid"], e["ts"] = rank, round(e["ts"] + by_us, 3)
        if e.get("ph") in k.FLOW_PHASES and "id" in e:
            e["id"] = flows.setdefault((e.get("cat"), e["id"]), flow_base + len(flows) + 1)
    return kept


def fragment(events: list[dict]) -> str:
    """Shifted events as a piece of the merged event list: ``{...}, {...}`` (no brackets)."""
    return json.dumps(events, check_circular=False)[1:-1]  # C's encoder


def track(t, host: str | None) -> list[dict]:
    """A rank's track metadata: its name (and host), its place, its threads' names."""
    label = f"rank {t.rank}" + (f" ({host})" if host else "")
    out = [
        {"ph": "M", "name": "process_name", "pid": t.rank, "args": {"name": label}},
        {"ph": "M", "name": "process_sort_index", "pid": t.rank, "args": {"sort_index": t.rank}},
    ]
    for e in summary(t).thread_names:
        out.append({"ph": "M", "name": e["name"], "pid": t.rank, "tid": e["tid"],
                    "args": e["args"]})  # fmt: skip
    return out


def write(f, traces, hosts: dict[int, str], fragments, zero: float) -> None:
    """The merged trace into the text file ``f``: each rank's track, then its fragment
    (``fragments(rank)`` yields its text in chunks, str or UTF-8 bytes), streamed, never
    whole in memory."""
    f.write('{"traceEvents": [')
    for i, t in enumerate(traces):
        f.write((", " if i else "") + json.dumps(track(t, hosts.get(t.rank)))[1:-1])
        chunks = (c for c in fragments(t.rank) if c)
        first = next(chunks, None)
        if first is not None:  # a rank with no events has no fragment
            f.write(", ")
            for chunk in (first, *chunks):
                _put(f, chunk)
    f.write(f'], "displayTimeUnit": "ms", "otherData": {json.dumps({"zero_us": zero})}}}')


def _put(f, chunk: str | bytes) -> None:
    """Text as text; bytes (UTF-8, read from a rank's fragment file) straight to the text
    file's buffer, neither decoded nor encoded again."""
    if isinstance(chunk, str):
        f.write(chunk)
    else:
        f.flush()
        f.buffer.write(chunk)


def merged(traces, hosts: dict[int, str] | None = None) -> dict:
    """The merged trace as one dict. Moves the traces' events there in place (54k events:
    a copy of each doubled the merge's time), so take the tables from the traces first."""
    hosts = hosts or {}
    zero = zero_us(traces)
    bases = flow_bases(traces)
    events: list[dict] = []
    for t in traces:
        events += track(t, hosts.get(t.rank))
        events += shift(t.events, t.rank, t.shift_us - zero, bases[t.rank])
        t.events = []  # moved: the trace no longer holds them on its own clock
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"zero_us": zero}}
