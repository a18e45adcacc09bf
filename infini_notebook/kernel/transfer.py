"""Values between the notebook and the ranks (pull, push): through shared memory for ranks
on this host (``shm_transport``), through ipyparallel's message stream for the others and
wherever shared memory cannot serve. Plain functions taking the Session; the kernel makes
and removes every file (in the session's 0700 folder in /dev/shm), so a failed or
interrupted transfer leaves none, and a rank uses only a file the kernel made and still has
(shm_transport.open_segment)."""

from __future__ import annotations

from typing import Any

from ..core.errors import DistCellError, DistUsageError
from ..core.output import one_line
from ..engine import shm_transport
from ..engine import values as rank_values


def shared_ranks(s, targets: list[int]) -> list[int]:
    """Of ``targets``, the ranks whose engine is a process of ours on this host (see
    engine_sets.own_process), when /dev/shm is there to use."""
    if not shm_transport.enabled:
        return []
    local = [r for r in targets if s.engines.local(r) is not None]
    return local if local and s.folder.shm_dir() is not None else []


def pull(s, name: str, targets: list[int]) -> dict[int, Any]:
    """``{rank: value}`` of ``name``. Each rank on this host writes its value's large buffers
    into a file made for it here; the value is rebuilt on a private mapping of that file,
    which is removed at once (the mapping stays)."""
    shared = shared_ranks(s, targets)
    segments = shm_transport.make_segments(s.folder.shm_dir() if shared else None, "pull", shared)
    calls = {
        r: (rank_values.pull_shared, (name, segments[r]))
        if r in segments
        else (rank_values.pull_value, (name,))
        for r in targets
    }
    try:
        replies = s.apply_each(calls, "pull_value", timeout=60)
        return {r: shm_transport.received(replies[r], segments.get(r)) for r in targets}
    finally:
        shm_transport.remove(segments.values())


def push(s, values: dict, targets: list[int]) -> None:
    """Set ``values`` in the ranks' namespaces; DistUsageError naming a value that cannot
    travel (then nothing was sent)."""
    try:
        _push(s, values, targets)
    except (DistUsageError, DistCellError):
        raise
    except Exception as e:  # ipyparallel could not serialize a value: nothing was sent
        raise DistUsageError(_unsendable_text(values, e)) from None


def _push(s, values: dict, targets: list[int]) -> None:
    """Set ``values`` in the ranks' namespaces. Pickled once for the ranks on this host, their
    large buffers in one file that each maps copy-on-write, removed once all have answered."""
    shared = shared_ranks(s, targets)
    code = {k: v for k, v in values.items() if shm_transport.travels_as_code(v)}
    data = {k: v for k, v in values.items() if k not in code}
    segment = shm_transport.make_segments(s.folder.shm_dir() if shared else None, "push", [0])
    try:
        packed = shm_transport.pack_or_none(data, segment[0]) if segment else None
        if packed is None:  # ipyparallel's path for all (and its error for an unpicklable value)
            shared = []
        calls = {
            r: (rank_values.push_shared, (code, packed, segment[0]))
            if r in shared
            else (rank_values.push_values, (values,))
            for r in targets
        }
        replies = s.apply_each(calls, "push_values", timeout=60)
    finally:
        shm_transport.remove(segment.values())
    missed = [r for r in shared if replies[r] is False]  # they see another /dev/shm
    if missed:
        s.apply_each({r: (rank_values.push_values, (values,)) for r in missed}, "push_values", 60)


def _unsendable_text(values: dict, error: Exception) -> str:
    """Name the value that cannot travel to the ranks (tried one by one, only on failure)."""
    from ipyparallel.serialize import serialize_object

    for name, value in values.items():
        try:
            serialize_object(value)
        except Exception:
            kind = f"{type(value).__module__}.{type(value).__qualname__}"
            kind = kind.removeprefix("builtins.")
            return (
                f"cannot send `{name}` to the ranks: {kind} cannot be pickled. Send the data "
                "it holds instead, or create it on the ranks in a %%dist cell."
            )
    return f"cannot send {', '.join(f'`{n}`' for n in values)} to the ranks: {one_line(error)}"
