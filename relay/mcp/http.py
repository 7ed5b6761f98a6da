"""``relay mcp --listen``: the same MCP server over the SDK's streamable HTTP transport,
for one agent identity, for a host on another machine (or another container).

Every request must carry ``Authorization: Bearer <token>``, the token read from a
file (compared in constant time; anything else is ``401`` with the relay's error
body). The listener is loopback-only unless it speaks TLS (``--tls-cert`` and
``--tls-key``). The socket is bound in the reactor thread, before the server
starts, so a port in use is a one-line error; uvicorn serves the SDK's ASGI app
on it in the MCP loop's thread.
"""

from __future__ import annotations

import hmac
import json
import os
import socket
import ssl
from pathlib import Path
from typing import Any, Awaitable, Callable, Dict, List, Optional, Tuple

from relay.client.settings import UsageError
from relay.wire.protocol import is_loopback_host

PATH = "/mcp"
MIN_TOKEN_CHARS = 16

Scope = Dict[str, Any]
Receive = Callable[[], Awaitable[Dict[str, Any]]]
Send = Callable[[Dict[str, Any]], Awaitable[None]]


def parse_listen(value: str) -> Tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as ``(host, port)``; port 0 picks a
    free one. Raises :class:`UsageError` naming ``--listen``."""
    host, sep, port_text = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise UsageError(f"--listen: expected HOST:PORT such as 127.0.0.1:8765, not {value!r}")
    return host, int(port_text)


def read_token(path: str) -> str:
    """The bearer token in ``path``: at least 16 characters, no whitespace inside.
    Raises :class:`UsageError` naming ``--token-file`` and the reason."""
    try:
        token = Path(path).expanduser().read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"--token-file: cannot read {path}: {error}") from None
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise UsageError(
            f"--token-file: {path} must hold one token of at least {MIN_TOKEN_CHARS} "
            "characters without spaces (e.g. `openssl rand -hex 32`)")
    return token


class BearerGuard:
    """An ASGI app that passes on only HTTP requests with the bearer token."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope.get("headers", ())
                      if name.lower() == b"authorization"), b"")
        if hmac.compare_digest(given.strip(), self._expected):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"code": "unauthenticated", "message":
                                     "this MCP endpoint needs Authorization: Bearer <token>"}},
                          separators=(",", ":")).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]})
        await send({"type": "http.response.body", "body": body})


class HTTPListener:
    """Where ``relay mcp --listen`` serves, checked and bound; :meth:`serve` runs the
    MCP server there until cancelled."""

    def __init__(self, listen: str, token_file: Optional[str], tls_cert: Optional[str] = None,
                 tls_key: Optional[str] = None) -> None:
        self.host, port = parse_listen(listen)
        if token_file is None:
            raise UsageError("--listen needs --token-file PATH: a file holding the bearer "
                             "token the MCP host sends")
        self.token = read_token(token_file)
        self.token_file = token_file
        if (tls_cert is None) != (tls_key is None):
            raise UsageError("--tls-cert and --tls-key go together")
        self.tls_cert, self.tls_key = tls_cert, tls_key
        if tls_cert is None and not is_loopback_host(self.host):
            raise UsageError(
                f"--listen {listen}: only a loopback address (127.0.0.1, ::1, localhost) "
                "without TLS; give --tls-cert and --tls-key to listen on another")
        if tls_cert is not None:
            try:
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                    tls_cert, tls_key)
            except (OSError, ssl.SSLError) as error:
                raise UsageError(f"--tls-cert/--tls-key: cannot load them: {error}") from None
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((self.host, port))
        except OSError as error:
            self.socket.close()
            raise UsageError(f"--listen {listen}: cannot listen there: {error.strerror}") from None
        self.port = self.socket.getsockname()[1]
        self.socket.listen(128)  # connections wait until the server accepts them

    @property
    def url(self) -> str:
        """The endpoint's URL, for the host's configuration."""
        scheme = "https" if self.tls_cert else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}{PATH}"

    def token_file_readable_by_others(self) -> bool:
        """Whether other users may read the token file."""
        return bool(os.stat(os.path.expanduser(self.token_file)).st_mode & 0o077)

    async def serve(self, server: Any) -> None:
        """Serve ``server``'s streamable HTTP app here until cancelled."""
        import uvicorn

        app = server.streamable_http_app(streamable_http_path=PATH, host=self.host)
        config = uvicorn.Config(
            BearerGuard(app, self.token), log_level="warning", lifespan="on",
            ssl_certfile=self.tls_cert, ssl_keyfile=self.tls_key,
        )
        sockets: List[socket.socket] = [self.socket]
        try:
            await uvicorn.Server(config).serve(sockets=sockets)
        finally:
            self.socket.close()
