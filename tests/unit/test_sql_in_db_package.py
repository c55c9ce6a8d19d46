"""All SQL lives in ``gateway/db/``: no string literal elsewhere in our packages looks like a
statement (docstrings, which may name one in prose, are not looked at)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bulletin_core", "bulletin", "gateway", "scheduler", "nodelet", "sdk")
DB_PACKAGE = ROOT / "gateway" / "db"
#: Upper-case keywords only (as every statement here is written): prose says "select".
SQL = re.compile(
    r"\b(SELECT|INSERT\s+INTO|UPDATE\s+\w+\s+SET|DELETE\s+FROM"
    r"|CREATE\s+(TABLE|INDEX|ROLE|DATABASE)|ALTER\s+(TABLE|ROLE)|pg_try_advisory|LISTEN|NOTIFY)\b"
)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that stand alone as statements: docstrings (of modules,
    classes, functions) and other bare strings, which are documentation too."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }


def sql_literals(source: str, name: str) -> list[str]:
    """``name:line: text`` for each string literal of ``source`` that looks like SQL (parts
    of f-strings included)."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docs
            and SQL.search(node.value)
        ):
            found.append(f"{name}:{node.lineno}: {node.value.strip()[:80]!r}")
    return found


def test_no_sql_outside_the_db_package() -> None:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.is_relative_to(DB_PACKAGE):
                continue
            found += sql_literals(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "SQL outside gateway/db/ (move it there):\n" + "\n".join(found)


def test_the_check_finds_a_statement_and_leaves_prose_alone() -> None:
    # What gateway/scheduling.py held before the leader lock moved to gateway/db.
    leader = (
        "async def run(conn):\n"
        '    """Lead while this connection holds the lock (pg_try_advisory_lock)."""\n'
        '    if await conn.fetchval("SELECT pg_try_advisory_lock($1)", LEADER_LOCK):\n'
        "        pass\n"
    )
    assert sql_literals(leader, "scheduling.py") == [
        "scheduling.py:3: 'SELECT pg_try_advisory_lock($1)'"
    ]
    assert sql_literals('x = f"UPDATE nodes SET name = {name!r}"', "f.py") == [
        "f.py:1: 'UPDATE nodes SET name ='"
    ]
    prose = (
        '"""One LISTEN connection per gateway."""\n'
        "async def ensure_database(url, name):\n"
        '    """CREATE DATABASE ``name`` unless it exists."""\n'
        '    raise ValueError("select a database name of letters and digits")\n'
    )
    assert sql_literals(prose, "admin.py") == []
