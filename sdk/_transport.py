"""httpx's transport, each request sent in one write.

httpx (through httpcore) writes a request's head and its body with one ``send`` each: two
packets, and the gateway's event loop woken twice, for every request of a few hundred
bytes (a blocking call is one such request). Here a connection holds what is written until
the request is sent whole, that is until the answer is first read, and sends it then in one
``send``. What it holds is bounded (``HOLD_BYTES``): a bigger write (a streamed upload's
chunk), or one that would pass the bound, goes at once.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx

#: At most this many bytes wait for the request's end.
HOLD_BYTES = 64 * 1024


class OneWriteTransport(httpx.HTTPTransport):
    """``httpx.HTTPTransport`` (no proxy: httpx mounts those from the environment itself)
    whose connections send a request in one write."""

    def __init__(self, *, verify: ssl.SSLContext | bool) -> None:
        context = httpx.create_ssl_context(verify=verify)
        super().__init__(verify=context)
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=20)
        self._pool = httpcore.ConnectionPool(
            ssl_context=context,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=_OneWriteBackend(httpcore.SyncBackend()),
        )


class _OneWriteBackend(httpcore.NetworkBackend):
    def __init__(self, backend: httpcore.NetworkBackend) -> None:
        self._backend = backend

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        stream = self._backend.connect_tcp(host, port, timeout, local_address, socket_options)
        return OneWriteStream(stream)

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        return OneWriteStream(self._backend.connect_unix_socket(path, timeout, socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


class OneWriteStream(httpcore.NetworkStream):
    """A connection whose writes are held until it is next read (HTTP/1.1 reads an answer
    only once its request is written whole), or until ``HOLD_BYTES`` would be passed."""

    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._timeout: float | None = None

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        if self._held_bytes + len(buffer) > HOLD_BYTES:
            self._flush()
            self._stream.write(buffer, timeout)
            return
        self._held.append(buffer)
        self._held_bytes += len(buffer)
        self._timeout = timeout

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        self._flush()
        return self._stream.read(max_bytes, timeout)

    def _flush(self) -> None:
        if self._held:
            held, self._held, self._held_bytes = self._held, [], 0
            self._stream.write(held[0] if len(held) == 1 else b"".join(held), self._timeout)

    def close(self) -> None:
        self._held, self._held_bytes = [], 0
        self._stream.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        self._flush()
        return OneWriteStream(self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)
