"""Users, node records and the tokens they authenticate with (only tokens' hashes are
stored)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.db._common import TOKENS_CHANGED, Conn, _f, _notify


@dataclass(frozen=True, slots=True)
class Principal:
    kind: str  # "user" or "node"
    user_id: int | None
    node_id: int | None
    name: str
    is_admin: bool = False
    #: A user's group (the quota unit); "" for a node.
    group: str = ""
    #: A node's current incarnation (0 for a user).
    incarnation: int = 0


@dataclass(frozen=True, slots=True)
class TokenRow:
    id: int
    kind: str
    owner: str
    name: str
    hint: str
    created_at: float
    expires_at: float | None
    revoked_at: float | None


@dataclass(frozen=True, slots=True)
class UserRow:
    id: int
    name: str
    group: str
    is_admin: bool


_CREATE_USER = """
INSERT INTO users (name, is_admin, group_name) VALUES ($1, $2, $3)
RETURNING id
"""

_FIND_USER = """
SELECT id FROM users WHERE name = $1
"""

_USERS_NAMED = """
SELECT id, name, group_name, is_admin FROM users WHERE name = ANY($1::text[])
"""

_SET_USER_ADMIN = """
UPDATE users SET is_admin = $2 WHERE name = $1
"""

_CREATE_NODE = """
INSERT INTO nodes (name) VALUES ($1)
-- A removed node comes back in service: it was drained to be removed.
ON CONFLICT (name) DO UPDATE SET removed_at = NULL,
  draining = nodes.draining AND nodes.removed_at IS NULL,
  drain_reason = CASE WHEN nodes.removed_at IS NULL THEN nodes.drain_reason END
RETURNING id
"""

_ADD_TOKEN = """
INSERT INTO tokens (token_hash, kind, user_id, node_id, name, hint, expires_at)
VALUES ($1, $2, $3, $4, $5, $6, clock_timestamp() + make_interval(secs => $7::float8))
RETURNING id
"""

_TOKENS = """
SELECT t.id, t.kind, coalesce(u.name, n.name) AS owner, t.name, t.hint,
  extract(epoch FROM t.created_at) AS created_at,
  extract(epoch FROM t.expires_at) AS expires_at,
  extract(epoch FROM t.revoked_at) AS revoked_at
FROM tokens t
LEFT JOIN users u ON u.id = t.user_id
LEFT JOIN nodes n ON n.id = t.node_id
WHERE $1::text IS NULL OR coalesce(u.name, n.name) = $1
ORDER BY t.id DESC
"""

_REVOKE_TOKEN = """
UPDATE tokens SET revoked_at = clock_timestamp()
WHERE id = $1 AND revoked_at IS NULL
"""

_REVOKE_NODE_TOKENS = """
UPDATE tokens SET revoked_at = clock_timestamp()
WHERE node_id = $1 AND revoked_at IS NULL
"""

_LOOKUP_TOKEN = """
SELECT t.kind, t.user_id, t.node_id, coalesce(u.name, n.name) AS name,
  coalesce(u.is_admin, false) AS is_admin, coalesce(u.group_name, '') AS group_name,
  coalesce(n.incarnation, 0) AS incarnation
FROM tokens t
LEFT JOIN users u ON u.id = t.user_id
LEFT JOIN nodes n ON n.id = t.node_id
WHERE t.token_hash = $1
  AND t.revoked_at IS NULL
  AND (t.expires_at IS NULL OR t.expires_at > clock_timestamp())
  -- Removing a node revokes its tokens; a removed node's token is refused here as well.
  AND (t.node_id IS NULL OR n.removed_at IS NULL)
"""


async def create_user(
    conn: Conn, name: str, *, is_admin: bool = False, group: str = "default"
) -> int:
    row = await conn.fetchrow(_CREATE_USER, name, is_admin, group)
    assert row is not None
    return int(row["id"])


async def find_user(conn: Conn, name: str) -> int | None:
    value = await conn.fetchval(_FIND_USER, name)
    return None if value is None else int(value)


async def find_users(conn: Conn, names: list[str]) -> dict[str, UserRow]:
    """The users of these names that exist, by name."""
    rows = await conn.fetch(_USERS_NAMED, names)
    return {r["name"]: UserRow(r["id"], r["name"], r["group_name"], r["is_admin"]) for r in rows}


async def set_user_admin(conn: Conn, name: str, is_admin: bool) -> bool:
    """Make a user an administrator or not (at once: every request looks it up); False if
    there is no such user."""
    status = await conn.execute(_SET_USER_ADMIN, name, is_admin)
    await _notify(conn, TOKENS_CHANGED)
    return status.endswith(" 1")


async def create_node(conn: Conn, name: str) -> int:
    """Create a node record (before its nodelet first registers) and return its id; a
    removed node of that name is brought back, in service (not draining)."""
    row = await conn.fetchrow(_CREATE_NODE, name)
    assert row is not None
    return int(row["id"])


async def add_token(
    conn: Conn,
    token_hash: bytes,
    *,
    user_id: int | None = None,
    node_id: int | None = None,
    name: str = "",
    hint: str = "",
    expires_s: float | None = None,
) -> int:
    """Store a token's hash; its id. ``expires_s``: seconds it stays valid (None: always)."""
    kind = "user" if user_id is not None else "node"
    value = await conn.fetchval(
        _ADD_TOKEN, token_hash, kind, user_id, node_id, name, hint, expires_s
    )
    return int(value)


async def tokens(conn: Conn, owner: str | None = None) -> list[TokenRow]:
    """Every token (of user or node ``owner`` when given), newest first; never the token."""
    rows = await conn.fetch(_TOKENS, owner)
    return [
        TokenRow(
            r["id"],
            r["kind"],
            r["owner"],
            r["name"],
            r["hint"],
            float(r["created_at"]),
            _f(r["expires_at"]),
            _f(r["revoked_at"]),
        )
        for r in rows
    ]


async def revoke_token(conn: Conn, token_id: int) -> bool:
    """Revoke a token by id (at once: the next request with it gets 401); False if there is
    no such token or it was revoked already."""
    status = await conn.execute(_REVOKE_TOKEN, token_id)
    await _notify(conn, TOKENS_CHANGED)
    return status.endswith(" 1")


async def revoke_node_tokens(conn: Conn, node_id: int) -> int:
    """Revoke every token of a node (at once); how many were still valid."""
    status = await conn.execute(_REVOKE_NODE_TOKENS, node_id)
    await _notify(conn, TOKENS_CHANGED)
    return int(status.split()[-1])


async def lookup_token(conn: Conn, token_hash: bytes) -> Principal | None:
    row = await conn.fetchrow(_LOOKUP_TOKEN, token_hash)
    if row is None:
        return None
    return Principal(
        row["kind"],
        row["user_id"],
        row["node_id"],
        row["name"],
        row["is_admin"],
        row["group_name"],
        row["incarnation"],
    )
