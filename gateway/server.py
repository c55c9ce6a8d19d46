"""Serving the gateway app with uvicorn, with bounds on slow clients.

uvicorn bounds nothing about a client that is slow to send its request head: its keep-alive
timer runs only between requests and any byte cancels it, and a new connection has no timer
at all, so a client that sends a header a byte now and then (slowloris) holds its connection
for ever. ``HeadTimeoutProtocol`` (uvicorn's httptools protocol, plus one timer) closes a
connection that has not sent a complete request head (request line and headers) within
``header_timeout_s`` of its opening, or of the first byte of its next request on a kept-alive
connection; one that sent part of a head gets a 408 problem first. The timer stops as soon as
the head is complete, so a request body (a slow but steady upload), a long-poll or a streamed
answer is never cut by it. An idle kept-alive connection is closed after ``idle_timeout_s``
(uvicorn's ``timeout_keep_alive``).

The number of connections is not capped (uvicorn's ``limit_concurrency``): past it uvicorn
answers 503 to everyone, so whoever holds that many connections, slow or not, would refuse
the legitimate users; with the head timeout a slow client holds a connection for
``header_timeout_s`` at most. The operating system's file-descriptor limit is the cap.

The gateway speaks HTTP/1.1 through httptools (the llhttp parser) on a uvloop event loop:
on the 2-core machine of ``docs/benchmarks.md`` they take a blocking call's gateway CPU from
about 10 to 6 ms against uvicorn's pure-Python h11 on asyncio's loop (asyncpg, made by the
same authors for uvloop, gains as much). The protocol class is given explicitly, and uvicorn's
proxy headers are off: the client address the gateway sees (``request.client``, which
``gateway/badtokens.py`` limits) is the TCP peer, never what an ``X-Forwarded-For`` header
claims.
"""

from __future__ import annotations

import asyncio
import enum
from types import FrameType

import msgspec
import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from bulletin_core import wire
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.errors import PROBLEM
from gateway.notify import Hub
from gateway.writes import CoalescedWrites

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


class _Head(enum.Enum):
    """Where a connection is in its next request's head."""

    AWAITED = "awaited"  # between requests (or none yet): no byte of the next one parsed
    ARRIVING = "arriving"  # part of a head came
    DONE = "done"  # the head is whole: its body and answer are never timed


class HeadTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing connections slow to send a request head."""

    #: Seconds a connection has to send a complete request head.
    header_timeout_s = 10.0
    _head_timer: asyncio.TimerHandle | None = None
    _head = _Head.AWAITED

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # An answer's head and body leave in one write (gateway/writes.py).
        super().connection_made(CoalescedWrites(transport, self.loop))  # type: ignore[arg-type]
        self._start_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def eof_received(self) -> None:
        # The loop closes the transport when the client half-closes (uvicorn keeps no half-
        # open connections): what the answer wrote this pass goes out first.
        self.transport.flush()  # type: ignore[attr-defined]
        super().eof_received()

    def data_received(self, data: bytes) -> None:
        if self._head is not _Head.DONE:
            # The first byte of the next request on a kept-alive connection (the parser
            # skips blank lines before a request line: they start the timer too).
            self._time_head()
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head = _Head.ARRIVING
        self._time_head()

    def on_headers_complete(self) -> None:
        self._head = _Head.DONE
        self._stop_head_timer()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        if self._head is _Head.DONE and not self.pipeline:
            self._head = _Head.AWAITED  # the next request's head is timed from its first byte
        super().on_response_complete()
        if self._head is _Head.ARRIVING:
            self._time_head()  # a pipelined head that came while this one was answered

    def _time_head(self) -> None:
        """Start the head timer, unless it runs, or a request is still being answered: a
        pipelined request's head is timed from when its turn comes (as h11 does), never
        while a long-poll before it holds the connection."""
        answering = self.cycle is not None and not self.cycle.response_complete
        if self._head_timer is None and not answering:
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
        if self.transport.is_closing() or self._head is _Head.DONE:
            return
        if self._head is _Head.ARRIVING:
            self.transport.write(REQUEST_TIMEOUT)
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
            loop="uvloop",
            # uvicorn hands it to loop.call_later, which takes any number of seconds.
            timeout_keep_alive=config.idle_timeout_s,  # type: ignore[arg-type]
            proxy_headers=False,
            ssl_certfile=config.tls_cert_file or None,
            ssl_keyfile=config.tls_key_file or None,
        ),
        app,
    )
    server.run()
