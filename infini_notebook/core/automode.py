"""Auto mode (``%dist_auto``): while it is on, every plain cell runs on the ranks.

The input transformer that turns a plain cell into a ``%%dist_auto`` call, and switching it
on a shell. No IPython import: the shell is passed in.
"""

from __future__ import annotations

AUTO_MARKER = "%%dist (auto)"  # first line of every cell auto mode sends to the ranks


def auto_cell_lines(lines: list[str]) -> list[str]:
    """IPython input transformer for auto mode: a plain cell becomes one call that runs it
    through %%dist_auto; a cell whose first code line is a magic, a shell escape or help
    (%dist_status, %dist_auto off, !ls) is left to run in the kernel."""
    code = [line.lstrip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not code or code[0][0] in "%!?":
        return lines
    return [f"get_ipython().run_cell_magic('dist_auto', '', {''.join(lines)!r})\n"]


# IPython's is-this-cell-complete check must see the user's code, not our one-line call.
auto_cell_lines.has_side_effects = True


def is_on(shell) -> bool:
    return auto_cell_lines in shell.input_transformers_cleanup


def wanted(state: str | None, on: bool) -> bool:
    """Whether auto mode should be on after ``%dist_auto [on|off]``; no state toggles."""
    return state == "on" or (state is None and not on)


def turn_on(shell) -> None:
    if not is_on(shell):
        shell.input_transformers_cleanup.append(auto_cell_lines)


def turn_off(shell) -> bool:
    """Remove the transformer; True when auto mode was on."""
    if not is_on(shell):
        return False
    shell.input_transformers_cleanup.remove(auto_cell_lines)
    return True
