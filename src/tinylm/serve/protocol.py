"""uvicorn, configured with limits: header, body and idle timeouts and a connection cap.

uvicorn times out idle keep-alive connections (``timeout_keep_alive``) and caps a request
head's size (``h11_max_incomplete_event_size``), but a client that sends a head slowly,
a byte at a time, is never timed out, and connections are not capped, only the requests
in flight (``limit_concurrency``). :class:`LimitedH11Protocol` adds both: a connection
with no request in progress ``HEADER_TIMEOUT`` seconds after it opened (or after its
previous response) is closed: its head is incomplete, or the body of a request already
answered (a 408) is still trickling in; and a connection beyond ``max_connections`` is closed
at once. The body has its own time limit in the app (``BODY_TIMEOUT``, a 408).
:class:`GracefulServer` drains the running requests on SIGTERM or SIGINT and exits 0.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT = 10.0  # seconds to send a request head
KEEP_ALIVE = 5  # seconds an idle keep-alive connection is kept
MAX_HEAD_BYTES = 16 * 1024  # a request line and headers


class LimitedH11Protocol(H11Protocol):
    """H11Protocol with a request-head timeout and a connection cap (set on the class
    by :func:`protocol_class`)."""

    max_connections = 128
    header_timeout = HEADER_TIMEOUT

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections:
            self.logger.warning("refused a connection: %d open, the limit is %d "
                                "(--max-connections)", len(self.connections) - 1,
                                self.max_connections)
            transport.close()
            return
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timeout)

    def _head_timeout(self) -> None:
        """No request is in progress: the next head is incomplete (a slow client), or the
        last request's body is still coming after its answer (a 408)."""
        self._head_timer = None
        busy = self.cycle is not None and not self.cycle.response_complete
        if not busy and not self.transport.is_closing():
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()  # the next request's head has the same time

    def connection_lost(self, exc: Exception | None) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)


def protocol_class(max_connections: int) -> type[LimitedH11Protocol]:
    return type("LimitedH11Protocol", (LimitedH11Protocol,),
                {"max_connections": max_connections})


def uvicorn_config(app: Any, *, host: str = "127.0.0.1", port: int = 8000,
                   max_connections: int = 128, log_level: str = "info") -> uvicorn.Config:
    """The uvicorn settings of ``tinylm serve``: the limits above, ``limit_concurrency``
    (requests in flight, a 503 beyond) at the connection cap, no WebSocket support."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          http=protocol_class(max_connections), ws="none",
                          timeout_keep_alive=KEEP_ALIVE,
                          h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                          limit_concurrency=max_connections + 1, lifespan="on")



class GracefulServer(uvicorn.Server):
    """uvicorn's server with a drain before its shutdown: on SIGTERM or SIGINT
    ``on_signal()`` runs at once (the app refuses new work), the listening sockets close,
    then ``drain(shutdown_timeout)`` (awaited: running requests finish or are
    cancelled), then uvicorn's own shutdown (connections closed, the app's lifespan
    ends) within ``CLOSE_TIMEOUT`` more seconds. The process then exits 0: the signal is
    not raised again after the shutdown (uvicorn's default would end the process with
    it). A second signal stops at once."""

    CLOSE_TIMEOUT = 10.0

    def __init__(self, config: uvicorn.Config, *, on_signal: Callable[[], None],
                 drain: Callable[[float], Awaitable[None]], shutdown_timeout: float) -> None:
        super().__init__(config)
        self.on_signal, self.drain = on_signal, drain
        self.shutdown_timeout = shutdown_timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = True  # a second signal: stop now
            return
        self.should_exit = True
        self.on_signal()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.on_signal()
        for server in self.servers:  # no new connections while the running requests end
            server.close()
        drain = asyncio.ensure_future(self.drain(self.shutdown_timeout))
        while not drain.done() and not self.force_exit:  # a second signal ends the wait
            await asyncio.sleep(0.05)
        if not drain.done():
            drain.cancel()
        self.config.timeout_graceful_shutdown = self.CLOSE_TIMEOUT
        await super().shutdown(sockets)


def graceful_server(app: Any, server: Any, *, shutdown_timeout: float,
                    **config: Any) -> GracefulServer:
    """The :class:`GracefulServer` of ``tinylm serve`` for ``app`` and its
    :class:`~tinylm.serve.app.Server` (whose tracker drains); ``config``:
    :func:`uvicorn_config`'s keywords."""
    tracker = server.tracker
    return GracefulServer(uvicorn_config(app, **config), on_signal=tracker.start_draining,
                          drain=tracker.drain, shutdown_timeout=shutdown_timeout)
