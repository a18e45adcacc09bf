"""What a rank writes reaches a cell, wherever it writes from. Runs inside each engine.

- Straight to fd 1/2 (C stdio, ``os.write``, NCCL_DEBUG, c10d's C++ warnings): ipykernel
  reads those from a pipe on a thread of its own, which may still hold the cell's last
  bytes when the cell ends; they then went to a finished cell and were lost. At the end of
  each cell, C stdio is flushed and a marker byte goes down each pipe; the cell ends once
  the reader has passed it (waiting at most ``SYNC_WAIT_S``).
- From a thread, after its cell ended: kept and shown at the start of the next cell, each
  line marked ``LATE`` (the kernel no longer listens to a finished cell), also when a pull,
  push, bench or rebuild runs on the engine in between.
- From a widget's callback (a Button's ``on_click``, a slider's ``observe``), and threads
  and timers it starts: the frontend's comm message runs it outside any cell, and ipykernel
  sent its text as the reply to that message, which the kernel's ipyparallel client files
  under the message's id and nobody shows. It is shown at once under the widget, in the
  cell that showed it (engine/widget_labels.py), and kept as late text for the rank's file
  (marked ``LATE_SHOWN``: not shown again); late text as the rest where no widget shows it.
- To stdout, then stderr (a print, then a warning): ipykernel buffers each stream on its
  own and sends each when its own timer fires, stdout first at a cell's end, so a warning
  raised before a print arrived after it (and, ranks differing in timing, split a
  --collapse merge). A write to one stream first sends what the other one holds.
"""

from __future__ import annotations

import array
import ctypes
import io
import logging
import os
import platform
import sys
import threading
import time

from ..core import internals
from ..core.output import LATE, LATE_SHOWN, settle
from . import widget_labels

SYNC_WAIT_S = 0.1
MARK = "\x00"  # one byte, so a pipe read cannot split it; NUL never shows in a notebook
LATE_MAX_CHARS = 100_000  # per stream, between two cells
_READ_NR = {"x86_64": b"0", "aarch64": b"63"}.get(platform.machine())  # read(2)'s number
_STREAM_PARTS = ("_fid", "_should_watch", "_setup_stream_redirects", "parent_header", "write")

_state: dict = {}  # once per engine process: what is installed, the Pipes, libc, hooks


class Pipe:
    """One of sys.stdout/sys.stderr (an ipykernel OutStream) and the fd it reads."""

    def __init__(self, stream, cell: dict, order: dict):
        self.stream, self.cell = stream, cell
        self.order = order  # {"last": the Pipe written to last}, shared by both streams
        self.fd = stream._original_stdstream_fd  # 1 or 2, now the pipe's write end
        self.reader = stream.watch_fd_thread.ident
        self.pipe_fd = stream._fid  # the read end
        self.reader_state = _syscall_view(stream.watch_fd_thread.native_id)
        self.write = stream.write  # ipykernel's own
        self.marks = threading.Condition()  # markers sent and seen: a late one from an
        self.sent = self.seen = 0  # earlier cell that timed out cannot end this cell's wait
        self._late_lock = threading.Lock()  # threads add, the cell's thread takes
        self.late: dict[str, list[str]] = {LATE: [], LATE_SHOWN: []}  # by the lines' mark
        self.late_chars = self.dropped = 0
        self.forwarded = 0  # characters handed to ipykernel for the running cell
        stream.write = self.route

    def route(self, text: str):
        """Every write to the stream: markers, late text, and the rest as ipykernel would."""
        me = threading.get_ident()
        if me == self.reader and MARK in text:
            rest = text.replace(MARK, "")
            if rest:
                self.route(rest)
            with self.marks:
                self.seen += len(text) - len(rest)
                self.marks.notify_all()
            return len(text)
        header = self.stream.parent_header
        if _callback(header):
            shown = widget_labels.show_callback_text(self.stream.name, text, header)
            self._keep_late(text, LATE_SHOWN if shown else LATE)
            return len(text)
        if me != self.cell.get("thread") and self._for_ended_cell(me):
            self._keep_late(text)
            return len(text)
        last = self.order.get("last")
        if last is not self:
            self.order["last"] = self
            if last is not None:  # written before this: sent first (cheap when empty,
                last.stream.flush()  # engine/tuning.py)
        self.forwarded += len(text)
        return self.write(text)

    def idle(self) -> bool:
        """The pipe is empty and its reader waits in read() on it: everything written so
        far is in the stream already, and a marker (two thread wake-ups, ~6 % of an empty
        cell on a loaded machine) is not needed. Checked in that order: a reader back in
        read() has handed on what it read before."""
        if self.reader_state is None or _unread(self.pipe_fd) != 0:
            return False
        try:
            fields = os.pread(self.reader_state, 128, 0).split()
        except OSError:
            return False
        return len(fields) > 1 and fields[0] == _READ_NR and int(fields[1], 16) == self.pipe_fd

    def wait_for_marks(self, deadline: float) -> bool:
        with self.marks:
            return self.marks.wait_for(
                lambda: self.seen >= self.sent, max(0.0, deadline - time.monotonic())
            )

    def _for_ended_cell(self, me: int) -> bool:
        """Whether text from a thread other than the cell's would go to a request that is
        not the running cell: a cell that ended, or a pull, push or bench (apply requests,
        whose output no cell shows), or nothing, between requests. The main thread's own
        text during such a request is the request's (the bootstrap's, a pull's)."""
        header = self.stream.parent_header  # the request this thread's text would go to
        running = self.cell.get("msg_id")
        if running is None:
            return me != threading.main_thread().ident
        return header.get("msg_id") != running

    def _keep_late(self, text: str, mark: str = LATE) -> None:
        with self._late_lock:
            room = max(LATE_MAX_CHARS - self.late_chars, 0)
            if len(text) > room:
                self.dropped += len(text) - room
                text = text[:room]
            self.late[mark].append(text)
            self.late_chars += len(text)

    def show_late(self) -> None:
        """Text kept since the last cell, into this one (called on the cell's thread)."""
        with self._late_lock:
            late, dropped = {m: "".join(t) for m, t in self.late.items()}, self.dropped
            self.late = {mark: [] for mark in self.late}
            self.late_chars, self.dropped = 0, 0
        if dropped:
            late[LATE] += f"\n... {dropped} more characters written after the cell ended"
        text = "".join(_marked(mark, text) for mark, text in late.items())
        if text:
            self.forwarded += len(text)
            self.write(text)


def _marked(mark: str, text: str) -> str:
    """Every line of ``text`` (carriage returns applied) after ``mark``."""
    text = settle(text).rstrip("\n")
    return "".join(f"{mark}{line}\n" for line in text.split("\n")) if text else ""


def _callback(header: dict) -> bool:
    """Text written for a comm message (a widget's callback), not for a request."""
    return str(header.get("msg_type", "")).startswith("comm_")


def install(shell) -> list[str]:
    """Hook the shell's cells; returns what is in place (``"fd sync"``, ``"late output"``)."""
    if "installed" in _state:
        return _state["installed"]
    streams = [s for s in (sys.stdout, sys.stderr) if _watching(s)]
    if not streams:
        _state["installed"] = []
        return []
    cell: dict = {}
    order: dict = {}
    pipes = [Pipe(s, cell, order) for s in streams]
    libc = _libc()
    hooks = {
        "pre_execute": lambda: _cell_started(cell, pipes),
        "post_execute": lambda: _cell_ended(cell, pipes, libc),
    }
    for event, hook in hooks.items():
        shell.events.register(event, hook)
    _state.update(installed=["fd sync", "late output"], pipes=pipes, libc=libc, hooks=hooks)
    return _state["installed"]


def sent() -> dict[str, int]:
    """Characters of stdout and stderr the running cell has sent so far (the kernel shows
    them all before a prompt of this rank's, see stdin_relay); empty where not counted."""
    return {pipe.stream.name: pipe.forwarded for pipe in _state.get("pipes", [])}


def installed() -> list[str]:
    """What ``install`` put in place on this engine."""
    return _state.get("installed", [])


def _watching(stream) -> bool:
    """Whether ``stream`` reads its fd through a pipe, starting that where ipykernel left it
    off: it does not when the engine inherited PYTEST_CURRENT_TEST from a kernel started by
    pytest, though no pytest captures this process's output."""
    if not internals.usable(stream, _STREAM_PARTS, "ipykernel", "OutStream fd capture"):
        return False
    if not stream._should_watch and os.name == "posix":
        _start_watching(stream)
    return stream._fid is not None and getattr(stream, "watch_fd_thread", None) is not None


def _start_watching(stream) -> None:
    """ipykernel's own set-up, which reads the fd to redirect from ``sys.<name>`` (the
    original file then, this OutStream now); log handlers on that fd keep writing to the
    engine's log, not into cells (as ipyparallel does for its own at start)."""
    name = stream.name
    saved = getattr(sys, name)
    setattr(sys, name, getattr(sys, f"__{name}__"))
    try:
        stream._should_watch = True
        stream._setup_stream_redirects(name)
    finally:
        setattr(sys, name, saved)
    fd = stream._original_stdstream_fd
    loggers = [logging.getLogger()] + list(logging.Logger.manager.loggerDict.values())
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, logging.StreamHandler) and _fd(handler.stream) == fd:
                copy = os.dup(stream._original_stdstream_copy)
                handler.setStream(io.TextIOWrapper(io.FileIO(copy, "w"), line_buffering=True))


def _fd(f) -> int | None:
    try:
        return f.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _libc():
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def _cell_started(cell: dict, pipes: list[Pipe]) -> None:
    header = pipes[0].stream.parent_header
    cell.update(msg_id=header.get("msg_id"), thread=threading.get_ident())
    for pipe in pipes:
        pipe.forwarded = 0
        pipe.show_late()


def _cell_ended(cell: dict, pipes: list[Pipe], libc) -> None:
    """Let fd output written during the cell reach it; then the cell counts as ended."""
    try:
        sync_fds(pipes, libc)
    except KeyboardInterrupt:  # a Stop meant for the cell, which is over: its reply must go
        pass
    except OSError:  # a pipe gone: what is left shows late or in the engine's log
        pass
    finally:
        cell.clear()


def sync_fds(pipes: list[Pipe], libc) -> bool:
    """Flush C stdio and Python's own fd streams, then wait until each pipe's reader has
    passed a marker written after them. Returns whether every marker came back in time."""
    if libc is not None:
        libc.fflush(None)
    for raw in (sys.__stdout__, sys.__stderr__):
        try:
            raw.flush()
        except (AttributeError, OSError, ValueError):
            pass
    busy = [pipe for pipe in pipes if not pipe.idle()]
    for pipe in busy:
        with pipe.marks:
            pipe.sent += 1
        os.write(pipe.fd, MARK.encode())
    deadline = time.monotonic() + SYNC_WAIT_S
    return all(pipe.wait_for_marks(deadline) for pipe in busy)


def _syscall_view(native_id: int | None) -> int | None:
    """An fd on /proc's view of what a thread waits in (Linux), or None."""
    if _READ_NR is None or native_id is None:
        return None
    try:
        return os.open(f"/proc/self/task/{native_id}/syscall", os.O_RDONLY)
    except OSError:
        return None


def _unread(fd: int) -> int:
    """Bytes waiting in a pipe (-1: cannot tell)."""
    buf = array.array("i", [0])
    try:
        import fcntl
        import termios

        fcntl.ioctl(fd, termios.FIONREAD, buf)
    except (ImportError, OSError):
        return -1
    return buf[0]
