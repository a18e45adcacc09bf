"""Files written into, and read from, a folder of this user's (``%%dist_profile``'s traces,
a session folder's connection data, lease and history): written 0600, no link followed at a
name written, a file already there replaced, never written through; read without following
a link or blocking on a FIFO, and used only once ``fstat`` of the open file shows a regular
file of this user's, not readable by others, under a size cap. The folder's owner is checked
on the open folder, so a folder swapped for another user's (or a link) after the check is
neither written into nor read from. Runs in the kernel, the watchdog and a rank."""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Callable
from typing import IO

from ..core.errors import DistUsageError


def folder_problem(st: os.stat_result, uid: int, private: bool = True) -> str | None:
    """Why a folder with lstat ``st`` is not this user's own (``private``: with mode 0700),
    or None when it is."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != uid:
        return f"belongs to uid {st.st_uid}, not to this user (uid {uid})"
    if private and stat.S_IMODE(st.st_mode) != 0o700:
        return f"has mode {stat.S_IMODE(st.st_mode):o}, not 700"
    return None


def untrusted_ancestor(path: str) -> str | None:
    """Why another user could replace what lies under ``path`` (a folder on the way that is
    theirs, or that others may write and is not sticky), or None."""
    uid = os.geteuid()
    parts = os.path.abspath(path).split(os.sep)
    for i in range(1, len(parts) + 1):
        step = os.sep + os.path.join(*parts[1:i]) if i > 1 else os.sep
        try:
            st = os.lstat(step)
        except FileNotFoundError:
            return None  # made by us from here on
        except OSError as e:
            return f"{step}: {e.strerror}"
        if stat.S_ISLNK(st.st_mode):
            return f"{step} is a symbolic link"
        if st.st_uid not in (0, uid):
            return f"{step} belongs to uid {st.st_uid}"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return f"{step} may be written by others and is not sticky"
    return None


READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class NotOurs(OSError):
    """A file that is not one of ours to read: a link, a FIFO, a device, another user's,
    readable by others, or too big. Its message is one line naming the file and why."""


def write(folder: str, name: str, fill: Callable[[IO[str]], None], binary: bool = False) -> str:
    """``fill(f)`` writes the text (``binary``: the bytes) of ``folder/name`` (0600) into
    ``f``; its path. A new file (``O_EXCL|O_NOFOLLOW``, a random name) renamed into place."""
    dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        problem = folder_problem(os.fstat(dir_fd), os.geteuid(), private=False)
        if problem:
            raise DistUsageError(f"{folder!r} {problem}: write into a folder of your own.")
        tmp = f".{name}.{secrets.token_hex(4)}"
        fd = os.open(tmp, TMP_FLAGS, 0o600, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8") as f:
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


def write_bytes(folder: str, name: str, body: bytes) -> str:
    """``body`` as ``folder/name`` (0600), whole or not at all; its path."""
    return write(folder, name, lambda f: f.write(body), binary=True)


def read(path: str, cap: int, dir_fd: int | None = None) -> bytes:
    """The bytes of our own file ``path`` (relative to ``dir_fd`` if given): NotOurs, at
    once and in one line, for a link, a FIFO, a device, another user's file, one others
    may read or write, or one over ``cap`` bytes (a link to /dev/zero never fills memory,
    a FIFO never hangs). FileNotFoundError when there is none."""
    try:
        fd = os.open(path, READ_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW met a link
            raise NotOurs(f"{path} is a symbolic link: refused") from None
        raise
    try:
        problem = file_problem(os.fstat(fd), os.geteuid(), cap)
        if problem:
            raise NotOurs(f"{path} {problem}: refused")
        chunks, left = [], cap + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        body = b"".join(chunks)
        if len(body) > cap:  # it grew after the fstat
            raise NotOurs(f"{path} is over {cap} bytes: refused")
        return body
    finally:
        os.close(fd)


def file_problem(st: os.stat_result, uid: int, cap: int) -> str | None:
    """Why an open file with status ``st`` is not one of ours to read, or None."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file (a FIFO, a device or a folder)"
    if st.st_uid != uid:
        return f"belongs to uid {st.st_uid}, not to this user (uid {uid})"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):o}: others may read or write it"
    if st.st_size > cap:
        return f"is {st.st_size} bytes, over its cap of {cap}"
    return None


def open_folder(path: str, identity: tuple[int, int] | None = None) -> int:
    """A directory fd of our own private folder ``path`` (not a link, this user's, 0700,
    and when ``identity`` is given that device and inode): NotOurs otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotOurs(f"{path} is a symbolic link or not a folder: refused") from None
        raise
    st = os.fstat(fd)
    problem = folder_problem(st, os.geteuid())
    if problem is None and identity is not None and (st.st_dev, st.st_ino) != tuple(identity):
        problem = "is not the folder the session was registered with (another device or inode)"
    if problem:
        os.close(fd)
        raise NotOurs(f"{path} {problem}: refused")
    return fd
