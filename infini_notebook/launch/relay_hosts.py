"""Where a session's relays run (``%dist_start --relay``) and how one is started: the
process side of launch/relay.py's ``RelayLink``, which owns them once started.

A local session has one relay, on this machine, its sockets in the session's folder; an ssh
session one per host, started over ssh (``ssh.relay_command``), reaching the kernel over
TCP with CurveZMQ where the engines reach the controller."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from ..core.plan import SessionPlan

Remote = Callable[[list[str]], list[str]]  # a relay's arguments -> the command running it there


def network(plan: SessionPlan) -> tuple[str, str] | None:
    """(the address the kernel listens on for relays, the one they reach it by), or None
    when the one relay runs on this machine (a socket in the session's folder)."""
    if plan.placement.launcher != "ssh":
        return None
    return plan.bind_address, plan.controller_address  # plan_checks.reachable: never 0.0.0.0


def hosts(plan: SessionPlan) -> list[tuple[str, list[int], Remote | None, str]]:
    """(tag, ranks, remote, host name) of each relay the plan needs; ``remote`` None: this
    machine."""
    from . import launchers, ssh

    place = plan.placement
    if network(plan) is None:
        return [("local", list(range(plan.world_size)), None, "this machine")]
    places = place.rank_places(plan.world_size)
    env = launchers.engine_env(plan)
    return [
        (
            f"h{i}-{secrets.token_hex(4)}",  # unguessable: its name on the kernel's socket
            [r for r, p in enumerate(places) if p[0] == i],
            ssh.relay_command(host, place.ssh_args, place.remote_python, env),
            f"host {host}",
        )
        for i, (host, _) in enumerate(place.hosts)
    ]


def start(
    place: str, tag: str, args: list[str], remote: Remote | None, keys: dict[str, Any], env: dict
) -> subprocess.Popen:
    """The relay ``tag`` started with ``args`` (from ``-m``), its keys on stdin; its stderr
    (over ssh too) in ``place``/relay-TAG.log. A relay here is given the kernel's pid to
    follow; one on another host (``remote``) keeps stdin open as its lifeline."""
    if remote is None:
        argv = [sys.executable, *args, str(os.getpid())]
    else:
        argv = remote([*args, "-"])
    with _private_log(log_path(place, tag)) as log_file:
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log_file,
            # the 0700 folder: `-m` imports from the working folder first, and the
            # kernel's may be one others can write (a notebook in /tmp)
            cwd=place,
            start_new_session=True,  # the kernel's SIGINT (the Stop button) is not its
            env=dict(os.environ, **env),
        )  # fmt: skip
    proc.stdin.write((json.dumps(keys) + "\n").encode())
    proc.stdin.flush()
    if remote is None:
        proc.stdin.close()  # a local relay follows the kernel's pid instead
    return proc


def log_path(place: str, tag: str) -> str:
    return os.path.join(place, f"relay-{tag}.log")


def _private_log(path: str):
    """The relay's log: this user's only (0600 whatever the umask), no link followed."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "ab")
