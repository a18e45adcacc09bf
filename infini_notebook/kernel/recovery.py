"""Bringing a session back: the soft restart (new process groups under a fresh store prefix
on the same engines, variables kept), the hard restart (new engines), the rebuild after a
failed cell's release, and what to tell the user to run. Functions taking the Session (its
facade, ``Session.restart``, refuses a background cell and moves to the next attempt first);
they write the RankBook through its methods."""

from __future__ import annotations

import os

from ..core.errors import DistCellError, DistUsageError
from ..core.output import one_line
from ..core.plan import soft_restart_fails
from ..core.ranks import rank_label
from ..engine import bootstrap
from ..launch import startup
from . import left_output, supervision

STUCK_SETTLE_S = 3.0  # a soft restart waits this long for ranks still finishing a cell
HARD_FIX = "%dist_restart --hard"
HARD_RESTART = f"Run {HARD_FIX} to bring the session back (variables are lost)."


def soft_restart(s, after_failure: bool = False) -> None:
    """New process groups on the same engines, every variable kept. Refused (naming --hard)
    for a dead rank or one still running earlier code; a rebuild that failed half way leaves
    the groups marked not whole."""
    refuse_without_relay(s, "Cannot restart softly")
    dead = supervision.dead_ranks(s, range(s.world_size))
    if dead:
        raise DistUsageError(
            f"Cannot restart softly: {supervision.dead_text(dead)}. {replace_advice(dead)}"
        )
    stuck = supervision.stuck_ranks(s, settle=STUCK_SETTLE_S)
    left, covered = left_output.still_running(s, stuck)  # an earlier kernel's cell
    if left and set(stuck) <= set(covered):
        raise DistUsageError(f"Cannot restart softly: {left}.")
    if stuck:
        raise DistUsageError(
            f"Cannot restart softly: {rank_label(stuck)[1:-1]} still running earlier "
            "code (stuck in native code?). See %dist_stacks; use %dist_restart --hard."
        )
    attempt, nonce = s.rendezvous.attempt, s.rendezvous.nonce
    bind = bind_decision(s, range(s.world_size))  # asking changes nothing yet
    try:
        with s.engines.client.lock:
            pending = {
                r: s.engines.view(r).apply_async(
                    bootstrap.reinit_distributed, attempt, nonce, False, bind
                )
                for r in range(s.world_size)
            }
        infos = s.engines.client.gather(pending, what="restart", timeout=60)
    except DistCellError as e:
        s.book.groups_broken(f"a rebuild failed half way ({e.summary})", HARD_FIX)
        raise DistCellError(f"{e.summary}. Use %dist_restart --hard.", e.report, e.ranks) from None
    s.book.record(startup.rank_table(s.plan, s.engines, infos))
    if after_failure:
        s.book.groups_rebuilt()
    else:
        s.book.restarted(hard=False)


def replace_ranks(s, ranks: list[int], progress=None) -> None:
    """New engines for ``ranks`` only (dead, or alive and ended first); every other rank
    keeps its process and variables. Then every rank's process groups are made anew under
    the next attempt (Session.restart moved to it): the survivors as a soft restart does,
    the new ranks by their bootstrap, joining the same rendezvous. A step that fails says
    which, and leaves the groups marked not whole (``--hard`` brings all back)."""
    others = set(range(s.world_size)) - set(ranks)
    named = rank_label(sorted(ranks))[1:-1]
    refuse_without_relay(s, f"Cannot replace {named} alone")
    dead = supervision.dead_ranks(s, sorted(others))
    if dead:
        also = ",".join(map(str, sorted(set(ranks) | set(dead))))
        raise DistUsageError(
            f"Cannot replace {named} alone: "
            f"{supervision.dead_text(dead)} too. Run %dist_restart --ranks {also}."
        )
    # the replaced ranks' engines may still count the task they died in: not asked
    stuck = supervision.stuck_ranks(s, settle=STUCK_SETTLE_S, ranks=sorted(others))
    if stuck:
        raise DistUsageError(
            f"Cannot replace {named}: {rank_label(stuck)[1:-1]} "
            "still running earlier code (see %dist_stacks); wait, interrupt it, or run "
            "%dist_restart --hard."
        )
    step = "starting the new engines"
    try:
        s.engines.replace(sorted(ranks), progress)
        step = "making the process groups anew on every rank"
        attempt, nonce = s.rendezvous.attempt, s.rendezvous.nonce
        # the survivors abort their communicators on NCCL (peer_lost): none binds then
        bind = "nccl" not in s.plan.backend and bind_decision(s, sorted(others))
        with s.engines.client.lock:
            pending = {
                r: s.engines.view(r).apply_async(
                    bootstrap.reinit_distributed, attempt, nonce, True, bind
                )
                for r in sorted(others)
            }
            for r in ranks:
                cfg = startup.engine_config(s.plan, s.rendezvous, s.folder, r, s.engines.relay)
                cfg["bind_device"] = bind
                pending[r] = s.engines.view(r).apply_async(bootstrap.bootstrap, cfg)
        infos = s.engines.client.gather(pending, what="replace", timeout=s.plan.timeout + 60)
    except (DistCellError, DistUsageError) as e:
        why = e.summary if isinstance(e, DistCellError) else str(e)
        s.book.groups_broken(f"replacing {named} failed", HARD_FIX)
        raise DistCellError(
            f"Replacing {named} failed while {step}: {why}. {HARD_RESTART}",
            getattr(e, "report", ""),
            getattr(e, "ranks", []),
        ) from None
    s.book.record(startup.rank_table(s.plan, s.engines, dict(sorted(infos.items()))))
    s.book.replaced(ranks)


def relay_gone(s) -> str | None:
    """With --relay, which relays ended (their ranks' cells have no way there until a hard
    restart starts new ones); None while every relay runs, or without --relay."""
    relay = s.engines.relay
    return None if relay is None or relay.alive() else relay.gone_text()


def refuse_without_relay(s, what: str) -> None:
    gone = relay_gone(s)
    if gone is not None:
        raise DistUsageError(
            f"{what}: {gone}, and only a hard restart starts new relays. {HARD_RESTART}"
        )


def replace_advice(dead: dict[int, str]) -> str:
    """What to run after ranks died: replace them alone, or restart every rank."""
    ranks = ",".join(map(str, sorted(dead)))
    which = rank_label(sorted(dead))[1:-1]
    return (
        f"%dist_restart --ranks {ranks} starts {'a new' if len(dead) == 1 else 'new'} {which}; "
        "the others keep their variables "
        f"(%dist_restart --hard restarts all)."
    )


def hard_restart(s, progress=None) -> None:
    """New engines (variables are lost). If they cannot come up, an ordinary session stops
    rather than leave half a session running; a kept session never ends on its own: the
    error says which step failed, and its store, controller, watchdog and lease stay for
    another try (its processes are what the user kept it for)."""
    step = "stopping the old engines"
    try:
        # A running controller stays (see Client.ensure_controller), and the spare engines
        # forked while the session was idle become the ranks (see spares.py).
        s.engines.stop_engines(keep_standby=True)
        s.folder.remove_shared_files()
        s.book.restarted(hard=True)
        step = "bringing up the new engines and their process groups"
        s.book.record(startup.bring_up(s.plan, s.engines, s.rendezvous, s.folder, progress))
    except KeyboardInterrupt:
        if not s.keeper.keeps:
            s.stop()
        raise
    except Exception as e:
        why = e.summary if isinstance(e, DistCellError) else one_line(e)
        if s.keeper.keeps:
            raise DistCellError(
                f"Hard restart failed while {step}: {why}. The kept session "
                f"{s.keeper.name!r} stays (its store, controller and lease): run "
                f"{HARD_FIX} again, or %dist_stop to end it.",
                getattr(e, "report", ""),
                getattr(e, "ranks", []),
            ) from None
        s.stop()
        raise DistCellError(
            f"Hard restart failed while {step}: {why}. The session is stopped and nothing "
            "is left running: start a new one with %dist_start.",
            getattr(e, "report", ""),
            getattr(e, "ranks", []),
        ) from None


def bind_decision(s, ranks) -> bool:
    """Whether every rank binds its device at this rebuild: one answer for all, since a
    bound rank splits its groups from the world's communicator and an unbound one makes
    each anew, and mixed they wait on each other for ever (bootstrap.binds_device). No once
    any of ``ranks`` aborted communicators: a release on NCCL aborts only the ranks it
    released, so the others alone would still bind."""
    with s.engines.client.lock:
        pending = {r: s.engines.view(r).apply_async(bootstrap.can_bind) for r in ranks}
    what = "asking each rank whether it binds its device (nothing changed yet)"
    return all(s.engines.client.gather(pending, what=what, timeout=60).values())


def rebuild_after_release(s) -> str:
    """The soft restart after a release: new process groups, variables kept. Until one
    works, every command that needs the groups is refused (``Session.require_whole``)."""
    try:
        s.restart(after_failure=True)
    except Exception as e:
        s.book.groups_broken(f"the rebuild after the failure failed ({one_line(e)})", HARD_FIX)
        return f"Rebuilding the process groups failed ({one_line(e)}). {HARD_RESTART}"
    return (
        "The process groups were rebuilt (variables kept), so `groups` and `mesh` are new: "
        "re-create what you built on the old ones (DDP or FSDP modules, your own DeviceMesh "
        "or new_group)."
    )


def restart_advice(s, after_timeout: bool = False) -> str:
    """How to recover from a timed-out collective, for the session's backend."""
    why = soft_restart_fails(s.plan, os.environ)
    if why is not None:
        return f"{why[0].upper()}{why[1:]}: run %dist_restart --hard (variables are lost)."
    if after_timeout:
        return "%dist_restart rebuilds the process groups and keeps your variables."
    return "The process groups are likely broken: run %dist_restart (keeps variables)."
