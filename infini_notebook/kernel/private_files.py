"""Folders and files the kernel writes where another user may have been first (the working
folder: ``%%dist_profile``'s traces): this user's alone (folders 0700, files 0600), no link
followed at a name written, nothing someone else made used."""

from __future__ import annotations

import os
import tempfile

from ..core.errors import DistUsageError
from ..engine.own_files import folder_problem, write, write_text  # noqa: F401 (the kernel's writers)


def own_folder_problem(st: os.stat_result, uid: int) -> str | None:
    """Why a folder with status ``st`` is not one to write into, or None: the same rule as
    a remote engine's folder (engine/remote_start.py), without the mode."""
    return folder_problem(st, uid, private=False)


def make_folder(path: str, fresh: bool) -> str:
    """The folder to write into; its path. ``fresh`` (a name the tool picked, such as
    dist_profile/<cell>-<time>): a new folder (0700), never one that exists, in a parent of
    this user's (made 0700 if missing); where that name is taken, or the parent is not this
    user's own folder, a new one with a random suffix beside it. Else (a folder the user
    named): made (0700) if missing, else it must be this user's."""
    if fresh:
        parent, leaf = os.path.split(os.path.normpath(path))
        parent = parent or "."
        try:
            os.mkdir(parent, 0o700)
        except FileExistsError:
            pass
        if own_folder_problem(os.lstat(parent), os.geteuid()) is not None:
            # someone else's (or a link): a new folder in the working folder instead
            above = os.path.dirname(parent) or "."
            return tempfile.mkdtemp(prefix=f"{os.path.basename(parent)}-{leaf}-", dir=above)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            return tempfile.mkdtemp(prefix=f"{leaf}-", dir=parent)
        return path
    if not os.path.lexists(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        os.mkdir(path, 0o700)
    problem = own_folder_problem(os.stat(path), os.geteuid())  # a link the user named: its folder
    if problem:
        raise DistUsageError(f"{path!r} {problem}: write into a folder of your own.")
    return path
