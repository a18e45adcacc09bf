"""Running a cell on the ranks, from sending it to the error it raises: what cannot run is
refused, the cell is sent, ``watch.CellWatch`` follows it while it runs (output, ranks that
leave, die or stay stuck, waits released, the Stop button), and the finished cell gives its
result or its failure's root cause. Functions taking the Session; what they change is
written through its owners (the RankBook, the client) and ``session.last``."""

from __future__ import annotations

import os
import time

from ..core import async_cells, cell_lines
from ..core.errors import DistCellError, DistUsageError
from ..core.output import (
    StreamLabeler,
    error_report,
    error_summary,
    left_debugger,
    one_line,
    remote_traceback,
)
from ..core.plan import soft_restart_fails
from ..core.ranks import parse_ranks, parse_where, rank_label
from ..core.state import CellResult
from ..launch.relay import RelayGone
from . import gc_pace, left_output, recovery, supervision
from .cell import Cell
from .output_files import OutputFiles
from .watch import CellWatch

_TIMEOUT_WORDS = ("timed out", "timeout")
# torch.distributed's own errors; gloo and nccl raise RuntimeError naming their sources
_DIST_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError")
_BACKEND_WORDS = ("gloo", "nccl", "processgroup")


def run(
    s, code: str, targets: list[int], collapse, max_lines, printer, users: bool = True
) -> CellResult:
    """Run ``code`` on ``targets`` as a cell. ``users``: the user's own cell, which needs
    whole process groups and becomes ``session.last`` and the ranks' last cell; False for
    the kernel's own (%dist_debug's pdb), which is neither."""
    refuse_top_level_await(code)
    dead = supervision.dead_ranks(s, targets)
    if dead:
        # the advice the failed cell gave (cell_error): replace them alone, or all
        raise DistUsageError(f"{supervision.dead_text(dead)}. {recovery.replace_advice(dead)}")
    if users:
        s.require_whole()
    refuse_stuck(s, targets)
    said = s.reloader.before_cell(s, targets) if users else None  # %dist_autoreload
    # Paced around _follow's whole frame: the cell's objects are freed (reference counting)
    # before the user's thresholds come back, not walked by the collection that follows
    with gc_pace.paced(len(targets)):  # per-rank objects: fewer collections (gc_pace.py)
        return _follow(s, code, targets, collapse, max_lines, printer, users, said)


def _follow(s, code, targets, collapse, max_lines, printer, users, said) -> CellResult:
    """``run``'s cell, sent, followed to its end and judged."""
    labeler = StreamLabeler(collapse=collapse)
    if max_lines:
        labeler.max_lines = max_lines
    name = cell_name()
    files = OutputFiles(s.folder.file("output"), targets, name)
    label = request_label(name, code)
    t0 = time.perf_counter()
    cell = _send_cell(s, code, label, targets, Cell.listener(labeler, printer, files))
    ar = cell.ar
    if said:  # kept in the cell's output, before the ranks' own
        cell.note(targets[0], said)
    watch = CellWatch(s, cell, name)
    try:
        watch.follow()  # until every rank left the cell (the Stop button: DistInterrupted)
        result = collect(cell, time.perf_counter() - t0, watch)
    finally:  # interrupted and failed cells too (a stuck rank's record goes once it ends)
        s.engines.forget(ar)
        files.close()
    if users:
        s.last = result
    if result.errors:
        raise cell_error(s, result, targets, watch)
    if users:
        s.book.cell_ended(targets, failed=())
    return result


def _send_cell(s, code: str, label: str, targets: list[int], listen) -> Cell:
    """Send the cell, through ipyparallel or (``--relay``) the hosts' relays; ``listen(ar,
    targets)`` makes the Cell, listening before any output can arrive."""
    relay = s.engines.relay
    if relay is None:
        view = s.engines.view(targets)
        return s.engines.client.on_io_thread(lambda _: listen(_execute(view, code, label), targets))
    ar = relay.prepare(code, label, targets)
    cell = listen(ar, targets)
    try:
        relay.send(ar)
    except RelayGone as e:
        raise DistUsageError(f"{e}. {recovery.HARD_RESTART}") from None
    return cell


def _execute(view, code: str, name: str):
    """Send the cell; its label (ipyparallel 9's execute metadata) tells the ranks the
    notebook's name for it, ``In[7]`` (see engine/cell_names.py)."""
    try:
        return view.execute(code, silent=False, block=False, label=name or None)
    except TypeError:  # ipyparallel 8: no labels; the ranks use their own cell numbers
        return view.execute(code, silent=False, block=False)


def refuse_top_level_await(code: str) -> None:
    """A cell with top-level await never gets a reply from an engine: refuse it at once.
    IPython syntax (magics, ``!ls``) becomes Python first, as the rank's IPython will do."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager

        code = TransformerManager().transform_cell(code)
    except Exception:  # no IPython here (a script): plain Python
        pass
    line = async_cells.top_level_await(code)
    if line is not None:
        raise DistUsageError(async_cells.refusal(line))


def refuse_stuck(s, targets: list[int]) -> None:
    """A rank still running an earlier cell (one that ignored an interrupt, or a wait that
    could not be released) would queue this one behind it, and ipykernel then aborts it."""
    busy = sorted(supervision.still_stuck(s) & set(targets))
    if not busy:
        return
    left, covered = left_output.still_running(s, busy)  # an earlier kernel's (kept session)
    native = [r for r in busy if r not in covered]
    if left and not native:
        raise DistUsageError(f"{left}.")
    raise DistUsageError(
        (f"{left}; " if left else "")
        + f"{rank_label(native)[1:-1]} still running an earlier cell (stuck in native code; "
        "see %dist_stacks). Wait for the collective timeout, or run %dist_restart --hard."
    )


def cell_name() -> str:
    """'In[5]': the notebook cell this runs from, for messages that point at a line."""
    try:
        from IPython import get_ipython

        ip = get_ipython()
    except ImportError:
        return ""
    if ip is None:
        return ""
    # IPython counts the running cell before running it (run_cell_async): its own number
    # is one less, as the notebook shows it and the displayhook names its Out[]
    return f"In[{ip.execution_count - 1}]"


def request_label(name: str, code: str) -> str:
    """The label the ranks get: the cell's name and the editor line ``code`` starts on
    (``In[5]:2`` for a %%dist cell's body), so their line numbers are the editor's."""
    try:
        from IPython import get_ipython

        raw = get_ipython().kernel.get_parent("shell")["content"]["code"]
    except Exception:  # no kernel (a script), or no request: the code's own lines
        return name
    return cell_lines.label(name, cell_lines.first_line(raw, code))


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


def collect(cell: Cell, elapsed: float, watch: CellWatch) -> CellResult:
    """The finished cell: its last output shown, its values and errors gathered. Ranks
    without a reply (dead, or stuck after a release) are errors; tracebacks already shown
    live, and those of ranks whose wait was released (their peer left), are not repeated."""
    watch.last_output()
    result = CellResult(ranks=cell.targets, elapsed=elapsed)
    tracebacks = {}
    for r in cell.targets:
        md = cell.metadata(r)
        result.stdout[r] = cell.tail(r, "stdout")
        result.stderr[r] = cell.tail(r, "stderr")
        if not cell.done(r):
            gone = watch.gone.get(r)
            result.errors[r] = "EngineError: its engine stopped" if gone else "still running"
            continue
        reply = cell.futures[r].result()
        if isinstance(reply, BaseException):
            result.errors[r] = one_line(reply)
            shown = r in watch.shown_live or r in cell.told_for or watch.gone.get(r) == "released"
            quiet = _engine_died(reply) or left_debugger(reply)  # EngineError: ipyparallel's
            if not quiet and not shown:
                tracebacks[r] = remote_traceback(reply)
            if _collective_timed_out(reply):
                result.timed_out.append(r)
        elif md.get("execute_result"):
            data = md["execute_result"].get("data", {})
            result.results[r] = data
            cell.printer.display(rank_label([r]), {"data": data, "metadata": {}})
    result.report = error_report(tracebacks)
    return result


def cell_error(s, result: CellResult, targets: list[int], watch: CellWatch) -> DistCellError:
    """The error a failed cell raises, root cause first: the ranks that died (named with
    their exit codes) or raised, then the waits released because of them, then what to do.
    Released groups are rebuilt here (a soft restart), so the next cell just works."""
    lost = relay_lost(s, result)
    if lost is not None:
        return lost
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
    s.book.cell_ended(
        targets,
        failed={r: e for r, e in result.errors.items() if r not in released},
        released={r: _waited_for(watch, r) for r in released},
    )
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
    if stuck:
        advice = f". {recovery.HARD_RESTART}"
    elif died:
        advice = f". {recovery.replace_advice(died)}"
    elif watch.released:
        advice = ". " + recovery.rebuild_after_release(s)
    else:
        advice = _advice(s, result)
        if result.timed_out:  # the groups a timed-out collective leaves are unusable
            fix = recovery.HARD_FIX if soft_restart_fails(s.plan, os.environ) else "%dist_restart"
            s.book.groups_broken("a collective timed out", fix)
    return DistCellError("; ".join(parts) + advice, result.report, sorted(result.errors))


def relay_lost(s, result: CellResult) -> DistCellError | None:
    """With --relay, a relay that ended took its ranks' parts of the cell with it: their
    engines still run, and the relay is what to name (not ranks that died), None else."""
    relay = s.engines.relay
    if relay is None or relay.alive():
        return None
    lost = sorted(r for r, e in result.errors.items() if e.startswith("EngineError"))
    if not lost:
        return None
    s.book.cell_ended(result.ranks, failed=dict(result.errors))
    return DistCellError(
        f"{relay.gone_text()}: {rank_label(lost)[1:-1]} lost {'its' if len(lost) == 1 else 'their'}"
        f" part of the cell (the engines still run; what they printed after it is lost). "
        f"{recovery.HARD_RESTART}",
        result.report,
        sorted(result.errors),
    )


def _waited_for(watch: CellWatch, rank: int) -> str:
    peers = watch.released.get(rank)
    return f"was waiting for {rank_label(peers)[1:-1]}" if peers else "lost a peer that left"


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


def _advice(s, result: CellResult) -> str:
    """What to do next, for failures that leave the process groups unusable."""
    if result.timed_out:
        return (
            ". A collective timed out: the failing ranks waited for peers that never joined "
            f"(their tracebacks show where). {recovery.restart_advice(s)}"
        )
    return ""
