"""``%dist_autoreload`` on a rank: IPython's autoreload (``%autoreload 2``) in the rank's
shell, and the notebook's folder first on ``sys.path``: the folder itself for a rank that
sees it (the kernel's machine), else a copy of its ``.py`` files, kept up to date by the
kernel before each cell (kernel/autoreload.py).

The copy is a folder of this rank's own: made new (``mkdtemp``, mode 0700, named as a
session's folder) in the host's temporary folder, or in the session's folder for a rank on
the kernel's host. It is removed when the engine ends, however it ends: at exit, and by a
small watcher process (``sh``) that waits for the engine's pid to go (a SIGKILL, an
``os._exit``). A rank writes only what a bundle signed with the session's key holds (the
key came in the bootstrap config, ipyparallel's signed messages; see core/signing.py), each
path checked (relative, no ``..``, ``.py``), never following a link.

Importing it stays cheap and torch-free (see ``engine``).
"""

from __future__ import annotations

import os
import subprocess
import sys

from ..core import code_sync, signing

_state: dict = {"folder": None, "manifest": {}, "seq": 0}
WATCH = 'while kill -0 "$1" 2>/dev/null; do sleep 0.5; done; rm -rf -- "$2"'


def boot_id() -> str:
    """This machine (one boot of its kernel): ranks with the kernel's see its files."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        import socket

        return socket.gethostname()


def folder_identity(path: str) -> dict:
    """What a rank compares to know it sees ``path`` itself (same machine, same inode)."""
    st = os.stat(path)
    return {"path": path, "boot": boot_id(), "dev": st.st_dev, "ino": st.st_ino}


def sees(identity: dict) -> bool:
    """Whether this process sees the folder ``identity`` names (folder_identity)."""
    if identity.get("boot") != boot_id():
        return False
    try:
        st = os.stat(identity["path"])
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (identity["dev"], identity["ino"])


def set_autoreload(shell, on: bool) -> bool:
    """IPython's autoreload in ``shell``: every module reloaded when its file changed,
    before each cell (``%autoreload 2``), or not (``%autoreload 0``). False without a shell."""
    if shell is None:
        return False
    names = shell.extension_manager.loaded  # IPython 9 names it by its module
    loaded = bool({"autoreload", "IPython.extensions.autoreload"} & set(names))
    if on and not loaded:
        shell.extension_manager.load_extension("autoreload")
    if on or loaded:
        shell.run_line_magic("autoreload", "2" if on else "0")
    return True


def enable(identity: dict, copy: bool, parent: str | None) -> dict:
    """Autoreload on in this rank's shell; whether it needs a copy of the folder
    ``identity`` names (``copy``: always), where the copy goes (``parent``, None: a new
    folder in this host's temporary folder), and what it holds (path -> stamp) so far."""
    from IPython import get_ipython

    set_autoreload(get_ipython(), True)
    copies = copy or not sees(identity)
    if not copies:
        _on_path(identity["path"])  # the folder itself (this rank may work elsewhere)
    else:
        _state["parent"] = parent
        if _state["folder"]:
            _on_path(_state["folder"])
    return {"copies": copies, "manifest": dict(_state["manifest"]), "seq": _state["seq"]}


def disable() -> None:
    """Autoreload off in this rank's shell (a copy stays where it is, on sys.path)."""
    from IPython import get_ipython

    set_autoreload(get_ipython(), False)


def receive(seq: int, files: dict[str, bytes], stamps: dict, remove: list[str], tag: bytes):
    """Write the files of a bundle from the kernel into this rank's copy, remove those it
    names, and make the next imports see them. Refused (ValueError, nothing written) unless
    signed with the session's key for this rank, newer than the last, and every path safe.
    Returns the copy's folder."""
    from . import bootstrap

    cfg = bootstrap._STATE["cfg"]
    rank, key = cfg["rank"], cfg["mac_key"]
    body = code_sync.manifest(rank, seq, files, remove)
    if signing.verify(key, code_sync.manifest_name(rank), tag + body) is None:
        raise ValueError("a bundle of files not signed with the session's key: refused")
    if seq <= _state["seq"]:
        raise ValueError(f"bundle {seq} is not newer than bundle {_state['seq']}: refused")
    bad = [p for p in [*files, *remove] if not code_sync.safe_path(p)]
    if bad:
        raise ValueError(f"unsafe paths in a bundle: {bad[:3]}: refused")
    folder = _state["folder"] or _make_folder(_state.get("parent"))
    for rel, data in files.items():
        _write(folder, rel, data)
        _state["manifest"][rel] = tuple(stamps[rel])
    for rel in remove:
        _unlink(folder, rel)
        _state["manifest"].pop(rel, None)
    _state["seq"] = seq
    import importlib

    importlib.invalidate_caches()  # new modules are found (FileFinder caches a listing)
    _on_path(folder)
    return folder


def _make_folder(parent: str | None) -> str:
    import atexit
    import tempfile

    from ..launch.watchdog import FOLDER_PREFIX

    if parent:
        folder = os.path.join(parent, f"code-rank{bootstrap_rank()}-{os.getpid()}")
        os.mkdir(folder, 0o700)
    else:  # not where another user could swap the copy for theirs (see remote_start)
        from .remote_start import refuse_shared_tmp

        refuse_shared_tmp(tempfile.gettempdir())
        folder = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}code-")
    _state["folder"] = folder
    atexit.register(remove_copy)
    from . import rank_services

    rank_services.BEFORE_EXIT.append(remove_copy)  # a rank that lost the kernel's store
    subprocess.Popen(  # removes it once this engine is gone, however it ends
        ["sh", "-c", WATCH, "infini-code-cleanup", str(os.getpid()), folder],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )
    return folder


def bootstrap_rank() -> int:
    from . import bootstrap

    return bootstrap._STATE["cfg"]["rank"]


def _write(folder: str, rel: str, data: bytes) -> None:
    """``data`` at ``rel`` under ``folder``, whole (a new file renamed into place), no link
    followed; its cached bytecode goes (Python checks it by whole seconds and size)."""
    path = os.path.join(folder, *rel.split("/"))
    parent = os.path.dirname(path)
    os.makedirs(parent, mode=0o700, exist_ok=True)
    if os.path.realpath(parent) != os.path.join(os.path.realpath(folder), *rel.split("/")[:-1]):
        raise ValueError(f"{rel}: a link in its path: refused")
    tmp = f"{path}.{os.urandom(4).hex()}.tmp"  # a new name: a leftover never blocks it
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    _drop_bytecode(path)


def _unlink(folder: str, rel: str) -> None:
    path = os.path.join(folder, *rel.split("/"))
    try:
        os.unlink(path)
    except OSError:
        pass
    _drop_bytecode(path)


def _drop_bytecode(path: str) -> None:
    import importlib.util

    try:
        os.unlink(importlib.util.cache_from_source(path))
    except (OSError, NotImplementedError, ValueError):
        pass


def _on_path(folder: str) -> None:
    """First on sys.path, as the notebook's folder is for a rank on the kernel's host."""
    if not sys.path or sys.path[0] != folder:
        if folder in sys.path:
            sys.path.remove(folder)
        sys.path.insert(0, folder)


def remove_copy() -> None:
    """Remove this rank's copy (at exit; rank_services before it ends the engine)."""
    import shutil

    folder, _state["folder"] = _state["folder"], None
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
