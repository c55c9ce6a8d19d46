"""Bearer tokens. Only their SHA-256 is stored; user and node tokens are different kinds and
each works only on its own routes."""

from __future__ import annotations

import hashlib
import secrets

from starlette.requests import Request

from gateway import db
from gateway.errors import Forbidden, Unauthorized

USER_PREFIX = "bu_"
NODE_PREFIX = "bn_"


def new_token(kind: str) -> str:
    prefix = USER_PREFIX if kind == "user" else NODE_PREFIX
    return prefix + secrets.token_urlsafe(32)


def token_hash(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized(
            "this route needs 'Authorization: Bearer <token>'; the token is in client.toml",
            code="missing_token",
        )
    return token.strip()


async def principal(request: Request, kind: str) -> db.Principal:
    """The caller, who must hold a token of ``kind`` ("user" or "node")."""
    found = await db.lookup_token(request.app.state.pool, token_hash(_bearer(request)))
    if found is None:
        raise Unauthorized("unknown or revoked token", code="bad_token")
    if found.kind != kind:
        raise Forbidden(f"a {found.kind} token cannot be used on {kind} routes", code="wrong_token")
    return found


async def user_id(request: Request) -> int:
    found = await principal(request, "user")
    assert found.user_id is not None
    return found.user_id


async def node_id(request: Request) -> int:
    found = await principal(request, "node")
    assert found.node_id is not None
    return found.node_id


async def admin(request: Request) -> db.Principal:
    """The caller, who must hold an administrator's user token."""
    found = await principal(request, "user")
    if not found.is_admin:
        raise Forbidden(
            f"user {found.name!r} is not an administrator (bulletin user add NAME --admin)",
            code="not_admin",
        )
    return found
