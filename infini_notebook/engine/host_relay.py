"""The per-host relay (``%dist_start --relay``, docs/scale.md): one process per host of ranks
that takes each cell once from the kernel, hands it to each of the host's ranks
(engine/relay_port.py), and sends the kernel what they answer packed: one signed message per
batch, instead of two or more signed messages per rank through ipyparallel's controller and
client. So the kernel's cost of a cell grows with hosts, and per rank only by what the
ranks said.

    python -m infini_notebook.engine.host_relay UP REQUESTS REPLIES TAG KERNEL_PID  (keys on stdin)
    python -m infini_notebook.engine.host_relay UP - - TAG -   (another host: started over ssh)

UP is the kernel's ROUTER (launch/relay.py); REQUESTS (a ROUTER, the ranks' DEALERs connect
with their tag ``r<rank>``) and REPLIES (a PULL, the ranks' PUSHes) are bound here. On the
kernel's host the relay ends when its parent is no longer the kernel. On another host (``-``)
it makes a 0700 folder of its own for those two sockets, says where they are in its first
batch, reaches the kernel over TCP with CurveZMQ (the server's public key comes with the keys,
as ipyparallel's engines get the controller's), and ends when its stdin closes: the ssh
connection that started it, the kernel's lifeline, is gone. Every
message is checked: a cell by the session's key (``core/signing``, numbered, so a replay is
dropped), a rank's message by the ranks' Jupyter HMAC. What is not signed, or is no message,
is dropped with a line in the log. Sockets live in the session's 0700 folder: the signatures
are a second wall, not the first.

Packing (``pack``, pure) keeps each rank's own order. What several ranks sent alike (a
stream line, an ok reply, an idle status) is sent once with their ranks, only where that
keeps each rank's order; what is sent is what arrived by the time the relay looked (no
timer, so nothing waits)."""

from __future__ import annotations

import base64
import collections
import hmac
import json
import logging
import os
import shutil
import sys
import traceback

from ..core import signing
from .relay_port import DELIM

CELL, BATCH = "relay-cell", "relay-batch"  # the names the two directions are signed under
MAX_BATCH = 4096  # rank messages packed into one batch at most
SEEN_KEPT = 2**16  # the ranks' signatures remembered against replays (as Session keeps them)


def pack(messages: list[tuple[int, dict]]) -> list[list]:
    """Items for the kernel from ``(rank, message)`` in arrival order:

    - ``["ok", ranks, parent_id, execution_count]``: an ok execute reply;
    - ``["idle", ranks, parent_id]``: status idle (other statuses are left out);
    - ``["stream", ranks, parent_id, name, text]``;
    - ``["msg", [rank], message]``: anything else, whole (header, parent_header,
      metadata, content, buffers as base64).

    A rank is added to an earlier item alike only if that item comes after its own last
    one: replayed in item order, each rank's messages come in the order it sent them."""
    items: list[list] = []
    last: dict[int, int] = {}  # rank -> index of its last item
    alike: dict[tuple, int] = {}  # mergeable key -> index of the latest item with it
    for rank, msg in messages:
        key, item = _item(rank, msg)
        if item is None:
            continue
        at = alike.get(key) if key is not None else None
        if at is not None and at > last.get(rank, -1):
            items[at][1].append(rank)
        else:
            at = len(items)
            items.append(item)
            if key is not None:
                alike[key] = at
        last[rank] = at
    return items


def _item(rank: int, msg: dict) -> tuple[tuple | None, list | None]:
    kind = msg["header"].get("msg_type")
    parent = msg.get("parent_header") or {}
    pid = parent.get("msg_id")
    content = msg.get("content") or {}
    if kind == "status":
        if content.get("execution_state") != "idle":
            return None, None
        return ("idle", pid), ["idle", [rank], pid]
    if kind == "execute_reply" and content.get("status") == "ok":
        count = content.get("execution_count")
        return ("ok", pid, count), ["ok", [rank], pid, count]
    if kind == "stream":
        name, text = content.get("name"), content.get("text", "")
        return ("stream", pid, name, text), ["stream", [rank], pid, name, text]
    whole = {k: msg.get(k) for k in ("header", "parent_header", "metadata", "content")}
    whole["header"] = {k: str(v) for k, v in whole["header"].items()}  # dates as text
    whole["buffers"] = [base64.b64encode(bytes(b)).decode() for b in msg.get("buffers", [])]
    return None, ["msg", [rank], whole]


def rank_of(tag: bytes) -> int | None:
    """The rank a tag ``r<rank>`` names (at most 7 digits), else None."""
    if not (tag.startswith(b"r") and 1 < len(tag) <= 8 and tag[1:].isdigit()):
        return None
    return int(tag[1:])


def shape_problem(msg: dict) -> str | None:
    """What makes a signed message unfit to pass on (a rank's own code can send anything
    its session signs), or None: the fields packing reads must have their types."""
    header, parent, content = msg["header"], msg["parent_header"], msg["content"]
    if not all(isinstance(x, dict) for x in (header, parent, content, msg["metadata"])):
        return "header, parent, metadata and content must be objects"
    if not isinstance(header.get("msg_type"), str):
        return "no message type"
    if not isinstance(parent.get("msg_id", ""), str):
        return "a parent id that is no string"
    kind = header["msg_type"]
    if kind == "stream" and not (
        isinstance(content.get("name"), str) and isinstance(content.get("text", ""), str)
    ):
        return "a stream whose name or text is no string"
    if kind == "execute_reply" and not isinstance(content.get("execution_count", 0), int | None):
        return "an execution count that is no number"
    return None


def _dumps(obj) -> bytes | None:
    """JSON of ``obj``, or None where it cannot be written (a rank's display nested deeper
    than this process may recurse: it must not end the relay)."""
    try:
        return json.dumps(obj, default=str).encode()
    except (RecursionError, ValueError, TypeError):
        return None


def _unpack(raw: bytes):
    """JSON as Jupyter's unpacker reads it (``jupyter_client.jsonutil``'s ``json_unpacker``):
    bytes that are not UTF-8 (a non-UTF-8 file name printed) replaced, not refused."""
    return json.loads(raw.decode("utf8", "replace"))


def sign_cell(key: str, host: str, head: dict, message: list[bytes]) -> list[bytes]:
    """A cell as the kernel sends it to ``host``'s relay: ``[tag, head, *message]``, the
    tag over both and the host (a cell for one host is no cell for another)."""
    raw = json.dumps(head).encode()
    name = f"{CELL}/{host}"
    tag = signing.sign(key, name, raw + b"\0" + b"".join(message))[: signing.TAG_LEN]
    return [tag, raw, *message]


def verify_cell(key: str, host: str, frames: list[bytes]) -> dict | None:
    """The head of a cell for ``host`` signed with ``key``; None for anything else."""
    if len(frames) < 2:
        return None
    tag, raw, message = frames[0], frames[1], frames[2:]
    if signing.verify(key, f"{CELL}/{host}", tag + raw + b"\0" + b"".join(message)) is None:
        return None
    try:
        head = json.loads(raw)
    except ValueError:
        return None
    return head if isinstance(head, dict) else None


class Relay:
    """The relay's sockets and its two checks; ``run`` serves until the kernel says stop."""

    def __init__(
        self, up: str, requests: str, replies: str, tag: str, keys: dict, parent: int | None = 0
    ):
        """``parent``: the kernel's pid (the relay ends when its parent is no longer it); None
        on another host, where the relay ends when its stdin closes. ``keys["curve"]``: the
        kernel's CurveZMQ public key, when UP is reached over the network."""
        import zmq
        from jupyter_client.session import Session

        self.zmq = zmq
        self.key, self.tag = keys["signing"], tag
        # The ranks' messages are signed with the engines' Jupyter key (ipyparallel's); with
        # CurveZMQ (ranks on other hosts) ipyparallel leaves the key empty and signs nothing:
        # the ranks then reach the relay only through its 0700 folder
        self.session = None
        if keys["jupyter"]:
            self.session = Session(key=keys["jupyter"].encode(), signature_scheme=keys["scheme"])
        ctx = zmq.Context.instance()
        self.up = ctx.socket(zmq.DEALER)
        self.up.setsockopt(zmq.IDENTITY, tag.encode())
        self.up.setsockopt(zmq.LINGER, 1000)
        if keys.get("curve"):  # encrypted and the kernel authenticated, as ipyparallel's
            self.up.curve_serverkey = keys["curve"].encode()
            self.up.curve_publickey, self.up.curve_secretkey = zmq.curve_keypair()
        self.ranks = ctx.socket(zmq.ROUTER)
        self.ranks.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a rank not here: said, not lost
        # No ROUTER_HANDOVER: a second connection with a rank's tag does not take the rank's
        # place (a replaced rank's old connection is gone before the new one says hello)
        self.inbox = ctx.socket(zmq.PULL)
        os.umask(0o077)  # the sockets' files: this user's only (the folder is 0700 too)
        self.ranks.bind(requests)
        self.inbox.bind(replies)
        self.up.setsockopt(zmq.IPV6, up.startswith("tcp://["))  # as the kernel binds it
        self.up.connect(up)
        self.addresses = [requests, replies]  # said to the kernel in the first batch
        self.parent = os.getppid() if parent == 0 else parent
        self.cells_seen = 0  # the number of the last cell taken: a replayed one is dropped
        self.seen: set[bytes] = set()  # the ranks' signatures seen (Session's digest_history)
        self.seen_order: collections.deque = collections.deque()
        self.sent = 0

    def run(self) -> None:
        zmq = self.zmq
        poller = zmq.Poller()
        for sock in (self.up, self.ranks, self.inbox):
            poller.register(sock, zmq.POLLIN)
        lifeline = sys.stdin.fileno() if self.parent is None else None
        if lifeline is not None:
            poller.register(lifeline, zmq.POLLIN)
        self._send([["up", os.getpid(), *self.addresses]])
        parent = self.parent
        while True:
            ready = dict(poller.poll(1000))
            if parent is not None and os.getppid() != parent:  # the kernel ended: so does its relay
                return
            if lifeline in ready and not os.read(lifeline, 4096):  # ssh's connection closed
                return
            if self.up in ready and not self._from_kernel():
                return
            if self.ranks in ready:
                self._hellos()
            if self.inbox in ready:
                self._from_ranks()

    def _from_kernel(self) -> bool:
        """A cell to hand to ranks, or stop; False to stop."""
        frames = self.up.recv_multipart(copy=True)
        head = verify_cell(self.key, self.tag, frames)
        if head is None:
            log.warning("a cell not signed with the session's key, dropped")
            return True
        return self._act(head, frames[2:])

    def _act(self, head: dict, message: list[bytes]) -> bool:
        if head.get("seq", 0) <= self.cells_seen:
            log.warning("cell %s replayed, dropped", head.get("seq"))
            return True
        self.cells_seen = head["seq"]
        if head.get("stop"):
            return False
        missing = []
        for r in head.get("ranks", []):
            try:
                self.ranks.send_multipart([b"r%d" % r, *message], flags=self.zmq.NOBLOCK)
            except self.zmq.ZMQError:  # not connected, or its queue full
                missing.append(r)
        if missing:
            self._send([["missing", missing, head.get("msg_id")]])
        return True

    def _hellos(self) -> None:
        here = []
        while True:
            try:
                tag, *_ = self.ranks.recv_multipart(flags=self.zmq.NOBLOCK)
            except self.zmq.Again:
                break
            rank = rank_of(tag)
            if rank is not None:
                here.append(rank)
        if here:
            self._send([["here", sorted(set(here))]])

    def _from_ranks(self) -> None:
        messages = []
        while len(messages) < MAX_BATCH:
            try:
                frames = self.inbox.recv_multipart(flags=self.zmq.NOBLOCK, copy=True)
            except self.zmq.Again:
                break
            got = self._rank_message(frames)
            if got is not None:
                messages.append(got)
        if messages:
            self._send(pack(messages))

    def _rank_message(self, frames: list[bytes]) -> tuple[int, dict] | None:
        """A rank's message, checked as ``Session.deserialize`` checks one (its HMAC, and
        a signature seen before is a replay), without its date parsing: the header's
        date goes on as text. Metadata is read only for what goes whole (``_item``)."""
        rank = rank_of(frames[0])
        if rank is None:
            log.warning("a message from something that is no rank, dropped")
            return None
        try:
            start = frames.index(DELIM) + 1
            sig, header, parent, metadata, content = frames[start : start + 5]
            if self.session is not None:  # else ipyparallel signs nothing (CurveZMQ)
                self._check_signature(sig, [header, parent, metadata, content])
            msg = {
                "header": _unpack(header),
                "parent_header": _unpack(parent),
                "metadata": _unpack(metadata),
                "content": _unpack(content),
                "buffers": frames[start + 5 :],
            }
            problem = shape_problem(msg)
            if problem:
                raise ValueError(problem)
        except Exception as e:  # unsigned, replayed or malformed: never the kernel's
            log.warning("rank %d: a message dropped (%.200s)", rank, e)
            return None
        return rank, msg

    def _check_signature(self, sig: bytes, parts: list[bytes]) -> None:
        if not hmac.compare_digest(sig, self.session.sign(parts)):
            raise ValueError("bad signature")
        if sig in self.seen:
            raise ValueError("replayed")
        self.seen.add(sig)
        self.seen_order.append(sig)
        if len(self.seen_order) > SEEN_KEPT:
            self.seen.discard(self.seen_order.popleft())

    def _send(self, items: list[list]) -> None:
        self.sent += 1
        body = _dumps({"seq": self.sent, "items": items})
        if body is None:  # an item JSON cannot write (nested too deep): the others go
            kept = [item for item in items if _dumps(item) is not None]
            log.warning("%d item(s) JSON cannot write, dropped", len(items) - len(kept))
            body = _dumps({"seq": self.sent, "items": kept})
        self.up.send(signing.sign(self.key, f"{BATCH}/{self.tag}", body))


log = logging.getLogger("infini_notebook.relay")


RELAY_FOLDER_PREFIX = "infini-relay-"  # a relay's folder on another host


def main(argv: list[str]) -> None:
    up, requests, replies, tag, parent = argv
    if parent != "-" and os.getppid() != int(parent):  # the kernel ended while this started
        return
    keys = json.loads(sys.stdin.readline())
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s relay: %(message)s")
    if parent != "-":
        Relay(up, requests, replies, tag, keys, int(parent)).run()
        return
    folder = own_folder()
    requests, replies = (f"ipc://{os.path.join(folder, n)}" for n in ("rq.sock", "rp.sock"))
    # The relay runs in a child; this process removes the folder once it ended, however it
    # ended (a relay killed could not), and ends with its status, which ssh passes on.
    child = os.fork()
    if child == 0:
        code = 1
        try:
            Relay(up, requests, replies, tag, keys, None).run()
            code = 0
        except BaseException:  # into the log: os._exit would leave before Python prints it
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(code)
    status = os.waitpid(child, 0)[1]
    shutil.rmtree(folder, ignore_errors=True)
    code = os.waitstatus_to_exitcode(status)
    sys.exit(code if code >= 0 else 128 - code)  # as a shell says a signal


def own_folder() -> str:
    """A new 0700 folder for the sockets, refused where another user could swap it (a
    temporary folder others may write without the sticky bit: see remote_start)."""
    import tempfile

    from .remote_start import refuse_shared_tmp

    refuse_shared_tmp(tempfile.gettempdir())
    return tempfile.mkdtemp(prefix=RELAY_FOLDER_PREFIX)


if __name__ == "__main__":
    main(sys.argv[1:])
