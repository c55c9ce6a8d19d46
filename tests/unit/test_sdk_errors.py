"""The sdk's errors: the tree drawn in ``sdk/_errors.py``'s docstring is the tree the classes
make, every one of them is exported, and each derives from ``sdk.BulletinError`` (the one
warning, from ``UserWarning``). Adding an error without drawing it fails here."""

from __future__ import annotations

import importlib
import pickle
import pkgutil
import re

import cloudpickle
import pytest

import sdk
from sdk import _errors

# A name line of the drawing: the root at the block's indent, or a child after its branch.
_NODE = re.compile(r"^    (?P<branches>(?:[│ ]   )*)(?:[├└]── )?(?P<name>[A-Z]\w*)\b")


def drawn() -> set[tuple[str | None, str]]:
    """(parent, child) for every class drawn in the docstring's tree; roots have no parent."""
    doc = _errors.__doc__ or ""
    block = doc.split("The tree::\n\n", 1)[1]
    lines = block.splitlines()
    edges: set[tuple[str | None, str]] = set()
    path: list[str] = []
    for line in lines:
        if line and not line.startswith("    "):
            break  # the end of the literal block
        match = _NODE.match(line)
        if match is None or (match["branches"] and "── " not in line):
            continue  # blank, or the description running on under a branch
        depth = len(match["branches"]) // 4 + ("── " in line)
        path[depth:] = [match["name"]]
        edges.add((path[depth - 1] if depth else None, match["name"]))
    return edges


def ours(cls: type) -> bool:
    return cls.__module__ == "sdk" or cls.__module__.startswith("sdk.")


def subclasses(parent: type[BaseException]) -> set[tuple[str | None, str]]:
    """(parent, child) for the sdk's classes below ``parent``, found by walking
    ``__subclasses__``."""
    edges: set[tuple[str | None, str]] = set()
    for child in parent.__subclasses__():
        if ours(child):
            edges.add((parent.__name__, child.__name__))
            edges |= subclasses(child)
    return edges


def defined() -> dict[str, type[BaseException]]:
    """Every public exception or warning class defined in a module of the sdk."""
    found = {}
    for module in pkgutil.iter_modules(sdk.__path__, "sdk."):
        for name, value in vars(importlib.import_module(module.name)).items():
            error = isinstance(value, type) and issubclass(value, BaseException)
            if error and ours(value) and not name.startswith("_"):
                found[name] = value
    return found


def test_the_drawn_tree_is_the_class_tree() -> None:
    warnings = {
        (None, name) for name, cls in defined().items() if issubclass(cls, Warning)
    }
    classes = {(None, "BulletinError")} | subclasses(sdk.BulletinError) | warnings
    assert drawn() == classes


def test_every_error_is_exported_and_a_bulletin_error_or_a_warning() -> None:
    errors = defined()
    assert "StateTooLarge" in errors and "BulletinError" in errors
    for name, cls in errors.items():
        assert getattr(sdk, name, None) is cls and name in sdk.__all__, name
        assert issubclass(cls, sdk.BulletinError | UserWarning), name
    assert issubclass(sdk.ResultTimeout, TimeoutError)


def test_the_drawing_is_parsed() -> None:
    edges = drawn()
    assert ("SerializationError", "StateTooLarge") in edges
    assert ("GatewayError", "GatewayUnreachable") in edges
    assert (None, "StateSyncWarning") in edges
    assert len(edges) == len(defined())


@pytest.mark.parametrize(
    "error",
    [
        sdk.RemoteError("boom", invocation_id="i-1", error_type="KeyError", remote_traceback="tb"),
        sdk.GatewayUnreachable("down", status=503),
        sdk.StateTooLarge("too big", invocation_id="i-2"),
        sdk.CallTimedOut("late", invocation_id="i-3"),
    ],
    ids=lambda error: type(error).__name__,
)
def test_errors_pickle_by_reference_to_the_sdk(error: sdk.BulletinError) -> None:
    for dumps in (pickle.dumps, cloudpickle.dumps):
        data = dumps(error)
        assert b"sdk._" not in data  # by its public name, not the private module's
        copy = pickle.loads(data)
        assert type(copy) is type(error) and copy.args == error.args
        assert vars(copy) == vars(error)
