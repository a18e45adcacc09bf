"""Taking over a kept session from a new kernel (``%dist_attach NAME``): claim its lease,
join its store, reconnect to its controller, ask every rank through the store what it is
(an apply would queue behind a cell that still runs), and record the ranks. Nothing on the
ranks changes: their variables, groups and mesh stay as they are. See launch/keep.py."""

from __future__ import annotations

import json
import os
import time

from ..core.errors import DistUsageError
from ..core.keep import format_duration
from ..core.output import one_line
from ..core.ranks import rank_label
from ..launch import startup
from . import left_output
from .left_output import LeftOutput

INFO_WAIT_S = 3.0  # for every rank's answer (a busy machine; dead ranks never answer)


def take_over(s, force: bool = False) -> str:
    """Make ``s`` (a Session over a kept session's connection data) drive it; the line
    that says what was taken over, and under it the last lines a cell that ended while no
    kernel was attached printed."""
    kept = s.keeper.kept
    took = s.keeper.claim(force)
    try:
        s.rendezvous.join(*kept.store)
        s.engines.client.attach(s.folder.profile_dir, kept.data["cluster_id"])
        world = s.world_size
        answers = s.rendezvous.ask(list(range(world)), "info", INFO_WAIT_S)
        infos = {r: json.loads(text) for r, text in answers.items()}
        s.engines.attach(kept.ranks(), {r: info["pid"] for r, info in infos.items()})
        s.rendezvous.resume(max((i.get("attempt", 0) for i in infos.values()), default=0))
        missing = {"pid": 0, "host": "?", "device": "?", "device_name": "?", "memory_used": None}
        rows = startup.rank_table(
            s.plan, s.engines, {r: infos.get(r, missing) for r in range(world)}
        )
        s.book.record(rows)
    except BaseException as e:
        s.keeper.release_claim()  # the session waits for a kernel again
        s.engines.client.close()
        if isinstance(e, (DistUsageError, KeyboardInterrupt)):
            raise
        raise DistUsageError(
            f"Attaching session {kept.name!r} failed: {one_line(e)}. It waits for a kernel "
            f"again; %dist_stop {kept.name} ends it."
        ) from None
    running = {r: i["cell"] for r, i in infos.items() if i.get("cell")}
    s.book.add_stuck(running)  # until their engines' queues drain (see supervision)
    ended = left_output.unseen(s, infos)  # cells that ended while no kernel was attached
    s.left_output = LeftOutput(s.folder.file("output"), running, ended, len(infos) == world)
    left = left_output.follow(s)  # what they printed while no kernel was attached; the
    # cells that ended on every rank they ran on
    ended_parts, shown = left_output.ended_text(s, left)
    dead = sorted(set(range(s.world_size)) - set(infos))
    return "\n".join([attach_line(s, took, dead, running, ended_parts), *shown])


def interrupt_left(s, ranks=None) -> list[int]:
    """SIGINT the ranks (of ``ranks``) that still run a cell a kernel before this one sent
    (see take_over); the ranks signalled."""
    import signal

    from ..core.ranks import parse_ranks
    from . import supervision

    chosen = set(parse_ranks(ranks, s.world_size)) if ranks is not None else None
    targets = sorted(r for r in supervision.still_stuck(s) if chosen is None or r in chosen)
    supervision.send_signal(s, signal.SIGINT, targets)
    return targets


def attach_line(
    s, took: str, dead: list[int], running: dict[int, dict], ended: list[str] = ()
) -> str:
    """What was attached, ranks that died while detached, the cell that still runs, and
    ``ended``: what each cell that ended unseen did (see left_output.ended_text)."""
    plan, kept = s.plan, s.keeper.kept
    where = f"{plan.backend}, GPUs {','.join(plan.gpus)}" if plan.gpus else plan.backend
    age = format_duration(time.time() - kept.data.get("started", kept.created))
    parts = [f"Attached session {kept.name!r}: {s.world_size} ranks ({where}), up {age}; {took}"]
    if dead:
        parts.append(f"{rank_label(dead)[1:-1]} died while detached (%dist_restart --hard)")
    if running:
        first = min(running.values(), key=lambda c: c.get("since") or 0)
        cell = f"In[{first['number']}]" if first.get("number") else "a cell"
        since = time.strftime("%H:%M:%S", time.localtime(first.get("since") or 0))
        out = os.path.join(s.folder.path, "output")
        parts.append(
            f"{cell} still runs on {rank_label(sorted(running))[1:-1]} since {since} "
            f"(%dist_stacks, %dist_interrupt; all its output so far, and more as it comes: "
            f"{out})"
        )
    parts += ended
    if s.reloader.on:  # kept with the session (see autoreload.py)
        parts.append("autoreload on (%dist_autoreload)")
    return "; ".join(parts) + "."
