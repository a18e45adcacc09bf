"""A rank's communication as the profile counts it (pure): each collective or point-to-point
op with the span it ran on the rank (µs, the rank's trace clock) and the keys that name it
on every rank taking part:

- ``("c", group, seq)``: a collective, by its group's name (the same on every member) and
  its sequence number in that group;
- ``("p", group, src, dst, n)``: the n-th message from global rank src to dst in the group
  (messages between two ranks arrive in the order they were sent), on the sender and on
  the receiver alike. A batch (``batch_isend_irecv``) runs as one kernel with a key per
  message.

Backends fill these in their own way (nccl_ops.py, gloo_ops.py); the profile's figures
(timeline.py) only read spans and keys."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CommOp:
    name: str  # the backend's record function: "nccl:all_reduce", "gloo:send"
    start: float  # µs on the rank's trace clock: when its part began to run
    end: float
    keys: tuple = ()  # () where nothing names it on the other ranks
    group: str = ""  # the group's description, to show ("default_pg")
    p2p: bool = False


def collective_key(group: str, seq) -> tuple:
    return ("c", str(group), int(seq))


@dataclass
class P2PCounter:
    """Numbers a rank's messages per (group, src, dst), in the order they were posted."""

    seen: dict = field(default_factory=dict)

    def key(self, group: str, src: int, dst: int) -> tuple:
        n = self.seen.get((group, src, dst), 0)
        self.seen[(group, src, dst)] = n + 1
        return ("p", str(group), int(src), int(dst), n)
