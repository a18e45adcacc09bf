"""A rank's debugger relay and %dist_debugpy's bridge under attack (issue 52's review):
a real Relay, with pydevd connected to it, in a process of its own; what another user
can do to them over loopback (connect, flood, stall, reset) must leave the debugger
reachable by the key's holder and cost the rank nothing lasting."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import time

import pytest

from infini_notebook.core import dap_frames, signing
from infini_notebook.engine import dap_relay

HOST = """\
import json, sys
from infini_notebook.engine import dap_relay
from infini_notebook.kernel import debugpy_bridge
key = sys.argv[1]
relay = dap_relay.Relay(key, "127.0.0.1")
bridge = debugpy_bridge.bridge(relay.endpoint, key, 0)
print(json.dumps({"relay": list(relay.endpoint), "bridge": list(bridge)}), flush=True)
sys.stdin.read()
"""
INIT = {"seq": 1, "type": "request", "command": "initialize", "arguments": {"adapterID": "t"}}


@pytest.fixture(scope="module")
def rank():
    key = signing.new_key()
    proc = subprocess.Popen(
        [sys.executable, "-c", HOST, key], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        ends = json.loads(proc.stdout.readline())
        yield key, tuple(ends["relay"]), tuple(ends["bridge"]), proc
    finally:
        proc.stdin.close()
        proc.wait(10)


def answers(relay, key) -> bool:
    """The key's holder links and gets pydevd's answer to an initialize."""
    link = dap_relay.Link(relay, key)
    try:
        link.conn.sendall(link.out.pack(dap_frames.dap_message(INIT)))
        link.conn.settimeout(10)
        return b'"success": true' in link.receive()
    finally:
        link.close()


def closed_within(conn: socket.socket, seconds: float) -> float:
    """Seconds until the other end closed ``conn`` (reading what it says meanwhile)."""
    t0 = time.monotonic()
    conn.settimeout(seconds)
    try:
        while conn.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


def test_the_keys_holder_is_answered_and_a_wrong_key_is_not(rank):
    key, relay, _, _ = rank
    assert answers(relay, key)
    with pytest.raises((ValueError, OSError)):  # refused at the hello: nothing passes
        answers(relay, signing.new_key())
    assert answers(relay, key)  # a refused link changed nothing


def test_a_stalled_or_oversized_hello_answer_is_cut_off(rank):
    key, relay, _, _ = rank
    slow = socket.create_connection(relay)
    slow.recv(100)
    t0 = time.monotonic()
    for byte in b"\x00\x00\x00":  # a byte a second: the deadline is the whole handshake's
        slow.sendall(bytes([byte]))
        time.sleep(1)
        if time.monotonic() - t0 > dap_relay.HANDSHAKE_S + 2:
            break
    assert time.monotonic() - t0 + closed_within(slow, 10) < dap_relay.HANDSHAKE_S + 2
    big = socket.create_connection(relay)
    big.recv(100)
    big.sendall(struct.pack(">I", dap_frames.MAX_FRAME))  # 64 MiB announced: not read
    assert closed_within(big, 5) < 1
    assert answers(relay, key)


def test_a_flood_of_unproven_connections_leaves_the_relay_serving(rank):
    key, relay, _, proc = rank
    flood = [socket.create_connection(relay) for _ in range(200)]  # more than HANDSHAKES
    for conn in flood:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    for conn in flood[:100]:
        conn.close()  # reset before or during their handshake
    deadline = time.monotonic() + dap_relay.HANDSHAKE_S + 5
    while time.monotonic() < deadline:  # the rest time out; then the key's holder gets in
        try:
            if answers(relay, key):
                break
        except (OSError, ValueError):
            time.sleep(0.5)
    else:
        pytest.fail("the relay did not serve the key's holder after a flood")
    for conn in flood[100:]:
        conn.close()
    assert proc.poll() is None


def test_connections_reset_at_the_bridge_never_stop_it(rank):
    """Reset before the bridge looked at them (the uid check's getpeername failed and the
    bridge's loop ended: its port was left for another user to take)."""
    _, _, bridge, _ = rank
    for _ in range(100):
        conn = socket.create_connection(bridge)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
    editor = socket.create_connection(bridge, timeout=10)
    editor.sendall(dap_frames.dap_message(INIT))
    assert b'"success": true' in editor.recv(1 << 16)
    editor.close()


def test_a_dap_header_with_a_length_that_is_no_count_is_refused():
    for header in (b"Content-Length: -23", b"Content-Length: 5x", b"Content-Length: "):
        with pytest.raises(dap_frames.BadFrame):
            dap_frames.split_dap(header + b"\r\n\r\n{}")
