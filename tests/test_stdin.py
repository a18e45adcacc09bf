"""A rank's stdin is the notebook's (issue 32): input(), pdb and torch.distributed.breakpoint
on a rank are answered at the notebook's input box, labeled with the rank, one prompt at a
time; q, the Stop button and a front end without stdin end them cleanly; %dist_debug with no
code opens pdb in the failing frame. In a real kernel on 2 CPU ranks, driven as a front end
does (jupyter_client's execute_interactive with allow_stdin)."""

from __future__ import annotations

import re

import pytest
from conftest import Frontend, message, text_of, use_session

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def two(kernel):
    use_session(kernel, "--nprocs 2")


def test_input_on_rank_0_is_asked_in_the_notebook(kernel, two):
    ui = Frontend(kernel, ["alice"])
    code = "%%dist\nname = input(f'name{rank}? ') if rank == 0 else 'nobody'\nprint('got', name)"
    assert ui.run(code) == "ok"
    assert ui.prompts() == ["[rank 0] name0?"]  # JupyterLab puts its own space after it
    lines = ui.shown["stdout"].splitlines()
    assert lines == ["[rank 0] name0? alice", "[rank 0] got alice", "[rank 1] got nobody"]


BREAKPOINT = """%%dist
x = rank * 10
torch.distributed.breakpoint(rank=1)
print('after', rank, x)"""

# Records what %dist_status says of each rank while the next cell runs
RECORD_STATES = """\
import threading, time
_seen, _stop = set(), threading.Event()
def _record():
    while not _stop.is_set():
        _seen.update((r.rank, r.state) for r in dist_session.status())
        time.sleep(0.05)
threading.Thread(target=_record, daemon=True).start()"""


def test_torch_distributed_breakpoint_steps_through_rank_1_while_rank_0_waits(kernel, two):
    """Issue 40 item 3: pdb starts in the user's frame, at the breakpoint's line (not in
    torch's, where `p x` was a NameError until `up`); `n` steps over torch's own frames
    (rank 0 leaves the barrier) to the end of that statement (IPython runs a cell's last
    statement apart), where the user's names are still there."""
    kernel.run(RECORD_STATES)
    # A person who thinks longer than a wait takes to be reported hung (2 s): no report
    ui = Frontend(kernel, ["p x + 1", "n", "p rank", "c"], think_s=2.5)
    assert ui.run(BREAKPOINT) == "ok"
    assert ui.prompts() == ["[rank 1] (Pdb)"] * 4
    out = ui.shown["stdout"]
    assert "Type 'up'" not in out and "distributed/__init__.py" not in out, out
    # the user's frame, at the breakpoint's own line; pdb names the cell as the notebook does
    assert re.search(
        r"\[rank 1\] > In\[\d+\]\(3\)<module>\(\)\n"
        r"\[rank 1\] -> torch.distributed.breakpoint\(rank=1\)\n",
        out,
    ), out
    assert "[rank 1] (Pdb) p x + 1\n[rank 1] 11\n" in out  # the answer kept in place
    assert "[rank 1] (Pdb) n\n[rank 1] --Return--\n" in out, out
    assert "[rank 1] (Pdb) p rank\n[rank 1] 1\n" in out
    assert "[rank 0] after 0 0" in out and "[rank 1] after 1 10" in out
    seen = text_of(kernel.run("_stop.set(); print(sorted(_seen))"))
    assert "(1, 'prompt')" in seen and "(0, 'busy')" in seen, seen  # not a hang
    assert "(0, 'released')" not in seen
    assert not [d for d in ui.displays if d.startswith("waiting")], ui.displays
    assert "[rank 1] 1" in text_of(kernel.run("%%dist\nprint(rank)"))


def test_breakpoint_and_a_breakpoint_wrapper_start_in_the_users_frame(kernel, two):
    """breakpoint() stops in the cell's frame, as Python does; a wrapper that calls pdb
    from inside torch.distributed (as torch.distributed.breakpoint does) in its caller's."""
    ui = Frontend(kernel, ["p y", "c", "p y * 2", "c"])
    code = (
        "%%dist --ranks 0\nimport pdb, types\ny = 21\nbreakpoint()\n"
        "wrapper = types.FunctionType(compile('def stop():\\n    pdb.set_trace()\\n    pass', "
        "'w', 'exec').co_consts[0], {'pdb': pdb, '__name__': 'torch.distributed.fake'})\n"
        "wrapper()\nprint('done', y)"
    )
    assert ui.run(code) == "ok"
    out = ui.shown["stdout"]
    assert "[rank 0] (Pdb) p y\n[rank 0] 21\n" in out
    assert "[rank 0] (Pdb) p y * 2\n[rank 0] 42" in out
    assert "[rank 0] -> wrapper()\n" in out, out  # the wrapper's caller, not the wrapper
    assert "[rank 0] done 21" in out


def test_two_ranks_asking_at_once_are_answered_one_after_the_other(kernel, two):
    ui = Frontend(kernel, ["A", "B"])
    assert ui.run("%%dist\nanswer = input(f'r{rank}? ')\nprint('got', answer)") == "ok"
    assert sorted(ui.prompts()) == ["[rank 0] r0?", "[rank 1] r1?"]
    got = dict(zip(ui.prompts(), "AB"))
    for r in range(2):
        assert f"[rank {r}] got {got[f'[rank {r}] r{r}?']}" in ui.shown["stdout"]


def test_q_fails_the_rank_in_one_line_and_releases_the_other(kernel, two):
    ui = Frontend(kernel, ["q"])
    assert ui.run(BREAKPOINT) == "error"
    summary = ui.summary()
    assert summary.startswith("rank 1: left the debugger (q); rank 0 was waiting for rank 1")
    assert "BdbQuit" not in summary and "Traceback" not in "".join(ui.shown.values())
    assert "[rank 0] 0" in text_of(kernel.run("%%dist\nprint(rank)"))


def test_the_stop_button_at_a_prompt_ends_it_and_the_cell(kernel, two):
    ui = Frontend(kernel, ["up", "!STOP"])
    assert ui.run(BREAKPOINT) == "error"
    assert ui.summary().startswith("rank 1: left the debugger (the Stop button at its prompt)")
    assert "[rank 1] (Pdb) up\n" in ui.shown["stdout"]  # answered before the Stop
    assert "[rank 0] 0" in text_of(kernel.run("%%dist\nprint(rank)"))


def test_without_stdin_the_rank_gets_StdinNotImplementedError_saying_why(kernel, two):
    cell = kernel.run("%%dist --ranks 1\ninput('name? ')", allow_error=True)  # nbclient
    err = message(cell)
    assert "StdinNotImplementedError: input('name? ') has no answer: the front end" in err
    assert "allow_stdin): run it in JupyterLab, Notebook or VS Code" in err
    kernel.run("%%dist --background --ranks 1\ninput('name? ')")
    kernel.run("dist_session.background.join(60)")
    out = text_of(kernel.run("print(dist_session.last.errors)"))
    assert "a --background cell cannot take input" in out, out


def test_dist_debug_with_no_code_opens_pdb_in_the_failing_frame(kernel, two):
    failing = "%%dist\ndef f(y):\n    if rank == 1:\n        raise ValueError(y)\nf(rank + 41)"
    kernel.run(failing, allow_error=True)
    ui = Frontend(kernel, ["p y * 2", "q"])
    assert ui.run("%dist_debug --ranks 1") == "ok"
    assert ui.prompts() == ["[rank 1] (Pdb)"] * 2
    assert "-> raise ValueError(y)" in ui.shown["stdout"]  # the user's frame, not torch's
    assert ")f()" in ui.shown["stdout"] and "[rank 1] > In[" in ui.shown["stdout"]
    assert "[rank 1] 84" in ui.shown["stdout"]
    assert "[rank 1] 41" in text_of(kernel.run("%dist_debug print(y - 1)"))  # still there
    states = text_of(kernel.run("print([r.state for r in dist_session.status()])"))
    assert states.strip() == "['idle', 'failed']", states  # the debugger's cell is not one


def test_auto_mode_cells_ask_too(kernel, two):
    kernel.run("%dist_auto on")
    try:
        ui = Frontend(kernel, ["bob"])
        assert ui.run("who = input('who? ') if rank == 1 else ''\nprint('hi', who)") == "ok"
        assert ui.prompts() == ["[rank 1] who?"]
        assert "[rank 1] hi bob" in ui.shown["stdout"]
    finally:
        kernel.run("%dist_auto off")


def test_sys_stdin_getpass_and_end_of_file(kernel, two):
    ui = Frontend(kernel, ["line one", "s3cret", "\x04"])  # Ctrl-D: end of file
    code = (
        "%%dist --ranks 0\nimport getpass, sys\nline = sys.stdin.readline()\n"
        "secret = getpass.getpass('pw? ')\ntry:\n    input('more? ')\n"
        "except EOFError:\n    print('EOF')\nprint(repr(line), len(secret))"
    )
    assert ui.run(code) == "ok"
    assert ui.prompts() == ["[rank 0]", "[rank 0] pw?", "[rank 0] more?"]
    out = ui.shown["stdout"]
    assert "[rank 0] EOF\n[rank 0] 'line one\\n' 6" in out
    assert "s3cret" not in out  # a password is not kept in the output


def test_a_script_has_no_notebook_to_ask(session4):
    """session.run() outside a notebook (here: pytest's process): the rank is told why."""
    from infini_notebook.core.errors import DistCellError

    with pytest.raises(DistCellError) as failed:
        session4.run("input('name? ')", ranks=[0], echo=False)
    assert "StdinNotImplementedError: input('name? ') has no answer: there is no notebook" in (
        str(failed.value)
    )


def test_the_question_log_is_read_whole_lines_only_and_skips_what_no_rank_wrote():
    """Issue 39 item 2: questions are one appended log (one store operation each), so none
    can be half there: a line still being written waits, a malformed one is skipped, and
    every question after either is read. Answers no rank read are deleted after the cell."""
    import json
    from datetime import timedelta

    from infini_notebook.core import signing
    from infini_notebook.core.plan_checks import make_plan
    from infini_notebook.engine.rank_services import session_store
    from infini_notebook.engine.stdin_relay import prompt_key
    from infini_notebook.launch.rendezvous import Rendezvous

    rdzv = Rendezvous(make_plan(nprocs=2))
    rdzv.host()
    log = prompt_key("asks")

    def line(q: dict) -> bytes:  # as a rank writes it: signed with the session's key
        return signing.sign(rdzv.mac_key, log, json.dumps(q)) + b"\n"

    def write(data) -> None:
        """Append as a rank does, then wait until the store has it: TCPStore::append sends
        without awaiting an answer (torch/csrc/distributed/c10d/TCPStore.cpp), so a read on
        the kernel's connection could come first; a check on this one is answered after."""
        rank.append(log, data)
        rank.check([log])

    try:
        rank = session_store(rdzv.engine_fields(), timedelta(seconds=10))
        q = {"id": "1-a", "rank": 1, "prompt": "x? "}
        write(line(q)[:80])  # a write not finished yet
        assert rdzv.prompts() == []
        write(line(q)[80:])
        assert rdzv.prompts() == [("1-a", q)]
        write("not a question\n")
        q2 = {"id": "0-b", "rank": 0, "prompt": "y? "}
        write(line(q2))
        assert rdzv.prompts() == [("0-b", q2)]  # read past the line no rank wrote
        assert rdzv.prompts() == []  # each question once
        rdzv.answer_prompt("1-a", {"value": "never read"})  # its rank died at the prompt
        rank.wait([prompt_key("answer", "1-a")], timedelta(seconds=10))  # set: no answer
        rdzv.drop_unread_answers()
        assert not rank.check([prompt_key("answer", "1-a")])
    finally:
        rdzv.close()


def test_a_rank_that_dies_at_its_prompt_leaves_later_prompts_working(kernel, two):
    """The rank dies while the person thinks; their answer goes nowhere, and is deleted;
    after the hard restart a rank's input() is answered as before."""
    ui = Frontend(kernel, ["too late"], think_s=2.0)
    code = (
        "%%dist --ranks 1\nimport os, threading\n"
        "threading.Timer(0.5, os._exit, (3,)).start()\ninput('last words? ')"
    )
    assert ui.run(code) == "error"
    assert "died" in ui.summary() or "exit" in ui.summary(), ui.summary()
    kernel.run("%dist_restart --hard", timeout=240)
    ui = Frontend(kernel, ["B0", "B1"])
    assert ui.run("%%dist\nanswer = input(f'again{rank}? ')\nprint('got', answer)") == "ok"
    assert sorted(ui.prompts()) == ["[rank 0] again0?", "[rank 1] again1?"]
    assert ui.shown["stdout"].count("got B") == 2
