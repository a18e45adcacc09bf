"""The Debug Adapter Protocol between the kernel and a rank's debugger, signed (pure).

A rank's debugger (pydevd) is reached only through its relay (engine/dap_relay.py), never on
a port of its own: every local user reaches loopback, and on another host every machine of
the network reaches the rank's address, and a DAP client may evaluate any code in the rank.
The relay accepts a link once the other end proved it holds the session's key
(core/signing.py), and every message after that is signed, numbered and bound to the link:

1. The relay says ``infini-dap/1 <relay nonce>`` (a fresh random nonce per connection).
2. The kernel answers with a frame: its own fresh nonce, signed under a name that carries
   the relay's nonce; a replayed answer of an earlier link is signed for another nonce.
3. Each later frame carries one whole DAP message, signed under
   ``dap <relay nonce> <kernel nonce> <direction> <n>``: n counts the direction's frames
   from 1, so a frame cannot be replayed, dropped, reordered, reflected back to its sender
   or moved to another link without its tag failing.

A frame is a 4-byte big-endian length, then ``signing.sign``'s tag and body.
"""

from __future__ import annotations

import json
import secrets

from . import signing

MAGIC = b"infini-dap/1 "
MAX_FRAME = 64 << 20  # a DAP message (a variable's value, a long stack) is far smaller
HEADER = 4
TO_RANK, TO_KERNEL = "k2r", "r2k"


class BadFrame(Exception):
    """A frame whose tag, number or size is not what this link expects: end the link."""


def hello(relay_nonce: str) -> bytes:
    return MAGIC + relay_nonce.encode() + b"\n"


def parse_hello(line: bytes) -> str:
    """The relay's nonce from its first line."""
    if not line.startswith(MAGIC) or not line.endswith(b"\n"):
        raise BadFrame("not an infini_notebook debugger relay")
    nonce = line[len(MAGIC) : -1].decode("ascii", "replace")
    if len(nonce) != 32 or any(c not in "0123456789abcdef" for c in nonce):
        raise BadFrame("a relay nonce that is not 16 bytes of hex")
    return nonce


def new_nonce() -> str:
    return secrets.token_hex(16)


def answer(key: str, relay_nonce: str, kernel_nonce: str) -> bytes:
    """The kernel's proof that it holds the key, for this link only."""
    return _frame(signing.sign(key, f"dap hello {relay_nonce}", kernel_nonce))


def kernel_side(key: str, relay_nonce: str) -> tuple[bytes, Direction, Direction]:
    """What the kernel's end of a link needs once it read the relay's nonce: its answer
    (with a fresh nonce of its own), then its directions, to the rank and from it."""
    kernel_nonce = new_nonce()
    return (
        answer(key, relay_nonce, kernel_nonce),
        Direction(key, relay_nonce, kernel_nonce, TO_RANK),
        Direction(key, relay_nonce, kernel_nonce, TO_KERNEL),
    )


ANSWER_LEN = signing.TAG_LEN + 32  # the kernel's answer: a tag and a 16-byte hex nonce


def check_answer(key: str, relay_nonce: str, body: bytes) -> str:
    """The kernel's nonce from its answer (``body``: the frame without its length)."""
    nonce = signing.verify(key, f"dap hello {relay_nonce}", body)
    if nonce is None or len(nonce) != 32:
        raise BadFrame("the answer to the relay's hello is not signed with the session's key")
    return nonce.decode("ascii")


def frame_length(header: bytes) -> int:
    length = int.from_bytes(header, "big")
    if not signing.TAG_LEN <= length <= MAX_FRAME:
        raise BadFrame(f"a frame of {length} bytes")
    return length


class Direction:
    """One direction of one link: numbers what it packs or unpacks."""

    def __init__(self, key: str, relay_nonce: str, kernel_nonce: str, direction: str):
        self.key, self.n = key, 0
        self.prefix = f"dap {relay_nonce} {kernel_nonce} {direction} "

    def pack(self, message: bytes) -> bytes:
        self.n += 1
        return _frame(signing.sign(self.key, self.prefix + str(self.n), message))

    def unpack(self, signed: bytes) -> bytes:
        body = signing.verify(self.key, self.prefix + str(self.n + 1), signed)
        if body is None:
            raise BadFrame(f"frame {self.n + 1} is not signed for this link")
        self.n += 1
        return body


def _frame(signed: bytes) -> bytes:
    return len(signed).to_bytes(HEADER, "big") + signed


def dap_message(body: dict) -> bytes:
    """One DAP message as debuggers write it: a Content-Length header, then the JSON."""
    data = json.dumps(body).encode()
    return b"Content-Length: %d\r\n\r\n" % len(data) + data


def split_dap(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Whole DAP messages (header and body, as read) at the front of ``buffer``, and the
    rest, which waits for more bytes."""
    out = []
    while True:
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            return out, buffer
        length = None
        for line in buffer[:end].split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value) if value.strip().isdigit() else -1
        if length is None or not 0 <= length <= MAX_FRAME:
            raise BadFrame("a DAP header without a usable Content-Length")
        if len(buffer) < end + 4 + length:
            return out, buffer
        out.append(buffer[: end + 4 + length])
        buffer = buffer[end + 4 + length :]
