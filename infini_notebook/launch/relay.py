"""The kernel's side of the per-host relays (``%dist_start --relay``, docs/scale.md).

:class:`RelayLink` is the only owner of the relays: their processes, the socket they reach
the kernel on, which ranks are connected, and each relayed cell's per-rank futures. A cell
is sent once per host (engine/host_relay.py hands it to each rank); what the ranks answer
comes back packed, and the link fills one future per rank as ipyparallel's client fills
its own (``Client._handle_execute_reply`` and ``_dispatch_iopub``, ipyparallel 9.2): the
reply resolves the future, output updates its ``output.metadata`` and calls its
``iopub_callbacks``, status idle resolves ``output``. So ``kernel/cell.Cell``, ``CellWatch``
and ``execution.collect`` are the same code both ways. A rank's comm messages (widgets)
are handed to ipyparallel's client, which proxies them as for its own requests
(``Client._dispatch_iopub``'s ``comm_open``).

All sockets are served by one thread; a cell to send is handed to it over an inproc pipe,
as zmq sockets are not shared between threads."""

from __future__ import annotations

import base64
import json
import logging
import os
import subprocess
import threading
import time
from typing import Any

from ..core import signing
from ..engine import host_relay
from . import relay_hosts
from .relay_cells import RankFuture, RelayedCell, engine_error

log = logging.getLogger("infini_notebook")

UP, REQUESTS, REPLIES = "relay-up.sock", "relay-rq.sock", "relay-rp.sock"
HERE_WAIT_S = 30.0  # a cell waits this long for its ranks to reach their relay
UP_WAIT_S = 60.0  # relays started (over ssh) have this long to say they are up


def relay_addresses(place: str) -> tuple[str, str]:
    """Where the ranks of the relay whose sockets are in ``place`` connect: (requests,
    replies)."""
    return f"ipc://{os.path.join(place, REQUESTS)}", f"ipc://{os.path.join(place, REPLIES)}"


class RelayGone(RuntimeError):
    """A host's relay ended: its ranks' cells cannot be sent or answered."""


class RelayLink:
    """The session's relays (one per host of ranks; today this machine's) and the cells
    they carry. ``add_host`` starts one; ``prepare`` then ``send`` a cell; ``busy`` is
    which ranks have not answered a cell; ``stop`` ends the relays."""

    def __init__(self, place: str, signing_key: str, client, env: dict | None = None, network=None):
        """``place``: a 0700 folder for the sockets; ``client``: the session's
        launch.client.Client (its ipyparallel session builds and signs requests); ``env``:
        added to the relays' environment (the session's mark, so its watchdog ends them).
        ``network``: (the address to listen on, the one other hosts reach it by) when
        relays run on other hosts: they reach the kernel over TCP, encrypted (CurveZMQ)."""
        import zmq

        self.place, self.key, self.client, self.env = place, signing_key, client, env or {}
        self._ctx = zmq.Context.instance()
        self._up = self._ctx.socket(zmq.ROUTER)
        self._up.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._up.setsockopt(zmq.LINGER, 0)
        self._curve = ""
        if network is None:
            old = os.umask(0o077)
            try:
                self._up.bind(f"ipc://{os.path.join(place, UP)}")
            finally:
                os.umask(old)
            self.up_address = f"ipc://{os.path.join(place, UP)}"
        else:
            public, secret = zmq.curve_keypair()
            self._up.curve_server, self._up.curve_secretkey = True, secret
            # a peer that never completes the handshake holds a file handle this long
            # (0MQ's default 30 s: a thousand of them could use up the kernel's)
            self._up.setsockopt(zmq.HANDSHAKE_IVL, 5000)
            self._curve = public.decode()
            listen, reached = (f"[{a}]" if ":" in a else a for a in network)
            self._up.setsockopt(zmq.IPV6, ":" in network[0])
            self._up.bind(f"tcp://{listen}:0")
            port = self._up.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]
            self.up_address = f"tcp://{reached}:{port}"
        self._pipe_in = self._ctx.socket(zmq.PULL)
        self._pipe_in.bind(f"inproc://relay-{id(self)}")
        self._pipe = self._ctx.socket(zmq.PUSH)
        self._pipe.connect(f"inproc://relay-{id(self)}")
        self._pipe_lock = threading.Lock()
        self._lock = threading.Condition()
        self._hosts: dict[str, dict] = {}  # tag -> {"proc", "seq", "up", "last"}
        self._host_of: dict[int, str] = {}  # rank -> its relay's tag
        self._here: set[int] = set()
        self._cells: dict[str, dict[int, RankFuture]] = {}  # msg_id -> rank -> future
        self._busy: dict[int, str] = {}  # rank -> the cell it has not answered
        self._eids: dict[int, int] = {}
        self._stopping = False
        self.batches = 0  # batches taken from the relays (benchmarks/bench_scale.py)
        self._thread = threading.Thread(target=self._serve, name="relay-link", daemon=True)
        self._thread.start()

    # ----- relays -------------------------------------------------------------------------
    def add_hosts(self, hosts: list[tuple[str, list[int], Any, str]]) -> None:
        """Start a relay per host, ``(tag, ranks, remote, host name)`` each, and wait until
        each is up (RelayGone naming the first that is not). ``remote``: for a relay on
        another host, a function that turns the relay's arguments (from ``-m``) into the
        command that runs it there (ssh); it then makes its own folder there and stays until
        its stdin (the ssh connection) closes. None: this machine."""
        for tag, ranks, remote, name in hosts:  # all started, then waited for
            self._start(tag, ranks, remote)
            self._hosts[tag]["name"] = name
        deadline = time.monotonic() + UP_WAIT_S
        with self._lock:
            for tag, *_ in hosts:
                host = self._hosts[tag]
                self._lock.wait_for(
                    lambda h=host: h["up"] or h["proc"].poll() is not None,
                    max(0.0, deadline - time.monotonic()),
                )
                if not host["up"]:
                    raise RelayGone(self._gone_text(tag))

    def _start(self, tag: str, ranks: list[int], remote) -> None:
        session = self.client.session
        keys = {
            "signing": self.key,
            "jupyter": session.key.decode(),
            "scheme": session.signature_scheme,
            "curve": self._curve,
        }
        args = ["-m", "infini_notebook.engine.host_relay", self.up_address]
        args += [*relay_addresses(self.place), tag] if remote is None else ["-", "-", tag]
        proc = relay_hosts.start(self.place, tag, args, remote, keys, self.env)
        with self._lock:
            self._hosts[tag] = {"proc": proc, "seq": 0, "up": 0, "last": 0}
            for r in ranks:
                self._host_of[r] = tag
                self._here.discard(r)

    def addresses(self, rank: int | None = None, tag: str | None = None) -> tuple[str, str]:
        """Where ``rank`` (or the ranks of the relay ``tag``) reach their host's relay
        (requests, replies)."""
        with self._lock:
            return self._hosts[tag or self._host_of[rank]]["addresses"]

    def ranks_left(self, ranks: list[int]) -> None:
        """``ranks`` are replaced or restarted: not connected until they say hello again,
        and what they owed is forgotten."""
        with self._lock:
            for r in ranks:
                self._here.discard(r)
                self._busy.pop(r, None)

    def map_engines(self, eids: dict[int, int]) -> None:
        """Each rank's engine id (its errors name it, as ipyparallel's do)."""
        self._eids.update(eids)

    def alive(self) -> bool:
        """Every relay still runs."""
        return all(h["proc"].poll() is None for h in self._hosts.values())

    def pids(self) -> list[int]:
        return [h["proc"].pid for h in self._hosts.values()]

    # ----- cells --------------------------------------------------------------------------
    def prepare(self, code: str, label: str, targets: list[int]) -> RelayedCell:
        """The execute request for ``targets``, built and signed once, with a future per
        rank registered before it is sent (no answer can come before its listener)."""
        session = self.client.session
        msg = session.msg(
            "execute_request",
            content={"code": code, "silent": False, "user_expressions": {}},
            metadata={"label": label or None},
        )
        msg_id = msg["header"]["msg_id"]
        frames = session.serialize(msg)
        futures = {r: RankFuture(msg_id, self._eids.get(r, r)) for r in targets}
        with self._lock:
            self._cells[msg_id] = futures
        return RelayedCell(msg_id, frames, futures)

    def send(self, cell: RelayedCell) -> None:
        """Send ``cell`` to each of its ranks' relays, once per relay, when its ranks are
        connected (a rank just bootstrapped may still be saying hello)."""
        targets = list(cell.futures)
        with self._lock:
            ok = self._lock.wait_for(
                lambda: self._here.issuperset(targets) or self._dead_hosts(targets), HERE_WAIT_S
            )
            dead = self._dead_hosts(targets)
            missing = [] if ok else sorted(set(targets) - self._here)
            sent = [r for r in targets if r not in missing]
            if not dead:
                for r in sent:  # owed until its reply (stuck-rank checks read it)
                    self._busy[r] = cell.msg_id
        if dead:
            self.forget(cell)
            raise RelayGone("; ".join(self._gone_text(t) for t in dead))
        if missing:
            self._fail(cell.msg_id, missing, "its engine never reached its host's relay")
        by_host: dict[str, list[int]] = {}
        for r in sent:
            by_host.setdefault(self._host_of[r], []).append(r)
        for tag, ranks in by_host.items():
            self._post([b"cell", tag.encode(), json.dumps(ranks).encode(), *cell.frames])

    def forget(self, cell) -> None:
        """The cell is over: its futures go (a rank still in it stays busy until it ends).
        Any other request (ipyparallel's) is none of the link's."""
        with self._lock:
            futures = self._cells.get(getattr(cell, "msg_id", None), {})
            if all(f.ended for f in futures.values()):
                self._cells.pop(cell.msg_id, None)

    def busy(self) -> set[int]:
        """Ranks that have not answered a relayed cell (stuck, or still running one)."""
        with self._lock:
            return set(self._busy)

    def stop(self) -> None:
        """End the relays and the link."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            tags = list(self._hosts)
        for tag in tags:
            self._post([b"stop", tag.encode()])
        for host in self._hosts.values():
            if host["proc"].stdin and not host["proc"].stdin.closed:
                host["proc"].stdin.close()  # a remote relay's lifeline: it ends either way
            try:
                host["proc"].wait(2)
            except subprocess.TimeoutExpired:
                host["proc"].kill()  # a pid this link started
                host["proc"].wait(5)
        self._post([b"end"])
        self._thread.join(5)

    # ----- the link's thread --------------------------------------------------------------
    def _post(self, frames: list[bytes]) -> None:
        with self._pipe_lock:
            self._pipe.send_multipart(frames)

    def _serve(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._up, zmq.POLLIN)
        poller.register(self._pipe_in, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(1000))
            if self._pipe_in in ready and not self._from_pipe():
                break
            if self._up in ready:
                self._from_relays()
            self._check_relays()
        for sock in (self._up, self._pipe_in, self._pipe):
            sock.close(linger=0)

    def _from_pipe(self) -> bool:
        import zmq

        while True:
            try:
                frames = self._pipe_in.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return True
            what, rest = frames[0], frames[1:]
            if what == b"end":
                return False
            tag = rest[0].decode()
            host = self._hosts[tag]
            host["seq"] += 1
            head = {"seq": host["seq"]}
            if what == b"stop":
                head["stop"] = True
                message = []
            else:
                head["ranks"] = json.loads(rest[1])
                message = rest[2:]
            try:
                signed = host_relay.sign_cell(self.key, tag, head, message)
                self._up.send_multipart([rest[0], *signed], flags=zmq.NOBLOCK)
            except zmq.ZMQError as e:  # the relay is gone: its ranks' parts fail
                if what == b"cell":
                    self._fail_host(tag, f"its host's relay could not be reached ({e})")

    def _from_relays(self) -> None:
        import zmq

        while True:
            try:
                tag, raw = self._up.recv_multipart(flags=zmq.NOBLOCK)[:2]
            except zmq.Again:
                return
            except ValueError:
                continue
            self._batch(tag.decode(errors="replace"), raw)

    def _batch(self, tag: str, raw: bytes) -> None:
        """One relay's batch: checked (signed by the session's key, newer than the last),
        then each item applied in order."""
        host = self._hosts.get(tag)
        body = signing.verify(self.key, f"{host_relay.BATCH}/{tag}", raw) if host else None
        if body is None:
            log.warning("relay: a batch not signed with the session's key, dropped")
            return
        batch = json.loads(body)
        if batch.get("seq", 0) <= host["last"]:
            log.warning("relay: batch %s from %s replayed, dropped", batch.get("seq"), tag)
            return
        host["last"] = batch["seq"]
        self.batches += 1
        for item in batch.get("items", []):
            try:
                self._apply(tag, item)
            except Exception:  # one bad item never stops the link
                log.exception("relay: item %.200r", item)

    def _apply(self, tag: str, item: list) -> None:
        kind, ranks = item[0], item[1]
        if kind == "up":  # the relay's pid, and where its ranks reach it
            with self._lock:
                self._hosts[tag]["addresses"] = tuple(item[2:4])
                self._hosts[tag]["up"] = ranks
                self._lock.notify_all()
            return
        if kind == "here":
            with self._lock:
                for r in ranks:  # a rank is at the relay it said hello to
                    self._host_of[r] = tag
                    self._here.add(r)
                self._lock.notify_all()
            return
        if kind == "missing":
            self._fail(item[2], ranks, "its engine is not connected to its host's relay")
            return
        pid = item[2] if kind != "msg" else _parent(item[2])
        msg_type = item[2]["header"].get("msg_type", "") if kind == "msg" else kind
        if msg_type.startswith("comm_"):  # a widget's, also from a thread after its cell
            self._comm(item[2])
        futures = self._cells.get(pid, {})
        unwrap = self.client.unwrap_exception
        for r in ranks:
            f = futures.get(r)
            if f is None:  # a cell forgotten (a stuck rank ending late): no longer busy
                if msg_type in ("ok", "execute_reply"):
                    self._answered(r, pid)
                continue
            if kind == "ok":
                f.reply({"status": "ok", "execution_count": item[3]}, unwrap)
            elif kind == "idle":
                f.idle()
            elif kind == "stream":
                f.stream(item[3], item[4])
            else:
                f.message(item[2], unwrap)
            if f.done():
                self._answered(r, f.msg_id)

    def _comm(self, msg: dict) -> None:
        """A rank's widget message, handed to ipyparallel's client, which proxies it as
        for its own requests (``Client._dispatch_iopub``'s comm handling)."""
        whole = dict(msg, msg_type=msg["header"]["msg_type"])
        whole["buffers"] = [base64.b64decode(b) for b in msg.get("buffers", [])]
        self.client.dispatch_iopub(whole)

    def engine_gone(self, engine_id: int) -> None:
        """ipyparallel saw the engine unregister: its rank's relayed parts fail at once,
        as ipyparallel fails its own work (``Client._handle_stranded_msgs``)."""
        ranks = [r for r, e in self._eids.items() if e == engine_id]
        for msg_id, futures in list(self._cells.items()):
            self._fail(msg_id, [r for r in ranks if r in futures], "its engine stopped")

    def _answered(self, rank: int, msg_id: str | None) -> None:
        with self._lock:
            if msg_id is None or self._busy.get(rank) == msg_id:
                self._busy.pop(rank, None)

    def _fail(self, msg_id: str, ranks: list[int], why: str) -> None:
        """``ranks``' parts of a cell end as ipyparallel ends a task whose engine left."""
        futures = self._cells.get(msg_id, {})
        for r in ranks:
            f = futures.get(r)
            if f is not None:
                f.fail(engine_error(f"rank {r}: {why}"))
            self._answered(r, None)

    def _fail_host(self, tag: str, why: str) -> None:
        ranks = {r for r, t in self._host_of.items() if t == tag}
        for msg_id, futures in list(self._cells.items()):
            self._fail(msg_id, [r for r in futures if r in ranks], why)

    def _check_relays(self) -> None:
        # a copy: add_hosts adds to it on the kernel's thread while poll() lets it run
        for tag, host in list(self._hosts.items()):
            if host["proc"].poll() is not None and not host.get("failed"):
                host["failed"] = True
                with self._lock:
                    self._lock.notify_all()
                if not self._stopping:
                    self._fail_host(tag, self._gone_text(tag))

    def gone_text(self) -> str:
        """Which relays ended, for an error."""
        dead = [t for t, h in list(self._hosts.items()) if h["proc"].poll() is not None]
        return "; ".join(self._gone_text(t) for t in dead) or "no relay ended"

    def _dead_hosts(self, ranks: list[int]) -> list[str]:
        tags = {self._host_of.get(r) for r in ranks}
        return sorted(t for t in tags if t is None or self._hosts[t]["proc"].poll() is not None)

    def _gone_text(self, tag: str | None) -> str:
        if tag is None:
            return "a rank has no relay"
        host = self._hosts[tag]
        code = host["proc"].poll()
        if code == 255 and host.get("name") != "this machine":  # ssh's own failure
            code = "255: ssh failed (login, host key, connection) or lost its connection"
        elif code is not None and code > 128 and host.get("name") != "this machine":
            code = f"{code}: killed by signal {code - 128}, or ssh's connection lost"
        log_file = relay_hosts.log_path(self.place, tag)
        try:
            said = f"its log: {log_file}" if os.path.getsize(log_file) else "it wrote no log"
        except OSError:
            said = "it wrote no log"
        return f"the relay of {host.get('name', tag)} ended (exit code {code}; {said})"


def _parent(msg: dict) -> str | None:
    return (msg.get("parent_header") or {}).get("msg_id")
