"""Exponential backoff with full jitter: the one retry schedule of every loop that retries.

Each delay is drawn uniformly between 0 and a cap that doubles from ``first_s`` to
``max_s`` (AWS's "full jitter"). Without the draw, every nodelet that lost its gateway
would retry in lockstep and meet the restarted gateway all at once; with it, their retries
spread over the whole window while the expected wait stays half the cap.
"""

from __future__ import annotations

import asyncio
import random
import time


class Backoff:
    """Delays drawn from ``[0, cap]``, the cap doubling from ``first_s`` up to ``max_s``;
    :meth:`reset` after a success. ``rng`` is for tests."""

    def __init__(
        self, first_s: float = 0.1, max_s: float = 2.0, *, rng: random.Random | None = None
    ) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"backoff needs 0 < first_s <= max_s, got {first_s} and {max_s}")
        self.first_s = first_s
        self.max_s = max_s
        self._cap = first_s
        self._random = (rng or random).uniform

    def reset(self) -> None:
        self._cap = self.first_s

    @property
    def cap(self) -> float:
        """The longest the next delay may be."""
        return self._cap

    def next_delay(self) -> float:
        """The delay to wait now; the cap of the one after it is twice as long, up to
        ``max_s``."""
        delay = self._random(0.0, self._cap)
        self._cap = min(self._cap * 2, self.max_s)
        return delay

    async def sleep(self) -> None:
        await asyncio.sleep(self.next_delay())

    def sleep_sync(self, at_least_s: float = 0.0) -> None:
        """Block for the next delay, or ``at_least_s`` if that is longer (a server's
        Retry-After)."""
        time.sleep(max(at_least_s, self.next_delay()))
