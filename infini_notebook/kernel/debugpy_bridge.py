"""``%dist_debugpy --rank 1``: a loopback port an editor (VS Code's "attach") connects to,
bridged to that rank's debugger over the rank's signed relay (engine/dap_relay.py).

An editor speaks plain DAP and cannot sign; a plain DAP port evaluates any code in the rank
for whoever connects. So the bridge accepts a connection only from a socket of this user:
on loopback the kernel itself says whose a socket is (/proc/net/tcp's uid column, the owner
of the connecting socket, which another local user cannot forge), and closes any other.
One client per rank at a time: an editor's link replaces JupyterLab's (and back), as the
relay keeps only its newest link.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from ..engine import dap_relay

log = logging.getLogger("infini_notebook")

_bridges: dict[tuple[int, int], tuple[str, int]] = {}  # (relay port, rank) -> our endpoint
_lock = threading.Lock()


def bridge(relay: tuple[str, int], key: str, rank: int) -> tuple[str, int]:
    """The loopback endpoint bridged to ``relay`` (made once per relay)."""
    with _lock:
        found = _bridges.get((relay[1], rank))
        if found is None:
            server = socket.create_server(("127.0.0.1", 0))
            found = _bridges[(relay[1], rank)] = server.getsockname()[:2]
            threading.Thread(
                target=_serve, args=(server, relay, key), name=f"infini-debugpy-{rank}", daemon=True
            ).start()
    return found


def _serve(server: socket.socket, relay: tuple[str, int], key: str) -> None:
    """Never ends while the kernel runs (a connection reset before it is looked at, a
    failed accept: the next one is served): a bridge that stopped would leave its port to
    be taken by another user, and handed out again."""
    while True:
        try:
            editor, _ = server.accept()
        except OSError as e:
            log.info("%%dist_debugpy: accept: %s", e)
            time.sleep(0.1)
            continue
        try:
            _serve_one(editor, relay, key)
        except OSError as e:
            log.info("%%dist_debugpy: %s", e)
            editor.close()


def _serve_one(editor: socket.socket, relay: tuple[str, int], key: str) -> None:
    if peer_uid(editor) != os.getuid():
        log.warning("%%dist_debugpy: refused a connection from another user")
        editor.close()
        return
    try:
        link = dap_relay.Link(relay, key)
    except (OSError, ValueError) as e:
        log.warning("%%dist_debugpy: the rank's relay: %s", e)
        editor.close()
        return
    threading.Thread(target=_pump_out, args=(editor, link), daemon=True).start()
    threading.Thread(target=_pump_in, args=(editor, link), daemon=True).start()


def _pump_out(editor: socket.socket, link: dap_relay.Link) -> None:
    """The editor's DAP messages, one signed frame each, to the rank."""
    try:
        link.send_stream(editor)
    finally:
        link.close()
        editor.close()


def _pump_in(editor: socket.socket, link: dap_relay.Link) -> None:
    try:
        while True:
            editor.sendall(link.receive())
    except (OSError, ValueError):
        pass
    finally:
        link.close()
        editor.close()


def peer_uid(conn: socket.socket) -> int | None:
    """The uid owning the other end of a loopback TCP connection (IPv4), from the kernel's
    table: ``/proc/net/tcp`` rows are ``sl local rem st ... uid``, addresses as hex
    ``IP:PORT`` with the IPv4 address in host (little-endian) byte order."""
    try:
        ip, port = conn.getpeername()[:2]
        here = conn.getsockname()
    except OSError:  # reset by its other end already
        return None
    want, back = _as_in_table(ip, port), _as_in_table(*here[:2])
    with open("/proc/net/tcp") as table:
        next(table)
        for row in table:
            fields = row.split()
            if fields[1] == want and fields[2] == back:
                return int(fields[7])
    return None


def _as_in_table(ip: str, port: int) -> str:
    return f"{socket.htonl(int.from_bytes(socket.inet_aton(ip), 'big')):08X}:{port:04X}"
