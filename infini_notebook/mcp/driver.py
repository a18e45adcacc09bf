"""The MCP server's work on a session, without the protocol: each tool is one method here over
the public session API (``cluster.start``/``attach``/``current``, ``Session`` methods,
``launch/kept_sessions``), returning the models of ``results.py``. Methods are synchronous
and block; the server calls them on worker threads (server.py).

One session per server process, as per kernel (``cluster._current``). A cell runs as the
notebook's ``%%dist --background`` does (``Session.run_background``), so a cell still running
at the tool's timeout keeps running: its ``CellRun`` has a handle that ``wait`` and
``interrupt`` take, and ``stacks`` and ``status`` work beside it. Output never reaches this
process's stdout: every printer here collects."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from .. import cluster
from ..core import export, waits
from ..core.errors import DistCellError, DistUsageError
from ..core.output import main_thread_stack, one_line, prefix_lines
from ..core.ranks import parse_ranks, rank_label
from ..core.state import CellResult
from ..engine import describe
from ..kernel import supervision
from ..launch import kept_sessions
from . import results as R

# ``progress(done, total, message)``: how a long call reports how far it got
Progress = Callable[[float, "float | None", str], None]

CAP_CHARS = 20_000  # per rank and stream in a result (every line is in output/rankN.*)
LINE_CHARS = 2_000  # a one-line field (an error, a root cause, a result's repr: its start)
KEPT_CELLS = 32  # handles of finished cells kept for wait
NO_SESSION = "No session is running. Start one with the start tool, or list kept sessions with "
NO_SESSION += "sessions and attach one."
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _quiet(done: float, total: float | None = None, message: str = "") -> None:
    """A Progress that reports nothing."""


class Collector:
    """A Printer (kernel/printers.py) that keeps a cell's labeled output, the last
    ``cap`` characters of it, and the latest line saying where its ranks hang."""

    def __init__(self, cap: int = CAP_CHARS):
        self.cap, self._text, self.waiting = cap, "", ""
        self.cut = 0  # characters left out so far
        self._lock = threading.Lock()

    def out(self, text: str) -> None:
        with self._lock:
            text = self._text + text
            if len(text) > self.cap:
                self.cut += len(text) - self.cap
                text = text[-self.cap :]
            self._text = text

    err = out

    def display(self, label: str, output: dict) -> None:
        self.out(prefix_lines(label, (output.get("data") or {}).get("text/plain", "<display>")))

    def status(self, text: str, handle=None):
        self.waiting = text
        return True

    def text(self) -> str:
        """What was kept, from a line's start, under a line that says what was cut."""
        with self._lock:
            text, cut = _ANSI.sub("", self._text), self.cut
        if not cut:
            return text
        rest = text[text.index("\n") + 1 :] if "\n" in text else text
        cut += len(text) - len(rest)
        return f"[{cut} characters cut: every line is in the session's output/rankN files]\n{rest}"


@dataclass
class CellRun:
    """One cell sent by ``run`` (or ``profile``'s record in the history)."""

    handle: str
    code: str
    ranks: list[int]
    source: str  # as the history holds it: "%%dist --ranks 0\n<code>"
    printer: Collector = field(default_factory=Collector)
    started: float = field(default_factory=time.monotonic)
    ended: threading.Event = field(default_factory=threading.Event)
    elapsed: float | None = None
    result: CellResult | None = None
    error: BaseException | None = None


class Driver:
    def __init__(self) -> None:
        self.lock = threading.RLock()  # start, attach, stop and calls that use the ranks
        self.cells: dict[str, CellRun] = {}
        self.history: list[export.HistoryCell] = []  # this server's cells (not kept sessions)
        self._count = 0
        # Set when the server ends (its client went): a call still following a cell returns,
        # so the process exits (and stops its session) instead of waiting out the timeout.
        self.closing = threading.Event()

    def close(self) -> None:
        self.closing.set()

    # ----- the session ------------------------------------------------------------------
    def session(self) -> cluster.Session:
        s = cluster.current()
        if s is None:
            raise DistUsageError(cluster.lost() or NO_SESSION)
        return s

    def start(self, options: dict, progress: Progress = _quiet) -> R.SessionInfo:
        from ..viz.status_render import ready_text

        with self.lock:
            self._refuse_second("start")

            def report(done: int, total: int, what: str = "") -> None:
                progress(done, total or None, what or "starting")

            s = cluster.start(progress=report, **options)
            self._new_session()
            how, layout = s.engines.how, s.layout.sizes_text()
            line = ready_text(s.plan.backend, s.ranks, how, layout, s.kept_line())
            return self._info(s, line, s.ranks)

    def attach(self, name: str, force: bool = False) -> R.SessionInfo:
        with self.lock:
            self._refuse_second("attach")
            s, line = cluster.attach(name, force=force)
            self._new_session()
            return self._info(s, line, s.status())

    def sessions(self) -> R.SessionsResult:
        rows = [kept_sessions.describe(k) for _, k in sorted(kept_sessions.kept_sessions().items())]
        return R.SessionsResult(sessions=rows)

    def stop(self, name: str | None = None) -> R.StopResult:
        with self.lock:
            s = cluster.current()
            if name and (s is None or s.plan.name != name):
                kept_sessions.stop(name)
                return R.StopResult(message=f"Session {name!r} stopped.")
            if s is None:
                lost = cluster.lost()
                if lost and "no longer drives" in lost:
                    lost += f" Nothing was stopped; stop with name {cluster.lost_name()!r} ends it."
                return R.StopResult(message=lost or "No session is running.")
            pids = [rs.pid for rs in s.ranks if rs.pid]
            s.stop()
            return R.StopResult(message="Session stopped.", pids=pids)

    def _refuse_second(self, what: str) -> None:
        s = cluster.current()
        if s is not None:
            raise DistUsageError(
                f"Cannot {what}: a session of {s.world_size} ranks already runs in this server "
                "(one at a time): end it with stop first, or start another server."
            )

    def _new_session(self) -> None:
        self.history = []

    def _info(self, s, line: str, rows) -> R.SessionInfo:
        return R.SessionInfo(
            message=line,
            world_size=s.world_size,
            backend=s.plan.backend,
            layout=s.layout.sizes_text(),
            name=s.plan.name if s.keeper.keeps else None,
            folder=s.folder.path,
            ranks=[R.RankRow(**asdict(rs)) for rs in rows],
        )

    # ----- cells ------------------------------------------------------------------------
    def run(
        self,
        code: str,
        ranks: str | None = None,
        where: str | None = None,
        timeout: float = 30.0,
        progress: Progress = _quiet,
    ) -> R.RunResult:
        with self.lock:
            s = self.session()
            self._refuse_running("run")
            self._count += 1
            flags = f" --ranks {ranks}" if ranks else f" --where {where}" if where else ""
            cell = CellRun(f"c{self._count}", code, [], f"%%dist{flags}\n{code}")
            thread = s.run_background(
                code,
                ranks,
                printer=cell.printer,
                where=where,
                on_end=lambda result, error: self._ended(s, cell, result, error),
            )
            running = s.background.current() if thread.is_alive() else None
            if running is not None and not cell.ended.is_set():
                cell.ranks = running.ranks
            self._keep(cell)
        return self._follow(cell, timeout, progress)

    def wait(self, handle: str, timeout: float = 30.0, progress: Progress = _quiet) -> R.RunResult:
        return self._follow(self._cell(handle), timeout, progress)

    def interrupt(
        self,
        handle: str | None = None,
        ranks: str | None = None,
        timeout: float = 15.0,
        progress: Progress = _quiet,
    ) -> R.InterruptResult:
        s = self.session()
        cell = self._cell(handle) if handle else self._running()
        if cell is not None and cell.ended.is_set():
            summary = f"Cell {cell.handle} had ended already; nothing was interrupted."
            return R.InterruptResult(signalled=[], summary=summary, cell=self._result(cell))
        signalled = s.interrupt(ranks)
        if signalled:
            summary = f"Sent SIGINT to {rank_label(signalled)[1:-1]}."
        elif cell is not None:  # its ranks left it meanwhile: it is ending by itself
            summary = f"Cell {cell.handle} was ending; nothing was signalled."
        else:
            summary = "No cell is running."
        if cell is None:  # none, or a cell an earlier kernel left running (a kept session)
            return R.InterruptResult(signalled=signalled, summary=summary)
        return R.InterruptResult(
            signalled=signalled, summary=summary, cell=self._follow(cell, timeout, progress)
        )

    def _ended(self, s, cell: CellRun, result, error) -> None:
        """On the cell's thread, as it ends: its outcome, and its place in the history."""
        cell.elapsed = time.monotonic() - cell.started
        cell.result, cell.error = result, error
        if result is not None:  # it ran (a refused cell is no history)
            cell.ranks = result.ranks
            self._record(s, cell.source, error is None)
        cell.ended.set()

    def _record(self, s, source: str, ok: bool) -> None:
        if s.keeper.keeps:  # a notebook that attaches it later exports these cells too
            s.keeper.record_cell(source, ok)
        else:
            self.history.append(export.HistoryCell(len(self.history) + 1, source, ok))

    def _keep(self, cell: CellRun) -> None:
        self.cells[cell.handle] = cell
        done = [h for h, c in self.cells.items() if c.ended.is_set()]
        for h in done[: max(0, len(self.cells) - KEPT_CELLS)]:
            del self.cells[h]

    def _cell(self, handle: str) -> CellRun:
        cell = self.cells.get(handle)
        if cell is None:
            raise DistUsageError(
                f"No cell has handle {handle!r}: run returns one (like 'c3') for a cell still "
                "running at its timeout."
            )
        return cell

    def _running(self) -> CellRun | None:
        return next((c for c in list(self.cells.values()) if not c.ended.is_set()), None)

    def _refuse_running(self, what: str) -> None:
        cell = self._running()
        if cell is not None:
            raise DistUsageError(
                f"{what}: cell {cell.handle} still runs on {rank_label(cell.ranks)[1:-1]}. "
                f"Wait for it (wait with handle {cell.handle!r}) or stop it (interrupt)."
            )

    def _follow(self, cell: CellRun, timeout: float, progress: Progress) -> R.RunResult:
        """Wait up to ``timeout`` s for ``cell`` to end, reporting progress each second."""
        deadline = time.monotonic() + max(0.0, timeout)
        while not cell.ended.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
            now = time.monotonic()
            if now >= deadline or self.closing.is_set():
                break
            what = cell.printer.waiting or f"running on {rank_label(cell.ranks)[1:-1]}"
            progress(now - cell.started, None, what)
        return self._result(cell)

    def _result(self, cell: CellRun) -> R.RunResult:
        base = dict(handle=cell.handle, ranks=cell.ranks)
        if not cell.ended.is_set():
            took = time.monotonic() - cell.started
            summary = (
                f"Still running on {rank_label(cell.ranks)[1:-1]} after {took:.0f} s: wait "
                f"(handle {cell.handle!r}) for more, interrupt (handle {cell.handle!r}) to stop it."
            )
            return R.RunResult(
                **base,
                state="running",
                elapsed_s=round(took, 3),
                summary=summary,
                waiting=cell.printer.waiting,
                output=cell.printer.text(),
            )
        error, result = cell.error, cell.result
        if result is None and isinstance(error, DistUsageError):
            raise error  # refused before it ran: the tool's error
        took = round(cell.elapsed or 0.0, 3)
        if error is None:
            summary = f"Ran on {rank_label(cell.ranks)[1:-1]} in {took:.2f} s."
            return R.RunResult(
                **base, state="ok", elapsed_s=took, summary=summary, outputs=outputs(result)
            )
        cause = _cut(error.summary if isinstance(error, DistCellError) else one_line(error))
        report = _ANSI.sub("", getattr(error, "report", "") or "")[-CAP_CHARS:]
        return R.RunResult(
            **base,
            state="failed",
            elapsed_s=took,
            summary=cause,
            root_cause=cause,
            tracebacks=report,
            output="" if result is not None else cell.printer.text(),
            outputs=outputs(result) if result is not None else [],
        )

    # ----- looking at the ranks ---------------------------------------------------------
    def status(self) -> R.StatusResult:
        s = self.session()
        rows = s.status()
        running = self._running()
        return R.StatusResult(
            line=s.session_line(rows),
            world_size=s.world_size,
            backend=s.plan.backend,
            layout=s.layout.sizes_text(),
            name=s.plan.name if s.keeper.keeps else None,
            folder=s.folder.path,
            running=running.handle if running else None,
            ranks=[R.RankRow(**asdict(rs)) for rs in rows],
        )

    def stacks(self, ranks: str | None = None, all_threads: bool = False) -> R.StacksResult:
        s = self.session()
        targets = parse_ranks(ranks, s.world_size)
        dumps = s.stacks(targets)
        busy = sorted(s.book.busy() & set(targets))
        found = supervision.waits(s, busy) if busy else {}
        rows = []
        for r, dump in dumps.items():
            wait = found.get(r)
            text = dump if all_threads else main_thread_stack(dump)
            rows.append(
                R.RankStack(
                    rank=r,
                    busy=r in busy,
                    waiting_in=waits.where(wait) if wait else None,
                    stack=text.rstrip(),
                )
            )
        waiting = sorted(r for r, w in found.items() if w)
        verdict = waits.verdict(found) if found else ""
        return R.StacksResult(verdict=verdict, waiting=waiting, ranks=rows)

    # ----- recovery and inspection ------------------------------------------------------
    def restart(
        self, hard: bool = False, ranks: str | None = None, progress: Progress = _quiet
    ) -> R.Message:
        if hard and ranks:
            raise DistUsageError("restart: hard restarts every rank; ranks replaces only those.")
        with self.lock:
            s = self.session()
            self._refuse_running("restart")
            t0 = time.perf_counter()

            def report(done: int, total: int, what: str = "") -> None:
                progress(done, total or None, what or "restarting")

            s.restart(hard=hard, progress=report, ranks=ranks)
            if ranks is not None:
                how = f"{rank_label(parse_ranks(ranks, s.world_size))[1:-1]} replaced, the "
                how += "others kept their variables; process groups made anew"
            else:
                how = "engines restarted" if hard else "process groups rebuilt, variables kept"
            return R.Message(message=f"Restarted ({how}) in {time.perf_counter() - t0:.2f}s.")

    def diff(self, name: str, group: str | None = None, atol: float = 0.0) -> R.DiffResult:
        with self.lock:
            s = self.session()
            self._refuse_running("diff")
            summary, frame = s.diff(name, group, atol)
            return R.DiffResult(summary=summary, rows=_rows(frame))

    def profile(
        self,
        code: str,
        ranks: str | None = None,
        where: str | None = None,
        out: str | None = None,
        max_mb: float | None = None,
    ) -> R.ProfileResult:
        with self.lock:
            s = self.session()
            self._refuse_running("profile")
            kw = {"max_mb": max_mb} if max_mb else {}
            before = s.last
            try:
                prof = s.profile(code, ranks, where=where, out=out, echo=False, **kw)
                state, cause = "ok", None
            except DistCellError as e:
                prof, state, cause = getattr(e, "profile", None), "failed", _cut(e.summary)
                if prof is None:
                    raise
            flags = f" --ranks {ranks}" if ranks else f" --where {where}" if where else ""
            self._record(s, f"%%dist_profile{flags}\n{code}", state == "ok")
            last = s.last if s.last is not before else None
            return R.ProfileResult(
                state=state,
                verdict=prof.verdict,
                coverage=prof.coverage,
                root_cause=cause,
                ranks=_rows(prof.ranks),
                collectives=_rows(prof.collectives)[:50],
                folder=os.path.abspath(prof.folder),  # the agent's cwd need not be ours
                trace=os.path.abspath(prof.merged),
                files={str(r): os.path.abspath(p) for r, p in prof.files.items()},
                partial=prof.partial,
                outputs=outputs(last) if last is not None else [],
            )

    def pull(self, name: str, ranks: str | None = None, max_chars: int = 2000) -> R.PullResult:
        with self.lock:
            s = self.session()
            self._refuse_running("pull")
            got = s.apply(describe.describe, name, max_chars, ranks=ranks, timeout=60)
            return R.PullResult(values=[R.PulledValue(rank=r, **v) for r, v in got.items()])

    def export(self, path: str, force: bool = False, profile: bool = False) -> R.ExportResult:
        from ..debug_magics import DebugMagics
        from ..magics import DistMagics

        def parser(magic):
            return lambda flags: magic.parser.parse_argstring(flags)

        with self.lock:
            s = self.session()
            path = os.path.abspath(os.path.expanduser(path))
            export.check_path(path, force)
            history = s.keeper.history() if s.keeper.keeps else self.history
            cells, start_line = export.last_session(history)
            settings = export.pick_settings(s, start_line, parser(DistMagics.dist_start))
            result = export.export_script(
                cells,
                settings,
                parser(DistMagics.dist),
                filename=os.path.basename(path),
                parse_profile_line=parser(DebugMagics.dist_profile),
                profile=profile,
            )
            export.write_script(path, result.text, force)
            return R.ExportResult(
                path=path,
                summary=result.summary(path),
                cells=result.cells,
                skipped=result.skipped,
                world_size=result.world_size,
            )


def outputs(result: CellResult) -> list[R.RankOutput]:
    """Each rank's part of a finished cell: its streams (the last CAP_CHARS of each), the
    repr of its last expression, its error."""
    rows = []
    for r in result.ranks:
        value = result.results.get(r)
        shown = value.get("text/plain") if isinstance(value, dict) else None
        rows.append(
            R.RankOutput(
                rank=r,
                stdout=_tail(result.stdout.get(r, "")),
                stderr=_tail(result.stderr.get(r, "")),
                result=_cut(shown, CAP_CHARS),
                error=_cut(result.errors.get(r)),
            )
        )
    return rows


def _tail(text: str) -> str:
    text = _ANSI.sub("", text)
    if len(text) <= CAP_CHARS:
        return text
    return f"[{len(text) - CAP_CHARS} characters cut]\n{text[-CAP_CHARS:]}"


def _cut(text: str | None, cap: int = LINE_CHARS) -> str | None:
    """The start of a repr or an error's line, cut at ``cap`` (a message or a value's repr
    can hold a whole tensor: the result stays small)."""
    if text is None or len(text) <= cap:
        return text
    return f"{text[:cap]}... [{len(text) - cap} characters cut]"


def _rows(frame) -> list[dict]:
    """A DataFrame as JSON rows (NaN as null, numpy numbers as plain ones)."""
    return json.loads(frame.to_json(orient="records", default_handler=str))
