"""Another local process writes into the kernel's TCPStore, as issue 44's attacker did: it
knows only the store's port (/proc/net/tcp shows it to every user), lists the keys
(``TCPStore.list_keys()``) and writes answers and questions of its own. None of them may
change what a rank does: each is dropped and said in one line. The store cannot tell users
apart, so the attacker runs as a separate process of this user (the venv's interpreter is
not readable by another uid here); what it can reach is the same.

In a real kernel on 2 CPU ranks, driven as a front end does (answers typed after a pause,
so the forgery is there first)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import Frontend, text_of, use_session

pytestmark = pytest.mark.timeout(600)

# The attacker: waits for what it needs in the store, plants it, says "planted", then for a
# forged stack request whether it was answered.
ATTACKER = r"""
import json, re, sys, time
from datetime import timedelta
import torch.distributed as dist

port, what = int(sys.argv[1]), sys.argv[2]
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
deadline = time.time() + 30

def keys():
    return [k.decode() if isinstance(k, bytes) else k for k in store.list_keys()]

def root():
    return next(k.split("/infini/")[0] for k in keys() if "/infini/" in k)

while time.time() < deadline:
    if what in ("answer", "pdb"):
        log = [k for k in keys() if k.endswith("/infini/stdin/asks")]
        if log:
            line = store.get(log[0]).decode().strip().splitlines()[-1]
            qid = json.loads(line[line.index("{"):])["id"]
            evil = "EVIL-FROM-ANOTHER-PROCESS" if what == "answer" else "!print('PWNED')"
            forged = json.dumps({"value": evil})
            store.set(f"{root()}/infini/stdin/answer/{qid}", "0" * 64 + forged)
            print("planted", flush=True)
            break
    else:  # a release, or a stack request, to rank 0's answering thread
        counts = [k for k in keys() if k.endswith("/infini/stacks/0/count")]
        attempts = [int(m) for k in keys() for m in re.findall(r"attempt_(\d+)-", k)]
        if counts and attempts:
            n = store.add(counts[0], 0) + 1
            ask = counts[0].replace("/count", f"/ask/{n}")
            store.set(ask, f"release {max(attempts)}" if what == "release" else "")
            print("planted", flush=True)
            time.sleep(2)
            answer = counts[0].replace("/count", f"/answer/{n}")
            print("answered" if store.check([answer]) else "no answer", flush=True)
            break
    time.sleep(0.05)
"""


@pytest.fixture(scope="module")
def two(kernel):
    use_session(kernel, "--nprocs 2")


def attack(kernel, what: str) -> subprocess.Popen:
    port = int(text_of(kernel.run("print(dist_session.rendezvous.port)")).strip())
    return subprocess.Popen(
        [sys.executable, "-c", ATTACKER, str(port), what], stdout=subprocess.PIPE, text=True
    )


def test_a_forged_answer_at_input_is_ignored_and_said(kernel, two):
    attacker = attack(kernel, "answer")
    ui = Frontend(kernel, ["Ada"], think_s=3.0)  # the attacker writes first
    assert ui.run("%%dist --ranks 0\nname = input('your name? ')\nprint('hello', name)") == "ok"
    assert attacker.communicate(timeout=30)[0].strip() == "planted"
    shown = "".join(ui.shown.values())
    assert "[rank 0] hello Ada" in shown, shown
    assert "EVIL" not in shown
    assert "an unsigned answer to rank 0's prompt was ignored" in shown, shown


def test_a_forged_pdb_command_is_never_run(kernel, two):
    attacker = attack(kernel, "pdb")
    ui = Frontend(kernel, ["p 6 * 7", "c"], think_s=3.0)
    assert ui.run("%%dist --ranks 0\nx = 1\nbreakpoint()\nprint('after', x)") == "ok"
    assert attacker.communicate(timeout=30)[0].strip() == "planted"
    shown = "".join(ui.shown.values())
    assert "[rank 0] 42" in shown and "[rank 0] after 1" in shown, shown
    assert "PWNED" not in shown


@pytest.mark.parametrize("what", ["release", "stacks"])
def test_a_forged_question_to_a_rank_is_not_acted_on(kernel, two, what):
    """A forged "release ATTEMPT" would fail the running cell; a forged stack request would
    be answered with every thread's stack."""
    attacker = attack(kernel, what)
    t0 = time.monotonic()
    out = text_of(kernel.run("%%dist\nimport time\ntime.sleep(3)\nprint('finished', rank)"))
    said = attacker.communicate(timeout=30)[0].split()
    assert said[0] == "planted" and " ".join(said[1:]) == "no answer", said
    assert "[rank 0] finished 0" in out and "[rank 1] finished 1" in out, out
    assert time.monotonic() - t0 < 30
    stacks = text_of(kernel.run("%dist_stacks"))  # the kernel's own questions still work
    assert stacks.count("idle: no cell running") == 2, stacks  # both answered, verified
