"""Bearer tokens. Only their SHA-256 is stored; user and node tokens are different kinds and
each works only on its own routes. Every token that cannot be used (missing, malformed,
unknown, expired or revoked) gets the same 401, so an answer tells nothing about which; the
token itself is never logged. Requests with a user token are rate limited per user
(``gateway/ratelimit.py``); failed authentications per client address, answered without a
database lookup once over the limit (``gateway/badtokens.py``).

A token found valid is kept for ``token_cache_s`` (:class:`TokenCache`), so the requests of
a busy client or node do not each read the tokens table; every change to what a token grants
(a revocation, a node removed or started again, a user's group or admin flag) notifies every
gateway (``db.TOKENS_CHANGED``), which drops what it keeps at once. A lost notification costs
at most ``token_cache_s`` of staleness."""

from __future__ import annotations

import hashlib
import re
import secrets
import time

from starlette.requests import Request

from bulletin_core import wire
from gateway import badtokens, db, ratelimit
from gateway.errors import Conflict, Forbidden, Unauthorized, Unprocessable
from gateway.notify import Hub

USER_PREFIX = "bu_"
NODE_PREFIX = "bn_"


#: What a token looks like: its kind's prefix and 43 URL-safe base64 characters (32 bytes).
TOKEN_PATTERN = re.compile(r"b[un]_[A-Za-z0-9_-]{43}")
#: How many characters of a token a listing shows to recognise it by.
HINT_CHARS = 9
UNAUTHORIZED = (
    "missing, malformed, unknown, expired or revoked token: send 'Authorization: Bearer "
    "<token>' with a valid token (an admin makes one with 'bulletin token create')"
)


#: Most lookups one gateway keeps (valid tokens only; beyond it, the oldest go).
CACHE_ENTRIES = 10_000


class TokenCache:
    """Valid tokens' lookups by digest, each for ``ttl_s`` (0: none kept)."""

    def __init__(self, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        self._found: dict[bytes, tuple[float, db.Principal]] = {}

    def get(self, digest: bytes) -> db.Principal | None:
        entry = self._found.get(digest)
        if entry is None:
            return None
        if entry[0] <= time.monotonic():
            del self._found[digest]
            return None
        return entry[1]

    def put(self, digest: bytes, found: db.Principal) -> None:
        if self._ttl_s <= 0:
            return
        if len(self._found) >= CACHE_ENTRIES:
            del self._found[next(iter(self._found))]
        self._found[digest] = (time.monotonic() + self._ttl_s, found)

    def clear(self) -> None:
        self._found.clear()

    async def follow(self, hub: Hub) -> None:
        """Drop every lookup whenever tokens change anywhere (or the listener reconnected,
        when anything may have); runs until cancelled."""
        async with hub.subscribe([db.TOKENS_CHANGED], stoppable=False) as sub:
            while True:
                await sub.wait(3600.0)
                self.clear()


def new_token(kind: str) -> str:
    prefix = USER_PREFIX if kind == "user" else NODE_PREFIX
    return prefix + secrets.token_urlsafe(32)


def hint(token: str) -> str:
    """The start of a token, shown in listings to recognise it."""
    return token[:HINT_CHARS] + "…"


def token_hash(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _digest(request: Request) -> bytes | None:
    """The hash of the request's bearer token; None when it has none of the right form."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not TOKEN_PATTERN.fullmatch(token):
        return None
    return token_hash(token)


async def principal(request: Request, kind: str, *, fresh: bool = False) -> db.Principal:
    """The caller, who must hold a token of ``kind`` ("user" or "node"). A user's requests
    count against their rate limit (429 over it); a node's do not. Failures count against
    the client address's failure budget (429 over it, for tokens not known good).
    ``fresh``: read the token from the database even if this gateway keeps its lookup."""
    bad = badtokens.guard(request)
    digest = _digest(request)
    address = badtokens.address(request, kind)
    charged = await badtokens.charge(request, bad, digest, address)
    if digest is None or bad.is_unknown(digest):
        raise Unauthorized(UNAUTHORIZED, code="unauthorized")
    cache: TokenCache = request.app.state.tokens
    found = None if fresh else cache.get(digest)
    if found is None:
        try:
            found = await db.lookup_token(request.app.state.pool, digest)
        except BaseException:
            bad.unjudged(address, charged=charged)  # the database failed (503), not the token
            raise
        if found is not None:
            cache.put(digest, found)
    if found is None:
        bad.failed(address, digest, charged=charged)
        raise Unauthorized(UNAUTHORIZED, code="unauthorized")
    bad.worked(address, digest, charged=charged)
    if found.kind != kind:
        raise Forbidden(f"a {found.kind} token cannot be used on {kind} routes", code="wrong_token")
    if found.user_id is not None:
        ratelimit.check(request, found.user_id)
    return found


async def user_id(request: Request) -> int:
    found = await principal(request, "user")
    assert found.user_id is not None
    return found.user_id


async def node_id(request: Request) -> int:
    """The caller's node, whose current incarnation the request must name (see :func:`node`)."""
    found = await node(request)
    assert found.node_id is not None
    return found.node_id


async def node(request: Request) -> db.Principal:
    """The caller, a node whose current incarnation the request must name (409 otherwise:
    an earlier start of the nodelet is still running, and must stop). A request that waits
    (a long-poll) must check it again where it acts: a new start may register meanwhile."""
    found = await principal(request, "node")
    assert found.node_id is not None
    named = request.headers.get(wire.INCARNATION_HEADER)
    if named is not None and named != str(found.incarnation):
        # A kept lookup may predate the registration this nodelet made (on another replica).
        found = await principal(request, "node", fresh=True)
    if named is None:
        raise Unprocessable(
            f"send the {wire.INCARNATION_HEADER} header that registration answered: this "
            f"gateway needs nodelet protocol {wire.MIN_PROTOCOL_VERSION} or newer; upgrade "
            "the nodelet",
            code="incarnation_missing",
        )
    if named != str(found.incarnation):
        raise Conflict(
            f"node {found.name!r} was registered again (incarnation {found.incarnation}) "
            f"since this nodelet registered (incarnation {named}): another start "
            "of it replaced this one, which must stop; what it held was taken back",
            code="superseded",
        )
    return found


async def admin(request: Request) -> db.Principal:
    """The caller, who must hold an administrator's user token."""
    found = await principal(request, "user")
    if not found.is_admin:
        raise Forbidden(
            f"user {found.name!r} is not an administrator (bulletin user add NAME --admin)",
            code="not_admin",
        )
    return found
