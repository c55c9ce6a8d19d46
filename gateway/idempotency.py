"""The ``Idempotency-Key`` header of submissions (invariant 4: exactly-once submission).

The first request with a key holds it while it is in flight; its answer (a 2xx) is kept,
and a retry with the same key and the same request gets that answer again, marked
``Idempotent-Replayed: true``, without submitting anything. The same key with a different
request is a 422; a retry while the first is still in flight is a 409 (retry after a
moment). A request that fails lets go of its key, so a corrected retry may reuse it. Keys
are kept as long as invocations (``retention_s``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from gateway import db
from gateway.errors import Conflict, Unprocessable

HEADER = "idempotency-key"
#: What a key may be: printable ASCII without spaces, 1 to 200 characters (a UUID is ideal).
KEY = re.compile(r"[\x21-\x7e]{1,200}")
#: Seconds after which a key still in flight is taken over by a retry of the same request
#: (its gateway died mid-request), on top of the longest ``?wait=``.
ABANDONED_AFTER_S = 60.0


def fingerprint(request: Request, canonical_body: bytes) -> bytes:
    """What makes two requests the same: the route and the decoded body, re-encoded."""
    return hashlib.sha256(request.url.path.encode() + b"\0" + canonical_body).digest()


async def once(
    request: Request,
    owner_id: int,
    request_hash: bytes,
    handle: Callable[[], Awaitable[Response]],
) -> Response:
    """Answer with ``handle()``, at most once per Idempotency-Key (none: every time)."""
    key = request.headers.get(HEADER)
    if key is None:
        return await handle()
    if not KEY.fullmatch(key):
        raise Unprocessable(
            "the Idempotency-Key header must be 1 to 200 printable ASCII characters without "
            "spaces (a UUID is ideal)",
            code="invalid_idempotency_key",
        )
    pool = request.app.state.pool
    abandoned_s = request.app.state.config.max_wait_s + ABANDONED_AFTER_S
    held = await db.claim_key(pool, owner_id, key, request_hash, abandoned_s)
    if held is not None:
        return _replay(held, request_hash)
    try:
        response = await handle()
    except BaseException:
        await db.release_key(pool, owner_id, key)
        raise
    if 200 <= response.status_code < 300:
        location = response.headers.get("location")
        await db.answer_key(
            pool, owner_id, key, response.status_code, bytes(response.body), location
        )
    else:
        await db.release_key(pool, owner_id, key)
    return response


def _replay(held: db.KeyHeld, request_hash: bytes) -> Response:
    if held.request_hash != request_hash:
        raise Unprocessable(
            "this Idempotency-Key was already used with a different request: send a new key "
            "with each new request (reuse a key only to retry the same request)",
            code="idempotency_key_reused",
        )
    if held.status is None:
        raise Conflict(
            "a request with this Idempotency-Key is still in flight: retry in a moment to get "
            "its answer",
            code="idempotency_key_in_flight",
            headers={"Retry-After": "1"},
        )
    headers = {"Idempotent-Replayed": "true"}
    if held.location:
        headers["Location"] = held.location
    return Response(held.body, held.status, headers=headers, media_type="application/json")
