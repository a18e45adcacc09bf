"""The kernel-side session: plan, store, engines, run, signal, restart, stop, state.

One :class:`Session` owns everything it starts: a TCPStore server hosted in this process
(the agent store: it outlives any rank), an ipyparallel controller and one engine per rank
(engine id == global rank). Nothing here renders widgets; ``viz`` reads ``status()``.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time
from typing import Any

import psutil

from .core.errors import DistCellError, DistInterrupted, DistUsageError
from .core.options import StartOptions
from .core.output import one_line, prefix_lines
from .core.plan import SessionPlan, make_plan
from .core.ranks import parse_ranks, rank_label
from .core.state import CellResult, Progress, RankState
from .engine import bootstrap, postmortem
from .engine.bootstrap import KERNEL_MARK
from .kernel import execution, supervision, transfer
from .kernel.execution import Printer
from .launch import engine_sets, launchers, prewarm, processes
from .launch.watchdog import FOLDER_PREFIX, remove_shared_files

__all__ = ["CellResult", "Printer", "Progress", "RankState", "Session", "current", "start"]

log = logging.getLogger("infini_notebook")


_current: Session | None = None


def current() -> Session | None:
    """The running session, if any."""
    return _current if _current is not None and _current.running else None


def start(
    progress: Progress | None = None, options: StartOptions | None = None, **keywords
) -> Session:
    """Start a session; options as ``%dist_start`` takes them (``nprocs=4``, ``gpus=8``,
    ``tp=2`` ...: the fields of StartOptions). Raises DistUsageError before starting
    anything when an option is wrong. ``progress(done, total, what)`` is called as engines
    come up and ranks initialise."""
    global _current
    if current() is not None:
        raise DistUsageError(
            f"A session with {_current.plan.world_size} ranks is already running. "
            "Stop it first with %dist_stop (or session.stop())."
        )
    plan = plan_from_options(options, **keywords)
    if progress is not None:
        progress(0, 0)  # the options are good: only now a "starting..." bar
    session = Session(plan, warmed=take_warmed(plan))
    session.start(progress)
    _current = session
    return session


def take_warmed(plan: SessionPlan) -> prewarm.Warmed | None:
    """The template %load_ext warmed, if it suits this plan's engines (see prewarm.py)."""
    if plan.template_off:
        prewarm.discard()  # no use to this session
        return None
    return prewarm.take(launchers.template_env(plan))


def plan_from_options(options: StartOptions | None = None, **keywords) -> SessionPlan:
    """The checked plan for ``options`` (or for the StartOptions the keywords make)."""
    try:
        options = options or StartOptions(**keywords)
    except TypeError as e:  # a keyword that is no option
        raise DistUsageError(f"Unknown start option: {e}. See %dist_start --help.") from None
    return make_plan(options, visible_gpus=visible_cuda_devices(), host_addresses=host_addresses())


def host_addresses() -> list[str]:
    """This machine's IPv4 addresses (for a bind address of 0.0.0.0: see plan.reachable)."""
    import socket

    return [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET
    ]


def visible_cuda_devices() -> list[str]:
    """CUDA_VISIBLE_DEVICES entries of the GPUs this process may use, one per GPU."""
    try:
        import torch

        n = torch.cuda.device_count()
    except Exception:
        return []
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env:
        return [x.strip() for x in env.split(",") if x.strip()][:n]
    return [str(i) for i in range(n)]


class Session:
    def __init__(self, plan: SessionPlan, warmed: prewarm.Warmed | None = None):
        """``warmed``: a template warmed ahead (see prewarm.py), whose folder, template and
        watchdog this session adopts."""
        self.plan = plan
        self.attempt = 0
        # Every key of the session lives under an unguessable root, and each attempt's
        # process groups under a fresh nonce: nobody can prepare keys for a restart.
        self._token = secrets.token_hex(16)
        self._attempt_key = secrets.token_hex(8)
        self.ranks: list[RankState] = []
        self.last: CellResult | None = None
        self.running = False
        self._busy: set[int] = set()
        self._idle_since = time.monotonic()  # when a rank was last busy (execution.idle_for)
        self._errored: set[int] = set()
        self._store = None
        self._keys = None  # the session's keys in _store (see processes.start_store)
        self._workdir = warmed.workdir if warmed else tempfile.mkdtemp(prefix=FOLDER_PREFIX)
        # Engines on another host find no such file in their copy of this folder (see
        # engine.remove_remote_copy); on this host they do.
        open(os.path.join(self._workdir, KERNEL_MARK), "w").close()
        self._created = warmed.created if warmed else time.time()  # no process of ours is older
        self._lock = threading.Lock()
        self.engines = processes.Engines()  # controller, client and its lock, engine processes
        if warmed:
            self.engines.template = warmed.template
            self.engines.template_env = launchers.template_env(plan)  # the same, per plan
        self._background: execution.Background | None = None
        self._stuck: set[int] = set()  # ranks that ignored an interrupt and still run
        self._late_stacks: list[str] = []  # store keys of stack answers nobody waited for
        self._ask_lock = threading.Lock()  # one question to the ranks at a time
        self._watchdog = warmed.watchdog if warmed else None
        self._made_init_file = False  # stop() removes a file:// path only if we made it

    # ----- start / stop -------------------------------------------------------------------
    def start(self, progress: Progress | None = None) -> Session:
        t0 = time.perf_counter()
        method = self.plan.init_method
        self._made_init_file = method.kind == "file" and not os.path.exists(method.path)
        try:
            processes.start_store(self)
            self._launch(progress)
        except (DistUsageError, DistCellError, KeyboardInterrupt):
            self.stop()
            raise
        except Exception as e:  # a launcher, ssh, an engine or the controller failed
            self.stop()
            raise engine_sets.start_error(self.plan, e) from None
        self.running = True
        engine_sets.plan_standby(self)  # spares for a first hard restart, once idle
        atexit.register(self.stop)
        log.info("session of %d ranks up in %.1fs", self.world_size, time.perf_counter() - t0)
        return self

    def _launch(self, progress: Progress | None) -> None:
        """Watchdog armed, engines up, ranks bootstrapped (also what a hard restart redoes)."""
        supervision.start_watchdog(self)
        engine_sets.start_engines(self, progress)
        processes.bootstrap_ranks(self, progress)

    @property
    def _profile_dir(self) -> str:
        """ipyparallel puts this in every process it launches (IPP_PROFILE_DIR): it marks
        the processes this session started, and only them (the folder is ours alone)."""
        return launchers.profile_dir(self._workdir)

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def layout(self):
        """The session's ParallelLayout (tp/cp/pp/dp sizes and order)."""
        from .core.layout import ParallelLayout

        return ParallelLayout(**self.plan.layout)

    def stop(self) -> None:
        """End everything this session started: engines, controller, store. Idempotent."""
        global _current
        self.running = False
        remote_folders = processes.remote_folder_removers(self)  # before the engines go
        engine_sets.stop_processes(self)
        processes.remove_remote_folders(self, remote_folders)
        supervision.end_watchdog(self)  # last: it covers a kernel killed while the rest stops
        if self.engines.loop is not None:
            self.engines.loop.call_soon_threadsafe(self.engines.loop.stop)
            self.engines.loop = None
        self._keys = None
        self._store = None  # the TCPStore server closes with its last reference
        shutil.rmtree(self._workdir, ignore_errors=True)
        remove_shared_files(self._workdir)  # none is left but by an engine that was killed
        if self._made_init_file:  # a path the user made stays (it may be theirs)
            processes.remove_quietly(self.plan.init_method.path)
        if _current is self:
            _current = None
        try:
            atexit.unregister(self.stop)
        except Exception:
            pass

    # ----- recovery -----------------------------------------------------------------------
    def restart(self, hard: bool = False, progress: Progress | None = None) -> None:
        """Soft: new process groups under a fresh store prefix on the same engines, keeping
        every variable. Hard: new engines (variables are lost). A soft restart that cannot
        work (a rank is dead, or stuck in native code) says so and names --hard."""
        if self.engines.cluster is None:
            raise DistUsageError("No session to restart. Start one with %dist_start.")
        # A hard restart may end a background cell that was told to stop and did not.
        execution.refuse_beside_background(self, "%dist_restart", unless_interrupted=hard)
        self.attempt += 1
        self._attempt_key = secrets.token_hex(8)
        if hard:
            self._restart_hard(progress)
            return
        self._require_running()
        dead = supervision.dead_ranks(self, range(self.world_size))
        if dead:
            raise DistUsageError(
                f"Cannot restart softly: {supervision.dead_text(dead)}. Use %dist_restart --hard."
            )
        stuck = supervision.stuck_ranks(self)
        if stuck:
            raise DistUsageError(
                f"Cannot restart softly: {rank_label(stuck)[1:-1]} still running earlier "
                "code (stuck in native code?). See %dist_stacks; use %dist_restart --hard."
            )
        with self.engines.lock:
            pending = {
                r: processes.rank_view(self, r).apply_async(
                    bootstrap.reinit_distributed, self.attempt, self._attempt_key
                )
                for r in range(self.world_size)
            }
        try:
            processes.record_ranks(
                self, processes.gather(self, pending, what="restart", timeout=60)
            )
        except DistCellError as e:
            raise DistCellError(
                f"{e.summary}. Use %dist_restart --hard.", e.report, e.ranks
            ) from None
        self._errored = set()

    def _restart_hard(self, progress: Progress | None) -> None:
        """New engines; if they cannot come up, stop everything rather than leave half a
        session running."""
        # A running controller stays (see ensure_controller), and the spare engines forked
        # while the session was idle become the ranks (see engine_sets.Standby).
        engine_sets.stop_engines(self, keep_standby=True)
        remove_shared_files(self._workdir)
        self.engines.pids, self._errored, self._stuck = {}, set(), set()
        try:
            self._launch(progress)
        except KeyboardInterrupt:
            self.stop()
            raise
        except Exception as e:
            self.stop()
            why = e.summary if isinstance(e, DistCellError) else one_line(e)
            raise DistCellError(
                f"Hard restart failed: {why}. The session is stopped and nothing is left "
                "running; start a new one with %dist_start.",
                getattr(e, "report", ""),
                getattr(e, "ranks", []),
            ) from None
        self.running = True
        engine_sets.plan_standby(self)

    # ----- running code -------------------------------------------------------------------
    def run(
        self,
        code: str,
        ranks: str | list[int] | None = None,
        *,
        collapse: bool = False,
        max_lines: int | None = None,
        echo: bool = True,
        printer: Printer | None = None,
        where: str | dict | None = None,
    ) -> CellResult:
        """Run ``code`` on ``ranks`` (or on the ranks at layout coordinates ``where``,
        ``"pp=0,tp=1"``) at once; show each rank's output labeled as it arrives (on this
        cell's streams, or through ``printer``). Raises DistCellError (labeled tracebacks)
        when any rank raised, DistUsageError while a background cell runs."""
        targets = execution.resolve_targets(self, ranks, where)
        self._require_running()
        execution.refuse_beside_background(self, "%%dist")
        return execution.run(
            self,
            code,
            targets,
            collapse,
            max_lines,
            printer or execution.TextPrinter(echo),
        )

    def run_background(
        self, code: str, ranks: str | list[int] | None = None, *, printer: Printer, **kw
    ) -> threading.Thread:
        """``run`` on a thread, so the notebook stays free (for %dist_stacks, %dist_status)
        while the ranks work. Output and errors go to ``printer``; the result to ``last``.
        One at a time: other cells (and pull, push, bench, restart) are refused until it
        ends; ``stacks`` and ``status`` work beside it, ``interrupt`` stops it."""
        return execution.run_background(self, code, ranks, printer=printer, **kw)

    def interrupt(self, ranks: str | list[int] | None = None) -> list[int]:
        """SIGINT the background cell's ranks that still run it (of ``ranks``): stops it
        and nothing else. Returns the ranks signalled."""
        return execution.interrupt(self, ranks)

    def stacks(self, ranks: str | list[int] | None = None, wait: float = 2.0) -> dict[int, str]:
        """Every thread's Python stack on each rank (the cell's thread as 'Current thread');
        see ``supervision.stacks``."""
        return supervision.stacks(self, ranks, wait)

    def signal(self, signum: int, ranks: list[int] | None = None) -> None:
        """Send ``signum`` to the engines of ``ranks`` (pids this session started)."""
        supervision.send_signal(self, signum, ranks)

    # ----- data in and out ----------------------------------------------------------------
    def apply(
        self, fn, *args, ranks: str | list[int] | None = None, timeout: float | None = None
    ) -> dict[int, Any]:
        """Call an importable function on ``ranks`` at once; ``{rank: return value}``.

        The function runs in the engine process; ``engine.user_namespace()`` reaches the
        ``%%dist`` namespace. Raises DistCellError naming the ranks that raised."""
        what = getattr(fn, "__name__", "call")
        targets = self._targets_for(what, ranks)
        return self._apply_each({r: (fn, args) for r in targets}, what, timeout)

    def _targets_for(self, what: str, ranks: str | list[int] | None) -> list[int]:
        """The ranks a call goes to, once the session can take it."""
        self._require_running()
        execution.refuse_beside_background(self, what)
        return parse_ranks(ranks, self.world_size)

    def _apply_each(
        self, calls: dict[int, tuple], what: str, timeout: float | None = None
    ) -> dict[int, Any]:
        """``apply`` with a function and arguments of its own per rank: ``{rank: (fn, args)}``."""
        targets = list(calls)
        with self.engines.lock:
            pending = {
                r: processes.rank_view(self, r).apply_async(fn, *args)
                for r, (fn, args) in calls.items()
            }
        execution.set_busy(self, targets, True)
        try:
            return processes.gather(self, pending, what=what, timeout=timeout)
        except KeyboardInterrupt:
            supervision.send_signal(self, signal.SIGINT, targets)
            raise DistInterrupted(
                f"{what} interrupted; {rank_label(targets)[1:-1]} were sent SIGINT."
            ) from None
        finally:
            execution.set_busy(self, targets, False)

    def pull(self, name: str, ranks: str | list[int] | None = None) -> dict[int, Any]:
        """``{rank: value}`` of a namespace variable, tensors moved to CPU (through shared
        memory from ranks on this host: see transfer.py)."""
        return transfer.pull(self, name, self._targets_for("pull_value", ranks))

    def push(self, values: dict, ranks: str | list[int] | None = None) -> None:
        """Set variables in the ranks' namespaces."""
        targets = self._targets_for("push_values", ranks)
        try:
            transfer.push(self, values, targets)
        except (DistUsageError, DistCellError):
            raise
        except Exception as e:  # ipyparallel could not serialize a value: nothing was sent
            raise DistUsageError(_unsendable_text(values, e)) from None

    def post_mortem(
        self, code: str, ranks: str | list[int] | None = None, *, echo: bool = True
    ) -> dict[int, str]:
        """Run ``code`` in the failing frame (its locals and globals) on each rank that failed
        in the last cell, or on ``ranks`` of those; ``{rank: output}``, shown labeled."""
        self._require_running()
        targets = self._failed_ranks(ranks)
        dead = supervision.dead_ranks(self, targets)
        if dead:
            raise DistUsageError(f"{supervision.dead_text(dead)}: its frames are gone.")
        out = self.apply(postmortem.post_mortem, code, ranks=targets, timeout=60)
        if echo:
            shown = [prefix_lines(rank_label([r]), text) for r, text in out.items() if text]
            execution.TextPrinter(echo).out("".join(shown))
        return out

    def _failed_ranks(self, ranks: str | list[int] | None) -> list[int]:
        """The ranks that failed in the last cell (of ``ranks``); DistUsageError if none."""
        failed = sorted(self.last.errors) if self.last is not None else []
        if not failed:
            raise DistUsageError(
                "The last cell did not fail, so there is no failing frame to inspect. "
                "Post-mortem works right after a %%dist cell that raised on some rank."
            )
        if ranks is None:
            return failed
        chosen = parse_ranks(ranks, self.world_size)
        if not set(chosen) <= set(failed):
            raise DistUsageError(
                f"Only {rank_label(failed)[1:-1]} failed in the last cell; pick --ranks among them."
            )
        return chosen

    # ----- state --------------------------------------------------------------------------
    def status(self) -> list[RankState]:
        """Each rank's pid, device and state (idle, busy, error, dead, stuck, stopped)."""
        return supervision.status(self)

    def template_rss(self) -> int | None:
        """The warm template's resident memory while it runs (engines fork from it), else
        None. Its pages are shared with every engine forked from it until one writes them."""
        return engine_sets.template_rss(self)

    def spare_engines(self) -> int:
        """How many engines wait for the next hard restart (see engine_sets.Standby)."""
        return engine_sets.spare_count(self)

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return (
            f"<infini_notebook.Session {state}: {self.world_size} ranks, "
            f"backend {self.plan.backend}, init {self.plan.init_method.url}>"
        )

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        from . import viz  # the live status widget when a cell's value, like dask's cluster

        return viz.session_mimebundle(self)

    def _require_running(self) -> None:
        if not self.running:
            raise DistUsageError("No session is running. Start one with %dist_start --nprocs 4.")
        processes.require_controller(self)


def _unsendable_text(values: dict, error: Exception) -> str:
    """Name the value that cannot travel to the ranks (tried one by one, only on failure)."""
    from ipyparallel.serialize import serialize_object

    for name, value in values.items():
        try:
            serialize_object(value)
        except Exception:
            kind = f"{type(value).__module__}.{type(value).__qualname__}"
            kind = kind.removeprefix("builtins.")
            return (
                f"cannot send `{name}` to the ranks: {kind} cannot be pickled. Send the data "
                "it holds instead, or create it on the ranks in a %%dist cell."
            )
    return f"cannot send {', '.join(f'`{n}`' for n in values)} to the ranks: {one_line(error)}"
