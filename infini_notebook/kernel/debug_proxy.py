"""JupyterLab's debugger on ranks (issue 52): the kernel proxies the Debug Adapter Protocol.

JupyterLab sends DAP requests as ``debug_request`` messages on the control channel;
ipykernel answers them in ``Debugger.process_request`` (ipykernel/debugger.py), on the
control thread's event loop, and sends debugpy's events as ``debug_event`` on iopub
(``Kernel._publish_debug_event``, ipykernel/kernelbase.py). ``install`` wraps that one
method: requests about the kernel's own threads, frames and variables go to ipykernel's
debugger unchanged (plain cells debug as before); each rank runs debugpy on loopback
(engine/rank_debug.py) and this module holds one DAP client per rank. Ids are mapped and
requests routed by core/dap_ids.py; a ``%%dist`` cell's source (the path JupyterLab's
``dumpCell`` gave) is mapped to the file each rank compiles the cell's body to.
"""

from __future__ import annotations

import asyncio
import logging
import os

from ..core import dap_ids
from . import rank_debuggers
from .dap_link import REPLY_TIMEOUT as _REPLY_TIMEOUT
from .dap_link import DapConnection

log = logging.getLogger("infini_notebook")

# Requests that act on a thread, frame or variable: sent to the rank that owns the id
_ROUTED = frozenset(
    {
        "stackTrace",
        "scopes",
        "variables",
        "evaluate",
        "next",
        "stepIn",
        "stepOut",
        "pause",
        "setVariable",
        "setExpression",
        "completions",
        "exceptionInfo",
    }
)
_RELAYED_EVENTS = frozenset({"stopped", "continued", "output"})


def install(kernel, current) -> bool:
    """Wrap the kernel's debugger (once); False where the kernel has none (no debugpy,
    or not an ipykernel kernel). ``current()``: the running session or None (passed in:
    the session's modules import this one)."""
    debugger = getattr(kernel, "debugger", None)
    if debugger is None or not hasattr(debugger, "process_request"):
        return False
    if isinstance(getattr(debugger, "_infini_proxy", None), DebugProxy):
        return True
    no_child_debugging(listening=bool(getattr(debugger, "debugpy_initialized", False)))
    proxy = DebugProxy(kernel, debugger, current)
    debugger._infini_proxy = proxy
    debugger.process_request = proxy.process_request  # the instance's, not the class's
    return True


def no_child_debugging(listening: bool) -> None:
    """Processes this one starts (the session's template, controller and engines) run
    undebugged. debugpy's default, ``subProcess``, patches process creation in the debugged
    process (pydevd's ``pydev_monkey.patch_new_process_functions``, applied at
    ``debugpy.listen``): each child Python would start under debugpy and wait for a client
    JupyterLab never sends, so %dist_start with the debugger on hung until its timeout.
    ``debugpy.configure(subProcess=False)`` (debugpy/public_api.py: it must precede listen;
    an attach request cannot carry it) before ipykernel's listen; where that already ran
    (the debugger was on before %load_ext), pydevd's patches are undone: each patched
    function kept its original as ``original_<name>`` (``pydev_monkey.monkey_patch_module``)."""
    try:
        import debugpy

        debugpy.configure(subProcess=False)
    except Exception as e:  # no debugpy, or one that does not know the property
        log.debug("debugpy.configure(subProcess=False): %r", e)
    if not listening:
        return
    import _posixsubprocess
    import subprocess

    for module in (os, _posixsubprocess, subprocess):
        for name in [n for n in vars(module) if n.startswith("original_")]:
            target = name[len("original_") :]
            if hasattr(module, target):
                setattr(module, target, getattr(module, name))


def proxy_of(kernel) -> DebugProxy | None:
    return getattr(getattr(kernel, "debugger", None), "_infini_proxy", None)


def paused_now() -> set[int]:
    """Ranks paused in JupyterLab's debugger now (read from the shell thread: a copy)."""
    try:
        from IPython import get_ipython

        proxy = proxy_of(getattr(get_ipython(), "kernel", None))
    except Exception:  # not in IPython
        return set()
    if proxy is None:
        return set()
    for _ in range(3):  # the control thread may change the sets while they are read
        try:
            return set(proxy.paused_ranks())
        except RuntimeError:
            continue
    return set()


def mark_paused(rows: list) -> list:
    """Status rows: a busy rank paused at a breakpoint says so (its tile, the summary),
    not 'busy' (the others wait for it in their collectives: not a hang)."""
    paused = paused_now()
    if not paused:
        return rows
    from dataclasses import replace

    return [
        replace(r, state="paused") if r.rank in paused and r.state == "busy" else r for r in rows
    ]


class RankLink:
    """What the proxy knows of one rank's debugger: its connection, its cell thread,
    the files it compiles cells to (its path -> the kernel's), its threads now paused."""

    def __init__(self, rank: int, conn: DapConnection, info: dict):
        self.rank, self.conn, self.info = rank, conn, info
        self.main_thread: int | None = None
        self.paths: dict[str, str] = {}  # this rank's file -> the kernel's (dumpCell's) path
        self.files: dict[str, str] = {}  # the kernel's path -> this rank's file
        self.texts: dict[str, list[str]] = {}  # an editor's dumped path -> files with its text
        self.paused: set[int] = set()  # local thread ids
        self.names: dict[int, str] = {}


class DebugProxy:
    """Routes JupyterLab's debug requests: the kernel's to ipykernel, a rank's to it."""

    def __init__(self, kernel, debugger, current):
        self.kernel, self.debugger, self.current = kernel, debugger, current
        self.original = debugger.process_request
        self.links: dict[int, RankLink] = {}
        self.cells: dict[str, str] = {}  # dumpCell's path -> the cell's code
        self.breakpoints: dict[str, list] = {}  # path -> the breakpoints asked for
        self.attached = False
        self.problem = ""  # why ranks are not debugged, when they are not

    # ----- the kernel's side --------------------------------------------------------------
    async def process_request(self, message: dict) -> dict:
        command = message.get("command")
        handler = getattr(self, f"_on_{command}", None)
        if handler is not None:
            return await handler(message)
        if command in _ROUTED:
            rank = dap_ids.route(message.get("arguments"))
            if rank is not None:
                return await self._to_rank(rank, message)
        return await self.original(message)

    async def _on_attach(self, message):
        reply = await self.original(message)
        self.attached = bool(reply.get("success"))
        if self.attached:
            await self._attach_ranks()
        return reply

    async def _on_dumpCell(self, message):
        reply = await self.original(message)
        path = (reply.get("body") or {}).get("sourcePath")
        if path:
            self.cells[path] = message["arguments"]["code"]
        return reply

    async def _on_setBreakpoints(self, message):
        reply = await self.original(message)
        args = message.get("arguments") or {}
        path = (args.get("source") or {}).get("path", "")
        self.breakpoints[path] = list(args.get("breakpoints") or [])
        await self._attach_ranks()
        for link in list(self.links.values()):
            await self._rank_breakpoints(link, path)
        return reply

    async def _on_threads(self, message):
        reply = await self.original(message)
        threads = list((reply.get("body") or {}).get("threads") or [])
        for link in self.links.values():
            ids = ({link.main_thread} if link.main_thread else set()) | link.paused
            for local in sorted(ids):
                name = link.names.get(local, link.info["main_thread"])
                threads.append(
                    {
                        "id": dap_ids.to_proxy(link.rank, local),
                        "name": dap_ids.thread_name(link.rank, name, link.info["main_thread"]),
                    }
                )
        reply.setdefault("body", {})["threads"] = threads
        return reply

    async def _on_continue(self, message):
        args = message.get("arguments") or {}
        rank = dap_ids.route(args)
        if rank is not None and args.get("singleThread"):
            return await self._to_rank(rank, message)
        # DAP: continue resumes every thread unless singleThread; JupyterLab's Continue sends
        # the kernel's thread 1 once it dropped the paused one (its _currentThread()).
        if self.debugger.stopped_threads or rank is None and not self._paused_links():
            reply = await self.original(message)
        else:
            reply = _response(message, body={"allThreadsContinued": True})
        for link in self._paused_links():
            for local in sorted(link.paused):
                await self._rank_request(link, "continue", {"threadId": local})
        reply.setdefault("body", {})["allThreadsContinued"] = True
        return reply

    async def _on_debugInfo(self, message):
        reply = await self.original(message)
        body = reply.get("body") or {}
        stopped = list(body.get("stoppedThreads") or [])
        for link in self.links.values():
            stopped += [dap_ids.to_proxy(link.rank, t) for t in sorted(link.paused)]
        body["stoppedThreads"] = stopped
        return reply

    async def _on_richInspectVariables(self, message):
        args = message.get("arguments") or {}
        rank = dap_ids.route(args)
        if rank is None:
            return await self.original(message)
        # ipykernel's way while paused (Debugger.richInspectVariables): evaluate the
        # display formatter in the frame; here on the rank that owns the frame
        name = args.get("variableName", "")
        body = {"data": {}, "metadata": {}}
        if name.isidentifier():
            code = f"get_ipython().display_formatter.format({name})"
            rep = await self._to_rank(
                rank,
                {
                    "seq": message.get("seq", 0),
                    "command": "evaluate",
                    "arguments": {"expression": code, "frameId": args["frameId"]},
                },
            )
            if rep.get("success"):
                import ast

                try:
                    data, metadata = ast.literal_eval(rep["body"]["result"])
                    kept = {k: metadata[k] for k in data if k in metadata}
                    body = {"data": data, "metadata": kept}
                except (ValueError, SyntaxError, KeyError, TypeError):
                    pass
        return _response(message, body=body)

    async def _on_copyToGlobals(self, message):
        args = message.get("arguments") or {}
        rank = dap_ids.route(args)
        if rank is None:
            return await self.original(message)
        return await self._to_rank(
            rank,
            {
                "seq": message.get("seq", 0),
                "command": "setExpression",
                "arguments": {
                    "expression": f"globals()['{args['dstVariableName']}']",
                    "value": args["srcVariableName"],
                    "frameId": args["srcFrameId"],
                },
            },
        )

    async def _on_disconnect(self, message):
        reply = await self.original(message)
        await self.detach()
        self.cells.clear()
        self.breakpoints.clear()
        self.attached = False
        return reply

    # ----- the ranks' side ----------------------------------------------------------------
    def _paused_links(self) -> list[RankLink]:
        return [link for link in self.links.values() if link.paused]

    def paused_ranks(self) -> list[int]:
        """Ranks paused in the debugger now (for the status and the wait watch)."""
        return sorted(link.rank for link in self._paused_links())

    async def _attach_ranks(self) -> None:
        """Attach to every rank's debugpy (started on the rank now, if it is not yet) that
        is not attached: the session may have started, or restarted, since."""
        if not self.attached:
            return
        session = self.current()
        if session is None:
            return
        for rank, link in list(self.links.items()):
            if not link.conn.alive:  # its process went (a restart): attach again
                link.conn.close()
                del self.links[rank]
        missing = [r for r in range(session.world_size) if r not in self.links]
        if not missing:
            return
        loop = asyncio.get_running_loop()
        infos = await loop.run_in_executor(None, rank_debuggers.listen_on, session, missing)
        for rank, info in infos.items():
            if isinstance(info, str):
                self.problem = info
                log.warning("debugger: rank %s not attached: %s", rank, info)
                continue
            try:
                self.links[rank] = await self._attach_rank(rank, info)
            except (OSError, asyncio.TimeoutError, ConnectionError) as e:
                self.problem = f"rank {rank}: {e!r}"
                log.warning("debugger: rank %s not attached: %r", rank, e)

    async def _attach_rank(self, rank: int, info: dict) -> RankLink:
        """initialize, attach, configurationDone, as ipykernel's DebugpyClient does with
        the kernel's own debugpy (``_handle_init_sequence``): debugpy answers the attach
        only after configurationDone, which waits for its 'initialized' event."""
        conn = DapConnection(rank, self._on_rank_event)
        await conn.open(info["host"], info["port"], self.current().rendezvous.mac_key)
        link = RankLink(rank, conn, info)
        await conn.request(
            "initialize",
            {"clientID": "infini_notebook", "adapterID": "python", "pathFormat": "path"}
            | {"linesStartAt1": True, "columnsStartAt1": True},
        )
        attached = conn.send("attach", _attach_arguments())
        await asyncio.wait_for(conn.initialized.wait(), _REPLY_TIMEOUT)
        await conn.request("configurationDone")
        await asyncio.wait_for(attached, _REPLY_TIMEOUT)
        threads = await conn.request("threads")
        for t in (threads.get("body") or {}).get("threads") or []:
            link.names[t["id"]] = t["name"]
            if t["name"] == info["main_thread"]:
                link.main_thread = t["id"]
        for path in list(self.breakpoints):
            await self._rank_breakpoints(link, path)
        return link

    async def _rank_breakpoints(self, link: RankLink, path: str) -> None:
        """The breakpoints of ``path`` on one rank: a module's on the same path; a %%dist
        cell's on the file the rank compiles its body to; an editor's text's on the files
        with that text (``_files_with_text``)."""
        code = self.cells.get(path)
        if code is None:
            targets = [path]
        elif (body := _dist_body(code)) is not None:
            targets = await self._cell_file(link, path, body, code)
        else:  # a plain cell, or a file open in JupyterLab's editor
            targets = await self._files_with_text(link, path, code)
        for target in targets:
            await self._rank_request(
                link,
                "setBreakpoints",
                {"source": {"path": target}, "breakpoints": self.breakpoints.get(path, [])}
                | {"sourceModified": False},
            )

    async def _cell_file(self, link: RankLink, path: str, body: str, code: str) -> list[str]:
        """The file the rank compiles this %%dist cell's body to (written there once)."""
        target = link.files.get(path)
        if target is None:
            target = await self._on_rank(link, rank_debuggers.write_cell_file, body, code)
            if target is None:
                return []
            link.files[path], link.paths[target] = target, path
        return [target]

    async def _files_with_text(self, link: RankLink, path: str, code: str) -> list[str]:
        """JupyterLab's file editor sets a file's breakpoints as a cell's: on the path
        dumpCell gave for the editor's text. On a rank they go on each source file with
        that very text (a module it imported, a file of its working folder), whose frames
        then show as that path, in that editor; a plain cell's text matches none."""
        targets = link.texts.get(path)
        if targets is None:
            targets = await self._on_rank(link, rank_debuggers.files_with_text, code) or []
            if targets:  # none yet: perhaps not imported yet, looked for again next time
                link.texts[path] = targets
            for target in targets:
                link.paths[target] = path
        return targets

    async def _on_rank(self, link: RankLink, fn, *args):
        """``fn(session, rank, *args)`` off the control thread (it waits on the rank);
        None without a session."""
        session = self.current()
        if session is None:
            return None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, fn, session, link.rank, *args)

    async def _rank_request(self, link: RankLink, command: str, arguments: dict) -> dict:
        try:
            return await link.conn.request(command, arguments)
        except (asyncio.TimeoutError, ConnectionError, OSError) as e:
            log.warning("debugger: rank %s %s: %r", link.rank, command, e)
            return {"success": False, "message": f"rank {link.rank}: {e!r}"}

    async def _to_rank(self, rank: int, message: dict) -> dict:
        link = self.links.get(rank)
        command = message.get("command")
        if link is None:
            return _response(message, success=False, text=f"rank {rank} is not being debugged")
        rep = await self._rank_request(link, command, dap_ids.to_rank(message.get("arguments")))
        body = rep.get("body") or {}
        if command == "stackTrace" and "stackFrames" in body:
            frames = dap_ids.stack_frames(rank, body["stackFrames"], link.paths)
            body = dict(body, stackFrames=frames)
        else:
            body = dap_ids.from_rank(rank, body, link.paths)
        if command == "variables" and "variables" in body:
            accept = getattr(self.debugger, "accept_variable", lambda name: True)
            body["variables"] = [v for v in body["variables"] if accept(v.get("name", ""))]
        out = _response(message, success=bool(rep.get("success")), body=body)
        if rep.get("message"):
            out["message"] = rep["message"]
        return out

    def _on_rank_event(self, rank: int, msg: dict) -> None:
        """A rank's event: stopped, continued and output relayed with ids mapped (as the
        kernel's debug_event); the rest (threads, modules, telemetry) kept here."""
        link = self.links.get(rank)
        event, body = msg.get("event"), dict(msg.get("body") or {})
        if event == "stopped" and link is not None and "threadId" in body:
            link.paused.add(body["threadId"])
        elif event == "continued" and link is not None:
            if body.get("allThreadsContinued"):
                link.paused.clear()
            else:
                link.paused.discard(body.get("threadId"))
        if event not in _RELAYED_EVENTS or body.get("category") == "telemetry":
            return
        body = dap_ids.from_rank(rank, body, link.paths if link else {})
        if event in ("stopped", "continued"):  # the rank's threads, not the kernel's
            body["allThreadsStopped" if event == "stopped" else "allThreadsContinued"] = False
        if event == "output" and body.get("output"):
            body["output"] = f"[rank {rank}] {body['output']}"
        self.kernel._publish_debug_event(dict(msg, body=body))

    async def detach(self) -> None:
        """Leave every rank's debugpy (its breakpoints go, paused ranks run on)."""
        for link in list(self.links.values()):
            if link.conn.alive:
                try:
                    bye = {"restart": False, "terminateDebuggee": False}
                    await asyncio.wait_for(link.conn.send("disconnect", bye), 5)
                except (asyncio.TimeoutError, ConnectionError, OSError):
                    pass
            link.conn.close()
        self.links.clear()


def _response(message: dict, success: bool = True, body: dict | None = None, text: str = ""):
    out = {
        "type": "response",
        "request_seq": message.get("seq", 0),
        "seq": message.get("seq", 0),
        "success": success,
        "command": message.get("command"),
        "body": body or {},
    }
    if text:
        out["message"] = text
    return out


def _attach_arguments() -> dict:
    """justMyCode, without our package's frames (the cell's wrapper, rank services) and
    without debugpy's copy of the rank's output (its output reaches the notebook already)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {
        "justMyCode": True,
        "redirectOutput": False,
        "subProcess": False,
        "rules": [{"path": package, "include": False}],
    }


def _dist_body(code: str) -> str | None:
    """The body a %%dist cell sends to its ranks, as IPython transforms the cell."""
    try:
        from IPython import get_ipython

        transformed = get_ipython().input_transformer_manager.transform_cell(code)
    except Exception:  # not in IPython
        return None
    return dap_ids.dist_body(transformed)
