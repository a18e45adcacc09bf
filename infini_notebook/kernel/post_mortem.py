"""After a failed cell, its failing frames on the ranks that failed (``%dist_debug``): code
run there (``run_code``), or pdb at the notebook's input box (``debug``). The rank side is
``engine/postmortem.py``. Functions taking the Session; the last cell stays the one
inspected, so both work again."""

from __future__ import annotations

from ..core.errors import DistUsageError
from ..core.output import prefix_lines
from ..core.ranks import parse_ranks, rank_label
from ..engine import postmortem
from . import execution, supervision
from .printers import TextPrinter


def run_code(s, code: str, ranks: str | list[int] | None, echo: bool) -> dict[int, str]:
    """``code`` run in the failing frame of each rank that failed (of ``ranks``);
    ``{rank: output}``, shown labeled when ``echo``."""
    targets = failed_ranks(s, ranks)
    dead = supervision.dead_ranks(s, targets)
    if dead:
        raise DistUsageError(f"{supervision.dead_text(dead)}: its frames are gone.")
    out = s.apply(postmortem.post_mortem, code, ranks=targets, timeout=60)
    if echo:
        shown = [prefix_lines(rank_label([r]), text) for r, text in out.items() if text]
        TextPrinter(echo).out("".join(shown))
    return out


def debug(s, ranks: str | list[int] | None) -> None:
    """pdb in the failing frame of each rank that failed (of ``ranks``), as a cell of the
    kernel's own."""
    targets = failed_ranks(s, ranks)
    # no process group is used (a session whose groups broke can debug too), and the
    # last cell stays the one inspected, its ranks still failed
    printer = TextPrinter(True, owns_cell=True)
    execution.run(s, postmortem.DEBUG_CELL, targets, False, None, printer, users=False)


def failed_ranks(s, ranks: str | list[int] | None) -> list[int]:
    """The ranks that failed in the last cell (of ``ranks``); DistUsageError if none."""
    failed = sorted(s.last.errors) if s.last is not None else []
    if not failed:
        raise DistUsageError(
            "The last cell did not fail, so there is no failing frame to inspect. "
            "Post-mortem works right after a %%dist cell that raised on some rank."
        )
    if ranks is None:
        return failed
    chosen = parse_ranks(ranks, s.world_size)
    if not set(chosen) <= set(failed):
        raise DistUsageError(
            f"Only {rank_label(failed)[1:-1]} failed in the last cell; pick --ranks among them."
        )
    return chosen
