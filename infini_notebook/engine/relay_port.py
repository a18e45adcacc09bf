"""A rank's side of the per-host relay (``%dist_start --relay``, docs/scale.md): cells come
from the host's relay instead of ipyparallel's controller, and what the rank sends about
them goes back to the relay, which packs the host's ranks' messages into one for the
kernel.

A request from the relay is handed to ipykernel as its shell stream hands one: to
``Kernel.shell_main(None, frames)`` on the kernel's own event loop (ipykernel 7.4,
``kernelbase.Kernel.start`` registers ``_async_in_context(partial(self.shell_main, None))``
on the shell stream). So a relayed cell runs in the main thread, in turn with every other
request, with SIGINT, pdb and every hook of this package, and is signed and checked by the
engine's own Session. Every message whose parent is a relayed request (the reply, its
output, its idle status) leaves through ``session.send`` as always, built, signed and
trimmed by ipyparallel's and our layers; only its socket is swapped for the port's PUSH,
under a lock (the main thread sends replies and displays, the IOPub thread the streams).
Everything else (apply requests, the controller's own) is untouched."""

from __future__ import annotations

import collections
import functools
import hmac
import threading

DELIM = b"<IDS|MSG>"  # jupyter_client.session.Session.DELIM
RELAYED_KEPT = 256  # request ids remembered as relayed (one per cell; more never overlap)

_PORT: dict = {}  # this engine's port, once connected


class _Out:
    """The PUSH to the relay, as a socket ``Session.send`` can send on from any thread: each
    message leaves tagged with the rank, its routing prefix (a topic) dropped."""

    def __init__(self, socket, tag: bytes):
        self.socket, self.tag, self.lock = socket, tag, threading.Lock()

    def send_multipart(self, frames, copy=True, track=False):
        frames = list(frames)
        start = next(i for i, f in enumerate(frames) if bytes(f) == DELIM)
        with self.lock:
            self.socket.send_multipart([self.tag, *frames[start:]], copy=copy)


def connect(requests: str, replies: str, rank: int) -> str:
    """Serve relayed requests from ``requests`` (the relay's ROUTER) and send what they
    produce to ``replies`` (its PULL). Called on the engine's main thread (bootstrap runs
    in an apply request there); again after a replacement or a hard restart it reconnects.
    Returns the rank's tag on the relay."""
    import zmq
    from IPython import get_ipython
    from zmq.eventloop.zmqstream import ZMQStream

    kernel = get_ipython().kernel
    close()
    tag = b"r%d" % rank
    inbox, outbox = sockets(zmq.Context.instance(), requests, replies, tag)
    out = _Out(outbox, tag)
    relayed: collections.deque = collections.deque(maxlen=RELAYED_KEPT)
    from ipykernel.utils import _async_in_context

    # as Kernel.start wraps shell_main: once, so cells share one persistent context
    dispatch = _async_in_context(functools.partial(kernel.shell_main, None))
    stream = ZMQStream(inbox, kernel.io_loop)
    stream.on_recv(functools.partial(_received, kernel, relayed, dispatch), copy=False)
    _swap_sends(kernel.session, out, relayed)
    inbox.send(b"hello")  # the relay learns the rank is here before any cell is sent
    _PORT.update(stream=stream, outbox=outbox, relayed=relayed)
    return tag.decode()


def sockets(ctx, requests: str, replies: str, tag: bytes):
    """The rank's two sockets, connected to its relay once and never again: when the relay
    ends, its folder goes, and another user may make one of the same name (a sticky /tmp
    lets them) with sockets of their own; a rank that reconnected would take their cells,
    which with CurveZMQ carry no HMAC (ipyparallel leaves the engines' key empty). A new
    relay means a hard restart, whose ranks connect anew."""
    import zmq

    inbox = ctx.socket(zmq.DEALER)
    inbox.setsockopt(zmq.IDENTITY, tag)
    inbox.setsockopt(zmq.LINGER, 0)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 1000)
    for sock, address in ((inbox, requests), (outbox, replies)):
        sock.setsockopt(zmq.RECONNECT_IVL, -1)  # zmq_setsockopt(3): -1, no reconnection
        sock.connect(address)
    return inbox, outbox


def close() -> None:
    """Disconnect from the relay (before a reconnect)."""
    if not _PORT:
        return
    _PORT["stream"].close(linger=0)
    _PORT["outbox"].close(linger=1000)
    _PORT.clear()


def _received(kernel, relayed, dispatch, frames):
    """A request from the relay: remembered as relayed, then dispatched as the shell
    stream dispatches one (the coroutine returned is scheduled by ZMQStream, as the
    shell stream's is)."""
    session = kernel.session
    try:
        _, msg = session.feed_identities(frames, copy=False)
        parts = [m.bytes for m in msg[:5]]
        if not hmac.compare_digest(parts[0], session.sign(parts[1:5])):
            raise ValueError("not signed with the session's key")
        header = session.unpack(parts[1])
    except Exception:  # dispatch_shell would drop it too: none of its ids is taken
        kernel.log.warning("relay: a request that is no message of ours, dropped")
        return None
    relayed.append(header.get("msg_id"))
    return dispatch(frames)


def _swap_sends(session, out: _Out, relayed) -> None:
    """``session.send`` sends what answers a relayed request on the port; the wrapper is
    put on once (a reconnect only changes where it sends)."""
    from jupyter_client.session import extract_header

    current = getattr(session.send, "relay_port", None)
    if current is not None:
        current.update(out=out, relayed=relayed)
        return
    port = {"out": out, "relayed": relayed}
    send = session.send

    def send_relayed(stream, msg_or_type, content=None, parent=None, *args, **kwargs):
        if isinstance(msg_or_type, dict):
            parent_id = msg_or_type.get("parent_header", {}).get("msg_id")
        else:
            parent_id = extract_header(parent or {}).get("msg_id")
        if parent_id is not None and parent_id in port["relayed"]:
            stream = port["out"]
        return send(stream, msg_or_type, content, parent, *args, **kwargs)

    send_relayed.relay_port = port
    session.send = send_relayed
