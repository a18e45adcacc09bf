"""The output of cells an earlier kernel started and that still ran when it ended (a kept
session, attached by a new kernel; see attach.py). Nothing they printed is lost: the
controller keeps every stream message under its request's id (ipyparallel 9,
``Hub.save_iopub_message`` appends each ``stream`` text to the record's stdout/stderr),
whether or not a kernel listens. Each rank's output file gets one section for such a
cell, with all of its output from its start, added to as more comes, until the cell has
ended on every rank."""

from __future__ import annotations

import os

STREAMS = ("stdout", "stderr")


class LeftOutput:
    """The cells left running, by rank (``{"msg_id", "number", ...}`` as the ranks said at
    attach), and how much of each record its section holds. The only writer of those
    sections."""

    def __init__(self, dir: str | None, running: dict[int, dict]):
        self.dir = dir
        self.cells = {r: c for r, c in running.items() if c.get("msg_id")}
        self._written: dict[tuple[int, str], int] = {}  # characters of each record written

    def msg_ids(self) -> list[str]:
        return [c["msg_id"] for c in self.cells.values()]

    def write(self, records: dict[str, dict]) -> None:
        """Each rank's section from its cell's record (``stdout``/``stderr``: all so far)."""
        if not self.dir:
            return
        os.makedirs(self.dir, exist_ok=True)
        for rank, cell in self.cells.items():
            record = records.get(cell["msg_id"]) or {}
            for stream in STREAMS:
                if record.get(stream):
                    self._write(rank, stream, header(cell), record[stream])

    def _write(self, rank: int, stream: str, head: str, text: str) -> None:
        """Append what is new since the last write (a record only grows): rewriting the
        section would cost its whole size at every check, and could cut off a cell that
        ran on the rank after it."""
        key = (rank, stream)
        done = self._written.get(key)
        if done is not None and len(text) <= done:
            return
        with open(os.path.join(self.dir, f"rank{rank}.{stream}"), "ab") as f:
            f.write(((head if done is None else "") + text[done or 0 :]).encode("utf-8", "replace"))
        self._written[key] = len(text)


def header(cell: dict) -> str:
    name = f"In[{cell['number']}]" if cell.get("number") else "a cell"
    return (
        f"\n===== {name}, started by an earlier kernel: all its output from its start, "
        "as the controller kept it =====\n"
    )


def follow(s) -> None:
    """Bring the sections of ``s.left_output`` up to date from the controller's records;
    once the cells ended on every rank, the last write, and nothing more to follow."""
    left = s.left_output
    if left is None:
        return
    try:
        query = {"msg_id": {"$in": left.msg_ids()}}
        keys = ["msg_id", *STREAMS, "completed", "submitted"]
        reply = s.engines.client.ask_controller("db_request", {"query": query, "keys": keys})
    except Exception:  # the controller is gone: the files keep what they have
        s.left_output = None
        return
    # A record gone was purged once complete (launch/client.py); one without ``submitted``
    # was made again by a message that came after the purge (Hub.save_iopub_message makes
    # a record for an unknown id) and holds only that: both leave the section as it is.
    records = {r["msg_id"]: r for r in reply.get("records", []) if r.get("submitted")}
    left.write(records)
    if all(records.get(m, {"completed": True}).get("completed") for m in left.msg_ids()):
        s.left_output = None
