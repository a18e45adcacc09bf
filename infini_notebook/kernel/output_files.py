"""Every line a rank writes, kept without holding it in the kernel's memory: appended to a
file per rank and stream in the session folder (``output/rank3.stdout``: each cell starts
with a header line naming it), kept until the session stops; the kernel holds only the last
``TAIL_CHARS`` of each (``session.last.stdout[r]``). The notebook shows at most the line cap
(StreamLabeler), and its cap message names the file."""

from __future__ import annotations

import ctypes
import os
import threading
from collections import deque

from ..core.output import settle

TAIL_CHARS = 1 << 20  # per rank and stream, per cell
# glibc serves a freed mmap-sized block's size from its heap from then on (the dynamic mmap
# threshold, up to 32 MiB), and heap memory rarely goes back to the OS: the multi-MB stream
# messages of a 200 MB flood left the kernel 46-92 MiB bigger. A fixed threshold turns the
# dynamic one off (mallopt(3), M_MMAP_THRESHOLD): 17 MiB after the same flood.
MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # malloc.h
_malloc_tuned: list[bool] = []


class OutputFiles:
    """One cell's output: its files (if the session has a folder) and bounded tails."""

    def __init__(self, dir: str | None, ranks: list[int], cell_name: str):
        self.dir = dir
        self.cell_name = cell_name or "a cell"
        self._files: dict[tuple[int, str], object] = {}
        # The IO thread opens files as text arrives, while a Stop may close them from the
        # cell's thread: one lock, and nothing opens once closed.
        self._lock = threading.Lock()
        self._closed = False
        self._tails = {(r, s): _Tail() for r in ranks for s in ("stdout", "stderr")}
        if self.dir:
            os.makedirs(self.dir, exist_ok=True)
        if not _malloc_tuned:
            _malloc_tuned.append(_fix_mmap_threshold())

    def path(self, rank: int, stream: str) -> str | None:
        return os.path.join(self.dir, f"rank{rank}.{stream}") if self.dir else None

    def paths(self) -> dict[tuple[int, str], str]:
        return {key: self.path(*key) for key in self._tails} if self.dir else {}

    def write(self, rank: int, stream: str, text: str) -> None:
        """Called on the client's IO thread, once per stream message."""
        if not text:
            return
        self._tails[(rank, stream)].add(text)
        with self._lock:
            f = self._file(rank, stream)
            if f is not None:
                try:
                    f.write(text)
                except (OSError, ValueError):  # a full disk
                    self._files[(rank, stream)] = None

    def _file(self, rank: int, stream: str):
        key = (rank, stream)
        if key not in self._files and self.dir and not self._closed:
            try:
                f = open(self.path(rank, stream), "a", encoding="utf-8", errors="replace")
                f.write(f"\n===== {self.cell_name} =====\n")
            except (OSError, TypeError):  # no folder, or it went with a stopped session
                f = None
            self._files[key] = f
        return self._files.get(key)

    def tail(self, rank: int, stream: str) -> str:
        """The last TAIL_CHARS the rank wrote, carriage returns applied (as ipyparallel's
        own copy had them), from a line's start where it was cut, and then under a first
        line that says so and where the whole is (a 10 MB line was left out without a word)."""
        tail = self._tails[(rank, stream)]
        text = settle(tail.text())
        if not tail.cut:
            return text
        where = self.path(rank, stream)
        return (
            f"[earlier output cut: all of it is in {where}]\n{text}"
            if where
            else (f"[earlier output cut]\n{text}")
        )

    def close(self) -> None:
        """Flush and close; text still trailing (a rank that ignored a Stop) is not kept."""
        with self._lock:
            self._closed = True
            for key, f in self._files.items():
                if f is not None:
                    try:
                        f.close()
                    except OSError:
                        pass
                self._files[key] = None


def _fix_mmap_threshold() -> bool:
    """Once per kernel process, on glibc; elsewhere nothing (whether it was done)."""
    try:
        return bool(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return False


class _Tail:
    """The last TAIL_CHARS of a stream, in the pieces it came in."""

    def __init__(self):
        self.pieces: deque[str] = deque()
        self.chars = 0
        self.cut = False

    def add(self, text: str) -> None:
        if len(text) > TAIL_CHARS:  # one message of a flood can be megabytes
            text, self.cut = text[-TAIL_CHARS:], True
        self.pieces.append(text)
        self.chars += len(text)
        while self.chars - len(self.pieces[0]) >= TAIL_CHARS:
            self.chars -= len(self.pieces.popleft())
            self.cut = True

    def text(self) -> str:
        text = "".join(self.pieces)
        if len(text) > TAIL_CHARS:
            text, self.cut = text[-TAIL_CHARS:], True
        if self.cut and "\n" in text:
            text = text[text.index("\n") + 1 :]
        return text
