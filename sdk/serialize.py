"""Pickling calls for the cluster and unpickling what comes back.

The payload of a call is ``cloudpickle.dumps((fn, args, kwargs), protocol=5)`` with ``fn``
the user's original function: cloudpickle ships it by value together with the globals it
references, and modules installed on both sides by reference. When that fails, the whole
object graph is probed piece by piece to name the culprit (an argument, or a global or
closure variable of the function or of a helper it calls), because cloudpickle's own error
("cannot pickle '_thread.lock' object") does not say which variable held it.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import cloudpickle

from sdk.errors import SerializationError

PROTOCOL = 5
_ADVICE = (
    "Create such objects inside the function instead of referencing them from the notebook, "
    "or pass something that pickles (a path, a config, plain data) and build the object "
    "remotely."
)


def dumps_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bytes:
    """The payload of one call. Raises ``SerializationError`` naming what cannot be pickled."""
    try:
        return cloudpickle.dumps((fn, args, dict(kwargs)), protocol=PROTOCOL)
    except Exception as exc:
        raise SerializationError(_explain(fn, args, kwargs, exc)) from None


def loads(data: bytes | bytearray) -> Any:
    """Unpickle a result (or a pickled exception) that came back from the cluster."""
    return cloudpickle.loads(data)


def _explain(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any], exc: Exception
) -> str:
    name = getattr(fn, "__qualname__", repr(fn))
    culprit = _culprit_in_arguments(args, kwargs)
    function = _function_behind(fn)
    if culprit is None and function is not None:
        culprit = _culprit_in_function(function, set())
    if culprit is None:
        return f"Cannot send the call to {name} to the cluster: {_reason(exc)}. {_ADVICE}"
    return (
        f"Cannot send the call to {name} to the cluster: {culprit} cannot be pickled "
        f"({_reason(exc)}). {_ADVICE}"
    )


def _culprit_in_arguments(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
    for index, value in enumerate(args):
        if not _pickles(value):
            return f"argument {index} ({_kind(value)})"
    for key, value in kwargs.items():
        if not _pickles(value):
            return f"keyword argument {key!r} ({_kind(value)})"
    return None


def _culprit_in_function(fn: types.FunctionType, seen: set[int]) -> str | None:
    """Describe the first unpicklable variable ``fn`` references, looking into helpers."""
    seen.add(id(fn))
    for label, value in _references(fn):
        if _pickles(value):
            continue
        helper = _function_behind(value)
        if helper is not None and id(helper) not in seen:
            deeper = _culprit_in_function(helper, seen)
            if deeper is not None:
                return deeper
        return f"{label} of {fn.__qualname__} ({_kind(value)})"
    return None


def _references(fn: types.FunctionType) -> Iterator[tuple[str, Any]]:
    """The variables cloudpickle ships with ``fn``: globals, closure cells, defaults."""
    for name in dict.fromkeys(_global_names(fn.__code__)):
        if name in fn.__globals__ and not isinstance(fn.__globals__[name], types.ModuleType):
            yield f"the global variable {name!r}", fn.__globals__[name]
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
        try:
            yield f"the closure variable {name!r}", cell.cell_contents
        except ValueError:  # an empty cell: the variable was never assigned
            continue
    for index, default in enumerate(fn.__defaults__ or ()):
        yield f"default value {index} of a parameter", default
    for name, default in (fn.__kwdefaults__ or {}).items():
        yield f"the default of parameter {name!r}", default


def _global_names(code: types.CodeType) -> Iterator[str]:
    # Nested functions, lambdas and comprehensions keep their own names in co_consts.
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


def _function_behind(value: Any) -> types.FunctionType | None:
    """The plain function to look into: ``value`` itself, or what a wrapper wraps."""
    while not inspect.isfunction(value) and hasattr(value, "__wrapped__"):
        value = value.__wrapped__
    return value if inspect.isfunction(value) else None


def _pickles(value: Any) -> bool:
    try:
        cloudpickle.dumps(value, protocol=PROTOCOL)
    except Exception:
        return False
    return True


def _kind(value: Any) -> str:
    kind = type(value)
    if kind.__module__ == "builtins":
        return f"a {kind.__qualname__}"
    return f"a {kind.__module__}.{kind.__qualname__}"


def _reason(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"
