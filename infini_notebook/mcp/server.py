"""The MCP server: one tool per session operation, on the official ``mcp`` SDK's MCPServer,
which makes each tool's JSON schema from its signature and its structured result's schema
from the return annotation (results.py). Each tool runs its ``Driver`` method on a worker
thread (the session API blocks); long ones report progress as MCP notifications, and every
failure is a tool error of one line."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import re
import time
import typing
from typing import Annotated

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field, ValidationError

from ..core.errors import DistCellError, DistUsageError
from ..core.options import StartOptions
from ..core.output import one_line
from . import results as R
from .driver import LINE_CHARS, Driver

log = logging.getLogger("infini_notebook")

INSTRUCTIONS = """\
Drives an infini_notebook session: torch.distributed ranks (one process each) that run the same
code at once. First call `sessions`: a kept session a notebook started can be taken over with
`attach` (name; force takes it from a live notebook, which is then told). Otherwise `start`
(nprocs=2 gives CPU ranks on gloo; gpus=N one rank per GPU). Then `run` code on every rank
(`rank`, `world_size`, `dist`, `torch`, `device`, `groups`, `mesh` are defined): each rank's
output, result and error come back, with a one-line root cause when a rank fails. A cell still
running at its timeout keeps running: `wait` or `interrupt` it by its handle; `stacks` shows
where each rank is and which ranks wait in a collective. `stop` ends the session."""

PROGRESS_EVERY_S = 0.25

Ranks = Annotated[
    str | None, Field(description="ranks: '0', '0,2', '1-3' or 'all' (default: every rank)")
]
Where = Annotated[
    str | None, Field(description="instead of ranks, layout coordinates: 'pp=0,tp=1'")
]


def build(driver: Driver | None = None) -> MCPServer:
    """The server with every tool bound to ``driver``."""
    driver = driver or Driver()
    server = _Server("infini-notebook", instructions=INSTRUCTIONS, log_level="WARNING")

    @server.tool()
    async def sessions(ctx: Context) -> R.SessionsResult:
        """This user's kept sessions on this machine (started with name and keep): name,
        ranks, backend, when started, the kernel that drives it or how long it waits
        detached, memory. Call this first: attach one, or start a new session."""
        return await call(ctx, driver.sessions)

    server.add_tool(_start_tool(driver), name="start", structured_output=True)

    @server.tool()
    async def attach(
        ctx: Context,
        name: Annotated[str, Field(description="the kept session's name (see sessions)")],
        force: Annotated[
            bool, Field(description="take it from the live kernel that drives it")
        ] = False,
    ) -> R.SessionInfo:
        """Take over a kept session: every rank's variables, groups and mesh stay. One
        driver at a time: refused while a live kernel drives it, unless force (that
        notebook is told at its next command)."""
        return await call(ctx, driver.attach, name, force)

    @server.tool()
    async def stop(
        ctx: Context,
        name: Annotated[
            str | None, Field(description="a kept session to end without attaching it")
        ] = None,
    ) -> R.StopResult:
        """End the session: every rank's process, the controller and the store."""
        return await call(ctx, driver.stop, name)

    @server.tool()
    async def run(
        ctx: Context,
        code: Annotated[str, Field(description="Python run on each rank, as a %%dist cell")],
        ranks: Ranks = None,
        where: Where = None,
        timeout: Annotated[
            float, Field(description="seconds to wait before returning a handle", ge=0)
        ] = 30.0,
    ) -> R.RunResult:
        """Run code on the ranks at once. Returns each rank's stdout, stderr, the repr of
        its last expression and its error; a failed cell has state 'failed' and a one-line
        root_cause (which rank raised what, ranks released from waits on it). A cell still
        running at the timeout has state 'running' and keeps running: pass its handle to
        wait or interrupt. Example: code="x = torch.ones(2) * rank; dist.all_reduce(x); x"."""
        return await call(ctx, driver.run, code, ranks, where, timeout)

    @server.tool()
    async def wait(
        ctx: Context,
        handle: Annotated[str, Field(description="the handle run returned, like 'c3'")],
        timeout: Annotated[float, Field(description="seconds to wait", ge=0)] = 30.0,
    ) -> R.RunResult:
        """Wait for a cell that was still running (run's handle); the same result as run."""
        return await call(ctx, driver.wait, handle, timeout)

    @server.tool()
    async def interrupt(
        ctx: Context,
        handle: Annotated[str | None, Field(description="the running cell's handle")] = None,
        ranks: Ranks = None,
        timeout: Annotated[
            float, Field(description="seconds to wait for the cell to end", ge=0)
        ] = 15.0,
    ) -> R.InterruptResult:
        """Send SIGINT to the ranks still running the cell (all its ranks, or these), and
        wait for it to end: ranks blocked in a collective on a peer that left are released.
        Also stops a cell an earlier notebook left running in an attached session."""
        return await call(ctx, driver.interrupt, handle, ranks, timeout)

    @server.tool()
    async def status(ctx: Context) -> R.StatusResult:
        """The session's line (ready, or what it needs) and each rank's row: pid, host,
        device, state (idle, busy, failed, released, died, stuck), note, memory, CPU."""
        return await call(ctx, driver.status)

    @server.tool()
    async def stacks(
        ctx: Context,
        ranks: Ranks = None,
        all_threads: Annotated[
            bool, Field(description="every thread, not only the cell's")
        ] = False,
    ) -> R.StacksResult:
        """Where each rank is now: its Python stack (answered while a rank is busy or stuck
        in a collective), the torch.distributed call a busy rank waits in, and which ranks
        wait (verdict: where each busy rank waits, mismatches within a group)."""
        return await call(ctx, driver.stacks, ranks, all_threads)

    @server.tool()
    async def restart(
        ctx: Context,
        hard: Annotated[bool, Field(description="new processes for every rank")] = False,
        ranks: Annotated[
            str | None, Field(description="new processes for these ranks only (dead, stuck)")
        ] = None,
    ) -> R.Message:
        """Soft (default): rebuild the process groups, every variable kept; after a failed
        or timed-out collective. ranks: replace those ranks' processes, the others keep
        theirs. hard: every rank restarts (variables are lost)."""
        return await call(ctx, driver.restart, hard, ranks)

    @server.tool()
    async def diff(
        ctx: Context,
        name: Annotated[str, Field(description="a tensor, module, optimizer or container")],
        group: Annotated[
            str | None, Field(description="compare within each group of: dp (default), tp, world")
        ] = None,
        atol: Annotated[float, Field(description="differences up to this are equal", ge=0)] = 0.0,
    ) -> R.DiffResult:
        """Are the replicas still the same? Compares name within every group: one summary
        line and a row per leaf that differs (ranks, reference rank, largest difference)."""
        return await call(ctx, driver.diff, name, group, atol)

    @server.tool()
    async def profile(
        ctx: Context,
        code: Annotated[str, Field(description="the code to run under torch.profiler")],
        ranks: Ranks = None,
        where: Where = None,
        out: Annotated[str | None, Field(description="folder for the traces")] = None,
        max_mb: Annotated[float | None, Field(description="cap on each rank's trace")] = None,
    ) -> R.ProfileResult:
        """Run code as run does, under torch.profiler on each rank; one merged timeline.
        Returns the verdict (who made the others wait, how long), a row per rank (wall,
        compute, wait, communication, idle ms, top ops), per-collective rows, the trace."""
        return await call(ctx, driver.profile, code, ranks, where, out, max_mb)

    @server.tool()
    async def pull(
        ctx: Context,
        name: Annotated[str, Field(description="a variable, or an expression, on each rank")],
        ranks: Ranks = None,
        max_chars: Annotated[
            int, Field(description="cut each repr here (at most 100000)", ge=1, le=100_000)
        ] = 2000,
    ) -> R.PullResult:
        """A value on each rank, described where it lives: its repr (cut at max_chars),
        type, and for tensors and arrays shape, dtype, device and bytes. Nothing large is
        moved: use run to compute what you need from big values."""
        return await call(ctx, driver.pull, name, ranks, max_chars)

    @server.tool()
    async def export(
        ctx: Context,
        path: Annotated[str, Field(description="the script to write, e.g. train.py")],
        force: Annotated[bool, Field(description="overwrite path if it exists")] = False,
        profile: Annotated[bool, Field(description="profiled cells under the profiler")] = False,
    ) -> R.ExportResult:
        """Write the cells that ran in this session (run, profile; an attached session's
        notebook cells too), in order, as a script for torchrun. Failed cells are left out
        as comments."""
        return await call(ctx, driver.export, path, force, profile)

    return server


class _Server(MCPServer):
    """The SDK's server, stricter with arguments: a name a tool does not take is refused (a
    misspelt ``rank`` would otherwise run the cell on every rank), and an argument that fails
    its schema is told in one line."""

    _known: dict[str, set[str]] | None = None

    async def call_tool(self, name, arguments, context=None):
        if self._known is None:
            tools = await self.list_tools()
            self._known = {t.name: set(t.input_schema.get("properties", {})) for t in tools}
        known = self._known.get(name)
        unknown = sorted(set(arguments) - known) if known is not None else []
        if unknown:
            takes = ", ".join(sorted(known)) or "none"
            raise ToolError(f"{name}: no argument {', '.join(unknown)} (it takes: {takes}).")
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as e:
            if not isinstance(e.__cause__, ValidationError):
                raise
            why = "; ".join(
                f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.__cause__.errors()
            )
            raise ToolError(_one_line(f"{name}: bad arguments: {why}.")) from e.__cause__


async def call(ctx: Context, fn, /, *args):
    """``fn(*args)`` on a worker thread; a ``progress`` keyword, if ``fn`` takes one, sends
    progress notifications (when the client asked for them, at most 4 a second); the
    session's errors become tool errors of one line."""
    kw = {}
    if "progress" in inspect.signature(fn).parameters:
        kw["progress"] = _progress(ctx, anyio.lowlevel.current_token())
    try:
        # abandon_on_cancel: a request the client cancels, or the server ending as its client
        # goes, returns now; the driver's call ends by itself (Driver.close ends a wait)
        return await anyio.to_thread.run_sync(
            functools.partial(fn, *args, **kw), abandon_on_cancel=True
        )
    except DistUsageError as e:
        raise ToolError(_one_line(str(e))) from None
    except DistCellError as e:
        raise ToolError(_one_line(e.summary)) from None
    except Exception as e:
        log.warning("%s failed", getattr(fn, "__name__", "tool"), exc_info=True)  # to stderr
        raise ToolError(_one_line(one_line(e))) from None


def _progress(ctx: Context, token):
    last = [0.0]

    def progress(done: float, total: float | None = None, message: str = "") -> None:
        now = time.monotonic()
        if now - last[0] < PROGRESS_EVERY_S:
            return
        last[0] = now
        try:
            report = functools.partial(ctx.report_progress, float(done), total, message or None)
            anyio.from_thread.run(report, token=token)
        except Exception:  # a client gone, a loop closing: the work goes on
            pass

    return progress


def _one_line(text: str) -> str:
    text = agent_words(" ".join(text.split()))
    return text if len(text) <= LINE_CHARS else f"{text[:LINE_CHARS]}... (cut)"


# The session's messages name the notebook's magics; an agent calls tools. Most specific
# first: each magic, with its flags, as the tool call that does the same.
_AGENT_WORDS = [
    (re.compile(r"%dist_attach (\S+) --force"), r'attach(name="\1", force=true)'),
    (re.compile(r"%dist_attach (\S+)"), r'attach(name="\1")'),
    (re.compile(r"%dist_restart --ranks ([\d,\-]+)"), r'restart(ranks="\1")'),
    (re.compile(r"%dist_restart --hard"), "restart(hard=true)"),
    (re.compile(r"\(or --hard\)"), "(or restart(hard=true))"),
    (re.compile(r"%dist_restart\b"), "restart()"),
    (re.compile(r"%dist_start --nprocs (\d+)"), r"start(nprocs=\1)"),
    (re.compile(r"%dist_stop (\S+)"), r'stop (after attach(name="\1"))'),
    (re.compile(r"%(dist_stop|dist_sessions|dist_stacks|dist_interrupt|dist_status)\b"),
     lambda m: m.group(1).removeprefix("dist_")),
    (re.compile(r"%%dist\b"), "run"),
]  # fmt: skip


def agent_words(text: str) -> str:
    """``text`` with the magics it names said as tool calls ('%dist_restart --hard' ->
    'restart(hard=true)')."""
    for pattern, words in _AGENT_WORDS:
        text = pattern.sub(words, text)
    return text


def _start_tool(driver: Driver):
    """``start``, with one keyword per start option (core/options.py writes them once, for
    ``%dist_start``'s flags too), each described by its flag's help."""
    hints = typing.get_type_hints(StartOptions)
    params, annotations = [], {}
    for f in dataclasses.fields(StartOptions):
        described = Field(description=f.metadata.get("help", "").replace("%%", "%"))
        annotations[f.name] = Annotated[hints[f.name], described]
        params.append(
            inspect.Parameter(
                f.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=f.default,
                annotation=annotations[f.name],
            )
        )
    ctx_param = inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=Context)

    async def start(ctx: Context, **options) -> R.SessionInfo:
        """Start a session: one process per rank with torch.distributed initialised on each
        (the options of %dist_start). nprocs=N: N CPU ranks on gloo; gpus=N: one rank per
        GPU on nccl; tp/cp/pp/dp: the parallel layout (every group and a DeviceMesh are made);
        name and keep (like '30m'): a kept session that outlives this server and that a
        notebook can attach. Refused while a session runs here."""
        return await call(ctx, driver.start, options)

    start.__signature__ = inspect.Signature([ctx_param, *params], return_annotation=R.SessionInfo)
    start.__annotations__ = {**annotations, "ctx": Context, "return": R.SessionInfo}
    return start
