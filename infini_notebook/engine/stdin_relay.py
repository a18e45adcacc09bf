"""A rank's stdin is the notebook's: ``input()``, ``getpass``, pdb and every ``cmd.Cmd``
debugger (``breakpoint()``, ``torch.distributed.breakpoint``), and ``sys.stdin.readline()``
ask the notebook, which shows Jupyter's input box labeled with the rank. Runs inside each
engine; the kernel's side is kernel/prompts.py.

ipyparallel's engines take no input requests (ipykernel's ``raw_input`` raises
StdinNotImplementedError when the request did not allow stdin), and a rank may be on
another host. So the question goes through the kernel's TCPStore: the rank appends one
line to ``prompt_key("asks")``, the question as JSON (a random id, rank, prompt, password,
the cell's msg_id, and how much of stdout and stderr it has sent, so that the kernel shows
that text before the prompt), and polls for ``prompt_key("answer", id)``:
``{"value": text}``, ``{"sealed": ...}`` (getpass), ``{"eof": true}`` or ``{"error": why}``,
deleting it once read. Both are signed with the session's key (core/signing.py): an answer
another local user writes is dropped, never typed into the prompt. One
append is one store operation, so a question is either there whole or not at all: a Stop,
a release or a dying rank can never leave a gap that later questions queue behind.
Polled with short sleeps, so that the Stop button's SIGINT reaches the waiting rank.

pdb on a rank is ``RankPdb`` (``pdb.Pdb`` is replaced, so ``breakpoint()``, ``pdb.set_trace``
and torch's own debugger class, made from ``pdb.Pdb`` when called, all get it): a debugger
entered from inside torch.distributed (``torch.distributed.breakpoint(rank=1)``, another
wrapper there) starts in the frame that called it, where the user's names are, instead of in
torch's; and stepping skips torch.distributed's own frames (bdb's ``skip`` patterns).
"""

from __future__ import annotations

import io
import json
import secrets
import sys
import time
from datetime import timedelta

from ..core import signing

POLL_S = 0.05
_state: dict = {}  # cfg, the store client (made on the first question), the kernel


def prompt_key(what: str, n: str | None = None) -> str:
    return "infini/stdin/" + what + ("" if n is None else f"/{n}")


class StdinNotImplementedError(RuntimeError):
    """The notebook cannot answer: same name as IPython's, raised on the rank."""


def install(kernel, cfg: dict) -> bool:
    """Route the kernel's ``raw_input``/``getpass`` (what ``input()`` and ``getpass`` are
    during a cell) and ``sys.stdin`` to the notebook; whether it is in place."""
    if "cfg" in _state:
        return True
    if kernel is None or not callable(getattr(kernel, "raw_input", None)):
        return False
    _state.update(cfg=cfg, kernel=kernel)
    # ipykernel's _forward_input sets builtins.input = self.raw_input for each execute
    # request (ipykernel/ipkernel.py): an instance attribute is what it then finds
    kernel.raw_input = lambda prompt="": ask(str(prompt))
    kernel.getpass = lambda prompt="", stream=None, **_: ask(str(prompt), password=True)
    sys.stdin = NotebookStdin()
    install_pdb()
    return True


# Modules whose frames a debugger started in them leaves for their caller's, and whose
# frames stepping skips: torch.distributed calls pdb on the user's behalf.
SKIP = ("torch.distributed", "torch.distributed.*")
# torch.distributed.breakpoint's hint (torch/distributed/__init__.py), wrong once pdb
# starts in the caller's frame: left out
TORCH_HINT = "Type 'up' to get to the frame that called dist.breakpoint"


def install_pdb() -> None:
    """Make ``pdb.Pdb`` this rank's ``RankPdb`` (once)."""
    import pdb

    if getattr(pdb.Pdb, "infini_rank_pdb", False):
        return

    class RankPdb(pdb.Pdb):
        """pdb that starts in the first frame outside SKIP's modules: the one that called
        ``torch.distributed.breakpoint`` rather than torch's own."""

        infini_rank_pdb = True

        def __init__(self, *args, skip=None, **kwargs):
            super().__init__(*args, skip=[*SKIP, *(skip or ())], **kwargs)
            self._entered = None  # the frame set_trace was called from, until it stops

        def set_trace(self, frame=None):
            self._entered = frame or sys._getframe().f_back
            super().set_trace(self._entered)

        def stop_here(self, frame):  # the first stop: in the frame set_trace came from
            return frame is self._entered or super().stop_here(frame)

        def interaction(self, frame, traceback):
            if frame is not None and frame is self._entered:
                self._entered = None
                while frame.f_back is not None and self.is_skipped_module(
                    frame.f_globals.get("__name__")
                ):
                    frame = frame.f_back  # shown at its call: "-> dist.breakpoint(rank=1)"
            super().interaction(frame, traceback)

        def message(self, msg):
            if TORCH_HINT not in str(msg):
                super().message(msg)

    pdb.Pdb = RankPdb


class NotebookStdin(io.TextIOBase):
    """``sys.stdin`` of a rank: a line read during a cell is asked of the notebook; outside
    a cell (a pull, a bench) there is nobody to ask, and it reads as end of file."""

    def readable(self) -> bool:
        return True

    def readline(self, size: int = -1) -> str:
        from . import cell_end

        if not cell_end.in_cell():
            return ""
        try:
            line = ask("") + "\n"
        except EOFError:
            return ""
        return line if size is None or size < 0 else line[:size]

    def read(self, size: int = -1) -> str:
        return self.readline(size)

    def isatty(self) -> bool:
        return False


def ask(prompt: str, password: bool = False) -> str:
    """Ask the notebook for a line; raise EOFError, or StdinNotImplementedError with the
    kernel's reason, when it has none to give."""
    from . import output_streams

    for stream in (sys.stdout, sys.stderr):  # what the rank printed shows before the box
        try:
            stream.flush()
        except Exception:
            pass
    store = _store()
    kernel = _state["kernel"]
    parent = kernel.get_parent("shell") if hasattr(kernel, "get_parent") else {}
    n = f"{_state['cfg']['rank']}-{secrets.token_hex(8)}"
    question = {
        "id": n,
        "rank": _state["cfg"]["rank"],
        "prompt": prompt,
        "password": password,
        "cell": (parent or {}).get("header", {}).get("msg_id"),
        "sent": output_streams.sent(),
    }
    mac_key = _state["cfg"]["mac_key"]
    log = prompt_key("asks")
    # a newline before as well: stray bytes someone else appended form a line of their own
    store.append(log, b"\n" + signing.sign(mac_key, log, json.dumps(question)) + b"\n")
    # the whole question again: one whose line someone deleted is asked anew
    again = b"\n" + signing.sign(mac_key, log, json.dumps(dict(question, again=True))) + b"\n"
    reply = _signed_answer(
        store, mac_key, prompt_key("answer", n), lambda: store.append(log, again)
    )
    if "error" in reply:
        raise StdinNotImplementedError(reply["error"])
    if "stop" in reply:
        raise _stop(reply["stop"])
    if reply.get("eof"):
        raise EOFError
    if "sealed" in reply:  # a getpass answer: it crossed the store encrypted
        return signing.unseal(mac_key, prompt_key("answer", n), reply["sealed"])
    return reply["value"]


AGAIN_S = 3.0  # then the kernel is asked to send its answer again, if it gave one


def _signed_answer(store, mac_key: str, key: str, ask_again) -> dict:
    """The kernel's answer under ``key``, deleted once read. One that our key did not sign
    (another local user writing into the store) is dropped and said, and the wait goes on.
    Every AGAIN_S without one, ``ask_again()``: an answer the kernel gave that someone
    deleted from the store is sent again (one not given yet waits for the user)."""
    from .rank_services import peek

    told = False
    while True:
        try:
            waited = time.monotonic()
            while (raw := peek(store, key)) is None:
                time.sleep(POLL_S)  # SIGINT (an interrupt of the whole cell) raises here
                if time.monotonic() - waited > AGAIN_S:
                    ask_again()
                    waited = time.monotonic()
        except KeyboardInterrupt:
            raise _stop("interrupted at the prompt") from None
        body = signing.verify(mac_key, key, raw)
        store.delete_key(key)
        if body is not None:
            return json.loads(body)
        if not told:  # once per prompt: a flood of forgeries is no flood of lines
            told = True
            rank = _state["cfg"]["rank"]
            print(f"infini_notebook: an unsigned answer to rank {rank}'s prompt was ignored",
                  file=sys.stderr, flush=True)  # fmt: skip


def _stop(why: str) -> BaseException:
    """What ends a prompt the user stopped: in a debugger, BdbQuit (pdb catches a
    KeyboardInterrupt and asks again, so the rank would never leave), else
    KeyboardInterrupt."""
    import bdb

    frame = sys._getframe()
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), bdb.Bdb):
            return bdb.BdbQuit(why)
        frame = frame.f_back
    return KeyboardInterrupt(why)


def _store():
    if "store" not in _state:
        from .rank_services import session_store

        _state["store"] = session_store(_state["cfg"], timedelta(seconds=60))
    return _state["store"]
