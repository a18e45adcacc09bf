"""What ``%dist_autoreload`` sends to ranks that do not see the notebook's folder (ranks on
other hosts): the rule for which files count, what changed since a rank's last copy, the
size cap and its one line, and the signed manifest a rank checks before it writes anything.
Pure: the standard library only.

The rule: every ``.py`` file under the notebook's folder (the kernel's working folder when
autoreload was turned on), at any depth, except in folders whose name starts with ``.``
(``.git``, ``.venv``, ``.ipynb_checkpoints``), ``__pycache__``, ``node_modules``,
``site-packages`` and virtual environments (a folder holding ``pyvenv.cfg``). A file counts
as changed when its size or modification time (ns) differs from what the rank was sent;
files removed here are removed from the rank's copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass, field

CAP_BYTES = 16 * 2**20  # the changed files sent before one cell, in all
SKIP_DIRS = frozenset({"__pycache__", "node_modules", "site-packages"})
SUFFIX = ".py"

Stamp = tuple[int, int]  # (mtime in ns, size in bytes)


def scan(root: str) -> dict[str, Stamp]:
    """Every file the rule counts under ``root``: its path relative to ``root`` (``/``
    separated) -> its stamp. Links to folders are not followed; a link to a file counts as
    the file."""
    found: dict[str, Stamp] = {}
    for folder, dirs, files in os.walk(root, followlinks=False):
        if "pyvenv.cfg" in files and folder != root:
            dirs[:] = []
            continue
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS]
        for name in files:
            if not name.endswith(SUFFIX) or name.startswith("."):
                continue
            path = os.path.join(folder, name)
            try:
                st = os.stat(path)
            except OSError:  # gone meanwhile, or a dangling link
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            found[rel] = (st.st_mtime_ns, st.st_size)
    return found


@dataclass
class Changes:
    """What a rank's copy lacks: files to send (path -> stamp) and files to remove."""

    send: dict[str, Stamp] = field(default_factory=dict)
    remove: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.send or self.remove)

    @property
    def size(self) -> int:
        return sum(size for _, size in self.send.values())

    def key(self) -> tuple:
        """Equal for ranks that need the same files (they get one bundle's worth)."""
        return tuple(sorted(self.send.items())), tuple(sorted(self.remove))


def changes(now: dict[str, Stamp], had: dict[str, Stamp]) -> Changes:
    """What a copy holding ``had`` needs to match ``now``."""
    send = {p: stamp for p, stamp in now.items() if tuple(had.get(p, ())) != stamp}
    return Changes(send, sorted(p for p in had if p not in now))


def format_mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def over_cap_line(change: Changes, root: str, ranks: str, cap: int = CAP_BYTES) -> str:
    """The one line shown when ``change`` is over ``cap``: nothing was sent to ``ranks``
    (a label such as "ranks 2-3"), the files named, largest first."""
    biggest = sorted(change.send.items(), key=lambda kv: (-kv[1][1], kv[0]))
    named = ", ".join(f"{p} {format_mib(stamp[1])}" for p, stamp in biggest[:5])
    more = f" and {len(biggest) - 5} more" if len(biggest) > 5 else ""
    return (
        f"autoreload: nothing sent to {ranks} (other hosts): the changed .py files under "
        f"{root} come to {format_mib(change.size)}, over the {format_mib(cap)} cap "
        f"({named}{more}); those ranks run the code they had. Make the files smaller or "
        "move them out of the folder.\n"
    )


def safe_path(rel: str) -> bool:
    """A path a rank may write under its copy: relative, ``/`` separated, no ``..``, no
    empty or hidden part, ending in ``.py``."""
    if not rel or rel.startswith("/") or "\\" in rel or "\0" in rel or not rel.endswith(SUFFIX):
        return False
    return all(part and not part.startswith(".") for part in rel.split("/"))


def manifest(rank: int, seq: int, files: dict[str, bytes], remove: list[str]) -> bytes:
    """What the kernel signs and the rank checks: the bundle's number for that rank (a rank
    takes only a higher one, so an old bundle cannot be sent again), each file's path, size
    and SHA-256, and the paths to remove."""
    entries = [[p, len(d), hashlib.sha256(d).hexdigest()] for p, d in sorted(files.items())]
    body = {"rank": rank, "seq": seq, "files": entries, "remove": sorted(remove)}
    return json.dumps(body, separators=(",", ":")).encode()


def manifest_name(rank: int) -> str:
    """The name a bundle for ``rank`` is signed under (see core/signing.py)."""
    return f"code/rank{rank}"
