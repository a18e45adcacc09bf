"""Ends a session's processes when its kernel dies, even by SIGKILL.

Started by the session as ``python -m infini_notebook.watchdog KERNEL PROC...`` where each
argument is ``pid:start_time``. It only ever signals those processes, and only while their
start time still matches (a recycled pid is left alone). It exits by itself once the kernel
and every watched process are gone.
"""

from __future__ import annotations

import sys
import time

import psutil

POLL_S = 0.5
GRACE_S = 3.0


def same_process(pid: int, start: float) -> psutil.Process | None:
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - start) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    except psutil.Error:
        pass
    return None


def parse(arg: str) -> tuple[int, float]:
    pid, start = arg.split(":")
    return int(pid), float(start)


def end_all(watched: list[tuple[int, float]]) -> None:
    procs = [p for p in (same_process(pid, start) for pid, start in watched) if p]
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=GRACE_S)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass


def main(argv: list[str]) -> int:
    kernel, watched = parse(argv[0]), [parse(a) for a in argv[1:]]
    while same_process(*kernel):
        if not any(same_process(*w) for w in watched):
            return 0  # the session stopped normally
        time.sleep(POLL_S)
    end_all(watched)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
