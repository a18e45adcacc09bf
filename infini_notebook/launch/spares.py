"""Spare engines for the next hard restart: one per rank, forked from the template once the
session is idle and left so, registered with the controller. The next hard restart makes
them the ranks instead of forking and waiting for new ones (the engines' start is most of a
hard restart). Forked only when no rank has been busy for SPARES_AFTER_IDLE_S: their start,
about 0.1 s of CPU each, would otherwise slow the user's first cells after a start or
restart. A :class:`Standby` is written only here; Engines holds the current one."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import psutil

from ..core.state import Progress

log = logging.getLogger("infini_notebook")

SPARES_AFTER_IDLE_S = 1.0  # no rank busy this long before spare engines are forked
SPARES_POLL_S = 0.25
STANDBY_WAIT_S = 30.0  # for spare engines still registering; then new ones are forked


@dataclass
class Standby:
    template: psutil.Process  # the template it forks from: a replaced one ended it
    # The engine set's id once launched. Pending until the session is idle; cancelled then
    # (by a hard restart or stop before that), it is never launched.
    launch: Future = field(default_factory=Future)
    known: set[int] = field(default_factory=set)  # engine ids registered before it: not its
    cluster: Any = None  # the ipyparallel Cluster it was launched in (a hard restart replaces
    # a dead controller's: its spares are unusable, and only that Cluster can stop them)


def launch_when_idle(engines, standby: Standby, idle_for) -> None:
    """From any thread: have the session's loop launch ``standby`` at the first idle moment."""
    engines.client.call_soon(_try_launch, engines, standby, idle_for, time.monotonic())


def _try_launch(engines, standby: Standby, idle_for, since: float) -> None:
    """On the session's loop: launch ``standby`` once no rank has been busy for
    SPARES_AFTER_IDLE_S (nor since ``since``), or look again soon. Never blocks the loop:
    the client's lock is only tried (its holder may be waiting for this loop)."""
    import asyncio

    from . import launchers

    if engines.standby is not standby or standby.launch.done():
        return  # taken, ended or cancelled meanwhile
    if not engines.template.alive():  # engines would start as new processes: not worth it
        standby.launch.cancel()
        return
    client = engines.client
    quiet = min(idle_for(), time.monotonic() - since)
    if quiet < SPARES_AFTER_IDLE_S or not client.lock.acquire(blocking=False):
        client.call_later(SPARES_POLL_S, _try_launch, engines, standby, idle_for, since)
        return
    try:
        if not client.connected or not standby.launch.set_running_or_notify_cancel():
            return
        try:  # from here on the future must settle: a hard restart waits for it
            standby.known = client.ids()
            standby.cluster = client.cluster
            profile_dir = engines.folder.profile_dir
            options = launchers.engine_options(engines.plan, profile_dir)
            options["template_socket"] = launchers.template_socket(profile_dir)
            launch = client.cluster.start_engines(engines.plan.world_size, **options)
            asyncio.ensure_future(launch).add_done_callback(partial(_settle, standby.launch))
        except Exception as e:
            standby.launch.set_exception(e)
    finally:
        client.lock.release()


def _settle(future: Future, task) -> None:
    """The launch task's outcome, to the future the kernel's threads wait on."""
    if task.exception() is not None:
        future.set_exception(task.exception())
    else:
        future.set_result(task.result())


def take(engines, standby: Standby | None, progress: Progress | None):
    """``(set id, launch note, engine ids)`` of the spares, now the ranks' set; None (and the
    spares ended) when there are none, or they are not all there: forked by a template
    since replaced, or one died."""
    if standby is None or standby.launch.cancel():  # not forked yet: nothing to wait for
        return None
    client, world = engines.client, engines.plan.world_size
    try:
        set_id = standby.launch.result(timeout=STANDBY_WAIT_S)
        if standby.cluster is not client.cluster:
            raise RuntimeError("the controller they registered with is gone")
        engine_set = client.cluster.engines[set_id]
        alive = standby.template is engines.template.process
        if not alive or engine_set.state != "running":
            raise RuntimeError("the spare engines' template is gone")
        if len(engine_set.launchers) < world:  # its launcher saw one end
            raise RuntimeError("a spare engine ended")
        eids = engines.wait_for_engines(progress, standby.known, set_id, STANDBY_WAIT_S)
    except Exception as e:
        log.warning("a hard restart forks new engines: the spare ones are unusable (%s)", e)
        end(engines, standby)
        return None
    return set_id, engines.launch_note(engine_set), eids


def count(engines, standby: Standby | None) -> int:
    """The spare engines launched and still running (0 until they are forked)."""
    if standby is None or not standby.launch.done() or standby.launch.cancelled():
        return 0
    if standby.launch.exception() is not None:
        return 0
    engine_set = engines.client.cluster.engines.get(standby.launch.result())
    return len(getattr(engine_set, "launchers", {}))


def end(engines, standby: Standby) -> None:
    """Kill the spare engines (by the pids their launcher recorded) and drop their set."""
    if standby.launch.cancel():
        return  # never launched: nothing of it runs
    try:
        set_id = standby.launch.result(timeout=STANDBY_WAIT_S)
    except Exception:
        return  # never launched: nothing of it runs
    engines.stop_engine_sets([set_id], standby.cluster)
