"""The read end of a worker's outcome pipe (nodelet/outcomes.py), fed through a real pipe
with what a worker, or the code of the call it runs, may write there."""

from __future__ import annotations

import asyncio
import os

import msgspec
import pytest

from bulletin_core import wire
from nodelet.errors import UntrustedOutcome
from nodelet.outcomes import _MAX_SKIPPED, Outcomes
from nodelet.worker_main import outcome_frame


def framed(invocation_id: str, **fields: object) -> bytes:
    task = wire.WorkerTask(invocation_id=invocation_id)
    return outcome_frame(task, wire.WorkerOutcome(ok=True, **fields))  # type: ignore[arg-type]


def read_all(written: bytes, *ids: str, max_bytes: int = 1 << 20) -> list[object]:
    """What each read of ``ids`` in turn gives (an outcome, None, or the error raised)."""

    async def main() -> list[object]:
        read, write = os.pipe()
        outcomes = await Outcomes.open(read)

        def writer() -> None:  # as the worker does, blocking while the pipe is full
            with os.fdopen(write, "wb") as pipe:
                pipe.write(written)

        writing = asyncio.create_task(asyncio.to_thread(writer))
        found: list[object] = []
        for invocation_id in ids:
            try:
                found.append(await outcomes.read(invocation_id, max_bytes))
            except UntrustedOutcome as exc:
                found.append(exc)
        outcomes.close()
        await writing
        return found

    return asyncio.run(main())


def test_each_call_gets_its_own_outcome_and_a_leftover_of_another_is_skipped() -> None:
    # Call a's code wrote an outcome of its own before the worker wrote the real one: the
    # first is a's (its code decides what it returns), and the real one, left in the pipe,
    # never becomes b's.
    forged, real, b = framed("a", result=b"mine"), framed("a", result=b"real"), framed("b")
    first, second, end = read_all(forged + real + b, "a", "b", "c")
    assert isinstance(first, wire.WorkerOutcome) and first.result == b"mine"
    assert isinstance(second, wire.WorkerOutcome) and second.invocation_id == "b"
    assert end is None  # the worker is gone: no outcome


def test_an_outcome_over_the_limit_is_refused_unread_and_garbage_is_not_an_outcome() -> None:
    [huge] = read_all((0xFFFFFFF0).to_bytes(4, "big"), "a")
    assert isinstance(huge, UntrustedOutcome) and "over the limit" in str(huge)
    [garbage] = read_all((3).to_bytes(4, "big") + b"\xc1\xc1\xc1", "a")
    assert isinstance(garbage, UntrustedOutcome) and "not an outcome" in str(garbage)
    [cut] = read_all((100).to_bytes(4, "big") + b"x" * 10, "a")
    assert cut is None  # the pipe ended inside it: none


def test_a_flood_of_other_calls_outcomes_is_refused() -> None:
    flood = framed("other") * (_MAX_SKIPPED + 1) + framed("a")
    [found] = read_all(flood, "a")
    assert isinstance(found, UntrustedOutcome) and "other calls" in str(found)


@pytest.mark.parametrize("size", [10, 1 << 20])
def test_outcomes_small_and_big_come_whole(size: int) -> None:
    [found] = read_all(framed("a", result=b"r" * size), "a", max_bytes=2 << 20)
    assert isinstance(found, wire.WorkerOutcome) and found.result == b"r" * size
    assert msgspec.structs.asdict(found)["invocation_id"] == "a"
