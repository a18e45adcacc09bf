"""What the MCP tools return: pydantic models, so each tool publishes a JSON schema of its
structured result (the SDK derives it from the return annotation). Plain data: built by
``driver.py`` from the session API's own objects."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class RankRow(BaseModel):
    """One rank, as the status tiles show it (core/state.py's RankState)."""

    rank: int
    pid: int
    host: str
    device: str
    device_name: str
    state: str = Field(
        description="idle, busy, prompt, failed (raised), released (freed from a wait on a "
        "rank that failed), died, stuck (ignores interrupts and releases), stopped"
    )
    coords: dict[str, int] = Field(default_factory=dict, description="layout coordinates")
    memory_used: int | None = None
    exit_code: int | None = None
    gpu: str | None = None
    threads: int | None = None
    memory_total: int | None = None
    gpu_util: int | None = None
    rss: int | None = None
    cpu_percent: float | None = None
    note: str = Field("", description="failed: its error; released: what it waited for")


class SessionInfo(BaseModel):
    message: str = Field(description="what happened, in one line")
    world_size: int
    backend: str
    layout: str = Field(description="the parallel layout's sizes, e.g. 'tp 2 x dp 2'")
    name: str | None = Field(None, description="a kept session's name")
    folder: str = Field(description="the session's folder; output/rankN.stdout holds every line")
    ranks: list[RankRow]


class RankOutput(BaseModel):
    rank: int
    stdout: str
    stderr: str
    result: str | None = Field(None, description="the repr of the cell's last expression")
    error: str | None = Field(None, description="this rank's error, in one line")


class RunResult(BaseModel):
    handle: str = Field(description="the cell's handle, for wait and interrupt")
    state: Literal["ok", "failed", "running"]
    ranks: list[int]
    elapsed_s: float
    summary: str = Field(description="one line: what happened, or what to do next")
    root_cause: str | None = Field(
        None, description="a failed cell: the one-line root cause (which rank, what error)"
    )
    tracebacks: str = Field("", description="a failed cell: each rank's traceback, labeled")
    waiting: str = Field("", description="a running cell: where its ranks wait, if they hang")
    output: str = Field(
        "", description="a running cell: the labeled output so far ('[rank 0] ...' lines)"
    )
    outputs: list[RankOutput] = Field(default_factory=list, description="a finished cell's")


class InterruptResult(BaseModel):
    signalled: list[int] = Field(description="the ranks sent SIGINT")
    summary: str
    cell: RunResult | None = Field(None, description="the interrupted cell, once it ended")


class StatusResult(BaseModel):
    line: str = Field(description="the session in a line: ready, or what it needs")
    world_size: int
    backend: str
    layout: str
    name: str | None = None
    folder: str
    running: str | None = Field(None, description="the handle of a cell still running")
    ranks: list[RankRow]


class RankStack(BaseModel):
    rank: int
    busy: bool
    waiting_in: str | None = Field(
        None, description="the torch.distributed call the rank's cell waits in, if any"
    )
    stack: str = Field(description="the cell thread's Python stack (every thread's if asked)")


class StacksResult(BaseModel):
    verdict: str = Field(
        "", description="where every busy rank waits, and mismatches within a group"
    )
    waiting: list[int] = Field(description="ranks waiting in a torch.distributed call")
    ranks: list[RankStack]


class Message(BaseModel):
    message: str


class StopResult(BaseModel):
    message: str
    pids: list[int] = Field(default_factory=list, description="the ranks' processes ended")


class SessionsResult(BaseModel):
    sessions: list[dict[str, Any]] = Field(
        description="this user's kept sessions: name, ranks, backend, started, driver, memory"
    )


class DiffResult(BaseModel):
    summary: str
    rows: list[dict[str, Any]] = Field(
        description="what differs: group, leaf, ranks, compared_with, max_abs_diff, what"
    )


class ProfileResult(BaseModel):
    state: Literal["ok", "failed"]
    verdict: str = Field(description="who made the others wait, and how long")
    coverage: str = Field("", description="what the wait figures do not cover")
    root_cause: str | None = None
    ranks: list[dict[str, Any]] = Field(
        description="per rank: wall, compute, wait, communication, idle (ms), ops, top ops"
    )
    collectives: list[dict[str, Any]] = Field(
        description="per collective (the first 50): who arrived last, the wait it caused"
    )
    folder: str
    trace: str = Field(description="the merged trace (one track per rank), for Perfetto")
    files: dict[str, str] = Field(description="each rank's own trace, by rank")
    partial: list[int] = Field(default_factory=list, description="ranks whose cell failed")
    outputs: list[RankOutput] = Field(default_factory=list)


class PulledValue(BaseModel):
    rank: int
    type: str
    repr: str
    truncated: bool = Field(description="repr was cut at max_chars")
    shape: list[int] | None = None
    dtype: str | None = None
    device: str | None = None
    nbytes: int | None = None


class PullResult(BaseModel):
    values: list[PulledValue]


class ExportResult(BaseModel):
    path: str
    summary: str = Field(description="what was written, how to run it, what was left out")
    cells: list[int]
    skipped: list[str]
    world_size: int
