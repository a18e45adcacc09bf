"""This user's private place on this machine: the one folder where session folders are made
and kept sessions are entered by name. Nothing of a session is ever found by globbing a
folder others can write (``/tmp``, or a world-writable TMPDIR without the sticky bit, where
another user can rename our folder away and put a link or a folder of theirs in its place).

    $INFINI_NOTEBOOK_DIR, else $XDG_STATE_HOME (~/.local/state)/infini-notebook/<host>
        infini-notebook-XXXXXXXX/     a session's folder (mkdtemp: 0700)
        kept/NAME                     a kept session's entry: its folder's name and identity

The place is 0700 and this user's, and no folder above it may be written by others (unless
sticky): checked on every use, the place itself on its open fd. A state folder, not
$XDG_RUNTIME_DIR: systemd removes that one at the user's last logout, and a kept session
outlives logins. ``<host>`` keeps the sessions of machines sharing an NFS home apart.

A name is claimed atomically (``O_EXCL``) before a kept session starts, and given back if
the start fails; the entry then records the folder's device, inode and owner, and a kernel
attaching by name opens the folder and uses it only if it is still that one
(``own_files.open_folder``). The entries' only writer is :mod:`launch.keep` (through the
functions here), and the watchdog that removes a session removes its entry.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import tempfile

import psutil

from ..core.errors import DistUsageError
from ..core.keep import FOLDER_PREFIX
from ..engine import own_files

ENV = "INFINI_NOTEBOOK_DIR"  # a folder of the user's choosing instead (a long home path)
KEPT = "kept"
ENTRY_CAP = 4096
# A session folder's sockets (the template's) must fit AF_UNIX's 108 bytes:
# <place>/infini-notebook-XXXXXXXX/template.sock
MAX_PLACE = 107 - len(f"/{FOLDER_PREFIX}XXXXXXXX/template.sock")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:32] or "host"


def _candidates() -> list[str]:
    if os.environ.get(ENV):
        return [os.path.abspath(os.environ[ENV])]
    home = os.path.expanduser("~")
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(home, ".local", "state")
    found = [os.path.join(state, "infini-notebook", _host())]
    if os.environ.get("XDG_RUNTIME_DIR"):  # a shorter path, when the state one is too long
        found.append(os.path.join(os.environ["XDG_RUNTIME_DIR"], "infini-notebook"))
    return found


def place() -> str:
    """The private place's path, made (0700) if missing and checked; DistUsageError in one
    line, naming the fix, when no candidate can serve."""
    problems = []
    for path in _candidates():
        path = os.path.realpath(path)
        if len(path) > MAX_PLACE:
            problems.append(f"{path} is too long for a socket path ({len(path)} > {MAX_PLACE})")
            continue
        problem = _make(path)
        if problem is None:
            return path
        problems.append(problem)
    raise DistUsageError(
        f"No private folder for sessions: {'; '.join(problems)}. Set {ENV} to a short "
        "folder of your own (mode 700) that nobody else can write above."
    )


def _make(path: str) -> str | None:
    """Make ``path`` (0700) if missing; why it cannot serve, or None."""
    problem = own_files.untrusted_ancestor(os.path.dirname(path))
    if problem:
        return problem
    try:
        # each missing folder made 0700 (not with the umask's mode), then the whole way
        # checked again: a folder above could have been made by someone else meanwhile
        missing = []
        step = os.path.dirname(path)
        while not os.path.lexists(step):
            missing.append(step)
            step = os.path.dirname(step)
        for folder in reversed(missing):
            try:
                os.mkdir(folder, 0o700)
            except FileExistsError:
                pass
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        problem = own_files.untrusted_ancestor(os.path.dirname(path))
        if problem:
            return problem
        os.close(own_files.open_folder(path))
    except own_files.NotOurs as e:
        return str(e)
    except OSError as e:
        return f"{path}: {e.strerror}"
    return None


def new_session_folder() -> str:
    """A new session folder in the private place (mkdtemp: 0700, a random name)."""
    return tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=place())


# ----- kept sessions' entries -----------------------------------------------------------------
def _kept_fd() -> int:
    base = place()
    try:
        os.mkdir(os.path.join(base, KEPT), 0o700)
    except FileExistsError:
        pass
    return own_files.open_folder(os.path.join(base, KEPT))


def _me() -> list:
    proc = psutil.Process()
    return [proc.pid, proc.create_time()]


def claim(name: str, taken) -> None:
    """Claim ``name`` for a kept session this kernel starts, atomically: a whole entry is
    linked into place, which fails if the name is entered. An entry already there is asked
    about: ``taken(entry)`` returns the line that refuses the name (a live session, a live
    kernel starting one), or None when the entry is stale (then it is replaced). Claims are
    made one at a time (a lock on the entries' folder), so two kernels that both find an
    entry stale cannot both replace it."""
    import fcntl

    fd = _kept_fd()
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd closes
        tmp = f".claim-{secrets.token_hex(8)}"
        entry_fd = os.open(tmp, own_files.TMP_FLAGS, 0o600, dir_fd=fd)
        with os.fdopen(entry_fd, "wb") as f:
            f.write(json.dumps({"claimed_by": _me()}).encode())
        try:
            try:
                os.link(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
                return
            except FileExistsError:
                pass
            problem = taken(read_entry(name))
            if problem:
                raise DistUsageError(problem)
            os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        finally:
            _unlink(tmp, fd)
    finally:
        os.close(fd)


def register(name: str, folder: str) -> None:
    """The entry of a kept session that started: its folder's name and identity."""
    st = os.lstat(folder)
    entry = {"folder": os.path.basename(folder), "dev": st.st_dev, "ino": st.st_ino,
             "uid": st.st_uid}  # fmt: skip
    os.close(_kept_fd())  # made if missing
    own_files.write_bytes(os.path.join(place(), KEPT), name, json.dumps(entry).encode())


def read_entry(name: str) -> dict:
    """The entry of ``name`` ({} when there is none or it cannot be read)."""
    fd = _kept_fd()
    try:
        data = json.loads(own_files.read(name, ENTRY_CAP, dir_fd=fd))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)


def names() -> list[str]:
    """The names entered (kept sessions, and names being claimed)."""
    fd = _kept_fd()
    try:
        return sorted(n for n in os.listdir(fd) if not n.startswith("."))
    finally:
        os.close(fd)


def open_entry(entry: dict) -> tuple[str, int]:
    """(path, directory fd) of the session folder an entry names, if it is still the folder
    that was entered (not a link; this user's, 0700, same device and inode): NotOurs else."""
    folder = str(entry.get("folder", ""))
    if not folder.startswith(FOLDER_PREFIX) or "/" in folder:
        raise own_files.NotOurs(f"the entry names {folder!r}, not a session folder: refused")
    path = os.path.join(place(), folder)
    return path, own_files.open_folder(path, (entry.get("dev"), entry.get("ino")))


def claimed_by_live(entry: dict) -> int | None:
    """The pid of the live kernel that claimed the name and is starting it, if any (as
    watchdog.same_process checks one, which this module cannot import: the watchdog
    imports it to remove an entry)."""
    claimer = entry.get("claimed_by")
    if not claimer:
        return None
    try:
        proc = psutil.Process(int(claimer[0]))
        return proc.pid if abs(proc.create_time() - float(claimer[1])) < 1.0 else None
    except (psutil.Error, TypeError, ValueError, IndexError):
        return None


def unregister(name: str, folder: str | None = None) -> None:
    """Remove the entry of ``name`` if it is this kernel's claim, or (``folder``) names that
    folder: never an entry another kernel has made since."""
    entry = read_entry(name)
    ours = entry.get("claimed_by") == _me() if "claimed_by" in entry else False
    if ours or (folder is not None and entry.get("folder") == os.path.basename(folder)):
        try:
            remove_entry(name)
        except (OSError, DistUsageError):
            pass


def remove_entry(name: str) -> None:
    """Remove the entry ``name`` (the caller checked it is the one to remove)."""
    fd = _kept_fd()
    try:
        _unlink(name, fd)
    finally:
        os.close(fd)


def _unlink(name: str, fd: int) -> None:
    try:
        os.unlink(name, dir_fd=fd)
    except FileNotFoundError:
        pass
