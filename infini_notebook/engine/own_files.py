"""Files written into a folder of this user's (``%%dist_profile``'s traces: the kernel's
merged trace, and each rank's own trace, written by the rank on the kernel's host): 0600,
no link followed at a name written, a file already there replaced, never written through.
The folder's owner is checked on the open folder, so a folder swapped for another user's
(or a link) after the check is not written into. Runs in the kernel and in a rank."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from typing import IO

from ..core.errors import DistUsageError
from .remote_start import folder_problem


def write(folder: str, name: str, fill: Callable[[IO[str]], None]) -> str:
    """``fill(f)`` writes the text of ``folder/name`` (0600) into ``f``; its path. A new
    file renamed into place."""
    dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        problem = folder_problem(os.fstat(dir_fd), os.geteuid(), private=False)
        if problem:
            raise DistUsageError(f"{folder!r} {problem}: write into a folder of your own.")
        tmp = f".{name}.{secrets.token_hex(4)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                fill(f)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            os.unlink(tmp, dir_fd=dir_fd)
            raise
    finally:
        os.close(dir_fd)
    return os.path.join(folder, name)


def write_text(folder: str, name: str, text: str) -> str:
    """``text`` as ``folder/name`` (0600); its path."""
    return write(folder, name, lambda f: f.write(text))
