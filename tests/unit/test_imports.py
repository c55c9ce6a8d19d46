"""Import directions between our packages (docs/architecture.md), checked on the source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = {"bulletin", "gateway", "scheduler", "nodelet", "sdk"}
ALLOWED = {
    "scheduler": set(),
    "sdk": {"bulletin.wire", "bulletin.shared", "bulletin.pickling", "bulletin.backoff"},
    "nodelet": {"bulletin.wire", "bulletin.shared", "bulletin.pickling", "bulletin.backoff"},
    "gateway": {"bulletin.wire", "bulletin.shared", "bulletin.backoff", "scheduler"},
}
FORBIDDEN_THIRD_PARTY = {"scheduler": {"asyncpg", "starlette", "httpx", "uvicorn"}}


def imports(package: str) -> set[tuple[Path, str]]:
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        if package != "bulletin" and path.name == "__main__.py":
            continue  # the tiny entry points hand over to the bulletin CLI
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update((path, alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add((path, node.module))
                found.update((path, f"{node.module}.{a.name}") for a in node.names)
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_it_may(package: str) -> None:
    bad = []
    for path, name in imports(package):
        top = name.split(".")[0]
        allowed = name == "bulletin" or any(
            name == a or name.startswith(a + ".") for a in ALLOWED[package]
        )
        if top in OURS and top != package and not allowed:
            bad.append(f"{path.relative_to(ROOT)} imports {name}")
        if top in FORBIDDEN_THIRD_PARTY.get(package, set()):
            bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(sorted(bad))


def test_wire_imports_nothing_of_ours() -> None:
    wire = ROOT / "bulletin" / "wire.py"
    names = {n for _, n in imports("bulletin") if _ == wire}
    assert not {n for n in names if n.split(".")[0] in OURS}
