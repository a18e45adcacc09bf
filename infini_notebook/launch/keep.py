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

import psutil

from ..core.errors import DistUsageError
from ..core.plan import plan_to_json
from ..engine import own_files
from . import private_place
from .kept_sessions import CONNECTION, Kept, write_private
from .watchdog import LEASE, MARK, read_json, same_process, wake

HISTORY = "history.jsonl"  # the cells every driving kernel ran (see record_cell)
STORE_READY_S = 120.0  # the store host's ``import torch`` on a loaded machine
HISTORY_CAP = 256 << 20  # every cell's source, from every kernel that drove it


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
                cwd=self.folder.path,  # -m imports from the working folder: ours, 0700
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
