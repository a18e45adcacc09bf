"""``%dist_autoreload on|off``: edited code on every rank. :class:`AutoReload` owns the
setting and is its only writer: whether it is on, the notebook folder it follows, and per
engine whether that engine has it and what copy of the folder it holds.

While on, the kernel and every rank run IPython's autoreload (``%autoreload 2``: a module
whose file changed is reloaded before the next cell). Ranks on the kernel's machine that
see the folder itself need nothing more. The others (ranks on other hosts) get a copy of
the folder's ``.py`` files (the rule: core/code_sync.py), first on their ``sys.path``;
before each cell the files changed since a rank's last copy go to it through ipyparallel's
signed messages, the bundle signed again with the session's key (engine/code_sync.py),
capped at 16 MiB in all (over it, nothing is sent and one line names the files).

An engine gets autoreload the first time a cell goes to it after ``on``: so the new
engines of a hard restart, and a kept session's after ``%dist_attach``, get it before their
next cell. The setting is written to the session's folder (``autoreload.json``, 0600): a
kept session keeps it, and the kernel that attaches turns its own autoreload on.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from ..core import code_sync, signing
from ..core.errors import DistCellError
from ..core.ranks import rank_label
from ..engine import code_sync as rank_side
from ..engine import own_files

SETTING = "autoreload.json"


@dataclass
class Copy:
    """One engine's copy of the folder (a rank that does not see it): what it holds."""

    stamps: dict = field(default_factory=dict)  # path -> (mtime_ns, size), as sent
    seq: int = 0  # the last bundle's number


class AutoReload:
    def __init__(self, folder):
        """``folder``: the session's SessionFolder, where the setting is kept (read back
        when a kept session is attached)."""
        self._path = folder.file(SETTING)
        saved = _read(self._path)
        self.on: bool = bool(saved.get("on"))
        self.root: str | None = saved.get("root")  # the notebook folder followed
        self.copy_all: bool = bool(saved.get("copy_all"))  # every rank gets a copy
        self.cap = code_sync.CAP_BYTES
        self._engines: dict[int, Copy | None] = {}  # engine id -> its copy (None: sees it)
        self._warned: tuple | None = None  # the over-cap change last named

    # ----- the setting ------------------------------------------------------------------------
    def turn(self, s, on: bool, copy_all: bool = False) -> str:
        """On: the kernel and every rank now, the folder this kernel works in followed
        (``copy_all``: every rank gets a copy, even one that sees the folder). Off: the
        kernel and every rank stop reloading. The line that says so."""
        if on:
            self.root, self.copy_all = os.getcwd(), copy_all
            self._engines.clear()
            self.on = True
            over = self.before_cell(s, list(range(s.world_size)))  # the first copies now
        else:
            s.apply(rank_side.disable)
            self.on, over = False, None
        rank_side.set_autoreload(_shell(), on)
        self._save()
        return f"{self.describe(s)}\n{over or ''}".rstrip("\n")

    def attached(self) -> None:
        """A kernel attached the session: its own autoreload as the session's setting."""
        if self.on:
            rank_side.set_autoreload(_shell(), True)

    def describe(self, s) -> str:
        """The state, in a line."""
        if not self.on:
            return "Autoreload is off: edited modules are not reloaded (%dist_autoreload on)."
        copies = self.copy_ranks(s)
        where = (
            f"; {_label(copies)}, which "
            f"{'were asked to take a copy' if self.copy_all else 'do not see it'}, "
            "get its changed .py files sent first"
            if copies
            else ""
        )
        return (
            f"Autoreload is on: the kernel and all {s.world_size} ranks reload the modules "
            f"you edit before each cell; folder {self.root}{where}."
        )

    def copy_ranks(self, s) -> list[int]:
        """The ranks known to need a copy of the folder (ranks on other hosts)."""
        return [r for r in range(s.world_size) if self._engines.get(_eid(s, r), None) is not None]

    def _save(self) -> None:
        body = json.dumps({"on": self.on, "root": self.root, "copy_all": self.copy_all})
        # a new temporary (O_EXCL|O_NOFOLLOW) renamed into place: never through a link
        own_files.write_text(os.path.dirname(self._path), os.path.basename(self._path), body)

    # ----- before each cell -------------------------------------------------------------------
    def before_cell(self, s, targets: list[int]) -> str | None:
        """Engines that have not got autoreload yet get it; ranks with a copy get the files
        changed since. The over-cap line, when nothing could be sent."""
        if not self.on:
            return None
        new = [r for r in targets if _eid(s, r) not in self._engines]
        if new:
            self._enable(s, new)
        copies = [r for r in targets if self._engines.get(_eid(s, r)) is not None]
        if not copies:
            return None
        return self._sync(s, copies)

    def _enable(self, s, ranks: list[int]) -> None:
        identity = rank_side.folder_identity(self.root)
        calls = {r: (rank_side.enable, (identity, self.copy_all, _parent(s, r))) for r in ranks}
        for r, answer in s.apply_each(calls, "autoreload", timeout=60).items():
            copy = Copy({k: tuple(v) for k, v in answer["manifest"].items()}, answer["seq"])
            self._engines[_eid(s, r)] = copy if answer["copies"] else None

    def _sync(self, s, ranks: list[int]) -> str | None:
        now = code_sync.scan(self.root)
        groups: dict[tuple, tuple[code_sync.Changes, list[int]]] = {}
        for r in ranks:
            change = code_sync.changes(now, self._engines[_eid(s, r)].stamps)
            if change:
                groups.setdefault(change.key(), (change, []))[1].append(r)
        lines, calls, contents = [], {}, {}
        for key, (change, members) in groups.items():
            if change.size > self.cap:
                if key != self._warned:
                    lines.append(code_sync.over_cap_line(change, self.root, _label(members)))
                self._warned = key
                continue
            files = {p: _read_bytes(self.root, p, contents) for p in change.send}
            files = {p: data for p, data in files.items() if data is not None}
            stamps = {p: change.send[p] for p in files}
            for r in members:
                seq = self._engines[_eid(s, r)].seq + 1
                body = code_sync.manifest(r, seq, files, change.remove)
                tag = signing.sign(s.rendezvous.mac_key, code_sync.manifest_name(r), body)
                tag = tag[: signing.TAG_LEN]
                calls[r] = (rank_side.receive, (seq, files, stamps, change.remove, tag))
        if calls:
            try:
                s.apply_each(calls, "autoreload", timeout=60)
            except DistCellError as e:
                raise DistCellError(
                    f"autoreload: sending the changed files failed ({e.summary}); the cell "
                    "did not run. %dist_autoreload off runs cells without it.",
                    e.report,
                    e.ranks,
                ) from None
            for r, (_, _, stamps, remove, _) in ((r, c[1]) for r, c in calls.items()):
                copy = self._engines[_eid(s, r)]
                copy.stamps.update(stamps)
                for p in remove:
                    copy.stamps.pop(p, None)
                copy.seq += 1
        return "".join(lines) or None


def _eid(s, rank: int) -> int:
    return s.engines.eid(rank)


def _parent(s, rank: int) -> str | None:
    """Where a rank's copy goes: in the session's folder for a rank on this host (removed
    with it), else a new folder on its host."""
    return s.folder.path if s.engines.local(rank) is not None else None


def _label(ranks: list[int]) -> str:
    return rank_label(ranks)[1:-1]


def _shell():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def _read(path: str) -> dict:
    try:
        data = json.loads(own_files.read(path, 1 << 16))  # ours alone, never a FIFO or link
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _read_bytes(root: str, rel: str, cache: dict) -> bytes | None:
    if rel not in cache:
        try:
            with open(os.path.join(root, *rel.split("/")), "rb") as f:
                cache[rel] = f.read()
        except OSError:  # removed meanwhile: the next cell removes it there too
            cache[rel] = None
    return cache[rel]
