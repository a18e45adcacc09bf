"""A rank on another host follows the kernel's heartbeat in its store
(engine/rank_services.watch_store, core/heartbeat.py): a dropped connection is reconnected,
a deleted or garbled key is looked at again, a copied beat served again is not fresh, and
only no fresh beat for the whole window ends the rank, saying which it saw. Real TCPStore,
real sockets: the watcher reaches the store through a small TCP relay that the test cuts,
as a network blip or a NAT timeout would."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist
from other_user import popen_as_other

from infini_notebook.core import signing
from infini_notebook.core.heartbeat import Freshness, beat, read_beat
from infini_notebook.engine.rank_services import ALIVE_KEY, session_root
from infini_notebook.launch.heartbeat import Heartbeat

# Says "watching" once it took two fresh beats on its connection (the state every test
# starts from; a fixed sleep raced the watcher's torch import on a loaded machine).
WATCHER = """\
import sys, threading, time
from infini_notebook.core import heartbeat
from infini_notebook.engine.rank_services import watch_store
port, lost_after, token, key = sys.argv[1:]
linked, take = threading.Event(), heartbeat.Freshness.take
def take_and_tell(self, seq, now):
    fresh = take(self, seq, now)
    if self.fresh_on_link >= 2:
        linked.set()
    return fresh
heartbeat.Freshness.take = take_and_tell
watch_store("127.0.0.1", int(port), token, key, every=0.2, lost_after=float(lost_after))
print("watching" if linked.wait(60) else "no beats taken in 60 s", flush=True)
time.sleep(60)
"""

TOKEN, KEY = "a" * 32, signing.new_key()

# Another user's store on the freed port, serving a copied beat again and again. It imports
# torch first and takes the port on stdin, so that it binds at once when told.
FOREIGN = """\
import sys, time
from datetime import timedelta
import torch.distributed as dist
print("ready", flush=True)
port, key, value = sys.stdin.readline().split()
port, value = int(port), bytes.fromhex(value)
store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5))
print("serving", flush=True)
for _ in range(600):
    store.set(key, value)
    time.sleep(0.05)
"""


def kernel_store() -> tuple[dist.TCPStore, Heartbeat]:
    """A store as the kernel hosts it, with its heartbeat (every 0.2 s here)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    keys = dist.PrefixStore(session_root(TOKEN), store)
    keys.set(ALIVE_KEY, beat(KEY, 0, time.time()))
    port = store.port  # not the store: the beats must not keep the server alive

    def connect():
        client = dist.TCPStore("127.0.0.1", port, is_master=False)
        return dist.PrefixStore(session_root(TOKEN), client)

    return store, Heartbeat(connect, KEY, every=0.2)


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
    store, beats = kernel_store()
    relay = Relay(store.port)
    watcher = start_watcher(relay.port, 2)
    try:
        assert watcher.stdout.readline().strip() == "watching"
        before = relay.accepted
        relay.cut()  # a blip: the store is still there
        deadline = time.monotonic() + 10
        while relay.accepted == before and time.monotonic() < deadline:
            time.sleep(0.05)  # three missed checks, then a new connection
        assert relay.accepted > before, "the watcher did not reconnect"
        time.sleep(3)  # longer than lost_after: it would have ended by now without it
        assert watcher.poll() is None, watcher.stderr.read()
        relay.close()  # now the store is unreachable for good
        t0 = time.monotonic()
        code = watcher.wait(30)
        took = time.monotonic() - t0
    finally:
        end(watcher)
        relay.close()
        beats.stop()
    assert code == 3
    said = watcher.stderr.read()
    import re

    waited = re.search(r"no fresh signed heartbeat from the kernel for (\d+) s", said)
    assert waited and 2 <= int(waited.group(1)) <= 10, said  # a connect may run past it
    assert "the store could not be reached" in said, said
    assert 2 <= took < 15, took


# The kernel's store and heartbeat in a process of their own, so that it can die as a kernel
# does (every connection reset by the OS): a store object deleted in this process stops
# listening but may leave its connections open. Prints the port; stops beating at "stop".
KERNEL = """\
import sys, time
from datetime import timedelta
import torch.distributed as dist
from infini_notebook.engine.rank_services import session_root
from infini_notebook.launch.heartbeat import Heartbeat
token, key = sys.argv[1:]
store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
port = store.port
def connect():
    client = dist.TCPStore("127.0.0.1", port, is_master=False)
    return dist.PrefixStore(session_root(token), client)
beats = Heartbeat(connect, key, every=0.2)
print(port, flush=True)
sys.stdin.readline()
beats.stop()
print("stopped", flush=True)
time.sleep(600)
"""


def test_a_copied_heartbeat_served_from_a_foreign_store_does_not_keep_the_rank_alive():
    """Issue 49: the signed alive value was the same for the whole session; copied, then
    served from a store on the same port once the kernel's had ended, it kept a remote rank
    alive for over 110 s. Now the copy (the newest beat, re-set all the time) is old news,
    and the connection it is served on is not the one the rank had to the kernel's."""
    kernel = subprocess.Popen(
        [sys.executable, "-c", KERNEL, TOKEN, KEY],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    foreign = subprocess.Popen(  # as uid 65534 where it can: another user's store
        [sys.executable, "-c", FOREIGN],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **popen_as_other(),
    )  # fmt: skip
    try:
        port = int(kernel.stdout.readline())
        watcher = start_watcher(port, 3)
        assert watcher.stdout.readline().strip() == "watching"
        assert foreign.stdout.readline().strip() == "ready"
        kernel.stdin.write("stop\n")
        kernel.stdin.flush()
        assert kernel.stdout.readline().strip() == "stopped"
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
        copied = dist.PrefixStore(session_root(TOKEN), client).get(ALIVE_KEY)  # the attacker's
        assert read_beat(KEY, copied) is not None
        del client
        end(kernel)  # SIGKILL: the kernel is gone, its port free
        foreign.stdin.write(f"{port} {session_root(TOKEN)}/{ALIVE_KEY} {copied.hex()}\n")
        foreign.stdin.flush()
        assert foreign.stdout.readline().strip() == "serving"
        t0 = time.monotonic()
        code = watcher.wait(30)
        took = time.monotonic() - t0
    finally:
        end(kernel)
        if "watcher" in locals():
            end(watcher)
        end(foreign)
    assert code == 3, code
    said = watcher.stderr.read()
    assert "no fresh signed heartbeat" in said and "only an old heartbeat" in said, said
    assert took < 10, took


def test_a_heartbeat_deleted_every_100ms_never_ends_the_rank(capfd):
    """Issue 49: deleting the alive key ended every remote rank within 60 s although the
    kernel was alive. Deleted every 100 ms for over 2 windows: the rank stays; the kernel says
    it once."""
    store, beats = kernel_store()
    watcher = start_watcher(store.port, 2)
    keys = dist.PrefixStore(session_root(TOKEN), store)
    try:
        assert watcher.stdout.readline().strip() == "watching"
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5:  # over 2 windows of 2 s
            keys.delete_key(ALIVE_KEY)
            time.sleep(0.1)
        assert watcher.poll() is None, watcher.stderr.read()
    finally:
        end(watcher)
        beats.stop()
    assert capfd.readouterr().err.count("heartbeat was deleted from its store") == 1


# Another user keeping the kernel's beat from the rank: the key overwritten with an old copy
# and deleted, in a tight loop (hundreds of thousands of writes a second's worth).
FLOODER = """\
import sys, time
from datetime import timedelta
import torch.distributed as dist
port, key, seconds = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
old = store.get(key)
print("flooding", flush=True)
writes, end = 0, time.monotonic() + seconds
while time.monotonic() < end:
    store.set(key, old)
    store.delete_key(key)
    writes += 2
print(writes, flush=True)
"""


def test_a_beat_kept_from_the_rank_by_a_tight_loop_of_writes_never_ends_it():
    """Issue 49's review: overwriting the key with an old beat, or deleting it, with no
    pause ended the rank in one window although the kernel lived (its fresh beats were
    never read). Its connection to the kernel's store, made before and still answering,
    keeps it: the store lives in the kernel's process."""
    store, beats = kernel_store()
    watcher = start_watcher(store.port, 2)
    flooder = None
    try:
        assert watcher.stdout.readline().strip() == "watching"
        flooder = subprocess.Popen(
            [sys.executable, "-c", FLOODER, str(store.port), f"{session_root(TOKEN)}/{ALIVE_KEY}",
             "6"],
            stdout=subprocess.PIPE, text=True, **popen_as_other(),
        )  # fmt: skip
        assert flooder.stdout.readline().strip() == "flooding"
        writes = int(flooder.stdout.readline())  # 6 s: 3 windows
        assert writes > 10_000, writes
        assert watcher.poll() is None, watcher.stderr.read()
    finally:
        end(watcher)
        if flooder is not None:
            end(flooder)
        beats.stop()


def test_freshness_takes_only_newer_beats_by_its_own_clock():
    key = signing.new_key()
    fresh = Freshness(window=10, since=100.0)
    assert fresh.take(read_beat(key, beat(key, 0, 0.0)), 101)  # the first beat
    assert not fresh.take(read_beat(key, beat(key, 0, 9e9)), 105)  # replayed: a later time
    assert "only an old heartbeat (sequence 0" in fresh.seen  # is no help
    assert not fresh.take(read_beat(key, b"0" * 64 + b'{"seq": 9}'), 106)  # unsigned
    assert not fresh.take(read_beat(signing.new_key(), beat(key, 5, 0)), 106)  # other key
    assert not fresh.expired(110) and fresh.expired(111.5)  # 10 s after the last fresh one
    assert fresh.take(read_beat(key, beat(key, 7, -1e9)), 111)  # newer: fresh, any clock
    assert fresh.last == 7 and not fresh.expired(120)
    assert "sequence 7" in fresh.last_words(125)


def test_the_window_of_a_remote_rank_is_set_by_its_environment(capsys):
    from infini_notebook.engine.rank_services import LOST_AFTER_ENV, store_lost_after

    assert store_lost_after({}) == 60.0
    assert store_lost_after({LOST_AFTER_ENV: "300"}) == 300.0
    for bad in ("soon", "0.5", "-3"):
        assert store_lost_after({LOST_AFTER_ENV: bad}) == 60.0
        assert (
            f"{LOST_AFTER_ENV}={bad!r} is not a number of seconds >= 2" in capsys.readouterr().err
        )


def test_a_connection_that_brought_fresh_beats_and_answers_holds_the_window_open():
    fresh = Freshness(window=2.0, since=0.0)
    fresh.connected(0.0)
    assert fresh.take(5, 0.5) and fresh.take(6, 1.0)  # two fresh beats on this connection
    fresh.reply(10.0)
    assert not fresh.expired(10.0)  # no beat for 9 s, but the kernel's store answers
    assert fresh.expired(16.0)  # ... then it stopped answering
    fresh.connected(11.0)  # remade: a store on the freed port, maybe
    assert fresh.take(7, 11.2)  # the newest beat, copied before the kernel died
    assert not fresh.take(7, 11.4)  # ... served again and again
    fresh.reply(14.0)
    assert fresh.expired(14.0)  # one fresh beat on a connection does not hold it
    fresh.unreachable("refused")
    assert fresh.linked is None and fresh.expired(14.0)
