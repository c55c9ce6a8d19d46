"""Log shipping: a worker's stdout/stderr, in order, to the gateway's logs route.

Output is read in chunks as it comes (never split by lines: ``\\r`` progress bars must survive)
and posted by ONE sender per attempt, so chunks keep their order. Each batch names the position
of its first chunk (``first_seq``), which makes a retried post idempotent.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable

from bulletin_core import wire
from bulletin_core.backoff import Backoff
from nodelet.client import GatewayClient
from nodelet.errors import GatewayUnavailable, NodeletError, StaleAttempt

log = logging.getLogger(__name__)

READ_SIZE = 65536
#: Flush at once when this much output is pending, without waiting for the flush interval.
URGENT_BYTES = 256 * 1024
#: Upper bound on one request's chunk bytes (JSON base64 adds a third on top).
MAX_BATCH_BYTES = 1024 * 1024
#: Past this much unsent output, stop reading the pipes: the worker then blocks on its writes
#: instead of the nodelet buffering without bound while the gateway is slow or away.
MAX_PENDING_BYTES = 16 * 1024 * 1024


class LogShipper:
    """Collects one attempt's output and posts it in order through one sender."""

    def __init__(
        self,
        client: GatewayClient,
        attempt: wire.Attempt,
        *,
        flush_s: float,
        on_stale: Callable[[], None],
    ) -> None:
        self._client = client
        self._attempt = attempt
        self._flush_s = flush_s
        self._on_stale = on_stale
        self._pending: collections.deque[wire.NodeLogChunk] = collections.deque()
        self._pending_bytes = 0
        self._sent = 0  # chunks the gateway has accepted: the next batch's first_seq
        self._has_data = asyncio.Event()
        self._urgent = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._closing = False
        self._stopped = False
        self._handed_over = False
        #: The sender gave up (stale, or the gateway refused): nothing is left to hand over.
        self._stopped_early = False
        self.stale: StaleAttempt | None = None
        #: The sender's task (:meth:`send_as_output_comes`), once output started it.
        self._sender: asyncio.Task[None] | None = None
        self._sender_name: str | None = None

    async def pump(
        self, reader: asyncio.StreamReader, stream: wire.Stream, marker: bytes = b""
    ) -> bool:
        """Read ``reader`` until EOF or ``marker`` (the end of one call's output from a worker
        that stays alive), queueing what arrives. True if the marker was seen."""
        held = b""
        while data := await reader.read(READ_SIZE):
            held += data
            if marker and (end := held.find(marker)) >= 0:
                self.add(stream, held[:end])
                return True
            keep = _marker_prefix(held, marker)
            self.add(stream, held[: len(held) - keep])
            held = held[len(held) - keep :]
            await self._room.wait()
        self.add(stream, held)
        return False

    def add(self, stream: wire.Stream, data: bytes) -> None:
        if self._stopped or not data:
            return
        last = self._pending[-1] if self._pending else None
        if last is not None and last.stream == stream and len(last.data) + len(data) <= READ_SIZE:
            # Merge small writes (a progress bar's) so the gateway stores fewer, fuller chunks.
            self._pending[-1] = wire.NodeLogChunk(stream=stream, data=last.data + data)
        else:
            self._pending.append(wire.NodeLogChunk(stream=stream, data=data))
        self._pending_bytes += len(data)
        self._has_data.set()
        if self._sender is None and self._sender_name is not None:
            self._start_sender()
        if self._pending_bytes >= URGENT_BYTES:
            self._urgent.set()
        if self._pending_bytes >= MAX_PENDING_BYTES:
            self._room.clear()

    def send_as_output_comes(self, name: str) -> None:
        """Run the sender (:meth:`run`) in a task named ``name``, started by the first output:
        a call that writes nothing costs no sender. :meth:`sent` waits for it."""
        self._sender_name = name
        if self._pending:
            self._start_sender()

    def _start_sender(self) -> None:
        self._sender = asyncio.get_running_loop().create_task(self.run(), name=self._sender_name)

    async def sent(self) -> None:
        """Once :meth:`close` or :meth:`hand_over` was called: wait until the sender started
        by output, if any was, has returned."""
        if self._sender is not None:
            await self._sender

    def cancel(self) -> None:
        """Stop the sender started by output, if any was."""
        if self._sender is not None:
            self._sender.cancel()

    async def run(self) -> None:
        """The sender: returns once :meth:`close` was called and everything was posted (or,
        after :meth:`hand_over`, everything but what :meth:`rest` then gives)."""
        try:
            while await self._next_round():
                if self._handed_over:
                    break
                batch = self._take()
                if batch:
                    await self._post(batch)
        except StaleAttempt as exc:
            self.stale = exc
            self._stopped_early = True
            self._on_stale()
        except NodeletError as exc:
            # Not the attempt's fault: stop shipping its output but let it finish and complete.
            log.error("dropping the rest of the output of %s: %s", self._describe(), exc)
            self._stopped_early = True
        self._stopped = True
        if not self._handed_over or self._stopped_early:
            self._pending.clear()
        self._room.set()  # the pipes must still be drained, or the worker blocks for ever

    def close(self) -> None:
        """No more output will come: post what is pending, then let :meth:`run` return."""
        self._closing = True
        self._has_data.set()
        self._urgent.set()

    def hand_over(self, most_bytes: int) -> None:
        """No more output will come, and the attempt completes next: unless more than
        ``most_bytes`` is pending, :meth:`run` returns once what is in flight was posted,
        leaving the rest to go with the completion (:meth:`rest`): one request, not two."""
        self._handed_over = self._pending_bytes <= most_bytes
        self.close()

    def rest(self) -> tuple[int, list[wire.NodeLogChunk]]:
        """After :meth:`run` returned: the number of the first chunk not posted, and those
        chunks (none unless handed over)."""
        if self._stopped_early:
            return self._sent, []
        return self._sent, list(self._pending)

    async def _next_round(self) -> bool:
        await self._has_data.wait()
        if not self._urgent.is_set():
            # Linger a little so a burst of small writes goes out as one request.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._urgent.wait(), self._flush_s)
        return bool(self._pending) or not self._closing

    def _take(self) -> list[wire.NodeLogChunk]:
        batch: list[wire.NodeLogChunk] = []
        size = 0
        while self._pending and (not batch or size + len(self._pending[0].data) <= MAX_BATCH_BYTES):
            chunk = self._pending.popleft()
            batch.append(chunk)
            size += len(chunk.data)
        self._pending_bytes -= size
        if not self._pending and not self._closing:
            self._has_data.clear()
        if self._pending_bytes < URGENT_BYTES and not self._closing:
            self._urgent.clear()
        if self._pending_bytes < MAX_PENDING_BYTES:
            self._room.set()
        return batch

    async def _post(self, batch: list[wire.NodeLogChunk]) -> None:
        request = wire.LogsRequest(epoch=self._attempt.epoch, first_seq=self._sent, chunks=batch)
        backoff = Backoff()
        while True:
            try:
                await self._client.logs(self._attempt.invocation_id, request)
                break
            except GatewayUnavailable as exc:
                log.warning("posting logs of %s failed (%s); retrying", self._describe(), exc)
                await backoff.sleep()
        self._sent += len(batch)

    def _describe(self) -> str:
        return f"invocation {self._attempt.invocation_id} epoch {self._attempt.epoch}"


def _marker_prefix(data: bytes, marker: bytes) -> int:
    """Length of the longest tail of ``data`` that could begin ``marker``: held back until
    the next read decides. Plain output never ends in the marker's NUL bytes, so live output
    is not delayed."""
    for size in range(min(len(marker) - 1, len(data)), 0, -1):
        if marker.startswith(data[-size:]):
            return size
    return 0
