"""JupyterLab's debugger on ranks (issue 52), driven through jupyter_client exactly as
JupyterLab drives it: ``debug_request`` messages on the control channel (initialize, attach,
debugInfo, dumpCell, setBreakpoints, configurationDone, then the cell's execute_request),
``debug_reply`` answers, ``debug_event`` messages on iopub. The request arguments are the
ones JupyterLab 4's debugger service sends (@jupyterlab/debugger, service.ts)."""

from __future__ import annotations

import os
import queue
import time

import pytest
from jupyter_client import BlockingKernelClient

from tests.conftest import REPO as REPO_ROOT
from tests.conftest import text_of, use_session

# x is the rank; y, z depend on it: what each rank's frame shows is checked against this
DIST_CELL = "%%dist\nx = rank\ny = x + 10\nz = y * 2\nprint('done', rank, z)\n"
# only rank 0 reaches line 5; rank 1 waits for it in all_reduce meanwhile
WAIT_CELL = """%%dist
t = torch.ones(1)
if rank == 0:
    t += 1
    t += 0
dist.all_reduce(t)
print('sum', t.item())
"""
# only rank 1 reaches line 4; rank 0 waits for it in the tp all_reduce, ranks 2 and 3 (the
# other tp group) finish meanwhile
TP_CELL = """%%dist
t = torch.ones(1) * (rank + 1)
if rank == 1:
    t += 0
dist.all_reduce(t, group=groups.tp)
print('tp sum', t.item())
"""
PLAIN_CELL = "a = 5\nb = a + 1\nc = b * 7\n"


class Lab:
    """JupyterLab's side of the debugger: requests on the control channel, events kept."""

    def __init__(self, connection_file: str):
        self.kc = BlockingKernelClient(connection_file=connection_file)
        self.kc.load_connection_file()
        self.kc.start_channels()
        self.seq = 0
        self.events: list[dict] = []
        self.streams: dict[str, str] = {}  # stdout text per request id
        self.displays: list[str] = []  # every text/plain shown (status lines updated too)
        self.idle: set[str] = set()  # requests whose idle status came (their output ended)

    def request(self, command: str, arguments: dict | None = None, timeout: float = 30):
        self.seq += 1
        content = {"type": "request", "seq": self.seq, "command": command}
        content["arguments"] = arguments or {}
        msg = self.kc.session.msg("debug_request", content)
        self.kc.control_channel.send(msg)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rep = self.kc.control_channel.get_msg(timeout=deadline - time.monotonic())
            if rep["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                assert rep["header"]["msg_type"] == "debug_reply"
                return rep["content"]
        raise TimeoutError(command)

    def event(self, name: str, timeout: float = 30, **body) -> dict:
        """The first debug_event ``name`` (whose body has ``body``'s items) not taken yet."""
        deadline = time.monotonic() + timeout
        while True:
            for e in self.events:
                if e["event"] == name and all(e["body"].get(k) == v for k, v in body.items()):
                    self.events.remove(e)
                    return e
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {name} event {body}; had {self.events}")
            self._read_iopub(0.2)

    def _read_iopub(self, timeout: float) -> None:
        try:
            msg = self.kc.iopub_channel.get_msg(timeout=timeout)
        except queue.Empty:
            return
        kind, parent = msg["header"]["msg_type"], msg["parent_header"].get("msg_id")
        if kind == "status" and msg["content"].get("execution_state") == "idle":
            self.idle.add(parent)
        if kind == "debug_event":
            self.events.append(msg["content"])
        elif kind == "stream":
            self.streams[parent] = self.streams.get(parent, "") + msg["content"]["text"]
        elif kind in ("display_data", "update_display_data"):
            self.displays.append(msg["content"]["data"].get("text/plain", ""))

    def reply(self, msg_id: str, timeout: float = 60) -> dict:
        """The execute_reply of ``msg_id``, reading iopub meanwhile (its output, events)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._read_iopub(0.05)
            try:
                rep = self.kc.shell_channel.get_msg(timeout=0.05)
            except queue.Empty:
                continue
            if rep["parent_header"].get("msg_id") == msg_id:
                # the output that trails the reply ends with the request's idle status
                while msg_id not in self.idle and time.monotonic() < deadline:
                    self._read_iopub(0.05)
                return rep["content"]
        raise TimeoutError("execute_reply")

    def start(self) -> None:
        """What JupyterLab sends when the debugger is switched on."""
        init = {"clientID": "jupyterlab", "clientName": "JupyterLab", "adapterID": "python"}
        init |= {"pathFormat": "path", "linesStartAt1": True, "columnsStartAt1": True}
        init |= {"supportsVariableType": True, "supportsVariablePaging": True}
        init = self.request("initialize", init)
        assert init["success"], f"the kernel could not start debugpy: {init}"
        assert self.request("attach")["success"]
        assert self.request("debugInfo")["body"]["isStarted"]

    def break_at(self, code: str, line: int) -> str:
        path = self.request("dumpCell", {"code": code})["body"]["sourcePath"]
        bp = {"breakpoints": [{"line": line}], "source": {"path": path}, "sourceModified": False}
        assert self.request("setBreakpoints", bp)["success"]
        assert self.request("configurationDone")["success"]
        return path

    def top(self, thread: int) -> dict:
        return self.request("stackTrace", {"threadId": thread})["body"]["stackFrames"][0]

    def locals(self, frame: int) -> dict[str, str]:
        scopes = self.request("scopes", {"frameId": frame})["body"]["scopes"]
        ref = scopes[0]["variablesReference"]
        variables = self.request("variables", {"variablesReference": ref})["body"]["variables"]
        return {v["name"]: v["value"] for v in variables}

    def stop(self) -> None:
        self.request("disconnect", {"restart": False, "terminateDebuggee": False})
        self.kc.stop_channels()


# Why ipykernel's debugger could not start (failed once on three workers, reason not kept):
# its start() runs debugpy.listen on a port it chose and freed, and keeps only "not ok".
RELISTEN = """\
import debugpy
_c = get_ipython().kernel.debugger.debugpy_client
try:
    debugpy.listen((_c.debugpy_host, int(_c.debugpy_port)))
    print('it listens now on', _c.debugpy_port)
except Exception as _e:
    print(repr(_e), 'on port', _c.debugpy_port)"""


@pytest.fixture(scope="module")
def lab(kernel):
    use_session(kernel, "--nprocs 2")
    lab = Lab(kernel.client.km.connection_file)
    try:
        lab.start()
    except AssertionError as e:  # ipykernel drops listen's error: ask again, to say why
        why = text_of(kernel.run(RELISTEN))
        raise AssertionError(f"{e}; debugpy.listen again: {why}") from None
    yield lab
    lab.stop()


def test_breakpoint_in_a_dist_cell_pauses_each_rank(lab):
    path = lab.break_at(DIST_CELL, 3)  # editor line 3: y = x + 10 (the %%dist line is 1)
    msg_id = lab.kc.execute(DIST_CELL)
    stops = {}
    for _ in range(2):
        e = lab.event("stopped", reason="breakpoint")
        stops[e["body"]["threadId"]] = e
    threads = {t["id"]: t["name"] for t in lab.request("threads")["body"]["threads"]}
    by_rank = {threads[tid]: tid for tid in stops}
    assert set(by_rank) == {"rank 0", "rank 1"}, threads

    for rank, tid in sorted(by_rank.items()):
        r = int(rank.split()[1])
        frame = lab.top(tid)
        assert frame["line"] == 3 and frame["source"]["path"] == path, frame
        assert frame["name"] == f"rank {r}: <module>"
        names = lab.locals(frame["id"])
        assert names["x"] == str(r) and "y" not in names  # line 3 not run yet
        got = lab.request(
            "evaluate", {"context": "repl", "expression": "x * 100"} | {"frameId": frame["id"]}
        )
        assert got["body"]["result"] == str(100 * r)

    # next moves rank 0 only: its frame is on line 4 with y set, rank 1 still on line 3
    assert lab.request("next", {"threadId": by_rank["rank 0"]})["success"]
    lab.event("stopped", reason="step", threadId=by_rank["rank 0"])
    frame0, frame1 = lab.top(by_rank["rank 0"]), lab.top(by_rank["rank 1"])
    assert (frame0["line"], frame1["line"]) == (4, 3)
    assert lab.locals(frame0["id"])["y"] == "10" and "y" not in lab.locals(frame1["id"])

    # JupyterLab's Continue: thread 1 once it dropped the paused one; every rank runs on
    assert lab.request("continue", {"threadId": 1})["body"]["allThreadsContinued"]
    assert lab.reply(msg_id)["status"] == "ok"
    out = lab.streams.get(msg_id, "")
    assert "[rank 0] done 0 20" in out and "[rank 1] done 1 22" in out, out
    assert lab.request("debugInfo")["body"]["stoppedThreads"] == []
    lab.request("setBreakpoints", {"breakpoints": [], "source": {"path": path}})


def test_a_plain_cell_still_pauses_the_kernel(lab):
    path = lab.break_at(PLAIN_CELL, 2)
    msg_id = lab.kc.execute(PLAIN_CELL)
    stop = lab.event("stopped", reason="breakpoint")
    tid = stop["body"]["threadId"]
    assert tid < 1_000_000_000  # the kernel's own thread, not a rank's
    frame = lab.top(tid)
    assert frame["line"] == 2 and frame["source"]["path"] == path
    assert frame["name"] == "<module>"
    assert lab.locals(frame["id"])["a"] == "5"
    lab.request("continue", {"threadId": tid})
    assert lab.reply(msg_id)["status"] == "ok"
    lab.request("setBreakpoints", {"breakpoints": [], "source": {"path": path}})


def test_a_paused_rank_is_said_paused_while_the_others_wait(lab):
    path = lab.break_at(WAIT_CELL, 5)
    msg_id = lab.kc.execute(WAIT_CELL)
    tid = lab.event("stopped", reason="breakpoint")["body"]["threadId"]
    assert lab.top(tid)["name"] == "rank 0: <module>"
    deadline = time.monotonic() + 15  # the cell's wait line comes after HANG_AFTER_S
    while not any("paused in the debugger" in d for d in lab.displays):
        assert time.monotonic() < deadline, lab.displays
        lab._read_iopub(0.2)
    line = next(d for d in lab.displays if "paused in the debugger" in d)
    assert "rank 0 paused in the debugger; rank 1 in the cell's 1st all_reduce" in line, line
    assert "not in it" not in line  # rank 0 is away on purpose: no mismatch to report
    lab.request("setBreakpoints", {"breakpoints": [], "source": {"path": path}})
    lab.request("continue", {"threadId": 1})
    assert lab.reply(msg_id)["status"] == "ok"  # not released, not failed: it only waited
    # the wait line, past: 'waiting 9 s' above the ranks' output read as still stuck
    assert lab.displays[-1].startswith("waited "), lab.displays[-1]
    assert "then every rank went on: rank 0 paused in the debugger" in lab.displays[-1]
    out = lab.streams.get(msg_id, "")
    assert "[rank 0] sum 3.0" in out and "[rank 1] sum 3.0" in out, out  # 2 + 1


# a module the ranks import: line 3 is ``b = a + 1``, reached in each rank's call
MODULE = "def scaled(rank):\n    a = rank * 3\n    b = a + 1\n    return b * 2\n"


def test_breakpoint_in_a_module_the_ranks_import(lab, tmp_path):
    folder = os.path.realpath(tmp_path)
    name = f"dbg_mod_{os.getpid()}"  # not imported before on any rank
    path = os.path.join(folder, f"{name}.py")
    with open(path, "w") as f:
        f.write(MODULE)
    bp = {"breakpoints": [{"line": 3}], "source": {"path": path}, "sourceModified": False}
    assert lab.request("setBreakpoints", bp)["success"]
    assert lab.request("configurationDone")["success"]
    cell = f"%%dist\nimport sys\nsys.path.insert(0, {folder!r})\nimport {name}\n"
    cell += f"print('got', rank, {name}.scaled(rank))\n"
    msg_id = lab.kc.execute(cell)
    stops = [lab.event("stopped", reason="breakpoint")["body"]["threadId"] for _ in range(2)]
    threads = {t["id"]: t["name"] for t in lab.request("threads")["body"]["threads"]}
    assert sorted(threads[t] for t in stops) == ["rank 0", "rank 1"], threads
    for tid in stops:
        r = int(threads[tid].split()[1])
        frame = lab.top(tid)
        assert frame["line"] == 3 and frame["source"]["path"] == path, frame
        assert frame["name"] == f"rank {r}: scaled"
        assert lab.locals(frame["id"]) == {"rank": str(r), "a": str(3 * r)}  # b not yet set
    # the editor JupyterLab opens on the frame (where breakpoints go on the module's path)
    assert lab.request("source", {"source": {"path": path}})["body"]["content"] == MODULE
    lab.request("setBreakpoints", {"breakpoints": [], "source": {"path": path}})
    assert lab.request("continue", {"threadId": 1})["body"]["allThreadsContinued"]
    assert lab.reply(msg_id)["status"] == "ok"
    out = lab.streams.get(msg_id, "")
    assert "[rank 0] got 0 2" in out and "[rank 1] got 1 8" in out, out  # (3r + 1) * 2


# a child Python says whether it runs under pydevd (debugpy's tracer)
CHILD = "import sys; print(any('pydevd' in m for m in sys.modules))"


def test_processes_a_rank_starts_run_undebugged(lab):
    """Under debugpy's default (subProcess) a child Python starts under pydevd and waits
    for a client JupyterLab never sends (a DataLoader's workers, a subprocess)."""
    cell = "%%dist\nimport subprocess, sys\n"
    cell += f"out = subprocess.run([sys.executable, '-c', {CHILD!r}], capture_output=True, "
    cell += "text=True, timeout=20)\nprint('child traced', out.stdout.strip())\n"
    msg_id = lab.kc.execute(cell)
    assert lab.reply(msg_id)["status"] == "ok"
    out = lab.streams.get(msg_id, "")
    assert "[rank 0] child traced False" in out and "[rank 1] child traced False" in out, out


def test_processes_the_kernel_starts_once_debugpy_listens_run_undebugged():
    """The debugger on before %load_ext (or on again after a kernel restart): ipykernel's
    debugpy.listen patched process creation already; installing the proxy undoes it, or
    %dist_start's controller and engines would start under pydevd."""
    import subprocess
    import sys

    script = f"""
import subprocess, sys
import debugpy
debugpy.listen(("127.0.0.1", 0))
print(subprocess.run([sys.executable, "-c", {CHILD!r}], capture_output=True,
                     text=True).stdout.strip())
from infini_notebook.kernel.debug_proxy import no_child_debugging
no_child_debugging(listening=True)
print(subprocess.run([sys.executable, "-c", {CHILD!r}], capture_output=True,
                     text=True).stdout.strip())
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT
    )
    assert out.stdout.split() == ["True", "False"], out  # traced before, not after


def test_ids_route_back_to_their_rank():
    from infini_notebook.core import dap_ids

    for rank, local in [(0, 1), (1, 7), (63, 999_999)]:
        shown = dap_ids.to_proxy(rank, local)
        assert shown >= dap_ids.STRIDE and dap_ids.split(shown) == (rank, local)
        assert dap_ids.route({"frameId": shown}) == rank
        assert dap_ids.to_rank({"frameId": shown, "x": 1}) == {"frameId": local, "x": 1}
    assert dap_ids.split(5) == (None, 5) and dap_ids.route({"threadId": 1}) is None
    assert dap_ids.to_proxy(3, 0) == 0  # "no children" stays so
    body = {"threadId": 2, "source": {"path": "/r.py"}, "variables": [{"variablesReference": 4}]}
    assert dap_ids.from_rank(1, body, {"/r.py": "/k.py"}) == {
        "threadId": 2_000_000_002,
        "source": {"path": "/k.py"},
        "variables": [{"variablesReference": 2_000_000_004}],
    }


def test_the_body_a_dist_cell_sends():
    from IPython.core.inputtransformer2 import TransformerManager

    from infini_notebook.core.dap_ids import dist_body

    cell = "%%dist --ranks 1\nx = 'a\\'b'\n\ny = 2\n"
    assert dist_body(TransformerManager().transform_cell(cell)) == "x = 'a\\'b'\n\ny = 2\n"
    assert dist_body(TransformerManager().transform_cell("%%time\nx = 1\n")) is None
    assert dist_body("x = 1") is None


def test_a_breakpoint_from_jupyterlabs_file_editor_pauses_the_ranks_in_that_module(lab, tmp_path):
    """JupyterLab's file editor sends a file's breakpoints as a cell's: dumpCell with the
    editor's text, then setBreakpoints on the path it got back. The ranks that imported the
    file stop there, and their frames name that path (the editor that set them)."""
    folder = os.path.realpath(tmp_path)
    name = f"dbg_file_{os.getpid()}"
    with open(os.path.join(folder, f"{name}.py"), "w") as f:
        f.write(MODULE)
    setup = f"%%dist\nimport sys\nsys.path.insert(0, {folder!r})\nimport {name}\n"
    assert lab.reply(lab.kc.execute(setup))["status"] == "ok"
    path = lab.break_at(MODULE, 3)  # the editor's text, dumped as a cell
    msg_id = lab.kc.execute(f"%%dist\nprint('got', rank, {name}.scaled(rank))\n")
    stops = [lab.event("stopped", reason="breakpoint")["body"]["threadId"] for _ in range(2)]
    for tid in stops:
        frame = lab.top(tid)
        assert frame["line"] == 3 and frame["source"]["path"] == path, frame
        assert frame["name"].endswith(": scaled")
    lab.request("setBreakpoints", {"breakpoints": [], "source": {"path": path}})
    assert lab.request("continue", {"threadId": 1})["body"]["allThreadsContinued"]
    assert lab.reply(msg_id)["status"] == "ok"
    out = lab.streams.get(msg_id, "")
    assert "[rank 0] got 0 2" in out and "[rank 1] got 1 8" in out, out


def _plain_dap(host: str, port: int) -> dict:
    """What a DAP client gets from ``host:port``: what it was told first, then what it got
    for an initialize (b"" once the other end closed)."""
    import socket

    with socket.create_connection((host, port), timeout=10) as conn:
        conn.settimeout(3)
        try:
            first = conn.recv(200)
        except TimeoutError:
            first = b""
        init = b'{"seq": 1, "type": "request", "command": "initialize"'
        init += b', "arguments": {"adapterID": "debugpy"}}'
        try:
            conn.sendall(b"Content-Length: %d\r\n\r\n" % len(init) + init)
            conn.settimeout(5)
            reply = conn.recv(1 << 16)
        except OSError as e:
            reply = repr(e).encode()
    return {"first": first.decode(errors="replace"), "reply": reply.decode(errors="replace")}


def test_dist_debugpy_bridges_an_editor_of_this_user_only(kernel, lab):
    """%dist_debugpy: a loopback port of the kernel's, bridged to the rank's relay. An
    editor of ours gets DAP answers; uid 65534, at that port or at the rank's relay (which
    every local user can find in /proc/net/tcp), gets nothing but a closed connection."""
    import json

    import psutil

    from tests.other_user import as_other

    shown = text_of(kernel.run("%dist_debugpy --rank 1"))
    config = json.loads(shown[: shown.rindex("}") + 1])
    assert "launch.json" in shown.splitlines()[-1]  # what to do with it
    assert config["request"] == "attach" and config["name"] == "rank 1"
    host, port = config["connect"]["host"], config["connect"]["port"]
    assert host == "127.0.0.1"
    listeners = {
        c.laddr.port: c.pid
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.pid
    }
    assert listeners[port] == kernel.kernel_pid  # the kernel's bridge, not a rank's port
    other = text_of(kernel.run("%dist_debugpy --rank 0"))
    other = json.loads(other[: other.rindex("}") + 1])
    assert other["connect"]["port"] != port
    assert config["pathMappings"][0]["remoteRoot"] == REPO_ROOT
    ours = _plain_dap(host, port)  # the editor: DAP answers come from rank 1's debugger
    assert '"command": "initialize"' in ours["reply"] and '"success": true' in ours["reply"]
    relay = text_of(
        kernel.run(
            "%%dist --ranks 1\nfrom infini_notebook.engine import rank_debug\n"
            "print(*rank_debug._state['relay'].endpoint)"
        )
    ).split()[-2:]
    if os.geteuid() != 0:  # no second user to attack as
        return
    for target in ((host, port), (relay[0], int(relay[1]))):
        got = as_other(_plain_dap, *target)
        assert got.get("reply") == "" or "Error" in got.get("reply", ""), (target, got)
        assert '"success"' not in json.dumps(got), (target, got)


def test_four_ranks_stop_and_step_apart(kernel, lab):
    """Last in the module: its session becomes 4 ranks (tp 2). The attached debugger
    follows the new session (the old ranks' debuggers went with their processes) at the
    next setBreakpoints; each rank stops, one steps alone, Continue runs all four on.
    Then tutorial 06's case: rank 1 paused, rank 0 waits for it in the tp all_reduce while
    the other tp group finishes; the wait line says so."""
    use_session(kernel, "--nprocs 4 --tp 2")
    path = lab.break_at(DIST_CELL, 3)
    msg_id = lab.kc.execute(DIST_CELL)
    stops = [lab.event("stopped", reason="breakpoint")["body"]["threadId"] for _ in range(4)]
    threads = {t["id"]: t["name"] for t in lab.request("threads")["body"]["threads"]}
    by_rank = {int(threads[t].split()[1]): t for t in stops}
    assert sorted(by_rank) == [0, 1, 2, 3], threads
    for r, tid in by_rank.items():
        frame = lab.top(tid)
        assert (frame["line"], frame["source"]["path"]) == (3, path), frame
        assert lab.locals(frame["id"])["x"] == str(r)
    assert lab.request("next", {"threadId": by_rank[2]})["success"]
    lab.event("stopped", reason="step", threadId=by_rank[2])
    assert [lab.top(by_rank[r])["line"] for r in range(4)] == [3, 3, 4, 3]
    lab.request("setBreakpoints", {"breakpoints": [], "source": {"path": path}})
    assert lab.request("continue", {"threadId": 1})["body"]["allThreadsContinued"]
    assert lab.reply(msg_id)["status"] == "ok"
    out = lab.streams.get(msg_id, "")
    for r in range(4):
        assert f"[rank {r}] done {r} {(r + 10) * 2}" in out, out

    path = lab.break_at(TP_CELL, 4)
    msg_id = lab.kc.execute(TP_CELL)
    tid = lab.event("stopped", reason="breakpoint")["body"]["threadId"]
    assert lab.top(tid)["name"] == "rank 1: <module>"
    deadline = time.monotonic() + 15  # the wait line comes after HANG_AFTER_S
    while not any("paused in the debugger" in d for d in lab.displays[-1:]):
        assert time.monotonic() < deadline, lab.displays
        lab._read_iopub(0.2)
    line = lab.displays[-1]
    assert "rank 0 in the cell's 1st all_reduce (#1 on the tp group)" in line, line
    assert "line 5; rank 1 paused in the debugger" in line and "rank 2" not in line, line
    out = lab.streams.get(msg_id, "")  # the other tp group did not wait for rank 1
    assert "[rank 2] tp sum 7.0" in out and "[rank 3] tp sum 7.0" in out, out
    assert "[rank 0]" not in out, out
    lab.request("setBreakpoints", {"breakpoints": [], "source": {"path": path}})
    lab.request("continue", {"threadId": 1})
    assert lab.reply(msg_id)["status"] == "ok"
    out = lab.streams.get(msg_id, "")
    assert "[rank 0] tp sum 3.0" in out and "[rank 1] tp sum 3.0" in out, out  # 1 + 2
