"""Per-user rate limit: a token bucket per user, in memory, per gateway replica.

Each user's bucket holds up to ``rate_limit_burst`` tokens and refills at
``rate_limit_per_s`` tokens a second; a request takes one, and a request that finds less
than one gets 429 with ``Retry-After`` (whole seconds until a token is back, at least 1).
Only requests with a user token are limited (see ``auth.principal``): not node tokens, not
``/healthz``.

The buckets live in this process only: behind a load balancer each replica limits on its
own (a user may get up to N times the rate from N replicas), and a restart forgets them,
which is harmless (every bucket starts full anyway).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Hashable

from starlette.requests import Request

from gateway.errors import TooManyRequests

#: Buckets kept before the full ones (idle users) are dropped; full buckets carry no state.
MAX_BUCKETS = 10_000


class RateLimiter:
    """Token buckets by key. Not thread-safe: the gateway's event loop is its only user."""

    def __init__(
        self, rate_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        # key -> (tokens left, when they were counted)
        self._buckets: dict[Hashable, tuple[float, float]] = {}
        self._scanned = -math.inf  # when _forget_full last looked for full buckets

    @property
    def enabled(self) -> bool:
        return self.rate_per_s > 0

    def take(self, key: Hashable) -> float:
        """Take a token from ``key``'s bucket: 0 when there was one, else the seconds until
        there will be one (nothing is taken then)."""
        if not self.enabled:
            return 0.0
        now = self._clock()
        tokens = self._tokens(key, now)
        if tokens >= 1.0:
            if len(self._buckets) >= MAX_BUCKETS and key not in self._buckets:
                self._forget_full(now)
            self._buckets[key] = (tokens - 1.0, now)
            return 0.0
        self._buckets[key] = (tokens, now)
        return (1.0 - tokens) / self.rate_per_s

    def refund(self, key: Hashable) -> None:
        """Give back a token taken from ``key``'s bucket (up to the bucket's size)."""
        if self.enabled and key in self._buckets:
            now = self._clock()
            self._buckets[key] = (min(float(self.burst), self._tokens(key, now) + 1.0), now)

    def _tokens(self, key: Hashable, now: float) -> float:
        tokens, then = self._buckets.get(key, (float(self.burst), now))
        return min(float(self.burst), tokens + (now - then) * self.rate_per_s)

    def _forget_full(self, now: float) -> None:
        """Drop the buckets that have refilled: they are the same as no bucket. The scan runs
        at most once a second; and past twice MAX_BUCKETS (many keys, such as the client
        addresses of ``gateway/badtokens.py``) the oldest MAX_BUCKETS go, full or not (a
        dropped key starts full again, as after a restart), so the table stays bounded."""
        if now - self._scanned >= 1.0:
            self._scanned = now
            full = [
                key
                for key, (tokens, then) in self._buckets.items()
                if tokens + (now - then) * self.rate_per_s >= self.burst
            ]
            for key in full:
                del self._buckets[key]
        if len(self._buckets) >= 2 * MAX_BUCKETS:
            for key in list(itertools.islice(self._buckets, MAX_BUCKETS)):
                del self._buckets[key]


def limiter(request: Request) -> RateLimiter:
    """The app's limiter, made from its config on first use."""
    state = request.app.state
    found: RateLimiter | None = getattr(state, "rate_limiter", None)
    if found is None:
        config = state.config
        found = state.rate_limiter = RateLimiter(config.rate_limit_per_s, config.rate_limit_burst)
    return found


def check(request: Request, user_id: int) -> None:
    """Count a request of ``user_id``; 429 (``TooManyRequests``) when over the limit."""
    limits = limiter(request)
    wait = limits.take(user_id)
    if wait > 0:
        retry_after = max(1, math.ceil(wait))
        raise TooManyRequests(
            f"too many requests: this gateway allows each user {limits.rate_per_s:g} requests "
            f"a second (bursts of {limits.burst}); retry after {retry_after} s",
            retry_after=retry_after,
        )
