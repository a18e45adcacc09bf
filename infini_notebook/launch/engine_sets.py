"""The ranks' engines as ipyparallel engine sets: forked from the warm template (see
template.py) or started the usual way, waited for and mapped to ranks; the spare set kept
for the next hard restart (``Standby``); and stopping sets, or everything the session
started. Plain functions taking the Session; the controller, the client and the plumbing
they go through are processes.py's."""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import psutil

from ..core.errors import DistCellError, DistUsageError
from ..core.output import one_line
from ..core.plan import SessionPlan
from ..core.state import Progress
from ..engine import bootstrap
from ..kernel import supervision
from .processes import (
    close_client,
    ensure_controller,
    forget,
    in_loop,
    own_process,
    remove_quietly,
    start_advice,
    stop_controller,
)

log = logging.getLogger("infini_notebook")


SPARES_AFTER_IDLE_S = 1.0  # no rank busy this long before spare engines are forked
SPARES_POLL_S = 0.25


@dataclass
class Standby:
    """A spare engine per rank, forked from the template once the session is idle and left
    so, registered with the controller: the next hard restart makes them the ranks instead
    of forking and waiting for new ones (the engines' start is most of a hard restart).
    Forked only when no rank has been busy for SPARES_AFTER_IDLE_S: their start, about 0.1 s
    of CPU each, would otherwise slow the user's first cells after a start or restart."""

    template: psutil.Process  # the template it forks from: a replaced one ended it
    # The engine set's id once launched. Pending until the session is idle; cancelled then
    # (by a hard restart or stop before that), it is never launched.
    launch: Future = field(default_factory=Future)
    known: set[int] = field(default_factory=set)  # engine ids registered before it: not its
    cluster: Any = None  # the ipyparallel Cluster it was launched in (a hard restart replaces
    # a dead controller's: its spares are unusable, and only that Cluster can stop them)


def start_engines(s, progress: Progress | None) -> None:
    """The controller (unless it still runs: a hard restart keeps it), then the engines,
    each mapped to its rank."""
    from . import launchers  # imports ipyparallel's launchers

    ensure_template(s)  # first: its imports overlap the controller's start
    ensure_controller(s)
    eids = take_standby(s, progress) or launch_engines(s, progress)
    ar = s.engines.client[eids].apply_async(bootstrap.identity)
    identities = ar.get_dict(timeout=60)
    forget(s, ar.msg_ids)
    s.engines.eids = launchers.assign_ranks(identities, s.plan)
    launchers.check_placement([identities[e] for e in s.engines.eids], s.plan)
    # Known from now on, so that a failed bootstrap can stop every engine at once.
    for r, eid in enumerate(s.engines.eids):
        proc = own_process(s, identities[eid]["pid"])
        if proc is not None:
            s.engines.pids[r] = proc


def launch_engines(s, progress: Progress | None) -> list[int]:
    """One new engine per rank; their ids once all registered."""
    from . import launchers

    known = set(s.engines.client.ids)  # a hard restart's old engines may linger there a moment
    options = launchers.engine_options(s.plan, s._profile_dir)
    if not s.plan.template_off:
        options["template_socket"] = template_ready(s, progress)
    s.engines.set_id = in_loop(s, s.engines.cluster.start_engines(s.world_size, **options))
    s.engines.how = launch_note(s, s.engines.cluster.engines[s.engines.set_id])
    return wait_for_engines(s, progress, known)


def plan_standby(s) -> None:
    """Fork spare engines (see Standby) once the session is idle, without waiting for
    them: the session's loop watches for the moment and runs the launch."""
    if s.plan.template_off or not template_alive(s) or s.engines.standby is not None:
        return
    standby = Standby(s.engines.template)
    s.engines.standby = standby
    since = time.monotonic()
    s.engines.loop.call_soon_threadsafe(launch_when_idle, s, standby, since)


def launch_when_idle(s, standby: Standby, since: float) -> None:
    """On the session's loop: launch ``standby`` once no rank has been busy for
    SPARES_AFTER_IDLE_S (nor since ``since``), or look again soon. Never blocks the loop:
    the client's lock is only tried (its holder may be waiting for this loop)."""
    import asyncio

    from ..kernel import execution
    from . import launchers

    if s.engines.standby is not standby or standby.launch.done():
        return  # taken, ended or cancelled meanwhile
    if not template_alive(s):  # engines would start as new processes: not worth it idle
        standby.launch.cancel()
        return
    quiet = min(execution.idle_for(s), time.monotonic() - since)
    if quiet < SPARES_AFTER_IDLE_S or not s.engines.lock.acquire(blocking=False):
        s.engines.loop.call_later(SPARES_POLL_S, launch_when_idle, s, standby, since)
        return
    try:
        if s.engines.client is None or not standby.launch.set_running_or_notify_cancel():
            return
        try:  # from here on the future must settle: a hard restart waits for it
            standby.known = set(s.engines.client.ids)
            standby.cluster = s.engines.cluster
            options = launchers.engine_options(s.plan, s._profile_dir)
            options["template_socket"] = launchers.template_socket(s._profile_dir)
            launch = s.engines.cluster.start_engines(s.world_size, **options)
            asyncio.ensure_future(launch).add_done_callback(partial(settle, standby.launch))
        except Exception as e:
            standby.launch.set_exception(e)
    finally:
        s.engines.lock.release()


def settle(future: Future, task) -> None:
    """The launch task's outcome, to the future the kernel's threads wait on."""
    if task.exception() is not None:
        future.set_exception(task.exception())
    else:
        future.set_result(task.result())


STANDBY_WAIT_S = 30.0  # for spare engines still registering; then new ones are forked


def take_standby(s, progress: Progress | None) -> list[int] | None:
    """The spare engines' ids, now the ranks' set; None (and the spares ended) when there
    are none, or they are not all there: forked by a template since replaced, or one died."""
    standby, s.engines.standby = s.engines.standby, None
    if standby is None or standby.launch.cancel():  # not forked yet: nothing to wait for
        return None
    try:
        set_id = standby.launch.result(timeout=STANDBY_WAIT_S)
        if standby.cluster is not s.engines.cluster:
            raise RuntimeError("the controller they registered with is gone")
        engine_set = s.engines.cluster.engines[set_id]
        if standby.template is not s.engines.template or engine_set.state != "running":
            raise RuntimeError("the spare engines' template is gone")
        if len(engine_set.launchers) < s.world_size:  # its launcher saw one end
            raise RuntimeError("a spare engine ended")
        eids = wait_for_engines(s, progress, standby.known, timeout=STANDBY_WAIT_S)
    except Exception as e:
        log.warning("a hard restart forks new engines: the spare ones are unusable (%s)", e)
        end_standby(s, standby)
        return None
    s.engines.set_id = set_id
    s.engines.how = launch_note(s, engine_set) + ", ahead of this restart"
    return eids


def spare_count(s) -> int:
    """The spare engines launched and still running (0 until they are forked)."""
    standby = s.engines.standby
    if standby is None or not standby.launch.done() or standby.launch.cancelled():
        return 0
    if standby.launch.exception() is not None:
        return 0
    engine_set = s.engines.cluster.engines.get(standby.launch.result())
    return len(getattr(engine_set, "launchers", {}))


def end_standby(s, standby: Standby) -> None:
    """Kill the spare engines (by the pids their launcher recorded) and drop their set."""
    if standby.launch.cancel():
        return  # never launched: nothing of it runs
    try:
        set_id = standby.launch.result(timeout=STANDBY_WAIT_S)
    except Exception:
        return  # never launched: nothing of it runs
    stop_engine_sets(s, [set_id], standby.cluster)


def ensure_template(s) -> None:
    """Start the warm template (see template.py) unless the plan starts engines the usual
    way or one already runs: a hard restart forks from the one the first start warmed.
    The template starts with the engines' environment, so what an interpreter reads as it
    starts (PYTHONPATH, LD_PRELOAD, an --env of the user's) is what a new engine would
    read; a kernel whose environment changed since gets a new template."""
    from . import launchers, template_client

    if s.plan.template_off:
        return
    env = launchers.template_env(s.plan)
    if template_alive(s) and s.engines.template_env == env:
        return
    end_template(s)
    path = launchers.template_socket(s._profile_dir)
    remove_quietly(path)  # a dead template's: a new one must not be taken as ready
    s.engines.template = template_client.start_template(
        env, s._profile_dir, path, os.path.join(s._workdir, "template.log")
    )
    s.engines.template_env = env


def template_alive(s) -> bool:
    from .template_client import alive

    return s.engines.template is not None and alive(s.engines.template)


def template_ready(s, progress: Progress | None) -> str:
    """The template's socket once it listens; "" (engines start the usual way, and
    ``launch_note`` says why) if it cannot fork: its log's last line is the reason."""
    from . import launchers, template_client

    path = launchers.template_socket(s._profile_dir)
    if progress:
        progress(0, s.world_size, "warming the template")
    try:
        template_client.wait_ready(s.engines.template, path)
        return path
    except template_client.TemplateUnavailable as e:
        log.warning("engines start without the template: %s", e)
        end_template(s)
        return ""


def template_rss(s) -> int | None:
    try:
        return s.engines.template.memory_info().rss if template_alive(s) else None
    except psutil.Error:
        return None


def end_template(s) -> None:
    """The template and what it forked that is still there: nannies outlive their engines
    for a while (each tries for up to 3 s to tell the controller), which held a stop at 16
    ranks for 1.5 s and slowed the controller's. Killed while the template still reaps."""
    if s.engines.template is None:
        return
    from .watchdog import end_all

    try:
        forked = s.engines.template.children()
    except psutil.Error:
        forked = []
    end_all(forked, grace=0)
    end_all([s.engines.template], grace=0)
    s.engines.template = None


def launch_note(s, engine_set) -> str:
    """How the engines came up, for %dist_start's line: forked, or why they were not."""
    from .template_launcher import FORKED

    if s.plan.template_off:
        return f"engines started as new processes ({s.plan.template_off})"
    reasons = sorted({why for why in engine_set.how() if why != FORKED})
    if not reasons:
        return "engines " + FORKED
    return f"engines started as new processes ({'; '.join(reasons)})"


def wait_for_engines(
    s, progress: Progress | None, known: set[int], timeout: float = 120
) -> list[int]:
    """The ids of the world_size engines that registered after ``known`` were there."""
    deadline = time.monotonic() + timeout
    note, asked = "engines up", 0.0
    while len(new := sorted(set(s.engines.client.ids) - known)) < s.world_size:
        if progress:
            progress(len(new), s.world_size, note)
        stopped = [es for es in s.engines.cluster.engines.values() if es.state == "after"]
        if stopped:
            raise EnginesExited(stopped[0])
        if time.monotonic() - asked > 1:  # a batch job: ask its scheduler, not too often
            note, asked = check_batch_job(s) or note, time.monotonic()
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"only {len(new)} of {s.world_size} engines came up in {timeout}s ({note})"
            )
        time.sleep(0.05)
    if progress:
        progress(s.world_size, s.world_size, "engines up")
    return new


def check_batch_job(s) -> str | None:
    """The batch job's state for the progress line (None for other launchers); raises
    DistUsageError when the job will never bring its engines up (see slurm.py)."""
    for es in s.engines.cluster.engines.values():
        if hasattr(es, "start_check"):
            problem, note = es.start_check()
            if problem:
                raise DistUsageError(problem)
            return note
    return None


def stop_processes(s) -> None:
    """Engines and controller (the store and the watchdog stay: see Session.stop)."""
    close_client(s)
    stop_engines(s)  # first: a controller stopped while ours die takes ~1.5 s longer
    end_template(s)  # with the nannies it forked, before they talk to the controller
    stop_controller(s)
    supervision.kill_leftovers(s)
    s.engines.pids = {}


def stop_engines(s, keep_standby: bool = False) -> None:
    """The engines only: a hard restart keeps the controller and the client (and the spare
    engines it is about to use)."""
    engines = supervision.kill_engines(s)  # see supervision.kill_engines
    standby, s.engines.standby = s.engines.standby, None
    if keep_standby:
        s.engines.standby = standby
    elif standby is not None:
        end_standby(s, standby)
    cluster = s.engines.cluster
    if cluster is not None:
        stop_engine_sets(s, [s.engines.set_id] if keep_standby else list(cluster.engines))
    psutil.wait_procs(engines, timeout=5)


def stop_engine_sets(s, set_ids: list[str], cluster: Any = None) -> None:
    """These engine sets: their engines killed at once when they are local forks (see
    supervision.kill_engines; psutil checks each one's start time), then stopped by
    ipyparallel. Other launchers' processes (mpiexec, ssh, srun) are left to ipyparallel's
    stop: killed outright, they could not end the engines they started elsewhere. The sets
    are ``cluster``'s (default: the session's)."""
    cluster = cluster or s.engines.cluster
    if cluster is None:
        return
    procs = [
        launcher.process
        for set_id in set_ids
        for launcher in getattr(cluster.engines.get(set_id), "launchers", {}).values()
        if not s.plan.template_off and getattr(launcher, "process", None) is not None
    ]
    supervision.kill(procs)
    for set_id in set_ids:
        if set_id in cluster.engines:
            try:
                in_loop(s, cluster.stop_engines(set_id))
            except Exception as e:
                log.warning("stopping the engines: %s", e)
    psutil.wait_procs(procs, timeout=5)


class EnginesExited(RuntimeError):
    """Engines ended before registering; carries the tail of what they printed."""

    def __init__(self, engine_set, lines: int = 20):
        exits = (engine_set.stop_data or {}).get("engines", {})
        failed = {i: d.get("exit_code") for i, d in exits.items() if d.get("exit_code")}
        ident, code = next(iter(failed.items()), next(iter(exits.items()), ("?", None)))
        more = f" ({len(exits) - 1} more engines exited)" if len(exits) > 1 else ""
        super().__init__(
            f"engine {ident} exited while starting ({supervision.exit_description(code)}){more}"
        )
        try:
            output = engine_set.get_output()
        except Exception:
            output = ""
        self.output = "".join(output.splitlines(True)[-lines:])


def start_error(plan: SessionPlan, e: Exception) -> DistCellError:
    """What a failed start says: the cause (an engine's own output when it exited) and
    advice that fits where the ranks run."""
    place = plan.placement
    cause = str(e) if isinstance(e, EnginesExited) else one_line(e)
    output = getattr(e, "output", "").rstrip()
    seen = " (its output is above)" if output else ""
    return DistCellError(
        f"Starting {plan.world_size} ranks with the {place.launcher} launcher failed: "
        f"{cause}{seen}. Nothing is left running. {start_advice(plan)}",
        f"{output}\n" if output else "",
    )
