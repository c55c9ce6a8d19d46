"""bulletin_core.http1, the nodelet's client for short exchanges (``Pool``) and the sdk's
(``SyncPool``), against a real uvicorn on loopback: whole answers of both framings,
kept-alive connections reused, one the server closed while idle replaced without an error,
timeouts and refusals as transport errors, and no connection shared across a fork."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from bulletin_core import http1
from tests.appserver import serving

IDLE_CLOSE_S = 0.3
peers: list[int] = []


async def echo(request: Request) -> Response:
    assert request.client is not None
    peers.append(request.client.port)
    body = await request.body()
    return Response(body + b"|" + request.headers.get("x-test", "").encode(), status_code=201)


async def chunks(request: Request) -> Response:
    async def parts() -> AsyncIterator[bytes]:
        for part in (b"one,", b"two,", b"three"):
            yield part

    return StreamingResponse(parts())


async def slow(request: Request) -> Response:
    await asyncio.sleep(2)
    return Response(b"late")


async def missing(request: Request) -> Response:
    return Response(b'{"detail":"no"}', status_code=404, media_type="application/json")


class Threaded:
    """``SyncPool`` behind ``Pool``'s interface (each request in a thread): the tests below
    hold both to the same behaviour."""

    def __init__(self, base_url: str, *, headers: dict[str, str]) -> None:
        self.pool = http1.SyncPool(base_url, headers=headers)

    async def request(self, *args: Any, **kwargs: Any) -> http1.Answer:
        return await asyncio.to_thread(self.pool.request, *args, **kwargs)

    async def aclose(self) -> None:
        self.pool.close()


POOLS = pytest.mark.parametrize("pool_class", [http1.Pool, Threaded], ids=["async", "sync"])
PoolClass = Any


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    app = Starlette(
        routes=[
            Route("/echo", echo, methods=["POST"]),
            Route("/chunks", chunks),
            Route("/slow", slow),
            Route("/missing", missing),
        ]
    )
    with serving(app, timeout_keep_alive=IDLE_CLOSE_S) as url:
        yield url


@POOLS
def test_answers_are_read_whole_and_connections_are_reused(
    server: str, pool_class: PoolClass
) -> None:
    async def main() -> None:
        pool = pool_class(server, headers={"X-Test": "pool"})
        peers.clear()
        for n in range(5):
            answer = await pool.request("POST", "/echo", body=b"%d" % n, timeout_s=5)
            assert (answer.status, answer.body) == (201, b"%d|pool" % n)
        assert len(set(peers)) == 1, "one kept-alive connection served them all"
        streamed = await pool.request("GET", "/chunks", timeout_s=5)
        assert streamed.headers["transfer-encoding"] == "chunked"
        assert streamed.body == b"one,two,three"
        answer = await pool.request("GET", "/missing", timeout_s=5)
        assert answer.is_error and answer.status == 404 and answer.text == '{"detail":"no"}'
        await pool.aclose()

    asyncio.run(main())


@POOLS
def test_a_connection_the_server_closed_while_idle_is_replaced_unseen(
    server: str, pool_class: PoolClass
) -> None:
    async def main() -> None:
        pool = pool_class(server, headers={})
        peers.clear()
        await pool.request("POST", "/echo", body=b"a", timeout_s=5)
        await asyncio.sleep(IDLE_CLOSE_S * 3)  # uvicorn closes it; the pool would still reuse it
        answer = await pool.request("POST", "/echo", body=b"b", timeout_s=5)
        assert answer.body == b"b|"
        assert len(set(peers)) == 2, "the second went on a new connection"
        await pool.aclose()

    asyncio.run(main())


@POOLS
def test_timeouts_and_refusals_are_transport_errors(server: str, pool_class: PoolClass) -> None:
    async def main() -> None:
        pool = pool_class(server, headers={})
        started = time.monotonic()
        with pytest.raises(http1.TimedOut):
            await pool.request("GET", "/slow", timeout_s=0.3)
        assert time.monotonic() - started < 1.5
        # The timed-out connection is not reused: the next answer is its own.
        assert (await pool.request("POST", "/echo", body=b"c", timeout_s=5)).body == b"c|"
        await pool.aclose()
        free = socket.socket()
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
        free.close()
        refused = pool_class(f"http://127.0.0.1:{port}", headers={})
        with pytest.raises(http1.TransportError, match="cannot connect"):
            await refused.request("GET", "/", timeout_s=5)

    asyncio.run(main())


def test_only_http_urls_are_taken() -> None:
    for pool_class in (http1.Pool, http1.SyncPool):
        with pytest.raises(ValueError, match="not an http"):
            pool_class("ftp://127.0.0.1/", headers={})


def test_a_forked_child_never_uses_its_parents_connection(server: str) -> None:
    """A notebook that forks (multiprocessing) while the sdk holds a kept-alive connection:
    two processes writing on one connection would read each other's answers."""
    pool = http1.SyncPool(server, headers={})
    peers.clear()
    assert pool.request("POST", "/echo", body=b"parent", timeout_s=5).body == b"parent|"
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child's outcome is read through the pipe)
        try:
            answer = pool.request("POST", "/echo", body=b"child", timeout_s=5)
            os.write(write, answer.body)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as got:
        assert got.read() == b"child|"
    os.waitpid(child, 0)
    assert pool.request("POST", "/echo", body=b"again", timeout_s=5).body == b"again|"
    assert len(peers) == 3 and peers[0] == peers[2] != peers[1], peers
    pool.close()


def test_a_header_or_target_with_a_line_break_is_refused_before_anything_is_sent() -> None:
    """A token pasted with its newline, or an id with one, must not smuggle a header or a
    second request into a connection shared with other requests."""
    for pool_class in (http1.Pool, http1.SyncPool):
        with pytest.raises(ValueError, match="line break"):
            pool_class("http://127.0.0.1:9", headers={"Authorization": "Bearer t\r\nX-Admin: 1"})
    pool = http1.SyncPool("http://127.0.0.1:9", headers={})
    with pytest.raises(ValueError, match="line break"):
        pool.request("GET", "/v1/invocations/x\r\nX-Evil: 1", timeout_s=1)
    with pytest.raises(ValueError, match="line break"):
        pool.request("GET", "/v1/x", headers={"X-Test": "a\nb"}, timeout_s=1)


@contextlib.contextmanager
def raw_peer(answers: list[bytes]) -> Iterator[str]:
    """A peer on one connection that answers each request head with the next of
    ``answers``, byte for byte: answers no uvicorn app gives (a proxy's 103, broken
    framing), which both pools must take apart safely."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            with conn:
                for answer in answers:
                    seen = b""
                    while b"\r\n\r\n" not in seen:
                        more = conn.recv(65536)
                        if not more:
                            return
                        seen += more
                    conn.sendall(answer)
                conn.recv(1)  # until the client closes

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        thread.join(5)


def _ask(pool_class: PoolClass, url: str, times: int) -> list[http1.Answer]:
    async def main() -> list[http1.Answer]:
        pool = pool_class(url, headers={})
        try:
            return [await pool.request("GET", "/x", timeout_s=5) for _ in range(times)]
        finally:
            await pool.aclose()

    return asyncio.run(main())


@POOLS
def test_an_interim_answer_is_skipped_and_the_next_request_gets_its_own(
    pool_class: PoolClass,
) -> None:
    """A reverse proxy's 103 Early Hints before the answer: taking it for the answer would
    leave the real one to the next request (another thread's, in the sdk)."""
    early = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
    answers = [
        early + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirst",
        b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecond",
    ]
    with raw_peer(answers) as url:
        got = _ask(pool_class, url, 2)
    assert [(a.status, a.body) for a in got] == [(200, b"first"), (200, b"second")]


@POOLS
@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n",  # a latin-1 digit
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcXX0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\nabc\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x3\r\nabc\r\n0\r\n\r\n",
    ],
    ids=["length", "chunk-end", "chunk-negative", "chunk-prefix"],
)
def test_broken_framing_is_a_transport_error(pool_class: PoolClass, answer: bytes) -> None:
    with raw_peer([answer]) as url, pytest.raises(http1.TransportError):
        _ask(pool_class, url, 1)
