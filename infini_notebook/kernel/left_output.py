"""The cells an earlier kernel started and did not see end (a kept session, attached by a new
kernel; see attach.py): those still running at the attach, and those that ended while no
kernel was attached. Nothing they printed is lost: the controller keeps every stream message
under its request's id (ipyparallel 9, ``Hub.save_iopub_message`` appends each ``stream``
text to the record's stdout/stderr), and the reply's status, whether or not a kernel
listens. Each rank's output file gets one section for such a cell, with all of its output
from its start (what it printed before the earlier kernel went too), added to as more comes,
until the cell has ended on every rank. Then the cell becomes ``session.last``, its failed
ranks show as failed, and a cell that ran through on every rank is code in %dist_export.

Which cell a rank ended last, each rank says at the attach (engine/cell_end.last_cell); a
kernel that saw a cell end had the controller drop its record (launch/client.forget), so a
record still there is one no kernel read."""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from dataclasses import dataclass

from ..core.output import error_report, error_summary, settle
from ..core.ranks import rank_label
from ..core.state import CellResult
from .output_files import TAIL_CHARS

STREAMS = ("stdout", "stderr")
KEYS = ["msg_id", *STREAMS, "completed", "submitted", "result_content", "execute_result", "content"]
TAIL_LINES = 5  # of each rank's output, shown under the attach line
SHOWN_MAX = 40  # lines of it in all


class LeftOutput:
    """The cells of an earlier kernel this kernel follows, by rank (``{"msg_id", "number",
    "since", ...}`` as the ranks said at attach): ``running`` still ran then, the others had
    ended unseen. How much of each record its section holds. The only writer of those
    sections."""

    def __init__(
        self,
        dir: str | None,
        running: dict[int, dict],
        ended: dict[int, dict] | None = None,
        every_rank: bool = True,
    ):
        """``every_rank``: every rank answered at the attach. A rank that died while
        detached may have run a cell too: the cell is then not known to have worked."""
        self.dir, self.every_rank = dir, every_rank
        self.lock = threading.Lock()  # the status poller follows too: one at a time
        self.ended = False
        self.running = {r: c for r, c in running.items() if c.get("msg_id")}
        self.cells = {r: c for r, c in (ended or {}).items() if c.get("msg_id")}
        self.cells.update(self.running)
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
    return (
        f"\n===== {cell_name(cell)}, started by an earlier kernel: all its output from its "
        "start, as the controller kept it =====\n"
    )


def cell_name(cell: dict) -> str:
    return f"In[{cell['number']}]" if cell.get("number") else "a cell"


def unseen(s, infos: dict[int, dict]) -> dict[int, dict]:
    """The ranks' last cells (``info["last"]``, ranks not in a cell now) whose end no kernel
    saw: the controller still holds their records, complete."""
    last = {r: i["last"] for r, i in infos.items() if not i.get("cell") and i.get("last")}
    ids = [c["msg_id"] for c in last.values() if c.get("msg_id")]
    if not ids:
        return {}
    try:
        records = _records(s, ids, ["msg_id", "completed", "submitted"])
    except Exception:  # the controller is gone: nothing to read from it
        return {}
    done = {m for m, r in records.items() if r.get("completed")}
    return {r: c for r, c in last.items() if c.get("msg_id") in done}


def _records(s, msg_ids: list[str], keys: list[str]) -> dict[str, dict]:
    """The controller's records of ``msg_ids``, by id. A record gone was purged once
    complete (launch/client.py); one without ``submitted`` was made again by a message that
    came after the purge (Hub.save_iopub_message makes a record for an unknown id) and holds
    only that: both are left out."""
    query = {"msg_id": {"$in": msg_ids}}
    reply = s.engines.client.ask_controller("db_request", {"query": query, "keys": keys})
    return {r["msg_id"]: r for r in reply.get("records", []) if r.get("submitted")}


@dataclass
class Ended:
    """A cell of an earlier kernel that ended on every rank it ran on, unseen."""

    name: str  # In[N]
    result: CellResult
    at: float  # when it ended on its last rank (time.time())


def follow(s) -> list[Ended]:
    """Bring the sections of ``s.left_output`` up to date from the controller's records;
    once the cells ended on every rank, the last write, and nothing more to follow: the
    cells that ended (see ``finish``)."""
    left = s.left_output
    if left is None:
        return []
    with left.lock:
        if left.ended:
            return []
        try:
            records = _records(s, left.msg_ids(), KEYS)
        except Exception:  # the controller is gone: the files keep what they have
            left.ended, s.left_output = True, None
            return []
        left.write(records)
        ids = left.msg_ids()
        if not all(records.get(m, {"completed": True}).get("completed") for m in ids):
            return []
        left.ended, s.left_output = True, None
        return finish(s, left, records)


def finish(s, left: LeftOutput, records: dict[str, dict]) -> list[Ended]:
    """The cells ``left`` followed ended: each becomes a CellResult (the latest one
    ``session.last``, unless this kernel ran a cell since), its failed ranks show as failed,
    one that ran through on every rank goes into the history %dist_export reads, and the
    controller drops their records."""
    by_cell: dict[tuple, dict[int, dict]] = {}
    for r, cell in sorted(left.cells.items()):
        by_cell.setdefault((cell.get("number") or 0, cell_name(cell)), {})[r] = cell
    ended = []
    for (_, name), cells in sorted(by_cell.items()):
        result, at, code = _result(s, cells, records)
        ended.append(Ended(name, result, at))
        s.book.cell_ended(result.ranks, failed=result.errors)
        if not result.errors and code is not None and left.every_rank:
            _recorded(s, result.ranks, code)
    if ended and s.last is None:
        s.last = ended[-1].result
    try:  # the next kernel must not find them unseen again
        s.engines.client.ask_controller("purge_request", {"msg_ids": left.msg_ids()})
    except Exception:
        pass
    return ended


def _result(s, cells: dict[int, dict], records: dict[str, dict]) -> tuple:
    """The CellResult of one cell (its ranks' records), when it ended, and its code (None
    where unknown)."""
    result = CellResult(ranks=sorted(cells))
    tracebacks, code, since, at = {}, None, [], []
    missing = [r for r, c in cells.items() if c["msg_id"] not in records]
    outcome = _ask_outcome(s, {r: cells[r] for r in missing}) if missing else {}
    for r, cell in sorted(cells.items()):
        record = records.get(cell["msg_id"]) or {}
        for stream in STREAMS:
            getattr(result, stream)[r] = tail(record.get(stream) or "")
        content = record.get("result_content") or {}
        code = code if code is not None else (record.get("content") or {}).get("code")
        since.append(cell.get("since") or time.time())
        at.append(_when(record.get("completed")) or outcome.get(r, {}).get("ended") or time.time())
        ok = content.get("status") == "ok" if content else outcome.get(r, {}).get("ok")
        if ok:
            data = (record.get("execute_result") or {}).get("data")
            if data:
                result.results[r] = data
            continue
        if content.get("ename"):
            first = (str(content.get("evalue") or "").strip().splitlines() or [""])[0]
            result.errors[r] = f"{content['ename']}: {first}" if first else content["ename"]
            tracebacks[r] = "\n".join(content.get("traceback") or []) or result.errors[r]
        elif content:
            result.errors[r] = f"its cell was {content.get('status')}"
        else:
            result.errors[r] = "its outcome is unknown (its record went before it was read)"
    result.report = error_report(tracebacks)
    result.elapsed = max(max(at) - min(since), 0.0)
    return result, max(at), code


def _ask_outcome(s, cells: dict[int, dict]) -> dict[int, dict]:
    """How the ranks' cells ended, from the ranks themselves, where the controller's
    records went (purged by a command of this kernel before they were read)."""
    try:
        answers = s.rendezvous.ask(list(cells), "info", 2.0)
    except Exception:
        return {}
    out = {}
    for r, text in answers.items():
        last = json.loads(text).get("last") or {}
        if last.get("msg_id") == cells[r]["msg_id"]:
            out[r] = last
    return out


def _when(value) -> float | None:
    """A record's date (a datetime, or ISO 8601 text as the reply carries it), as time.time()."""
    if isinstance(value, str):
        try:
            value = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.timezone.utc)
        return value.timestamp()
    return None


def tail(text: str) -> str:
    """The last TAIL_CHARS of ``text``, carriage returns applied, from a line's start where
    it was cut (as OutputFiles keeps a cell's)."""
    if len(text) > TAIL_CHARS:
        text = text[-TAIL_CHARS:]
        if "\n" in text:
            text = text[text.index("\n") + 1 :]
    return settle(text)


def _recorded(s, ranks: list[int], code: str) -> None:
    """Make the history %dist_export reads hold the cell as one that worked. The kernel that
    ran it recorded it as failed if Jupyter's restart interrupted it first (the last %%dist
    cell of that body, with no cell that worked after it), as succeeded if it was a
    --background cell (recorded as it started), and not at all if it was killed: then it is
    added, as the %%dist cell that ran this code on these ranks."""
    from ..core.export import split_cell

    for cell in reversed(s.keeper.history()):
        name, line, body = split_cell(cell.source)
        if name != "dist":
            continue
        if body.strip() == code.strip():
            if cell.ok is False:
                s.keeper.mark_ok(cell.number)
                return
            if "--background" in line.split():
                return
            break  # an earlier run of the same code: this one is another
        if cell.ok:
            break
    flags = "" if ranks == list(range(s.world_size)) else f" --ranks {','.join(map(str, ranks))}"
    s.keeper.record_cell(f"%%dist{flags}\n{code}", True)


def ended_text(s, ended: list[Ended]) -> tuple[list[str], list[str]]:
    """For the attach line: what each cell that ended unseen did ("In[5] finished ok on
    ranks 0-1 at 14:02:31 ..."), and the last lines of its output to show under it."""
    parts, shown = [], []
    out = os.path.join(s.folder.path, "output")
    for cell in ended:
        result = cell.result
        when = time.strftime("%H:%M:%S", time.localtime(cell.at))
        if result.errors:
            what = (
                f"{cell.name} failed at {when} while no kernel was attached, "
                f"{error_summary(result.errors, result.ranks)}"
            )
        else:
            ranks = rank_label(result.ranks)[1:-1]
            what = f"{cell.name} finished ok on {ranks} at {when} while no kernel was attached"
        lines, cut = tail_lines(result)
        notes = ["session.last"]
        if lines:
            whole = f", all of it in {os.path.join(out, 'rank*.stdout')}" if cut else ""
            notes.append(f"its output's last lines below{whole}")
        parts.append(f"{what} ({'; '.join(notes)})")
        shown += lines
    return parts, shown[-SHOWN_MAX:]


def tail_lines(result: CellResult) -> tuple[list[str], bool]:
    """The last TAIL_LINES lines of each rank's stdout, then stderr, labeled (ranks whose
    lines are the same, once); and whether that is not all of it."""
    lines, cut = [], False
    for stream in STREAMS:
        tails = {}
        for r in result.ranks:
            text = getattr(result, stream).get(r, "").rstrip("\n")
            if text:
                rows = text.splitlines()
                cut |= len(rows) > TAIL_LINES
                tails[r] = "\n".join(rows[-TAIL_LINES:])
        groups: dict[str, list[int]] = {}
        for r, text in tails.items():
            groups.setdefault(text, []).append(r)
        for text, ranks in sorted(groups.items(), key=lambda g: g[1][0]):
            lines += [f"{rank_label(ranks)} {row}" for row in text.splitlines()]
    return lines, cut or len(lines) > SHOWN_MAX


def still_running(s, ranks) -> tuple[str | None, list[int]]:
    """The advice for those of ``ranks`` that run a cell a kernel before this one started
    ("In[5] from the earlier kernel still runs on ranks 0-1; %dist_interrupt stops it"; None
    if none does), and those ranks. Such a cell is Python that an interrupt stops (a loop, an
    ``input()``) far more often than native code: no advice to restart the engines, which
    loses every variable."""
    left = s.left_output
    by_name: dict[str, list[int]] = {}
    for r in sorted(ranks):
        if left is not None and r in left.running:
            by_name.setdefault(cell_name(left.running[r]), []).append(r)
    if not by_name:
        return None, []
    runs = "; ".join(
        f"{name} from the earlier kernel still runs on {rank_label(rs)[1:-1]}"
        for name, rs in by_name.items()
    )
    return f"{runs}; %dist_interrupt stops it", [r for rs in by_name.values() for r in rs]
