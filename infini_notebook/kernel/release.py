"""Releasing the waits of a running cell that can never finish: the ranks that left it end
their process groups, and the ranks waiting in vain let go (gloo: close their connections;
NCCL: abort their communicators), through the store's answering thread and ipyparallel.
``watch.py`` decides when and whom (with ``core/waits.py``); this is how.
"""

from __future__ import annotations

import json
import logging

from ..core import waits
from ..engine import bootstrap

log = logging.getLogger("infini_notebook")

ASK_WAIT_S = 1.0  # answers come from a thread beside the cell: quick, unless the host is busy


def end_groups(s, ending: list[int], blocked: list[int], gone: dict[int, str]) -> None:
    """Release waits on the ranks ``ending`` (they left the cell, alive): they end their
    process groups and close their connections to every other rank (gloo: a wait on such a
    connection raises 'Connection closed by peer'; a dead rank's closed with it). Only
    groups that hold a rank that left are touched: a connection joins two ranks' processes
    and serves only groups holding both.

    The ``blocked`` ranks (waiting in vain) are leaving too. On gloo they shut down their
    connections to each other and to the ranks that left, from their answering thread: a
    ring or tree collective waits on neighbours only, so releasing only the ranks next to
    the one that left took a round per hop (8 ranks: four rounds, 1.3-4 s). On NCCL they
    abort their communicators: only an abort ends a wait in NCCL."""
    nccl = "nccl" in s.plan.backend
    if blocked:  # first, before anything of theirs is cut: see rank_services.release
        s.rendezvous.ask(blocked, f"release {s.attempt}", ASK_WAIT_S)
    links: dict[int, list] = {}
    if ending or (blocked and not nccl):
        alive = [r for r in range(s.world_size) if gone.get(r) != "died" and r not in ending]
        answers = s.rendezvous.ask(alive, "links", ASK_WAIT_S)
        links = {r: json.loads(text) for r, text in answers.items()}
    if ending:
        peer_links = [link for own in links.values() for link in own]
        with s.engines.client.lock:
            ar = s.engines.view(ending).apply_async(bootstrap.release_groups, peer_links)
    if blocked and nccl:
        s.rendezvous.ask(blocked, f"abort {s.attempt}", ASK_WAIT_S)
    elif blocked:
        leaving = set(blocked) | {r for r, why in gone.items() if why != "died"}
        close = {r: waits.links_between(links, r, leaving) for r in blocked}
        questions = {r: f"close {s.attempt} {json.dumps(own)}" for r, own in close.items() if own}
        if questions:
            s.rendezvous.ask(sorted(questions), questions, ASK_WAIT_S)
    if ending:
        try:
            log.debug("released %s (%s): %s", ending, blocked, ar.get(timeout=10))
        except Exception as e:
            log.warning("ending the process groups of %s: %s", ending, e)
        s.engines.client.forget(ar.msg_ids)
