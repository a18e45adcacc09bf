"""The kernel-side session: plan, store, engines, run, signal, restart, stop, state.

One :class:`Session` owns everything it starts: a TCPStore server hosted in this process
(the agent store: it outlives any rank), an ipyparallel controller and one engine per rank
(engine id == global rank). Nothing here renders widgets; ``viz`` reads ``status()``.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import psutil

from . import engine
from .errors import DistCellError, DistInterrupted, DistUsageError
from .output import (
    StreamLabeler,
    error_report,
    error_summary,
    main_thread_stack,
    prefix_lines,
)
from .plan import LOOPBACK, SessionPlan, is_loopback, make_plan
from .ranks import parse_ranks, rank_label
from .state import CellResult, RankState

log = logging.getLogger("infini_notebook")

# ``progress(done, total, what)``: how long work reports how far it got (viz.Progress draws it)
Progress = Callable[[int, int, str], None]

_current: Session | None = None


def current() -> Session | None:
    """The running session, if any."""
    return _current if _current is not None and _current.running else None


def start(progress: Progress | None = None, **options) -> Session:
    """Start a session; options as ``%dist_start`` takes them (``nprocs=4``, ``gpus=8``,
    ``tp=2`` ...). Raises DistUsageError before starting anything when an option is wrong.
    ``progress(done, total, what)`` is called as engines come up and ranks initialise."""
    global _current
    if current() is not None:
        raise DistUsageError(
            f"A session with {_current.plan.world_size} ranks is already running. "
            "Stop it first with %dist_stop (or session.stop())."
        )
    plan = plan_from_options(**options)
    session = Session(plan)
    session.start(progress)
    _current = session
    return session


def plan_from_options(
    *, tp=None, cp=None, pp=None, dp=None, order=None, zero1=None, **options
) -> SessionPlan:
    layout = {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "order": order, "zero1": zero1}
    return make_plan(visible_gpus=visible_cuda_devices(), layout=layout, **options)


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
    def __init__(self, plan: SessionPlan):
        self.plan = plan
        self.attempt = 0
        self.ranks: list[RankState] = []
        self.last: CellResult | None = None
        self.running = False
        self._busy: set[int] = set()
        self._errored: set[int] = set()
        self._pids: dict[int, psutil.Process] = {}
        self._store = None
        self._cluster = None
        self._client = None
        self._workdir = tempfile.mkdtemp(prefix="infini-notebook-")
        self._created = time.time()  # no process of ours is older
        self._lock = threading.Lock()
        # ipyparallel's Client is not thread-safe, and the foreground cell, a --background
        # cell's thread and the status widget's poller all use it: every call holds this.
        self._client_lock = threading.RLock()
        self._background: _Background | None = None
        self._unpurged: list[str] = []  # msg ids of finished work, until purged
        self._hub_purge_queued = False  # a purge of the controller's records is due soon
        self._eids: list[int] = []  # engine id of each rank (== rank on one host)
        self._stuck: set[int] = set()  # ranks that ignored an interrupt and still run
        self._late_stacks: list[str] = []  # store keys of stack answers nobody waited for
        self._loop = None  # the event loop ipyparallel runs on (see _in_loop)
        self._watchdog = None
        self._made_init_file = False  # stop() removes a file:// path only if we made it

    # ----- start / stop -------------------------------------------------------------------
    def start(self, progress: Progress | None = None) -> Session:
        t0 = time.perf_counter()
        method = self.plan.init_method
        self._made_init_file = method.kind == "file" and not os.path.exists(method.path)
        try:
            self._start_store()
            self._launch(progress)
        except (DistUsageError, DistCellError, KeyboardInterrupt):
            self.stop()
            raise
        except Exception as e:  # a launcher, ssh, an engine or the controller failed
            self.stop()
            raise _start_error(self.plan, e) from None
        self.running = True
        atexit.register(self.stop)
        log.info("session of %d ranks up in %.1fs", self.world_size, time.perf_counter() - t0)
        return self

    def _launch(self, progress: Progress | None) -> None:
        """Watchdog armed, engines up, ranks bootstrapped (also what a hard restart redoes)."""
        self._start_watchdog()
        self._start_engines(progress)
        self._bootstrap(progress)

    @property
    def _profile_dir(self) -> str:
        """ipyparallel puts this in every process it launches (IPP_PROFILE_DIR): it marks
        the processes this session started, and only them (the folder is ours alone)."""
        return os.path.join(self._workdir, "profile")

    def _start_watchdog(self) -> None:
        """A small process that ends ours if this kernel dies, even by SIGKILL. Started
        before anything else, so a kernel killed while engines come up leaves nothing."""
        import subprocess

        if self._watchdog is not None and self._watchdog.poll() is None:
            return  # a hard restart keeps the session's watchdog
        kernel = psutil.Process()
        self._watchdog = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "infini_notebook.watchdog",
                f"{kernel.pid}:{kernel.create_time()}",
                self._profile_dir,
                repr(self._created),
            ],
            start_new_session=True,  # a Ctrl-C meant for the kernel must not end it
            stdin=subprocess.DEVNULL,
        )

    def _end_watchdog(self) -> None:
        if self._watchdog is not None and self._watchdog.poll() is None:
            self._watchdog.terminate()
            self._watchdog.wait(5)
        self._watchdog = None

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def layout(self):
        """The session's ParallelLayout (tp/cp/pp/dp sizes and order)."""
        from .groups import ParallelLayout

        return ParallelLayout(**self.plan.layout)

    def _start_store(self) -> None:
        """Host the TCPStore here. We bind the listening socket ourselves: TCPStore alone
        listens on every interface, whatever host it is given."""
        import socket

        import torch.distributed as dist

        method = self.plan.init_method
        host = method.host if method.kind == "tcp" else self.plan.bind_address
        port = method.port if method.kind == "tcp" else 0
        if not is_loopback(host):  # allowed (ranks elsewhere need it), but never silently
            warnings.warn(
                f"Listening on {host}: the rendezvous TCPStore has no authentication, so "
                "anyone who reaches that address can join or disturb the session. Keep it on "
                "a private network."
                + (
                    " ipyparallel's traffic is encrypted (CurveZMQ)."
                    if self.plan.bind_address not in LOOPBACK
                    else ""
                ),
                stacklevel=2,
            )
        try:
            sock = socket.create_server((host, port), backlog=1024)
            port = sock.getsockname()[1]
            self._store = dist.TCPStore(
                host, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.fileno()
            )
            sock.detach()  # the store owns the descriptor now and closes it
        except Exception as e:  # port taken, address not ours
            raise DistUsageError(
                f"Cannot host the rendezvous store on {host}:{port} ({e}). "
                "Pick a free port, or use the default env:// init method."
            ) from None

    def _start_engines(self, progress: Progress | None) -> None:
        import ipyparallel as ipp

        from . import launchers

        self._cluster = ipp.Cluster(
            **launchers.cluster_options(self.plan, self._profile_dir),
            log=logging.getLogger("infini_notebook.ipyparallel"),
            shutdown_atexit=True,
        )
        profile = os.path.join(self._workdir, "profile")
        self._in_loop(self._cluster.start_controller())
        self._in_loop(
            self._cluster.start_engines(
                self.world_size, **launchers.engine_options(self.plan, profile)
            )
        )
        self._client = self._in_loop(self._cluster.connect_client())
        # Signatures of received messages, kept against replays: 2**16 by default, ~10 MB
        # after some thousand cells. Messages travel on loopback or CurveZMQ.
        self._client.session.digest_history_size = DIGEST_HISTORY
        self._wait_for_engines(progress)
        ar = self._client[:].apply_async(engine.identity)
        identities = ar.get_dict(timeout=60)
        self._forget(ar.msg_ids)
        self._eids = launchers.assign_ranks(identities, self.plan)

    def _wait_for_engines(self, progress: Progress | None, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        note, asked = "engines up", 0.0
        while (up := len(self._client.ids)) < self.world_size:
            if progress:
                progress(up, self.world_size, note)
            stopped = [es for es in self._cluster.engines.values() if es.state == "after"]
            if stopped:
                raise _EnginesExited(stopped[0])
            if time.monotonic() - asked > 1:  # a batch job: ask its scheduler, not too often
                note, asked = self._check_batch_job() or note, time.monotonic()
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"only {up} of {self.world_size} engines came up in {timeout}s ({note})"
                )
            time.sleep(0.05)
        if progress:
            progress(self.world_size, self.world_size, "engines up")

    def _check_batch_job(self) -> str | None:
        """The batch job's state for the progress line (None for other launchers); raises
        DistUsageError when the job will never bring its engines up (see slurm.py)."""
        for es in self._cluster.engines.values():
            if hasattr(es, "start_check"):
                problem, note = es.start_check()
                if problem:
                    raise DistUsageError(problem)
                return note
        return None

    def _engine(self, rank: int):
        """The ipyparallel view of one rank's engine."""
        return self._client[self._eids[rank]]

    def _view(self, ranks: list[int]):
        return self._client[[self._eids[r] for r in ranks]]

    def _in_loop(self, coro, timeout: float = 120):
        """Run an ipyparallel coroutine on this session's own event loop thread. The loop
        keeps running between calls, so the launchers' exit callbacks (which record each
        engine's exit code) fire; ``*_sync`` wrappers would leave them on a stopped loop."""
        import asyncio

        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(
                target=self._loop.run_forever, name="infini-session-loop", daemon=True
            ).start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _engine_config(self, rank: int) -> dict:
        kernel = psutil.Process()
        method = self.plan.init_method
        store = {"kind": method.kind, "host": self._store.host, "port": self._store.port}
        if method.kind == "file":
            store = {"kind": "file", "path": method.path}
        group_rank, local_rank, local_world = self.plan.placement.rank_places(self.world_size)[rank]
        return {
            "rank": rank,
            "local_rank": local_rank,
            "world_size": self.world_size,
            "local_world_size": local_world,
            "group_rank": group_rank,
            "watch": "store" if self.plan.placement.multi_host else "pid",
            "loopback_only": self.plan.bind_address in LOOPBACK,
            "master_addr": self._store.host,
            "master_port": self._store.port,
            "backend": self.plan.backend,
            "timeout": self.plan.timeout,
            "cuda": self.plan.cuda_devices(rank),
            "threads": self.plan.threads_per_rank,
            "store": store,
            "attempt": self.attempt,
            "layout": self.plan.layout,
            "kernel_pid": kernel.pid,
            "kernel_start": kernel.create_time(),
        }

    def _bootstrap(self, progress: Progress | None = None) -> None:
        configs = {r: self._engine_config(r) for r in range(self.world_size)}
        with self._client_lock:
            pending = {
                r: self._engine(r).apply_async(engine.bootstrap, configs[r]) for r in configs
            }
        if progress:  # the gather below reports errors; this only counts finished ranks
            while (done := sum(ar.ready() for ar in pending.values())) < self.world_size:
                progress(done, self.world_size, "ranks initialised")
                if any(ar.ready() and not ar.successful() for ar in pending.values()):
                    break
                time.sleep(0.05)
            progress(done, self.world_size, "ranks initialised")
        infos = self._gather(pending, what="start")
        self._record_ranks(infos)

    def _host_name(self, rank: int, reported: str) -> str:
        """The host as the user named it in --hosts (two hosts may share a hostname)."""
        place = self.plan.placement
        if not place.multi_host or place.launcher == "slurm":  # Slurm picks the nodes
            return reported
        return place.hosts[place.rank_places(self.world_size)[rank][0]][0]

    def _record_ranks(self, infos: dict[int, dict]) -> None:
        layout = self.layout
        self.ranks = []
        for r in range(self.world_size):
            info = infos[r]
            if not self.plan.placement.multi_host:  # remote pids mean nothing here (_liveness)
                self._pids[r] = psutil.Process(info["pid"])
            self.ranks.append(
                RankState(
                    rank=r,
                    pid=info["pid"],
                    host=self._host_name(r, info["host"]),
                    device=info["device"],
                    device_name=info["device_name"],
                    memory_used=info["memory_used"],
                    state="idle",
                    coords=layout.coords(r),
                )
            )

    def _gather(self, pending: dict, what: str, timeout: float | None = None) -> dict:
        """Wait for one apply per rank; raise DistCellError naming the ranks that failed."""
        deadline = time.monotonic() + (timeout or self.plan.timeout + 60)
        out, errors, tracebacks = {}, {}, {}
        for r, ar in pending.items():
            try:
                out[r] = ar.get(timeout=max(0.1, deadline - time.monotonic()))
            except Exception as e:
                errors[r] = _one_line(e)
                tracebacks[r] = _remote_traceback(e)
        # return values can be big (a pulled tensor): nothing here keeps a copy
        self._forget([m for ar in pending.values() for m in ar.msg_ids])
        if errors:
            raise DistCellError(
                f"{what} failed on {error_summary(errors, list(pending))}",
                error_report(tracebacks),
                sorted(errors),
            )
        return out

    def stop(self) -> None:
        """End everything this session started: engines, controller, store. Idempotent."""
        global _current
        self.running = False
        self._stop_processes()
        self._end_watchdog()  # last: it covers a kernel killed while the rest stops
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None
        self._store = None  # the TCPStore server closes with its last reference
        shutil.rmtree(self._workdir, ignore_errors=True)
        if self._made_init_file:  # a path the user made stays (it may be theirs)
            _remove_quietly(self.plan.init_method.path)
        if _current is self:
            _current = None
        try:
            atexit.unregister(self.stop)
        except Exception:
            pass

    def _stop_processes(self) -> None:
        """Engines and controller (the store and the watchdog stay: a hard restart reuses
        them)."""
        with self._client_lock:
            if self._client is not None:
                try:
                    self._client.close()
                except Exception:
                    pass
                self._client = None
            self._unpurged = []
        engines = self._kill_engines()  # first: see _kill_engines
        if self._cluster is not None:
            try:  # the controller and remote engines stop while ours die
                self._in_loop(self._cluster.stop_cluster())
            except Exception as e:
                log.warning("stopping the cluster: %s", e)
            self._cluster = None
        psutil.wait_procs(engines, timeout=5)
        self._kill_leftovers()
        self._pids = {}

    # ----- recovery -----------------------------------------------------------------------
    def restart(self, hard: bool = False, progress: Progress | None = None) -> None:
        """Soft: new process groups under a fresh store prefix on the same engines, keeping
        every variable. Hard: new engines (variables are lost). A soft restart that cannot
        work (a rank is dead, or stuck in native code) says so and names --hard."""
        if self._cluster is None:
            raise DistUsageError("No session to restart. Start one with %dist_start.")
        # A hard restart may end a background cell that was told to stop and did not.
        self._refuse_beside_background("%dist_restart", unless_interrupted=hard)
        self.attempt += 1
        if hard:
            self._restart_hard(progress)
            return
        self._require_running()
        dead = self._dead_ranks(range(self.world_size))
        if dead:
            raise DistUsageError(
                f"Cannot restart softly: {_dead_text(dead)}. Use %dist_restart --hard."
            )
        stuck = self._stuck_ranks()
        if stuck:
            raise DistUsageError(
                f"Cannot restart softly: {rank_label(stuck)[1:-1]} still running earlier "
                "code (stuck in native code?). See %dist_stacks; use %dist_restart --hard."
            )
        with self._client_lock:
            pending = {
                r: self._engine(r).apply_async(engine.reinit_distributed, self.attempt)
                for r in range(self.world_size)
            }
        try:
            self._record_ranks(self._gather(pending, what="restart", timeout=60))
        except DistCellError as e:
            raise DistCellError(
                f"{e.summary}. Use %dist_restart --hard.", e.report, e.ranks
            ) from None
        self._errored = set()

    def _restart_hard(self, progress: Progress | None) -> None:
        """New engines; if they cannot come up, stop everything rather than leave half a
        session running."""
        self._stop_processes()
        self._errored = set()
        try:
            self._launch(progress)
        except KeyboardInterrupt:
            self.stop()
            raise
        except Exception as e:
            self.stop()
            why = e.summary if isinstance(e, DistCellError) else _one_line(e)
            raise DistCellError(
                f"Hard restart failed: {why}. The session is stopped and nothing is left "
                "running; start a new one with %dist_start.",
                getattr(e, "report", ""),
                getattr(e, "ranks", []),
            ) from None
        self.running = True

    def _still_stuck(self) -> set[int]:
        """Ranks that ignored an interrupt, until their engine's queue drains."""
        with self._lock:
            if not self._stuck:
                return set()
        try:
            running = set(self._stuck_ranks())
        except Exception:
            return set(self._stuck)
        with self._lock:
            self._stuck &= running
            return set(self._stuck)

    def _stuck_ranks(self) -> list[int]:
        """Ranks whose engine still has work queued or running."""
        with self._client_lock:
            status = self._client.queue_status()
        return [
            r for r in range(self.world_size) if status.get(self._eids[r], {}).get("queue", 0) > 0
        ]

    def stacks(self, ranks: str | list[int] | None = None, wait: float = 2.0) -> dict[int, str]:
        """Every thread's Python stack on each rank (the cell's thread as 'Current thread').
        Asked and answered through the TCPStore, which a thread on each engine watches, so a
        rank busy in a cell or stuck in a collective answers, on this host or another."""
        from datetime import timedelta

        targets = parse_ranks(ranks, self.world_size)
        store = self._store
        for key in self._late_stacks:  # answers that came after we stopped waiting
            store.delete_key(key)
        self._late_stacks = []
        answers = {}
        for r in targets:
            n = store.add(engine.stack_key(r, "count"), 1)
            store.set(engine.stack_key(r, "ask", n), "")
            answers[r] = engine.stack_key(r, "answer", n)
        try:
            store.wait(list(answers.values()), timedelta(seconds=wait))
        except Exception:  # a rank did not answer in time; the others did
            pass
        out: dict[int, str] = {}
        for r, key in answers.items():
            if store.check([key]):
                out[r] = store.get(key).decode(errors="replace")
                store.delete_key(key)
            else:
                self._late_stacks.append(key)
                out[r] = (
                    f"(no answer in {wait:.0f} s: the rank is dead, or native code holds "
                    "its Python interpreter lock)"
                )
        return out

    def _kill_engines(self) -> list[psutil.Process]:
        """SIGKILL every local engine at once; returns them to wait for (their nannies exit
        when they do). ipyparallel stops engines one after another with SIGTERM, and each
        then spends about a second of CPU finalizing torch for nothing (it exits with status
        1 anyway): stop took 11.6 s at 16 ranks. Only the pids we recorded, checked by start
        time (a recycled pid is safe)."""
        procs = list(self._pids.values())
        for proc in procs:
            try:
                proc.kill()
            except psutil.Error:
                pass
        return procs

    def _kill_leftovers(self) -> None:
        """Processes the launcher could not stop (an engine, the controller after a failed
        stop): the engines we recorded (psutil checks their start time, so a recycled pid is
        never touched) and whatever else carries this session's mark."""
        from .watchdog import end_all, session_processes

        procs = {p.pid: p for p in self._pids.values()}
        procs.update({p.pid: p for p in session_processes(self._profile_dir, self._created)})
        end_all(list(procs.values()), grace=0)

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
    ) -> CellResult:
        """Run ``code`` on ``ranks`` at once; show each rank's output labeled as it arrives
        (on this cell's streams, or through ``printer``). Raises DistCellError (labeled
        tracebacks) when any rank raised, DistUsageError while a background cell runs."""
        self._require_running()
        self._refuse_beside_background("%%dist")
        return self._run(
            code,
            parse_ranks(ranks, self.world_size),
            collapse,
            max_lines,
            printer or _Printer(echo),
        )

    def _run(self, code: str, targets: list[int], collapse, max_lines, printer) -> CellResult:
        dead = self._dead_ranks(targets)
        if dead:
            raise DistUsageError(f"{_dead_text(dead)}. Run %dist_restart --hard first.")
        labeler = StreamLabeler(collapse=collapse)
        if max_lines:
            labeler.max_lines = max_lines
        shown = {r: 0 for r in targets}  # rich outputs displayed so far, per rank
        t0 = time.perf_counter()
        with self._client_lock:
            ar = self._view(targets).execute(code, silent=False, block=False)
        self._set_busy(targets, True)
        try:
            self._follow(ar, targets, labeler, printer, shown)
        except KeyboardInterrupt:
            stuck = self._interrupt(ar, targets)
            raise DistInterrupted(_interrupt_summary(targets, stuck), ranks=stuck) from None
        finally:
            self._set_busy(targets, False)
        result = self._collect(ar, targets, labeler, printer, shown, time.perf_counter() - t0)
        self._forget(ar.msg_ids)
        self.last = result
        if result.errors:
            self._errored |= set(result.errors)
            raise self._cell_error(result, targets)
        self._errored -= set(targets)
        return result

    def run_background(
        self, code: str, ranks: str | list[int] | None = None, *, printer: Printer, **kw
    ) -> threading.Thread:
        """``run`` on a thread, so the notebook stays free (for %dist_stacks, %dist_status)
        while the ranks work. Output and errors go to ``printer``; the result to ``last``.
        One at a time: other cells (and pull, push, bench, restart) are refused until it
        ends; ``stacks`` and ``status`` work beside it, ``interrupt`` stops it."""
        self._require_running()
        self._refuse_beside_background("%%dist --background")
        targets = parse_ranks(ranks, self.world_size)  # refuse a bad spec now
        collapse, max_lines = kw.get("collapse", False), kw.get("max_lines")

        def work() -> None:
            try:
                self._run(code, targets, collapse, max_lines, printer)
            except DistCellError as e:
                printer.err(f"{e.report}DistCellError: {e.summary}\n")
            except DistUsageError as e:
                printer.err(f"DistUsageError: {e}\n")
            except Exception as e:  # the session stopped under it, say
                printer.err(f"The background cell ended: {_one_line(e)}\n")

        thread = threading.Thread(target=work, name="infini-background-cell", daemon=True)
        self._background = _Background(thread, targets)
        thread.start()
        return thread

    def _running_background(self) -> _Background | None:
        bg = self._background
        return bg if bg is not None and bg.thread.is_alive() else None

    def _refuse_beside_background(self, what: str, unless_interrupted: bool = False) -> None:
        """One background cell owns its ranks until it ends: anything else sent to the
        engines would queue behind it (or, for a Stop button, interrupt it)."""
        bg = self._running_background()
        if bg is None or threading.current_thread() is bg.thread:
            return
        if unless_interrupted and bg.interrupted:
            return
        raise DistUsageError(
            f"{what}: a background cell is running on {rank_label(bg.ranks)[1:-1]}; wait for "
            "it, or stop it with %dist_interrupt."
        )

    def interrupt(self, ranks: str | list[int] | None = None) -> list[int]:
        """SIGINT the background cell's ranks that still run it (of ``ranks``): stops it
        and nothing else. Returns the ranks signalled."""
        bg = self._running_background()
        if bg is None:
            return []
        bg.interrupted = True
        with self._lock:
            busy = set(self._busy)
        chosen = parse_ranks(ranks, self.world_size) if ranks is not None else bg.ranks
        targets = [r for r in chosen if r in busy and r in bg.ranks]
        self.signal(signal.SIGINT, targets)
        return targets

    def _follow(self, ar, targets, labeler, printer, shown) -> None:
        """Stream output while the cell runs; notice ranks that die."""
        t0 = last_check = time.monotonic()
        running = set(targets)
        while not ar.ready():
            ar.wait(0.05)
            finished = {r for r in running if _done(ar, targets, r)}
            if finished:  # the status shows each rank idle as soon as it is
                running -= finished
                self._set_busy(finished, False)
            # --collapse holds output back a little, so that lines the ranks print at about
            # the same time arrive together and can be merged.
            if not labeler.collapse or time.monotonic() - t0 > COLLAPSE_HOLD_S:
                self._show_progress(ar, targets, labeler, printer, shown, final=False)
            if time.monotonic() - last_check > 0.5:
                last_check = time.monotonic()
                dead = self._dead_ranks(targets)
                if dead:
                    self._fail_dead(ar, targets, dead)

    def _show_progress(self, ar, targets, labeler, printer, shown, final) -> None:
        mds = _metadata_list(ar)
        printer.out(labeler.feed("stdout", {r: md["stdout"] for r, md in zip(targets, mds)}, final))
        printer.err(labeler.feed("stderr", {r: md["stderr"] for r, md in zip(targets, mds)}, final))
        for r, md in zip(targets, mds):
            for output in md["outputs"][shown[r] :]:
                printer.display(rank_label([r]), output)
            shown[r] = len(md["outputs"])

    def _collect(self, ar, targets, labeler, printer, shown, elapsed) -> CellResult:
        try:
            ar.wait_for_output(timeout=2)
        except Exception:
            pass
        mds = _metadata_list(ar)
        self._show_progress(ar, targets, labeler, printer, shown, final=True)
        result = CellResult(ranks=targets, elapsed=elapsed)
        tracebacks = {}
        replies = ar.get(return_exceptions=True)
        for r, md, reply in zip(targets, mds, replies):
            result.stdout[r] = md["stdout"]
            result.stderr[r] = md["stderr"]
            if isinstance(reply, BaseException):
                result.errors[r] = _one_line(reply)
                if not _engine_died(reply):  # its traceback is ipyparallel's, not the user's
                    tracebacks[r] = _remote_traceback(reply)
                if _collective_timed_out(reply):
                    result.timed_out.append(r)
            elif md.get("execute_result"):
                data = md["execute_result"].get("data", {})
                result.results[r] = data
                printer.display(rank_label([r]), {"data": data, "metadata": {}})
        result.report = error_report(tracebacks)
        return result

    def _interrupt(self, ar, targets) -> list[int]:
        """Stop button: SIGINT every running rank; for ranks that ignore it (stuck in native
        code, such as a collective whose peers never came), show where they are and what to
        do: they stay stuck until the collective timeout fires."""
        self.signal(signal.SIGINT, targets)
        ar.wait(INTERRUPT_GRACE_S)
        if ar.ready():
            return []
        stuck = [r for r in targets if not _done(ar, targets, r)]
        with self._lock:
            self._stuck = set(stuck)
        stacks = self.stacks(stuck)
        report = "".join(
            f"{rank_label([r])} stack:\n{main_thread_stack(stacks[r])}\n" for r in stuck
        )
        print(
            f"{report}{rank_label(stuck)} ignored SIGINT for {INTERRUPT_GRACE_S:.0f} s: stuck in "
            f"native code (stacks above). They stay busy until the {self.plan.timeout:.0f} s "
            "collective timeout fires; then %dist_restart rebuilds the process groups and "
            "keeps your variables. %dist_restart --hard restarts the engines now.",
            file=sys.stderr,
        )
        return stuck

    def _fail_dead(self, ar, targets, dead: dict[int, str]) -> None:
        alive = [r for r in targets if r not in dead]
        self.signal(signal.SIGINT, alive)  # don't leave survivors waiting on the dead
        for r in dead:
            self._errored.add(r)
        raise DistCellError(
            f"{_dead_text(dead)}. The other ranks were interrupted. {_HARD_RESTART}",
            ranks=sorted(dead),
        )

    def _cell_error(self, result: CellResult, targets: list[int]) -> DistCellError:
        """The error a failed cell raises. A rank that died while the others finished
        (ipyparallel answers for it with an EngineError) is named with its exit code."""
        died = self._dead_ranks(sorted(result.errors))
        for r, e in result.errors.items():
            if r not in died and e.startswith("EngineError"):
                died[r] = "its engine stopped"
        if not died:
            summary = error_summary(result.errors, targets) + _advice(result)
            return DistCellError(summary, result.report, sorted(result.errors))
        others = {r: e for r, e in result.errors.items() if r not in died}
        also = f"; {error_summary(others, [])}" if others else ""
        return DistCellError(
            f"{_dead_text(died)}{also}. {_HARD_RESTART}", result.report, sorted(result.errors)
        )

    def _dead_ranks(self, targets) -> dict[int, str]:
        alive = self._liveness()
        dead = {}
        for r in targets:
            if alive(r):
                continue
            proc = self._pids.get(r)
            dead[r] = (
                _exit_description(self._exit_code(proc))
                if proc is not None
                else "its engine unregistered"
            )
        return dead

    def _liveness(self) -> Callable[[int], bool]:
        """``alive(rank)``: a local engine by its process; a remote one (no pid of ours) by
        the controller, which drops an engine when its nanny reports it gone or its
        heartbeats stop. The controller is asked once, and only when a rank is remote."""
        registered: set[int] | None = None

        def alive(r: int) -> bool:
            nonlocal registered
            proc = self._pids.get(r)
            if proc is not None:
                return _alive(proc)
            if registered is None:
                with self._client_lock:
                    client = self._client
                    registered = set(client.ids) if client is not None else set()
            return bool(self._eids) and self._eids[r] in registered

        return alive

    def _exit_code(self, proc: psutil.Process) -> int | None:
        """The engine's exit status as its ipyparallel launcher recorded it (the launcher
        reaps the child, so only it can know). Negative: killed by that signal."""
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            for engine_set in (self._cluster.engines if self._cluster else {}).values():
                for data in (engine_set.stop_data or {}).get("engines", {}).values():
                    if data.get("pid") == proc.pid:
                        return data.get("exit_code")
            time.sleep(0.05)
        return None

    def signal(self, signum: int, ranks: list[int] | None = None) -> None:
        """Send ``signum`` to the engines of ``ranks`` (pids this session started)."""
        remote = []
        for r in ranks if ranks is not None else range(self.world_size):
            proc = self._pids.get(r)
            if proc is None:
                remote.append(self._eids[r])
                continue
            try:
                if proc.is_running():
                    proc.send_signal(signum)
            except psutil.Error:
                pass
        with self._client_lock:
            if remote and self._client is not None:  # through each engine's nanny
                self._client.send_signal(signum, targets=remote, block=False)

    def _forget(self, msg_ids: list[str]) -> None:
        """Drop what ipyparallel keeps of finished work: the client's results, metadata and
        history now, the controller's records soon after (see ``_purge_hub``). Work still
        running (a rank that ignored an interrupt) is dropped once it ends."""
        with self._client_lock:
            client = self._client
            if client is None:
                return
            self._unpurged.extend(msg_ids)
            done = {m for m in self._unpurged if m not in client.outstanding}
            self._unpurged = [m for m in self._unpurged if m not in done]
            client.purge_local_results(jobs=list(done))
            client.history = [m for m in client.history if m not in done]
            if self._hub_purge_queued or self._loop is None:
                return
            self._hub_purge_queued = True
        self._loop.call_soon_threadsafe(self._loop.call_later, HUB_PURGE_DELAY_S, self._purge_hub)

    def _purge_hub(self) -> None:
        """Ask the controller to drop every finished task's record (results included, such
        as a pulled tensor). On the session's loop thread, at most once per
        HUB_PURGE_DELAY_S: a round trip costs about as much as an empty cell's tenth, and
        the controller counts a task finished a little after the client does."""
        with self._client_lock:
            self._hub_purge_queued = False
            client = self._client
            if client is None:
                return
            try:  # purge_hub_results would wait for ever on a controller that is gone
                reply = client._send(
                    client._query_stream,
                    "purge_request",
                    content={"engine_ids": [], "msg_ids": "all"},
                )
                reply.result(timeout=10)
            except Exception as e:
                log.debug("controller purge: %s", e)

    def _set_busy(self, ranks, busy: bool) -> None:
        with self._lock:
            if busy:
                self._busy |= set(ranks)
            else:
                self._busy -= set(ranks)

    # ----- data in and out ----------------------------------------------------------------
    def apply(
        self, fn, *args, ranks: str | list[int] | None = None, timeout: float | None = None
    ) -> dict[int, Any]:
        """Call an importable function on ``ranks`` at once; ``{rank: return value}``.

        The function runs in the engine process; ``engine.user_namespace()`` reaches the
        ``%%dist`` namespace. Raises DistCellError naming the ranks that raised."""
        self._require_running()
        self._refuse_beside_background(getattr(fn, "__name__", "call"))
        targets = parse_ranks(ranks, self.world_size)
        with self._client_lock:
            pending = {r: self._engine(r).apply_async(fn, *args) for r in targets}
        self._set_busy(targets, True)
        try:
            return self._gather(pending, what=getattr(fn, "__name__", "call"), timeout=timeout)
        except KeyboardInterrupt:
            self.signal(signal.SIGINT, targets)
            raise DistInterrupted(
                f"{getattr(fn, '__name__', 'call')} interrupted; {rank_label(targets)[1:-1]} "
                "were sent SIGINT."
            ) from None
        finally:
            self._set_busy(targets, False)

    def pull(self, name: str, ranks: str | list[int] | None = None) -> dict[int, Any]:
        """``{rank: value}`` of a namespace variable, tensors moved to CPU."""
        return self.apply(engine.pull_value, name, ranks=ranks, timeout=60)

    def push(self, values: dict, ranks: str | list[int] | None = None) -> None:
        """Set variables in the ranks' namespaces."""
        try:
            self.apply(engine.push_values, values, ranks=ranks, timeout=60)
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
        dead = self._dead_ranks(targets)
        if dead:
            raise DistUsageError(f"{_dead_text(dead)}: its frames are gone.")
        out = self.apply(engine.post_mortem, code, ranks=targets, timeout=60)
        if echo:
            shown = [prefix_lines(rank_label([r]), text) for r, text in out.items() if text]
            _Printer(echo).out("".join(shown))
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
        """Each rank's pid, device and state (idle, busy, error, dead)."""
        with self._lock:
            busy = set(self._busy)
        stuck = self._still_stuck()
        alive = self._liveness()
        telemetry = self._telemetry()
        for rs in self.ranks:
            for name, value in telemetry.get(rs.rank, {}).items():
                setattr(rs, name, value)
            proc = self._pids.get(rs.rank)
            if not self.running:
                rs.state = "stopped"
            elif not alive(rs.rank):
                if rs.state != "dead" and proc is not None:  # look the exit code up once
                    rs.exit_code = self._exit_code(proc)
                rs.state = "dead"
            elif rs.rank in stuck:
                rs.state = "stuck"
            elif rs.rank in busy:
                rs.state = "busy"
            elif rs.rank in self._errored:
                rs.state = "error"
            else:
                rs.state = "idle"
        return list(self.ranks)

    def _telemetry(self) -> dict[int, dict]:
        """The latest snapshot each rank's telemetry thread put in the store (engine.py)."""
        store = self._store
        if store is None or not self.running:
            return {}
        out = {}
        try:
            for rs in self.ranks:
                key = engine.telemetry_key(rs.rank)
                if store.check([key]):  # get would wait for a rank that has not reported yet
                    out[rs.rank] = engine.parse_telemetry(store.get(key))
        except Exception:  # the store is closing with the session: show what we have
            pass
        return out

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


@dataclass
class _Background:
    """The background cell: its thread, its ranks, and whether %dist_interrupt was sent."""

    thread: threading.Thread
    ranks: list[int]
    interrupted: bool = False


class Printer(Protocol):
    """Where a cell's labeled output goes."""

    def out(self, text: str) -> None: ...
    def err(self, text: str) -> None: ...
    def display(self, label: str, output: dict) -> None: ...


class _Printer:
    """The running cell's streams and IPython's display publisher."""

    def __init__(self, echo: bool):
        self.echo = echo

    def out(self, text: str) -> None:
        if self.echo and text:
            sys.stdout.write(text)
            sys.stdout.flush()

    def err(self, text: str) -> None:
        if self.echo and text:
            sys.stderr.write(text)
            sys.stderr.flush()

    def display(self, label: str, output: dict) -> None:
        if not self.echo:
            return
        from IPython import get_ipython

        ip = get_ipython()
        data = output.get("data", {})
        if ip is None or getattr(ip, "display_pub", None) is None or set(data) == {"text/plain"}:
            self.out(prefix_lines(label, data.get("text/plain", "")))  # plain values inline
            return
        self.out(f"{label}\n")
        ip.display_pub.publish(data=data, metadata=output.get("metadata") or {})


def _metadata_list(ar) -> list[dict]:
    md = ar.metadata
    return md if isinstance(md, list) else [md]


def _done(ar, targets, rank) -> bool:
    md = _metadata_list(ar)[targets.index(rank)]
    return md.get("status") is not None or md.get("completed") is not None


_SOURCE_PREFIX = re.compile(r"^\[[^\]]+\.(?:cc|cpp|h|hpp):\d+\]\s*")


def _one_line(e: BaseException) -> str:
    ename = getattr(e, "ename", type(e).__name__)
    evalue = _SOURCE_PREFIX.sub("", str(getattr(e, "evalue", str(e))).strip())
    first = str(evalue).strip().splitlines()[0] if str(evalue).strip() else ""
    return f"{ename}: {first}" if first else ename


def _remote_traceback(e: BaseException) -> str:
    tb = getattr(e, "traceback", None)
    if isinstance(tb, str) and tb.strip():
        return tb
    render = getattr(e, "render_traceback", None)
    if render is not None:
        try:
            return "\n".join(render())
        except Exception:
            pass
    return _one_line(e)


INTERRUPT_GRACE_S = 3.0
DIGEST_HISTORY = 2**14
HUB_PURGE_DELAY_S = 1.0  # a cell's records stay on the controller this long at most
COLLAPSE_HOLD_S = 2.0
_TIMEOUT_WORDS = ("timed out", "timeout")
# torch.distributed's own errors; gloo and nccl raise RuntimeError naming their sources
_DIST_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError")
_BACKEND_WORDS = ("gloo", "nccl", "processgroup")
_HARD_RESTART = "Run %dist_restart --hard to bring the session back (variables are lost)."


def _engine_died(e: BaseException) -> bool:
    """ipyparallel's answer for a task whose engine went away."""
    return getattr(e, "ename", type(e).__name__) == "EngineError"


def _collective_timed_out(e: BaseException) -> bool:
    """A timeout raised by torch.distributed or its backends, not any error that says
    "timeout" (a user's own TimeoutError leaves the process groups intact)."""
    ename = getattr(e, "ename", type(e).__name__)
    evalue = str(getattr(e, "evalue", e)).lower()  # raw: gloo's source path is kept
    if not any(w in evalue for w in _TIMEOUT_WORDS):
        return False
    return ename in _DIST_ERRORS or (
        ename == "RuntimeError" and any(w in evalue for w in _BACKEND_WORDS)
    )


def _interrupt_summary(targets: list[int], stuck: list[int]) -> str:
    if not stuck:
        return f"cell interrupted; {rank_label(targets)[1:-1]} stopped. The session is ready."
    return (
        f"cell interrupted, but {rank_label(stuck)[1:-1]} did not stop (stuck in native code; "
        "see the stacks above)."
    )


def _advice(result: CellResult) -> str:
    """What to do next, for failures that leave the process groups unusable."""
    if result.timed_out:
        return (
            ". A collective timed out: the failing ranks waited for peers that never joined; "
            "their tracebacks show where. The process groups are likely broken: run "
            "%dist_restart (keeps variables)."
        )
    return ""


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
    return f"cannot send {', '.join(f'`{n}`' for n in values)} to the ranks: {_one_line(error)}"


class _EnginesExited(RuntimeError):
    """Engines ended before registering; carries the tail of what they printed."""

    def __init__(self, engine_set, lines: int = 20):
        exits = (engine_set.stop_data or {}).get("engines", {})
        failed = {i: d.get("exit_code") for i, d in exits.items() if d.get("exit_code")}
        ident, code = next(iter(failed.items()), next(iter(exits.items()), ("?", None)))
        more = f" ({len(exits) - 1} more engines exited)" if len(exits) > 1 else ""
        super().__init__(f"engine {ident} exited while starting ({_exit_description(code)}){more}")
        try:
            output = engine_set.get_output()
        except Exception:
            output = ""
        self.output = "".join(output.splitlines(True)[-lines:])


def _start_error(plan: SessionPlan, e: Exception) -> DistCellError:
    """What a failed start says: the cause (an engine's own output when it exited) and
    advice that fits where the ranks run."""
    place = plan.placement
    remote = place.launcher == "slurm" or any(not is_loopback(h) for h, _ in place.hosts)
    cause = str(e) if isinstance(e, _EnginesExited) else _one_line(e)
    output = getattr(e, "output", "").rstrip()
    seen = " (its output is above)" if output else ""
    if remote:
        advice = (
            "Check that the hosts are reachable and run the same Python with "
            "infini_notebook installed."
        )
    else:
        advice = (
            f"The engines run {sys.executable} on this machine: check that it imports "
            "ipyparallel, torch and infini_notebook, and your --env values."
        )
    return DistCellError(
        f"Starting {plan.world_size} ranks with the {place.launcher} launcher failed: "
        f"{cause}{seen}. Nothing is left running. {advice}",
        f"{output}\n" if output else "",
    )


def _dead_text(dead: dict[int, str]) -> str:
    return "; ".join(f"rank {r} died ({why})" for r, why in sorted(dead.items()))


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _exit_description(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
