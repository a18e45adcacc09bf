"""``python -m infini_notebook.mcp [--http [--host 127.0.0.1] [--port N]]``: the MCP server on
stdio (what MCP clients start), or on streamable HTTP at http://127.0.0.1:PORT/mcp with a
token ($INFINI_NOTEBOOK_MCP_TOKEN, else a random one printed to stderr)."""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
import traceback


def port_number(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is no port (0-65535; 0: a free one)")
    return port


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m infini_notebook.mcp",
        description="An MCP server that drives infini_notebook sessions (docs/agents.md).",
    )
    parser.add_argument(
        "--http", action="store_true", help="serve streamable HTTP on loopback, not stdio"
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="a loopback address: 127.0.0.1, ::1 or localhost"
    )
    parser.add_argument("--port", type=port_number, default=0, help="default: a free port")
    args = parser.parse_args(argv)
    try:
        from .server import build
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "mcp":
            raise
        sys.exit(
            "infini_notebook.mcp needs the MCP SDK: pip install 'infini_notebook[mcp]' "
            "(or pip install 'mcp>=2')."
        )
    # SIGTERM (an MCP client ending us) exits as an interrupt does, so the session's stop
    # (atexit) runs; a kept session is left to its watchdog, as a kernel leaves it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    from .driver import Driver

    driver = Driver()
    server = build(driver)
    code = 0
    try:
        if args.http:
            import anyio

            from .http import TOKEN_ENV, serve

            anyio.run(serve, server, args.host, args.port, os.environ.get(TOKEN_ENV))
        else:
            server.run("stdio")  # the SDK points fd 1 at stderr while it serves on a copy of it
    except SystemExit as e:  # SIGTERM, the SDK's own exit, or ours saying why (http.py)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr, flush=True)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        driver.close()  # a call still waiting on a cell returns
        # The session's stop (atexit) now, then out without the interpreter's finalization:
        # a call abandoned on a worker thread may still be inside torch, and tearing the
        # interpreter down under it aborted the server (SIGABRT) on a fresh clone.
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
