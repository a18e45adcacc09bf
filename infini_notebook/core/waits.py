"""Who waits for whom (pure): from what the running ranks report they wait in (see
``wait_probe.current_wait``) and which ranks have left the cell, the waits that can never
finish, and the sentences that say so.

A wait is a dict: op, group (label), ranks (the group's global ranks), peer (send/recv),
seq (the collective's number in its group, when the Flight Recorder knows), nth (which of
the running cell's calls of that op on that group it is, where the recorder still holds
them all), line, in_cell, func.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .ranks import rank_label

# Why a rank left the cell, as the messages say it.
LEFT = {"failed": "raised", "finished": "had finished the cell", "died": "died"}


def ranks_text(ranks) -> str:
    """'rank 2' or 'ranks 0-3'."""
    return rank_label(sorted(ranks))[1:-1]


def waited_for(wait: Mapping, gone: Mapping[int, str]) -> list[int]:
    """The ranks that left the cell (``gone``: rank -> failed/finished/died) that this
    wait needs: its peer for send/recv, else the members of its group."""
    if wait.get("peer") is not None:
        needed = [wait["peer"]]
    else:
        needed = wait.get("ranks") or []
    return sorted(r for r in needed if r in gone)


def hopeless(waits: Mapping[int, Mapping | None], gone: Mapping[int, str]) -> dict[int, list[int]]:
    """Running ranks whose wait can never finish -> the gone ranks they wait for. A rank
    computing (no wait) or waiting in a group of running ranks only is not among them."""
    out = {}
    for r, wait in waits.items():
        if wait:
            needed = waited_for(wait, gone)
            if needed:
                out[r] = needed
    return out


def links_between(links: Mapping[int, list], rank: int, peers) -> list:
    """``rank``'s TCP connections ([local, remote] address pairs, as each rank reports
    them: wait_probe.tcp_links) whose other end is one of ``peers``' connections."""
    theirs = {(tuple(r), tuple(lo)) for p in peers if p != rank for lo, r in links.get(p, [])}
    return [[lo, r] for lo, r in links.get(rank, []) if (tuple(lo), tuple(r)) in theirs]


def where(wait: Mapping, cell: str = "") -> str:
    """Where a rank waits: 'the cell's 1st all_reduce (#7 on the tp group) at In[5], line 4',
    numbered within the cell where the ranks know (the group's own number beside it)."""
    group, op = wait.get("group") or "world", wait["op"]
    if wait.get("peer") is not None:
        verb = "to" if op.startswith(("send", "isend")) else "from"
        place = f"{op} {verb} rank {wait['peer']} on the {group} group"
    elif wait.get("seq") and wait.get("nth"):
        place = f"the cell's {ordinal(wait['nth'])} {op} (#{wait['seq']} on the {group} group)"
    elif wait.get("seq"):
        place = f"{op} (#{wait['seq']} on the {group} group)"
    else:
        place = f"{op} on the {group} group"
    line = wait.get("line")
    if line is not None:
        if wait.get("in_cell"):
            place += f" at {cell}, line {line}" if cell else f" at line {line} of the cell"
        else:
            place += f" in {wait.get('func', '?')}(), line {line}"
    return place


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, 11th, 12th, 21st."""
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def released_text(
    blocked: Mapping[int, list[int]],
    waits: Mapping[int, Mapping | None],
    gone: Mapping[int, str],
    cell: str = "",
    late: Sequence[int] = (),
) -> str:
    """'ranks 1-3 were waiting for rank 0 in the cell's 1st all_reduce (#3 on the world
    group) at In[5], line 4: released', one clause per distinct wait, ranks merged.
    ``late``: ranks that came to a wait only after the release had closed their peers'
    connections (never seen waiting)."""
    by_place: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for r, needed in sorted(blocked.items()):
        by_place.setdefault((where(waits[r], cell), tuple(needed)), []).append(r)
    clauses = []
    for (place, needed), ranks in by_place.items():
        verb = "was" if len(ranks) == 1 else "were"
        clauses.append(f"{ranks_text(ranks)} {verb} waiting for {ranks_text(needed)} in {place}")
    if late:
        their = "its connection" if len(late) == 1 else "their connections"
        clauses.append(f"{ranks_text(sorted(late))} lost {their} to a rank that left")
    return "; ".join(clauses) + ": released"


def verdict(waits: Mapping[int, Mapping | None], cell: str = "", paused=()) -> str:
    """Where every running rank waits, merged by place, with what does not match within a
    group: 'ranks 0-1 in all_reduce (#7 on the tp group); ranks 2-3 in broadcast (#7 on
    the tp group): mismatch in the tp group [0, 1, 2, 3]'. ``paused``: ranks paused in
    JupyterLab's debugger (kernel/debug_proxy.py), which the others wait for."""
    places: dict[str, list[int]] = {}
    for r, wait in sorted(waits.items()):
        place = f"in {where(wait, cell)}" if wait else "computing (not in a collective)"
        if r in paused:
            place = "paused in the debugger"
        places.setdefault(place, []).append(r)
    text = "; ".join(f"{ranks_text(ranks)} {place}" for place, ranks in places.items())
    problems = mismatches({r: w for r, w in waits.items() if r not in paused})  # expected there
    return text + (f": {'; '.join(problems)}" if problems else "")


def mismatches(waits: Mapping[int, Mapping | None]) -> list[str]:
    """Groups whose members wait in different calls, or in different collectives by number,
    and members of a waited-in group that are not waiting in it."""
    by_group: dict[tuple[int, ...], dict[int, Mapping]] = {}
    for r, wait in waits.items():
        if wait and wait.get("peer") is None and wait.get("ranks"):
            by_group.setdefault(tuple(wait["ranks"]), {})[r] = wait
    out = []
    for members, inside in sorted(by_group.items()):
        label = next(iter(inside.values())).get("group", "world")
        calls = {(w["op"], w.get("seq")) for w in inside.values()}
        absent = [r for r in members if r in waits and r not in inside]
        if len(calls) > 1:
            out.append(f"mismatch in the {label} group {list(members)}")
        if absent:
            out.append(f"{ranks_text(absent)} of the {label} group not in it")
    return out
