"""``%%dist_profile`` on a rank: torch.profiler around the cell, started and stopped by two
calls of the kernel's around the ordinary ``%%dist`` run (the same thread runs all three),
and what the kernel needs to merge the ranks' traces (core/timeline.py): the trace and its
summary (core/rank_trace.py); the rank's wall clock read inside mark events (the
profiler's start and stop, and the cell's own start and end, which bound the figures); the
Flight Recorder's entries of the cell and how many its ring dropped; the sends and receives
the cell posted (p2p_log.py); each group's ranks. Runs inside each engine."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import tempfile
import time

from ..core.kineto import CELL_END, CELL_START, START_MARK, STOP_MARK
from . import cell_end, own_files, p2p_log

_state: dict = {}


def _mark(name: str) -> None:
    import torch

    with torch.profiler.record_function(name):
        _state["marks"][name] = time.time_ns()


def _cell(moment: str) -> None:
    """The cell's marks (cell_end's watcher): its first start and its last end."""
    name = CELL_START if moment == "start" else CELL_END
    if "prof" in _state and (name == CELL_END or CELL_START not in _state["marks"]):
        _mark(name)


def running_elsewhere() -> bool:
    """Whether a torch.profiler not ours is on: a second one would stop it."""
    import torch

    return bool(torch.autograd.profiler._is_profiler_enabled) or bool(
        torch._C._autograd._profiler_enabled()
    )


def start(cuda: bool) -> dict:
    """Start profiling this rank (CPU ops, and CUDA where the rank has a GPU). Never raises:
    ``{"started": True}``, ``{"refused": why}`` (a profiler of the user's runs) or
    ``{"error": what}``."""
    stop_quietly()
    if running_elsewhere():
        return {"refused": "a torch.profiler of your own is running"}
    try:
        first_id = _last_record_id()
        prof = new_profiler(cuda)
        prof.start()
        _state.update(prof=prof, marks={}, first_id=first_id)
        _mark(START_MARK)
        cell_end.watch(_cell)
        if _distributed():
            p2p_log.arm()
    except Exception as e:
        stop_quietly()
        return {"error": f"{type(e).__name__}: {e}"}
    return {"started": True}


def new_profiler(cuda: bool):
    """torch.profiler as ``%%dist_profile`` runs it (and an exported script's profiled
    cells): CPU ops, and CUDA ops where the rank has a GPU."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    # libkineto writes each start and stop to fd 2 (its STAGE and USDT levels, 3 and 5,
    # above ERROR's 4, so nothing but 6 quiets them), which the next cell would show as
    # late output. Read once, as the first profiler starts; a user's own setting stays.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    activities = [ProfilerActivity.CPU]
    if cuda and torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    return profile(activities=activities)


def stop(max_bytes: int, rank: int = 0) -> dict:
    """Stop, export the trace and summarize it here (rank_trace.summarize: the rank's own
    events, in parallel with the other ranks); the summary goes to the kernel and the
    trace waits for ``write``. Only the size when over ``max_bytes``."""
    from ..core import rank_trace

    _state.pop("done", None)
    if "prof" not in _state:
        return {"error": "not profiling (its start failed or the engine restarted)"}
    _mark(STOP_MARK)
    calls = _disarm()
    prof = _state.pop("prof")
    prof.stop()
    text, size = exported_trace(prof, max_bytes)
    if text is None:
        return {"too_big": size}
    entries, lost = _recorded_since(_state["first_id"])
    groups = _group_ranks()
    with _no_gc():
        events = json.loads(text).get("traceEvents", [])
        trace = rank_trace.RankTrace(
            rank, events, _state["marks"], entries, p2p=calls, fr_lost=lost, group_ranks=groups
        )
        summary = rank_trace.summarize(trace)
    _state["done"] = (text, events)
    return {"summary": summary, "fr_lost": lost, "group_ranks": groups, "size": size}


def exported_trace(prof, max_bytes: float = float("inf")) -> tuple[str | None, int]:
    """A stopped profiler's Chrome trace: (its text, its size), text None when over
    ``max_bytes``. Exported in a new 0700 folder of ours, not beside other users' files:
    kineto writes "<path>.tmp" by name, following links, then renames it onto path (a link
    planted at that predictable name in /tmp had a rank overwrite any file of its user's)."""
    folder = tempfile.mkdtemp(prefix="infini-notebook-trace-")
    dir_fd = own_files.open_folder(folder)
    try:
        prof.export_chrome_trace(os.path.join(f"/proc/self/fd/{dir_fd}", "trace.json"))
        fd = os.open("trace.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        with os.fdopen(fd, encoding="utf-8") as f:
            size = os.fstat(fd).st_size
            return (f.read() if size <= max_bytes else None), size
    finally:
        for name in os.listdir(dir_fd):
            os.unlink(name, dir_fd=dir_fd)
        os.close(dir_fd)
        os.rmdir(folder)


def write(rank: int, folder: str | None, shift_us: float, flow_base: int) -> dict:
    """The trace the last ``stop`` kept: as this rank's own file (``rankN.json``, as
    exported) and its events moved ``shift_us`` to the merged trace's clock, as a fragment
    of its event list (trace_merge.py), both in ``folder`` (the kernel made it, on this
    host): the fragment's path. With no folder (a rank on another host), their texts."""
    from ..core import trace_merge

    text, events = _state.pop("done")
    with _no_gc():
        piece = trace_merge.fragment(trace_merge.shift(events, rank, shift_us, flow_base))
    if folder is None:
        return {"trace": text, "fragment": piece}
    own_files.write_text(folder, f"rank{rank}.json", text)
    return {"fragment_file": own_files.write_text(folder, fragment_name(rank), piece)}


@contextlib.contextmanager
def _no_gc():
    """The cyclic collector off while a trace's 10^5 objects (no cycles among them) are
    made and walked: each collection they would set off walks every object of the rank,
    torch's included (4 ranks, 100 DDP steps: a summary took 120-180 ms, 35 ms without)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def fragment_name(rank: int) -> str:
    """The file (in the kernel's folder) a rank's shifted events wait in until merged."""
    return f".rank{rank}.events"


def stop_quietly() -> None:
    """A profiler of ours left running (a stop that never came, a failed start on another
    rank) ended, its trace dropped."""
    _disarm()
    _state.pop("done", None)
    prof = _state.pop("prof", None)
    if prof is not None:
        try:
            prof.stop()
        except Exception:
            pass


def _disarm() -> list[dict]:
    cell_end.unwatch(_cell)
    return p2p_log.take() if _distributed() else []


def _distributed() -> bool:
    import sys

    return "torch.distributed" in sys.modules


def _dump() -> dict:
    from . import wait_probe

    return wait_probe.flight_recorder_dump(entries=True, only_active=False) or {}


def _last_record_id() -> int:
    """The newest Flight Recorder entry's id (-1: none): the cell's are the later ones."""
    return max((e.get("record_id", -1) for e in _dump().get("entries") or []), default=-1)


def _recorded_since(first_id: int) -> tuple[list[dict], int]:
    """The entries recorded after ``first_id``, and how many of those the ring dropped (ids
    run on, one per entry; the ring keeps the newest)."""
    entries = [e for e in _dump().get("entries") or [] if e.get("record_id", -1) > first_id]
    lost = min((e["record_id"] for e in entries), default=first_id + 1) - first_id - 1
    return entries, max(0, lost)


def _group_ranks() -> dict[str, list[int]]:
    """Each group's global ranks, by the group's name (as the trace and recorder name it)."""
    if not _distributed():
        return {}
    import torch.distributed as dist

    if not dist.is_initialized():
        return {}
    out = {}
    for group, ranks in dist.distributed_c10d._world.pg_group_ranks.items():
        try:
            out[group.group_name] = sorted(ranks, key=ranks.get)
        except Exception:
            continue
    return out
