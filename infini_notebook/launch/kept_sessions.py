"""The user's kept sessions on this machine, by name: finding them (``find``,
``kept_sessions``), claiming and giving back a name for a start, ending one without
attaching (``stop``), and the rows of %dist_sessions. Their life while a kernel drives one is
:class:`launch.keep.Keeper`'s (see launch/keep.py for what a kept session is).

Every file of a session folder is read through ``own_files.read`` (no link followed, no
FIFO waited on, owner, mode and size checked on the open file), and the folders are reached
through this user's private place, never by globbing a folder others can write."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

import psutil

from ..core.errors import DistUsageError
from ..core.keep import check_name, format_duration, lease_verdict
from ..core.plan import plan_from_json
from ..engine import own_files
from . import private_place
from .watchdog import (
    DETACHED,
    LEASE,
    end_all,
    read_json,
    remove_session_folder,
    remove_shared_files,
    same_process,
    session_processes,
    wait_gone,
    wake,
)

CONNECTION = "keep.json"
RANKS = "ranks.json"
JSON_CAP = 1 << 20  # keep.json, lease.json, ranks.json: a few hundred bytes each


@dataclass
class Kept:
    """One kept session's connection data, as an attaching kernel reads it. Doubles as a
    ``warmed`` for SessionFolder and Engines (the folder, its watchdog, the template)."""

    name: str
    workdir: str
    created: float
    keep_s: float
    data: dict  # keep.json
    plan: Any  # the SessionPlan
    watchdog: psutil.Process
    template: psutil.Process | None

    @property
    def store(self) -> tuple[str, int]:
        return self.data["store_host"], int(self.data["store_port"])

    def ranks(self) -> dict:
        """The rank -> engine map Engines wrote (``eids``, ``set_id``, ``how``)."""
        return read_json(os.path.join(self.workdir, RANKS)) or {}


def write_private(path: str, body: bytes) -> None:
    """Write ``path`` 0600, whole or not at all (a reader never sees half of it), through a
    new temporary file (O_EXCL|O_NOFOLLOW): a link planted at any name is never written
    through."""
    own_files.write_bytes(os.path.dirname(path), os.path.basename(path), body)


def _read_json(name: str, dir_fd: int) -> dict:
    data = json.loads(own_files.read(name, JSON_CAP, dir_fd=dir_fd))
    if not isinstance(data, dict):
        raise ValueError(f"{name} holds no object")
    return data


def _load(name: str, entry: dict) -> Kept | str:
    """The kept session entered as ``name``, or why it cannot be attached (one line; a line
    starting with "stale" when its processes are gone or it is ending)."""
    if not entry:
        return "no entry"
    if "folder" not in entry:
        pid = private_place.claimed_by_live(entry)
        return f"kernel pid {pid} is starting it" if pid else "stale (a start that never ended)"
    try:
        workdir, fd = private_place.open_entry(entry)
    except FileNotFoundError:
        return "stale (its folder is gone)"
    except OSError as e:
        return f"{e}"
    try:
        data = _read_json(CONNECTION, fd)
        plan = plan_from_json(data["plan"])
        watchdog = same_process(*data["watchdog"])
        if watchdog is None:
            return "stale (its processes are gone, after a reboot or a kill)"
        try:
            lease = _read_json(LEASE, fd)
        except FileNotFoundError:
            lease = {}
        if _ending(lease, fd):
            return "stale (it is ending)"
        try:
            ranks = _read_json(RANKS, fd)
        except FileNotFoundError:
            ranks = {}
    except own_files.NotOurs as e:
        return str(e)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its connection data is unreadable ({type(e).__name__}: {e})"
    finally:
        os.close(fd)
    template = same_process(*ranks["template"]) if ranks.get("template") else None
    return Kept(
        data["name"], workdir, float(data["created"]), float(data["keep_s"]), data, plan,
        watchdog, template,
    )  # fmt: skip


def _ending(lease: dict, fd: int) -> bool:
    """Whether the session is on its way out: told to end, or detached past its keep time."""
    if lease.get("end"):
        return True
    holder = lease.get("holder")
    if holder and same_process(int(holder[0]), float(holder[1])) is not None:
        return False
    since = _detached_since(DETACHED, fd)
    return since is not None and lease_verdict(lease, False, since, time.time()) == "end"


def _detached_since(path: str, dir_fd: int | None = None) -> float | None:
    """When the watchdog saw the session lose its driver (None: it did not write it yet)."""
    try:
        return float(own_files.read(path, 64, dir_fd=dir_fd))
    except (OSError, ValueError):
        return None


def kept_sessions() -> dict[str, Kept]:
    """This user's live kept sessions on this machine, by name. Entries of sessions whose
    processes are gone (a reboot, a killed watchdog) are removed as they are found."""
    found = {}
    for name in private_place.names():
        entry = private_place.read_entry(name)
        kept = _load(name, entry)
        if isinstance(kept, Kept):
            found[name] = kept
        elif kept.startswith("stale"):
            remove_stale(name, entry)
    return found


def remove_stale(name: str, entry: dict) -> None:
    """What the watchdog of a session whose watchdog is gone would have done: end the
    processes it left (its watchdog was killed: the controller and the template do not
    watch it; after a reboot there are none), remove the folder and its /dev/shm folder,
    and the entry. A session still ending (its watchdog alive) is left to its watchdog."""
    if "folder" not in entry:  # a claim whose kernel died before the start ended
        if private_place.claimed_by_live(entry) is None:
            _drop(name, entry)
        return
    try:
        workdir, fd = private_place.open_entry(entry)
    except FileNotFoundError:
        _drop(name, entry)
        return
    except OSError:
        return  # not ours to touch
    try:
        data = _read_json(CONNECTION, fd)
        if same_process(*data["watchdog"]) is not None:
            return  # still ending: its watchdog cleans up
        created = float(data["created"])
    except (OSError, ValueError, KeyError, TypeError):
        created = os.fstat(fd).st_mtime  # no process of it is older than its folder
    finally:
        os.close(fd)
    for _ in range(2):  # a template caught halfway may still fork
        end_all(session_processes(os.path.join(workdir, "profile"), created))
    remove_session_folder(workdir)
    remove_shared_files(workdir)
    _drop(name, entry)


def _drop(name: str, entry: dict) -> None:
    """Remove the entry ``name`` if it is still ``entry``."""
    if private_place.read_entry(name) == entry:
        private_place.remove_entry(name)


def find(name: str) -> Kept:
    """The kept session ``name``; DistUsageError naming what exists otherwise."""
    entry = private_place.read_entry(check_name(name))  # a file name in kept/, nothing else
    kept = _load(name, entry)
    if isinstance(kept, Kept):
        return kept
    if kept.startswith("stale"):
        remove_stale(name, entry)
        raise DistUsageError(f"Cannot attach session {name!r}: {kept}; its entry is removed.")
    if kept != "no entry":
        raise DistUsageError(f"Cannot attach session {name!r}: {kept}.")
    names = sorted(kept_sessions())
    known = f"Kept sessions: {', '.join(names)}." if names else "No session is kept."
    raise DistUsageError(f"No kept session is named {name!r}. {known} See %dist_sessions.")


def claim_name(name: str) -> None:
    """Claim ``name`` for a session this kernel starts (atomically: two kernels starting
    the same name at once, one wins); DistUsageError, one line, when it is taken."""

    def taken(entry: dict) -> str | None:
        kept = _load(name, entry)
        if isinstance(kept, Kept):
            return (
                f"A kept session named {name!r} runs already. Attach it with %dist_attach "
                f"{name}, end it with %dist_stop {name}, or pick another --name."
            )
        starter = private_place.claimed_by_live(entry)
        if starter is not None:
            return (
                f"A kept session named {name!r} is being started by kernel pid {starter}: "
                "attach it once it runs (%dist_attach), or pick another --name."
            )
        if kept.startswith("stale") or kept == "no entry":
            remove_stale(name, entry)
            return None
        return (
            f"The name {name!r} is entered for a folder that cannot be used ({kept}): "
            f"pick another --name, or end it with %dist_stop {name}."
        )

    private_place.claim(name, taken)


def release_name(name: str) -> None:
    """Give back a name this kernel claimed for a start that failed."""
    private_place.unregister(name, None)


def stop(name: str, timeout: float = 30.0) -> None:
    """End a kept session without attaching, as the kernel that drives it would: its lease
    says ``end`` first (a kernel that drives it sees it stopped and lets it go, its watchdog
    that it ends), then every process of it gets SIGKILL from here, the store host last (a
    kernel that drives it may be asking it this very moment); its watchdog, woken, finds
    nothing left, removes the folder and the entry, and exits. Waits for that by its exit
    (pidfd), not by polls: 5-6 s at 4 ranks, when the watchdog ended everything on its own
    poll, with SIGTERM and a grace."""
    kept = find(name)
    lease = read_json(os.path.join(kept.workdir, LEASE)) or {}
    ended = dict(lease, end=True, ended=time.time())
    write_private(os.path.join(kept.workdir, LEASE), json.dumps(ended).encode())
    end_processes(os.path.join(kept.workdir, "profile"), kept.created)
    wake(kept.watchdog)
    if wait_gone([kept.watchdog], timeout):
        raise DistUsageError(
            f"Session {name!r} did not end within {timeout:.0f}s; its watchdog is pid "
            f"{kept.watchdog.pid}."
        )


def end_processes(profile_dir: str, created: float) -> None:
    """SIGKILL every process of the session marked ``profile_dir`` (engines, nannies,
    controller, template) at once and wait for their exits, then its store host: ranks
    that lost the store before they died would print c10d's warnings for nothing."""
    procs = session_processes(profile_dir, created)
    store = [p for p in procs if _is_store_host(p)]
    end_all([p for p in procs if p not in store], grace=0)
    end_all(store, grace=0)


def _is_store_host(proc: psutil.Process) -> bool:
    try:
        return "infini_notebook.launch.store_host" in proc.cmdline()
    except psutil.Error:
        return False


def describe(kept: Kept, now: float | None = None) -> dict:
    """One row of %dist_sessions."""
    from ..viz.render import format_bytes

    now = time.time() if now is None else now
    lease = read_json(os.path.join(kept.workdir, LEASE)) or {}
    holder = lease.get("holder")
    if holder and same_process(int(holder[0]), float(holder[1])) is not None:
        driver = f"kernel pid {holder[0]}"
    else:
        since = _detached_since(os.path.join(kept.workdir, DETACHED)) or now
        driver = f"detached, ends in {format_duration(since + kept.keep_s - now)}"
    plan = kept.plan
    gpus = f"{plan.backend}, GPUs {','.join(plan.gpus)}" if plan.gpus else plan.backend
    procs = session_processes(os.path.join(kept.workdir, "profile"), kept.created)
    used = 0  # PSS: forked spares share most pages with the template (RSS counted them 5x)
    for p in procs:
        try:
            used += _pss(p)
        except psutil.Error:
            pass
    started = kept.data.get("started", kept.created)
    return {
        "name": kept.name,
        "ranks": plan.world_size,
        "backend": gpus,
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "driver": driver,
        "memory": format_bytes(used),
    }


def _pss(proc: psutil.Process) -> int:
    """The process's proportional share of the memory it maps (Linux); RSS elsewhere."""
    try:
        return proc.memory_full_info().pss
    except (AttributeError, psutil.AccessDenied):
        return proc.memory_info().rss
