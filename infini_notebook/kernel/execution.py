"""Running code on the ranks: a cell (foreground or background), its labeled output as it
arrives, the Stop button, and the error a failed cell raises. Plain functions taking the
:class:`~infini_notebook.cluster.Session` whose state they read and update."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from ..core import internals
from ..core.errors import DistCellError, DistInterrupted, DistUsageError
from ..core.output import (
    StreamLabeler,
    error_report,
    error_summary,
    main_thread_stack,
    one_line,
    prefix_lines,
    remote_traceback,
)
from ..core.plan import soft_restart_fails
from ..core.ranks import parse_ranks, parse_where, rank_label
from ..core.state import CellResult
from ..launch import processes
from . import supervision
from .wait_watch import WaitWatch

INTERRUPT_GRACE_S = 3.0
COLLAPSE_HOLD_S = 2.0
DEAD_CHECK_S = 0.5  # how often a running cell looks for ranks that died
_TIMEOUT_WORDS = ("timed out", "timeout")
# torch.distributed's own errors; gloo and nccl raise RuntimeError naming their sources
_DIST_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError")
_BACKEND_WORDS = ("gloo", "nccl", "processgroup")
HARD_RESTART = "Run %dist_restart --hard to bring the session back (variables are lost)."


def run(s, code: str, targets: list[int], collapse, max_lines, printer) -> CellResult:
    dead = supervision.dead_ranks(s, targets)
    if dead:
        raise DistUsageError(f"{supervision.dead_text(dead)}. Run %dist_restart --hard first.")
    refuse_stuck(s, targets)
    labeler = StreamLabeler(collapse=collapse)
    if max_lines:
        labeler.max_lines = max_lines
    t0 = time.perf_counter()
    with s.engines.lock:
        ar = processes.ranks_view(s, targets).execute(code, silent=False, block=False)
    cell = Cell(ar, targets, labeler, printer)
    watch = WaitWatch(s, cell, _cell_name())
    set_busy(s, targets, True)
    try:
        try:
            follow(s, cell, watch)
        except KeyboardInterrupt:
            stuck = interrupt_stuck(s, cell)
            cell.wait_for_trailing_output()  # else a late idle re-creates a purged record
            raise DistInterrupted(_interrupt_summary(targets, stuck), ranks=stuck) from None
        finally:
            set_busy(s, targets, False)
            cell.detach()
        result = collect(cell, time.perf_counter() - t0, watch)
    finally:  # interrupted and failed cells too (a stuck rank's record goes once it ends)
        processes.forget(s, ar.msg_ids)
    s.last = result
    if result.errors:
        error = cell_error(s, result, targets, watch)
        s._errored |= set(result.errors)
        raise error
    s._errored -= set(targets)
    return result


def refuse_stuck(s, targets: list[int]) -> None:
    """A rank still running an earlier cell (one that ignored an interrupt, or a wait that
    could not be released) would queue this one behind it, and ipykernel then aborts it."""
    busy = sorted(supervision.still_stuck(s) & set(targets))
    if busy:
        raise DistUsageError(
            f"{rank_label(busy)[1:-1]} still running an earlier cell (stuck in native code; "
            "see %dist_stacks). Wait for the collective timeout, or run %dist_restart --hard."
        )


def _cell_name() -> str:
    """'In[5]': the notebook cell this runs from, for messages that point at a line."""
    try:
        from IPython import get_ipython

        ip = get_ipython()
    except ImportError:
        return ""
    return f"In[{ip.execution_count}]" if ip is not None else ""


def resolve_targets(s, ranks: str | list[int] | None, where: str | dict | None) -> list[int]:
    """The ranks a cell runs on: ``ranks`` (a spec), or those at the layout coordinates
    ``where`` (``"pp=0,tp=1"`` or ``{"pp": 0, "tp": 1}``)."""
    if where:
        if ranks:
            raise DistUsageError("Give --ranks or --where, not both.")
        coords = parse_where(where) if isinstance(where, str) else dict(where)
        try:
            ranks = s.layout.ranks_where(**coords)
        except (TypeError, ValueError) as e:
            raise DistUsageError(f"Bad --where {where!r}: {e}") from None
    return parse_ranks(ranks, s.world_size)


def run_background(
    s,
    code: str,
    ranks: str | list[int] | None = None,
    *,
    printer: Printer,
    where: str | dict | None = None,
    **kw,
) -> threading.Thread:
    """``run`` on a thread, so the notebook stays free (for %dist_stacks, %dist_status)
    while the ranks work. Output and errors go to ``printer``; the result to ``last``.
    One at a time: other cells (and pull, push, bench, restart) are refused until it
    ends; ``stacks`` and ``status`` work beside it, ``interrupt`` stops it."""
    s._require_running()
    refuse_beside_background(s, "%%dist --background")
    targets = resolve_targets(s, ranks, where)  # refuse a bad spec now
    collapse, max_lines = kw.get("collapse", False), kw.get("max_lines")

    def work() -> None:
        try:
            run(s, code, targets, collapse, max_lines, printer)
        except DistCellError as e:
            printer.err(f"{e.report}DistCellError: {e.summary}\n")
        except DistUsageError as e:
            printer.err(f"DistUsageError: {e}\n")
        except Exception as e:  # the session stopped under it, say
            printer.err(f"The background cell ended: {one_line(e)}\n")

    thread = threading.Thread(target=work, name="infini-background-cell", daemon=True)
    s._background = Background(thread, targets)
    thread.start()
    return thread


def running_background(s) -> Background | None:
    bg = s._background
    return bg if bg is not None and bg.thread.is_alive() else None


def refuse_beside_background(s, what: str, unless_interrupted: bool = False) -> None:
    """One background cell owns its ranks until it ends: anything else sent to the
    engines would queue behind it (or, for a Stop button, interrupt it)."""
    bg = running_background(s)
    if bg is None or threading.current_thread() is bg.thread:
        return
    if unless_interrupted and bg.interrupted:
        return
    raise DistUsageError(
        f"{what}: a background cell is running on {rank_label(bg.ranks)[1:-1]}; wait for "
        "it, or stop it with %dist_interrupt."
    )


def interrupt(s, ranks: str | list[int] | None = None) -> list[int]:
    """SIGINT the background cell's ranks that still run it (of ``ranks``): stops it
    and nothing else. Returns the ranks signalled."""
    bg = running_background(s)
    if bg is None:
        return []
    bg.interrupted = True
    with s._lock:
        busy = set(s._busy)
    chosen = parse_ranks(ranks, s.world_size) if ranks is not None else bg.ranks
    targets = [r for r in chosen if r in busy and r in bg.ranks]
    supervision.send_signal(s, signal.SIGINT, targets)
    return targets


class Cell:
    """One running cell, as ipyparallel reports it: each rank's message future resolves on
    its reply, and its iopub callbacks (the hook ``AsyncResult.stream_output`` uses) fire
    on every output message, on the client's IO thread. The callbacks keep the text of each
    stream message as it comes (ipyparallel's accumulated copy is rewritten on ``\\r``, so
    it can shrink, and cannot be diffed) and wake the cell's thread, which shows it: rank
    labels, progress lines updated in place, ``--collapse`` and the line cap
    (``StreamLabeler``). Rich outputs are read from ipyparallel's per-message metadata."""

    LIVE_EVERY_S = 0.1  # a display updated in place at most this often
    # After the replies, output is waited for until no message came for this long. Each
    # rank's idle status ends it at once; the wait runs out only for an engine that went
    # silent after its reply. 2 s lost a rank's last line on a loaded machine.
    TRAILING_QUIET_S = 10.0

    def __init__(self, ar, targets: list[int], labeler: StreamLabeler, printer: Printer):
        internals.require(ar, ("_children",), "ipyparallel", "AsyncResult: one future per rank")
        for f in ar._children:
            internals.require(f, ("iopub_callbacks", "output"), "ipyparallel", "MessageFuture")
        self.ar, self.targets, self.labeler, self.printer = ar, targets, labeler, printer
        self.futures = dict(zip(targets, ar._children))
        self.shown = {r: 0 for r in targets}  # rich outputs displayed so far, per rank
        self.changed = threading.Event()
        self.dirty = set(targets)  # ranks with output not looked at yet
        self._text = {r: {"stdout": [], "stderr": []} for r in targets}  # arrived, not shown
        self._snapshot: dict[int, dict | None] = {}
        self._live_at = 0.0
        self._live_text = ""
        self._dirty_lock = threading.Lock()
        self.heard_at = time.monotonic()  # when the last output message arrived
        self._callbacks = {}
        for r, f in self.futures.items():
            self._callbacks[r] = functools.partial(self._on_message, r)
            with self._dirty_lock:  # a message arriving now waits for the snapshot
                f.iopub_callbacks.append(self._callbacks[r])
                self._take_snapshot(r)
            f.add_done_callback(functools.partial(self._wake, r))
        self.changed.set()  # output that arrived before we listened is read at once

    def _take_snapshot(self, rank: int) -> None:
        """What the rank wrote before we listened, from ipyparallel's copy."""
        md = self.metadata(rank)
        self._snapshot[rank] = {name: md.get(name) for name in ("stdout", "stderr")}
        for name, text in self._snapshot[rank].items():
            if text:
                self._text[rank][name].append(text)

    def _on_message(self, rank: int, msg: dict) -> None:
        self.heard_at = time.monotonic()
        with self._dirty_lock:
            snapshot = self._snapshot.pop(rank, None)
            content = msg.get("content", {})
            if msg.get("header", {}).get("msg_type") == "stream":
                name = content.get("name")
                # ipyparallel updates its copy before the callbacks run, on one thread: only
                # the first message after we listened can be in the snapshot already, and
                # then its copy is still the very string the snapshot took.
                seen = snapshot is not None and self.metadata(rank).get(name) is snapshot[name]
                if name in self._text[rank] and not seen:
                    self._text[rank][name].append(content.get("text", ""))
            self.dirty.add(rank)
        self.changed.set()

    def wait_for_trailing_output(self) -> None:
        """iopub trails the replies: wait for each replied rank's output to end (its idle
        status) for as long as messages keep coming. A fixed wait lost the tail of a flood
        that the client was still reading on a loaded machine."""
        start = time.monotonic()
        while True:
            pending = [self.futures[r].output for r in self.targets if self.done(r)]
            heard = max(start, self.heard_at)
            quiet_left = heard + self.TRAILING_QUIET_S - time.monotonic()
            if quiet_left <= 0:
                return
            _, still = concurrent.futures.wait(pending, timeout=min(quiet_left, 0.2))
            if not still:
                return

    def _wake(self, rank: int, _future=None) -> None:
        with self._dirty_lock:
            self.dirty.add(rank)
        self.changed.set()

    def detach(self, final: bool = False) -> None:
        """Stop listening to the ranks whose output is complete (all of them when
        ``final``): output still trailing a reply is shown by ``show(final=True)``."""
        for r, f in self.futures.items():
            if (final or f.output.done()) and self._callbacks[r] in f.iopub_callbacks:
                f.iopub_callbacks.remove(self._callbacks[r])

    def done(self, rank: int) -> bool:
        return self.futures[rank].done()

    def metadata(self, rank: int) -> dict:
        return self.futures[rank].output.metadata

    def show(self, final: bool) -> None:
        """Print what the ranks wrote since the last call, labeled; refresh live lines."""
        if final:
            self.detach(final=True)  # before taking the text: nothing comes in after
        with self._dirty_lock:  # a message arriving after this is shown next time
            ranks = self.targets if final else sorted(self.dirty)
            self.dirty = set()
            new = {name: {r: self._take(r, name) for r in ranks} for name in ("stdout", "stderr")}
        self.printer.out(self.labeler.feed("stdout", new["stdout"], final))
        self.printer.err(self.labeler.feed("stderr", new["stderr"], final))
        self._show_live(final)
        for r in ranks:
            outputs = self.metadata(r)["outputs"]
            for output in outputs[self.shown[r] :]:
                self.printer.display(rank_label([r]), output)
            self.shown[r] = len(outputs)

    def _take(self, rank: int, name: str) -> str:
        pieces = self._text[rank][name]
        self._text[rank][name] = []
        return "".join(pieces)

    def _show_live(self, final: bool) -> None:
        """Progress lines (rewritten with \\r) in one display updated in place, a line per
        rank; emptied when the cell ends (their last state is in the stream by then)."""
        live = getattr(self.printer, "live", None)
        text = "" if final else self.labeler.live()
        now = time.monotonic()
        if live is None or text == self._live_text:
            return
        if not final and now - self._live_at < self.LIVE_EVERY_S:
            return
        self._live_at, self._live_text = now, text
        live(text)


def follow(s, cell: Cell, watch: WaitWatch) -> None:
    """Show output as it arrives and each rank idle as soon as it is; notice ranks that
    fail or die while others run, and release the waits that can never finish (watch)."""
    t0 = last_check = time.monotonic()
    running = set(cell.targets)
    while running:
        pause = min(DEAD_CHECK_S, max(0.01, watch.next_wake() - time.monotonic()))
        if cell.changed.wait(pause):
            cell.changed.clear()  # before reading: a later message wakes the next wait
        finished = {r for r in running if cell.done(r)}
        # A lost connection is a consequence: look for a dead peer first, to name it.
        if running - finished and (
            time.monotonic() - last_check > DEAD_CHECK_S or watch.lost_peer(finished)
        ):
            last_check = time.monotonic()
            if not processes.controller_running(s):  # no reply can come any more
                raise DistCellError(processes.CONTROLLER_GONE, ranks=sorted(running))
            dead = set(supervision.dead_ranks(s, sorted(running - finished)))
            if dead:  # their peers' waits are released below; the others finish
                running -= dead
                set_busy(s, dead, False)
                watch.left(dead, running - finished, died=True)
        if finished:
            running -= finished
            set_busy(s, finished, False)
            watch.left(finished, running)
        # --collapse holds output back a little, so that lines the ranks print at about
        # the same time arrive together and can be merged.
        if not cell.labeler.collapse or time.monotonic() - t0 > COLLAPSE_HOLD_S:
            cell.show(final=False)
        stuck = watch.tick(running)
        if stuck:  # released, yet still waiting: native code that ignores the release
            running -= stuck
            give_up_stuck(s, cell, sorted(stuck))


def give_up_stuck(s, cell: Cell, stuck: list[int]) -> None:
    """End the cell without ranks that could not be released: show where they are; the
    next cell on them is refused (refuse_stuck) until they finish."""
    with s._lock:
        s._stuck |= set(stuck)
    stacks = supervision.stacks(s, stuck)
    report = "".join(f"{rank_label([r])} stack:\n{main_thread_stack(stacks[r])}\n" for r in stuck)
    cell.printer.err(report)


def collect(cell: Cell, elapsed: float, watch: WaitWatch) -> CellResult:
    """The finished cell: its last output shown, its values and errors gathered. Ranks
    without a reply (dead, or stuck after a release) are errors; tracebacks already shown
    live, and those of ranks whose wait was released (their peer left), are not repeated."""
    cell.wait_for_trailing_output()
    cell.show(final=True)
    result = CellResult(ranks=cell.targets, elapsed=elapsed)
    tracebacks = {}
    for r in cell.targets:
        md = cell.metadata(r)
        result.stdout[r] = md["stdout"]
        result.stderr[r] = md["stderr"]
        if not cell.done(r):
            gone = watch.gone.get(r)
            result.errors[r] = "EngineError: its engine stopped" if gone else "still running"
            continue
        reply = cell.futures[r].result()
        if isinstance(reply, BaseException):
            result.errors[r] = one_line(reply)
            shown = r in watch.shown_live or watch.gone.get(r) == "released"
            if not _engine_died(reply) and not shown:  # EngineError: ipyparallel's traceback
                tracebacks[r] = remote_traceback(reply)
            if _collective_timed_out(reply):
                result.timed_out.append(r)
        elif md.get("execute_result"):
            data = md["execute_result"].get("data", {})
            result.results[r] = data
            cell.printer.display(rank_label([r]), {"data": data, "metadata": {}})
    result.report = error_report(tracebacks)
    return result


def interrupt_stuck(s, cell: Cell) -> list[int]:
    """Stop button: SIGINT every running rank; for ranks that ignore it (stuck in native
    code, such as a collective whose peers never came), show where they are and what to
    do: they stay stuck until the collective timeout fires."""
    targets = cell.targets
    supervision.send_signal(s, signal.SIGINT, targets)
    cell.ar.wait(INTERRUPT_GRACE_S)
    stuck = [r for r in targets if not cell.done(r)]
    if not stuck:
        return []
    with s._lock:
        s._stuck = set(stuck)
    stacks = supervision.stacks(s, stuck)
    report = "".join(f"{rank_label([r])} stack:\n{main_thread_stack(stacks[r])}\n" for r in stuck)
    print(
        f"{report}{rank_label(stuck)} ignored SIGINT for {INTERRUPT_GRACE_S:.0f} s: stuck in "
        f"native code (stacks above). They stay busy until the {s.plan.timeout:.0f} s "
        f"collective timeout fires; then {_restart_advice(s, after_timeout=True)} "
        "%dist_restart --hard restarts the engines now.",
        file=sys.stderr,
    )
    return stuck


def cell_error(s, result: CellResult, targets: list[int], watch: WaitWatch) -> DistCellError:
    """The error a failed cell raises, root cause first: the ranks that died (named with
    their exit codes) or raised, then the waits released because of them, then what to do.
    Released groups are rebuilt here (a soft restart), so the next cell just works."""
    died = supervision.dead_ranks(s, sorted(result.errors))
    for r, e in result.errors.items():
        if r not in died and e.startswith("EngineError"):
            died[r] = "its engine stopped"
    stuck = [r for r in result.errors if result.errors[r] == "still running"]
    released = {r for r, why in watch.gone.items() if why == "released"} | set(watch.released)
    aside = set(died) | released | set(stuck)
    if not died and set(result.errors) <= aside:  # no other cause: lost peers are the news
        aside -= released - set(watch.released)
    causes = {r: e for r, e in result.errors.items() if r not in aside}
    parts = []
    if died:
        parts.append(supervision.dead_text(died))
    if causes:
        parts.append(error_summary(causes, [r for r in targets if r not in aside]))
    if watch.released:
        parts.append(watch.released_text())
    if stuck:
        parts.append(
            f"{rank_label(stuck)[1:-1]} could not be released (stacks above) and "
            f"{'stays' if len(stuck) == 1 else 'stay'} busy until the "
            f"{s.plan.timeout:.0f} s collective timeout"
        )
    if died or stuck:
        advice = f". {HARD_RESTART}"
    elif watch.released:
        advice = ". " + _rebuild_groups(s)
    else:
        advice = _advice(s, result)
    return DistCellError("; ".join(parts) + advice, result.report, sorted(result.errors))


def _rebuild_groups(s) -> str:
    """The soft restart after a release: new process groups, variables kept."""
    try:
        s.restart()
    except Exception as e:
        return f"Rebuilding the process groups failed ({one_line(e)}). {HARD_RESTART}"
    return (
        "The process groups were rebuilt (variables kept): `groups` and `mesh` are new; "
        "re-create what you built on the old ones (DDP or FSDP modules, your own DeviceMesh "
        "or new_group)."
    )


def set_busy(s, ranks, busy: bool) -> None:
    with s._lock:
        if busy:
            s._busy |= set(ranks)
        else:
            s._busy -= set(ranks)
        s._idle_since = time.monotonic()


def idle_for(s) -> float:
    """Seconds since a rank was last busy (0 while one is): when background work, such as
    forking spare engines (engine_sets.Standby), would slow nobody's cell."""
    with s._lock:
        return 0.0 if s._busy else time.monotonic() - s._idle_since


@dataclass
class Background:
    """The background cell: its thread, its ranks, and whether %dist_interrupt was sent."""

    thread: threading.Thread
    ranks: list[int]
    interrupted: bool = False


class Printer(Protocol):
    """Where a cell's labeled output goes. A printer may also have ``live(text)``: lines
    shown in place of the previous call's (progress lines, see ``Cell._show_live``)."""

    def out(self, text: str) -> None: ...
    def err(self, text: str) -> None: ...
    def display(self, label: str, output: dict) -> None: ...
    def status(self, text: str, handle=None): ...  # optional: a line updated in place


class TextPrinter:
    """The running cell's streams and IPython's display publisher."""

    def __init__(self, echo: bool):
        self.echo = echo
        self._live = None  # the display of this cell's progress lines, once there are some

    def out(self, text: str) -> None:
        if self.echo and text:
            sys.stdout.write(text)
            sys.stdout.flush()

    def err(self, text: str) -> None:
        if self.echo and text:
            sys.stderr.write(text)
            sys.stderr.flush()

    def status(self, text: str, handle=None):
        """A line updated in place (a display with an id); a terminal gets its first text."""
        if not self.echo:
            return handle
        from IPython import get_ipython

        ip = get_ipython()
        if ip is None or getattr(ip, "kernel", None) is None:
            if handle is None:
                self.err(f"{text}\n")
            return True
        from IPython.display import display

        if handle is None:
            return display({"text/plain": text}, raw=True, display_id=True)
        handle.update({"text/plain": text}, raw=True)
        return handle

    def live(self, text: str) -> None:
        """Show ``text`` in place of what the last call showed (a notebook display with an
        id, updated; outside a kernel nothing: the final lines still come on the stream)."""
        if not self.echo:
            return
        bundle = {"text/plain": text}
        if self._live is not None:
            self._live.update(bundle, raw=True)
            return
        from IPython import get_ipython
        from IPython.display import display

        if text and getattr(get_ipython(), "kernel", None) is not None:
            self._live = display(bundle, raw=True, display_id=True)

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


def _advice(s, result: CellResult) -> str:
    """What to do next, for failures that leave the process groups unusable."""
    if result.timed_out:
        return (
            ". A collective timed out: the failing ranks waited for peers that never joined; "
            f"their tracebacks show where. {_restart_advice(s)}"
        )
    return ""


def _restart_advice(s, after_timeout: bool = False) -> str:
    """How to recover from a timed-out collective, for the session's backend."""
    why = soft_restart_fails(s.plan, os.environ)
    if why is not None:
        return f"{why[0].upper()}{why[1:]}: run %dist_restart --hard (variables are lost)."
    if after_timeout:
        return "%dist_restart rebuilds the process groups and keeps your variables."
    return "The process groups are likely broken: run %dist_restart (keeps variables)."
