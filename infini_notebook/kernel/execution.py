"""Running a cell on the ranks, from sending it to the error it raises: following it while
it runs (output, ranks that leave, die or stay stuck, waits released: wait_watch.py), the
Stop button, and a failure's root cause. Functions taking the Session; what they change is
written through its owners (the RankBook, the client) and ``session.last``."""

from __future__ import annotations

import math
import os
import signal
import sys
import time

from ..core import async_cells
from ..core.errors import DistCellError, DistInterrupted, DistUsageError
from ..core.output import (
    StreamLabeler,
    error_report,
    error_summary,
    left_debugger,
    main_thread_stack,
    one_line,
    remote_traceback,
)
from ..core.plan import soft_restart_fails
from ..core.ranks import parse_ranks, parse_where, rank_label
from ..core.state import CellResult
from ..launch.client import CONTROLLER_GONE
from . import supervision
from .cell import Cell
from .output_files import OutputFiles
from .prompts import Prompts
from .wait_watch import WaitWatch

INTERRUPT_GRACE_S = 3.0
COLLAPSE_HOLD_S = 2.0
DEAD_CHECK_S = 0.5  # how often a running cell looks for ranks that died
_TIMEOUT_WORDS = ("timed out", "timeout")
# torch.distributed's own errors; gloo and nccl raise RuntimeError naming their sources
_DIST_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError")
_BACKEND_WORDS = ("gloo", "nccl", "processgroup")
HARD_FIX = "%dist_restart --hard"
HARD_RESTART = f"Run {HARD_FIX} to bring the session back (variables are lost)."


def run(
    s, code: str, targets: list[int], collapse, max_lines, printer, users: bool = True
) -> CellResult:
    """Run ``code`` on ``targets`` as a cell. ``users``: the user's own cell, which needs
    whole process groups and becomes ``session.last`` and the ranks' last cell; False for
    the kernel's own (%dist_debug's pdb), which is neither."""
    refuse_top_level_await(code)
    dead = supervision.dead_ranks(s, targets)
    if dead:
        raise DistUsageError(f"{supervision.dead_text(dead)}. Run %dist_restart --hard first.")
    if users:
        s.require_whole()
    refuse_stuck(s, targets)
    said = s.reloader.before_cell(s, targets) if users else None  # %dist_autoreload
    labeler = StreamLabeler(collapse=collapse)
    if max_lines:
        labeler.max_lines = max_lines
    name = cell_name()
    files = OutputFiles(s.folder.file("output"), targets, name)
    t0 = time.perf_counter()
    with s.engines.client.lock:
        ar = _execute(s.engines.view(targets), code, name)
    cell = Cell(ar, targets, labeler, printer, files)
    if said:  # kept in the cell's output, before the ranks' own
        cell.note(targets[0], said)
    watch = WaitWatch(s, cell, name)
    prompts = Prompts(s, cell, on_answer=watch.human_answered)
    s.book.set_busy(targets, True)
    try:
        try:
            follow(s, cell, watch, prompts)
        except KeyboardInterrupt:
            stuck = interrupt_stuck(s, cell)
            cell.wait_for_trailing_output()  # else a late idle re-creates a purged record
            raise DistInterrupted(_interrupt_summary(targets, stuck), ranks=stuck) from None
        finally:
            s.book.set_busy(targets, False)
            cell.detach()
            s.rendezvous.drop_unread_answers()
        result = collect(cell, time.perf_counter() - t0, watch, supervision.liveness(s))
    finally:  # interrupted and failed cells too (a stuck rank's record goes once it ends)
        s.engines.client.forget(ar.msg_ids)
        files.close()
    if users:
        s.last = result
    if result.errors:
        raise cell_error(s, result, targets, watch)
    if users:
        s.book.cell_ended(targets, failed=())
    return result


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
    if busy:
        raise DistUsageError(
            f"{rank_label(busy)[1:-1]} still running an earlier cell (stuck in native code; "
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


def follow(s, cell: Cell, watch: WaitWatch, prompts: Prompts | None = None) -> None:
    """Show output as it arrives and each rank idle as soon as it is; answer the ranks'
    prompts; notice ranks that fail or die while others run, and release the waits that
    can never finish (watch)."""
    t0 = last_check = time.monotonic()
    running = set(cell.targets)
    while running:
        wake = min(watch.next_wake(), prompts.next_poll if prompts else math.inf)
        pause = min(DEAD_CHECK_S, max(0.01, wake - time.monotonic()))
        if cell.changed.wait(pause):
            cell.changed.clear()  # before reading: a later message wakes the next wait
        finished = {r for r in running if cell.done(r)}
        # A lost connection is a consequence: look for a dead peer first, to name it.
        if running - finished and (
            time.monotonic() - last_check > DEAD_CHECK_S or watch.lost_peer(finished)
        ):
            last_check = time.monotonic()
            if not s.engines.client.controller_running():  # no reply can come any more
                raise DistCellError(CONTROLLER_GONE, ranks=sorted(running))
            dead = set(supervision.dead_ranks(s, sorted(running - finished)))
            if dead:  # their peers' waits are released below; the others finish
                running -= dead
                s.book.set_busy(dead, False)
                watch.left(dead, running - finished, died=True)
        if finished:
            running -= finished
            s.book.set_busy(finished, False)
            watch.left(finished, running)
        # --collapse holds output back a little, so that lines the ranks print at about
        # the same time arrive together and can be merged.
        if not cell.labeler.collapse or time.monotonic() - t0 > COLLAPSE_HOLD_S:
            cell.show(final=False)
        if prompts is not None and running:
            prompts.serve()  # parks here while the user types: nothing is released
        stuck = watch.tick(running)
        if stuck:  # released, yet still waiting: native code that ignores the release
            running -= stuck
            give_up_stuck(s, cell, sorted(stuck))


def give_up_stuck(s, cell: Cell, stuck: list[int]) -> None:
    """End the cell without ranks that could not be released: show where they are; the
    next cell on them is refused (refuse_stuck) until they finish."""
    s.book.add_stuck(stuck)
    stacks = supervision.stacks(s, stuck)
    for r in stuck:
        cell.note(r, f"{rank_label([r])} stack:\n{main_thread_stack(stacks[r])}\n")


def collect(cell: Cell, elapsed: float, watch: WaitWatch, alive=None) -> CellResult:
    """The finished cell: its last output shown, its values and errors gathered. Ranks
    without a reply (dead, or stuck after a release) are errors; tracebacks already shown
    live, and those of ranks whose wait was released (their peer left), are not repeated."""
    cell.wait_for_trailing_output(alive)
    cell.show(final=True)
    cell.render_final()
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
            shown = r in watch.shown_live or watch.gone.get(r) == "released"
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
    s.book.add_stuck(stuck)  # added to: ranks stuck in an earlier cell may still be
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
    if died or stuck:
        advice = f". {HARD_RESTART}"
    elif watch.released:
        advice = ". " + _rebuild_groups(s)
    else:
        advice = _advice(s, result)
        if result.timed_out:  # the groups a timed-out collective leaves are unusable
            fix = HARD_FIX if soft_restart_fails(s.plan, os.environ) else "%dist_restart"
            s.book.groups_broken("a collective timed out", fix)
    return DistCellError("; ".join(parts) + advice, result.report, sorted(result.errors))


def _waited_for(watch: WaitWatch, rank: int) -> str:
    peers = watch.released.get(rank)
    return f"was waiting for {rank_label(peers)[1:-1]}" if peers else "lost a peer that left"


def _rebuild_groups(s) -> str:
    """The soft restart after a release: new process groups, variables kept. Until one
    works, every command that needs the groups is refused (``Session.require_whole``)."""
    try:
        s.restart(after_failure=True)
    except Exception as e:
        s.book.groups_broken(f"the rebuild after the failure failed ({one_line(e)})", HARD_FIX)
        return f"Rebuilding the process groups failed ({one_line(e)}). {HARD_RESTART}"
    return (
        "The process groups were rebuilt (variables kept), so `groups` and `mesh` are new: "
        "re-create what you built on the old ones (DDP or FSDP modules, your own DeviceMesh "
        "or new_group)."
    )


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
            ". A collective timed out: the failing ranks waited for peers that never joined "
            f"(their tracebacks show where). {_restart_advice(s)}"
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


def failed_ranks(s, ranks: str | list[int] | None) -> list[int]:
    """The ranks that failed in the last cell (of ``ranks``); DistUsageError if none."""
    failed = sorted(s.last.errors) if s.last is not None else []
    if not failed:
        raise DistUsageError(
            "The last cell did not fail, so there is no failing frame to inspect. "
            "Post-mortem works right after a %%dist cell that raised on some rank."
        )
    if ranks is None:
        return failed
    chosen = parse_ranks(ranks, s.world_size)
    if not set(chosen) <= set(failed):
        raise DistUsageError(
            f"Only {rank_label(failed)[1:-1]} failed in the last cell; pick --ranks among them."
        )
    return chosen
