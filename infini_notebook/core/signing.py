"""What our code reads from the kernel's TCPStore is authenticated with the session's key.

The store has no authentication: every local user reaches loopback, and torch's
``TCPStore.list_keys()`` hands out every key, so the key root is no secret there. The key
used here never enters the store: the kernel makes it and sends it to each rank inside the
bootstrap config (ipyparallel's signed messages). Every message is
``HMAC-SHA256(key, name NUL body) || body``, the name being the store key it is written under,
so a message cannot be moved to another key, nor forged; questions and answers are numbered
or carry a random id, so an old one cannot stand for a new one. Secrets (getpass answers) are
also sealed: XORed with an HMAC-SHA256 keystream (counter mode) under a random nonce, then
signed with the rest of the message. Pure: the standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

TAG_LEN = 64  # hex digits of an HMAC-SHA256


def new_key() -> str:
    """A session key, as hex (it travels in the ranks' config, never in the store)."""
    return secrets.token_hex(32)


def sign(key: str, name: str, body: bytes | str) -> bytes:
    """``body`` as written under the store key ``name``, with its tag in front."""
    body = body.encode() if isinstance(body, str) else body
    return _tag(key, name, body) + body


def verify(key: str, name: str, raw: bytes | str) -> bytes | None:
    """The body of a message read under ``name``; None when its tag is not ours (forged,
    moved from another key, or written by something else)."""
    raw = raw.encode() if isinstance(raw, str) else raw
    tag, body = raw[:TAG_LEN], raw[TAG_LEN:]
    if len(tag) < TAG_LEN or not hmac.compare_digest(tag, _tag(key, name, body)):
        return None
    return body


def seal(key: str, name: str, secret: str) -> str:
    """``secret`` encrypted for the message under ``name`` (hex: nonce, then ciphertext);
    sign the message that carries it."""
    nonce = secrets.token_bytes(16)
    data = secret.encode()
    return (nonce + _xor(data, _keystream(key, name, nonce, len(data)))).hex()


def unseal(key: str, name: str, sealed: str) -> str:
    raw = bytes.fromhex(sealed)
    nonce, data = raw[:16], raw[16:]
    return _xor(data, _keystream(key, name, nonce, len(data))).decode()


def _tag(key: str, name: str, body: bytes) -> bytes:
    mac = hmac.new(bytes.fromhex(key), b"mac\0" + name.encode() + b"\0" + body, hashlib.sha256)
    return mac.hexdigest().encode()


def _keystream(key: str, name: str, nonce: bytes, size: int) -> bytes:
    blocks = []
    for counter in range((size + 31) // 32):
        msg = b"seal\0" + name.encode() + b"\0" + nonce + counter.to_bytes(8, "big")
        blocks.append(hmac.new(bytes.fromhex(key), msg, hashlib.sha256).digest())
    return b"".join(blocks)[:size]


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b))
