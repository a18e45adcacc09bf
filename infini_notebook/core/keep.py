"""Kept sessions, the pure part: ``--keep`` durations, session names, and the lease a kept
session's watchdog follows (who drives it, how long it waits without a driver). The
processes and files are ``launch/keep.py``'s; this module only decides."""

from __future__ import annotations

import re

from .errors import DistUsageError

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
FOLDER_PREFIX = "infini-notebook-"  # a session's folder (tempfile.mkdtemp's prefix)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def parse_duration(text: str) -> float:
    """``90s``, ``10m``, ``2h``, ``1d`` or plain seconds; DistUsageError otherwise."""
    m = _DURATION.match(str(text))
    if not m or float(m.group(1)) <= 0:
        given = (
            f"--keep {text!r} is no duration" if str(text).strip() else "--keep needs a duration"
        )
        raise DistUsageError(
            f"{given}: write it as 90s, 10m, 2h or 1d "
            "(how long the session waits for a kernel to attach once none is)."
        )
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def format_duration(seconds: float) -> str:
    """``8m 20s``, ``2h 5m``, ``45s``: the two largest units."""
    s = max(0, int(round(seconds)))
    parts = [(s // 86400, "d"), (s % 86400 // 3600, "h"), (s % 3600 // 60, "m"), (s % 60, "s")]
    shown = [f"{n}{u}" for n, u in parts if n]
    return " ".join(shown[:2]) or "0s"


def kept_clause(keep_s: float) -> str:
    """What ``--keep`` promises, as the ready line and the status say it: 'waits 30m for a
    kernel once none drives it'."""
    return f"waits {format_duration(keep_s)} for a kernel once none drives it"


def check_name(name: str) -> str:
    """A session name: letters, digits, ``_ . -``, at most 64, not starting with a sign."""
    if not _NAME.fullmatch(name or ""):  # no trailing newline, no "/": a file name
        raise DistUsageError(
            f"--name {name!r} cannot name a session: use letters, digits, '_', '.' and '-' "
            "(at most 64), starting with a letter or digit."
        )
    return name


def detached_until(keep_s: float, detached_since: float | None) -> float | None:
    """When a session without a driver since ``detached_since`` ends (None: it has one)."""
    return None if detached_since is None else detached_since + keep_s


def lease_verdict(lease: dict, holder_alive: bool, detached_since: float | None, now: float) -> str:
    """What a kept session's watchdog does now: "hold" (a kernel drives it, or it waits for
    one), or "end" (asked to, or nobody attached within its keep time). A lease without
    ``keep_s`` is an ordinary session's: it ends with its kernel."""
    if lease.get("end"):
        return "end"
    if holder_alive:
        return "hold"
    keep_s = lease.get("keep_s")
    if not keep_s:
        return "end"
    until = detached_until(float(keep_s), detached_since)
    return "hold" if until is None or now < until else "end"
