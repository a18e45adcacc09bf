"""One simulated host: many ipyparallel engine identities served by one process, speaking
ipyparallel 9's engine protocol to a real controller (what ``ipyparallel/engine/app.py``
and ``engine/kernel.py`` do, without IPython or torch). For bench_scale.py: the kernel's
side of a session with 1,024 ranks, on one machine.

    python benchmarks/sim_host.py ENGINE_JSON --engines K [--host-index I] [--store HOST:PORT]
        [--relay REQUESTS REPLIES]

Each identity registers as an engine (``registration_request`` on the controller's
registration socket), answers the heartbeat with its own DEALER, and on its own shell
ROUTER (connected to mux, task and one broadcast leaf, as an engine is) answers:

- ``execute_request``: the code run with ``exec`` in the identity's namespace (``rank`` and
  ``host`` in it), stdout and stderr captured and published as ``stream``, errors as
  ``error`` with a traceback, then status idle: what a session's engine publishes, whose
  ipykernel engine/tuning.py trims of status busy and ``execute_input`` (``--stock``
  publishes both, as an untrimmed engine does);
- ``apply_request``: the function called here (``ipyparallel.serialize``), its result or
  error in the reply (a function that needs torch fails, as it should);
- broadcast requests: the same, with the broadcast metadata echoed, so that a
  BroadcastView with coalesced replies works too.

The identities share one iopub PUB socket and one heartbeat SUB (neither has an identity
that matters). With ``--store``, each identity also does what a rank does with the
kernel's TCPStore: its bootstrap (a key of its own set, a counter added to; then the host
waits for ``sim/ready``, which the kernel sets once all joined) and a telemetry key,
signed with ``SIM_MAC_KEY`` as a rank signs it, set every ``--telemetry-s``. The store
client per identity is real (torch).

With ``--relay`` (bench_scale.py --relay), each identity also takes cells from its host's
relay (engine/host_relay.py) as a rank's engine/relay_port.py does: a DEALER with the
rank's tag, a hello, and what a request produces sent to the relay's PULL, tagged.

Prints ``registered K`` once every identity has its id, then serves until stdin closes or
SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import sys
import threading
import traceback
import uuid
from datetime import datetime, timezone

import zmq
from ipyparallel import serialize
from jupyter_client.session import Session


def utcnow():
    return datetime.now(timezone.utc)


class Identity:
    """One simulated engine: its sockets, id and namespace."""

    def __init__(self, ctx, info: dict, session: Session, host: int, stock: bool):
        self.stock = stock  # publish busy and execute_input, as an untrimmed ipykernel does
        self.uuid = str(uuid.uuid4())
        self.bident = self.uuid.encode()
        self.info, self.session, self.ctx = info, session, ctx
        self.host = host
        self.id: int | None = None
        self.ns: dict = {"rank": None, "host": host, "__name__": "__main__"}
        self.count = 0
        self.reg = ctx.socket(zmq.DEALER)
        self.reg.IDENTITY = self.bident
        self.reg.connect(self.url("registration"))
        session.send(self.reg, "registration_request", content={"uuid": self.uuid})
        self.shell = self.pong = None

    def url(self, key: str, port=None) -> str:
        return f"{self.info['interface']}:{port if port is not None else self.info[key]}"

    def registered(self) -> None:
        """The registration reply came: connect the shell and the heartbeat's pong."""
        idents, msg = self.session.feed_identities(self.reg.recv_multipart())
        content = self.session.deserialize(msg)["content"]
        if content["status"] != "ok":
            raise RuntimeError(f"registration failed: {content}")
        self.id = content["id"]
        self.ns["rank"] = self.id
        self.reg.close(linger=0)
        broadcast = self.info["broadcast"]
        self.shell = self.ctx.socket(zmq.ROUTER)
        self.shell.IDENTITY = self.bident
        for addr in (
            self.url("mux"),
            self.url("task"),
            self.url("", broadcast[self.id % len(broadcast)]),
        ):
            self.shell.connect(addr)
        self.pong = self.ctx.socket(zmq.DEALER)
        self.pong.IDENTITY = self.bident
        self.pong.connect(self.url("hb_pong"))

    def connect_relay(self, requests: str) -> None:
        """--relay: cells come from the host's relay, as to a rank (engine/relay_port.py)."""
        self.inbox = self.ctx.socket(zmq.DEALER)
        self.inbox.IDENTITY = b"r%d" % self.id
        self.inbox.connect(requests)
        self.inbox.send(b"hello")

    def topic(self, what: str) -> bytes:
        return f"engine.{self.id}.{what}".encode()

    def handle(self, iopub, outbox=None) -> None:
        """A request on the shell; with ``outbox`` (--relay), one the relay handed over,
        and everything it produces goes to the relay's PULL, tagged with the rank."""
        sock = self.shell if outbox is None else self.inbox
        idents, raw = self.session.feed_identities(sock.recv_multipart(copy=False), copy=False)
        msg = self.session.deserialize(raw, content=True, copy=False)
        if outbox is not None:  # each rank checks a relayed cell once; here they share a Session
            self.session.digest_history.discard(bytes(raw[0]))
        kind = msg["header"]["msg_type"]
        md_in = msg.get("metadata", {})
        md = {
            "started": utcnow(),
            "dependencies_met": True,
            "engine": self.uuid,
            "is_broadcast": md_in.get("is_broadcast", False),
            "is_coalescing": md_in.get("is_coalescing", False),
            "original_msg_id": md_in.get("original_msg_id", ""),
            "label": md_in.get("label"),
        }

        def pub(kind: str, content: dict) -> None:  # on iopub, as the engine's own
            meta = {"engine": self.uuid}
            to, ident = (iopub, self.topic(kind)) if outbox is None else (outbox, tag)
            self.session.send(to, kind, content, parent=msg, ident=ident, metadata=meta)

        tag = b"r%d" % self.id

        if self.stock:
            pub("status", {"execution_state": "busy"})
        buffers = None
        if kind == "execute_request":
            self.count += 1
            code = msg["content"]["code"]
            if self.stock:
                pub("execute_input", {"code": code, "execution_count": self.count})
            reply = self._run(code, pub)
            reply["execution_count"] = self.count
            reply_type = "execute_reply"
        elif kind == "apply_request":
            reply, buffers = self._apply(msg)
            reply_type = "apply_reply"
        else:  # nothing else is simulated: said, not hung
            reply = {
                "status": "error",
                "ename": "NotImplementedError",
                "evalue": kind,
                "traceback": [],
            }
            reply_type = kind.replace("_request", "_reply")
        md["status"] = reply["status"]
        if reply["status"] == "error":
            md["engine_info"] = {"engine_uuid": self.uuid, "engine_id": self.id}
        to, ident = (self.shell, idents) if outbox is None else (outbox, tag)
        self.session.send(
            to, reply_type, reply, parent=msg, ident=ident, metadata=md, buffers=buffers
        )
        pub("status", {"execution_state": "idle"})

    def _run(self, code: str, pub) -> dict:
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                exec(compile(code, f"<cell {self.count}>", "exec"), self.ns)
            reply = {"status": "ok", "user_expressions": {}, "payload": []}
        except Exception as e:
            reply = {"status": "error", "ename": type(e).__name__, "evalue": str(e),
                     "traceback": traceback.format_exception(e)}  # fmt: skip
        for name, buf in (("stdout", out), ("stderr", err)):
            if buf.getvalue():
                pub("stream", {"name": name, "text": buf.getvalue()})
        if reply["status"] == "error":
            pub("error", {k: reply[k] for k in ("ename", "evalue", "traceback")})
        return reply

    def _apply(self, msg) -> tuple[dict, list | None]:
        try:
            # interactive functions (pull, push) get the identity's namespace as globals
            f, args, kwargs = serialize.unpack_apply_message(msg["buffers"], g=self.ns, copy=False)
            result = f(*args, **kwargs)
            return {"status": "ok"}, serialize.serialize_object(result)
        except Exception as e:
            return {"status": "error", "ename": type(e).__name__, "evalue": str(e),
                    "traceback": traceback.format_exception(e)}, None  # fmt: skip


def serve(
    info: dict,
    n: int,
    host: int,
    store: str | None,
    telemetry_s: float,
    stock: bool,
    relay: tuple[str, str] | None = None,
) -> None:
    if store:  # imported before registering, as a rank's engine has torch before it serves
        import torch.distributed  # noqa: F401
    ctx = zmq.Context()
    ctx.MAX_SOCKETS = 4 * n + 64
    session = Session(
        key=info["key"].encode(), signature_scheme=info["signature_scheme"],
        packer="json", unpacker="json", username=f"sim-host-{host}",
    )  # fmt: skip
    iopub = ctx.socket(zmq.PUB)
    iopub.SNDHWM = 0
    iopub.connect(f"{info['interface']}:{info['iopub']}")
    ping = ctx.socket(zmq.SUB)
    ping.setsockopt(zmq.SUBSCRIBE, b"")
    ping.connect(f"{info['interface']}:{info['hb_ping']}")
    poller = zmq.Poller()
    poller.register(ping, zmq.POLLIN)
    ids = [Identity(ctx, info, session, host, stock) for _ in range(n)]
    waiting = {x.reg: x for x in ids}
    for x in ids:
        poller.register(x.reg, zmq.POLLIN)
    by_shell, by_inbox = {}, {}
    outbox = None
    if relay:  # one PUSH for the host's identities: each message carries its rank's tag
        outbox = ctx.socket(zmq.PUSH)
        outbox.SNDHWM = 0
        outbox.connect(relay[1])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    while not stop.is_set():
        for sock, _ in poller.poll(100):
            if sock is ping:  # every identity's heart answers the controller's ping
                frames = ping.recv_multipart()
                for x in ids:
                    if x.pong is not None:
                        x.pong.send_multipart(frames)
            elif sock in waiting:
                x = waiting.pop(sock)
                poller.unregister(sock)
                x.registered()
                by_shell[x.shell] = x
                poller.register(x.shell, zmq.POLLIN)
                if relay:
                    x.connect_relay(relay[0])
                    by_inbox[x.inbox] = x
                    poller.register(x.inbox, zmq.POLLIN)
                if not waiting:
                    print("registered", n, flush=True)
                    if store:
                        threading.Thread(
                            target=store_load, args=(store, ids, telemetry_s, stop), daemon=True
                        ).start()
            elif sock in by_inbox:
                by_inbox[sock].handle(iopub, outbox)
            else:
                by_shell[sock].handle(iopub)
    os._exit(0)  # sockets unclosed: the controller sees the hearts stop


def store_load(addr: str, ids: list[Identity], every: float, stop: threading.Event) -> None:
    """Each identity's use of the kernel's TCPStore, as a rank's: bootstrap, then telemetry."""
    from datetime import timedelta

    import torch.distributed as dist

    host, port = addr.rsplit(":", 1)
    clients = [
        dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=120)) for _ in ids
    ]
    for x, s in zip(ids, clients):  # bootstrap: who I am, counted in
        s.set(f"sim/identity/{x.id}", json.dumps({"pid": os.getpid(), "host": x.host}))
        s.add("sim/joined", 1)
    clients[0].wait(["sim/ready"])  # the kernel sets it once every rank joined
    from infini_notebook.core import signing
    from infini_notebook.engine.rank_services import telemetry_key

    mac_key = os.environ["SIM_MAC_KEY"]  # signed as a rank signs: the kernel verifies
    body = json.dumps({"rss": 1 << 30, "cpu_percent": 3.0, "memory_used": 0})
    while True:
        for x, s in zip(ids, clients):
            key = telemetry_key(x.id)
            s.set(key, signing.sign(mac_key, key, body))
        if stop.wait(every):
            return


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("engine_json")
    p.add_argument("--engines", type=int, required=True)
    p.add_argument("--host-index", type=int, default=0)
    p.add_argument("--store", default=None, help="HOST:PORT of the kernel's TCPStore")
    p.add_argument("--telemetry-s", type=float, default=1.0)
    p.add_argument("--stock", action="store_true", help="publish busy and execute_input too")
    p.add_argument("--relay", nargs=2, metavar=("REQUESTS", "REPLIES"),
                   help="take cells from this host's relay (engine/host_relay.py)")  # fmt: skip
    a = p.parse_args()
    with open(a.engine_json) as f:
        info = json.load(f)
    serve(info, a.engines, a.host_index, a.store, a.telemetry_s, a.stock, a.relay)


if __name__ == "__main__":
    main()
