"""One running cell as ipyparallel reports it, and the labeled output it shows as it comes:
each rank's message future resolves on its reply, and its iopub callbacks fire on every
output message. Kept apart from what decides the cell's fate (execution.py)."""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time

from ..core import internals
from ..core.output import StreamLabeler
from ..core.ranks import rank_label
from .printers import Printer


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
    # ... unless the engine is known to be alive: its idle status will come. An engine's
    # final flush of a flood waits up to 10 s for its own IO thread (ipykernel's
    # OutStream.flush_timeout) and then replies anyway, so the last stream message and
    # the idle status can trail the reply by more than the quiet window.
    TRAILING_ALIVE_MAX_S = 120.0

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

    def wait_for_trailing_output(self, alive=None) -> None:
        """iopub trails the replies: wait for each replied rank's output to end (its idle
        status) for as long as messages keep coming, or, with ``alive(rank)``, for as long
        as a rank still owing its idle status is alive (up to TRAILING_ALIVE_MAX_S). A fixed
        wait lost the tail of a flood that the client was still reading on a loaded
        machine."""
        start = time.monotonic()
        while True:
            owing = [r for r in self.targets if self.done(r) and not self.futures[r].output.done()]
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
