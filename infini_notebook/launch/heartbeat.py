"""The kernel's heartbeat in its store (core/heartbeat.py), for ranks on other hosts that
cannot watch its pid: a thread with a store client of its own writes a signed beat with the
next sequence number every ``BEAT_S`` seconds until the session's store closes. A beat
deleted by someone else (anyone can delete any key) is written again at the next one, and
said once: the ranks look again rather than end."""

from __future__ import annotations

import sys
import threading
import time

from ..core.heartbeat import ALIVE_KEY, BEAT_S, beat


class Heartbeat:
    def __init__(self, connect, mac_key: str, every: float = BEAT_S):
        """``connect()``: a new client of the session's keys (a PrefixStore)."""
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(connect, mac_key, every), name="infini-heartbeat", daemon=True
        )
        self._thread.start()

    def _run(self, connect, key: str, every: float) -> None:
        # counted from the time, not from 0: beats of a later writer (another kernel)
        # must be newer than any a rank took before
        seq, told, beaten = time.time_ns(), False, False
        try:
            store = connect()
        except Exception:  # the store is closing with the session
            return
        while not self._stopped.is_set():
            try:
                if beaten and not told and not store.check([ALIVE_KEY]):
                    told = True
                    print(
                        "infini_notebook: the session's heartbeat was deleted from its store "
                        "by another process; it is written again every second, and ranks on "
                        "other hosts end only when none comes for their window (a minute by "
                        "default)",
                        file=sys.stderr,
                    )
                seq += 1
                store.set(ALIVE_KEY, beat(key, seq, time.time()))
                beaten = True
            except Exception:  # the store is closing with the session
                pass
            self._stopped.wait(every)

    def stop(self) -> None:
        """No beat after this returns (its client is closed with the thread)."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5)
