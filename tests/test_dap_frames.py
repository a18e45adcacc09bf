"""The signed link to a rank's debugger (core/dap_frames.py): what an attacker who sees or
can write the link's bytes tries, each refused. Pure; the relay itself is attacked in
tests/test_rank_debugger.py."""

from __future__ import annotations

import pytest

from infini_notebook.core import dap_frames, signing
from infini_notebook.core.dap_frames import TO_KERNEL, TO_RANK, BadFrame, Direction

KEY = signing.new_key()
HEADER = dap_frames.HEADER


def link(key: str = KEY, relay: str = "a" * 32, kernel: str = "b" * 32):
    return Direction(key, relay, kernel, TO_RANK), Direction(key, relay, kernel, TO_RANK)


def body(frame: bytes) -> bytes:
    assert dap_frames.frame_length(frame[:HEADER]) == len(frame) - HEADER
    return frame[HEADER:]


def test_messages_pass_in_order_and_whole():
    sender, receiver = link()
    messages = [dap_frames.dap_message({"seq": n, "command": "threads"}) for n in range(1, 4)]
    assert [receiver.unpack(body(sender.pack(m))) for m in messages] == messages


def test_a_replayed_dropped_or_reordered_frame_is_refused():
    sender, receiver = link()
    first, second, third = (body(sender.pack(b"m%d" % n)) for n in range(3))
    assert receiver.unpack(first) == b"m0"
    with pytest.raises(BadFrame):
        receiver.unpack(first)  # replayed
    with pytest.raises(BadFrame):
        receiver.unpack(third)  # the second dropped
    assert receiver.unpack(second) == b"m1"


def test_a_frame_of_another_link_direction_or_key_is_refused():
    frame = body(Direction(KEY, "a" * 32, "b" * 32, TO_RANK).pack(b"evaluate"))
    for other in (
        Direction(KEY, "a" * 32, "c" * 32, TO_RANK),  # another kernel nonce: another link
        Direction(KEY, "d" * 32, "b" * 32, TO_RANK),  # another relay nonce
        Direction(KEY, "a" * 32, "b" * 32, TO_KERNEL),  # reflected back to its sender
        Direction(signing.new_key(), "a" * 32, "b" * 32, TO_RANK),  # another session's key
    ):
        with pytest.raises(BadFrame):
            other.unpack(frame)


def test_a_changed_byte_is_refused():
    sender, receiver = link()
    frame = bytearray(body(sender.pack(b'{"command": "continue"}')))
    frame[-3] ^= 1
    with pytest.raises(BadFrame):
        receiver.unpack(bytes(frame))


def test_the_hello_answer_proves_the_key_for_this_relay_nonce_only():
    relay = dap_frames.new_nonce()
    answer = body(dap_frames.answer(KEY, relay, "e" * 32))
    assert dap_frames.check_answer(KEY, relay, answer) == "e" * 32
    with pytest.raises(BadFrame):
        dap_frames.check_answer(KEY, dap_frames.new_nonce(), answer)  # an earlier link's
    with pytest.raises(BadFrame):
        dap_frames.check_answer(signing.new_key(), relay, answer)
    assert dap_frames.parse_hello(dap_frames.hello(relay)) == relay
    for bad in (b"Content-Length: 10\r\n", b"infini-dap/1 zz\n", dap_frames.MAGIC + b"a" * 32):
        with pytest.raises(BadFrame):
            dap_frames.parse_hello(bad)


def test_frame_sizes_outside_the_bounds_are_refused_before_reading():
    for size in (0, signing.TAG_LEN - 1, dap_frames.MAX_FRAME + 1):
        with pytest.raises(BadFrame):
            dap_frames.frame_length(size.to_bytes(HEADER, "big"))


def test_dap_messages_are_split_where_their_lengths_say():
    one, two = dap_frames.dap_message({"a": "é" * 3}), dap_frames.dap_message({"b": 2})
    stream = one + two
    for cut in range(len(stream) + 1):  # arriving in two pieces, cut anywhere
        first, rest = dap_frames.split_dap(stream[:cut])
        second, left = dap_frames.split_dap(rest + stream[cut:])
        assert first + second == [one, two] and left == b""
    with pytest.raises(BadFrame):
        dap_frames.split_dap(b"X-Other: 1\r\n\r\n{}")
