"""Plain data the kernel side hands to renderers (viz) and users. Pure: no imports beyond the
standard library, so viz can type against it without importing the cluster."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# ``progress(done, total, what)``: how long work reports how far it got (viz.Progress draws it)
Progress = Callable[[int, int, str], None]


@dataclass
class RankState:
    rank: int
    pid: int
    host: str
    device: str
    device_name: str
    # idle, busy, prompt (at an input box), failed (raised), released (freed from a wait on
    # a rank that failed), died, stuck (ignores interrupts and releases), stopped
    state: str
    coords: dict = field(default_factory=dict)
    memory_used: int | None = None  # GPU ranks: the device's memory in use (bytes)
    exit_code: int | None = None
    gpu: str | None = None  # the physical GPU: its CUDA_VISIBLE_DEVICES entry in the kernel
    threads: int | None = None  # torch's intra-op threads on the rank
    # live, from the rank's telemetry thread (engine.TELEMETRY_FIELDS); None until it reports
    memory_total: int | None = None
    gpu_util: int | None = None  # percent, where nvidia-ml-py is importable on the rank
    rss: int | None = None  # the rank's process (bytes)
    cpu_percent: float | None = None  # 100 = one core busy
    note: str = ""  # failed: its error; released: what it waited for; idle: its last cell


@dataclass
class CellResult:
    """Everything one ``run`` produced, per rank: stdout and stderr are the last MB of each
    (every line is in the session folder's output/rankN.stdout, see kernel/output_files.py)."""

    ranks: list[int]
    stdout: dict[int, str] = field(default_factory=dict)
    stderr: dict[int, str] = field(default_factory=dict)
    results: dict[int, Any] = field(default_factory=dict)  # last expression's data, if any
    errors: dict[int, str] = field(default_factory=dict)  # rank -> one-line error
    report: str = ""  # the labeled tracebacks, identical ones grouped
    elapsed: float = 0.0
    timed_out: list[int] = field(default_factory=list)  # ranks whose collective timed out
