"""The private parts of ipyparallel and ipykernel that infini_notebook reads or patches,
checked where they are used. An upgrade that renames one then fails with a message naming
the versions (where output would otherwise be lost or a cell hang), or degrades to stock
behaviour with a log line (where only speed is at stake). Pure: no imports of either."""

from __future__ import annotations

import logging
from importlib import metadata

log = logging.getLogger("infini_notebook")

TESTED = {"ipyparallel": "9.2", "ipykernel": "7.4"}  # the versions these checks were written for


def version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def missing(obj, attrs: tuple[str, ...]) -> list[str]:
    return [a for a in attrs if not hasattr(obj, a)]


def describe(dist: str, what: str, names: list[str]) -> str:
    return (
        f"{dist} {version(dist)} has no {', '.join(names)} ({what}); infini_notebook was "
        f"built against {dist} {TESTED[dist]}"
    )


def require(obj, attrs: tuple[str, ...], dist: str, what: str) -> None:
    """Raise, saying what to install, when ``obj`` lacks one of ``attrs``."""
    names = missing(obj, attrs)
    if names:
        raise RuntimeError(
            f"{describe(dist, what, names)}. Install that version "
            f"(pip install '{dist}~={TESTED[dist]}.0') or an infini_notebook that supports yours."
        )


def usable(obj, attrs: tuple[str, ...], dist: str, what: str) -> bool:
    """False, with a log line, when ``obj`` lacks one of ``attrs`` (the caller skips a
    speed-up and stays on the stock path)."""
    names = missing(obj, attrs)
    if names and (dist, what) not in _warned:
        _warned.add((dist, what))
        log.warning("%s: left at stock behaviour.", describe(dist, what, names))
    return not names


_warned: set = set()  # said once per process
