"""``%%dist_profile`` on a rank: torch.profiler around the cell, started and stopped by two
calls of the kernel's around the ordinary ``%%dist`` run (the same thread runs all three),
and what the kernel needs to merge the ranks' traces (core/timeline.py): the trace, the
rank's wall clock read inside two marker events, and the Flight Recorder's collectives of
the window. Runs inside each engine."""

from __future__ import annotations

import os
import tempfile
import time

from ..core.timeline import START_MARK, STOP_MARK

_state: dict = {}


def _mark(name: str) -> None:
    import torch

    with torch.profiler.record_function(name):
        _state["marks"][name] = time.time_ns()


def start(cuda: bool) -> None:
    """Start profiling this rank (CPU ops, and CUDA where the rank has a GPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    stop_quietly()
    # libkineto writes each start and stop to fd 2 (its STAGE and USDT levels, 3 and 5,
    # above ERROR's 4, so nothing but 6 quiets them), which the next cell would show as
    # late output. Read once, as the first profiler starts; a user's own setting stays.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    activities = [ProfilerActivity.CPU]
    if cuda and torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities)
    prof.start()
    _state.update(prof=prof, marks={}, since=time.time_ns())
    _mark(START_MARK)


def stop(max_bytes: int) -> dict:
    """Stop and return the trace (JSON text), or only its size when over ``max_bytes``."""
    from . import wait_probe

    prof = _state.pop("prof", None)
    if prof is None:
        return {"error": "not profiling (its start failed or the engine restarted)"}
    _mark(STOP_MARK)
    prof.stop()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        size = os.path.getsize(path)
        if size > max_bytes:
            return {"too_big": size}
        with open(path) as f:
            trace = f.read()
    finally:
        os.remove(path)
    dump = wait_probe.flight_recorder_dump(entries=True, only_active=False) or {}
    since = _state["since"]
    entries = [e for e in dump.get("entries") or [] if e.get("time_created_ns", 0) >= since]
    return {"trace": trace, "marks": _state["marks"], "collectives": entries, "size": size}


def stop_quietly() -> None:
    """A profiler left running (a stop that never came) ended, its trace dropped."""
    prof = _state.pop("prof", None)
    if prof is not None:
        try:
            prof.stop()
        except Exception:
            pass
