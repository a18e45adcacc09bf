"""ipyparallel's controller, run as ``python -m infini_notebook.controller ARGS`` (the same
arguments as ``python -m ipyparallel.controller``), with one change: a new engine counts as
registered at its first heartbeat, not at the heart monitor's next tick.

Stock, the monitor collects answers to a ping and acts on them at the following ping: an
engine that answered waited one more period (0.5 s here, see launchers.HEARTBEAT) before the
hub saw it, every start and every hard restart. Beating faster would cost every idle rank
CPU; answering at once costs nothing. Where ipyparallel's heart monitor is not the one this
was written for, it stays stock (with a log line): only speed is at stake.
"""

from __future__ import annotations

from . import internals

_NEEDS = ("handle_pong", "handle_new_hearts", "hearts", "responses")


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


def patch() -> None:
    from ipyparallel.controller import heartmonitor

    register_at_first_pong(heartmonitor.HeartMonitor)


# The monitor runs in a child process of this one (multiprocessing): forked, it inherits
# the patch; started by spawn or forkserver, it imports this module as __mp_main__.
if __name__ in ("__main__", "__mp_main__"):
    patch()

if __name__ == "__main__":
    from ipyparallel.controller import app

    app.main()
