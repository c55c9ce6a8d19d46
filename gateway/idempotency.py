"""The ``Idempotency-Key`` header of submissions (invariant 4: exactly-once submission).

The key is taken in the very transaction that inserts the request's invocations, with the
hash of the request (route, parameters, body) and their ids, so one key submits once: a
concurrent duplicate waits for that commit and then finds the key taken. A retry with the
same key and request is answered from those invocations as they are now (a replayed
submission gets the same ids; a replayed invoke waits like the first and returns the
invocation's current state), marked ``Idempotent-Replayed: true``. The same key with another
request is a 422. While the first request is still answering (an invoke waiting for its
result), a retry is a 409 with ``Retry-After``; a key whose request never answered (its
gateway died) is replayed after ``max_wait_s`` + ``ABANDONED_AFTER_S``. A request refused
before anything was inserted leaves no key behind. Keys are kept for ``retention_s``.
"""

from __future__ import annotations

import contextlib
import hashlib
import re

import asyncpg
from starlette.requests import Request

from gateway import db
from gateway.errors import Conflict, Unprocessable

HEADER = "idempotency-key"
#: What a key may be: printable ASCII without spaces, 1 to 200 characters (a UUID is ideal).
KEY = re.compile(r"[\x21-\x7e]{1,200}")
#: Seconds after which a key whose request never answered is replayed (on top of the
#: longest ``?wait=``).
ABANDONED_AFTER_S = 60.0
#: Sent with an answer built from an earlier request's invocations.
REPLAYED = {"Idempotent-Replayed": "true"}


def key_of(request: Request) -> str | None:
    """The request's Idempotency-Key, if it has one; 422 if it is malformed."""
    key = request.headers.get(HEADER)
    if key is not None and not KEY.fullmatch(key):
        raise Unprocessable(
            "the Idempotency-Key header must be 1 to 200 printable ASCII characters without "
            "spaces (a UUID is ideal)",
            code="invalid_idempotency_key",
        )
    return key


def fingerprint(request: Request, *parts: bytes) -> bytes:
    """What makes two requests the same: the route and the given parts (the parameters as
    sent and the decoded body, re-encoded)."""
    digest = hashlib.sha256(request.url.path.encode())
    for part in parts:
        digest.update(b"\0%d\0" % len(part) + part)
    return digest.digest()


async def earlier(
    request: Request, owner_id: int, key: str, request_hash: bytes
) -> list[str] | None:
    """The invocations an earlier request with ``key`` made, to answer from; None when there
    was none. 422 if that request was another one; 409 if it is still answering."""
    held = await db.find_key(request.app.state.pool, owner_id, key)
    if held is None:
        return None
    if held.request_hash != request_hash:
        raise Unprocessable(
            "this Idempotency-Key was already used with a different request: send a new key "
            "with each new request (reuse a key only to retry the same request)",
            code="idempotency_key_reused",
        )
    abandoned_s = request.app.state.config.max_wait_s + ABANDONED_AFTER_S
    if not held.answered and held.age_s < abandoned_s:
        raise Conflict(
            "a request with this Idempotency-Key is still in flight: retry in a moment to get "
            "its answer",
            code="idempotency_key_in_flight",
            headers={"Retry-After": "1"},
        )
    return held.invocation_ids


async def answered(request: Request, owner_id: int, key: str) -> None:
    """The request holding ``key`` is answering (or gave up): retries replay from now on. A
    failure here only delays that until the key counts as abandoned."""
    with contextlib.suppress(asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
        await db.answer_key(request.app.state.pool, owner_id, key)
