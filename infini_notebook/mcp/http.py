"""The MCP server over streamable HTTP: on loopback only, and only for requests that carry
the server's token (``Authorization: Bearer TOKEN``); anything else gets 401 before the
SDK's app sees it: whoever can reach a port on this machine (every local user) could
otherwise run code on the ranks as you. It holds its port on both loopback addresses (see
``loopback_sockets``)."""

from __future__ import annotations

import errno
import hmac
import ipaddress
import json
import secrets
import socket
import sys

TOKEN_ENV = "INFINI_NOTEBOOK_MCP_TOKEN"


class TokenGate:
    """ASGI middleware: HTTP requests without the token are refused (401); the app's
    lifespan events pass through."""

    def __init__(self, app, token: str):
        if len(token) < 16:
            raise ValueError(f"the token must have at least 16 characters ({TOKEN_ENV})")
        self.app, self._expected = app, token.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket" and not self._allowed(scope):
            await send({"type": "websocket.close", "code": 1008})  # before accept: a 403
            return
        if scope["type"] == "http" and not self._allowed(scope):
            body = json.dumps(
                {"error": "unauthorized: send the server's token as 'Authorization: Bearer TOKEN'"}
            ).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"www-authenticate", b"Bearer"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope) -> bool:
        """One Authorization header, scheme Bearer in any case (RFC 9110 11.1: schemes are
        case-insensitive; some clients send ``bearer``), then the token, compared in
        constant time."""
        sent = [v for k, v in scope.get("headers", []) if k.lower() == b"authorization"]
        if len(sent) != 1:
            return False
        scheme, _, token = sent[0].strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._expected)


LOOPBACK_TWIN = {"127.0.0.1": "::1", "::1": "127.0.0.1"}
TWIN_TRIES = 20  # free ports tried for a pair when another process holds the twin's
# the twin address does not exist here (no IPv6 in many containers): serve without it
NO_SUCH_ADDRESS = (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)


def loopback_sockets(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on ``host`` (a loopback address; ``localhost`` is 127.0.0.1) and
    ``port`` (0: any free one), and on the other loopback address at the same port where
    this machine has it: a client told ``localhost`` may try ::1 first, and another local
    user listening there would receive its token. A twin another process holds is refused
    (a given port) or avoided (another free port); only an address this machine lacks
    leaves it out (a flood of another user's sockets must not pass for "no IPv6")."""
    address = loopback_address(host)
    host = str(address)
    twin = LOOPBACK_TWIN.get(host)
    for _ in range(TWIN_TRIES if port == 0 else 1):
        first = _listen(host, port)
        bound = first.getsockname()[1]
        if twin is None:
            return [first]
        try:
            return [first, _bind_listen(twin, bound)]
        except OSError as e:
            if e.errno in NO_SUCH_ADDRESS:
                return [first]
            first.close()
            if port:
                raise SystemExit(
                    f"infini_notebook.mcp: port {port} is free on {host} but {twin} refused "
                    f"it ({e.strerror}): another process (maybe another user's) may listen "
                    "there, where clients told 'localhost' may go. Leave --port out for a "
                    "free pair."
                ) from None
    raise SystemExit(
        f"infini_notebook.mcp: no port free on both {host} and {twin} in {TWIN_TRIES} tries: "
        f"another process (maybe another user's) holds them on {twin}. Try again, or give "
        "--port a port free on both."
    )


def loopback_address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``host`` as a loopback address, or SystemExit saying why not."""
    try:
        address = ipaddress.ip_address("127.0.0.1" if host == "localhost" else host)
    except ValueError:
        address = None
    if address is None or not address.is_loopback:
        raise SystemExit(
            f"infini_notebook.mcp: --host {host!r} is not a loopback address; the HTTP "
            "transport listens on loopback only (127.0.0.1, ::1 or localhost)."
        )
    if getattr(address, "scope_id", None) or getattr(address, "ipv4_mapped", None):
        raise SystemExit(
            f"infini_notebook.mcp: --host {host!r}: give 127.0.0.1 or ::1 itself (no zone, "
            "no IPv4-mapped form)."
        )
    return address


def _bind_listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def _listen(host: str, port: int) -> socket.socket:
    try:
        return _bind_listen(host, port)
    except OSError as e:
        if e.errno in NO_SUCH_ADDRESS:
            why = f"this machine has no {host}: give --host 127.0.0.1"
        elif port:
            why = "another process (maybe another user's) holds it: leave --port out"
        else:
            why = "no free port there (another process may hold them all): try again"
        raise SystemExit(
            f"infini_notebook.mcp: cannot listen on {host} port {port}: {e.strerror}; {why}."
        ) from None


async def serve(server, host: str, port: int, token: str | None) -> None:
    """Serve ``server`` (an MCPServer) at http://HOST:PORT/mcp until cancelled. Without a
    ``token`` one is made and printed to stderr."""
    import uvicorn

    told = token is not None
    token = token or secrets.token_urlsafe(32)
    if len(token) < 16:
        raise SystemExit(f"infini_notebook.mcp: ${TOKEN_ENV} must have at least 16 characters.")
    host = str(loopback_address(host))  # what the SDK's Host check is told: 127.0.0.1, ::1
    socks = loopback_sockets(host, port)
    where = socks[0].getsockname()
    shown = f"[{where[0]}]" if ":" in where[0] else where[0]
    app = TokenGate(server.streamable_http_app(host=host), token)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    secret = f"${TOKEN_ENV}" if told else token  # a token of the caller's is not echoed
    print(
        f"infini_notebook MCP server: http://{shown}:{where[1]}/mcp "
        f"(header 'Authorization: Bearer {secret}')",
        file=sys.stderr,
        flush=True,
    )
    await uvicorn.Server(config).serve(sockets=socks)
