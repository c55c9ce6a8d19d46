"""The read end of a worker's outcome pipe (:mod:`nodelet.worker_main` writes, for each call,
a 4-byte big-endian length, then a msgpack :class:`~bulletin_core.wire.WorkerOutcome`).

The worker runs the call's code, which may write anything on the pipe: what it writes as
an outcome of its own call is that call's outcome, as a value it returned would be (the
nodelet checks what an outcome names, whoever wrote it: ``nodelet.attempt``). An outcome
tagged with another call's id (the leftover of a call that wrote one of its own as well) is
skipped, so a later call never takes an earlier one's result; what is not an outcome, or
one over the size limit, is refused unread, and the worker is not used again.
"""

from __future__ import annotations

import asyncio
import os

import msgspec

from bulletin_core import wire
from nodelet.errors import UntrustedOutcome

_outcome_decoder = msgspec.msgpack.Decoder(wire.WorkerOutcome)
#: Outcomes of other calls skipped before the pipe counts as misused.
_MAX_SKIPPED = 16


class Outcomes:
    """The read end of a worker's outcome pipe (:mod:`nodelet.worker_main`: a 4-byte
    big-endian length, then a msgpack WorkerOutcome, for each call)."""

    def __init__(self, reader: asyncio.StreamReader, transport: asyncio.ReadTransport) -> None:
        self._reader = reader
        self._transport = transport

    @classmethod
    async def open(cls, fd: int) -> Outcomes:
        """Read the pipe ``fd`` (taken over: closed with this) on the running loop."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=2**16, loop=loop)
        pipe = os.fdopen(fd, "rb", buffering=0)
        try:
            transport, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader, loop=loop), pipe
            )
        except BaseException:
            pipe.close()
            raise
        return cls(reader, transport)

    async def read(self, invocation_id: str, max_bytes: int) -> wire.WorkerOutcome | None:
        """See :meth:`Worker.read_outcome`."""
        for _ in range(_MAX_SKIPPED + 1):
            try:
                size = int.from_bytes(await self._reader.readexactly(4), "big")
                if size > max_bytes:
                    raise UntrustedOutcome(
                        f"an outcome of {size} bytes, over the limit of {max_bytes}: refused "
                        "unread (the call's code wrote it, not the worker)"
                    )
                body = await self._reader.readexactly(size)
            except asyncio.IncompleteReadError:
                return None
            try:
                outcome = _outcome_decoder.decode(body)
            except msgspec.DecodeError as exc:
                message = f"not an outcome ({exc}): the call's code wrote it"
                raise UntrustedOutcome(message) from None
            if outcome.invocation_id == invocation_id:
                return outcome
        raise UntrustedOutcome(
            f"more than {_MAX_SKIPPED} outcomes of other calls: the call's code wrote them"
        )

    def close(self) -> None:
        self._transport.close()
