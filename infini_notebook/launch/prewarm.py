"""A warm template started as the extension loads, for the session that starts next.

A first ``%dist_start`` otherwise waits for its template's imports (about one ``import
torch``: see template.py). Started at ``%load_ext``, they overlap the user's typing.

The template is started as a session starts its own (``template_client.start_template``),
in a session folder made now, with that folder's mark (watchdog.MARK): the mark must be in the
template's environment from the start, because forked engines show the template's. The next
session adopts the folder, the template and a watchdog started with them (``take``), so a
kernel that dies, before or after ``%dist_start``, leaves nothing: the watchdog ends what
carries the mark and removes the folder. A session whose engines need another environment
(``--env``, a changed ``os.environ``, ``--no-template``, another launcher) ends them and
starts as before; so does an orderly exit of the kernel.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import psutil

# Set per plan and applied by each engine at bootstrap (torch.set_num_threads), so a template
# warmed before the plan is known serves any number of threads per rank.
PER_PLAN = ("OMP_NUM_THREADS",)


@dataclass
class Warmed:
    workdir: str  # a session folder, for the session that adopts it
    created: float  # no process of it is older (the session's ``since``)
    template: psutil.Process
    env: dict  # the environment the template started with
    watchdog: Any  # its Popen


_warmed: Warmed | None = None
_lock = threading.Lock()


def warm() -> None:
    """Start a template for the next session unless one is warm already or engines are not
    forked on this platform (see plan.template_off)."""
    global _warmed
    if sys.platform != "linux":
        return
    from . import launchers, private_place, template_client
    from .folder import spawn_watchdog

    with _lock:
        if _warmed is not None and template_client.alive(_warmed.template):
            return
        discard_locked()
        created = time.time()
        try:
            workdir = private_place.new_session_folder()
        except Exception:  # no private place: %dist_start will say why
            return
        profile_dir = launchers.profile_dir(workdir)
        watchdog = spawn_watchdog(profile_dir, created)  # first, as a session's
        env = dict(os.environ)
        template = template_client.start_template(
            env,
            profile_dir,
            launchers.template_socket(profile_dir),
            os.path.join(workdir, "template.log"),
        )
        _warmed = Warmed(workdir, created, template, env, watchdog)


def take(env: dict) -> Warmed | None:
    """The warm template, its folder and watchdog, for a session whose engines start with
    ``env``; None when none is warm or it started with another environment (then it ends)."""
    global _warmed
    from .template_client import alive

    with _lock:
        warmed, _warmed = _warmed, None
    if warmed is None:
        return None
    if alive(warmed.template) and same_interpreter(warmed.env, env):
        return warmed
    end(warmed)
    return None


def take_for(plan) -> Warmed | None:
    """The warm template, if it suits ``plan``'s engines (``take``); ended if none of its."""
    from . import launchers

    if plan.template_off:
        discard()  # no use to this session
        return None
    return take(launchers.template_env(plan))


def same_interpreter(a: dict, b: dict) -> bool:
    """Whether two environments start the same interpreter, up to what each plan sets."""

    def shared(env: dict) -> dict:
        return {k: v for k, v in env.items() if k not in PER_PLAN}

    return shared(a) == shared(b)


def warm_template() -> psutil.Process | None:
    """The template waiting for the next session, if one is."""
    with _lock:
        return _warmed.template if _warmed is not None else None


def discard() -> None:
    """End the template nobody adopted (at the kernel's exit, or when a new one replaces it)."""
    with _lock:
        discard_locked()


atexit.register(discard)  # once: an orderly exit of the kernel ends a template nobody took


def discard_locked() -> None:
    global _warmed
    warmed, _warmed = _warmed, None
    if warmed is not None:
        end(warmed)


def end(warmed: Warmed) -> None:
    from .folder import stop_watchdog
    from .watchdog import end_all, remove_session_folder

    end_all([warmed.template], grace=0)
    stop_watchdog(warmed.watchdog)
    remove_session_folder(warmed.workdir)


def status_note() -> str:
    """What %dist_status says of the template warmed for the next session, if one waits."""
    template = warm_template()
    try:
        rss = template.memory_info().rss if template is not None else None
    except Exception:  # it just ended
        rss = None
    if rss is None:
        return ""
    from ..viz.render import format_bytes

    return f" A warm template waits for it (RSS {format_bytes(rss)}; %dist_stop ends it)."
