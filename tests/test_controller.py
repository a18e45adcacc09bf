"""The session's controller: ipyparallel's, announcing a new engine at its first heartbeat."""

import zmq
from ipyparallel.controller.heartmonitor import HeartMonitor
from jupyter_client.session import Session
from zmq.eventloop.zmqstream import ZMQStream

from infini_notebook.controller import register_at_first_pong


def test_a_new_heart_is_announced_at_its_first_answer_and_only_once():
    class Monitor(HeartMonitor):  # a copy: ipyparallel's own class stays stock here
        pass

    assert register_at_first_pong(Monitor)
    ctx = zmq.Context()
    hub, monitor_side = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    hub.bind("inproc://monitor")
    monitor_side.connect("inproc://monitor")
    ping = ctx.socket(zmq.PUB)
    ping.bind("inproc://ping")
    session = Session(key=b"")
    m = Monitor(
        session=session,
        ping_stream=ZMQStream(ping),
        pong_stream=ZMQStream(ctx.socket(zmq.ROUTER)),
        monitor_stream=ZMQStream(monitor_side),
    )
    try:
        m.handle_pong([b"heart-1", str(m.lifetime).encode()])
        m.monitor_stream.flush()  # what the monitor's event loop does next
        assert hub.poll(2000), "the hub was not told of the new heart before the next tick"
        _, msg = session.recv(hub)
        assert msg["msg_type"] == "new_heart" and msg["content"]["hearts"] == ["heart-1"]
        m.handle_pong([b"heart-1", str(m.lifetime).encode()])  # a known heart: no news
        m.beat()
        m.monitor_stream.flush()
        assert not hub.poll(200)
        assert m.hearts == {b"heart-1"}
    finally:
        for stream in (m.ping_stream, m.pong_stream, m.monitor_stream):
            stream.close()
        hub.close()
        ctx.term()


def test_an_unknown_heart_monitor_is_left_stock():
    class Other:
        def handle_pong(self, msg): ...

    assert not register_at_first_pong(Other)
    assert Other.handle_pong.__qualname__.endswith("Other.handle_pong")
