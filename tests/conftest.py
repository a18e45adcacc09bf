"""Shared fixtures. Starting ranks costs seconds on a 2-core machine, so sessions and kernels
are started once per module (or once per run) and reused."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import time

import nbformat
import pytest
from hypothesis import HealthCheck, settings
from jupyter_core.utils import run_sync  # nbclient's kernel client is the async one
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

# Hypothesis times each example (a deadline) and its input generation (a health check): wall
# clock checks that fail on a loaded 2-core machine, not the property under test. Timing
# belongs in benchmarks/.
settings.register_profile("infini", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("infini")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(name: str):
    """scripts/NAME.py as a module (the scripts are no package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_notebooks = _script("run_notebooks")  # its kernels' sockets, shared with the tests


@pytest.fixture(scope="session")
def session4():
    """An in-process API session: 4 CPU ranks on gloo, tp=2 (dp=2)."""
    import infini_notebook

    session = infini_notebook.start(nprocs=4, tp=2, timeout=30)
    # Its spare engines (engine_sets.Standby) first: forked at the first idle second, they
    # would compete with some test's timed cell for the CPU.
    session.engines.standby.launch.result(60)
    while len(session.engines.client.ids() - session.engines.standby.known) < 4:
        time.sleep(0.05)
    yield session
    session.stop()


class KernelCells:
    """Run cells one at a time in a real Jupyter kernel (nbclient), like a user would."""

    def __init__(self, client: NotebookClient):
        self.client = client
        self.index = 0

    def run(self, source: str, allow_error: bool = False, timeout: int = 120):
        cell = nbformat.v4.new_code_cell(source)
        self.client.nb.cells.append(cell)
        self.client.timeout = timeout
        try:
            self.client.execute_cell(cell, self.index, store_history=True)
        except CellExecutionError:
            if not allow_error:
                raise
        finally:
            self.index += 1
        return cell

    @property
    def kernel_pid(self) -> int:
        return self.client.km.provisioner.process.pid


class Frontend:
    """One cell run as JupyterLab runs it: input requests answered from ``answers`` (the
    string "!STOP" presses the Stop button instead), every message kept in order.
    ``before_answer()``, when given, is called at each prompt before the answer is typed
    (a test's attacker says it saw the question)."""

    def __init__(self, kernel, answers=(), think_s: float = 0.0, before_answer=None):
        self.kernel, self.answers, self.think_s = kernel, list(answers), think_s
        self.before_answer = before_answer
        self.events: list[tuple[str, str]] = []  # ("prompt" / "stdout" / ..., text)
        self.shown: dict[str, str] = {}  # what the cell shows at the end, per stream
        self.error: dict | None = None
        self.displays: list[str] = []  # every text/plain a display showed, updates too

    def run(self, code: str) -> str:
        client = self.kernel.client
        reply = run_sync(client.kc.execute_interactive)(
            code,
            allow_stdin=True,
            stdin_hook=self._stdin,
            output_hook=self._output,
            timeout=120,
        )
        return reply["content"]["status"]

    def _stdin(self, msg) -> None:
        self.events.append(("prompt", msg["content"]["prompt"]))
        answer = self.answers.pop(0)
        if self.before_answer is not None:
            self.before_answer()
        time.sleep(self.think_s)  # a person reads before typing
        if answer == "!STOP":  # what the button does to an IPython kernel: SIGINT
            os.kill(self.kernel.kernel_pid, signal.SIGINT)
        else:
            self.kernel.client.kc.input(answer)

    def _output(self, msg) -> None:
        kind, content = msg["header"]["msg_type"], msg["content"]
        if kind == "stream":
            self.events.append((content["name"], content["text"]))
            self.shown[content["name"]] = self.shown.get(content["name"], "") + content["text"]
        elif kind in ("display_data", "update_display_data"):
            self.displays.append(content["data"].get("text/plain", ""))
        elif kind == "clear_output":
            self.shown = {}
        elif kind == "error":
            self.error = content

    def prompts(self) -> list[str]:
        return [text for kind, text in self.events if kind == "prompt"]

    def summary(self) -> str:
        return self.error["evalue"] if self.error else ""


def text_of(cell, name: str | None = None) -> str:
    """All text a cell showed (streams, errors, text/plain), optionally one stream only."""
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream" and name in (None, out.name):
            parts.append(out.text)
        elif out.output_type == "error" and name in (None, "error"):
            parts.append("\n".join(out.traceback))
        elif out.output_type in ("display_data", "execute_result") and name is None:
            parts.append(out.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def message(cell) -> str:
    """A failed cell's own message, as one line: the error's summary (its first line), not
    the lines it is wrapped in for the notebook (core/errors.py, tested in test_plan)."""
    errors = [o for o in cell.outputs if o.output_type == "error"]
    return errors[-1].evalue.split("\n")[0] if errors else ""


@contextlib.contextmanager
def fresh_kernel(timeout: int = 180):
    """A new real IPython kernel with the extension loaded, shut down on exit."""
    nb = nbformat.v4.new_notebook()
    # its sockets in a folder of its own: no free-port race (run_notebooks.py)
    with run_notebooks.client_over_ipc(nb, timeout, NotebookClient) as client:
        with client.setup_kernel():
            cells = KernelCells(client)
            cells.run("%load_ext infini_notebook")
            yield cells


@pytest.fixture(scope="module")
def kernel():
    """A real kernel shared by one test module (starting kernels is slow on 2 cores)."""
    with fresh_kernel(timeout=120) as cells:
        yield cells
        cells.run("%dist_stop", allow_error=True)


# Marks a session started by use_session with the flags it was started with (an attribute of
# the session object, so a session a test starts by hand never passes for one of these).
_PROBE = """\
from infini_notebook import cluster as _c
_s = _c.current()
print(getattr(_s, 'test_flags', None) == {flags!r} and _s.engines.client.controller_running()
      and all(r.state in ("idle", "failed") for r in _s.status()) and _s.book.broken() is None)
del _c, _s"""


# Kernel code that waits until the spare engines the session forks once idle
# (engine_sets.Standby) have registered, and prints their pids (nothing without spares).
SPARES = """\
import time as _time
_spare = dist_session.engines.standby
_deadline = _time.monotonic() + 60
if _spare is not None:
    _set = dist_session.engines.client.cluster.engines[_spare.launch.result(60)]
    while len(dist_session.engines.client.ids() - _spare.known) < dist_session.world_size:
        assert _time.monotonic() < _deadline, "the spare engines did not register in 60 s"
        _time.sleep(0.05)
    print(sorted(_l.process.pid for _l in _set.launchers.values()))"""


def use_session(kernel: KernelCells, flags: str | None, timeout: int = 240) -> None:
    """Make ``kernel`` run a usable session started with ``%dist_start flags`` (None: no
    session), reusing the one a previous test left when it matches, so every test passes
    alone and in any order without paying for a start each time. A rank in state 'failed'
    (its last cell raised) is usable; a busy, stuck or dead one, groups that are not whole,
    or a dead controller (a test that failed after killing it) are not. Returns once the
    session's spare engines are there: forked while a test runs, they would change the
    processes it counts."""
    if flags is None or text_of(kernel.run(_PROBE.format(flags=flags))).strip() != "True":
        kernel.run("%dist_stop", allow_error=True)
        if flags is None:
            return
        kernel.run(f"%dist_start {flags}", timeout=timeout)
        kernel.run(f"dist_session.test_flags = {flags!r}")
    kernel.run(SPARES, timeout=90)


# Kernel code that SIGKILLs the session's controller and returns once it is dead: kill()
# returns when the signal is queued, and on a loaded machine the process can still be
# scheduled for a moment, answering requests (a cell sent then ran as if nothing happened).
KILL_CONTROLLER = """\
import psutil, time
from infini_notebook import cluster as _c
_p = psutil.Process(_c.current().engines.client.cluster.controller.process.pid)
_p.kill()
try:
    while _p.status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.005)
except psutil.NoSuchProcess:
    pass
del _p
"""


# Fault-injection timings (time to detect, time to recover), reported at the end of the run.
FAULT_TIMINGS: dict[str, float] = {}


# The suite runs on three workers (pytest-xdist, ``-n 3`` in pytest's addopts) on two cores:
# with two, about a third of the cores' time sat idle while ranks start, kernels restart and
# cells wait out injected sleeps and timeouts (843 s on two workers, 713 s on three, the same
# fresh clone, 2026-11-28). A module runs whole on one worker (its kernel and session are
# shared by its tests, as on one process), and the modules below share one worker and run in
# turn: each lists or ends *every* kept session of the user, which another module's would
# disturb.
ONE_WORKER = {
    "test_keep", "test_keep_life", "test_keep_output", "test_mcp", "test_private_place",
    "test_viz",
}  # fmt: skip
# The slowest first (from ``--durations``): the last unit to start sets the run's tail.
FIRST = [
    "kept", "test_notebooks", "test_faults", "test_multinode", "test_export", "test_browser",
    "test_store_attacks", "test_template", "test_runtime", "test_store_watch",
]  # fmt: skip


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its module, or "kept" (ONE_WORKER)."""
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
    return "kept" if module in ONE_WORKER else module


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with our units as scopes. (Its ``loadgroup`` marks a test's
    group by rewriting ``item._nodeid``, which pytest 9.2 no longer reads: the groups were
    silently ignored and modules' fixtures set up on both workers at once.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return ByUnit(config, log)


def pytest_collection_modifyitems(config, items):
    rank = {g: i for i, g in enumerate(FIRST)}
    items.sort(key=lambda it: rank.get(unit_of(it.nodeid), len(FIRST)))  # stable: order kept


def pytest_sessionfinish(session):
    """A worker's fault timings go to the controller (its terminal summary shows them)."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["fault_timings"] = dict(FAULT_TIMINGS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    FAULT_TIMINGS.update(getattr(node, "workeroutput", {}).get("fault_timings", {}))


def pytest_terminal_summary(terminalreporter):
    if not FAULT_TIMINGS:
        return
    import json

    terminalreporter.section("fault detection and recovery times (s)")
    for name, seconds in FAULT_TIMINGS.items():
        terminalreporter.write_line(f"{name:<45} {seconds:6.2f}")
    os.makedirs(os.path.join(REPO, "out"), exist_ok=True)
    with open(os.path.join(REPO, "out", "fault_timings.json"), "w") as f:
        json.dump(FAULT_TIMINGS, f, indent=1)


def session_processes(folder: str) -> list:
    """Every live process of the session in ``folder`` (the oracle of what a stop ended):
    the ones carrying its mark (launch/watchdog.py's MARK: engines, controller, template)
    and its watchdog (which names the folder's profile on its command line)."""
    import psutil

    from infini_notebook.launch.watchdog import MARK

    profile = os.path.join(folder, "profile")
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get(MARK) == profile or profile in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            pass
    return found
