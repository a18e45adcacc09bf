"""A kept session's life between kernels (issue 48, items 7 and 8): a kernel that lost its
session to another kernel, or whose session was stopped from another kernel, is told once
(its live %dist_status freezes with one line) and hears nothing of c10d; %dist_detach lets a
session go and keeps it; %dist_start after an attach names both ways out; %dist_stop after
an attach and %dist_stop NAME end every process (their times go to the run's summary; the
target is benchmarks/bench_stop.py's). Real kernels through jupyter_client, as
test_keep.py drives them."""

from __future__ import annotations

import re
import secrets
import subprocess
import sys
import time

import psutil
import pytest
from conftest import FAULT_TIMINGS, fresh_kernel, message, text_of
from jupyter_core.utils import run_sync
from test_keep import folder_of, wait_until_gone

from infini_notebook.launch.watchdog import wait_gone

pytestmark = pytest.mark.timeout(600)

C10D = ("sendBytes", "Broken pipe", "recvValue", "c10d", "TCPStore")
QUIET_S = 2.0  # how long a frozen widget's kernel is listened to after it froze: 4 polls
TIMED_STOP = (
    "import time as _t\n_t0 = _t.perf_counter()\n%dist_stop {name}\n"
    "print(f'stop took {{_t.perf_counter() - _t0:.3f}} s')"
)


class Listener:
    """Everything a kernel publishes between cells, as a frontend receives it: its streams
    (what c10d writes to the kernel's stderr arrives there) and its widgets' updates."""

    def __init__(self, cells):
        self.kc = cells.client.kc
        self.streams: list[str] = []
        self.titles: list[str] = []  # each status summary line its display was sent

    def take(self, msg) -> None:
        kind, content = msg["header"]["msg_type"], msg["content"]
        if kind == "stream":
            self.streams.append(content["text"])
        elif kind in ("display_data", "update_display_data"):  # %dist_status: in place
            text = content.get("data", {}).get("text/plain", "")
            if text.startswith("session "):
                self.titles.append(text.split("\n", 1)[0])

    def run(self, code: str) -> None:
        """A cell whose output keeps coming after it ends (``%dist_status``)."""
        run_sync(self.kc.execute_interactive)(code, output_hook=self.take, timeout=120)

    def until(self, words: str, timeout: float = 30.0) -> str:
        """Listen until a widget's line says ``words``; then on for QUIET_S more (what a
        poller that went on would print meanwhile). The line."""
        deadline = time.monotonic() + timeout
        while not (said := [t for t in self.titles if words in t]):
            assert time.monotonic() < deadline, (words, self.titles[-3:], self.streams[-3:])
            self._listen(0.2)
        self.listen(QUIET_S)
        return said[0]

    def listen(self, seconds: float) -> None:
        """Take what comes for ``seconds``."""
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            self._listen(left)

    def _listen(self, timeout: float) -> None:
        try:
            self.take(run_sync(self.kc.get_iopub_msg)(timeout=timeout))
        except Exception:  # queue.Empty: nothing within ``timeout``
            pass

    def c10d_text(self) -> list[str]:
        return [s for s in self.streams if any(word in s for word in C10D)]


def stop_seconds(out: str) -> float:
    found = re.search(r"stop took ([\d.]+) s", out)
    assert found, out
    return float(found.group(1))


def test_lost_kernels_freeze_quietly_detach_keeps_and_stops_end_everything():
    name = f"kl-{secrets.token_hex(3)}"
    with fresh_kernel() as first, fresh_kernel() as second, fresh_kernel() as third:
        said = text_of(first.run(f"%dist_start --nprocs 2 --name {name} --keep 2m", timeout=240))
        kept = "waits 2m for a kernel once none drives it"  # the ready line and status say so
        assert f"kept session {name!r}: {kept}; " in said, said
        first.run("%%dist\nx = rank * 10 + 1")
        folder = folder_of(first)
        heard = Listener(first)
        heard.run("%dist_status")  # live tiles, refreshed twice a second
        assert heard.titles[0].startswith(f"session {name!r} ready · kept: {kept} · 2 ranks")

        # another kernel takes it over: the first one's tiles freeze with who drives it now
        said = text_of(second.run(f"%dist_attach {name} --force"))
        assert f"taken over from kernel pid {first.kernel_pid}" in said, said
        line = heard.until(f"driven by kernel pid {second.kernel_pid} since")
        assert line.startswith(f"session {name!r} driven by") and "tiles as of" in line, line
        told = [t for t in heard.titles if "driven by" in t]
        assert len(told) == 1, told  # told once: the widget stopped there
        assert heard.c10d_text() == [], heard.c10d_text()[:2]
        out = first.run("%%dist\nprint(x)", allow_error=True)
        assert "no longer drives session" in message(out), text_of(out)

        # %dist_start while a kept session is attached names both ways out
        out = second.run("%dist_start --nprocs 2", allow_error=True)
        assert "%dist_detach" in message(out) and "%dist_stop" in message(out), text_of(out)

        # %dist_detach: the session waits for a kernel, which attaches it without --force
        said = text_of(second.run("%dist_detach"))
        assert f"Detached session {name!r}" in said and f"%dist_attach {name}" in said, said
        listed = text_of(third.run("%dist_sessions"))
        row = [r for r in listed.splitlines() if r.split()[:1] == [name]]
        head = listed.splitlines()[0]  # each header over its column (the text starts there)
        assert row and row[0][head.index("driver") :].startswith("detached, ends in"), listed
        assert row[0][head.index("backend") :].startswith("gloo "), listed
        out = second.run("%%dist\nprint(x)", allow_error=True)
        assert "detached session" in message(out), text_of(out)
        said = text_of(third.run(f"%dist_attach {name}"))
        assert "was detached" in said, said
        assert "[rank 1] 11" in text_of(third.run("%%dist\nprint(x)"))

        # %dist_stop of the attached session (the first kernel, which started its
        # processes, lives on): every process ends; the lost kernel stays quiet
        out = text_of(third.run(TIMED_STOP.format(name="")))
        FAULT_TIMINGS["keep: %dist_stop after attach, 2 ranks"] = stop_seconds(out)
        assert wait_until_gone(folder, 15) == []
        heard.listen(QUIET_S)
        assert heard.c10d_text() == [], heard.c10d_text()[:2]
        out = text_of(first.run("print('first')"))  # a cell of its own says nothing either
        assert out == "first\n", out

        # %dist_stop NAME from a kernel that does not drive it: the driving kernel's tiles
        # freeze saying so, and nothing of c10d reaches it
        name = f"kl-{secrets.token_hex(3)}"
        first.run(f"%dist_start --nprocs 2 --name {name} --keep 2m", timeout=240)
        folder = folder_of(first)
        heard = Listener(first)
        heard.run("%dist_status")
        out = text_of(second.run(TIMED_STOP.format(name=name)))
        assert f"Session {name!r} stopped." in out, out
        FAULT_TIMINGS["keep: %dist_stop NAME, 2 ranks"] = stop_seconds(out)
        assert wait_until_gone(folder, 15) == []
        line = heard.until("stopped from another kernel at")
        assert line.startswith(f"session {name!r} stopped"), line
        assert heard.c10d_text() == [], heard.c10d_text()[:2]
        out = first.run("%%dist\nprint(1)", allow_error=True)
        assert "was stopped from another kernel" in message(out), text_of(out)

        # an ordinary session cannot be detached: one line, which names %dist_stop
        second.run("%dist_start --nprocs 1", timeout=240)
        out = second.run("%dist_detach", allow_error=True)
        assert "cannot be detached" in message(out) and "%dist_stop" in message(out)
        assert "Traceback" not in text_of(out)
        second.run("%dist_stop")


# A process that starts a child and never reaps it (as a kernel that started a kept session
# and lives on, for the session's store host, template and watchdog): the child's pid.
NO_REAPER = """\
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
sys.stdin.read()
"""


def test_an_ended_process_its_parent_does_not_reap_counts_as_gone():
    parent = subprocess.Popen(
        [sys.executable, "-c", NO_REAPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        assert wait_gone([child], 0.05) == [child]  # running: still there after the timeout
        child.kill()
        assert wait_gone([child], 30) == []
        assert child.status() == psutil.STATUS_ZOMBIE  # ended, and nobody reaped it
        # what psutil's wait says of it: alive, until its timeout (the 5 s of a 6 s stop)
        assert psutil.wait_procs([child], timeout=0.1)[1] == [child]
    finally:
        parent.kill()
        parent.wait()
