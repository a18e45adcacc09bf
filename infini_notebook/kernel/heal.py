"""``%dist_heal``: give ranks that lack a name (or hold a stale copy: replaced since it was
last healed into them) its value from a healthy replica in their group. Every rank
describes what it holds (engine/heal.py ``survey``), core/heal_plan.py decides who sends to
whom (or why nobody can), and the ranks move the data over their process group
(engine/heal.py ``transfer``): nothing but the few bytes of the survey and the result goes
through the kernel."""

from __future__ import annotations

import time

from ..core.errors import DistCellError, DistUsageError
from ..core.heal_plan import Healed, check_names, plan
from ..core.ranks import parse_ranks
from ..engine import heal as rank_side
from . import recovery, supervision


def heal(s, names: list[str] | str, group: str = "dp", to=None) -> list[Healed]:
    """Heal each of ``names`` over every group of ``group`` (a kind: dp, tp, cp, pp,
    world, cp-dp ...); ``to``: these ranks receive (default: those missing the name or
    replaced since it was last healed into them). One ``Healed`` per name, in order."""
    try:
        names = check_names(names)
    except ValueError as e:
        raise DistUsageError(str(e)) from None
    try:
        kind = s.layout.normalize_kind(group)
    except ValueError as e:
        raise DistUsageError(f"Bad --from {group!r}: {e}") from None
    label = s.layout.kind_label(kind)
    targets = set(parse_ranks(to, s.world_size)) if to is not None else None
    s.require_whole()
    dead = supervision.dead_ranks(s, range(s.world_size))
    if dead:  # a dead rank is replaced first, then healed
        raise DistUsageError(
            f"Cannot heal: {supervision.dead_text(dead)}. {recovery.replace_advice(dead)} "
            f"Then %dist_heal {' '.join(names)}."
        )
    groups = s.layout.groups(kind)
    coords = {r: s.layout.coords(r) for r in range(s.world_size)}
    found = s.apply(rank_side.survey, names)
    out = []
    for name in names:
        stale = s.book.stale(name)
        healed = plan(
            name, {r: found[r][name] for r in found}, groups, label, stale, targets, coords
        )
        if healed.refused is None:
            _carry_out(s, healed, kind)
        out.append(healed)
    return out


def _carry_out(s, healed: Healed, kind: str) -> None:
    """Run the transfers on the ranks (every rank is called: a gloo twin built on first
    use is collective) and note what they did: bytes from the sources, the slowest rank's
    time, the receivers healed (RankBook: no longer stale)."""
    calls = {}
    for r in range(s.world_size):
        parts = [p for t in healed.transfers if (p := t.part_for(r)) is not None]
        calls[r] = (rank_side.transfer, (healed.name, kind, parts))
    try:
        got = s.apply_each(calls, "heal")
    except DistCellError as e:
        healed.error = e.summary
        return
    sources = {t.src for t in healed.transfers}
    healed.nbytes = sum(got[r]["nbytes"] for r in sources if got[r])
    healed.seconds = max((g["seconds"] for g in got.values() if g), default=0.0)
    errors = sorted({g["error"] for g in got.values() if g and "error" in g})
    if errors:
        healed.error = "; ".join(errors)
        return
    s.book.healed(healed.name, [r for t in healed.transfers for r in t.dst], time.time())
