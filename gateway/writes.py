"""A connection's writes of one event-loop pass, sent as one.

uvicorn writes a response's head and its body with one ``transport.write`` each, and the
event loop sends each at once: two packets, and the client's process woken twice, for every
answer of a few hundred bytes (a blocking call takes three such answers: the caller's, the
node's poll and its completion). ``CoalescedWrites`` holds what is written until the writer
yields to the loop and sends it then in one write. What it holds is bounded
(``HOLD_BYTES``): a bigger write, or one that would pass the bound, sends at once, so a
streamed answer is never held back nor kept in memory beyond that.
"""

from __future__ import annotations

import asyncio
from typing import Any

#: At most this many bytes wait for the end of the loop's pass.
HOLD_BYTES = 64 * 1024


class CoalescedWrites:
    """A transport whose writes wait for the end of the event loop's current pass (see the
    module docstring); everything else is the wrapped transport's."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []
        self._held_bytes = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if self._held_bytes + len(data) > HOLD_BYTES:
            self.flush()
            self._transport.write(data)
            return
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(bytes(data))
        self._held_bytes += len(data)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        """Send what is held now."""
        if self._held:
            held, self._held, self._held_bytes = self._held, [], 0
            if not self._transport.is_closing():
                self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def get_write_buffer_size(self) -> int:
        return self._held_bytes + self._transport.get_write_buffer_size()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()  # a transport sends what it has before it closes
        self._transport.close()

    def abort(self) -> None:
        self._held, self._held_bytes = [], 0
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
