"""The ``Host`` check: the server answers only requests addressed to a name it serves.

A web page the user visits can make the browser send requests to 127.0.0.1 by DNS
rebinding (its own name, re-pointed at the loopback address): the browser then sends the
page's name in ``Host``. So every HTTP request whose ``Host`` is not one of the server's
names is refused with ``421 Misdirected Request`` before any route runs (a request with no
``Host`` at all: 400). The names are the loopback ones (``127.0.0.1``, ``localhost``,
``[::1]``), the ``--host`` address, and ``--allowed-hosts``; ``*`` among them turns the
check off. With a port, a ``Host`` that names a port must name that one.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
WILDCARD_BINDS = ("0.0.0.0", "::", "")

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]


def host_names(host: str, allowed: Iterable[str] = ()) -> frozenset[str]:
    """The names a server bound to ``host`` answers to: loopback, ``host`` itself (unless
    a wildcard address) and ``allowed`` (lower case, IPv6 without brackets, a port given
    with a name dropped: the port checked is the one bound)."""
    names = set(LOOPBACK_NAMES)
    if host not in WILDCARD_BINDS:
        names.add(host)
    names.update(a.strip() for a in allowed if a.strip())
    return frozenset("*" if n == "*" else split_host(n)[0] for n in names)


def split_host(value: str) -> tuple[str, str | None]:
    """A Host header's name (lower case, IPv6 without brackets) and port (None if none)."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        return name, rest[1:] if rest.startswith(":") else None
    name, colon, port = value.rpartition(":")
    if not colon or ":" in name:  # no port, or a bare IPv6 address
        return value, None
    return name, port


def host_allowed(value: str, names: frozenset[str], port: int | None) -> bool:
    if "*" in names:
        return True
    name, given = split_host(value)
    if name not in names:
        return False
    return given is None or port is None or given == str(port)


class HostGuard:
    """ASGI middleware: HTTP requests with a ``Host`` outside ``names`` get a JSON 421
    in OpenAI's error shape (400 without a ``Host``); everything else passes through."""

    def __init__(self, app: ASGIApp, names: frozenset[str], port: int | None,
                 on_refused: Callable[[int], None] | None = None) -> None:
        self.app, self.names, self.port, self.on_refused = app, names, port, on_refused

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        hosts = [v for k, v in scope.get("headers", ()) if k == b"host"]
        if len(hosts) == 1 and host_allowed(hosts[0].decode("latin-1"), self.names,
                                            self.port):
            return await self.app(scope, receive, send)
        if not hosts:
            status, message = 400, "the request has no Host header"
        elif len(hosts) > 1:
            status, message = 400, "the request has more than one Host header"
        else:
            status = 421
            message = (f"this server does not answer to Host "
                       f"{hosts[0].decode('latin-1')[:100]!r}; it serves "
                       f"{', '.join(sorted(self.names))} (start it with --allowed-hosts "
                       f"NAME to add a name)")
        if self.on_refused is not None:
            self.on_refused(status)
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                     "param": None, "code": "host_not_allowed"}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
