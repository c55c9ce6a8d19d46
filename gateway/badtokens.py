"""Cheap refusals of failed authentication: a failure budget per client address and a short
memory of unknown tokens, so that a flood of bad tokens costs the database next to nothing
and does not slow down the users whose tokens work.

``auth.principal`` judges a request's token in this order:

1. **The address's failure budget.** Each client address has a token bucket of
   ``auth_failure_burst`` failures, refilled at ``auth_failure_rate_per_s`` a second
   (``gateway/ratelimit.py``'s RateLimiter). While it is empty, the address's requests get
   429 with ``Retry-After``, with no database lookup, unless their token is *known good*:
   it worked on this replica within ``KNOWN_GOOD_S``. The 429 is held for
   ``auth_failure_delay_s`` first (a tarpit): a refusal costs little, but a flood over N
   connections that got its answers at once would still keep the event loop busy and slow
   everyone's requests (measured: docs/benchmarks.md); held, its connections wait idle, N
   requests a delay. At most ``MAX_HELD`` are held at once, so holding costs bounded memory.
2. **Unknown tokens.** A token the database did not know within ``auth_negative_cache_s``
   gets the usual 401 again without a lookup.
3. Anything else is looked up, as always. Every failure (a missing, malformed, unknown,
   expired or revoked token: one and the same 401) takes one from the address's bucket:
   taken before the lookup and given back when the token works, so that many concurrent
   requests cannot all pass a bucket that has room for one.

Why this cannot let a bad token in: the known-good set authorises nothing. A known-good token
is looked up on every request like any other, so a revoked or expired one is refused at once
(and leaves the set); the set only decides who is still looked up while their address is
over its failure budget, and a token enters it only by working. No successful lookup is
cached. Remembering a token as unknown cannot refuse a good one either: a token becomes valid
only by being made, and a new token is 32 random bytes nobody can have sent before; the
memory is short and bounded to keep it small, not because it goes stale.

Why the users whose tokens work are still served: many clients may share an address (a
JupyterHub, a NAT, a reverse proxy, every test on 127.0.0.1), and the attacker's failures
empty that address's bucket for all of them. A user or node whose token has worked here
recently is looked up regardless, so it is not slowed (and it is not waiting behind lookups:
the attacker's requests no longer reach the database). The cost falls on a client whose token
has not yet worked on this replica and who shares an address with the attacker: until the
flood stops, it competes with the attacker for the refill, one lookup every
1/``auth_failure_rate_per_s`` seconds (its sdk retries the 429s for up to 30 s).

The address is the TCP peer: uvicorn's proxy headers are off (``gateway/server.py``), so no
client can claim another address with ``X-Forwarded-For``. Behind a reverse proxy every
client has the proxy's address and shares one budget: limit failed requests at the proxy,
or turn this off there (``--auth-failure-rate-per-s 0``). IPv6 peers are grouped by their /64
network, which one host usually holds whole. The state is per replica and in memory, like
the per-user rate limit: a restart forgets it, which only refills the budgets.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import math
import time
from collections import OrderedDict
from collections.abc import Callable

from starlette.requests import Request

from gateway.errors import TooManyRequests
from gateway.ratelimit import RateLimiter

#: How long a token that worked stays known good (exempt from its address's failure budget).
KNOWN_GOOD_S = 3600.0
#: Most tokens remembered as known good, and as unknown; the oldest are forgotten first.
MAX_KNOWN_GOOD = 10_000
MAX_UNKNOWN = 10_000
#: Most refused requests held before their 429 at once; more are answered at once.
MAX_HELD = 1000


class BadTokens:
    """The failure budgets, the known-good and the unknown tokens (by SHA-256) of one
    replica. Not thread-safe: the gateway's event loop is its only user."""

    def __init__(
        self,
        rate_per_s: float,
        burst: int,
        unknown_ttl_s: float,
        delay_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failures = RateLimiter(rate_per_s, burst, clock)
        self.unknown_ttl_s = unknown_ttl_s
        self.delay_s = delay_s
        #: Refused requests being held before their answer now.
        self.held = 0
        self._clock = clock
        # digest -> when it last worked / until when it counts as unknown; oldest first.
        self._good: OrderedDict[bytes, float] = OrderedDict()
        self._unknown: OrderedDict[bytes, float] = OrderedDict()

    def charge(self, address: str, digest: bytes | None) -> float | None:
        """Charge a failure to ``address`` in advance for a request whose token (None: none
        usable) is about to be judged, so that concurrent requests cannot all slip past a
        budget with room for one. None: the token is known good, nothing charged; 0: charged;
        more: the budget is empty, so refuse, retrying after that many seconds."""
        if digest is not None and self._known_good(digest):
            return None
        return self.failures.take(address)

    def is_unknown(self, digest: bytes) -> bool:
        """Whether the database did not know this token a moment ago."""
        until = self._unknown.get(digest)
        if until is None:
            return False
        if until > self._clock():
            return True
        del self._unknown[digest]
        return False

    def failed(self, address: str, digest: bytes, *, charged: bool) -> None:
        """The database did not know this token: remember it as unknown, and count the
        failure if it was not ``charged`` in advance (it was known good until now)."""
        if not charged:
            self.failures.take(address)
        self._good.pop(digest, None)
        if self.unknown_ttl_s > 0:
            _put(self._unknown, digest, self._clock() + self.unknown_ttl_s, MAX_UNKNOWN)

    def worked(self, address: str, digest: bytes, *, charged: bool) -> None:
        """The database knew this token: refund the failure ``charged`` for it, and make it
        known good for the next KNOWN_GOOD_S."""
        if charged:
            self.failures.refund(address)
        self._unknown.pop(digest, None)
        _put(self._good, digest, self._clock(), MAX_KNOWN_GOOD)

    def unjudged(self, address: str, *, charged: bool) -> None:
        """The lookup could not be made (the database is away): refund the charge, so that
        an outage does not count as everyone's failures."""
        if charged:
            self.failures.refund(address)

    def _known_good(self, digest: bytes) -> bool:
        since = self._good.get(digest)
        if since is None:
            return False
        if self._clock() - since < KNOWN_GOOD_S:
            return True
        del self._good[digest]
        return False


def _put(table: OrderedDict[bytes, float], key: bytes, value: float, limit: int) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)


@functools.lru_cache(maxsize=4096)
def client_key(host: str | None) -> str:
    """The failure budget's key for a TCP peer: its IPv4 address, or its IPv6 /64 (kept
    for the peers seen last: parsing one costs more than the rest of the check)."""
    if not host:
        return ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host  # not an IP address (a Unix socket's peer)
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def guard(request: Request) -> BadTokens:
    """The app's BadTokens, made from its config on first use."""
    state = request.app.state
    found: BadTokens | None = getattr(state, "bad_tokens", None)
    if found is None:
        config = state.config
        found = state.bad_tokens = BadTokens(
            config.auth_failure_rate_per_s,
            config.auth_failure_burst,
            config.auth_negative_cache_s,
            config.auth_failure_delay_s,
        )
    return found


def address(request: Request, routes: str) -> str:
    """The failure budget a request draws on: its client address's, for the ``routes`` it
    asks ("user" or "node"). Apart, so that users on a node (their calls, a login shell)
    who flood the user routes with bad tokens do not empty the budget of the node's own
    nodelet, which shares their address."""
    return f"{routes}@{client_key(request.client.host if request.client else None)}"


async def charge(request: Request, bad: BadTokens, digest: bytes | None, key: str) -> bool:
    """Charge the budget ``key`` (``address``) a failure in advance (``BadTokens.charge``);
    whether it was charged. 429 (``TooManyRequests``, code ``auth_rate_limited``), after
    holding the request ``delay_s``, when its budget is empty and its token is not known
    good."""
    wait = bad.charge(key, digest)
    if wait is None or wait == 0:
        return wait is not None
    if bad.delay_s > 0 and bad.held < MAX_HELD:
        bad.held += 1
        try:
            await asyncio.sleep(bad.delay_s)
        finally:
            bad.held -= 1
        wait -= bad.delay_s
    retry_after = max(1, math.ceil(wait))
    limits = bad.failures
    raise TooManyRequests(
        f"too many requests with a missing or unusable token from this address (this "
        f"gateway allows {limits.rate_per_s:g} a second, bursts of {limits.burst}): check "
        f"the token (BULLETIN_TOKEN, or client.toml), and retry after {retry_after} s",
        retry_after=retry_after,
        code="auth_rate_limited",
    )
