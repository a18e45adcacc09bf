"""The kernel's heartbeat in its store, as ranks on other hosts follow it (they cannot watch
the kernel's pid). Pure: what a beat is, and when a rank may believe the kernel alive.

A beat is the session-signed ``{"seq": N, "time": T}`` under ``ALIVE_KEY``, written by the
kernel every ``BEAT_S`` seconds with N counting up. A rank takes a beat only when its N is
newer than the last it took, and judges freshness by when it took it (its own monotonic
clock), never by T against its clock: hosts' clocks differ. So a copied beat served again
(by another user from a store on the freed port, or written back into ours) never keeps a
rank alive, and a deleted or garbled key is only a reason to look again: a rank ends when no
fresh beat came within its window and its connection to the kernel's store is gone (lost,
remade, or silent: see Freshness), and its last words say which of these it saw.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from . import signing

ALIVE_KEY = "infini/alive"
BEAT_S = 1.0


def beat(key: str, seq: int, now: float) -> bytes:
    """The signed beat number ``seq``."""
    return signing.sign(key, ALIVE_KEY, json.dumps({"seq": seq, "time": now}))


def read_beat(key: str, raw: bytes) -> int | None:
    """The sequence number of a beat our key signed; None for anything else."""
    body = signing.verify(key, ALIVE_KEY, raw)
    try:
        seq = json.loads(body)["seq"] if body is not None else None
    except (ValueError, KeyError, TypeError):
        return None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else None


LINK_ANSWERS_S = 5.0  # a connection counts as the kernel's store while it answered this recently


@dataclass
class Freshness:
    """What a rank knows of the kernel's beats: the newest sequence it took and when (its
    monotonic clock), what it saw since (for its last words), and its connection to the
    store: when it was made and when the store last answered on it.

    A beat can be kept from a rank (another user deleting the key, or overwriting it with
    an old copy, in a tight loop), but not its connection: one on which the rank took two
    fresh beats or more, still answering, goes to the store the kernel hosts (only the
    kernel signs new beats, and its process is alive: the connection would have dropped
    with it). One fresh beat is not enough: the newest beat, copied before the kernel died
    and not yet taken, can be served once from a store on the freed port. So the window
    ends the rank only when, besides no fresh beat, that connection is gone: lost, remade
    (a store on the freed port is a new connection), or silent (a network split)."""

    window: float
    since: float  # the last fresh beat, or when the rank began to follow
    last: int = -1
    seen: str = "no heartbeat yet"
    linked: float | None = None  # when the current connection was made
    answered: float = float("-inf")  # when the store last answered on it
    fresh_on_link: int = 0  # fresh beats taken on the current connection

    def take(self, seq: int | None, now: float) -> bool:
        """A beat read now; whether it is fresh (newer than the last one taken)."""
        if seq is None:
            self.seen = "the key was missing, unsigned or garbled (looked again)"
            return False
        if seq <= self.last:
            self.seen = f"only an old heartbeat (sequence {seq}, not newer than {self.last})"
            return False
        self.last, self.since, self.seen = seq, now, "fresh"
        self.fresh_on_link += 1
        return True

    def connected(self, now: float) -> None:
        self.linked, self.fresh_on_link = now, 0

    def reply(self, now: float) -> None:
        """The store answered on the current connection."""
        self.answered = now

    def unreachable(self, why: str) -> None:
        self.seen = f"the store could not be reached ({why})"
        self.linked = None

    def link_holds(self, now: float) -> bool:
        """The connection that brought two fresh beats or more still answers."""
        return (
            self.linked is not None
            and self.fresh_on_link >= 2
            and now - self.answered < LINK_ANSWERS_S
        )

    def expired(self, now: float) -> bool:
        return now - self.since > self.window and not self.link_holds(now)

    def left(self, now: float) -> float:
        """Seconds until the window ends without a fresh beat."""
        return self.since + self.window - now

    def last_words(self, now: float) -> str:
        return (
            f"no fresh signed heartbeat from the kernel for {now - self.since:.0f} s (the "
            f"last one taken: sequence {self.last}); then {self.seen}; this rank ends"
        )
