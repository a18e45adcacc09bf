"""``%dist_heal``: who gives a name's value to whom, or why nobody can (pure).

Each rank describes what it holds under a name (engine/heal.py ``survey``: its kind, the
shapes of its tensors, its DTensors' meshes and placements, FSDP groups); ``plan`` decides,
for every group of a kind (dp by default), which ranks receive (missing the name, replaced
since it was last healed into them, or named with ``--to``) and which rank sends (the lowest
of the group that holds it and does not receive), or gives the one line that says why the
name cannot be healed (no replica in the group: a shard; no healthy copy; an optimizer
missing on a receiver). ``Healed`` is what one name's heal did, and its line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .ranks import format_ranks, rank_label

NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
CHECKPOINT = "no replica to heal from; load it from a checkpoint"


@dataclass
class Transfer:
    """One group's part of a heal: ``src`` sends to ``dst``. ``rebuild``: the receivers
    get a new object (they lack the name, or hold another kind of object); else their
    own is overwritten in place (so what refers to it, an optimizer to a module's
    parameters, stays valid)."""

    group: list[int]
    src: int
    dst: list[int]
    rebuild: bool = False

    def part_for(self, rank: int) -> dict | None:
        """What engine/heal.py ``transfer`` is told on ``rank`` (None: not involved)."""
        if rank != self.src and rank not in self.dst:
            return None
        return {"group": self.group, "src": self.src, "dst": self.dst, "rebuild": self.rebuild}


@dataclass
class Healed:
    """What healing one name did (``transfers``, ``nbytes``, ``seconds``), or why it did
    nothing (``refused``) or failed (``error``)."""

    name: str
    kind: str  # the group kind, as users read it ("dp", "world")
    what: str = ""  # the type: "Linear", "Adam", "Tensor", "DTensor", "int"
    object_kind: str = ""  # "module", "optimizer", "tensor", "value"
    transfers: list[Transfer] = field(default_factory=list)
    nbytes: int = 0
    seconds: float = 0.0
    refused: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.refused is None and self.error is None and bool(self.transfers)

    @property
    def line(self) -> str:
        if self.refused is not None:
            return self.refused
        pairs = " and ".join(
            f"from rank {t.src} to {rank_label(t.dst)[1:-1]}" for t in self.transfers
        )
        if self.error is not None:
            return (
                f"healing {self.name} ({self.what}) over {self.kind} {pairs} failed: {self.error}"
            )
        rebuilt = sorted(r for t in self.transfers if t.rebuild for r in t.dst)
        new = ""
        if rebuilt:
            how = " from the pickled module" if self.object_kind == "module" else ""
            new = f"; {'rebuilt' if how else 'new'} on {rank_label(rebuilt)[1:-1]}{how}"
        rate = ""
        if self.seconds > 0 and self.nbytes >= 1e6:  # a rate of a few bytes says nothing
            # groups heal at once: each group's rate, as %dist_bench gives a group's algbw
            n = len({tuple(t.group) for t in self.transfers})
            each = " per group" if n > 1 else ""
            rate = f" ({size_text(self.nbytes / n / self.seconds)}/s{each})"
        return (
            f"healed {self.name} ({self.what}) over {self.kind} {pairs}: "
            f"{size_text(self.nbytes)} in {time_text(self.seconds)}{rate}{new}"
        )


def check_names(names: list[str] | str) -> list[str]:
    """Names (``model``, ``trainer.opt``) as a list; ValueError naming a bad one."""
    names = names.split() if isinstance(names, str) else [str(n).strip() for n in names]
    bad = [n for n in names if not NAME.match(n)]
    if not names or bad:
        raise ValueError(
            f"%dist_heal takes variable names (model, opt, trainer.model), not {bad[0]!r}: "
            "heal the variable that holds it."
            if bad
            else "%dist_heal needs a name: %dist_heal model opt --from dp"
        )
    return list(dict.fromkeys(names))


def receivers(
    group: list[int], found: dict[int, dict], stale: set[int], to: set[int] | None
) -> list[int]:
    """The ranks of ``group`` that receive: those named by ``to``; without it, those
    missing the name or replaced since it was last healed into them (``stale``)."""
    if to is not None:
        return [r for r in group if r in to]
    return [r for r in group if "missing" in found[r] or r in stale]


def plan(
    name: str,
    found: dict[int, dict],
    groups: list[list[int]],
    kind: str,
    stale: set[int],
    to: set[int] | None,
    coords: dict[int, dict[str, int]],
) -> Healed:
    """The transfers that heal ``name`` in every group of ``kind``, or the refusal line.
    ``found``: each rank's survey of the name; ``coords``: each rank's layout coordinates."""
    out = Healed(name, kind)
    holders = [r for r in sorted(found) if "missing" not in found[r]]
    if not holders:
        why = found[min(found)]["missing"] if found else "no ranks"
        out.refused = f"{name} is on no rank ({why}): nothing to heal from"
        return out
    out.what = found[holders[0]]["type"]
    for group in groups:
        dst = receivers(group, found, stale, to)
        if not dst:
            continue
        sources = [r for r in group if r in holders and r not in dst]
        if not sources:
            out.refused = (
                f"{name} has no healthy copy in {kind} group {rank_label(group)[1:-1]} "
                f"(each rank there lacks it or receives it): {CHECKPOINT}"
            )
            return out
        src = sources[0]
        out.what, out.object_kind = found[src]["type"], found[src]["kind"]
        why = sharded(name, found, group, src, dst, kind, coords)
        rebuild = [r for r in dst if _needs_rebuild(found[src], found[r])]
        why = why or _cannot_rebuild(name, found, src, dst, rebuild)
        if why:
            out.refused = why
            return out
        in_place = [r for r in dst if r not in rebuild]
        for part, new in ((in_place, False), (rebuild, True)):
            if part:
                out.transfers.append(Transfer(list(group), src, part, new))
    if not out.transfers:
        out.refused = (
            f"{name}: nothing to heal over {kind} (every rank holds it and none was replaced "
            f"since it was last healed; --to N heals rank N anyway)"
        )
    return out


def sharded(
    name: str,
    found: dict[int, dict],
    group: list[int],
    src: int,
    dst: list[int],
    kind: str,
    coords: dict[int, dict[str, int]],
) -> str | None:
    """Why ``src`` holds no replica of what ``dst`` should hold (a shard), or None: tensors
    whose shapes differ within the group, a DTensor sharded along the group, FSDP shards."""
    mine = found[src]
    head = f"{name} is sharded over {kind}"
    shapes = _shape_conflict(found, group)
    if shapes:
        return f"{head} ({shapes}): {CHECKPOINT}"
    fsdp = set(mine.get("fsdp") or ())
    if fsdp & set(dst):
        return f"{head} (FSDP shards it over ranks {format_ranks(sorted(fsdp))}): {CHECKPOINT}"
    for leaf in mine.get("dtensors", []):
        for r in dst:
            theirs = _coordinate(leaf, found[r], r, coords)
            if theirs is None:
                return (
                    f"{name} is missing on rank {r} and {_leaf_text(name, leaf)} is a DTensor "
                    f"on a mesh rank {r} is not in: create {name} on rank {r} first (on its "
                    f"mesh), then heal it"
                )
            for i in leaf["sharded"]:
                if theirs[i] != leaf["coord"][i]:
                    dim = leaf["dims"][i] if leaf["dims"] else f"dim {i}"
                    where = f"{_leaf_text(name, leaf)} is " if leaf["leaf"] else ""
                    return (
                        f"{head} ({where}{leaf['placements'][i]} on mesh dim {dim}): {CHECKPOINT}"
                    )
    return None


def _leaf_text(name: str, leaf: dict) -> str:
    return f"its {leaf['leaf']}" if leaf["leaf"] else "it"


def _shape_conflict(found: dict[int, dict], group: list[int]) -> str | None:
    """'weight: rank 0 [2, 4], rank 1 [4, 4]' for the first tensor whose local shape
    differs between ranks of ``group`` that hold it."""
    seen: dict[str, tuple[int, list]] = {}
    for r in group:
        for leaf, sig in (found[r].get("sig") or {}).items():
            shape = sig[0]
            if leaf in seen and seen[leaf][1] != shape:
                first, other = seen[leaf]
                what = f"{leaf}: " if leaf else ""
                return f"{what}shape {other} on rank {first}, {shape} on rank {r}"
            seen.setdefault(leaf, (r, shape))
    return None


def _coordinate(leaf: dict, theirs: dict, rank: int, coords: dict) -> list[int] | None:
    """``rank``'s coordinates in the mesh of a DTensor ``leaf`` of the source: its own
    (when it holds the leaf), its layout coordinates (mesh dims named after the layout's),
    its place in the source's mesh, or None."""
    for other in theirs.get("dtensors", []):
        if other["leaf"] == leaf["leaf"]:
            return other["coord"]
    dims = leaf["dims"]
    if dims and all(d in coords[rank] for d in dims):
        return [coords[rank][d] for d in dims]
    return _position(leaf["mesh"], rank)


def _position(mesh, rank: int) -> list[int] | None:
    """Where ``rank`` is in a nested list of ranks, or None."""
    if not isinstance(mesh, list):
        return [] if mesh == rank else None
    for i, sub in enumerate(mesh):
        at = _position(sub, rank)
        if at is not None:
            return [i, *at]
    return None


def _needs_rebuild(src: dict, theirs: dict) -> bool:
    """A receiver gets a new object when it lacks the name, holds another kind of object,
    or tensors under other names, dtypes or devices (shapes that differ are shards)."""
    if "missing" in theirs or theirs["kind"] != src["kind"] or theirs["type"] != src["type"]:
        return True
    if src["kind"] in ("module", "tensor"):
        return theirs.get("sig") != src.get("sig")
    return False


def _cannot_rebuild(
    name: str, found: dict[int, dict], src: int, dst: list[int], rebuild: list[int]
) -> str | None:
    """Why a receiver cannot get ``name`` from ``src``: an optimizer missing there (it
    must be made there, over that rank's parameters) or with other parameter groups; a
    module that holds DTensors or is wrapped in DDP (made collectively), or a DTensor on a
    mesh of the user's own, missing there."""
    mine = found[src]
    kind = mine["kind"]
    if kind == "optimizer":
        if rebuild:
            return (
                f"{name} is missing on {rank_label(rebuild)[1:-1]}: create the optimizer "
                f"there first (as on rank {src}, over the healed model's parameters), then "
                f"%dist_heal {name}"
            )
        odd = [r for r in dst if found[r].get("groups") != mine.get("groups")]
        if odd:
            r = odd[0]
            return (
                f"{name} on rank {r} has other parameter groups than on rank {src} "
                f"({found[r].get('groups')} parameters against {mine.get('groups')}): "
                f"create it there as on rank {src}, then %dist_heal {name}"
            )
        return None
    if not rebuild:
        return None
    who = rank_label(rebuild)[1:-1]
    if kind == "module" and (mine.get("ddp") or mine.get("dtensors")):
        made = "is wrapped in DDP" if mine.get("ddp") else "holds DTensors"
        return (
            f"{name} is missing (or made otherwise) on {who} and {made}: build it there "
            f"first (on every rank, as you did), then %dist_heal {name}"
        )
    if kind == "tensor" and mine.get("dtensors") and not mine["dtensors"][0]["session_mesh"]:
        return (
            f"{name} is missing (or made otherwise) on {who} and is a DTensor on a mesh of "
            f"your own: create it there first (on its mesh), then %dist_heal {name}"
        )
    return None


def size_text(n: float) -> str:
    """Bytes as people read them: '812 B', '4.2 kB', '100.0 MB' (powers of 1000)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def time_text(seconds: float) -> str:
    """'3.1 ms', '1.25 s'."""
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"
