"""The gateway's own PostgreSQL role and database, set up by a superuser
(``bulletin/admin.py`` ``ensure_role``).

Role and database names arrive as quoted identifiers the caller checked: DDL takes no
parameters, so those statements are built here around them, and the password arrives only
as a SCRAM verifier. Everything else is a fixed statement."""

from __future__ import annotations

import asyncpg

_IS_SUPERUSER = """
SELECT rolsuper FROM pg_roles WHERE rolname = current_user
"""

_ROLE_EXISTS = """
SELECT 1 FROM pg_roles WHERE rolname = $1
"""

_DATABASE_EXISTS = """
SELECT 1 FROM pg_database WHERE datname = $1
"""

#: A plain login role: what CREATE ROLE / ALTER ROLE give it, before its password.
_LOGIN_ATTRIBUTES = "LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS"

_PUBLIC_SCHEMA_OWNER = """
SELECT pg_get_userbyid(nspowner) FROM pg_namespace WHERE nspname = 'public'
"""

_REVOKE_PUBLIC_CREATE = """
REVOKE CREATE ON SCHEMA public FROM PUBLIC
"""

#: Relations of the public schema of kinds ``$1`` (pg_class.relkind) not owned by role ``$2``.
_FOREIGN_OWNED = """
SELECT c.oid::regclass::text AS name, c.relkind::text AS kind
FROM pg_class c
WHERE c.relnamespace = 'public'::regnamespace
  AND c.relkind::text = ANY($1)
  AND c.relowner <> (SELECT oid FROM pg_roles WHERE rolname = $2)
"""


async def is_superuser(conn: asyncpg.Connection) -> bool:
    return bool(await conn.fetchval(_IS_SUPERUSER))


async def set_login_role(conn: asyncpg.Connection, role: str, quoted: str, verifier: str) -> None:
    """Create or alter ``role`` into a plain LOGIN role (no superuser, no database or role
    creation, no replication, no RLS bypass) with the SCRAM ``verifier`` as its password."""
    exists = await conn.fetchval(_ROLE_EXISTS, role)
    attributes = f"{_LOGIN_ATTRIBUTES} PASSWORD '{verifier}'"
    await conn.execute(f"{'ALTER' if exists else 'CREATE'} ROLE {quoted} {attributes}")


async def own_database(
    conn: asyncpg.Connection, database: str, quoted_db: str, quoted_role: str
) -> None:
    """Make ``database`` (created if missing) the role's, and nobody else's to connect to."""
    if await conn.fetchval(_DATABASE_EXISTS, database):
        await conn.execute(f"ALTER DATABASE {quoted_db} OWNER TO {quoted_role}")
    else:
        await conn.execute(f"CREATE DATABASE {quoted_db} OWNER {quoted_role}")
    await conn.execute(f"REVOKE ALL ON DATABASE {quoted_db} FROM PUBLIC")


async def adopt_schema(conn: asyncpg.Connection, role: str, quoted_role: str) -> None:
    """Give the role the ``public`` schema of the connected database and everything in it
    (tables a superuser made before the role existed); nobody else may create there."""
    # PostgreSQL 15+ has the schema owned by pg_database_owner (so by the role, through
    # the database); older servers by the bootstrap superuser: hand it over either way.
    owner = await conn.fetchval(_PUBLIC_SCHEMA_OWNER)
    if owner not in (role, "pg_database_owner"):
        await conn.execute(f"ALTER SCHEMA public OWNER TO {quoted_role}")
    await conn.execute(_REVOKE_PUBLIC_CREATE)
    # Tables first: their own sequences (serial, identity) follow them.
    for kinds, statement in ((["r", "p"], "TABLE"), (["v", "m"], "VIEW"), (["S"], "SEQUENCE")):
        for row in await conn.fetch(_FOREIGN_OWNED, kinds, role):
            kind = "MATERIALIZED VIEW" if row["kind"] == "m" else statement
            # row["name"] is regclass text: already a quoted, schema-qualified identifier.
            await conn.execute(f"ALTER {kind} {row['name']} OWNER TO {quoted_role}")
