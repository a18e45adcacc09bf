"""The session's controller: ipyparallel's, announcing a new engine at its first heartbeat."""

import time

import zmq
from ipyparallel.controller.heartmonitor import Heart, HeartMonitor
from jupyter_client.session import Session
from zmq.eventloop.zmqstream import ZMQStream

from infini_notebook.launch.controller import ping_new_hearts, register_at_first_pong


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


def test_a_heart_that_connects_is_registered_long_before_the_next_beat():
    """A real monitor on its own event loop, beating every 30 s, and a real engine heart
    (ipyparallel's): the hub hears of the heart at once, not 30-60 s later."""
    import asyncio
    import threading

    class Monitor(HeartMonitor):
        pass

    assert register_at_first_pong(Monitor) and ping_new_hearts(Monitor)
    ctx = zmq.Context()
    hub = ctx.socket(zmq.PAIR)
    port = hub.bind_to_random_port("tcp://127.0.0.1")
    urls, monitors, loops = {}, [], []

    def serve():
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        ping, pong, side = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER), ctx.socket(zmq.PAIR)
        urls["ping"] = f"tcp://127.0.0.1:{ping.bind_to_random_port('tcp://127.0.0.1')}"
        urls["pong"] = f"tcp://127.0.0.1:{pong.bind_to_random_port('tcp://127.0.0.1')}"
        side.connect(f"tcp://127.0.0.1:{port}")
        m = Monitor(
            session=Session(key=b""),
            period=30_000,
            ping_stream=ZMQStream(ping),
            pong_stream=ZMQStream(pong),
            monitor_stream=ZMQStream(side),
        )
        monitors.append(m)
        loops.append(loop)
        m.start()  # first waits for the hub's hello (stock: the hub's subscription)
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    hub.send(b"hello")
    session = Session(key=b"")
    deadline = time.monotonic() + 10
    while not monitors or getattr(monitors[0], "_connects", None) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    heart = Heart(urls["ping"], urls["pong"], heart_id=b"heart-1")
    heart.start()
    try:
        assert hub.poll(5000), "no new heart within 5 s (the next beat is 30 s away)"
        _, msg = session.recv(hub)
        assert msg["msg_type"] == "new_heart" and msg["content"]["hearts"] == ["heart-1"]
    finally:
        loops[0].call_soon_threadsafe(loops[0].stop)
        thread.join(5)
        m = monitors[0]
        for stream in (m.ping_stream, m.pong_stream, m.monitor_stream, m._connects):
            stream.close(linger=0)
        hub.close(linger=0)


def test_an_unknown_heart_monitor_is_left_stock():
    class Other:
        def handle_pong(self, msg): ...

    assert not register_at_first_pong(Other) and not ping_new_hearts(Other)
    assert Other.handle_pong.__qualname__.endswith("Other.handle_pong")
