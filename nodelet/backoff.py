"""Exponential backoff for retrying calls to a gateway that is down or restarting."""

from __future__ import annotations

import asyncio


class Backoff:
    """Delays of ``first_s`` doubling up to ``max_s``; :meth:`reset` after a success."""

    def __init__(self, first_s: float = 0.1, max_s: float = 2.0) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self._next = first_s

    def reset(self) -> None:
        self._next = self.first_s

    def next_delay(self) -> float:
        """The delay to wait now; the one after it is twice as long, up to ``max_s``."""
        delay, self._next = self._next, min(self._next * 2, self.max_s)
        return delay

    async def sleep(self) -> None:
        await asyncio.sleep(self.next_delay())
