"""Reading a Flight Recorder dump: which collectives a rank has enqueued and not yet seen
complete. Pure: the dump is the JSON torch 2.13 writes (``FlightRecorder::dump_json`` in
torch/csrc/distributed/c10d/FlightRecorderDetail.hpp; its version "2.10"), read on the rank by
engine/wait_probe.py from the recorder its backend writes to.

An entry's "state" alone cannot say it is pending. gloo's entries never leave "scheduled"
(they carry no CUDA events; their work is marked "retired" when it ends), and NCCL's state is
refreshed only as the dump is taken. So an entry is pending when it is neither completed nor
retired (a retired, uncompleted NCCL entry timed out: nothing waits on it any more) and, for a
collective, its sequence number is past the last one its group completed ("pg_status", kept
by the backend per group: ``ProcessGroupStatus::lastCompletedSeq`` in c10d/logger.hpp)."""

from __future__ import annotations

import json

from .layout import kind_label

COMPLETED = "completed"


def last_completed(dump: dict) -> dict[int, int]:
    """Each group's (pg_id) last completed collective sequence number (-1: none yet)."""
    out = {}
    for pg_id, status in (dump.get("pg_status") or {}).items():
        try:
            out[int(pg_id)] = int(status.get("last_completed_collective", -1))
        except (TypeError, ValueError):
            continue
    return out


def anything_enqueued(dump: dict) -> bool:
    """Whether a group enqueued a collective past the last one it completed ("pg_status"
    alone: a dump without entries answers it)."""
    for status in (dump.get("pg_status") or {}).values():
        try:
            enqueued = int(status.get("last_enqueued_collective", -1))
            completed = int(status.get("last_completed_collective", -1))
        except (TypeError, ValueError):
            continue
        if enqueued > completed:
            return True
    return False


def is_pending(entry: dict, completed: dict[int, int]) -> bool:
    if entry.get("state") == COMPLETED or entry.get("retired"):
        return False
    if entry.get("is_p2p"):  # p2p work is numbered apart (p2p_seq_id), not in pg_status
        return True
    seq = entry.get("collective_seq_id") or 0
    return seq > completed.get(entry.get("pg_id"), -1)


def pending(dump: dict, collectives_only: bool = False) -> list[dict]:
    """The entries still pending, oldest first (p2p ones left out with ``collectives_only``)."""
    completed = last_completed(dump)
    found = [
        e
        for e in dump.get("entries") or []
        if is_pending(e, completed) and not (collectives_only and e.get("is_p2p"))
    ]
    return sorted(found, key=lambda e: e.get("record_id", 0))


def group_label(desc: str) -> str:
    """A group as errors and the profile name it, from its description: 'world' (torch's
    default group), the layout's kind ('tp', 'cp dp': the session makes its groups with
    group_desc 'inb_<kind>'), its gloo twin; else the description itself."""
    if desc == "default_pg":
        return "world"
    if desc.startswith("inb_cpu_"):
        return f"{_kind(desc.removeprefix('inb_cpu_'))} (gloo twin)"
    return _kind(desc.removeprefix("inb_"))


def _kind(name: str) -> str:
    """The kind a group description names ('cp_dp' -> 'cp dp'); 'world' for all dims."""
    return kind_label(name).replace("_", " ")


def describe(dump: dict, entry: dict) -> dict:
    """A wait as wait_probe reports it: op, group label, the group's global ranks, seq."""
    name, desc = (list(entry.get("process_group") or []) + ["", ""])[:2]
    config = (dump.get("pg_config") or {}).get(name, {})
    try:
        ranks = json.loads(config.get("ranks", "[]"))
    except (TypeError, ValueError):
        ranks = []
    label = group_label(desc)
    op = str(entry.get("profiling_name", "?")).split(":")[-1]
    seq = entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id")
    return {
        "op": op,
        "group": label or name,
        "ranks": ranks,
        "peer": None,
        "seq": seq,
        "name": name,
    }


def oldest_pending(dump: dict, collectives_only: bool = False) -> dict | None:
    """The entry the rank waits in by the recorder (its oldest pending one), or None."""
    entries = pending(dump, collectives_only)
    return entries[0] if entries else None


def oldest_wait(dump: dict, collectives_only: bool = False) -> dict | None:
    """What the rank waits in by the recorder, described, or None."""
    entry = oldest_pending(dump, collectives_only)
    return describe(dump, entry) if entry else None


def newest_entry(dump: dict, group_name: str) -> dict | None:
    """The newest collective this rank enqueued on the group named ``group_name``: a group
    rebuilt by a restart may take an old group's name again, so by record id."""
    mine = [
        e
        for e in dump.get("entries") or []
        if (e.get("process_group") or [None])[0] == group_name and e.get("collective_seq_id")
    ]
    return max(mine, key=lambda e: e.get("record_id", 0)) if mine else None


def nth_in_cell(dump: dict, entry: dict, since_ns: int | None, capacity: int) -> int | None:
    """Which of the running cell's calls of its kind on its group ``entry`` is (1: the
    cell's first all_reduce there), counting the entries made since the cell started
    (``since_ns``, on time.time_ns()'s clock, as the recorder's ``time_created_ns``). None
    when not known: no cell start, a p2p entry, or a recorder that may have dropped some of
    the cell's entries (it keeps the last ``capacity``, and all of them are the cell's)."""
    entries = dump.get("entries") or []
    if since_ns is None or entry.get("is_p2p"):
        return None
    if len(entries) >= capacity and all(e.get("time_created_ns", 0) >= since_ns for e in entries):
        return None
    same = [
        e
        for e in entries
        if e.get("time_created_ns", 0) >= since_ns
        and e.get("process_group") == entry.get("process_group")
        and e.get("profiling_name") == entry.get("profiling_name")
        and e.get("record_id", 0) <= entry.get("record_id", 0)
    ]
    return len(same) or None
