"""The MCP server (issue 53), driven as an agent's client drives it: the official SDK's own
client over stdio against ``python -m infini_notebook.mcp``. One server process and one
2-rank session serve most tests; a notebook kernel's kept session is attached at the end,
and the HTTP transport is checked for its token."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import pytest
from conftest import REPO, fresh_kernel, session_processes, text_of

mcp = pytest.importorskip("mcp", reason="the MCP SDK is not installed (pip install 'mcp>=2')")
from anyio.from_thread import start_blocking_portal  # noqa: E402
from mcp.client.session import ClientSession  # noqa: E402
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402

pytestmark = pytest.mark.timeout(240)

TOOLS = {
    "sessions", "start", "attach", "stop", "run", "wait", "interrupt", "status", "stacks",
    "restart", "diff", "profile", "pull", "export",
}  # fmt: skip


class Client:
    """The SDK's ClientSession on its own event loop thread (anyio's blocking portal), called
    synchronously. Every message the server wrote to stdout must parse as the protocol's:
    anything else reaches ``message_handler`` as an exception, kept in ``bad``."""

    def __init__(self, *args: str):
        self.bad: list[BaseException] = []
        self.errlog = tempfile.TemporaryFile("w+")
        self._stack = contextlib.ExitStack()
        self.portal = self._stack.enter_context(start_blocking_portal())
        params = StdioServerParameters(
            command=sys.executable, args=["-m", "infini_notebook.mcp", *args],
            env=dict(os.environ), cwd=REPO,
        )  # fmt: skip
        before = {p.pid for p in psutil.Process().children()}
        read, write = self._enter(stdio_client(params, errlog=self.errlog))
        self.session = self._enter(ClientSession(read, write, message_handler=self._message))
        self.portal.call(self.session.initialize)
        new = [p for p in psutil.Process().children() if p.pid not in before]
        self.server = next(p for p in new if "infini_notebook.mcp" in " ".join(p.cmdline()))

    def _enter(self, cm):
        return self._stack.enter_context(self.portal.wrap_async_context_manager(cm))

    async def _message(self, message) -> None:
        if isinstance(message, BaseException):
            self.bad.append(message)

    def call(self, tool: str, /, progress: list | None = None, **arguments):
        """The tool's result: (structured content, or None for a tool error; its text)."""

        async def note(done, total, message):
            progress.append((done, total, message))

        call = functools.partial(
            self.session.call_tool,
            tool,
            arguments,
            progress_callback=note if progress is not None else None,
        )
        result = self.portal.call(call)
        text = "".join(getattr(c, "text", "") for c in result.content)
        return (None if result.is_error else result.structured_content), text

    def ok(self, tool: str, /, **arguments) -> dict:
        got, text = self.call(tool, **arguments)
        assert got is not None, f"{tool} failed: {text}\n{self.stderr()[-3000:]}"
        return got

    def stderr(self) -> str:
        self.errlog.seek(0)
        return self.errlog.read()

    def close(self) -> None:
        self._stack.close()
        self.errlog.close()


def gone(pids: list[int], folder: str, timeout: float = 10.0) -> list:
    """What is left of a session after ``timeout`` s: its rank pids alive, its processes."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if psutil.pid_exists(p) and not _zombie(p)]
        left = alive + [p.pid for p in session_processes(folder)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


@pytest.fixture(scope="module")
def client():
    c = Client()
    yield c
    with contextlib.suppress(Exception):
        c.call("stop")
    c.close()
    assert not c.bad, c.bad  # nothing but the protocol on the server's stdout
    with contextlib.suppress(psutil.NoSuchProcess):  # reaped already: gone
        c.server.wait(10)  # psutil.TimeoutExpired: the server outlived its stdin


@pytest.fixture(scope="module")
def started(client):
    """The module's session, started through the tool (2 CPU ranks), and its progress."""
    progress: list = []
    got, text = client.call("start", progress=progress, nprocs=2, timeout=30)
    assert got is not None, text + client.stderr()[-3000:]
    return got, progress


def test_the_tools_are_listed_with_their_schemas(client):
    tools = {t.name: t for t in client.portal.call(client.session.list_tools).tools}
    assert set(tools) == TOOLS
    run = tools["run"]
    assert run.input_schema["required"] == ["code"]
    assert set(run.input_schema["properties"]) == {"code", "ranks", "where", "timeout"}
    assert {"outputs", "root_cause", "handle", "state"} <= set(run.output_schema["properties"])
    # start takes %dist_start's options, each described by its flag's help
    start = tools["start"].input_schema["properties"]
    assert {"nprocs", "gpus", "tp", "dp", "timeout", "name", "keep"} <= set(start)
    assert "CPU ranks" in start["nprocs"]["description"]
    assert "ctx" not in start


def test_start_gives_two_ranks_and_reports_progress(started):
    got, progress = started
    assert got["world_size"] == 2 and got["backend"] == "gloo"
    assert got["message"].startswith("2 ranks ready (dp 2; gloo;"), got["message"]
    assert [r["rank"] for r in got["ranks"]] == [0, 1]
    assert all(psutil.pid_exists(r["pid"]) for r in got["ranks"])
    assert progress, "no progress notification while the ranks started"


def test_run_returns_each_ranks_output_and_value(client, started):
    got = client.ok("run", code="print('hello from', rank)\nrank * 10 + world_size")
    assert got["state"] == "ok" and got["root_cause"] is None
    for r, out in enumerate(got["outputs"]):
        assert out["rank"] == r and out["stdout"] == f"hello from {r}\n"
        assert out["result"] == str(r * 10 + 2) and out["error"] is None
    one = client.ok("run", code="print(rank)", ranks="1")
    assert [o["rank"] for o in one["outputs"]] == [1] and one["outputs"][0]["stdout"] == "1\n"


def test_a_failing_cell_names_its_root_cause(client, started):
    got = client.ok("run", code="print('before', rank)\nif rank == 1:\n    1 / 0\nrank")
    assert got["state"] == "failed"
    assert got["root_cause"] == "rank 1: ZeroDivisionError: division by zero (rank 0 finished)"
    zero, one = got["outputs"]
    assert zero["stdout"] == "before 0\n" and zero["error"] is None and zero["result"] == "0"
    assert one["stdout"] == "before 1\n" and one["error"].startswith("ZeroDivisionError")
    assert "1 / 0" in got["tracebacks"] and "[rank 1]" in got["tracebacks"]
    # usage errors are tool errors of one line
    got, text = client.call("run", code="1", ranks="5")
    assert got is None and "\n" not in text.strip() and "5" in text, text
    # so are bad arguments: a wrong type, and a misspelt name (not run on every rank)
    for bad in ({"code": 5}, {"code": "rank", "rank": "1"}):
        got, text = client.call("run", **bad)
        assert got is None and "\n" not in text.strip(), text
    assert "no argument rank (it takes: code, ranks, timeout, where)" in text, text
    # a huge value or error message is cut: the result stays small
    got = client.ok("run", code="if rank == 1:\n    raise ValueError('z' * 10**6)\n'y' * 10**6")
    zero, one = got["outputs"]
    cut = f"... [{10**6 + 2 - 20_000} characters cut]"  # the repr: 10**6 + 2 characters
    assert zero["result"].endswith(cut), zero["result"][-80:]
    assert len(one["error"]) < 2100 and len(got["root_cause"]) < 2100, len(one["error"])


def test_a_hung_collective_is_seen_in_stacks_and_interrupted(client, started):
    code = "import time\nif rank == 1:\n    time.sleep(60)\ndist.all_reduce(torch.ones(1))"
    got = client.ok("run", code=code, timeout=1.5)
    assert got["state"] == "running" and got["handle"], got
    handle = got["handle"]
    deadline = time.monotonic() + 15
    while True:  # until rank 0 is inside all_reduce (it may take a moment on a busy host)
        stacks = client.ok("stacks")
        if stacks["waiting"] == [0] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert stacks["waiting"] == [0], stacks
    zero, one = stacks["ranks"]
    assert zero["busy"] and "all_reduce" in zero["waiting_in"], zero
    assert one["busy"] and one["waiting_in"] is None and "line 3" in one["stack"], one
    assert "rank 0 in" in stacks["verdict"] and "rank 1 computing" in stacks["verdict"]
    # a second cell is refused while this one runs, naming its handle
    _, text = client.call("run", code="1")
    assert handle in text and "interrupt" in text, text

    t0 = time.monotonic()
    got = client.ok("interrupt", handle=handle, timeout=30)
    assert sorted(got["signalled"]) == [0, 1]
    cell = got["cell"]
    assert cell["state"] == "failed" and "KeyboardInterrupt" in cell["root_cause"], cell
    assert time.monotonic() - t0 < 20
    # the groups were rebuilt: the next collective works on both ranks
    got = client.ok("run", code="t = torch.ones(1)\ndist.all_reduce(t)\nt.item()")
    assert [o["result"] for o in got["outputs"]] == ["2.0", "2.0"], got


def test_a_cell_past_its_timeout_gives_a_handle_to_wait_on(client, started, tmp_path):
    gate = tmp_path / "gate"  # the cell runs until the test removes it (2 s into the wait)
    gate.touch()
    code = f"import os, time\nwhile os.path.exists({str(gate)!r}):\n    time.sleep(0.05)\n"
    got = client.ok("run", code=code + "print('done', rank)", timeout=0.3)
    returned = time.monotonic()
    assert got["state"] == "running"
    status = client.ok("status")
    assert status["running"] == got["handle"]
    assert [r["state"] for r in status["ranks"]] == ["busy", "busy"]
    progress: list = []
    opened: list[float] = []
    threading.Timer(2.0, lambda: (opened.append(time.monotonic()), gate.unlink())).start()
    done, _ = client.call("wait", progress=progress, handle=got["handle"], timeout=30)
    assert done["state"] == "ok" and done["handle"] == got["handle"]
    assert [o["stdout"] for o in done["outputs"]] == ["done 0\n", "done 1\n"]
    assert done["elapsed_s"] >= opened[0] - returned  # it ran until the gate opened
    assert progress and all(b >= a for (a, _, _), (b, _, _) in zip(progress, progress[1:]))
    assert client.ok("status")["running"] is None
    _, text = client.call("wait", handle="c999")
    assert "No cell has handle 'c999'" in text


def test_pull_diff_and_export(client, started, tmp_path):
    client.ok("run", code="w = torch.full((3, 2), float(rank))\nsame = torch.arange(4)")
    import torch

    pulled = client.ok("pull", name="w")["values"]
    for r, v in enumerate(pulled):
        assert v["shape"] == [3, 2] and v["dtype"] == "torch.float32"
        assert v["nbytes"] == 3 * 2 * 4 and v["type"] == "torch.Tensor"
        assert v["repr"] == repr(torch.full((3, 2), float(r))) and not v["truncated"]
    cut = client.ok("pull", name="list(range(1000))", ranks="0", max_chars=50)["values"]
    assert cut[0]["truncated"] and cut[0]["repr"].startswith("[0, 1, 2, 3, 4, 5, ...")
    # a value far over the cap is described at the cap's cost, not its size's
    huge = client.ok("pull", name="list(range(10**7))", ranks="0", max_chars=80)["values"]
    assert huge[0]["truncated"] and len(huge[0]["repr"]) <= 80, huge
    _, text = client.call("pull", name="nothing_here")
    assert "nothing_here" in text and "not defined" in text
    differs = client.ok("diff", name="w", group="world")
    assert differs["rows"] and differs["rows"][0]["max_abs_diff"] == 1.0, differs
    assert client.ok("diff", name="same", group="world")["rows"] == []
    # a soft restart rebuilds the groups and keeps the variables
    said = client.ok("restart")["message"]
    assert said.startswith("Restarted (process groups rebuilt, variables kept)"), said
    after = client.ok("run", code="dist.all_reduce(w)\nw.sum().item()")
    assert [o["result"] for o in after["outputs"]] == [str(6 * (0.0 + 1.0))] * 2
    # the script holds the cells that ran, the failed one as comments only
    path = tmp_path / "train.py"
    got = client.ok("export", path=str(path))
    script = path.read_text()
    assert "\nw = torch.full((3, 2), float(rank))\n" in script and got["world_size"] == 2
    failed = [line for line in script.splitlines() if "1 / 0" in line]
    assert failed and all(line.startswith("#") for line in failed), failed
    assert any("failed" in why for why in got["skipped"]), got["skipped"]
    assert "Run it with: torchrun --nproc_per_node 2" in got["summary"]
    _, text = client.call("export", path=str(path))
    assert "exists" in text and "force" in text


def test_profile_names_the_rank_that_arrived_last(client, started, tmp_path):
    # rank 1 reaches the all_reduce 0.4 s after rank 0: rank 0 waits about that long
    code = "import time\nif rank == 1:\n    time.sleep(0.4)\ndist.all_reduce(torch.ones(1))"
    got = client.ok("profile", code=code, out=str(tmp_path / "prof"))
    assert got["state"] == "ok" and got["verdict"].startswith("rank 1 arrived last"), got
    zero, one = got["ranks"]
    assert 0.8 * 400 <= zero["wait_ms"] <= zero["wall_ms"] and one["wait_ms"] < 50, got["ranks"]
    assert got["collectives"][0]["last_rank"] == 1
    with open(got["trace"]) as f:
        events = json.load(f)["traceEvents"]
    assert {e.get("pid") for e in events if e.get("ph") == "X"} >= {0, 1}


def test_stop_leaves_no_process(client, started):
    status = client.ok("status")
    pids, folder = [r["pid"] for r in status["ranks"]], status["folder"]
    assert session_processes(folder)  # the oracle sees the session before the stop
    got = client.ok("stop")
    assert sorted(got["pids"]) == sorted(pids)
    assert gone(pids, folder) == []
    assert not os.path.exists(folder)
    _, text = client.call("status")
    assert "No session is running" in text and "start" in text


def test_attach_a_kept_session_a_notebook_started(client, started):
    name = f"mcp-{secrets.token_hex(3)}"
    client.call("stop")  # one session per server: the module's is ended (if still running)
    with fresh_kernel() as cells, _ended_by_name(client, name):
        cells.run(f"%dist_start --nprocs 2 --name {name} --keep 2m", timeout=180)
        cells.run("%%dist\nsecret = 40 + rank")
        folder = text_of(cells.run("print(dist_session.folder.path)")).strip()
        kernel = cells.kernel_pid
        listed = {s["name"]: s for s in client.ok("sessions")["sessions"]}
        assert listed[name]["driver"] == f"kernel pid {kernel}" and listed[name]["ranks"] == 2
        _, refused = client.call("attach", name=name)
        assert f"kernel pid {kernel}" in refused and "force" in refused, refused
        got = client.ok("attach", name=name, force=True)
        assert got["name"] == name and f"taken over from kernel pid {kernel}" in got["message"]
        ran = client.ok("run", code="secret")
        assert [o["result"] for o in ran["outputs"]] == ["40", "41"]
        # the notebook is told, and its next cell does not run
        lost = text_of(cells.run("%%dist\nprint(secret)", allow_error=True))
        assert "no longer drives" in lost, lost
        pids = [r["pid"] for r in got["ranks"]]
        assert client.ok("stop")["pids"] == pids
        assert gone(pids, folder) == []
        assert name not in {s["name"] for s in client.ok("sessions")["sessions"]}


def test_a_session_ends_with_the_server_that_started_it():
    """The client goes without a stop (an agent closed): the server's session ends with it,
    as a notebook's ends with its kernel."""
    other = Client()
    try:
        got = other.ok("start", nprocs=1)
        pids, folder = [r["pid"] for r in got["ranks"]], got["folder"]
        assert session_processes(folder)
    finally:
        other.close()
    assert not other.server.is_running() or other.server.status() == psutil.STATUS_ZOMBIE
    assert gone(pids, folder) == []


def test_the_server_exits_when_its_client_goes_during_a_call(tmp_path):
    """stdin closes while run waits on a cell that never ends: the server exits now and
    ends its session, not when the call's timeout (600 s) runs out. Raw JSON-RPC: the SDK's
    client would SIGKILL a server that lingers, hiding the wait (and skipping its stop)."""

    def send(message: dict) -> None:
        proc.stdin.write(json.dumps({"jsonrpc": "2.0", **message}).encode() + b"\n")
        proc.stdin.flush()

    proc = subprocess.Popen(
        [sys.executable, "-m", "infini_notebook.mcp"], cwd=REPO,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        info = {"name": "raw", "version": "0"}
        send({"id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": info}})  # fmt: skip
        send({"method": "notifications/initialized"})
        send({"id": 2, "method": "tools/call", "params": {"name": "start",
                                                          "arguments": {"nprocs": 1}}})  # fmt: skip
        while (reply := json.loads(proc.stdout.readline())).get("id") != 2:
            pass
        started = reply["result"]["structuredContent"]
        pids, folder = [r["pid"] for r in started["ranks"]], started["folder"]
        there = str(tmp_path / "there")
        code = f"open({there!r}, 'w').close()\nwhile True:\n    pass"
        endless = {"code": code, "timeout": 600}
        send({"id": 3, "method": "tools/call", "params": {"name": "run", "arguments": endless}})
        deadline = time.monotonic() + 60
        while not os.path.exists(there):  # the call waits on a running cell
            assert time.monotonic() < deadline, "the endless cell did not start"
            time.sleep(0.02)
        proc.stdin.close()
        assert proc.wait(20) == 0  # subprocess.TimeoutExpired: it waits out the 600 s
        assert gone(pids, folder) == []
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def _ended_by_name(client, name: str):
    """A kept session a failed test left is ended now, not at the end of its keep time."""
    try:
        yield
    finally:
        if name in {s["name"] for s in (client.call("sessions")[0] or {}).get("sessions", [])}:
            client.call("stop", name=name)


def has_ipv6_loopback() -> bool:
    import errno
    import socket

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError as e:  # every port taken by someone is no missing address
        return e.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)


def test_http_listens_on_loopback_only_and_holds_the_port_on_both_addresses():
    from infini_notebook.mcp import http

    for host in ("0.0.0.0", "192.0.2.1", "localhost.example"):
        with pytest.raises(SystemExit, match="loopback only"):
            http.loopback_sockets(host, 0)
    socks = http.loopback_sockets("127.0.0.1", 0)
    port = socks[0].getsockname()[1]
    where = [sock.getsockname()[:2] for sock in socks]
    # a client told "localhost" may try ::1 first: the port there is ours too
    assert where == [("127.0.0.1", port)] + ([("::1", port)] if has_ipv6_loopback() else [])
    with pytest.raises(SystemExit, match="cannot listen on 127.0.0.1 port .*leave --port out"):
        http.loopback_sockets("127.0.0.1", port)  # taken (by another user, say)
    for sock in socks:
        sock.close()


# Takes ::1 at a port it first found free on 127.0.0.1: a port of ::1 alone could be held on
# 127.0.0.1 by another test's process, and the server's refusal would name that cause.
SQUATTER = (
    "import socket, sys\n"
    "v4 = socket.socket(); v4.bind(('127.0.0.1', 0)); port = v4.getsockname()[1]\n"
    "s = socket.socket(socket.AF_INET6); s.bind(('::1', port)); s.listen(8); v4.close()\n"
    "print(port, flush=True); sys.stdin.read()\n"
)


def test_another_user_listening_on_ipv6_loopback_gets_no_token(monkeypatch):
    """Another local user listens on ::1 at a port free on 127.0.0.1: a server there would
    send "localhost" clients (and their token) to it. A given port is refused; a free one
    is chosen away from it."""
    from other_user import popen_as_other

    from infini_notebook.mcp import http

    if not has_ipv6_loopback():
        pytest.skip("no IPv6 loopback here: nothing to squat")
    squatter = subprocess.Popen(
        [sys.executable, "-c", SQUATTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, **popen_as_other(),
    )  # fmt: skip
    try:
        taken = int(squatter.stdout.readline())
        with pytest.raises(SystemExit, match=f"port {taken} is free on 127.0.0.1 but ::1 refused"):
            http.loopback_sockets("127.0.0.1", taken)
        listen, tries = http._listen, []

        def first_at_the_squatters_port(host, port):  # as if the kernel chose it for us
            tries.append(port)
            return listen(host, taken if len(tries) == 1 else port)

        monkeypatch.setattr(http, "_listen", first_at_the_squatters_port)
        socks = http.loopback_sockets("127.0.0.1", 0)
        got = {sock.getsockname()[1] for sock in socks}
        assert len(got) == 1 and taken not in got and len(socks) == 2, (got, tries)
        for sock in socks:
            sock.close()
    finally:
        squatter.stdin.close()
        squatter.wait(10)


def test_a_flood_of_another_users_ipv6_sockets_does_not_pass_for_no_ipv6(monkeypatch):
    """uid 65534 listening on ::1 at every port made the probe for IPv6 fail, and the
    server then served on 127.0.0.1 alone, its ::1 twin left to the attacker. Only an
    address the machine lacks leaves the twin out."""
    import errno

    from infini_notebook.mcp import http

    bind_listen = http._bind_listen

    def v6_fails_with(code):
        def bind(host, port):
            if ":" in host:
                raise OSError(code, os.strerror(code))
            return bind_listen(host, port)

        return bind

    monkeypatch.setattr(http, "_bind_listen", v6_fails_with(errno.EADDRINUSE))
    with pytest.raises(SystemExit, match="no port free on both 127.0.0.1 and ::1"):
        http.loopback_sockets("127.0.0.1", 0)
    monkeypatch.setattr(http, "_bind_listen", v6_fails_with(errno.EADDRNOTAVAIL))
    socks = http.loopback_sockets("127.0.0.1", 0)  # no IPv6 here: 127.0.0.1 alone
    assert [s.getsockname()[0] for s in socks] == ["127.0.0.1"]
    socks[0].close()


def test_the_server_says_why_it_cannot_start():
    for args, said in (
        (["--host", "0.0.0.0"], "is not a loopback address"),
        (["--host", "::ffff:127.0.0.1"], "is not a loopback address"),
        (["--host", "::1%lo"], "give 127.0.0.1 or ::1 itself"),
        (["--port", "70000"], "70000 is no port"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "infini_notebook.mcp", "--http", *args],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode != 0 and said in proc.stderr, (args, proc.returncode, proc.stderr)


async def _tools_over_http(url: str, token: str) -> set[str]:
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    async with httpx2.AsyncClient(headers={"authorization": f"Bearer {token}"}) as http:
        async with streamable_http_client(url, http_client=http) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                return {t.name for t in (await session.list_tools()).tools}


def test_http_transport_refuses_requests_without_the_token():
    import anyio
    import httpx2

    proc = subprocess.Popen(
        [sys.executable, "-m", "infini_notebook.mcp", "--http"],
        cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        line = proc.stderr.readline()
        found = re.search(
            r"(http://127\.0\.0\.1:\d+/mcp) \(header 'Authorization: Bearer (\S+)'\)", line
        )
        assert found, line
        url, token = found.groups()
        init = {
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                       "clientInfo": {"name": "test", "version": "0"}},
        }  # fmt: skip
        headers = {"accept": "application/json, text/event-stream"}
        for bad in (
            {}, {"authorization": "Bearer nope"}, {"authorization": token},
            {"authorization": f"Bearer{token}"}, {"authorization": f"Basic {token}"},
        ):  # fmt: skip
            refused = httpx2.post(url, json=init, headers={**headers, **bad}, timeout=10)
            assert refused.status_code == 401, refused.text
            assert "token" in refused.json()["error"]
        assert anyio.run(_tools_over_http, url, token) == TOOLS  # the SDK's client, with it
        # the scheme in any case, as RFC 9110 has it (some clients send "bearer")
        lower = httpx2.post(url, json=init, headers={**headers, "authorization": f"bearer {token}"},
                            timeout=10)  # fmt: skip
        assert lower.status_code == 200, lower.text
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_sessions_messages_name_tool_calls_not_magics():
    from infini_notebook.mcp.server import agent_words

    said = agent_words(
        "rank 2 died. %dist_restart --ranks 2 starts a new rank 2 (%dist_restart --hard "
        "restarts all); driven by kernel pid 7: take it over with %dist_attach x --force. "
        "See %dist_sessions; %dist_interrupt stops it."
    )
    assert said == (
        'rank 2 died. restart(ranks="2") starts a new rank 2 (restart(hard=true) restarts '
        'all); driven by kernel pid 7: take it over with attach(name="x", force=true). '
        "See sessions; interrupt stops it."
    )


def test_a_running_cells_output_says_what_was_cut_and_starts_at_a_line():
    from infini_notebook.mcp.driver import Collector

    kept = Collector(cap=30)
    for line in ("[rank 0] line one\n", "[rank 0] line two is long\n", "[rank 1] three\n"):
        kept.out(line)
    assert kept.text() == (
        "[44 characters cut: every line is in the session's output/rankN files]\n[rank 1] three\n"
    )  # 62 written, 30 kept, 14 of them the cut line's end
