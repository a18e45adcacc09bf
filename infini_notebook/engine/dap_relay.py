"""A rank's debugger, reachable only through a signed link (issue 52; core/dap_frames.py).

``debugpy.listen`` would open a port that speaks plain DAP to whoever connects first, and a
DAP client may evaluate any code in the rank: on loopback that is every local user, on a
rank of another host every machine that reaches it. Instead pydevd connects *out*
(``debugpy.connect``, debugpy/public_api.py -> ``pydevd.settrace``: pydevd then speaks DAP
itself, as in debugpy's in-process adapter mode) to a loopback socket of this process,
accepted only once it is proven to be pydevd's own (the other end of the connection is a
socket of this very process: psutil's table of its connections). The kernel reaches pydevd
through the relay's listener, on loopback or on the address this host reaches the kernel
by (a rank of another host), and only over a link it opened with the session's key.

One kernel link at a time: a newer proven link (a restarted kernel, JupyterLab's debugger
turned off and on) replaces the older. When a link ends, pydevd is sent ``disconnect``: the
breakpoints go and paused threads run on, as when a debugger detaches.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

import psutil

from ..core import dap_frames

log = logging.getLogger("infini_notebook")

HANDSHAKE_S = 5.0  # a connection that has not proven itself by then is closed
HANDSHAKES = 64  # unproven connections at once (a thread each); more are closed as they come
PYDEVD_S = 30.0  # pydevd's connection to us, after debugpy.connect started
DETACH_SEQ = 1 << 30  # the disconnect the relay sends itself: a number no client uses


class Relay:
    """pydevd's connection, and the kernel link that drives it."""

    def __init__(self, key: str, host: str):
        self.key = key
        self.lock = threading.Lock()
        self.link: socket.socket | None = None
        self.out: dap_frames.Direction | None = None  # frames to the kernel
        self.pydevd = _connect_pydevd()
        self.unproven = threading.BoundedSemaphore(HANDSHAKES)
        self.server = socket.create_server((host, 0))
        self.endpoint = self.server.getsockname()[:2]
        _daemon(self._from_pydevd, "infini-dap-pydevd")
        _daemon(self._accept, "infini-dap-accept")

    # ----- the kernel's side --------------------------------------------------------------
    def _accept(self) -> None:
        """Never ends: a failed accept (out of file descriptors while someone floods the
        port) waits a moment and goes on, and at most HANDSHAKES connections are being
        proven at once (each for HANDSHAKE_S at most), so a flood costs neither the
        kernel's link nor the rank's memory."""
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError as e:
                log.info("debugger relay: accept: %s", e)
                time.sleep(0.1)
                continue
            if not self.unproven.acquire(blocking=False):
                _close(conn)
                continue
            _daemon(lambda c=conn: self._handshake(c), "infini-dap-link")

    def _handshake(self, conn: socket.socket) -> None:
        try:
            relay_nonce = dap_frames.new_nonce()
            conn.settimeout(HANDSHAKE_S)
            conn.sendall(dap_frames.hello(relay_nonce))
            answer = _read_answer(conn, time.monotonic() + HANDSHAKE_S)
            kernel_nonce = dap_frames.check_answer(self.key, relay_nonce, answer)
            conn.settimeout(None)
        except (OSError, dap_frames.BadFrame) as e:
            log.info("debugger relay: refused a connection: %s", e)
            _close(conn)
            return
        finally:
            self.unproven.release()
        inbound = dap_frames.Direction(self.key, relay_nonce, kernel_nonce, dap_frames.TO_RANK)
        with self.lock:
            old, self.link = self.link, conn
            self.out = dap_frames.Direction(
                self.key, relay_nonce, kernel_nonce, dap_frames.TO_KERNEL
            )
        if old is not None:
            _close(old)
        self._to_pydevd(conn, inbound)

    def _to_pydevd(self, conn: socket.socket, inbound: dap_frames.Direction) -> None:
        try:
            while True:
                self.pydevd.sendall(inbound.unpack(_read_frame(conn)))
        except (OSError, dap_frames.BadFrame) as e:
            log.info("debugger relay: the kernel's link ended: %s", e)
        with self.lock:
            current = self.link is conn
            if current:
                self.link = self.out = None
        _close(conn)
        if current:  # nobody drives the debugger now: run on, without breakpoints
            bye = {"seq": DETACH_SEQ, "type": "request", "command": "disconnect"}
            try:
                self.pydevd.sendall(dap_frames.dap_message(bye))
            except OSError:
                pass

    # ----- pydevd's side ------------------------------------------------------------------
    def _from_pydevd(self) -> None:
        buffer = b""
        while True:
            chunk = self.pydevd.recv(1 << 16)
            if not chunk:
                return
            messages, buffer = dap_frames.split_dap(buffer + chunk)
            for message in messages:
                if _answers_our_detach(message):
                    continue
                with self.lock:
                    link, out = self.link, self.out
                    if link is None:
                        continue  # an event while nobody listens
                    try:
                        link.sendall(out.pack(message))
                    except OSError:
                        pass  # the link's reader ends it


class Link:
    """A blocking client of a relay (the kernel's, for an editor: kernel/debugpy_bridge.py;
    JupyterLab's proxy has an asyncio one, kernel/dap_link.py)."""

    def __init__(self, relay: tuple[str, int], key: str):
        self.conn = socket.create_connection(relay, timeout=HANDSHAKE_S)
        try:
            relay_nonce = dap_frames.parse_hello(_read_line(self.conn))
            answer, self.out, self.inbound = dap_frames.kernel_side(key, relay_nonce)
            self.conn.sendall(answer)
        except (OSError, dap_frames.BadFrame) as e:
            self.conn.close()
            raise ValueError(f"not a relay that answers: {e}") from None
        self.conn.settimeout(None)

    def send_stream(self, source: socket.socket) -> None:
        """Every DAP message read from ``source``, until it closes, to the rank."""
        buffer = b""
        try:
            while chunk := source.recv(1 << 16):
                messages, buffer = dap_frames.split_dap(buffer + chunk)
                for message in messages:
                    self.conn.sendall(self.out.pack(message))
        except (OSError, dap_frames.BadFrame):
            pass

    def receive(self) -> bytes:
        """The rank's next DAP message (raises at the link's end or a frame not its own)."""
        try:
            return self.inbound.unpack(_read_frame(self.conn))
        except dap_frames.BadFrame as e:
            raise ValueError(str(e)) from None

    def close(self) -> None:
        _close(self.conn)


def _answers_our_detach(message: bytes) -> bool:
    if b"%d" % DETACH_SEQ not in message:
        return False
    try:
        body = json.loads(message[message.index(b"\r\n\r\n") + 4 :])
        return body.get("request_seq") == DETACH_SEQ
    except ValueError:
        return False


def _connect_pydevd() -> socket.socket:
    """pydevd connected to a loopback socket of ours (its only way in or out)."""
    # pydevd's warning that frozen stdlib modules may miss breakpoints, on the rank's
    # stderr (read as pydevd_constants is imported): about the stdlib's frames only
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    import debugpy

    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(PYDEVD_S)
    # a process the cell starts (a DataLoader's workers, a subprocess) runs undebugged:
    # under debugpy's default it would wait for a client that never comes
    debugpy.configure(subProcess=False)
    # connect() waits for configurationDone (pydevd.settrace's wait_for_ready_to_run), which
    # the kernel sends once linked: it runs beside us
    _daemon(lambda: debugpy.connect(server.getsockname()), "infini-dap-connect")
    try:
        while True:
            conn, _ = server.accept()
            if _own(conn):
                return conn
            conn.close()  # another process raced pydevd to our port
    finally:
        server.close()


def _own(conn: socket.socket) -> bool:
    """Whether the other end of ``conn`` is a socket of this process (False for one
    already reset by its other end)."""
    try:
        peer, here = conn.getpeername()[:2], conn.getsockname()[:2]
        mine = psutil.Process().net_connections("tcp")
    except (OSError, psutil.Error):
        return False
    return any(c.raddr and tuple(c.laddr) == peer and tuple(c.raddr) == here for c in mine)


def _read_answer(conn: socket.socket, deadline: float) -> bytes:
    """The kernel's answer to the hello: exactly its size, all of it before ``deadline``
    (a byte every few seconds does not keep a connection unproven for longer)."""
    header = _read_exactly(conn, dap_frames.HEADER, deadline)
    if dap_frames.frame_length(header) != dap_frames.ANSWER_LEN:
        raise dap_frames.BadFrame("an answer to the hello of another size")
    return _read_exactly(conn, dap_frames.ANSWER_LEN, deadline)


def _read_frame(conn: socket.socket) -> bytes:
    length = dap_frames.frame_length(_read_exactly(conn, dap_frames.HEADER))
    return _read_exactly(conn, length)


def _read_line(conn: socket.socket, limit: int = 100) -> bytes:
    line = b""
    while not line.endswith(b"\n") and len(line) < limit:
        line += _read_exactly(conn, 1)
    return line


def _read_exactly(conn: socket.socket, n: int, deadline: float | None = None) -> bytes:
    data = b""
    while len(data) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("too slow")
            conn.settimeout(left)
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the link closed")
        data += chunk
    return data


def _daemon(target, name: str) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    # pydevd neither suspends nor traces it: it relays while the rank is paused
    thread.is_pydev_daemon_thread = True
    thread.pydev_do_not_trace = True
    thread.start()
    return thread


def _close(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()
