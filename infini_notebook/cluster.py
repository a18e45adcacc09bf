"""The kernel-side session: the facade users and magics call (start, run, pull/push,
status, stacks, restart, stop). It holds the owners of the session's state (see Session)
and delegates: launching to ``launch/``, work on the running ranks to ``kernel/``. Nothing
here renders widgets; ``viz`` reads ``status()``.
"""

from __future__ import annotations

import atexit
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from .core.errors import DistCellError, DistInterrupted, DistUsageError
from .core.keep import kept_clause
from .core.options import StartOptions
from .core.plan import SessionPlan
from .core.rankbook import RankBook
from .core.ranks import parse_ranks, rank_label
from .core.state import CellResult, Progress, RankState
from .kernel import attach as attach_kept
from .kernel import diff, execution, left_output, post_mortem, recovery, supervision, transfer
from .kernel import heal as healing
from .kernel import profile as cell_profile
from .kernel.autoreload import AutoReload
from .kernel.background import BackgroundCell
from .kernel.printers import Printer, TextPrinter
from .launch import kept_sessions, prewarm, start_errors, startup
from .launch.engine_sets import Engines
from .launch.folder import SessionFolder
from .launch.keep import Keeper
from .launch.machine import plan_from_options
from .launch.rendezvous import Rendezvous

__all__ = ["CellResult", "Printer", "Progress", "RankState", "Session", "current", "start"]

log = logging.getLogger("infini_notebook")


_current: Session | None = None


def current() -> Session | None:
    """The running session, if any."""
    session = _current
    return session if session is not None and session.running and session.driven() else None


def _runs_already(session: Session) -> str:
    """Why a start or an attach is refused while ``session`` runs in this kernel: for a kept
    one, both ways to free the kernel (let it go and keep it, or end it)."""
    if session.keeper.keeps:
        name = session.keeper.name
        return (
            f"Kept session {name!r} ({session.world_size} ranks) is attached to this kernel. "
            f"%dist_detach lets it go and keeps it (%dist_attach {name} takes it back); "
            "%dist_stop ends it for good."
        )
    return (
        f"A session with {session.world_size} ranks is already running. "
        "Stop it first with %dist_stop (or session.stop())."
    )


def start(
    progress: Progress | None = None, options: StartOptions | None = None, **keywords
) -> Session:
    """Start a session; options as ``%dist_start`` takes them (``nprocs=4``, ``gpus=8``,
    ``tp=2`` ...: the fields of StartOptions). Raises DistUsageError before starting
    anything when an option is wrong. ``progress(done, total, what)`` is called as engines
    come up and ranks initialise."""
    global _current
    if current() is not None:
        raise DistUsageError(_runs_already(_current))
    plan = plan_from_options(options, **keywords)
    if plan.keep_s:
        kept_sessions.claim_name(plan.name)  # atomically, before anything starts
    try:
        if progress is not None:
            progress(0, 0)  # the options are good: only now a "starting..." bar
        session = Session(plan, warmed=prewarm.take_for(plan))
        session.start(progress)
    except BaseException:
        if plan.keep_s:
            kept_sessions.release_name(plan.name)
        raise
    _current = session
    return session


def attach(name: str, force: bool = False) -> tuple[Session, str]:
    """Take over the kept session ``name`` (``%dist_start --name NAME --keep 30m``) from
    this kernel; the session and the line that says what was taken over (see attach.py)."""
    global _current
    if current() is not None:
        raise DistUsageError(_runs_already(_current))
    kept = kept_sessions.find(name)
    session = Session(kept.plan, kept=kept)
    line = attach_kept.take_over(session, force)
    session.reloader.attached()  # the kernel's own autoreload, as the session's setting
    session.running = True
    session.engines.plan_standby(session.book.idle_for)
    _current = session
    return session, line


def lost() -> str | None:
    """Why this kernel's session is no longer its own (another kernel attached it)."""
    return _current.keeper.lost if _current is not None else None


def lost_name() -> str | None:
    """The name of the kept session this kernel lost (see lost)."""
    return _current.keeper.name if _current is not None else None


class Session:
    """The facade over a session's owners, each the only writer of its state:

    - ``folder`` (SessionFolder): the 0700 folder, the mark of our processes, the watchdog;
    - ``rendezvous`` (Rendezvous): the store the kernel hosts, the attempt and its nonce;
    - ``engines`` (Engines): which engine serves which rank, the client, template, spares;
    - ``book`` (RankBook): each rank's row, busy, failed and stuck ranks;
    - ``background`` (BackgroundCell): the --background cell, if one runs;
    - ``keeper`` (Keeper): a kept session's lease and connection data (see keep.py);
    - ``reloader`` (AutoReload): %dist_autoreload's setting and the ranks' copies.

    ``last`` (the last cell's CellResult) and ``running`` are the facade's own."""

    def __init__(
        self,
        plan: SessionPlan,
        warmed: prewarm.Warmed | None = None,
        kept: kept_sessions.Kept | None = None,
    ):
        """``warmed``: a template warmed ahead (see prewarm.py), whose folder, template and
        watchdog this session adopts; ``kept``: a kept session's, to attach (see attach)."""
        self.plan = plan
        self.folder = SessionFolder(warmed or kept)
        self.rendezvous = Rendezvous(plan, kept)
        self.engines = Engines(plan, self.folder, warmed or kept)
        self.keeper = Keeper(plan, self.folder, kept)
        self.book = RankBook()
        self.background = BackgroundCell()
        self.reloader = AutoReload(self.folder)  # %dist_autoreload (a kept session's: read)
        self.last: CellResult | None = None
        self.left_output = None  # cells an earlier kernel left running (kernel/left_output)
        self.running = False

    # ----- start / stop -------------------------------------------------------------------
    def start(self, progress: Progress | None = None) -> Session:
        t0 = time.perf_counter()
        try:
            self.keeper.host_store(self.rendezvous)  # hosted here, or kept: a process of its own
            self.book.record(
                startup.bring_up(self.plan, self.engines, self.rendezvous, self.folder, progress)
            )
        except (DistUsageError, DistCellError, KeyboardInterrupt):
            self.stop()
            raise
        except Exception as e:  # a launcher, ssh, an engine or the controller failed
            self.stop()
            raise start_errors.start_error(self.plan, e) from None
        self.running = True
        self.engines.plan_standby(self.book.idle_for)  # spares for a hard restart, once idle
        if not self.keeper.keep(self.rendezvous, self.engines.client.cluster.cluster_id):
            atexit.register(self.stop)  # a kept session outlives the kernel
        log.info("session of %d ranks up in %.1fs", self.world_size, time.perf_counter() - t0)
        return self

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def attempt(self) -> int:
        """How many times the process groups were rebuilt (restarts, releases)."""
        return self.rendezvous.attempt

    @property
    def ranks(self) -> list[RankState]:
        """Each rank's row as last recorded (``status()`` brings them up to date)."""
        return self.book.rows

    @property
    def layout(self):
        """The session's ParallelLayout (tp/cp/pp/dp sizes and order)."""
        from .core.layout import ParallelLayout

        return ParallelLayout(**self.plan.layout)

    def stop(self) -> None:
        """End everything this session started: engines, controller, store. Idempotent. A
        kept session that another kernel drives now (or stopped, or that this kernel
        detached) is only let go: nothing of it is ended from here."""
        global _current
        if self.running and not self.driven():
            return
        self.running = False
        remote_folders = startup.remote_folder_removers(self.engines)  # before the engines go
        self.engines.stop_all()
        startup.remove_remote_folders(remote_folders)
        self.folder.disarm_watchdog()  # last: it covers a kernel killed while the rest stops
        self.engines.client.stop_loop()
        self.rendezvous.close()
        self.folder.remove()  # and the shared-memory files only a killed engine leaves
        self.keeper.forget()  # a kept session's entry: its name is free again
        if _current is self:
            _current = None
        try:
            atexit.unregister(self.stop)
        except Exception:
            pass

    def detach(self) -> str:
        """Let this kernel's kept session go and keep it (%dist_detach): its ranks, variables
        and groups stay; its --keep time starts counting (%dist_sessions: "detached, ends
        in ..."), and %dist_attach NAME from any kernel of this user takes it back without
        --force. This kernel's own connections to it close; no process of it ends. The line
        that says so. An ordinary session cannot be detached (it ends with its kernel)."""
        from .core.keep import format_duration

        if not self.running:
            raise DistUsageError(
                self.keeper.lost or "No session is running. Start one with %dist_start."
            )
        if not self.keeper.keeps:
            raise DistUsageError(
                "This session is not kept (started without --name NAME --keep 30m), so it "
                "cannot be detached: it ends with its kernel. %dist_stop ends it now."
            )
        self.background.refuse("%dist_detach")
        self.keeper.detach()
        self._let_go()
        name = self.keeper.name
        return (
            f"Detached session {name!r}: it waits {format_duration(self.plan.keep_s)} for a "
            f"kernel to attach it (%dist_attach {name}); %dist_stop {name} ends it."
        )

    def driven(self) -> bool:
        """Whether this kernel drives the session (an ordinary one: always). A kept one that
        another kernel attached, or stopped, is let go as soon as that is seen: see
        ``_let_go``."""
        if self.keeper.driven():
            return True
        self._let_go()
        return False

    def gone_line(self) -> str | None:
        """None while this kernel drives its session; once it does not, who drives it and
        since when, in a few words (or that it was stopped from another kernel, or detached
        from this one): the line a live %dist_status freezes with. Asking reads the lease,
        never the store."""
        if self.running and self.keeper.keeps:
            self.driven()
        return self.keeper.gone

    def _let_go(self) -> None:
        """Close this kernel's own connections to a kept session it no longer drives, and
        end none of its processes: the controller's client (which also heard every engine's
        output) and its loop, and the store's client. A live %dist_status that went on
        asking a store another kernel had stopped printed c10d's "sendBytes failed ...
        Broken pipe" into the notebook twice a second. Idempotent. Not while a cell this
        kernel sent still runs: its replies and output come here, as before the takeover,
        and the cell ends as it would have; the check after it (IPython's post_run_cell)
        lets go."""
        if not self.running or self.book.busy():
            return
        self.running = False
        self.engines.client.close()
        self.engines.client.stop_loop()
        self.rendezvous.let_go()
        self.folder.reap_watchdog()  # ours, ended by %dist_stop NAME: no zombie left

    # ----- recovery -----------------------------------------------------------------------
    def restart(
        self,
        hard: bool = False,
        progress: Progress | None = None,
        after_failure: bool = False,
        ranks: str | list[int] | None = None,
    ) -> None:
        """Soft: new process groups under a fresh store prefix on the same engines, keeping
        every variable. ``ranks``: new engines for those ranks only (dead, or stuck), the
        others keeping theirs and their variables, every rank's groups made anew. Hard: new
        engines for every rank (variables are lost). A soft restart that cannot work (a
        rank is dead, or stuck in native code) says so and names --ranks and --hard; one
        that failed half way leaves the groups marked not whole. ``after_failure``: the
        automatic rebuild after a failed cell (the status then says so)."""
        if self.engines.client.cluster is None:
            raise DistUsageError("No session to restart. Start one with %dist_start.")
        self.keeper.require_held()  # a kept session another kernel drives now: not ours
        # A hard restart may end a background cell that was told to stop and did not.
        self.background.refuse("%dist_restart", unless_interrupted=hard)
        replace = parse_ranks(ranks, self.world_size) if ranks is not None else None
        self.rendezvous.next_attempt()
        if replace:
            self.require_running()
            recovery.replace_ranks(self, replace, progress)
        elif hard:  # the session stops if the new engines cannot come up (see recovery.py)
            recovery.hard_restart(self, progress)
            self.running = True
            self.engines.plan_standby(self.book.idle_for)
        else:
            self.require_running()
            recovery.soft_restart(self, after_failure)

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
        self.require_running()
        self.background.refuse("%%dist")
        return execution.run(
            self,
            code,
            targets,
            collapse,
            max_lines,
            printer or TextPrinter(echo),
        )

    def run_background(
        self, code: str, ranks: str | list[int] | None = None, *, printer: Printer, **kw
    ) -> threading.Thread:
        """``run`` on a thread, so the notebook stays free (for %dist_stacks, %dist_status)
        while the ranks work. Output and errors go to ``printer``; the result to ``last``.
        One at a time: other cells (and pull, push, bench, restart) are refused until it
        ends; ``stacks`` and ``status`` work beside it, ``interrupt`` stops it."""
        return self.background.start(self, code, ranks, printer=printer, **kw)

    def interrupt(self, ranks: str | list[int] | None = None) -> list[int]:
        """SIGINT the background cell's ranks that still run it (of ``ranks``), or a cell
        an earlier kernel left running (see attach.py). Returns the ranks signalled."""
        return self.background.interrupt(self, ranks) or attach_kept.interrupt_left(self, ranks)

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

        The function runs in the engine process; ``engine.bootstrap.user_namespace()`` reaches the
        ``%%dist`` namespace. Raises DistCellError naming the ranks that raised."""
        what = getattr(fn, "__name__", "call")
        targets = self._targets_for(what, ranks)
        return self.apply_each({r: (fn, args) for r in targets}, what, timeout)

    def _targets_for(self, what: str, ranks: str | list[int] | None) -> list[int]:
        """The ranks a call goes to, once the session can take it."""
        self.require_running()
        self.background.refuse(what)
        return parse_ranks(ranks, self.world_size)

    def apply_each(
        self, calls: dict[int, tuple], what: str, timeout: float | None = None
    ) -> dict[int, Any]:
        """``apply`` with a function and arguments of its own per rank: ``{rank: (fn, args)}``."""
        return self.submit_each(calls, what, timeout)()

    def submit_each(
        self, calls: dict[int, tuple], what: str, timeout: float | None = None
    ) -> Callable[[], dict[int, Any]]:
        """``apply_each`` sent now and waited for later: the returned function waits for
        the answers and returns them (or raises) as ``apply_each`` does. Call it once."""
        targets = list(calls)
        with self.engines.client.lock:
            pending = {
                r: self.engines.view(r).apply_async(fn, *args) for r, (fn, args) in calls.items()
            }
        self.book.set_busy(targets, True)

        def wait() -> dict[int, Any]:
            try:
                limit = timeout or self.plan.timeout + 60
                return self.engines.client.gather(pending, what=what, timeout=limit)
            except KeyboardInterrupt:
                supervision.send_signal(self, signal.SIGINT, targets)
                raise DistInterrupted(
                    f"{what} interrupted; {rank_label(targets)[1:-1]} were sent SIGINT."
                ) from None
            finally:
                self.book.set_busy(targets, False)

        return wait

    def pull(self, name: str, ranks: str | list[int] | None = None) -> dict[int, Any]:
        """``{rank: value}`` of a namespace variable, tensors moved to CPU (through shared
        memory from ranks on this host: see transfer.py)."""
        targets = self._targets_for("pull_value", ranks)
        self.require_whole()
        return transfer.pull(self, name, targets)

    def push(self, values: dict, ranks: str | list[int] | None = None) -> None:
        """Set variables in the ranks' namespaces."""
        targets = self._targets_for("push_values", ranks)
        self.require_whole()
        transfer.push(self, values, targets)

    def post_mortem(
        self, code: str, ranks: str | list[int] | None = None, *, echo: bool = True
    ) -> dict[int, str]:
        """Run ``code`` in the failing frame (its locals and globals) on each rank that failed
        in the last cell, or on ``ranks`` of those; ``{rank: output}``, shown labeled."""
        self.require_running()
        return post_mortem.run_code(self, code, ranks, echo)

    def profile(
        self,
        code: str,
        ranks: str | list[int] | None = None,
        *,
        where: str | dict | None = None,
        out: str | None = None,
        max_mb: float = cell_profile.DEFAULT_MAX_MB,
        echo: bool = True,
    ) -> cell_profile.ProfileResult:
        """Run ``code`` as ``run`` does, under torch.profiler on each rank; merge the
        traces into one timeline (a track per rank, one clock) in ``out`` (default
        dist_profile/In<N>-<time>/) with each rank's own trace. Returns the verdict (who
        made the others wait, how long), per-rank and per-collective DataFrames and a
        figure. A failed cell raises DistCellError after writing the traces; its
        ``profile`` attribute holds them (partial there)."""
        targets = execution.resolve_targets(self, ranks, where)
        self.require_running()
        self.background.refuse("%%dist_profile")
        printer = TextPrinter(echo, owns_cell=True)
        name = execution.cell_name()
        return cell_profile.profile(self, code, targets, printer, out, max_mb, name)

    def diff(self, name: str, group: str | None = None, atol: float = 0.0):
        """Compare ``name`` (a tensor, module, optimizer, state dict or nested container on
        each rank) within every group of ``group`` (default dp; world without dp).
        Returns (one summary line, a DataFrame of what differs: group, leaf, ranks,
        compared_with, max_abs_diff, what)."""
        self.require_running()
        self.background.refuse("%dist_diff")
        return diff.diff(self, name, group, atol)

    def heal(self, names: list[str] | str, group: str = "dp", to: str | list[int] | None = None):
        """Give ranks that lack ``names`` (or were replaced since each was last healed into
        them; ``to``: these ranks) the value from a healthy replica in their group of
        ``group``, sent over the process group: modules (parameters and buffers in place,
        or rebuilt from the source's pickled module), optimizer state, tensors, DTensors
        replicated over the group, plain values. A name with no replica (a shard) is
        refused in its line. Returns one ``Healed`` per name (``.line``, ``.ok``,
        ``.nbytes``, ``.seconds``, ``.transfers``)."""
        self.require_running()
        self.background.refuse("%dist_heal")
        return healing.heal(self, names, group, to)

    def debug(self, ranks: str | list[int] | None = None) -> None:
        """pdb post-mortem in the failing frame of each rank that failed in the last cell
        (or ``ranks`` of those), at the notebook's input box, one rank's prompts at a time.
        The last cell stays the one inspected: ``debug`` and ``post_mortem`` work again."""
        self.require_running()
        self.background.refuse("%dist_debug")
        post_mortem.debug(self, ranks)

    def set_autoreload(self, on: bool, copy_all: bool = False) -> str:
        """Edited code on every rank: while on, the kernel and every rank reload a module
        whose file changed before each cell (IPython's ``%autoreload 2``), and ranks that do
        not see the notebook's folder (other hosts) get its changed .py files first (see
        kernel/autoreload.py; ``copy_all``: every rank gets them). Kept across restarts and
        by a kept session. The line that says the state."""
        self.require_running()
        self.background.refuse("%dist_autoreload")
        return self.reloader.turn(self, on, copy_all)

    def autoreload_state(self) -> str:
        """%dist_autoreload's state, in a line."""
        return self.reloader.describe(self)

    # ----- state --------------------------------------------------------------------------
    def status(self) -> list[RankState]:
        """Each rank's pid, device, state (idle, busy, failed, released, died, stuck,
        stopped) and note. A kept session this kernel no longer drives: the rows as last
        seen (the ranks are asked nothing: they are another kernel's, or gone)."""
        if self.gone_line() is not None:
            return self.book.rows
        return supervision.status(self)

    def session_line(self, states: list[RankState] | None = None) -> str:
        """The session in a line: 'ready', 'rebuilt after a failure on rank 1, variables
        kept', 'needs %dist_restart --ranks 2 (or --hard): rank 2 died' (from ``states``, a
        status())."""
        if not self.running:
            return self.keeper.gone or "stopped"
        states = self.status() if states is None else states
        died = [rs.rank for rs in states if rs.state == "died"]
        stuck = [rs.rank for rs in states if rs.state == "stuck"]
        left, covered = left_output.still_running(self, stuck)  # an earlier kernel's cell
        native = [r for r in stuck if r not in covered]
        line = self.book.session_line(died, native)
        gone = recovery.relay_gone(self)  # --relay: no cell reaches that host's ranks
        if gone is not None:
            line = f"needs {recovery.HARD_FIX}: {gone}"
        if left:
            line = f"{line}; {left}" if died or native or self.book.broken() else left
        if self.keeper.keeps:  # its name, and how long it outlives its kernel
            line = f"{self.plan.name!r} {line} · kept: {kept_clause(self.plan.keep_s)}"
        return line

    def kept_line(self) -> str:
        """The ready line's "kept session 'train': waits 30m for a kernel once none drives
        it", or "" for a session that ends with its kernel."""
        if not self.keeper.keeps:
            return ""
        return f"kept session {self.plan.name!r}: {kept_clause(self.plan.keep_s)}"

    def require_whole(self) -> None:
        """DistUsageError, one line, while the process groups are not whole (a rebuild
        refused or half applied, a collective timed out): what is wrong, and the fix."""
        broken = self.book.broken()
        if broken is not None:
            why, fix = broken
            raise DistUsageError(f"The process groups are not whole: {why}. Run {fix} first.")

    def template_rss(self) -> int | None:
        """The warm template's resident memory while the session runs (engines fork from
        it), else None. Its pages are shared with every engine forked from it until one
        writes them."""
        return self.engines.template.rss() if self.running else None

    def spare_engines(self) -> int:
        """How many engines wait for the next hard restart (see spares.py); 0 once stopped."""
        return self.engines.spare_count() if self.running else 0

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return (
            f"<infini_notebook.Session {state}: {self.world_size} ranks, "
            f"backend {self.plan.backend}, init {self.plan.init_method.url}>"
        )

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        from . import viz  # the live status widget when a cell's value, like dask's cluster

        return viz.session_mimebundle(self)

    def require_running(self) -> None:
        """DistUsageError unless the session runs and its controller answers."""
        if not self.running:
            raise DistUsageError(
                self.keeper.lost or "No session is running. Start one with %dist_start --nprocs 4."
            )
        self.keeper.require_held()  # another kernel may have attached a kept session
        self.engines.client.require_controller()
