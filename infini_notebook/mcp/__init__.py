"""An MCP server over the session API, so a coding agent drives ranks as a notebook does:
``python -m infini_notebook.mcp`` (stdio), or ``--http`` (streamable HTTP on loopback, with a
token). See docs/agents.md.

- ``driver.py``: each tool's work over the public session API (no protocol);
- ``results.py``: the tools' structured results (their JSON schemas);
- ``server.py``: the tools on the official ``mcp`` SDK's MCPServer (progress, errors);
- ``http.py``: the HTTP transport's loopback socket and token gate;
- ``__main__.py``: the command line.

Imports ``mcp`` (the SDK, ``pip install 'infini_notebook[mcp]'``) only in those modules: the
package itself stays importable without it."""
