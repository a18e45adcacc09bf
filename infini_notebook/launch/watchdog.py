"""Ends a session's processes when its kernel dies, even by SIGKILL.

Started by the session before anything else, as
``python -m infini_notebook.launch.watchdog KERNEL_PID:START PROFILE_DIR SINCE``. ipyparallel
launches every process of the session (controller, engines, their nannies) with
``IPP_PROFILE_DIR=PROFILE_DIR``, a folder that belongs to this session alone: when the kernel
is gone, the watchdog ends the processes that carry that mark and started after ``SINCE``,
and nothing else. So it covers processes that appear while the session is still starting,
and those a hard restart brings up, without being told about each. Then it removes the
session's folder, the folders it noted elsewhere (``record_elsewhere``: a Slurm job's log)
and its folder in /dev/shm (``/dev/shm/<folder's name>-*``).

A kept session (``--keep``, see launch/keep.py) writes a lease in its folder
(``lease.json``): the kernel that drives it now and how long to wait once none does. The
watchdog then follows the lease instead of its first kernel: it writes when the session
lost its driver (``detached``), and ends everything once nobody attached within the keep
time, or at once when the lease says ``end``. It reads only files and process tables, so
it works while the controller or the store hang.
"""

from __future__ import annotations

import os
import signal
import stat
import sys
import time

import psutil

from ..core.keep import FOLDER_PREFIX  # a session's folder's prefix (re-exported)

POLL_S = 0.5
GRACE_S = 3.0
MARK = "IPP_PROFILE_DIR"
# A kernel that wrote the lease (%dist_stop NAME, %dist_detach) wakes the watchdog with it to
# read it at once, not at its next poll. Ignored by default: one sent before the watchdog
# blocks it (to wait for it) ends nothing.
WAKE = signal.SIGURG


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


def session_processes(profile_dir: str, since: float = 0.0) -> list[psutil.Process]:
    """Live processes marked with this session's profile folder, started after ``since``."""
    found = []
    me = os.geteuid()
    for proc in psutil.process_iter(["create_time", "uids"]):
        try:
            if (proc.info["create_time"] or 0) < since - 1.0:
                continue
            if proc.info["uids"] is None or proc.info["uids"].real != me:
                continue  # another user's: never ours, whatever its environment says
            if proc.environ().get(MARK) == profile_dir and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:  # gone, or another user's
            pass
    return found


def end_all(procs: list[psutil.Process], grace: float = GRACE_S) -> None:
    """SIGTERM, then SIGKILL what is left after ``grace`` seconds. psutil refuses to signal
    a pid that was reused since the Process object was made."""
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    alive = wait_gone(procs, grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    wait_gone(alive, GRACE_S)


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until each of ``procs`` has exited; those still running after ``timeout``. One
    that exited counts at once, whoever reaps it: a kept session's store host, template and
    watchdog are children of the kernel that started it, which may live on without reaping
    them (psutil's ``wait_procs`` waited out its whole timeout for each such zombie: 5 s of
    a 6 s stop), or of a PID 1 that never reaps. Woken by each one's pidfd (readable once
    it exits), not a poll; the children of this process among them are reaped."""
    import select

    deadline = time.monotonic() + timeout
    watched: dict[int, psutil.Process] = {}  # pidfd -> its process
    polled: list[psutil.Process] = []  # no pidfd here (an old kernel): asked every 10 ms
    for proc in procs:
        try:
            fd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # gone already (ESRCH), or no pidfds here
            fd = None
        # After the open: a pidfd names the process that had the pid then, and psutil
        # checks the start time, so a pid reused meanwhile is never waited for.
        if not _running(proc):
            if fd is not None:
                os.close(fd)
            _reap(proc)
        elif fd is None:
            polled.append(proc)
        else:
            watched[fd] = proc
    poller = select.poll()
    for fd in watched:
        poller.register(fd, select.POLLIN)
    try:
        while watched or polled:
            left = deadline - time.monotonic()
            wait = min(left, 0.01) if polled else left
            for fd, _ in poller.poll(max(0, int(wait * 1000))):
                poller.unregister(fd)
                os.close(fd)
                _reap(watched.pop(fd))
            polled = [p for p in polled if _running(p) or _reap(p)]
            if left <= 0:
                break
    finally:
        for fd in watched:
            os.close(fd)
    return list(watched.values()) + polled


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _reap(proc: psutil.Process) -> bool:
    """Collect the exit status of an ended child of ours (nothing for another's). False."""
    try:
        proc.wait(0)
    except (psutil.Error, psutil.TimeoutExpired):
        pass
    return False


ELSEWHERE = "elsewhere"  # in the session's folder: its folders outside it, a path per line


def record_elsewhere(folder: str, path: str) -> None:
    """Note a folder of the session's outside its own folder (a Slurm job's log, in the
    notebook's folder), to be removed with it."""
    with open(os.path.join(folder, ELSEWHERE), "a") as f:
        f.write(path + "\n")


def remove_session_folder(path: str) -> None:
    """The session's own folder and those it noted elsewhere, nothing else: each must be
    named as a session's (the ones elsewhere may start with a dot), and those elsewhere be
    folders of this user's, not links."""
    import shutil

    if not os.path.basename(os.path.normpath(path)).startswith(FOLDER_PREFIX):
        return
    try:
        with open(os.path.join(path, ELSEWHERE)) as f:
            elsewhere = f.read().splitlines()
    except OSError:
        elsewhere = []
    for other in elsewhere:
        if os.path.basename(other).lstrip(".").startswith(FOLDER_PREFIX) and _own_folder(other):
            shutil.rmtree(other, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)


def _own_folder(path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def remove_shared_files(folder: str) -> None:
    """The session's folders in /dev/shm (see shm_transport), named after its folder, which
    must be named as a session's."""
    from ..engine.shm_transport import remove_session_dirs

    if os.path.basename(os.path.normpath(folder)).startswith(FOLDER_PREFIX):
        remove_session_dirs(folder)


LEASE = "lease.json"  # a kept session's lease, in its folder (see launch/keep.py)
DETACHED = "detached"  # written by the watchdog: since when no kernel drives it


def read_json(path: str) -> dict | None:
    """The JSON object in our own file ``path``; None for none, or one that is not ours to
    read (a link, a FIFO, a device, another user's: see own_files.read)."""
    import json

    from ..engine.own_files import read

    try:
        data = json.loads(read(path, 1 << 20))
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def wait_for_the_end(kernel: tuple[int, float], folder: str) -> None:
    """Until the kernel is gone, or for a kept session until its lease says it ends."""
    from ..core.keep import lease_verdict

    detached_since: float | None = None
    told: float | None | bool = False  # what the DETACHED file says (False: not written yet)
    while True:
        lease = read_json(os.path.join(folder, LEASE))
        if lease is None:  # an ordinary session: it ends with its kernel
            if not same_process(*kernel):
                return
        else:
            holder = lease.get("holder")
            alive = bool(holder) and same_process(int(holder[0]), float(holder[1])) is not None
            if alive:
                detached_since = None
            elif detached_since is None:
                detached_since = time.time()
            if told != detached_since:
                told = detached_since
                _write_detached(folder, detached_since)
            if lease_verdict(lease, alive, detached_since, time.time()) == "end":
                return
        _nap(POLL_S)


def _nap(seconds: float) -> None:
    """Sleep ``seconds``, less when woken (WAKE, blocked by main to be waited for here)."""
    if WAKE in signal.pthread_sigmask(signal.SIG_BLOCK, []):
        signal.sigtimedwait([WAKE], seconds)
    else:
        time.sleep(seconds)


def wake(watchdog: psutil.Process) -> None:
    """Have a session's watchdog read its lease now (see WAKE). psutil refuses a pid that
    was reused since the Process object was made."""
    try:
        watchdog.send_signal(WAKE)
    except psutil.Error:
        pass


def _write_detached(folder: str, since: float | None) -> None:
    path = os.path.join(folder, DETACHED)
    try:
        if since is None:
            os.remove(path)
        else:
            from ..engine.own_files import write_text

            write_text(folder, DETACHED, repr(since))  # 0600, never through a link
    except OSError:
        pass


def main(argv: list[str]) -> int:
    signal.pthread_sigmask(signal.SIG_BLOCK, [WAKE])  # waited for in _nap
    kernel, profile_dir, since = parse(argv[0]), argv[1], float(argv[2])
    wait_for_the_end(kernel, os.path.dirname(profile_dir))
    # Twice: a launcher caught halfway may still start a process as the first round ends.
    for _ in range(2):
        end_all(session_processes(profile_dir, since))
    folder = os.path.dirname(profile_dir)
    name = (read_json(os.path.join(folder, LEASE)) or {}).get("name")
    remove_session_folder(folder)  # the kernel cannot any more
    remove_shared_files(folder)
    if name:  # a kept session's entry in the private place (see private_place.py)
        from .private_place import unregister

        try:
            unregister(str(name), folder)
        except Exception:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
