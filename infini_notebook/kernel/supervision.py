"""The ranks, asked about from the kernel: which are alive, stuck or dead and why (exit
codes), their stacks (asked through the store, or by signal), what their cells wait in,
signals to them, and the status snapshot (the RankBook's rows with each rank's telemetry).
Plain functions taking the Session; they read its owners (Engines, Rendezvous,
SessionFolder) and write the RankBook through its methods. They answer and return: following
a running cell is ``watch.py``'s, which asks here; nothing here calls back into it or into
``execution.py``."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import psutil

from ..core.ranks import parse_ranks
from ..core.state import RankState
from ..engine import rank_services
from ..launch.start_errors import exit_description
from . import debug_proxy, left_output


def still_stuck(s) -> set[int]:
    """Ranks that ignored an interrupt or a release, until their engine's queue drains.
    A cell an earlier kernel left running gets its output files brought up to date."""
    left_output.follow(s)
    return s.book.stuck(running=lambda: stuck_ranks(s))


def stuck_ranks(s, settle: float = 0.0, ranks=None) -> list[int]:
    """Ranks (of ``ranks``, default all) whose engine still has work queued or running.
    The controller counts a task done a moment after its reply reached us: with
    ``settle``, ranks still counted busy are asked again for up to that long (a rebuild
    right after a cell was refused for a rank that had just answered)."""
    eid = s.engines.eid
    ranks = range(s.world_size) if ranks is None else ranks
    deadline = time.monotonic() + settle
    while True:
        status = s.engines.client.queue_status()
        relayed = s.engines.busy_relayed()  # --relay: cells the controller never saw
        if relayed:  # a rank that died owes its reply for ever: dead, not stuck
            relayed -= set(dead_ranks(s, sorted(relayed)))
        busy = [r for r in ranks if status.get(eid(r), {}).get("queue", 0) > 0 or r in relayed]
        if not busy or time.monotonic() >= deadline:
            return busy
        time.sleep(0.05)


def stacks(s, ranks: str | list[int] | None = None, wait: float = 2.0) -> dict[int, str]:
    """Every thread's Python stack on each rank (the cell's thread as 'Current thread').
    Asked and answered through the TCPStore, which a thread on each engine watches, so a
    rank busy in a cell or stuck in a collective answers, on this host or another."""
    targets = parse_ranks(ranks, s.world_size)
    out = s.rendezvous.ask(targets, "", wait)
    silent = [r for r in targets if r not in out]
    out.update(signal_stacks(s, silent, wait))
    for r in silent:
        out.setdefault(
            r,
            f"(no answer in {wait:.0f} s: the rank is dead, or native code holds its Python "
            "interpreter lock on another host)",
        )
    return dict(sorted(out.items()))


def waits(s, ranks: list[int], wait: float = 1.0) -> dict[int, dict | None]:
    """What each rank's cell waits in (see wait_probe.current_wait); None: not in a
    torch.distributed call. Ranks that did not answer in time are left out."""
    import json

    return {r: json.loads(text) for r, text in s.rendezvous.ask(ranks, "wait", wait).items()}


def signal_stacks(s, ranks: list[int], wait: float) -> dict[int, str]:
    """Stacks of this host's ranks whose answering thread is held off by native code
    holding the GIL: faulthandler dumps them from its signal handler into a file (see
    rank_services.install_signal_dump). Only to ranks that installed the handler: the
    signal's default would end the process."""
    multi_host = s.plan.placement.multi_host
    local = {r: s.engines.local(r) for r in ranks}
    paths = {r: s.folder.stack_file(r, multi_host) for r, p in local.items() if p and _alive(p)}
    sizes = {r: _size(p) for r, p in paths.items() if p}
    sizes = {r: size for r, size in sizes.items() if size}  # 0: no handler (yet)
    send_signal(s, rank_services.STACK_SIGNAL, list(sizes))
    out, seen = {}, {}
    deadline = time.monotonic() + wait
    while sizes and time.monotonic() < deadline:
        time.sleep(0.05)
        for r, before in list(sizes.items()):
            size = _size(paths[r])
            if size > before and seen.get(r) == size:  # the dump grew, then stopped
                out[r] = _read_signal_dump(paths[r], before)
                del sizes[r]
            seen[r] = size
    return out


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_signal_dump(path: str, offset: int) -> str:
    with open(path, "rb") as f:
        main = int(f.readline().split()[1], 16)
        f.seek(offset)
        dump = f.read().decode(errors="replace")
    # the handler ran on some thread; label the main thread as the answering thread does
    return rank_services.as_seen_by_thread(dump, main, helper=-1)


def dead_ranks(s, targets) -> dict[int, str]:
    alive = liveness(s)
    dead = {}
    for r in targets:
        if alive(r):
            continue
        proc = s.engines.local(r)
        dead[r] = (
            exit_description(exit_code(s, proc)) if proc is not None else "its engine unregistered"
        )
    return dead


def liveness(s) -> Callable[[int], bool]:
    """``alive(rank)``: a local engine by its process; a remote one (no pid of ours) by
    the controller, which drops an engine when its nanny reports it gone or its
    heartbeats stop. The controller is asked once, and only when a rank is remote."""
    registered: set[int] | None = None

    def alive(r: int) -> bool:
        nonlocal registered
        proc = s.engines.local(r)
        if proc is not None:
            return _alive(proc)
        if registered is None:
            registered = s.engines.client.ids()
        return s.engines.mapped and s.engines.eid(r) in registered

    return alive


def exit_code(s, proc: psutil.Process) -> int | None:
    """The engine's exit status as its ipyparallel launcher recorded it (the launcher
    reaps the child, so only it can know). Negative: killed by that signal."""
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        cluster = s.engines.client.cluster
        for engine_set in (cluster.engines if cluster else {}).values():
            for data in (engine_set.stop_data or {}).get("engines", {}).values():
                if data.get("pid") == proc.pid:
                    return data.get("exit_code")
        time.sleep(0.05)
    return None


def send_signal(s, signum: int, ranks: list[int] | None = None) -> None:
    """Send ``signum`` to the engines of ``ranks`` (pids this session started)."""
    remote = []
    for r in ranks if ranks is not None else range(s.world_size):
        proc = s.engines.local(r)
        if proc is None:
            remote.append(s.engines.eid(r))
            continue
        try:
            if proc.is_running():
                proc.send_signal(signum)
        except psutil.Error:
            pass
    s.engines.client.send_signal(signum, remote)  # through each engine's nanny


def status(s) -> list[RankState]:
    """Each rank's pid, device and state (idle, busy, error, dead, stuck, stopped)."""

    def exit_code_of(rank: int) -> int | None:
        proc = s.engines.local(rank)
        return exit_code(s, proc) if proc is not None else None

    running = s.running
    telemetry = s.rendezvous.telemetry(range(s.world_size)) if running else {}
    rows = s.book.snapshot(running, liveness(s), still_stuck(s), telemetry, exit_code_of)
    return debug_proxy.mark_paused(rows)  # busy, but in JupyterLab's debugger


def dead_text(dead: dict[int, str]) -> str:
    return "; ".join(f"rank {r} died ({why})" for r, why in sorted(dead.items()))


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
