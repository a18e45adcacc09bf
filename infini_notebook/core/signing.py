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


# ----- questions to a rank's answering thread, and their answers --------------------------------
# The asker (the kernel) makes a random id for each question; the answer goes under a key named
# by that id, and its body repeats the id, the rank and the kind of question, all under the MAC.
# So an answer counts only for its own question, and an old one never stands for a new one.
def question_kind(question: str) -> str:
    """The kind of a question to a rank ("stacks" for the empty question)."""
    return question.split(" ", 1)[0] or "stacks"


def new_question_id() -> str:
    return secrets.token_hex(12)


def pack_question(key: str, name: str, qid: str, rank: int, question: str) -> bytes:
    import json

    return sign(key, name, json.dumps({"id": qid, "rank": rank, "q": question}))


def unpack_question(key: str, name: str, raw: bytes, rank: int) -> tuple[str, str] | None:
    """(id, question) of a signed question to ``rank``; None for anything else."""
    import json

    body = verify(key, name, raw)
    try:
        data = json.loads(body) if body is not None else None
        if data["rank"] == rank and isinstance(data["id"], str) and isinstance(data["q"], str):
            return data["id"], data["q"]
    except (ValueError, KeyError, TypeError):
        pass
    return None


def pack_answer(key: str, name: str, qid: str, rank: int, kind: str, answer: str) -> bytes:
    import json

    body = {"id": qid, "rank": rank, "kind": kind, "answer": answer}
    return sign(key, name, json.dumps(body))


def unpack_answer(key: str, name: str, raw: bytes, qid: str, rank: int, kind: str) -> str | None:
    """The answer to question ``qid`` of ``kind`` asked of ``rank``; None for anything else
    (unsigned, or signed for another question, rank or kind)."""
    import json

    body = verify(key, name, raw)
    try:
        data = json.loads(body) if body is not None else None
        if (data["id"], data["rank"], data["kind"]) == (qid, rank, kind):
            return str(data["answer"])
    except (ValueError, KeyError, TypeError):
        pass
    return None
