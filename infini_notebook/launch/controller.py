"""ipyparallel's controller, run as ``python -m infini_notebook.launch.controller ARGS`` (the same
arguments as ``python -m ipyparallel.controller``), with a new engine registered as soon as
its heart answers instead of up to two heartbeat periods later.

Stock, the heart monitor pings every period (0.5 s here, see launchers.HEARTBEAT) and acts
on the answers at the following ping: a new engine's heart waited for the next ping, then
for one more period, before the hub saw it; every start and every hard restart paid that
(0.5-1 s). Here a heart that connects is pinged at once, and a heart not yet known is
announced to the hub at its first answer. Beating faster would cost every idle rank CPU;
this costs nothing between starts. Where ipyparallel's heart monitor is not the one this was
written for, it stays stock (with a log line): only speed is at stake.
"""

from __future__ import annotations

from ..core import internals

_NEEDS = ("handle_pong", "handle_new_hearts", "hearts", "responses", "start", "lifetime")
# A heart subscribes to the pings just after its connection is made: ping again a little
# later (a ping sent before the subscription arrives does not reach it).
REPING_AFTER_S = (0.02, 0.1)


def register_at_first_pong(monitor_class) -> bool:
    """Patch ``monitor_class`` (ipyparallel's HeartMonitor) so that a heart not yet known
    is announced to the hub as soon as its answer arrives. The next tick then finds it among
    the known hearts, so it is announced once. False when left stock."""
    if not internals.usable(monitor_class, _NEEDS, "ipyparallel", "the heart monitor"):
        return False
    stock = monitor_class.handle_pong

    def handle_pong(self, msg):
        stock(self, msg)
        heart = msg[0]
        if heart in self.responses and heart not in self.hearts:
            self.handle_new_hearts({heart})

    monitor_class.handle_pong = handle_pong
    return True


def ping_new_hearts(monitor_class) -> bool:
    """Patch ``monitor_class`` so that each heart that connects to the ping socket is
    pinged at once (again: the ping of this period) instead of at the next period. False
    when left stock."""
    if not internals.usable(monitor_class, _NEEDS, "ipyparallel", "the heart monitor"):
        return False
    stock = monitor_class.start

    def start(self):
        import zmq
        from zmq.eventloop.zmqstream import ZMQStream

        stock(self)
        connects = self.ping_stream.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._connects = ZMQStream(connects, self.loop)
        self._connects.on_recv(lambda _event: _ping_soon(self))

    monitor_class.start = start
    return True


def _ping_soon(monitor) -> None:
    for delay in REPING_AFTER_S:
        monitor.loop.call_later(delay, _ping_again, monitor)


def _ping_again(monitor) -> None:
    """The current ping once more: known hearts answer it as they did (a set keeps one
    answer each), a new one answers it for the first time."""
    monitor.ping_stream.send(str(monitor.lifetime).encode("ascii"))
    monitor.ping_stream.flush()


def patch() -> None:
    from ipyparallel.controller import heartmonitor

    register_at_first_pong(heartmonitor.HeartMonitor)
    ping_new_hearts(heartmonitor.HeartMonitor)


# The monitor runs in a child process of this one (multiprocessing): forked, it inherits
# the patch; started by spawn or forkserver, it imports this module as __mp_main__.
if __name__ in ("__main__", "__mp_main__"):
    patch()

if __name__ == "__main__":
    from ipyparallel.controller import app

    app.main()
