"""The ranks' traces as one Chrome/Perfetto trace (pure): a process track per rank, on the
kernel's clock (timeline.py aligns them), time 0 at the earliest event.

Each rank keeps its own threads and GPU streams (kineto's pid is the process for CPU
threads and the device for streams; both become the rank's track) with their names
(``thread_name``/``thread_sort_index`` metadata). Flow ids (``ph`` s/t/f: launch to
kernel, forward to backward) are kineto's correlation ids, numbered per process, so the
same id on two ranks would join them with an arrow: each rank's are numbered anew."""

from __future__ import annotations

from . import kineto as k


def merged(traces, hosts: dict[int, str] | None = None) -> dict:
    """Moves the traces' events there in place (54k events: a copy of each doubled the
    merge's time), so take the tables from the traces first."""
    hosts = hosts or {}
    kept = [(t, [e for e in t.events if "ts" in e and e.get("ph") != "M"]) for t in traces]
    zero = min((e["ts"] + t.shift_us for t, evs in kept for e in evs), default=0.0)
    events: list[dict] = []
    flows: dict = {}
    for t, evs in kept:
        label = f"rank {t.rank}" + (f" ({hosts[t.rank]})" if t.rank in hosts else "")
        events.append({"ph": "M", "name": "process_name", "pid": t.rank, "args": {"name": label}})
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": t.rank, "args": {"sort_index": t.rank}}
        )
        events += _thread_names(t)
        shift = t.shift_us - zero
        for e in evs:
            e["pid"], e["ts"] = t.rank, round(e["ts"] + shift, 3)
            if e.get("ph") in k.FLOW_PHASES and "id" in e:
                e["id"] = flows.setdefault((t.rank, e.get("cat"), e["id"]), len(flows) + 1)
        events += evs
        t.events = []  # moved: the trace no longer holds them on its own clock
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"zero_us": zero}}


def _thread_names(t) -> list[dict]:
    """The rank's thread and stream names, moved to its track."""
    out, seen = [], set()
    for e in t.events:
        if e.get("ph") != "M" or e.get("name") in k.PROCESS_META:
            continue
        key = (e.get("name"), e.get("tid"))
        if key in seen:  # a CPU thread and a stream of the same number: the first
            continue
        seen.add(key)
        out.append({"ph": "M", "name": e["name"], "pid": t.rank, "tid": e.get("tid"),
                    "args": e.get("args", {})})  # fmt: skip
    return out
