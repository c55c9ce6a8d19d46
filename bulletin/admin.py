"""Accounts and tokens, made directly in the database (the admin's side of set-up), nodes'
draining and removal, and the database role the gateway connects as.

The gateway, the migrations and these commands run as a role that owns Bulletin's database
and nothing else: LOGIN, but not a superuser, and unable to create databases or roles
(``ensure_role``). A superuser is needed only to make that role and database, and for
maintenance. Its statements are in ``gateway/db/roles.py``, with all the others.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import hmac
import os
import re
import time
import urllib.parse
from collections.abc import AsyncIterator
from typing import TypeVar

import asyncpg

from bulletin_core import wire
from gateway import auth, db


@contextlib.asynccontextmanager
async def connection(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection of its own, closed afterwards."""
    conn = await asyncpg.connect(database_url)
    try:
        yield conn
    finally:
        await conn.close()


async def migrate(database_url: str) -> list[str]:
    async with connection(database_url) as conn:
        return await db.migrate(conn)


class AdminError(Exception):
    """What an admin command was asked cannot be done; the message says why."""


async def mint_token(
    conn: asyncpg.Connection,
    user_id: int | None = None,
    *,
    node_id: int | None = None,
    name: str = "",
    expires_s: float | None = None,
) -> str:
    """A new token of the user (or, with ``node_id``, of the node); only its hash is stored,
    labelled ``name``, expiring after ``expires_s`` if given."""
    token = auth.new_token("user" if user_id is not None else "node")
    await db.add_token(
        conn,
        auth.token_hash(token),
        user_id=user_id,
        node_id=node_id,
        name=name,
        hint=auth.hint(token),
        expires_s=expires_s,
    )
    return token


async def add_user(
    database_url: str, name: str, *, is_admin: bool = False, group: str | None = None
) -> str:
    """Create the user if new (in ``group``, else 'default'; an existing user is moved to
    ``group`` when given) and return a fresh token for them."""
    if not re.fullmatch(wire.SLUG, name):
        # A user name names a directory of the shared directory, and on nodes with
        # --user-mapping same-name a Unix account: nothing else.
        raise AdminError(f"user name {name!r} is not one: {wire.SLUG_RULE}")
    async with connection(database_url) as conn, conn.transaction():
        if group is not None:
            await require_group(conn, group)
        user_id = await db.find_user(conn, name)
        if user_id is None:
            user_id = await db.create_user(conn, name, is_admin=is_admin, group=group or "default")
        elif group is not None:
            await db.set_user_group(conn, name, group)
        return await mint_token(conn, user_id)


async def add_node(database_url: str, name: str, *, replace: bool = False) -> str:
    """Create the node record if new (or bring back a removed one, in service) and return a
    fresh node token for it; with ``replace``, the node's other tokens are revoked."""
    async with connection(database_url) as conn, conn.transaction():
        node_id = await db.create_node(conn, name)
        if replace:
            await db.revoke_node_tokens(conn, node_id)
        return await mint_token(conn, node_id=node_id)


async def drain(database_url: str, name: str, reason: str | None) -> db.Drain | None:
    """Give node NAME no new work (its running calls finish), with ``reason`` (a node
    already draining keeps its own); how it was before, None if there is none."""
    async with connection(database_url) as conn:
        return await db.set_draining(conn, name, True, reason or None, "drained by an admin")


async def undrain(
    database_url: str, name: str, *, if_reason: str | None = None
) -> db.Drain | None:
    """Let node NAME take work again (with ``if_reason``: only if it drains for exactly that
    reason); how it was before, None if there is none."""
    async with connection(database_url) as conn, conn.transaction():
        locked = await db.lock_node(conn, name)
        if locked is None:
            return None
        _, before = locked
        if if_reason is not None and before.reason != if_reason:
            return before
        return await db.set_draining(conn, name, False)


async def wait_idle(database_url: str, name: str, wait_s: float, poll_s: float = 1.0) -> int:
    """Wait up to ``wait_s`` until node NAME holds no attempt (assigned or running), checking
    every ``poll_s``; how many it still holds (0 also when the node is gone)."""
    deadline = time.monotonic() + wait_s
    async with connection(database_url) as conn:
        while True:
            held = await db.held_attempts(conn, name) or 0
            left = deadline - time.monotonic()
            if held == 0 or left <= 0:
                return held
            await asyncio.sleep(min(poll_s, left))


async def remove_node(database_url: str, name: str) -> bool:
    """Deregister node NAME, which must be draining and hold no attempt: revoke its tokens
    (its nodelet's next request gets 401) and mark it removed (not listed, never given work;
    its history stays). False if there is no such node (or it was removed already)."""
    async with connection(database_url) as conn, conn.transaction():
        found = await db.lock_node(conn, name)
        if found is None:
            return False
        node_id, drain = found
        if not drain.draining:
            raise AdminError(
                f"node {name!r} is not draining: drain it first "
                f"(bulletin node drain {name} --wait SECONDS), then stop its nodelet"
            )
        held = await db.held_attempts(conn, name)
        if held:
            raise AdminError(
                f"node {name!r} still runs {held} call(s): wait for them (bulletin node drain "
                f"{name} --wait SECONDS) or stop its nodelet, which hands them back to the queue"
            )
        await db.remove_node(conn, node_id)
        return True


async def nodes(database_url: str) -> list[db.NodeStatus]:
    async with connection(database_url) as conn:
        return await db.node_statuses(conn)


async def token_valid(database_url: str, token: str) -> bool:
    async with connection(database_url) as conn:
        return await db.lookup_token(conn, auth.token_hash(token)) is not None


async def ensure_database(server_url: str, name: str) -> None:
    """CREATE DATABASE ``name`` unless it exists (``server_url`` names another database)."""
    async with connection(server_url) as conn:
        await db.ensure_database(conn, name)


#: ``change_group(borrow_limit=NO_LIMIT)``: the group may borrow every idle GPU.
NO_LIMIT = -1


async def set_group(
    database_url: str, name: str, guaranteed_gpus: int, borrow_limit_gpus: int | None
) -> None:
    """Create group NAME or set its whole quota."""
    async with connection(database_url) as conn:
        await db.set_group(conn, name, guaranteed_gpus, borrow_limit_gpus)


async def change_group(
    database_url: str,
    name: str,
    *,
    guaranteed: int | None,
    borrow_limit: int | None,
    model: str | None = None,
    drop_model: bool = False,
) -> db.GroupRow:
    """Create group NAME or change the parts of its quota given (None: keep; a new group
    has 0 guaranteed and no borrowing limit; ``NO_LIMIT``: lift the limit). With ``model``,
    the parts given are those of its quota for that GPU model (made as for a new group),
    or, with ``drop_model``, that quota is removed."""
    async with connection(database_url) as conn, conn.transaction():
        await db.lock_group(conn, name)
        old = next(iter(await db.groups(conn, name)), None)
        models = list(old.models) if old else []
        if model is not None:  # (models match case-insensitively: so does this)
            mine = next((m for m in models if m.model.casefold() == model.casefold()), None)
            models = [m for m in models if m is not mine]
            if mine is not None:
                mine = dataclasses.replace(mine, model=model)
            elif drop_model:
                raise AdminError(f"group {name!r} has no quota for GPU model {model!r}")
            if not drop_model:
                models.append(_changed(mine or db.ModelQuotaRow(model, 0, None),
                                       guaranteed, borrow_limit))  # fmt: skip
            whole = old or db.GroupRow(name, 0, None)
        else:
            whole = _changed(old or db.GroupRow(name, 0, None), guaranteed, borrow_limit)
        return await db.set_group(
            conn,
            name,
            whole.guaranteed_gpus,
            whole.borrow_limit_gpus,
            sorted(models, key=lambda m: m.model),
        )


_Q = TypeVar("_Q", db.GroupRow, db.ModelQuotaRow)


def _changed(quota: _Q, guaranteed: int | None, borrow_limit: int | None) -> _Q:
    """``quota`` with the parts given changed (``NO_LIMIT``: no borrowing limit)."""
    limit = quota.borrow_limit_gpus if borrow_limit is None else borrow_limit
    return dataclasses.replace(
        quota,
        guaranteed_gpus=quota.guaranteed_gpus if guaranteed is None else guaranteed,
        borrow_limit_gpus=None if limit == NO_LIMIT else limit,
    )


async def require_group(conn: asyncpg.Connection, group: str) -> None:
    if not await db.group_exists(conn, group):
        raise AdminError(f"no group {group!r}: create it with 'bulletin group set'")


async def set_user_group(database_url: str, user: str, group: str) -> None:
    """Move a user to a group. Nothing else needs changing: the scheduler reads a queued
    call's group from its owner's row each time it plans."""
    async with connection(database_url) as conn:
        await require_group(conn, group)
        if not await db.set_user_group(conn, user, group):
            raise AdminError(f"no user {user!r}")


async def groups(database_url: str) -> list[db.GroupRow]:
    async with connection(database_url) as conn:
        return await db.groups(conn)


async def usage(database_url: str, days: int) -> list[db.UsageRow]:
    async with connection(database_url) as conn:
        return await db.usage(conn, days)


async def create_token(
    database_url: str, user: str, *, name: str = "", expires_s: float | None = None
) -> str:
    """A new token for an existing user (named, expiring after ``expires_s`` if given)."""
    async with connection(database_url) as conn:
        user_id = await db.find_user(conn, user)
        if user_id is None:
            raise AdminError(f"no user {user!r} (bulletin user add {user})")
        return await mint_token(conn, user_id, name=name, expires_s=expires_s)


async def tokens(database_url: str, owner: str | None = None) -> list[db.TokenRow]:
    async with connection(database_url) as conn:
        return await db.tokens(conn, owner)


async def revoke_token(database_url: str, token_id: int) -> None:
    async with connection(database_url) as conn:
        if not await db.revoke_token(conn, token_id):
            raise AdminError(f"no token {token_id} that is not revoked (bulletin token list)")


# ---------------------------------------------------------------------------- the gateway's role

_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_SCRAM_ITERATIONS = 4096  # PostgreSQL's default (scram_iterations)


def scram_verifier(password: str) -> str:
    """The SCRAM-SHA-256 secret PostgreSQL stores for ``password`` (RFC 5802/7677), made
    here so that the password itself never reaches the server, its logs or its statistics."""
    if not password or not password.isascii() or not password.isprintable():
        raise AdminError("the role's password must be printable ASCII (no SASLprep here)")
    salt = os.urandom(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, _SCRAM_ITERATIONS)
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    server_key = hmac.new(salted, b"Server Key", "sha256").digest()
    stored_key = hashlib.sha256(client_key).digest()
    b64 = lambda raw: base64.b64encode(raw).decode()  # noqa: E731
    return f"SCRAM-SHA-256${_SCRAM_ITERATIONS}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def _identifier(name: str, what: str) -> str:
    if not _IDENTIFIER.match(name):
        raise AdminError(
            f"{what} {name!r} must be lower-case letters, digits and underscores, "
            "starting with a letter or underscore"
        )
    return f'"{name}"'


def role_url(server_url: str, role: str, database: str, password: str | None = None) -> str:
    """``server_url`` (any user's URL of the same server) for ``role`` and ``database``,
    with the password only when given."""
    where = urllib.parse.urlsplit(server_url).netloc.rpartition("@")[2]
    user = urllib.parse.quote(role, safe="")
    if password is not None:
        user += ":" + urllib.parse.quote(password, safe="")
    return _replace(server_url, f"{user}@{where}", database)


def _replace(url: str, netloc: str, database: str) -> str:
    parts = urllib.parse.urlsplit(url)
    path = "/" + urllib.parse.quote(database, safe="")
    return urllib.parse.urlunsplit((parts.scheme, netloc, path, parts.query, ""))


async def ensure_role(superuser_url: str, role: str, password: str, database: str) -> None:
    """Make ``role`` a plain LOGIN role (NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION
    NOBYPASSRLS) with ``password`` (SCRAM), owning ``database`` (created if missing) and
    every table, view and sequence in its ``public`` schema; other roles may neither connect
    to that database nor create objects in its schema. Idempotent: run it on every start
    (it also adopts tables a superuser made before the role existed)."""
    quoted_role, quoted_db = _identifier(role, "role"), _identifier(database, "database")
    async with connection(superuser_url) as conn:
        if not await db.is_superuser(conn):
            raise AdminError("the --superuser-url must connect as a superuser")
        await db.set_login_role(conn, role, quoted_role, scram_verifier(password))
        await db.own_database(conn, database, quoted_db, quoted_role)
    netloc = urllib.parse.urlsplit(superuser_url).netloc
    async with connection(_replace(superuser_url, netloc, database)) as conn:
        await db.adopt_schema(conn, role, quoted_role)
