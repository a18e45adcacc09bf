"""The ipyparallel side of a session: the controller (``Cluster``), the client and the lock
every use of it holds (ipyparallel's Client is not thread-safe, and the foreground cell, a
--background cell's thread and the status widget's poller all use it), the event loop
ipyparallel runs on (see ``in_loop``), requests to the controller that never wait for ever,
gathering replies, and purging finished work. :class:`Client` is the only writer of all of
it."""

from __future__ import annotations

import glob
import logging
import os
import re
import threading
import time
from typing import Any

import psutil

from ..core import internals
from ..core.errors import DistCellError, DistUsageError
from ..core.output import error_report, error_summary, one_line, remote_traceback
from ..core.plan import SessionPlan
from ..core.ranks import rank_label
from . import reply_dates

log = logging.getLogger("infini_notebook")

DIGEST_HISTORY = 2**14
HUB_PURGE_DELAY_S = 1.0  # a cell's records stay on the controller this long at most
CONTROLLER_TIMEOUT_S = 10.0  # the longest any single request to the controller may take
# private: ipyparallel's own requests (queue_status, purge_hub_results) can wait for ever
_QUERY_PARTS = ("_send", "_query_stream")
_REGISTRATION = ("_registration_callbacks",)  # private: called at each (un)registration
IO_THREAD_WAIT_S = 60.0  # ipyparallel's IO thread runs a queued call within ms; a dead one never
CONTROLLER_GONE = (
    "The session's ipyparallel controller is gone (it died or was killed), so nothing "
    "reaches the ranks. Run %dist_restart --hard (variables are lost) or %dist_stop."
)


class ControllerGone(DistUsageError):
    """The controller died: no request to the ranks can be answered."""

    def __init__(self, what: str = ""):
        super().__init__(f"{what}: {CONTROLLER_GONE}" if what else CONTROLLER_GONE)


ANSI = re.compile(r"\x1b\[[0-9;]*m")  # IPython colours its tracebacks


class Client:
    def __init__(self, error_log: str | None = None):
        self.lock = threading.RLock()  # held for every use of the client (see above)
        self.error_log = error_log  # the whole tracebacks of failed machinery calls
        self._cluster: Any = None
        self._client: Any = None
        self._loop: Any = None
        self._unpurged: list[str] = []  # msg ids of finished work
        self._purge_queued = False  # a purge of the controller's records is due soon
        # set by ipyparallel's IO thread when an engine registers or unregisters
        self._registrations = threading.Event()

    # ----- read-only views ------------------------------------------------------------------
    @property
    def cluster(self):
        """ipyparallel's Cluster (its engine sets, the controller's launcher), or None."""
        return self._cluster

    @property
    def ipp_client(self):
        """ipyparallel's Client itself, for inspection (tests): use it under ``lock``."""
        return self._client

    @property
    def connected(self) -> bool:
        return self._client is not None

    def ids(self) -> set[int]:
        """The engine ids registered with the controller now."""
        with self.lock:
            return set(self._client.ids) if self._client is not None else set()

    def view(self, eids):
        """ipyparallel's view of the engines ``eids`` (one id, or a list)."""
        return self._client[eids]

    # ----- what the relay (launch/relay.py) shares with ipyparallel's client ------------------
    @property
    def session(self):
        """ipyparallel's Session: the key and signature scheme the engines check."""
        return self._client.session

    def unwrap_exception(self, content: dict):
        """A rank's error reply as ipyparallel's RemoteError (``Client._unwrap_exception``,
        ipyparallel 9.2, private: it names the engine as the client's own errors do)."""
        client = self._client
        internals.require(client, ("_unwrap_exception",), "ipyparallel", "Client: errors")
        return client._unwrap_exception(content)

    def dispatch_iopub(self, msg: dict) -> None:
        """A rank's message handed to ipyparallel's client on its IO thread, as if it came
        on iopub, and handled before this returns (``Client._dispatch_iopub``, private:
        its comm_open makes the proxy comm that lets a rank's widget talk to the notebook)."""
        import zmq

        client = self._client
        internals.require(client, ("_dispatch_iopub", "_io_loop"), "ipyparallel", "Client: iopub")
        # as frames off its iopub socket: the handler's decorator (unpack_message) unpacks them
        raw = client.session.serialize(msg) + list(msg.get("buffers") or [])
        handled = threading.Event()

        def dispatch():
            try:
                client._dispatch_iopub([zmq.Frame(f) for f in raw])
            finally:
                handled.set()

        client._io_loop.add_callback(dispatch)
        # waited for: the notebook must have the widget (comm_open) before the rank's
        # display of it, which the caller shows next; ipyparallel keeps that order itself
        handled.wait(IO_THREAD_WAIT_S)

    # ----- the loop ---------------------------------------------------------------------------
    def in_loop(self, coro, timeout: float = 120):
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

    def call_soon(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the session's loop (from any thread)."""
        self._loop.call_soon_threadsafe(fn, *args)

    def call_later(self, delay: float, fn, *args) -> None:
        """On the loop's thread: run ``fn(*args)`` there in ``delay`` seconds."""
        self._loop.call_later(delay, fn, *args)

    def on_io_thread(self, fn):
        """``fn(client)`` run on ipyparallel's IO thread, under the lock held here for it.
        A request sent there is queued behind the call (``Client._send`` hands the send to
        that thread), and what engines publish is dispatched there too: listeners a
        request's output needs are in place before any of it arrives. ipyparallel keeps no
        copy of ``update_display_data`` or ``clear_output`` (``Client._dispatch_iopub``),
        so a listener added after them lost them (a rank's display showed its first value
        instead of its last)."""
        import concurrent.futures

        with self.lock:
            client = self._client
            if client is None:
                raise ControllerGone("a cell")
            internals.require(client, ("_io_loop",), "ipyparallel", "Client: its IO thread")
            done: concurrent.futures.Future = concurrent.futures.Future()

            def call():
                if done.set_running_or_notify_cancel():
                    try:
                        done.set_result(fn(client))
                    except BaseException as e:
                        done.set_exception(e)

            client._io_loop.add_callback(call)
            try:
                return done.result(IO_THREAD_WAIT_S)
            except concurrent.futures.TimeoutError:
                if done.cancel():  # it never ran: a client whose IO thread is gone
                    raise ControllerGone("a cell") from None
                return done.result()  # it runs: its sends are queued, let it finish

    def stop_loop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None

    # ----- the controller ---------------------------------------------------------------------
    def start_controller(self, plan: SessionPlan, profile_dir: str, template: str = "") -> None:
        """A new controller and a client of it; ``template``: a ready template's socket,
        which forks it (see template_launcher)."""
        import ipyparallel as ipp

        from . import launchers

        self._cluster = ipp.Cluster(
            **launchers.cluster_options(plan, profile_dir),
            log=logging.getLogger("infini_notebook.ipyparallel"),
            shutdown_atexit=not plan.keep_s,  # a kept session outlives the kernel
        )
        options = launchers.controller_options(plan, template)
        self.in_loop(self._cluster.start_controller(**options))
        wait_for_files(self._cluster.controller)
        self._client = self.in_loop(self._cluster.connect_client())
        self._tune_client()

    def attach(self, profile_dir: str, cluster_id: str) -> None:
        """A kept session's running controller (see keep.py): its Cluster as ipyparallel
        saved it (engine sets, launchers watching their pids), and a client of it."""
        import ipyparallel as ipp

        async def reconnect():  # on the loop: the launchers watch from it
            cluster = ipp.Cluster.from_file(
                profile_dir=profile_dir,
                cluster_id=cluster_id,
                log=logging.getLogger("infini_notebook.ipyparallel"),
            )
            return cluster, await cluster.connect_client()

        self._cluster, self._client = self.in_loop(reconnect(), timeout=60)
        self._tune_client()

    def _tune_client(self) -> None:
        # Signatures of received messages, kept against replays: 2**16 by default, ~10 MB
        # after some thousand cells. Messages travel on loopback or CurveZMQ.
        self._client.session.digest_history_size = DIGEST_HISTORY
        reply_dates.install()  # each rank's reply date read without dateutil (see there)
        self._follow_registrations()

    def _follow_registrations(self) -> None:
        """Engines registering wake ``wait_for_registration`` (ipyparallel's own
        ``wait_for_engines`` hooks the same private list)."""
        if internals.usable(self._client, _REGISTRATION, "ipyparallel", "engines registering"):
            self._client._registration_callbacks.append(lambda _event: self._registrations.set())

    def on_unregister(self, callback) -> None:
        """``callback(engine_id)`` on ipyparallel's IO thread when an engine unregisters
        (it died or was stopped: the controller missed its heartbeats)."""
        if internals.usable(self._client, _REGISTRATION, "ipyparallel", "engines leaving"):

            def call(event: dict) -> None:
                if event.get("event") == "unregister" and "id" in event:
                    callback(int(event["id"]))

            self._client._registration_callbacks.append(call)

    def wait_for_registration(self, timeout: float) -> None:
        """Until an engine registers or unregisters, or ``timeout`` seconds. The caller
        checks ``ids()`` after it: an event between that check and this wait is kept."""
        self._registrations.wait(timeout)
        self._registrations.clear()

    def ensure_controller(self, plan: SessionPlan, profile_dir: str, template: str = "") -> None:
        """Keep a running controller (a hard restart's new engines register with it);
        replace one that died, its client and connection files first."""
        if self.controller_running():
            return
        self.stop_controller(profile_dir)
        self.start_controller(plan, profile_dir, template)

    def controller_running(self) -> bool:
        """By the process itself: the launcher's state lags a kill (its waiting thread
        notices the exit, then the loop runs the callback), and a restart decided on that
        state once kept a dead controller and then started a second one beside its files."""
        controller = getattr(self._cluster, "controller", None)
        if self._client is None or getattr(controller, "state", None) != "running":
            return False
        try:
            return controller.process.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def controller_process(self) -> psutil.Process | None:
        """The controller's process (this kernel's, or an attached session's), or None."""
        return getattr(getattr(self._cluster, "controller", None), "process", None)

    def require_controller(self, what: str = "") -> None:
        if self._cluster is not None and not self.controller_running():
            raise ControllerGone(what)

    def ask_controller(self, msg_type: str, content: dict, timeout: float = CONTROLLER_TIMEOUT_S):
        """One request on the controller's query socket, its reply's content. Sent under the
        client lock, waited for outside it, and never for longer than ``timeout``:
        ipyparallel's own calls (queue_status, purge_results) wait for ever on a dead one."""
        future = self._send_to_controller(msg_type, content)
        try:
            reply = future.result(timeout=timeout)
        except Exception:
            self.require_controller(msg_type)
            raise TimeoutError(
                f"the controller did not answer {msg_type} in {timeout:.0f}s"
            ) from None
        content = reply["content"]
        if content.get("status") != "ok":
            raise RuntimeError(f"the controller refused {msg_type}: {content}")
        return content

    def _send_to_controller(self, msg_type: str, content: dict):
        """Send one request on the controller's query socket, under the client lock; the
        future of its reply."""
        with self.lock:
            client = self._client
            if client is None:
                raise ControllerGone(msg_type)
            internals.require(client, _QUERY_PARTS, "ipyparallel", "Client: controller requests")
            return client._send(client._query_stream, msg_type, content=content)

    def queue_status(self) -> dict[int, dict]:
        """Each engine's queue lengths (``Client.queue_status()``, bounded)."""
        from ipyparallel import util

        content = self.ask_controller("queue_request", {"targets": None, "verbose": False})
        content.pop("status", None)
        return util.int_keys(content)

    def send_signal(self, signum: int, eids: list[int]) -> None:
        """Through each engine's nanny (for engines that are no process of ours here)."""
        with self.lock:
            if eids and self._client is not None:
                self._client.send_signal(signum, targets=eids, block=False)

    def close(self) -> None:
        with self.lock:
            if self._client is not None:
                try:
                    self._client.close()
                except Exception:
                    pass
                self._client = None
            self._unpurged = []

    def stop_controller(self, profile_dir: str) -> None:
        """The controller, running or dead, and its connection files (a controller that died
        leaves them; a new one must not meet them). Engines first: see Engines.stop_all."""
        self.close()
        if self._cluster is None:
            return
        self._end_orphan_controller()
        try:
            self.in_loop(self._cluster.stop_controller())
        except Exception as e:
            log.warning("stopping the controller: %s", e)
        security = os.path.join(profile_dir, "security")
        for path in glob.glob(os.path.join(security, f"ipcontroller-{self._cluster.cluster_id}-*")):
            try:
                os.remove(path)
            except OSError:
                pass
        self._cluster = None

    def _end_orphan_controller(self) -> None:
        """A running controller that is no child of this process (a kept session's, after an
        attach) is ended from here and waited for by its pidfd; then ipyparallel is told it
        stopped. ipyparallel's own stop waits for such a process until its pid is gone, and
        the zombie of one whose parent died (the kernel that started the session) stays
        until PID 1 reaps it: 1.2-1.9 s of a 2 s stop after an attach here, for ever under a
        PID 1 that does not reap."""
        from .template_launcher import FORKED
        from .watchdog import end_all

        controller = getattr(self._cluster, "controller", None)
        proc = getattr(controller, "process", None)
        if proc is None or getattr(controller, "state", None) != "running":
            return
        if getattr(controller, "how", "") == FORKED:
            return  # forked here: the template reaps it, or Forked.wait_orphan waits by pidfd
        try:
            if proc.ppid() == os.getpid():
                return  # ours: reaped as it ends
        except psutil.Error:
            return
        end_all([proc], grace=float(getattr(controller, "stop_seconds_until_kill", 5)))

        async def stopped():  # on the loop, as the launcher's own watcher would call it
            controller.notify_stop({"exit_code": None, "pid": proc.pid})

        self.in_loop(stopped())

    # ----- replies ------------------------------------------------------------------------
    def gather(self, pending: dict, what: str, timeout: float, log: bool = True) -> dict:
        """Wait for one apply per rank; raise DistCellError naming the ranks that failed,
        one line each: these are our calls (start, restart, bench, pull, push), and their
        tracebacks run through our and ipyparallel's frames; the whole of them goes to the
        session folder's errors.log, which the error names. ``log=False`` (a failed start,
        whose folder goes with it): the tracebacks are shown instead."""
        deadline = time.monotonic() + timeout
        out, errors, tracebacks = {}, {}, {}
        try:
            for r, ar in pending.items():
                while not ar.ready() and time.monotonic() < deadline:  # a dead controller
                    ar.wait(min(1.0, max(0.0, deadline - time.monotonic())))
                    if not ar.ready() and not self.controller_running():
                        raise DistCellError(f"{what}: {CONTROLLER_GONE}")
                try:
                    out[r] = ar.get(timeout=0)
                except Exception as e:
                    errors[r] = one_line(e)
                    tracebacks[r] = remote_traceback(e)
        finally:  # also when interrupted (Stop during a pull): the client's history
            # and results kept every interrupted call's entries for the session's life.
            # Return values can be big (a pulled tensor): nothing here keeps a copy.
            self.forget([m for ar in pending.values() for m in ar.msg_ids])
        if errors:
            where = self._log_tracebacks(what, tracebacks) if log else None
            lines = "".join(f"{rank_label([r])} {errors[r]}\n" for r in sorted(errors))
            raise DistCellError(
                f"{what} failed on {error_summary(errors, list(pending))}",
                lines + (f"(the tracebacks: {where})\n" if where else error_report(tracebacks)),
                sorted(errors),
            )
        return out

    def _log_tracebacks(self, what: str, tracebacks: dict[int, str]) -> str | None:
        """Append the tracebacks to the error log; its path, or None if it cannot be written."""
        if not self.error_log:
            return None
        try:
            with open(self.error_log, "a", encoding="utf-8") as f:
                f.write(f"===== {what}, {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n")
                f.write(ANSI.sub("", error_report(tracebacks)))
        except OSError:
            return None
        return self.error_log

    def forget(self, msg_ids: list[str]) -> None:
        """Drop what ipyparallel keeps of finished work: the client's results, metadata and
        history now, the controller's records soon after (see ``_purge_hub``). Work still
        running (a rank that ignored an interrupt) is dropped once it ends."""
        with self.lock:
            client = self._client
            if client is None:
                return
            self._unpurged.extend(msg_ids)
            outstanding = client.outstanding  # a traitlet: slow to read once per message
            done = {m for m in self._unpurged if m not in outstanding}
            self._unpurged = [m for m in self._unpurged if m not in done]
            if done:  # an empty list is refused by ipyparallel
                client.purge_local_results(jobs=list(done))
            client.history = [m for m in client.history if m not in done]
            # A widget's callback on a rank runs for a comm message the notebook relayed
            # (ipyparallel's relay_comm); the widget updates it sends back are filed under
            # that message's id, which is no request of ours: a record per click, dropped.
            ours = set(client.history) | set(self._unpurged) | {"submitted"}
            for stray in [m for m in list(client.metadata) if m not in ours]:
                client.metadata.pop(stray, None)
            if self._purge_queued or self._loop is None:
                return
            self._purge_queued = True
        self._loop.call_soon_threadsafe(self._loop.call_later, HUB_PURGE_DELAY_S, self._purge_hub)

    def _purge_hub(self) -> None:
        """Ask the controller to drop every finished task's record (results included, such
        as a pulled tensor). On the session's loop thread, at most once per
        HUB_PURGE_DELAY_S: a round trip costs about as much as an empty cell's tenth, and
        the controller counts a task finished a little after the client does. Not waited
        for: the loop also stops engines, and a controller that died would have held a hard
        restart for the whole CONTROLLER_TIMEOUT_S."""
        self._purge_queued = False
        if not self.controller_running():
            return
        try:
            future = self._send_to_controller("purge_request", {"engine_ids": [], "msg_ids": "all"})
        except Exception as e:
            log.debug("controller purge: %s", e)
            return
        future.add_done_callback(_log_purge_reply)


def _log_purge_reply(future) -> None:
    try:
        status = future.result()["content"].get("status")
    except Exception as e:
        status = one_line(e)
    if status != "ok":
        log.debug("controller purge: %s", status)


def wait_for_files(controller, timeout: float = 60.0, every: float = 0.005) -> None:
    """Until the controller (just launched) has written its connection files, polling every
    5 ms: ipyparallel's ``get_connection_info`` polls every 0.1 s, and a start waited 50 ms
    on average for it. Returns early when the controller exits or ``timeout`` passes:
    ipyparallel's own wait then says what went wrong."""
    paths = list(getattr(controller, "connection_files", {}).values())
    process = getattr(controller, "process", None)
    deadline = time.monotonic() + timeout
    while paths and not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline or (process is not None and not process.is_running()):
            return
        time.sleep(every)
