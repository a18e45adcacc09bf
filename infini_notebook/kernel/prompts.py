"""Kernel side of a rank's stdin (engine/stdin_relay.py): while a cell runs, the questions
its ranks ask are answered one at a time, in the order asked, in Jupyter's own input box
labeled with the rank (``[rank 1] (Pdb)``), after the output the rank printed before it.

Waiting for a human is not a hang: the cell's loop is parked in the input box, so nothing
is released and no wait is reported meanwhile; the rank shows "at a prompt" in
``%dist_status``. Where no box can be shown (a front end without stdin, a ``--background``
cell, a script), the rank gets StdinNotImplementedError with the reason.
"""

from __future__ import annotations

import threading
import time

from ..core.ranks import rank_label

POLL_S = 0.1  # how often a running cell looks for questions
OUTPUT_WAIT_S = 2.0  # for the text a rank printed before asking to arrive
STOPPED = "the Stop button at its prompt"


class Prompts:
    """The questions of one running cell's ranks. ``CellWatch.follow`` (watch.py) calls
    ``serve`` in its loop."""

    def __init__(self, s, cell, on_answer=None):
        self.s, self.cell, self.on_answer = s, cell, on_answer
        self.next_poll = time.monotonic() + POLL_S
        self.why_not = why_no_input()
        self.stopped: set[int] = set()  # ranks whose prompt the Stop button ended

    def serve(self) -> None:
        if time.monotonic() < self.next_poll:
            return
        for n, question in self.s.rendezvous.prompts():
            self.s.rendezvous.answer_prompt(n, self._reply(question))
        self.next_poll = time.monotonic() + POLL_S

    def _reply(self, question: dict) -> dict:
        rank, prompt = question.get("rank"), str(question.get("prompt", ""))
        if rank not in self.cell.targets or question.get("cell") != self.cell.msg_id(rank):
            return {"error": "asked for input outside the cell that ran it: nobody to answer"}
        if self.why_not:
            return {"error": f"input({prompt!r}) has no answer: {self.why_not}"}
        if self.stopped:  # after a Stop, the cell's other prompts end too
            return {"stop": STOPPED}
        self.cell.wait_for_text(rank, question.get("sent") or {}, OUTPUT_WAIT_S)
        self.cell.show(final=False)
        password = bool(question.get("password"))
        from IPython.core.error import StdinNotImplementedError  # what ipykernel raises

        self.s.book.set_prompt(rank, True)
        try:  # no trailing space: JupyterLab adds one before the answer it echoes
            value = ask(f"{rank_label([rank])} {prompt}".rstrip(), password)
        except EOFError:
            return {"eof": True}
        except KeyboardInterrupt:  # the Stop button ends the prompt, not the whole cell:
            self.stopped.add(rank)  # the rank leaves it, and its peers are released
            return {"stop": STOPPED}
        except StdinNotImplementedError:  # the request that ran the cell allowed no stdin
            return {"error": f"input({prompt!r}) has no answer: {NO_STDIN}"}
        finally:
            self.s.book.set_prompt(rank, False)
            if self.on_answer is not None:
                self.on_answer()
        self.cell.input_given(rank, prompt + ("" if password else value))
        return {"value": value}


def why_no_input() -> str:
    """Why no input box can be shown for this cell ("" when one can)."""
    if threading.current_thread() is not threading.main_thread():
        return "a --background cell cannot take input: run it without --background"
    kernel = _kernel()
    if kernel is None:
        return "there is no notebook to ask (input works in a %%dist cell of a notebook)"
    return ""


NO_STDIN = (
    "the front end that ran the cell takes no input (as nbclient without allow_stdin): "
    "run it in JupyterLab, Notebook or VS Code"
)


def ask(prompt: str, password: bool) -> str:
    """Jupyter's input box (ipykernel's input request, to the front end that ran the cell);
    raises StdinNotImplementedError where that front end takes no input."""
    kernel = _kernel()
    return kernel.getpass(prompt) if password else kernel.raw_input(prompt)


def _kernel():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return getattr(get_ipython(), "kernel", None)
