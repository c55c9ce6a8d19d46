"""Bearer tokens. Only their SHA-256 is stored; user and node tokens are different kinds and
each works only on its own routes. Every token that cannot be used (missing, malformed,
unknown, expired or revoked) gets the same 401, so an answer tells nothing about which; the
token itself is never logged. Requests with a user token are rate limited per user
(``gateway/ratelimit.py``); failed authentications per client address, answered without a
database lookup once over the limit (``gateway/badtokens.py``)."""

from __future__ import annotations

import hashlib
import re
import secrets

from starlette.requests import Request

from bulletin_core import wire
from gateway import badtokens, db, ratelimit
from gateway.errors import Conflict, Forbidden, Unauthorized, Unprocessable

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


async def principal(request: Request, kind: str) -> db.Principal:
    """The caller, who must hold a token of ``kind`` ("user" or "node"). A user's requests
    count against their rate limit (429 over it); a node's do not. Failures count against
    the client address's failure budget (429 over it, for tokens not known good)."""
    bad = badtokens.guard(request)
    digest = _digest(request)
    address = badtokens.address(request, kind)
    charged = await badtokens.charge(request, bad, digest, address)
    if digest is None or bad.is_unknown(digest):
        raise Unauthorized(UNAUTHORIZED, code="unauthorized")
    try:
        found = await db.lookup_token(request.app.state.pool, digest)
    except BaseException:
        bad.unjudged(address, charged=charged)  # the database failed (503), not the token
        raise
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
