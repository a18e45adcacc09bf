"""A kept session's life (``%dist_start --name NAME --keep 30m``): what lets its processes
outlive the kernel, and a new kernel of the same user take it over.

- The store is hosted by a process of its own (``store_host.py``), not by the kernel: the
  ranks' process groups, and every service they reach through it (stacks, stdin questions,
  telemetry, release and abort answers), keep working with no kernel attached.
- The watchdog (``watchdog.py``) follows the session's **lease** (``lease.json``: which
  kernel drives it, how long to wait once none does) instead of the kernel that started it,
  and ends every process, the folder and the shared-memory files when nobody attached in
  time. The ranks and the store host watch the watchdog, not the kernel.
- The **connection data** (``keep.json``, 0600 in the 0700 folder, JSON: never a pickle) is
  what an attaching kernel reads: the name, the plan, the store's address, the key root and
  the session's signing key (never written into the store), the controller's cluster id.
- Kept sessions are **entered by name** in this user's private place (private_place.py),
  with their folder's identity; a name is claimed (O_EXCL) before the start. Nothing is
  found by globbing a folder others can write, and every file of a session folder is read
  through ``own_files.read`` (no link followed, no FIFO waited on, owner, mode and size
  checked on the open file).

:class:`Keeper` is the only writer of the lease and the connection data; Engines writes the
rank -> engine map (``ranks.json``) it keeps up to date across hard restarts. Every process
of a kept session is started in a session of its own (setsid), so Jupyter's restart and
kill, which signal the kernel's whole process group, reach none of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import psutil

from ..core.errors import DistUsageError
from ..core.keep import check_name, format_duration, lease_verdict
from ..core.plan import plan_from_json, plan_to_json
from ..engine import own_files
from . import private_place
from .watchdog import (
    DETACHED,
    LEASE,
    MARK,
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
HISTORY = "history.jsonl"  # the cells every driving kernel ran (see record_cell)
STORE_READY_S = 120.0  # the store host's ``import torch`` on a loaded machine
JSON_CAP = 1 << 20  # keep.json, lease.json, ranks.json: a few hundred bytes each
HISTORY_CAP = 256 << 20  # every cell's source, from every kernel that drove it


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


def me() -> list:
    """This kernel, as a lease names it: [pid, start time]."""
    proc = psutil.Process()
    return [proc.pid, proc.create_time()]


class Keeper:
    def __init__(self, plan, folder, kept: Kept | None = None):
        self.plan, self.folder = plan, folder
        self.kept = kept  # connection data: written at start, or read at attach
        self._lost: str | None = None  # why this kernel no longer drives the session
        self._gone: str | None = None  # ... and in a few words, for a frozen %dist_status

    @property
    def keeps(self) -> bool:
        return bool(self.plan.keep_s)

    @property
    def name(self) -> str:
        return self.plan.name

    # ----- start ----------------------------------------------------------------------------
    def host_store(self, rdzv) -> None:
        """The store: hosted here for an ordinary session; for a kept one by a process of
        its own (watched by the session's watchdog, armed first), which the kernel joins."""
        if not self.keeps:
            rdzv.host()
            return
        self.folder.arm_watchdog()
        method = self.plan.init_method
        address = method.host if method.kind == "tcp" else self.plan.bind_address
        port = method.port if method.kind == "tcp" else 0
        guard = self.folder.guard()
        env = dict(os.environ, **{MARK: self.folder.profile_dir})
        with open(self.folder.file("store.log"), "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "infini_notebook.launch.store_host", address, str(port),
                 f"{guard.pid}:{guard.create_time()}"],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, env=env,
                start_new_session=True,  # Jupyter's restart signals the kernel's group
            )  # fmt: skip
        line = proc.stdout.readline().decode().strip()  # once it listens (or failed)
        proc.stdout.close()
        if not line.isdigit():
            raise DistUsageError(
                f"Cannot host the kept session's store on {address}:{port} "
                f"({line or 'its process exited: see store.log'}). Pick a free port, or use "
                "the default env:// init method."
            )
        rdzv.join(self.plan.store_address or address, int(line))

    def keep(self, rdzv, cluster_id: str) -> bool:
        """Once started: a kept session's connection data and its lease (this kernel drives
        it). False for an ordinary session (it ends with the kernel)."""
        if not self.keeps:
            return False
        host, port = rdzv.address
        guard = self.folder.guard()
        data = {
            "name": self.name, "created": self.folder.created, "started": time.time(),
            "keep_s": self.plan.keep_s, "store_host": host, "store_port": port,
            "token": rdzv.token, "mac_key": rdzv.mac_key, "cluster_id": cluster_id,
            "watchdog": [guard.pid, guard.create_time()], "world_size": self.plan.world_size,
            "backend": self.plan.backend, "gpus": list(self.plan.gpus),
            "plan": plan_to_json(self.plan),
        }  # fmt: skip
        write_private(self.folder.file(CONNECTION), json.dumps(data).encode())
        self._write_lease(holder=me())
        private_place.register(self.name, self.folder.path)  # found by name from now on
        return True

    def forget(self) -> None:
        """The session ended from this kernel (or its start failed): its entry goes, its
        name is free again."""
        if self.keeps:
            private_place.unregister(self.name, self.folder.path)

    # ----- who drives it ----------------------------------------------------------------------
    def _write_lease(self, **fields) -> None:
        lease = {"keep_s": self.plan.keep_s, "name": self.name, "since": time.time(), **fields}
        write_private(self.folder.file(LEASE), json.dumps(lease).encode())

    def holder(self) -> tuple[list | None, float | None]:
        """The kernel that drives the session now ([pid, start] or None) and since when."""
        lease = read_json(self.folder.file(LEASE)) or {}
        holder = lease.get("holder")
        if holder and same_process(int(holder[0]), float(holder[1])) is None:
            holder = None
        return holder, lease.get("since")

    def claim(self, force: bool) -> str:
        """Drive the session from this kernel: refused while another live kernel does,
        unless ``force``. What was taken from whom, for the attach line."""
        holder, since = self.holder()
        if holder is not None and holder[0] != me()[0]:
            when = time.strftime("%H:%M:%S", time.localtime(since or 0))
            if not force:
                raise DistUsageError(
                    f"Session {self.name!r} is driven by the live kernel pid {holder[0]} "
                    f"(since {when}). Stop or restart that kernel, or take it over with "
                    f"%dist_attach {self.name} --force."
                )
            self._write_lease(holder=me(), taken_from=holder[0])
            return f"taken over from kernel pid {holder[0]}"
        self._write_lease(holder=me())
        return "was detached"

    def release_claim(self) -> None:
        """An attach that failed: the session waits for a kernel again (its keep time)."""
        self._write_lease(holder=None)

    def detach(self) -> None:
        """This kernel lets the session go and keeps it (%dist_detach): the lease names no
        holder, so its watchdog counts the keep time from now (woken to write ``detached``
        at once) and any kernel of this user attaches it without --force."""
        self.require_held()
        self._write_lease(holder=None, detached_by=me()[0])
        when = time.strftime("%H:%M:%S")
        self._gone = f"{self.name!r} detached from this kernel at {when}"
        self._lost = (
            f"This kernel detached session {self.name!r} at {when}: it waits for a kernel "
            f"(%dist_attach {self.name} takes it back; %dist_stop {self.name} ends it)."
        )
        try:
            wake(self.folder.guard())
        except psutil.Error:  # no watchdog: nothing to wake
            pass

    def driven(self) -> bool:
        """Whether this kernel still drives the session (an ordinary one: always)."""
        return not self.keeps or (self._lost is None and self._still_mine())

    def require_held(self) -> None:
        """DistUsageError, one line, once another kernel took the session over."""
        if not self.driven():
            raise DistUsageError(self._lost)

    def _still_mine(self) -> bool:
        lease = read_json(self.folder.file(LEASE)) or {}
        holder = lease.get("holder")
        if holder and int(holder[0]) == me()[0]:
            return True
        self.folder.reap_watchdog()  # ours, ended by %dist_stop NAME: no zombie left
        if lease.get("end") or not os.path.isdir(self.folder.path):
            self._lost = f"Session {self.name!r} was stopped from another kernel."
            when = time.strftime("%H:%M:%S", time.localtime(lease.get("ended") or time.time()))
            self._gone = f"{self.name!r} stopped from another kernel at {when}"
        else:
            when = time.strftime("%H:%M:%S", time.localtime(lease.get("since") or 0))
            who = f"kernel pid {holder[0]}" if holder else "another kernel"
            self._lost = (
                f"This kernel no longer drives session {self.name!r}: {who} took it over at "
                f"{when}. Attach again with %dist_attach {self.name} --force."
            )
            self._gone = f"{self.name!r} driven by {who} since {when}"
        return False

    # ----- the cells run so far (for %dist_export from any kernel that drove it) -------------
    def record_cell(self, source: str, ok: bool) -> None:
        """Append a cell this kernel ran while it drove the session."""
        if self.keeps and source.strip() and self._lost is None:
            line = json.dumps({"source": source, "ok": ok}) + "\n"
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(self.folder.file(HISTORY), flags, 0o600)
            with os.fdopen(fd, "a", encoding="utf-8") as f:
                f.write(line)

    def history(self) -> list:
        """Every cell the kernels that drove the session ran, in order, numbered from 1."""
        from ..core.export import HistoryCell

        try:
            cells = self._history_cells()
        except (OSError, ValueError):
            cells = []
        return [HistoryCell(n, c["source"], c["ok"]) for n, c in enumerate(cells, 1)]

    def _history_cells(self) -> list[dict]:
        text = own_files.read(self.folder.file(HISTORY), HISTORY_CAP).decode("utf-8")
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def mark_ok(self, number: int) -> None:
        """Cell ``number`` of ``history()``, recorded as failed, finished ok after all: the
        kernel that ran it went (Jupyter's restart interrupts it first) and the ranks ran it
        through with no kernel attached (see kernel/left_output.py)."""
        if not self.keeps or self._lost is not None:
            return
        try:
            cells = self._history_cells()
            cells[number - 1]["ok"] = True
        except (OSError, ValueError, IndexError, TypeError):
            return
        body = "".join(json.dumps(c) + "\n" for c in cells)
        write_private(self.folder.file(HISTORY), body.encode())

    @property
    def lost(self) -> str | None:
        """Why this kernel no longer drives the session, once it does not."""
        return self._lost

    @property
    def gone(self) -> str | None:
        """Once this kernel no longer drives the session, who does and since when, in a few
        words ("'train' driven by kernel pid 4242 since 17:27:50"; or stopped from
        another kernel, or detached from this one): what a live %dist_status freezes with."""
        return self._gone


# ----- finding kept sessions ------------------------------------------------------------------
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
