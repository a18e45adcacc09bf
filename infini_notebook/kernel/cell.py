"""One running cell as ipyparallel reports it, and the labeled output it shows as it comes:
each rank's message future resolves on its reply, and its iopub callbacks fire on every
output message. Kept apart from what decides the cell's fate (execution.py)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
import weakref

from ..core import internals
from ..core.output import LATE_SHOWN, StreamLabeler, merge_told, remote_traceback
from ..core.ranks import rank_label
from ..core.transcript import Item, Transcript
from .output_files import OutputFiles
from .printers import Printer, show_items


class Cell:
    """One running cell, as ipyparallel reports it: each rank's message future resolves on
    its reply, and its iopub callbacks (the hook ``AsyncResult.stream_output`` uses) fire
    on every output message, on the client's IO thread. The callbacks queue each rank's
    messages in order (stream text, displays, clear_output, update_display_data), write
    its text to its file (OutputFiles), and empty ipyparallel's own copy, which would grow
    without end and rescan it on every ``\\r``; the cell's thread shows what was queued:
    rank labels, progress lines updated in place, the line cap (``StreamLabeler``), each
    rank's part kept in a ``Transcript``. When the cell ends (``render_final``), or a rank
    cleared or updated its output, the cell's output is shown again from the transcript,
    in rank order."""

    LIVE_EVERY_S = 0.1  # a display updated in place at most this often
    REPLAY_EVERY_S = 0.25  # a rank's clear_output or update_display shown at most this often
    # After the replies, output is waited for until no message came for this long. Each
    # rank's idle status ends it at once; the wait runs out only for an engine that went
    # silent after its reply. 2 s lost a rank's last line on a loaded machine.
    TRAILING_QUIET_S = 10.0
    # ... unless the engine is known to be alive: its idle status will come. An engine's
    # final flush of a flood waits up to 10 s for its own IO thread (ipykernel's
    # OutStream.flush_timeout) and then replies anyway, so the last stream message and
    # the idle status can trail the reply by more than the quiet window.
    TRAILING_ALIVE_MAX_S = 120.0

    def __init__(
        self,
        ar,
        targets: list[int],
        labeler: StreamLabeler,
        printer: Printer,
        files: OutputFiles | None = None,
    ):
        internals.require(ar, ("_children",), "ipyparallel", "AsyncResult: one future per rank")
        for f in ar._children:
            internals.require(f, ("iopub_callbacks", "output"), "ipyparallel", "MessageFuture")
        self.ar, self.targets, self.labeler, self.printer = ar, targets, labeler, printer
        self.files = files or OutputFiles(None, targets, "")
        labeler.full_text_at.update(self.files.paths())
        self.futures = dict(zip(targets, ar._children))
        self.transcript = Transcript(targets)
        self.shown: list[Item] = []  # what the cell's output shows now, in order
        self.told: dict[int, str] = {}  # rank -> its traceback, shown as it came
        self.told_for: set[int] = set()  # failed ranks whose traceback a note shows
        self.changed = threading.Event()
        self.dirty = set(targets)  # ranks with output not looked at yet
        self._events: dict[int, list[tuple]] = {r: [] for r in targets}  # arrived, not shown
        self._snapshot: dict[int, dict | None] = {}
        self._live_at = 0.0
        self._live_text = ""
        self._replay_wanted = False
        self._replayed_at = 0.0
        self._reset_at_next: set[int] = set()  # cleared with wait: the cap resets at output
        self._dirty_lock = threading.Lock()
        self.heard_at = time.monotonic()  # when the last output message arrived
        self.received = {(r, name): 0 for r in targets for name in ("stdout", "stderr")}
        self.texted: set[int] = set()  # ranks that wrote text
        self._callbacks = {}
        # Ranks replied, and ranks whose output ended (idle), kept by the futures' own
        # callbacks: asking 1,024 futures (each its lock) at every wake cost the kernel
        # more than the messages did (docs/scale.md)
        self.finished: set[int] = set()
        self.output_ended: set[int] = set()
        me = weakref.ref(self)  # the futures' callbacks do not keep the cell (_weakly)
        for r, f in self.futures.items():
            self._callbacks[r] = _weakly(me, Cell._on_message, r)
            with self._dirty_lock:  # a message arriving now waits for the snapshot
                f.iopub_callbacks.append(self._callbacks[r])
                self._take_snapshot(r)
            f.add_done_callback(_weakly(me, Cell._wake, r))
            f.output.add_done_callback(_weakly(me, Cell._output_ended, r))
        self.changed.set()  # output that arrived before we listened is read at once

    @classmethod
    def listener(cls, labeler: StreamLabeler, printer: Printer, files: OutputFiles | None):
        """``listen(ar, targets)``: the Cell of a request, once it is made."""
        return lambda ar, targets: cls(ar, targets, labeler, printer, files)

    def _take_snapshot(self, rank: int) -> None:
        """What the rank wrote before we listened, from ipyparallel's copy."""
        md = self.metadata(rank)
        snap = {name: md.get(name) for name in ("stdout", "stderr")}
        snap["outputs"] = list(md.get("outputs") or [])
        self._snapshot[rank] = snap
        for name in ("stdout", "stderr"):
            if snap[name]:
                self._text_came(rank, name, snap[name])
        for output in snap["outputs"]:
            self._events[rank].append(("rich", output))

    def _on_message(self, rank: int, msg: dict) -> None:
        self.heard_at = time.monotonic()
        kind = msg.get("header", {}).get("msg_type")
        content = msg.get("content", {})
        with self._dirty_lock:
            snapshot = self._snapshot.pop(rank, None)
            md = self.metadata(rank)
            # ipyparallel updates its copy before the callbacks run, on one thread: only
            # the first message after we listened can be in the snapshot already, and then
            # its copy is still the very object the snapshot took.
            if kind == "stream" and content.get("name") in ("stdout", "stderr"):
                name = content["name"]
                if not (snapshot is not None and md.get(name) is snapshot[name]):
                    self._text_came(rank, name, content.get("text", ""))
                md[name] = ""  # ours is the copy: theirs grows and is rescanned on each \r
            elif kind == "display_data":
                if not (snapshot is not None and any(o is content for o in snapshot["outputs"])):
                    self._events[rank].append(("rich", content))
                md["outputs"] = []
            elif kind == "clear_output":
                self._events[rank].append(("clear", bool(content.get("wait"))))
            elif kind == "update_display_data":
                self._events[rank].append(("update", content))
            self.dirty.add(rank)
        self.changed.set()

    def _text_came(self, rank: int, name: str, text: str) -> None:
        self.files.write(rank, name, text)
        self.received[(rank, name)] += len(text)
        self.texted.add(rank)
        self._events[rank].append(("text", name, text))

    def msg_id(self, rank: int) -> str | None:
        """The id of the execute request this cell sent ``rank``."""
        return getattr(self.futures[rank], "msg_id", None)

    def wait_for_text(self, rank: int, sent: dict[str, int], timeout: float) -> bool:
        """Until ``rank``'s text has come as far as it had sent (``{"stdout": chars}``,
        counted since the cell started, see engine/output_streams.sent), or ``timeout``."""
        deadline = time.monotonic() + timeout
        while any(self.received.get((rank, name), 0) < n for name, n in sent.items()):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def input_given(self, rank: int, line: str) -> None:
        """A prompt of ``rank`` and what the user answered, kept in the rank's output where
        it was asked (the input box's own echo goes when the cell's output is replayed)."""
        with self._dirty_lock:
            self._events[rank].append(("input", line))
            self.dirty.add(rank)
        self.changed.set()

    def wait_for_trailing_output(self, alive=None) -> None:
        """iopub trails the replies: wait for each replied rank's output to end (its idle
        status) for as long as messages keep coming, or, with ``alive(rank)``, for as long
        as a rank still owing its idle status is alive (up to TRAILING_ALIVE_MAX_S). A fixed
        wait lost the tail of a flood that the client was still reading on a loaded
        machine."""
        start = time.monotonic()
        while True:
            owing = sorted(self.finished - self.output_ended)
            if not owing:
                return
            heard = max(start, self.heard_at)
            now = time.monotonic()
            quiet_left = heard + self.TRAILING_QUIET_S - now
            if quiet_left <= 0:
                if alive is None or now - start > self.TRAILING_ALIVE_MAX_S:
                    return
                if not any(alive(r) for r in owing):
                    return
                quiet_left = 1.0  # look again in a second
            outputs = [self.futures[r].output for r in owing]
            concurrent.futures.wait(outputs, timeout=min(quiet_left, 0.2))

    def _wake(self, rank: int, _future=None) -> None:
        with self._dirty_lock:
            self.dirty.add(rank)
            self.finished.add(rank)
        self.changed.set()

    def _output_ended(self, rank: int, _future=None) -> None:
        self.output_ended.add(rank)

    def detach(self, final: bool = False) -> None:
        """Stop listening to the ranks whose output is complete (all of them when
        ``final``): output still trailing a reply is shown by ``show(final=True)``."""
        for r, f in self.futures.items():
            if (final or f.output.done()) and self._callbacks[r] in f.iopub_callbacks:
                f.iopub_callbacks.remove(self._callbacks[r])

    def done(self, rank: int) -> bool:
        """The rank replied (its future's result can be read)."""
        return rank in self.finished

    def finished_among(self, ranks: set[int]) -> set[int]:
        return ranks & self.finished

    def metadata(self, rank: int) -> dict:
        return self.futures[rank].output.metadata

    def show(self, final: bool) -> None:
        """Show what the ranks wrote since the last call, labeled; refresh live lines, and
        the whole output when a rank cleared or updated its part."""
        if final:
            self.detach(final=True)  # before taking the text: nothing comes in after
        with self._dirty_lock:  # a message arriving after this is shown next time
            # at the end, also each rank with text: its last line may be unfinished
            ranks = sorted(self.dirty | self.texted) if final else sorted(self.dirty)
            self.dirty = set()
            events = {r: self._events[r] for r in ranks}
            for r in ranks:
                self._events[r] = []
        fresh = {r: self._apply(r, events[r], final) for r in ranks}
        self._replay_wanted |= self.transcript.take_changed()
        if self._replay_wanted and self._can_replay():
            # the new items are in the transcript: the replay (or render_final) shows them
            if not final and time.monotonic() - self._replayed_at >= self.REPLAY_EVERY_S:
                self._replay()
        else:
            self._replay_wanted = False  # a printer that cannot: output is only added to
            self._emit(self._live_items(fresh))
        self._show_live(final)

    def _apply(self, rank: int, events: list[tuple], final: bool) -> list[Item]:
        """Put one rank's queued messages into its transcript; the items new to show."""
        items: list[Item] = []
        for event in events:
            if event[0] in ("text", "rich") and rank in self._reset_at_next:
                self._reset_at_next.discard(rank)  # clear_output(wait=True) acts now
                self.labeler.reset(rank)
            if event[0] == "text":
                _, stream, text = event
                items += self._lines(rank, stream, self.labeler.complete(rank, stream, text))
            elif event[0] == "rich":
                self.transcript.add_rich(rank, event[1])
                items.append(Item((rank,), "rich", event[1]))
            elif event[0] == "clear":
                self.transcript.clear(rank, wait=event[1])
                if event[1]:
                    self._reset_at_next.add(rank)
                else:
                    self.labeler.reset(rank)
            elif event[0] == "update":
                self.transcript.update_display(rank, event[1])
            elif event[0] == "input":  # shown by the front end already: kept, not shown
                self.transcript.add_text(rank, "stdout", event[1] + "\n")
        if final:
            for stream in ("stdout", "stderr"):
                items += self._lines(rank, stream, self.labeler.complete(rank, stream, "", True))
        return items

    def _lines(self, rank: int, stream: str, text: str) -> list[Item]:
        if LATE_SHOWN in text:  # shown under its widget already: in the rank's file only
            text = "".join(t for t in text.splitlines(True) if not t.startswith(LATE_SHOWN))
        if not text:
            return []
        self.transcript.add_text(rank, stream, text)
        return [Item((rank,), stream, line) for line in text.splitlines()]

    def _live_items(self, fresh: dict[int, list[Item]]) -> list[Item]:
        """This call's new items in rank order; with --collapse, ranks whose new lines are
        the very same shown once (the cell's end merges the rest, see render_final)."""
        if not self.labeler.collapse:
            return [item for r in sorted(fresh) for item in fresh[r]]
        groups: dict[tuple, list[int]] = {}
        for r in sorted(fresh):
            if fresh[r]:
                key = tuple((i.kind, repr(i.payload)) for i in fresh[r])
                groups.setdefault(key, []).append(r)
        return [
            Item(tuple(ranks), item.kind, item.payload)
            for ranks in groups.values()
            for item in fresh[ranks[0]]
        ]

    def note(self, rank: int, text: str) -> None:
        """The kernel's own words about one rank (a traceback shown as it came, a stuck
        rank's stack), labeled already: shown now, and kept in its place in the output."""
        self.transcript.add_note(rank, text)
        self._emit([Item((rank,), "note", text)])

    def failure_note(self, rank: int, traceback: str) -> None:
        """A rank's traceback shown as it came, while others still run (the root cause)."""
        self.told[rank] = traceback
        self.told_for.add(rank)
        self.note(rank, _failure_text((rank,), traceback))

    def _merge_told(self) -> None:
        """Notes of identical tracebacks merged into the first, labeled with every rank that
        raised it, the ranks raising it later included: the traceback is shown once."""
        failed = {}
        for r in self.targets:
            reply = self.futures[r].result() if self.done(r) else None
            if isinstance(reply, BaseException) and r not in self.told:
                failed[r] = remote_traceback(reply)
        for keeper, ranks in merge_told(self.told, failed).items():
            self.told_for.update(ranks)
            if ranks == (keeper,) or not self._can_replay():  # shown already: left as is
                continue
            old = _failure_text((keeper,), self.told[keeper])
            self.transcript.replace_note(keeper, old, _failure_text(ranks, self.told[keeper]))
            for r in ranks:
                if r in self.told and r != keeper:
                    self.transcript.replace_note(r, _failure_text((r,), self.told[r]), None)

    def _emit(self, items: list[Item]) -> None:
        if items:
            show_items(self.printer, items)
            self.shown += items

    def _can_replay(self) -> bool:
        return getattr(self.printer, "can_replay", lambda: False)()

    def _replay(self, items: list[Item] | None = None) -> None:
        """Show the whole output again from the transcript, in place of what is shown."""
        if items is None:
            items = self.transcript.render(self.labeler.collapse)
        self._replay_wanted, self._replayed_at = False, time.monotonic()
        if self._can_replay():
            self.printer.replay(items)
            self.shown = items
            self._live_text = ""  # the live display went with the rest

    def render_final(self) -> None:
        """Once every rank's output is in: the cell's output in rank order, identical
        warnings (and with --collapse, identical lines) merged; left as is when that is
        what shows already. Figures of several ranks are shown together, in a grid; notes
        of identical tracebacks as one (``_merge_told``)."""
        if self.told:
            self._merge_told()
        items = self.transcript.render(self.labeler.collapse, figures_together=True)
        if items != self.shown:
            self._replay(items)
        self.files.close()

    def tail(self, rank: int, stream: str) -> str:
        return self.files.tail(rank, stream)

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


def _failure_text(ranks, traceback: str) -> str:
    return f"{rank_label(list(ranks))}\n{traceback.rstrip()}\n"


def _weakly(cell: weakref.ref, method, rank: int):
    """``method(cell, rank, ...)`` while the cell lives. A strong callback would make each
    future and its cell a cycle, which only the cyclic collector frees: at 1,024 ranks that
    was ~40 objects per rank per cell left for it, a third of the kernel's CPU per cell
    (docs/scale.md). Whoever needs the cell holds it; the futures need not."""

    def call(*args):
        c = cell()
        if c is not None:
            method(c, rank, *args)

    return call
