"""A rank on another host watches the kernel's store (engine/rank_services.watch_store): a
dropped connection is reconnected, and only a store gone for good ends the rank. Real
TCPStore, real sockets: the watcher reaches the store through a small TCP relay that the
test cuts, as a network blip or a NAT timeout would."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from infini_notebook.core import signing
from infini_notebook.engine.rank_services import ALIVE_KEY, session_root

WATCHER = """\
import sys, time
from infini_notebook.engine.rank_services import watch_store
port, lost_after, token, key = sys.argv[1:]
watch_store("127.0.0.1", int(port), token, key, every=0.2, lost_after=float(lost_after))
print("watching", flush=True)
time.sleep(60)
"""

TOKEN, KEY = "a" * 32, signing.new_key()


def kernel_store() -> dist.TCPStore:
    """A store as the kernel hosts it: the session's signed alive key under its root."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    keys = dist.PrefixStore(session_root(TOKEN), store)
    keys.set(ALIVE_KEY, signing.sign(KEY, ALIVE_KEY, "alive"))
    return store


def end(watcher: subprocess.Popen) -> None:
    """The watcher this test started, killed if it still runs (by its pid: ours)."""
    if watcher.poll() is None:
        watcher.kill()
        watcher.wait()


def start_watcher(port: int, lost_after: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", WATCHER, str(port), str(lost_after), TOKEN, KEY],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


class Relay:
    """Forwards connections on its own port to ``target``; ``cut()`` drops the ones open,
    ``close()`` stops taking new ones."""

    def __init__(self, target: int):
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open: list[socket.socket] = []
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            self.open += [client, server]
            self.accepted += 1
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        for s in self.open:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.open = []

    def close(self) -> None:
        self.cut()
        try:  # wakes the accepting thread: a close alone leaves the socket listening
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()


def test_a_dropped_store_connection_is_reconnected_and_a_lost_store_ends_the_rank():
    store = kernel_store()
    relay = Relay(store.port)
    watcher = start_watcher(relay.port, 3)
    try:
        assert watcher.stdout.readline().strip() == "watching"
        before = relay.accepted
        relay.cut()  # a blip: the store is still there
        deadline = time.monotonic() + 10
        while relay.accepted == before and time.monotonic() < deadline:
            time.sleep(0.05)  # three missed checks, then a new connection
        assert relay.accepted > before, "the watcher did not reconnect"
        time.sleep(4)  # longer than lost_after: it would have ended by now without it
        assert watcher.poll() is None, watcher.stderr.read()
        relay.close()  # now the store is unreachable for good
        t0 = time.monotonic()
        code = watcher.wait(30)
        took = time.monotonic() - t0
    finally:
        end(watcher)
        relay.close()
    assert code == 3
    assert "lost the kernel's store for 3 s" in watcher.stderr.read()
    assert 3 <= took < 15, took


def test_a_foreign_store_on_the_old_port_does_not_keep_the_rank_alive():
    """Issue 44 item 4: the kernel dies, another user binds a TCPStore on the freed port
    (any TCPStore answers a bare check); the rank still ends once lost_after passes."""
    store = kernel_store()
    port = store.port
    watcher = start_watcher(port, 3)
    try:
        assert watcher.stdout.readline().strip() == "watching"
        del store  # the kernel is gone, its port free
        foreign = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5))
        foreign.set(f"{session_root(TOKEN)}/{ALIVE_KEY}", b"alive")  # even under our root
        t0 = time.monotonic()
        code = watcher.wait(30)
        took = time.monotonic() - t0
    finally:
        end(watcher)
    assert code == 3, code
    assert "not the session's" in watcher.stderr.read()
    assert took < 15, took
