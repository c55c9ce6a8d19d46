"""Splitting a warm worker's output at a call's end marker, wherever the reads cut it."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bulletin_core import wire
from nodelet.logs import LogShipper

MARKER = b"\x00\x00bulletin-end-0123\x00"


async def pump(pieces: list[bytes], marker: bytes) -> tuple[bool, bytes, bytes]:
    reader = asyncio.StreamReader()
    for piece in pieces:
        reader.feed_data(piece)
    reader.feed_eof()
    shipper = LogShipper(
        None,
        wire.Attempt(invocation_id="x", epoch=1),  # type: ignore[arg-type]
        flush_s=1,
        on_stale=lambda: None,
    )
    seen = await shipper.pump(reader, wire.Stream.STDOUT, marker)
    sent = b"".join(c.data for c in shipper._pending)
    return seen, sent, await reader.read()


@given(st.binary(max_size=300), st.binary(max_size=50), st.lists(st.integers(1, 40), max_size=8))
def test_output_before_the_marker_is_kept_whole_and_what_follows_is_left(
    before: bytes, after: bytes, cuts: list[int]
) -> None:
    data = before + MARKER + after
    if MARKER in before + MARKER[:-1]:
        return  # the user's own bytes cannot contain a random marker
    pieces, rest = [], data
    for cut in cuts:
        pieces.append(rest[:cut])
        rest = rest[cut:]
    pieces.append(rest)
    seen, sent, _ = asyncio.run(pump([p for p in pieces if p], MARKER))
    assert seen and sent == before


def test_without_a_marker_everything_up_to_eof_is_output() -> None:
    seen, sent, _ = asyncio.run(pump([b"abc\x00", b"\x00bul"], MARKER))
    assert not seen and sent == b"abc\x00\x00bul"


@pytest.mark.parametrize("tail", [b"50%\r", b"x\x00"])
def test_live_output_is_not_held_back_unless_it_could_start_the_marker(tail: bytes) -> None:
    async def first_read() -> bytes:
        reader = asyncio.StreamReader()
        reader.feed_data(tail)
        shipper = LogShipper(
            None,
            wire.Attempt(invocation_id="x", epoch=1),  # type: ignore[arg-type]
            flush_s=1,
            on_stale=lambda: None,
        )
        task = asyncio.create_task(shipper.pump(reader, wire.Stream.STDOUT, MARKER))
        await asyncio.sleep(0.01)
        task.cancel()
        return b"".join(c.data for c in shipper._pending)

    shown = asyncio.run(first_read())
    assert shown == (tail if tail == b"50%\r" else b"x")
