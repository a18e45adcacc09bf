"""When a cell ends on a rank. Two rules the Python code alone does not give:

- Leaving the cell's code is not finishing it. NCCL calls return at once, and the GPU may
  still wait for a peer after the code left the cell (as may a gloo ``async_op`` collective
  nobody waited for). A cell ends once the device work it queued is done: a CUDA event
  recorded on the current stream at the end of the code, and every collective the Flight
  Recorder holds as pending (core/recorder.py), which covers NCCL's own streams. Until then
  the rank is in its cell: busy, and waiting (the wait probe reads the recorder) where a
  peer never comes, so that the kernel can release it. Polled with sleeps: the GIL stays
  free for the rank's answering thread.
- A released rank fails its cell, and the release never runs inside user code. The
  answering thread marks the cell released, and the cell fails at its end (even if user code
  swallowed an error on the way). An asynchronous exception (``PyThreadState_SetAsyncExc``)
  fires at the thread's next bytecode, wherever that is: inside a ``with`` block's
  ``__exit__`` it would skip the rest of it (grad mode left off, autocast left on, a user's
  lock held). So one is raised only into a main thread parked in a known wait: its top frame
  stopped at a call of ``.item()``, ``.wait()``, ``synchronize()`` ..., no ``__exit__``
  below it (``parked_in_wait``),
  and only before the abort that ends that wait (rank_services.abort), so the exception
  fires as that call returns, in that frame, as if the call itself raised. A thread running
  Python instead goes on until the next collective on the aborted communicator raises, or
  the cell ends; what it computed after the wait in that cell is not to be trusted, and the
  failure says so.

Both hang on IPython's ``run_cell_async``, which ipykernel's two paths (plain and async
cells) both go through; so do the watchers (``watch``) that want to know when a cell's code
starts and when the cell has ended, its device work done (%%dist_profile's window).
"""

from __future__ import annotations

import ctypes
import threading
import time

_lock = threading.Lock()
# why: the release of the running cell; started_ns: when it started (time.time_ns(), the
# Flight Recorder's clock: a wait is numbered within the cell by it); armed: a
# release's exception was set for the cell's thread (raised by now, or still to fire);
# last: the cell that ended last (see last_cell)
_state: dict = {"in_cell": False, "why": None, "started_ns": None, "armed": False, "last": None}
_watchers: list = []  # called with "start" as a cell's code starts, "end" once it ended


class RankReleased(BaseException):
    """This rank's wait was released: a rank it waited for left the cell. A BaseException,
    so that an ``except Exception`` in the cell does not carry on with unreduced data."""

    def __init__(self, *args):  # raised as a class by PyThreadState_SetAsyncExc: no args
        super().__init__(*(args or (_state["why"] or "this rank's wait was released",)))


def install(shell) -> None:
    """Wrap the shell's ``run_cell_async`` (once per engine)."""
    original = shell.run_cell_async
    if getattr(original, "infini_cell_end", False):
        return

    async def run_cell_async(*args, **kwargs):
        from .cell_names import notebook_number, request_id

        with _lock:
            _state.update(
                in_cell=True,
                why=None,
                started_ns=time.time_ns(),
                since=time.time(),
                number=notebook_number(shell),
                msg_id=request_id(shell),
            )
        _tell("start")
        try:
            result = await original(*args, **kwargs)
        except RankReleased as e:  # fired while IPython was showing the cell's own error
            from IPython.core.interactiveshell import ExecutionResult

            result = ExecutionResult(None)
            result.error_in_exec = e
        error = finish(result.success)
        _tell("end")
        if error is not None:
            own = result.error_in_exec
            if result.success:
                shell.showtraceback((type(error), error, None), exception_only=True)
                result.error_in_exec = error
            elif isinstance(error, RankReleased) and isinstance(own, RuntimeError):
                # the cell's code raised after the release a RuntimeError, as the abort makes
                # them (torch's DistError family: NCCL's "internal error", a lazy init that
                # never met the failed rank; gloo's closed connection), not a ValueError of
                # its own or a Stop: a consequence. The reply names the release; its
                # traceback, already shown, stays that error's (ipykernel's _last_traceback).
                error.__cause__ = own
                result.error_in_exec = error
        with _lock:
            if _state["last"] is not None:
                _state["last"]["ok"] = bool(result.success)
        return result

    run_cell_async.infini_cell_end = True
    shell.run_cell_async = run_cell_async


def watch(fn) -> None:
    """Call ``fn("start")`` as each cell's code starts and ``fn("end")`` once the cell has
    ended (after its device work), until ``unwatch(fn)``."""
    if fn not in _watchers:
        _watchers.append(fn)


def unwatch(fn) -> None:
    if fn in _watchers:
        _watchers.remove(fn)


def _tell(moment: str) -> None:
    for fn in list(_watchers):
        try:
            fn(moment)
        except Exception:  # a watcher never fails the cell
            pass


def finish(succeeded: bool) -> BaseException | None:
    """End the cell: wait for its device work (after code that succeeded), then leave it.
    The error the cell must fail with, if any: a release, or an interrupt while waiting."""
    error = None
    try:
        if succeeded:
            wait_for_device_work()
    except BaseException as e:  # RankReleased delivered here, or the Stop button
        error = e
    while True:  # a release just before the lock: its exception fires here; then retry
        try:
            with _lock:
                _state["in_cell"] = False  # from here on no release raises into the thread
                _state["last"] = _ended()
                why, _state["why"] = _state["why"], None
                armed, _state["armed"] = _state["armed"], False
            if armed:
                _deliver_pending()  # none may fire later, in the kernel's own loop
            break
        except RankReleased as e:
            error = error or e
    if why and not isinstance(error, RankReleased):
        # released: whatever the wait for device work raised after the abort (NCCL's
        # "internal error" on an aborted communicator) is a consequence, not the cause
        cause, error = error, RankReleased(why)
        error.__cause__ = cause
    return error


def in_cell() -> bool:
    """Whether a cell's code runs on this rank now (not a pull, a bench, or nothing)."""
    return _state["in_cell"]


def running_cell() -> dict | None:
    """The cell that runs now: its notebook number (In[N]), since when and its request's id;
    None if none."""
    with _lock:
        if not _state["in_cell"]:
            return None
        return {k: _state.get(k) for k in ("number", "since", "msg_id")}


def _ended() -> dict:
    """The cell that just ended, as ``last_cell`` gives it: ``ok`` None until the wrapper
    knows (the cell's own error, or one ``finish`` raised)."""
    return dict(
        {k: _state.get(k) for k in ("number", "since", "msg_id")}, ended=time.time(), ok=None
    )


def last_cell() -> dict | None:
    """The last cell that ended on this rank: its notebook number, since when, its
    request's id, when it ended and whether it succeeded (None: not known yet). A kernel
    attaching a kept session names the cell that ended while none was attached."""
    with _lock:
        last = _state.get("last")
        return dict(last) if last else None


def started_ns() -> int | None:
    """When the running cell started (time.time_ns()); None outside a cell."""
    return _state["started_ns"] if _state["in_cell"] else None


def release(why: str, interrupt: bool) -> bool:
    """From the answering thread, as this rank's wait is released: the running cell fails
    with ``why`` at its end; with ``interrupt`` (NCCL, asked before the abort: a sync may
    return normally after it), also at once where the main thread is parked in a known wait
    (see the module's docstring). False when no cell runs (nothing to fail)."""
    import sys

    with _lock:
        if not _state["in_cell"]:
            return False
        _state["why"] = why
        if interrupt and parked_in_wait(sys._current_frames().get(threading.main_thread().ident)):
            _set_async_exc(RankReleased)
            _state["armed"] = True
        return True


# Calls that block until a peer's data has come: torch's syncs and waits. A frame stopped at
# one of these calls is parked in native code (a Python callee would be the top frame).
WAIT_CALLS = frozenset(
    {"item", "tolist", "cpu", "numpy", "wait", "synchronize", "_cuda_synchronize", "barrier"}
)


def parked_in_wait(frame) -> bool:
    """Whether ``frame`` (a thread's top frame) is stopped at a call of a known wait, and
    not while a ``with`` block is being left: the instruction it executes is a call whose
    callee is named in WAIT_CALLS (``x.item()``, ``work.wait(timeout=t)``,
    ``torch.cuda.synchronize()``), and no frame below it is an ``__exit__`` (torch's own
    profiler synchronizes in its ``__exit__`` before it disables itself: an exception there
    would leave it recording)."""
    if frame is None or _leaving_a_with(frame):
        return False
    return _callee(frame) in WAIT_CALLS


def _callee(frame) -> str | None:
    """The name of what the call ``frame`` is stopped at calls: of the loads before it that
    start where the call expression starts, the one that reaches furthest (``a.b.wait`` in
    ``a.b.wait(x.item)``, never an argument's attribute). Source positions, Python >= 3.11."""
    import dis

    instructions, current = [], None
    for ins in dis.get_instructions(frame.f_code):
        if ins.offset > frame.f_lasti:  # f_lasti may point into the instruction's caches
            break
        instructions.append(ins)
        current = ins
    where = getattr(current, "positions", None)
    if current is None or not current.opname.startswith("CALL") or where is None:
        return None
    start = (where.lineno, where.col_offset)
    callee, reach = None, None
    for ins in instructions[:-1]:
        at = ins.positions
        if ins.opname.startswith("LOAD") and at and (at.lineno, at.col_offset) == start:
            end = (at.end_lineno or 0, at.end_col_offset or 0)
            if reach is None or end >= reach:
                callee, reach = ins.argval, end
    return callee if isinstance(callee, str) else None


def _leaving_a_with(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_name in ("__exit__", "__aexit__"):
            return True
        frame = frame.f_back
    return False


def _set_async_exc(exc) -> None:
    """Raise ``exc`` (a class) in the cell's thread at its next bytecode."""
    ident = ctypes.c_ulong(threading.main_thread().ident)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ident, ctypes.py_object(exc))


def _deliver_pending() -> None:
    """Let an asynchronous exception set for this thread and not raised yet fire now: the
    interpreter checks at a backward jump. Not cleared with ``PyThreadState_SetAsyncExc(id,
    NULL)``: CPython 3.11 then leaves its eval breaker set for good (``_PyEval_SignalAsyncExc``
    signals even for NULL, and only a raised one unsignals it), and under a tracer every
    function call spins on it (pdb's ``n`` or ``s`` hung the rank in any later cell)."""
    for _ in range(2):
        pass


POLL_MAX_S = 0.05


def wait_for_device_work() -> None:
    """Until the device work queued by the cell is done (see the module's docstring)."""
    import sys

    if "torch" not in sys.modules:
        return
    event = _record_event()
    delay = 0.001
    while not (_done(event) and not _collectives_pending()):
        time.sleep(delay)
        delay = min(2 * delay, POLL_MAX_S)


def _record_event():
    """A CUDA event at the end of the current stream's work, or None off the GPU."""
    import torch

    if not torch.cuda.is_initialized():
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _done(event) -> bool:
    return event is None or event.query()


def _collectives_pending() -> bool:
    """Whether the Flight Recorder holds a collective of this rank as pending. Its groups'
    status first (cheap, no entries): nothing enqueued past what completed is the common
    case. NCCL's status lags (its watchdog marks completions), so then the entries, whose
    states the dump refreshes (``update_state`` in FlightRecorderDetail.hpp)."""
    import torch.distributed as dist

    from ..core import recorder
    from . import wait_probe

    if not dist.is_initialized():
        return False
    status = wait_probe.flight_recorder_dump(entries=False)
    if not status or not recorder.anything_enqueued(status):
        return False
    dump = wait_probe.flight_recorder_dump()
    return bool(dump and recorder.pending(dump, collectives_only=True))
