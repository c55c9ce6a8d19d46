"""The sdk sends a request's head and body in one write (sdk/_transport.py): nothing leaves
before the request is whole, nothing is lost or reordered, and a big body is not held."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpcore
import pytest

from sdk._client import Client
from sdk._transport import HOLD_BYTES, OneWriteStream, OneWriteTransport


@pytest.fixture
def connected() -> Iterator[tuple[OneWriteStream, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        stream = OneWriteStream(httpcore.SyncBackend().connect_tcp("127.0.0.1", port))
        peer, _ = listener.accept()
    peer.setblocking(False)
    yield stream, peer
    stream.close()
    peer.close()


def _arrived(peer: socket.socket, size: int) -> bytes:
    got = b""
    deadline = time.monotonic() + 5
    while len(got) < size and time.monotonic() < deadline:
        try:
            got += peer.recv(1 << 20)
        except BlockingIOError:
            time.sleep(0.001)
    return got


HEAD = b"POST /v1/invocations HTTP/1.1\r\nhost: gw\r\ncontent-length: 4\r\n\r\n"
ANSWER = b"HTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n"


def test_the_request_leaves_whole_in_one_write_when_its_answer_is_read(
    connected: tuple[OneWriteStream, socket.socket],
) -> None:
    stream, peer = connected
    stream.write(HEAD)
    stream.write(b"body")
    with pytest.raises(BlockingIOError):
        peer.recv(1024)  # nothing has left yet
    peer.sendall(ANSWER)
    assert stream.read(1024) == ANSWER
    assert peer.recv(1 << 20) == HEAD + b"body"  # one segment: the first recv has it all


def test_a_body_past_the_bound_goes_at_once_after_the_held_head(
    connected: tuple[OneWriteStream, socket.socket],
) -> None:
    stream, peer = connected
    big = b"x" * (HOLD_BYTES + 1)
    stream.write(HEAD)
    stream.write(big)
    assert _arrived(peer, len(HEAD) + len(big)) == HEAD + big  # before any read


def test_the_sdks_client_sends_through_it() -> None:
    """Every sdk request (the end-to-end tests' included) goes through the transport."""
    client = Client("http://127.0.0.1:9", "token")
    try:
        assert isinstance(client._http._transport, OneWriteTransport)
    finally:
        client.close()
