"""Accounts and tokens, made directly in the database (the admin's side of set-up)."""

from __future__ import annotations

import asyncpg

from gateway import auth, db


async def _connect(database_url: str) -> asyncpg.Connection:
    return await asyncpg.connect(database_url)


async def migrate(database_url: str) -> list[str]:
    conn = await _connect(database_url)
    try:
        return await db.migrate(conn)
    finally:
        await conn.close()


async def add_user(database_url: str, name: str, *, is_admin: bool = False) -> str:
    """Create the user if new and return a fresh token for them."""
    conn = await _connect(database_url)
    try:
        async with conn.transaction():
            user_id = await db.find_user(conn, name)
            if user_id is None:
                user_id = await db.create_user(conn, name, is_admin=is_admin)
            token = auth.new_token("user")
            await db.add_token(conn, auth.token_hash(token), user_id=user_id)
        return token
    finally:
        await conn.close()


async def add_node(database_url: str, name: str) -> str:
    """Create the node record if new and return a fresh node token for it."""
    conn = await _connect(database_url)
    try:
        async with conn.transaction():
            node_id = await db.create_node(conn, name)
            token = auth.new_token("node")
            await db.add_token(conn, auth.token_hash(token), node_id=node_id)
        return token
    finally:
        await conn.close()


async def token_valid(database_url: str, token: str) -> bool:
    conn = await _connect(database_url)
    try:
        return await db.lookup_token(conn, auth.token_hash(token)) is not None
    finally:
        await conn.close()


async def ensure_database(server_url: str, name: str) -> None:
    """CREATE DATABASE ``name`` unless it exists (``server_url`` names another database)."""
    conn = await _connect(server_url)
    try:
        await db.ensure_database(conn, name)
    finally:
        await conn.close()
