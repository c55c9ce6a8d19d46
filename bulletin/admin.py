"""Accounts and tokens, made directly in the database (the admin's side of set-up)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import asyncpg

from gateway import auth, db


@contextlib.asynccontextmanager
async def _connection(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(database_url)
    try:
        yield conn
    finally:
        await conn.close()


async def migrate(database_url: str) -> list[str]:
    async with _connection(database_url) as conn:
        return await db.migrate(conn)


async def add_user(database_url: str, name: str, *, is_admin: bool = False) -> str:
    """Create the user if new and return a fresh token for them."""
    async with _connection(database_url) as conn:
        async with conn.transaction():
            user_id = await db.find_user(conn, name)
            if user_id is None:
                user_id = await db.create_user(conn, name, is_admin=is_admin)
            token = auth.new_token("user")
            await db.add_token(conn, auth.token_hash(token), user_id=user_id)
        return token


async def add_node(database_url: str, name: str) -> str:
    """Create the node record if new and return a fresh node token for it."""
    async with _connection(database_url) as conn:
        async with conn.transaction():
            node_id = await db.create_node(conn, name)
            token = auth.new_token("node")
            await db.add_token(conn, auth.token_hash(token), node_id=node_id)
        return token


async def drain(database_url: str, name: str, reason: str | None) -> bool:
    """Give node NAME no new work (its running calls finish); False if there is none."""
    async with _connection(database_url) as conn:
        return await db.set_draining(conn, name, True, reason or "drained by an admin")


async def undrain(database_url: str, name: str) -> bool:
    """Let node NAME take work again; False if there is none."""
    async with _connection(database_url) as conn:
        return await db.set_draining(conn, name, False, None)


async def nodes(database_url: str) -> list[db.NodeStatus]:
    async with _connection(database_url) as conn:
        return await db.node_statuses(conn)


async def token_valid(database_url: str, token: str) -> bool:
    async with _connection(database_url) as conn:
        return await db.lookup_token(conn, auth.token_hash(token)) is not None


async def ensure_database(server_url: str, name: str) -> None:
    """CREATE DATABASE ``name`` unless it exists (``server_url`` names another database)."""
    async with _connection(server_url) as conn:
        await db.ensure_database(conn, name)
