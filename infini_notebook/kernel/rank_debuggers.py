"""What the kernel asks of the ranks' debuggers, over ipyparallel (each call on the ranks it
names, never waiting long on a rank busy in a cell): start one behind its relay, write a
cell's file, find the files with an editor's text; and ``%dist_debugpy``'s configuration.
The protocol itself is kernel/debug_proxy.py's."""

from __future__ import annotations

import os


def attach_config(session, rank: int) -> dict:
    """A VS Code "attach" configuration for one rank (``%dist_debugpy --rank 1``): a
    loopback port of the kernel's, bridged to the rank's debugger (started there now if it
    is not yet) over its signed relay (kernel/debugpy_bridge.py). Modules map from the
    kernel's folder to the rank's; a cell compiles to the rank's own temporary file, which
    the editor opens as the debugger shows it."""
    from ..core.errors import DistUsageError
    from . import debugpy_bridge

    if not 0 <= rank < session.world_size:
        raise DistUsageError(f"No rank {rank}: the session has ranks 0-{session.world_size - 1}.")
    info = listen_on(session, [rank])[rank]
    if isinstance(info, str):
        raise DistUsageError(f"rank {rank} did not start its debugger ({info}); is it in a cell?")
    relay = (info["host"], info["port"])
    host, port = debugpy_bridge.bridge(relay, session.rendezvous.mac_key, rank)
    return {
        "name": f"rank {rank}",
        "type": "debugpy",
        "request": "attach",
        "connect": {"host": host, "port": port},
        "pathMappings": [{"localRoot": os.getcwd(), "remoteRoot": info["cwd"]}],
        "justMyCode": True,
    }


def listen_on(session, ranks: list[int]) -> dict:
    """debugpy listening on each rank (engine/rank_debug.listen): ``{rank: info}``, or
    ``{rank: why not}`` for a rank that did not answer (busy in a long cell, say)."""
    from ..engine import rank_debug

    key, (toward, _) = session.rendezvous.mac_key, session.rendezvous.address
    return _apply(session, ranks, rank_debug.listen, key, toward)


def files_with_text(session, rank: int, code: str) -> list[str]:
    from ..engine import rank_debug

    out = _apply(session, [rank], rank_debug.files_with_text, code)[rank]
    return out if isinstance(out, list) else []


def write_cell_file(session, rank: int, body: str, code: str) -> str | None:
    from ..engine import rank_debug

    out = _apply(session, [rank], rank_debug.cell_file, body, code)[rank]
    return None if isinstance(out, str) and not out.startswith("/") else out


def _apply(session, ranks: list[int], fn, *args, timeout: float = 10.0) -> dict:
    """``fn(*args)`` on each rank; a rank busy for longer than ``timeout`` (a cell that
    runs) answers with why not, so the control thread never waits on a cell."""
    with session.engines.client.lock:
        pending = {r: session.engines.view(r).apply_async(fn, *args) for r in ranks}
    out = {}
    for rank, ar in pending.items():
        try:
            out[rank] = ar.get(timeout=timeout)
        except Exception as e:  # a timeout, or the rank raised
            out[rank] = f"{type(e).__name__}: {e}"
    # the client's records of them go (one still running: once it ends)
    session.engines.client.forget([m for ar in pending.values() for m in ar.msg_ids])
    return out
