"""Watching the ranks: signals, stacks (asked through the store), which ranks are alive,
stuck or dead and why (exit codes), the status snapshot (with each rank's telemetry), the
watchdog, and killing the engines we started. Plain functions taking the Session."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable

import psutil

from ..core.ranks import parse_ranks
from ..core.state import RankState
from ..engine import rank_services


def start_watchdog(s) -> None:
    """A small process that ends ours if this kernel dies, even by SIGKILL. Started
    before anything else, so a kernel killed while engines come up leaves nothing."""
    if s._watchdog is not None and s._watchdog.poll() is None:
        return  # a hard restart keeps the session's watchdog (an adopted one too: prewarm)
    s._watchdog = spawn_watchdog(s._profile_dir, s._created)


def spawn_watchdog(profile_dir: str, since: float):
    """``python -m infini_notebook.launch.watchdog`` for the processes marked ``profile_dir``
    started after ``since`` (see watchdog.py); its Popen."""
    import subprocess

    kernel = psutil.Process()
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "infini_notebook.launch.watchdog",
            f"{kernel.pid}:{kernel.create_time()}",
            profile_dir,
            repr(since),
        ],
        start_new_session=True,  # a Ctrl-C meant for the kernel must not end it
        stdin=subprocess.DEVNULL,
    )


def end_watchdog(s) -> None:
    if s._watchdog is not None:
        stop_watchdog(s._watchdog)
    s._watchdog = None


def stop_watchdog(watchdog) -> None:
    """End a watchdog (its Popen) that is no longer needed."""
    if watchdog.poll() is None:
        watchdog.terminate()
        watchdog.wait(5)


def still_stuck(s) -> set[int]:
    """Ranks that ignored an interrupt, until their engine's queue drains."""
    with s._lock:
        if not s._stuck:
            return set()
    try:
        running = set(stuck_ranks(s))
    except Exception:
        return set(s._stuck)
    with s._lock:
        s._stuck &= running
        return set(s._stuck)


def stuck_ranks(s) -> list[int]:
    """Ranks whose engine still has work queued or running."""
    from ..launch.processes import queue_status

    status = queue_status(s)
    return [r for r in range(s.world_size) if status.get(s.engines.eids[r], {}).get("queue", 0) > 0]


def stacks(s, ranks: str | list[int] | None = None, wait: float = 2.0) -> dict[int, str]:
    """Every thread's Python stack on each rank (the cell's thread as 'Current thread').
    Asked and answered through the TCPStore, which a thread on each engine watches, so a
    rank busy in a cell or stuck in a collective answers, on this host or another."""
    targets = parse_ranks(ranks, s.world_size)
    out = ask(s, targets, "", wait)
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

    return {r: json.loads(text) for r, text in ask(s, ranks, "wait", wait).items()}


def ask(s, ranks: list[int], question: str | dict[int, str], wait: float) -> dict[int, str]:
    """Ask each rank's answering thread (rank_services) through the store (one question
    for all, or one per rank); the answers that came within ``wait`` seconds. Later ones
    are deleted at the next question."""
    from datetime import timedelta

    store = s._keys
    with s._ask_lock:  # a running cell asks while %dist_stacks may ask beside it
        for key in s._late_stacks:  # answers that came after we stopped waiting
            store.delete_key(key)
        s._late_stacks = []
        answers = {}
        for r in ranks:
            n = store.add(rank_services.stack_key(r, "count"), 1)
            asked = question[r] if isinstance(question, dict) else question
            store.set(rank_services.stack_key(r, "ask", n), asked)
            answers[r] = rank_services.stack_key(r, "answer", n)
        try:
            store.wait(list(answers.values()), timedelta(seconds=wait))
        except Exception:  # a rank did not answer in time; the others did
            pass
        out: dict[int, str] = {}
        for r, key in answers.items():
            if store.check([key]):
                out[r] = store.get(key).decode(errors="replace")
                store.delete_key(key)
            else:
                s._late_stacks.append(key)
    return out


def stack_file(s, rank: int) -> str | None:
    """Where a rank on this host dumps its stacks on STACK_SIGNAL (None: on another host)."""
    if s.plan.placement.multi_host:
        return None
    return os.path.join(s._workdir, f"stacks-{rank}.txt")


def signal_stacks(s, ranks: list[int], wait: float) -> dict[int, str]:
    """Stacks of this host's ranks whose answering thread is held off by native code
    holding the GIL: faulthandler dumps them from its signal handler into a file (see
    rank_services.install_signal_dump). Only to ranks that installed the handler: the
    signal's default would end the process."""
    paths = {
        r: stack_file(s, r) for r in ranks if r in s.engines.pids and _alive(s.engines.pids[r])
    }
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


def kill_engines(s) -> list[psutil.Process]:
    """SIGKILL every local engine at once; returns them to wait for (their nannies exit
    when they do). ipyparallel stops engines one after another with SIGTERM, and each
    then spends about a second of CPU finalizing torch for nothing (it exits with status
    1 anyway): stop took 11.6 s at 16 ranks. Only the pids we recorded, checked by start
    time (a recycled pid is safe)."""
    procs = list(s.engines.pids.values())
    kill(procs)
    return procs


def kill(procs: list[psutil.Process]) -> None:
    """SIGKILL each (psutil refuses a pid reused since its Process was made)."""
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass


def kill_leftovers(s) -> None:
    """Processes the launcher could not stop (an engine, the controller after a failed
    stop): the engines we recorded (psutil checks their start time, so a recycled pid is
    never touched) and whatever else carries this session's mark."""
    from ..launch.watchdog import end_all, session_processes

    procs = {p.pid: p for p in s.engines.pids.values()}
    procs.update({p.pid: p for p in session_processes(s._profile_dir, s._created)})
    end_all(list(procs.values()), grace=0)


def dead_ranks(s, targets) -> dict[int, str]:
    alive = liveness(s)
    dead = {}
    for r in targets:
        if alive(r):
            continue
        proc = s.engines.pids.get(r)
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
        proc = s.engines.pids.get(r)
        if proc is not None:
            return _alive(proc)
        if registered is None:
            with s.engines.lock:
                client = s.engines.client
                registered = set(client.ids) if client is not None else set()
        return bool(s.engines.eids) and s.engines.eids[r] in registered

    return alive


def exit_code(s, proc: psutil.Process) -> int | None:
    """The engine's exit status as its ipyparallel launcher recorded it (the launcher
    reaps the child, so only it can know). Negative: killed by that signal."""
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        for engine_set in (s.engines.cluster.engines if s.engines.cluster else {}).values():
            for data in (engine_set.stop_data or {}).get("engines", {}).values():
                if data.get("pid") == proc.pid:
                    return data.get("exit_code")
        time.sleep(0.05)
    return None


def send_signal(s, signum: int, ranks: list[int] | None = None) -> None:
    """Send ``signum`` to the engines of ``ranks`` (pids this session started)."""
    remote = []
    for r in ranks if ranks is not None else range(s.world_size):
        proc = s.engines.pids.get(r)
        if proc is None:
            remote.append(s.engines.eids[r])
            continue
        try:
            if proc.is_running():
                proc.send_signal(signum)
        except psutil.Error:
            pass
    with s.engines.lock:
        if remote and s.engines.client is not None:  # through each engine's nanny
            s.engines.client.send_signal(signum, targets=remote, block=False)


def status(s) -> list[RankState]:
    """Each rank's pid, device and state (idle, busy, error, dead)."""
    with s._lock:
        busy = set(s._busy)
    stuck = still_stuck(s)
    alive = liveness(s)
    telemetry = read_telemetry(s)
    for rs in s.ranks:
        for name, value in telemetry.get(rs.rank, {}).items():
            setattr(rs, name, value)
        proc = s.engines.pids.get(rs.rank)
        if not s.running:
            rs.state = "stopped"
        elif not alive(rs.rank):
            if rs.state != "dead" and proc is not None:  # look the exit code up once
                rs.exit_code = exit_code(s, proc)
            rs.state = "dead"
        elif rs.rank in stuck:
            rs.state = "stuck"
        elif rs.rank in busy:
            rs.state = "busy"
        elif rs.rank in s._errored:
            rs.state = "error"
        else:
            rs.state = "idle"
    return list(s.ranks)


def read_telemetry(s) -> dict[int, dict]:
    """The latest snapshot each rank's telemetry thread put in the store (engine.py)."""
    store = s._keys
    if store is None or not s.running:
        return {}
    out = {}
    try:
        for rs in s.ranks:
            key = rank_services.telemetry_key(rs.rank)
            if store.check([key]):  # get would wait for a rank that has not reported yet
                out[rs.rank] = rank_services.parse_telemetry(store.get(key))
    except Exception:  # the store is closing with the session: show what we have
        pass
    return out


def dead_text(dead: dict[int, str]) -> str:
    return "; ".join(f"rank {r} died ({why})" for r, why in sorted(dead.items()))


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def exit_description(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
