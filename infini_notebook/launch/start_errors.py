"""What a failed start says: an engine's exit in words, the engines that ended before
registering (with the tail of their output), and the error a failed start raises."""

from __future__ import annotations

from ..core.errors import DistCellError
from ..core.output import one_line
from ..core.plan import SessionPlan


def exit_description(code) -> str:
    """An exit code in words; "exit status unknown" for anything that is not one (a
    launcher that reattached to an engine after a kernel restart reports a dict)."""
    import signal

    if not isinstance(code, int) or isinstance(code, bool):
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class EnginesExited(RuntimeError):
    """Engines ended before registering; carries the tail of what they printed."""

    def __init__(self, engine_set, lines: int = 20):
        data = getattr(engine_set, "stop_data", None)
        exits = data.get("engines", {}) if isinstance(data, dict) else {}
        exits = {i: d for i, d in exits.items() if isinstance(d, dict)}
        codes = {i: d.get("exit_code") for i, d in exits.items()}
        failed = {i: c for i, c in codes.items() if c}
        ident, code = next(iter(failed.items()), next(iter(codes.items()), ("?", None)))
        more = f" ({len(exits) - 1} more engines exited)" if len(exits) > 1 else ""
        super().__init__(f"engine {ident} exited while starting ({exit_description(code)}){more}")
        try:
            output = engine_set.get_output() if engine_set is not None else ""
        except Exception:
            output = ""
        self.output = "".join(output.splitlines(True)[-lines:])


def start_error(plan: SessionPlan, e: Exception) -> DistCellError:
    """What a failed start says: the cause (an engine's own output when it exited) and
    advice that fits where the ranks run."""
    from .launchers import start_advice

    place = plan.placement
    cause = str(e) if isinstance(e, EnginesExited) else one_line(e)
    output = getattr(e, "output", "").rstrip()
    seen = " (its output is above)" if output else ""
    return DistCellError(
        f"Starting {plan.world_size} ranks with the {place.launcher} launcher failed: "
        f"{cause}{seen}. Nothing is left running. {start_advice(plan)}",
        f"{output}\n" if output else "",
    )
