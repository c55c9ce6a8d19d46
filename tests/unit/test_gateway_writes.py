"""The gateway's writes of one event-loop pass leave as one (gateway/writes.py): an
answer's head and body reach the client together, and nothing written is lost or
reordered, whether it is held, bigger than the bound, or followed by a close."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from gateway.writes import HOLD_BYTES, CoalescedWrites

# The gateway runs on uvloop; asyncio's own loop keeps the class honest about transports.
RUNNERS = pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
Run = Callable[[Coroutine[Any, Any, None]], None]


async def _pair() -> tuple[CoalescedWrites, socket.socket]:
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
    return CoalescedWrites(transport, loop), theirs  # type: ignore[arg-type]


def _received(peer: socket.socket) -> bytes:
    try:
        return peer.recv(1 << 20)
    except BlockingIOError:
        return b""


@RUNNERS
def test_what_one_pass_writes_arrives_in_one_piece_once_the_writer_yields(run: Run) -> None:
    run(_test_what_one_pass_writes_arrives_in_one_piece_once_the_writer_yields())


async def _test_what_one_pass_writes_arrives_in_one_piece_once_the_writer_yields() -> None:
    writes, peer = await _pair()
    writes.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n")
    writes.write(b"body")
    assert _received(peer) == b""  # held until the writer yields to the loop
    await asyncio.sleep(0)
    await asyncio.sleep(0.01)
    assert _received(peer) == b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nbody"
    writes.close()
    peer.close()


@RUNNERS
def test_a_write_past_the_bound_goes_at_once_after_what_was_held(run: Run) -> None:
    run(_test_a_write_past_the_bound_goes_at_once_after_what_was_held())


async def _test_a_write_past_the_bound_goes_at_once_after_what_was_held() -> None:
    writes, peer = await _pair()
    big = b"x" * (HOLD_BYTES + 1)
    writes.write(b"head")
    writes.write(big)
    await asyncio.sleep(0.01)
    got = b""
    while len(got) < len(big) + 4:
        got += _received(peer)
        await asyncio.sleep(0.001)
    assert got == b"head" + big
    writes.close()
    peer.close()


@RUNNERS
def test_closing_sends_what_is_held_first(run: Run) -> None:
    run(_test_closing_sends_what_is_held_first())


async def _test_closing_sends_what_is_held_first() -> None:
    writes, peer = await _pair()
    writes.write(b"HTTP/1.1 408 Request Timeout\r\n\r\n")
    writes.close()
    await asyncio.sleep(0.01)
    peer.setblocking(True)
    peer.settimeout(5)
    got = b""
    while chunk := peer.recv(1024):
        got += chunk
    assert got == b"HTTP/1.1 408 Request Timeout\r\n\r\n"
    peer.close()


@RUNNERS
def test_an_abort_drops_what_is_held(run: Run) -> None:
    run(_test_an_abort_drops_what_is_held())


async def _test_an_abort_drops_what_is_held() -> None:
    writes, peer = await _pair()
    writes.write(b"never")
    writes.abort()
    await asyncio.sleep(0.01)
    peer.setblocking(True)
    peer.settimeout(5)
    try:
        got = peer.recv(1024)
    except ConnectionResetError:
        got = b""
    assert got == b""  # the end of the stream (or a reset): nothing that was held
    peer.close()
