"""The ranks' engines as ipyparallel engine sets: forked from the warm template (see
template.py) or started the usual way, waited for and mapped to ranks; spare engines kept
for the next hard restart (spares.py); stopping sets, or everything the session started.
:class:`Engines` is the only writer of which engine serves which rank, their local
processes, the template and the spares; the client and controller are client.py's."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import psutil

from ..core.errors import DistUsageError
from ..core.plan import SessionPlan
from ..core.state import Progress
from ..engine import bootstrap
from . import spares
from .client import Client
from .folder import SessionFolder
from .relay import RelayLink
from .start_errors import EnginesExited
from .warm_template import WarmTemplate
from .watchdog import MARK, end_all, session_processes, wait_gone

log = logging.getLogger("infini_notebook")


class Engines:
    def __init__(self, plan: SessionPlan, folder: SessionFolder, warmed=None):
        from . import launchers

        self.plan, self.folder = plan, folder
        self.client = Client(folder.file("errors.log"))  # machinery tracebacks go there
        self.template = WarmTemplate(warmed, launchers.template_env(plan) if warmed else None)
        self._eids: list[int] = []  # engine id of each rank
        self._pids: dict[int, psutil.Process] = {}  # ranks whose engine is ours, on this host
        self._set_id = ""  # the ranks' engine set (ipyparallel's), stopped by a hard restart
        self._replacements: list[str] = []  # sets of engines that replaced single ranks
        self.how = ""  # how the last engines came up (see launch_note), for the ready line
        self._standby: spares.Standby | None = None  # engines forked for the next hard restart
        self.relay: RelayLink | None = (
            None  # --relay: the cells' way (relay.py), kept as the controller is
        )

    # ----- read-only views ------------------------------------------------------------------
    def local(self, rank: int) -> psutil.Process | None:
        """The rank's engine process when it is one of ours on this host."""
        return self._pids.get(rank)

    @property
    def pids(self) -> dict[int, psutil.Process]:
        return dict(self._pids)

    def eid(self, rank: int) -> int:
        return self._eids[rank]

    @property
    def mapped(self) -> bool:
        return bool(self._eids)

    @property
    def standby(self) -> spares.Standby | None:
        return self._standby

    def view(self, ranks: int | list[int]):
        """ipyparallel's view of one rank's engine, or of several ranks' engines."""
        if isinstance(ranks, int):
            return self.client.view(self._eids[ranks])
        return self.client.view([self._eids[r] for r in ranks])

    def forget(self, ar) -> None:
        """A finished request's records: ipyparallel's, or the relay's."""
        self.client.forget(ar.msg_ids)
        if self.relay is not None:
            self.relay.forget(ar)

    def busy_relayed(self) -> set[int]:
        """Ranks that have not answered a relayed cell (none without --relay)."""
        return self.relay.busy() if self.relay is not None else set()

    def adopt(self, rank: int, pid: int) -> None:
        """The rank's engine reported ``pid``: known from now on if it is ours here."""
        proc = own_process(self.folder.profile_dir, pid)
        if proc is not None:
            self._pids[rank] = proc

    # ----- start ------------------------------------------------------------------------------
    def start(self, progress: Progress | None) -> None:
        """The controller (unless it still runs: a hard restart keeps it), then the engines,
        each mapped to its rank."""
        from . import launchers  # imports ipyparallel's launchers

        self._ensure_template()  # first: its imports overlap the controller's start
        self.client.ensure_controller(self.plan, self.folder.profile_dir, self._ready_template())
        self._hand_over_controller()
        self._ensure_relay()
        eids = self._take_standby(progress) or self._launch(progress)
        ar = self.client.view(eids).apply_async(bootstrap.identity)
        identities = ar.get_dict(timeout=60)
        self.client.forget(ar.msg_ids)
        self._eids = launchers.assign_ranks(identities, self.plan)
        launchers.check_placement([identities[e] for e in self._eids], self.plan)
        # Known from now on, so that a failed bootstrap can stop every engine at once.
        for r, eid in enumerate(self._eids):
            self.adopt(r, identities[eid]["pid"])
        if self.relay is not None:  # new engines: each says hello from its bootstrap
            self.relay.ranks_left(list(range(self.plan.world_size)))
            self.relay.map_engines(dict(enumerate(self._eids)))
        self._write_map()

    def _ensure_relay(self) -> None:
        """The relays of the ranks' hosts (relay_hosts.py), started once (a hard restart
        keeps them, or replaces them if one ended)."""
        if self.relay is not None and not self.relay.alive():
            self.relay.stop()
            self.relay = None
        if not self.plan.relay or self.relay is not None:
            return
        from ..core import signing
        from . import relay_hosts

        mark = {MARK: self.folder.profile_dir}  # a process of the session's: see watchdog.py
        key, network = signing.new_key(), relay_hosts.network(self.plan)
        self.relay = RelayLink(self.folder.path, key, self.client, mark, network)
        self.client.on_unregister(self.relay.engine_gone)  # a dead rank's part fails at once
        self.relay.add_hosts(relay_hosts.hosts(self.plan))

    def _write_map(self) -> None:
        """The rank -> engine map in the session's folder: what a kernel attaching a kept
        session reads (see kept_sessions.py)."""
        import json

        from .kept_sessions import RANKS, write_private

        proc = self.template.process
        template = [proc.pid, proc.create_time()] if self.template.alive() else None
        body = {
            "eids": self._eids,
            "set_id": self._set_id,
            "replacements": self._replacements,
            "how": self.how,
            "template": template,
        }
        write_private(self.folder.file(RANKS), json.dumps(body).encode())

    def attach(self, mapped: dict, pids: dict[int, int]) -> None:
        """A kept session's engines, as the kernel that drove it left them (``mapped``:
        kept_sessions.Kept.ranks()); ``pids``: each live rank's engine pid. Spare engines that
        kernel forked are ended (this one forks its own once idle)."""
        self._eids, self._set_id, self.how = list(mapped["eids"]), mapped["set_id"], mapped["how"]
        self._replacements = list(mapped.get("replacements", []))
        for r, pid in pids.items():
            self.adopt(r, pid)
        self._hand_over_controller()
        cluster = self.client.cluster
        ranks_sets = {self._set_id, *self._replacements}
        spare = [s for s in (cluster.engines if cluster else {}) if s not in ranks_sets]
        # ended and forgotten: an ended set left in the cluster made the next hard
        # restart's wait for its engines fail ("engine ... exited while starting")
        self.stop_engine_sets(spare, local=True)

    def replace(self, ranks: list[int], progress: Progress | None) -> None:
        """New engines for ``ranks`` (their old ones gone or ended first), on their hosts,
        forked by the warm template where there is one; every other rank's engine stays.
        Bootstrapping them is the caller's (kernel/recovery.replace_ranks)."""
        from . import launchers

        options = launchers.replacement_options(self.plan, self.folder.profile_dir, ranks)
        old = [p for r in ranks if (p := self._pids.pop(r, None)) is not None]
        kill(old)  # a rank replaced while alive (hung, its GPU context lost)
        wait_gone(old, 5)
        if not self.plan.template_off and self.template.alive():
            options["template_socket"] = self.template.ready(
                self.folder.profile_dir, progress, len(ranks)
            )
        known = self.client.ids()
        cluster = self.client.cluster
        set_id = self.client.in_loop(cluster.start_engines(len(ranks), **options))
        self._replacements.append(set_id)
        eids = self.wait_for_engines(progress, known, set_id, count=len(ranks))
        ar = self.client.view(eids).apply_async(bootstrap.identity)
        identities = ar.get_dict(timeout=60)
        self.client.forget(ar.msg_ids)
        for r, eid in launchers.assign_replacements(identities, self.plan, ranks).items():
            self._eids[r] = eid
            self.adopt(r, identities[eid]["pid"])
        if self.relay is not None:
            self.relay.ranks_left(ranks)
            self.relay.map_engines({r: self._eids[r] for r in ranks})
        self._write_map()

    def _launch(self, progress: Progress | None) -> list[int]:
        """One new engine per rank; their ids once all registered."""
        from . import launchers

        known = self.client.ids()  # a hard restart's old engines may linger there a moment
        options = launchers.engine_options(self.plan, self.folder.profile_dir)
        if not self.plan.template_off:
            options["template_socket"] = self.template.ready(
                self.folder.profile_dir, progress, self.plan.world_size
            )
        cluster = self.client.cluster
        self._set_id = self.client.in_loop(cluster.start_engines(self.plan.world_size, **options))
        self.how = self.launch_note(cluster.engines[self._set_id])
        return self.wait_for_engines(progress, known, self._set_id)

    def _hand_over_controller(self) -> None:
        """A controller the template forked is stopped by ipyparallel, not with what the
        template forked (see WarmTemplate.hand_over)."""
        controller = self.client.controller_process()
        if controller is not None:
            self.template.hand_over(controller.pid)

    def _ready_template(self) -> str:
        """The template's socket if it serves already (one warmed at %load_ext, or a hard
        restart's), else "": waiting for one still importing torch would hold the
        controller back."""
        from . import launchers

        path = launchers.template_socket(self.folder.profile_dir)
        usable = not self.plan.template_off and self.template.alive()
        return path if usable and os.path.exists(path) else ""

    def _ensure_template(self) -> None:
        """Unless the plan starts engines the usual way (see WarmTemplate.ensure)."""
        from . import launchers

        if not self.plan.template_off:
            env = launchers.template_env(self.plan)
            self.template.ensure(env, self.folder.profile_dir, self.folder.file("template.log"))

    def launch_note(self, engine_set) -> str:
        """How the engines came up, for %dist_start's line: forked, or why they were not."""
        from .template_launcher import FORKED

        if self.plan.template_off:
            return f"engines started as new processes ({self.plan.template_off})"
        reasons = sorted({why for why in engine_set.how() if why != FORKED})
        if not reasons:
            return "engines " + FORKED
        return f"engines started as new processes ({'; '.join(reasons)})"

    def wait_for_engines(
        self,
        progress: Progress | None,
        known: set[int],
        set_id: str,
        timeout: float = 120,
        count: int | None = None,
    ) -> list[int]:
        """The ids of the ``count`` (world_size) engines that registered after ``known``;
        EnginesExited when the engine set ``set_id`` (the one they come from) ended first.
        Other sets do not count: an earlier kernel's spares, ended at an attach, and the
        set a hard restart just stopped."""
        world = self.plan.world_size if count is None else count
        deadline = time.monotonic() + timeout
        note, asked = "engines up", 0.0
        while len(new := sorted(self.client.ids() - known)) < world:
            if progress:
                progress(len(new), world, note)
            engine_set = self.client.cluster.engines.get(set_id)
            if engine_set is None or engine_set.state == "after":
                raise EnginesExited(engine_set)
            if time.monotonic() - asked > 1:  # a batch job: ask its scheduler, not too often
                note, asked = self._check_batch_job() or note, time.monotonic()
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"only {len(new)} of {world} engines came up in {timeout}s ({note})"
                )
            # woken by the next registration: a 50 ms poll cost a start 25 ms on average
            self.client.wait_for_registration(0.25)
        if progress:
            progress(world, world, "engines up")
        return new

    def _check_batch_job(self) -> str | None:
        """The batch job's state for the progress line (None for other launchers); raises
        DistUsageError when the job will never bring its engines up (see slurm.py)."""
        for es in self.client.cluster.engines.values():
            if hasattr(es, "start_check"):
                problem, note = es.start_check()
                if problem:
                    raise DistUsageError(problem)
                return note
        return None

    # ----- spares (see spares.py) -----------------------------------------------------------
    def plan_standby(self, idle_for) -> None:
        """Fork spare engines once the session is idle (``idle_for()`` seconds since a rank
        was busy), without waiting for them: the session's loop watches for the moment."""
        if self.plan.template_off or not self.template.alive() or self._standby is not None:
            return
        self._standby = spares.Standby(self.template.process)
        spares.launch_when_idle(self, self._standby, idle_for)

    def _take_standby(self, progress: Progress | None) -> list[int] | None:
        """The spare engines' ids, now the ranks' set; None (and the spares ended) when there
        are none, or they are not all there."""
        standby, self._standby = self._standby, None
        taken = spares.take(self, standby, progress)
        if taken is None:
            return None
        self._set_id, how = taken[0], taken[1]
        self.how = how + ", ahead of this restart"
        return taken[2]

    def spare_count(self) -> int:
        return spares.count(self, self._standby)

    # ----- stop -------------------------------------------------------------------------------
    def stop_all(self) -> None:
        """Engines, relay and controller (the store and the watchdog stay: see Session.stop)."""
        if self.relay is not None:
            self.relay.stop()
            self.relay = None
        self.client.close()
        # the nannies and spare engines die with the engines, not after ipyparallel's stop
        self.template.kill_forked()
        self.stop_engines()  # first: a controller stopped while ours die takes ~1.5 s longer
        # the controller before the template when the template forked it: the template reaps
        # it (orphaned, it stayed a zombie until PID 1 reaped it: for ever under a PID 1
        # that does not); its nannies got SIGKILL above, so none talks to it any more
        self.client.stop_controller(self.folder.profile_dir)
        self.template.end()
        self._kill_leftovers()
        self._pids = {}

    def stop_engines(self, keep_standby: bool = False) -> None:
        """The engines only: a hard restart keeps the controller and the client (and the
        spare engines it is about to use)."""
        engines = self._kill_engines()
        standby, self._standby = self._standby, None
        if keep_standby:
            self._standby = standby
        elif standby is not None:
            spares.end(self, standby)
        cluster = self.client.cluster
        if cluster is not None:
            ours = [self._set_id, *self._replacements]
            self.stop_engine_sets(ours if keep_standby else list(cluster.engines))
            self._replacements = []
        wait_gone(engines, 5)  # by their exits: an attached kernel is not their parent
        if keep_standby:  # a hard restart: the next engines' pids come with them
            self._pids = {}

    def stop_engine_sets(
        self, set_ids: list[str], cluster: Any = None, local: bool = False
    ) -> None:
        """These engine sets: their engines killed at once when they are local forks (see
        _kill_engines; psutil checks each one's start time; ``local``: they are, whatever
        the plan says), then stopped by ipyparallel. Other launchers' processes (mpiexec,
        ssh, srun) are left to ipyparallel's stop: killed outright, they could not end the
        engines they started elsewhere. The sets are ``cluster``'s (default: the session's)."""
        cluster = cluster or self.client.cluster
        if cluster is None:
            return
        forked = local or not self.plan.template_off
        procs = [
            launcher.process
            for set_id in set_ids
            for launcher in getattr(cluster.engines.get(set_id), "launchers", {}).values()
            if forked and getattr(launcher, "process", None) is not None
        ]
        kill(procs)
        for set_id in set_ids:
            if set_id in cluster.engines:
                try:
                    self.client.in_loop(cluster.stop_engines(set_id))
                except Exception as e:
                    log.warning("stopping the engines: %s", e)
        psutil.wait_procs(procs, timeout=5)

    def _kill_engines(self) -> list[psutil.Process]:
        """SIGKILL every local engine at once; returns them to wait for (their nannies exit
        when they do). ipyparallel stops engines one after another with SIGTERM, and each
        then spends about a second of CPU finalizing torch for nothing (it exits with status
        1 anyway): stop took 11.6 s at 16 ranks. Only the pids we recorded, checked by start
        time (a recycled pid is safe)."""
        procs = list(self._pids.values())
        kill(procs)
        return procs

    def _kill_leftovers(self) -> None:
        """Processes the launcher could not stop (an engine, the controller after a failed
        stop): the engines we recorded and whatever else carries this session's mark."""
        procs = {p.pid: p for p in self._pids.values()}
        marked = session_processes(self.folder.profile_dir, self.folder.created)
        procs.update({p.pid: p for p in marked})
        end_all(list(procs.values()), grace=0)


def own_process(profile_dir: str, pid: int) -> psutil.Process | None:
    """The process ``pid`` on this host if it is one of the session's marked ``profile_dir``
    (see watchdog.py). The pid an engine on another host reports may name an unrelated
    process here, which must never be signalled."""
    try:
        proc = psutil.Process(pid)
        if proc.uids().real == os.geteuid() and proc.environ().get(MARK) == profile_dir:
            return proc
    except psutil.Error:  # gone, or another user's: not ours
        pass
    return None


def kill(procs: list[psutil.Process]) -> None:
    """SIGKILL each (psutil refuses a pid reused since its Process was made)."""
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
