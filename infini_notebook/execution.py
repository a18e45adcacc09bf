"""Running code on the ranks: a cell (foreground or background), its labeled output as it
arrives, the Stop button, and the error a failed cell raises. Plain functions taking the
:class:`~infini_notebook.cluster.Session` whose state they read and update."""

from __future__ import annotations

import functools
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from . import internals, processes, supervision
from .errors import DistCellError, DistInterrupted, DistUsageError
from .output import (
    StreamLabeler,
    error_report,
    error_summary,
    main_thread_stack,
    one_line,
    prefix_lines,
    remote_traceback,
)
from .ranks import parse_ranks, parse_where, rank_label
from .state import CellResult

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
    labeler = StreamLabeler(collapse=collapse)
    if max_lines:
        labeler.max_lines = max_lines
    t0 = time.perf_counter()
    with s._client_lock:
        ar = processes.ranks_view(s, targets).execute(code, silent=False, block=False)
    cell = Cell(ar, targets, labeler, printer)
    set_busy(s, targets, True)
    try:
        try:
            follow(s, cell)
        except KeyboardInterrupt:
            stuck = interrupt_stuck(s, cell)
            raise DistInterrupted(_interrupt_summary(targets, stuck), ranks=stuck) from None
        finally:
            set_busy(s, targets, False)
            cell.detach()
        result = collect(cell, time.perf_counter() - t0)
    finally:  # interrupted and failed cells too (a stuck rank's record goes once it ends)
        processes.forget(s, ar.msg_ids)
    s.last = result
    if result.errors:
        s._errored |= set(result.errors)
        raise cell_error(s, result, targets)
    s._errored -= set(targets)
    return result


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


def follow(s, cell: Cell) -> None:
    """Show output as it arrives and each rank idle as soon as it is; notice ranks that die."""
    t0 = last_check = time.monotonic()
    running = set(cell.targets)
    while running:
        if cell.changed.wait(DEAD_CHECK_S):
            cell.changed.clear()  # before reading: a later message wakes the next wait
        finished = {r for r in running if cell.done(r)}
        if finished:
            running -= finished
            set_busy(s, finished, False)
        # --collapse holds output back a little, so that lines the ranks print at about
        # the same time arrive together and can be merged.
        if not cell.labeler.collapse or time.monotonic() - t0 > COLLAPSE_HOLD_S:
            cell.show(final=False)
        if running and time.monotonic() - last_check > DEAD_CHECK_S:
            last_check = time.monotonic()
            dead = supervision.dead_ranks(s, cell.targets)  # a dead rank's reply came too
            if dead:
                fail_dead(s, cell.targets, dead)


def collect(cell: Cell, elapsed: float) -> CellResult:
    """The finished cell: its last output shown, its values and errors gathered."""
    ar = cell.ar
    ar.wait_for_output(timeout=2)  # iopub trails the replies a little
    cell.show(final=True)
    result = CellResult(ranks=cell.targets, elapsed=elapsed)
    tracebacks = {}
    replies = ar.get(return_exceptions=True)
    for r, reply in zip(cell.targets, replies):
        md = cell.metadata(r)
        result.stdout[r] = md["stdout"]
        result.stderr[r] = md["stderr"]
        if isinstance(reply, BaseException):
            result.errors[r] = one_line(reply)
            if not _engine_died(reply):  # its traceback is ipyparallel's, not the user's
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
        "collective timeout fires; then %dist_restart rebuilds the process groups and "
        "keeps your variables. %dist_restart --hard restarts the engines now.",
        file=sys.stderr,
    )
    return stuck


def fail_dead(s, targets, dead: dict[int, str]) -> None:
    alive = [r for r in targets if r not in dead]
    supervision.send_signal(s, signal.SIGINT, alive)  # don't leave survivors waiting on the dead
    for r in dead:
        s._errored.add(r)
    raise DistCellError(
        f"{supervision.dead_text(dead)}. The other ranks were interrupted. {HARD_RESTART}",
        ranks=sorted(dead),
    )


def cell_error(s, result: CellResult, targets: list[int]) -> DistCellError:
    """The error a failed cell raises. A rank that died while the others finished
    (ipyparallel answers for it with an EngineError) is named with its exit code."""
    died = supervision.dead_ranks(s, sorted(result.errors))
    for r, e in result.errors.items():
        if r not in died and e.startswith("EngineError"):
            died[r] = "its engine stopped"
    if not died:
        summary = error_summary(result.errors, targets) + _advice(result)
        return DistCellError(summary, result.report, sorted(result.errors))
    others = {r: e for r, e in result.errors.items() if r not in died}
    also = f"; {error_summary(others, [])}" if others else ""
    return DistCellError(
        f"{supervision.dead_text(died)}{also}. {HARD_RESTART}", result.report, sorted(result.errors)
    )


def set_busy(s, ranks, busy: bool) -> None:
    with s._lock:
        if busy:
            s._busy |= set(ranks)
        else:
            s._busy -= set(ranks)


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


def _advice(result: CellResult) -> str:
    """What to do next, for failures that leave the process groups unusable."""
    if result.timed_out:
        return (
            ". A collective timed out: the failing ranks waited for peers that never joined; "
            "their tracebacks show where. The process groups are likely broken: run "
            "%dist_restart (keeps variables)."
        )
    return ""
