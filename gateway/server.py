"""Serving the gateway app with uvicorn, with bounds on slow clients.

uvicorn bounds nothing about a client that is slow to send its request head: its keep-alive
timer runs only between requests and any byte cancels it, and a new connection has no timer
at all, so a client that sends a header a byte now and then (slowloris) holds its connection
for ever. ``HeadTimeoutProtocol`` (uvicorn's h11 protocol, plus one timer) closes a connection
that has not sent a complete request head (request line and headers) within
``header_timeout_s`` of its opening, or of the first byte of its next request on a kept-alive
connection; one that sent part of a head gets a 408 problem first. The timer stops as soon as
the head is complete, so a request body (a slow but steady upload), a long-poll or a streamed
answer is never cut by it. An idle kept-alive connection is closed after ``idle_timeout_s``
(uvicorn's ``timeout_keep_alive``).

The number of connections is not capped (uvicorn's ``limit_concurrency``): past it uvicorn
answers 503 to everyone, so whoever holds that many connections, slow or not, would refuse
the legitimate users; with the head timeout a slow client holds a connection for
``header_timeout_s`` at most. The operating system's file-descriptor limit is the cap.

The gateway always speaks h11 (the protocol class is given explicitly, even where httptools
is installed), and uvicorn's proxy headers are off: the client address the gateway sees
(``request.client``, which ``gateway/badtokens.py`` limits) is the TCP peer, never what an
``X-Forwarded-For`` header claims.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import FrameType

import h11
import msgspec
import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.h11_impl import H11Protocol

from bulletin_core import wire
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.errors import PROBLEM
from gateway.notify import Hub

_TIMED_OUT = msgspec.json.encode(
    wire.Problem(
        title="Request Timeout",
        status=408,
        detail="the request head (line and headers) did not arrive in time; send it whole",
        code="header_timeout",
    )
)
REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: " + PROBLEM.encode() + b"\r\n"
    b"content-length: "
    + str(len(_TIMED_OUT)).encode()
    + b"\r\nconnection: close\r\n\r\n"
    + _TIMED_OUT
)


class HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing connections slow to send a request head."""

    #: Seconds a connection has to send a complete request head.
    header_timeout_s = 10.0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self.conn.their_state is h11.IDLE:
            self._start_head_timer()  # the first byte of the next request on this connection
        super().data_received(data)
        self._head_progress()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._head_progress()  # a pipelined request may be waiting, whole or in part

    def _head_progress(self) -> None:
        if self.conn.their_state is not h11.IDLE:  # a head arrived: its body is not timed
            self._stop_head_timer()
        elif self._head_timer is None and self.conn.trailing_data[0]:
            self._start_head_timer()

    def _start_head_timer(self) -> None:
        self._stop_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:
            self.transport.write(REQUEST_TIMEOUT)
        with contextlib.suppress(h11.LocalProtocolError):  # closes all the same
            self.conn.send(h11.ConnectionClosed())
        self.transport.close()


def protocol(header_timeout_s: float) -> type[HeadTimeoutProtocol]:
    """A HeadTimeoutProtocol with this header timeout (uvicorn makes one per connection)."""

    class Configured(HeadTimeoutProtocol):
        pass

    Configured.header_timeout_s = header_timeout_s
    return Configured


class _Server(uvicorn.Server):
    """uvicorn's server, ending the app's long-polls as soon as it is told to stop: they
    answer 503 with Retry-After (gateway/notify.py: GatewayStopping) instead of being
    cancelled after the graceful shutdown timeout, which answered 500."""

    def __init__(self, config: uvicorn.Config, app: Starlette) -> None:
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        hub: Hub | None = getattr(self._app.state, "hub", None)  # None: still starting
        if hub is not None:
            asyncio.get_running_loop().call_soon_threadsafe(hub.stop_waiters)
        super().handle_exit(sig, frame)


def serve(config: GatewayConfig) -> None:
    """Run the gateway until SIGINT/SIGTERM (uvicorn drains in-flight requests)."""
    app = create_app(config)
    server = _Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="warning",
            access_log=False,
            # Long-polls hold for seconds; their clients retry, so do not wait them out.
            timeout_graceful_shutdown=2,
            http=protocol(config.header_timeout_s),
            # uvicorn hands it to loop.call_later, which takes any number of seconds.
            timeout_keep_alive=config.idle_timeout_s,  # type: ignore[arg-type]
            proxy_headers=False,
            ssl_certfile=config.tls_cert_file or None,
            ssl_keyfile=config.tls_key_file or None,
        ),
        app,
    )
    server.run()
