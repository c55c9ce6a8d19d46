"""A small keep-alive HTTP/1.1 client for the short exchanges of the hot path.

httpx, which the rest of the project uses (streamed uploads and downloads, the sdk), costs
about 1.7 ms of CPU per request in its async client on the project's 2-core machines and
0.8 ms in its sync one; a request written on an asyncio stream and its answer read back costs
about 0.13 ms (``docs/benchmarks.md``). A nodelet makes several requests per call (poll,
complete, logs), so this client carries its small JSON exchanges with the gateway: one
request at a time per connection, bodies with a ``Content-Length`` (or chunked answers),
connections kept alive and reused, TLS through the standard library.

Failures are :class:`TransportError` (connecting, TLS, a cut or malformed answer) or
:class:`TimedOut`; an answer of any status is returned, never raised. A request that fails on
a reused connection before any byte of its answer arrived is sent once more on a new one: the
gateway closes idle connections (``idle_timeout_s``), and a request that met such a closing
was never read. Connections idle for longer than :data:`MAX_IDLE_S` are not reused at all.

:class:`SyncPool` is the same for threads (the sdk's small JSON exchanges: a blocking call is
one), on blocking sockets: httpx's sync client spent about 0.7 ms of CPU per request where
this spends a few tens of µs (``docs/benchmarks.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import select
import socket
import ssl
import threading
import time
import weakref
from dataclasses import dataclass
from urllib.parse import urlsplit

#: Kept-alive connections idle longer than this are closed rather than reused (below the
#: gateway's default idle timeout of 5 s, so a reuse rarely meets a closing connection).
MAX_IDLE_S = 2.0
#: Most idle connections kept per pool.
MAX_KEPT = 16
#: Longest answer head (status line and headers) accepted.
MAX_HEAD = 64 * 1024


class TransportError(OSError):
    """No answer: the connection could not be made (or secured), or broke, or the answer was
    not HTTP/1.1."""


class TimedOut(TransportError):
    """No answer within the request's timeout."""


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    reason: str
    headers: dict[str, str]  # names in lower case; a repeated header keeps its last value
    body: bytes

    @property
    def is_error(self) -> bool:
        return self.status >= 400

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


@dataclass(slots=True)
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class Pool:
    """Keep-alive connections to one origin (``base_url``: http or https), sending
    ``headers`` with every request. Safe for concurrent use by tasks of one event loop."""

    def __init__(
        self, base_url: str, *, headers: dict[str, str], tls: ssl.SSLContext | None = None
    ) -> None:
        self._host, self._port, self._prefix, self._tls, self.headers = _origin(
            base_url, headers, tls
        )
        self._idle: list[_Connection] = []
        self._closed = False

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        timeout_s: float,
    ) -> Answer:
        """Send one request and read its whole answer, within ``timeout_s`` in all."""
        head = self._head(method, path, body, headers)
        reuse = True
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    conn, reused = await self._connection(reuse)
                    try:
                        answer, keep = await _exchange(conn, head, body, method)
                    except _Unanswered as exc:
                        conn.close()
                        if reused:
                            reuse = False  # once more, on a new connection
                            continue  # an idle connection the gateway was closing
                        raise TransportError(str(exc.__cause__ or exc)) from exc
                    except BaseException:
                        conn.close()  # mid-exchange: the connection cannot be reused
                        raise
                    self._keep(conn) if keep else conn.close()
                    return answer
        except TimeoutError:
            raise TimedOut(f"no answer within {timeout_s:g} s") from None

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _head(self, method: str, path: str, body: bytes, headers: dict[str, str] | None) -> bytes:
        return _request_head(self._prefix, self.headers, method, path, body, headers)

    async def _connection(self, reuse: bool = True) -> tuple[_Connection, bool]:
        now = time.monotonic()
        while reuse and self._idle:
            conn = self._idle.pop()
            if now - conn.idle_since < MAX_IDLE_S and not conn.reader.at_eof():
                return conn, True
            conn.close()
        try:
            reader, writer = await asyncio.open_connection(
                self._host,
                self._port,
                ssl=self._tls,
                server_hostname=self._host if self._tls else None,
                limit=MAX_HEAD,
            )
        except (OSError, ssl.SSLError) as exc:
            raise TransportError(f"cannot connect to {self._host}:{self._port}: {exc}") from exc
        return _Connection(reader, writer), False

    def _keep(self, conn: _Connection) -> None:
        if self._closed or len(self._idle) >= MAX_KEPT:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)


def _origin(
    base_url: str, headers: dict[str, str], tls: ssl.SSLContext | None
) -> tuple[str, int, str, ssl.SSLContext | None, dict[str, str]]:
    """Host, port, path prefix, TLS context (https only) and headers of every request."""
    url = urlsplit(base_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(f"not an http(s) URL: {base_url!r}")
    port = url.port or (443 if url.scheme == "https" else 80)
    context = (tls or ssl.create_default_context()) if url.scheme == "https" else None
    authority = url.netloc.rpartition("@")[2]
    common = {"Host": authority, **headers}
    _check_fields(common)
    return url.hostname, port, url.path.rstrip("/"), context, common


def _check_fields(fields: dict[str, str]) -> None:
    """A header that would end its line early (a token with a line break in it) would
    smuggle headers or a request of its own into the connection: refused."""
    for name, value in fields.items():
        if _BREAKS.intersection(name) or _BREAKS.intersection(value):
            raise ValueError(f"header {name!r} has a line break in its name or value")


_BREAKS = frozenset("\r\n\0")


def _request_head(
    prefix: str,
    common: dict[str, str],
    method: str,
    path: str,
    body: bytes,
    headers: dict[str, str] | None,
) -> bytes:
    if _BREAKS.intersection(path) or " " in path:
        raise ValueError(f"request target {path[:80]!r} has a space or a line break in it")
    if headers:
        _check_fields(headers)
    fields = {**common, **headers} if headers else dict(common)
    if body or method in ("POST", "PUT"):
        fields["Content-Length"] = str(len(body))
    lines = [f"{method} {prefix}{path} HTTP/1.1"]
    lines += [f"{name}: {value}" for name, value in fields.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class _Unanswered(Exception):
    """The connection failed before any byte of the answer arrived."""


async def _exchange(
    conn: _Connection, head: bytes, body: bytes, method: str
) -> tuple[Answer, bool]:
    """Write the request, read the answer; whether the connection may be reused."""
    try:
        conn.writer.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            conn.writer.write(body)
        await conn.writer.drain()
        first = await conn.reader.read(1)
    except (OSError, ssl.SSLError) as exc:
        raise _Unanswered() from exc
    if not first:
        raise _Unanswered()
    try:
        raw = first + await conn.reader.readuntil(b"\r\n\r\n")
        status, reason, version, headers = _parse_head(raw)
        while _interim(status):  # 100 Continue, 103 Early Hints (a proxy's): the answer follows
            raw = await conn.reader.readuntil(b"\r\n\r\n")
            status, reason, version, headers = _parse_head(raw)
    except asyncio.LimitOverrunError:
        raise TransportError(f"answer head over {MAX_HEAD} bytes") from None
    except (asyncio.IncompleteReadError, OSError, ssl.SSLError) as exc:
        raise TransportError(f"the answer was cut short: {exc}") from exc
    length, keep = _framing(method, status, version, headers)
    try:
        if length == _CHUNKED:
            data = await _chunked(conn.reader)
        elif length is None:
            data = await conn.reader.read()
        else:
            data = await conn.reader.readexactly(length)
    except (asyncio.IncompleteReadError, OSError, ssl.SSLError) as exc:
        raise TransportError(f"the answer's body was cut short: {exc}") from exc
    return Answer(status, reason, headers, data), keep


#: ``_framing``'s length of a chunked body.
_CHUNKED = -1


def _framing(
    method: str, status: int, version: str, headers: dict[str, str]
) -> tuple[int | None, bool]:
    """How an answer's body is delimited (for both pools): its length (0: it has none),
    ``_CHUNKED``, or None (it ends with the connection); and whether the connection may be
    reused after it."""
    keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
    if method == "HEAD" or status in (101, 204, 304):
        return 0, keep
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return _CHUNKED, keep
    if (length := headers.get("content-length")) is not None:
        if not (length.isascii() and length.isdigit()):
            raise TransportError(f"bad Content-Length {length!r}")
        return int(length), keep
    return None, False


def _interim(status: int) -> bool:
    """A 1xx answer other than 101: another head, the answer's own, follows it."""
    return 100 <= status < 200 and status != 101


_HEX = frozenset("0123456789abcdefABCDEF")


def _chunk_size(line: bytes) -> int:
    text = line.split(b";", 1)[0].strip().decode("latin-1")
    if not text or not _HEX.issuperset(text):
        raise TransportError(f"bad chunk size {text[:20]!r}")
    return int(text, 16)


def _parse_head(raw: bytes) -> tuple[int, str, str, dict[str, str]]:
    lines = raw.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code, _, reason = rest.partition(" ")
    if not version.startswith("HTTP/1.") or not (code.isdigit() and len(code) == 3):
        raise TransportError(f"not an HTTP/1.1 answer: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, sep, value = line.partition(":")
            if not sep:
                raise TransportError(f"malformed header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
    return int(code), reason, version, headers


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = _chunk_size(size_line)
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                pass
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        if await reader.readexactly(2) != b"\r\n":
            raise TransportError("a chunk does not end where its size says")


# ------------------------------------------------------------------ blocking, for threads


@dataclass(slots=True)
class _SyncConnection:
    sock: socket.socket
    reader: io.BufferedReader[socket.SocketIO]
    idle_since: float = 0.0

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.reader.close()
        with contextlib.suppress(Exception):
            self.sock.close()

    def still_open(self) -> bool:
        """Idle and nothing to read: a readable idle connection was closed by the gateway
        (or sent something unasked for), and is not reused."""
        if not hasattr(select, "poll"):  # Windows
            return not select.select([self.sock], [], [], 0)[0]
        poll = select.poll()
        poll.register(self.sock, select.POLLIN)
        return not poll.poll(0)


class SyncPool:
    """:class:`Pool` for threads: blocking sockets, one request at a time per connection,
    the idle ones shared under a lock. A forked child starts with none of its parent's."""

    def __init__(
        self, base_url: str, *, headers: dict[str, str], tls: ssl.SSLContext | None = None
    ) -> None:
        self._host, self._port, self._prefix, self._tls, self.headers = _origin(
            base_url, headers, tls
        )
        self._idle: list[_SyncConnection] = []
        self._lock = threading.Lock()
        self._closed = False
        _sync_pools.add(self)

    def _forget_after_fork(self) -> None:
        """In a forked child: the parent's connections stay the parent's (two processes on
        one connection would read each other's answers), and a lock another thread of the
        parent held would stay held for ever."""
        self._lock = threading.Lock()
        self._idle = []

    def request(
        self,
        method: str,
        path: str,
        *,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        timeout_s: float,
    ) -> Answer:
        """Send one request and read its whole answer; ``timeout_s`` bounds the connecting
        and each wait for the gateway (as httpx's timeout does)."""
        head = _request_head(self._prefix, self.headers, method, path, body, headers)
        reuse = True
        while True:
            conn, reused = self._connection(timeout_s, reuse)
            try:
                answer, keep = _exchange_sync(conn, head, body, method, timeout_s)
            except _Unanswered as exc:
                conn.close()
                if reused:
                    reuse = False  # once more, on a new connection
                    continue  # an idle connection the gateway was closing
                raise TransportError(str(exc.__cause__ or exc)) from exc
            except BaseException:
                conn.close()  # mid-exchange: the connection cannot be reused
                raise
            self._keep(conn) if keep else conn.close()
            return answer

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _connection(self, timeout_s: float, reuse: bool) -> tuple[_SyncConnection, bool]:
        now = time.monotonic()
        while reuse:
            with self._lock:
                if not self._idle:
                    break
                conn = self._idle.pop()
            if now - conn.idle_since < MAX_IDLE_S and conn.still_open():
                return conn, True
            conn.close()
        try:
            sock = socket.create_connection((self._host, self._port), timeout=timeout_s)
        except TimeoutError:
            message = f"cannot connect to {self._host}:{self._port} within {timeout_s:g} s"
            raise TimedOut(message) from None
        except OSError as exc:
            raise TransportError(f"cannot connect to {self._host}:{self._port}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self._host)
        except (OSError, ssl.SSLError) as exc:
            sock.close()
            raise TransportError(f"cannot connect to {self._host}:{self._port}: {exc}") from exc
        reader = io.BufferedReader(socket.SocketIO(sock, "rb"), buffer_size=MAX_HEAD)
        return _SyncConnection(sock, reader), False

    def _keep(self, conn: _SyncConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < MAX_KEPT:
                conn.idle_since = time.monotonic()
                self._idle.append(conn)
                return
        conn.close()


_sync_pools: weakref.WeakSet[SyncPool] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for pool in list(_sync_pools):
        pool._forget_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _exchange_sync(
    conn: _SyncConnection, head: bytes, body: bytes, method: str, timeout_s: float
) -> tuple[Answer, bool]:
    """Write the request in one piece (up to 64 KiB of body), read the answer; whether the
    connection may be reused."""
    conn.sock.settimeout(timeout_s)
    try:
        conn.sock.sendall(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            conn.sock.sendall(body)
        first = conn.reader.read(1)
    except TimeoutError:
        raise TimedOut(f"no answer within {timeout_s:g} s") from None
    except (OSError, ssl.SSLError) as exc:
        raise _Unanswered() from exc
    if not first:
        raise _Unanswered()
    try:
        status, reason, version, headers = _parse_head(first + _read_head(conn.reader))
        while _interim(status):  # 100 Continue, 103 Early Hints (a proxy's): the answer follows
            status, reason, version, headers = _parse_head(_read_head(conn.reader))
        length, keep = _framing(method, status, version, headers)
        if length == _CHUNKED:
            data = _chunked_sync(conn.reader)
        elif length is None:
            data = conn.reader.read()
        else:
            data = _exactly(conn.reader, length)
    except TimeoutError:
        raise TimedOut(f"no whole answer within {timeout_s:g} s") from None
    except TransportError:
        raise
    except (OSError, ssl.SSLError) as exc:
        raise TransportError(f"the answer was cut short: {exc}") from exc
    return Answer(status, reason, headers, data), keep


def _read_head(reader: io.BufferedReader[socket.SocketIO]) -> bytes:
    """The rest of an answer's head, up to and with its blank line."""
    lines: list[bytes] = []
    size = 0
    while True:
        line = reader.readline(MAX_HEAD - size + 1)
        size += len(line)
        if size > MAX_HEAD:
            raise TransportError(f"answer head over {MAX_HEAD} bytes")
        if not line.endswith(b"\n"):
            raise TransportError("the answer was cut short in its head")
        lines.append(line)
        if line == b"\r\n":
            return b"".join(lines)


def _exactly(reader: io.BufferedReader[socket.SocketIO], size: int) -> bytes:
    data = reader.read(size)
    if len(data) != size:
        raise TransportError(f"the answer's body was cut short ({len(data)} of {size} bytes)")
    return data


def _chunked_sync(reader: io.BufferedReader[socket.SocketIO]) -> bytes:
    parts: list[bytes] = []
    while True:
        size_line = reader.readline(1024)
        if not size_line.endswith(b"\n"):
            raise TransportError("the answer was cut short in a chunk's size")
        size = _chunk_size(size_line)
        if size == 0:
            while (line := reader.readline(MAX_HEAD)) != b"\r\n":  # trailers
                if not line.endswith(b"\n"):
                    raise TransportError("the answer was cut short in its trailers")
            return b"".join(parts)
        parts.append(_exactly(reader, size))
        if _exactly(reader, 2) != b"\r\n":
            raise TransportError("a chunk does not end where its size says")
