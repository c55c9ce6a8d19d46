"""The layers of docs/architecture.md, checked on the source with no exemptions.

- ``bulletin_core`` (wire types, pickling, shared-directory layout, settings, backoff) is
  the leaf: it imports nothing of ours but itself.
- ``scheduler`` is pure: nothing of ours, no I/O library.
- ``sdk``, ``nodelet`` and ``gateway`` stand on the leaf (the gateway also on the
  scheduler), never on each other.
- ``bulletin`` (the ``bulletin`` command, ``bulletin up``) is the top: it may import
  anything.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = {"bulletin_core", "gateway", "scheduler", "nodelet", "sdk", "bulletin"}
MAY_IMPORT = {
    "bulletin_core": set(),
    "scheduler": set(),
    "sdk": {"bulletin_core"},
    "nodelet": {"bulletin_core"},
    "gateway": {"bulletin_core", "scheduler"},
    "bulletin": OURS,
}
FORBIDDEN_THIRD_PARTY = {
    "scheduler": {"asyncpg", "starlette", "httpx", "uvicorn", "click"},
    # What every component imports stays light: no web framework, database driver or CLI
    # library at import time (bulletin_core.settings imports click inside the functions that
    # need it).
    "bulletin_core": {"asyncpg", "starlette", "httpx", "uvicorn", "click"},
}


def imports(package: str) -> set[tuple[Path, str, bool]]:
    """(file, imported module, at module level) for every absolute import in ``package``."""
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        tree = ast.parse(path.read_text())
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update((path, a.name, id(node) in top_level) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add((path, node.module, id(node) in top_level))
    return found


def test_every_package_has_a_layer() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "bench"}
    assert packages == set(MAY_IMPORT), "give a new package its layer here and in the docs"


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_package_imports_only_the_layers_below(package: str) -> None:
    bad = []
    for path, name, top_level in imports(package):
        top = name.split(".")[0]
        where = path.relative_to(ROOT)
        if top in OURS and top != package and top not in MAY_IMPORT[package]:
            bad.append(f"{where} imports {name}")
        if top in FORBIDDEN_THIRD_PARTY.get(package, set()):
            # The pure core may not use them at all; the leaf only inside a function.
            if package == "scheduler":
                bad.append(f"{where} imports {name}")
            elif top_level:
                bad.append(f"{where} imports {name} at module level")
    assert not bad, "\n".join(sorted(bad))


def loaded_by(code: str) -> set[str]:
    """Our modules that running ``code`` in a fresh interpreter imports."""
    probe = f"{code}\nimport sys\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\n")[-2]
    return {m for m in out.split() if m.split(".")[0] in OURS}


def test_a_subcommand_loads_only_what_it_runs() -> None:
    # What `bulletin nodelet` imports before it runs: its own command and config, never
    # the gateway or the scheduler (it used to import 13 scheduler modules).
    loaded = loaded_by("from bulletin import cli\ncli.get_command(None, 'nodelet')")
    assert "nodelet.command" in loaded
    assert not {m for m in loaded if m.split(".")[0] in {"gateway", "scheduler", "sdk"}}
    loaded = loaded_by("import nodelet.agent")
    assert not {m for m in loaded if m.split(".")[0] in {"gateway", "scheduler", "sdk", "bulletin"}}


def test_the_sdk_loads_no_cluster_side_code() -> None:
    loaded = loaded_by("import sdk")
    cluster_side = {"gateway", "scheduler", "nodelet", "bulletin"}
    assert not {m for m in loaded if m.split(".")[0] in cluster_side}
