"""Pickling calls for the cluster, with errors that name the variable at fault.

The payload of a call is an envelope (``bulletin_core.pickling``) of ``(fn, args, kwargs)`` with
``fn`` the user's original function: cloudpickle ships it by value together with the globals
it references (and local helper modules), installed modules by reference, tensors and arrays
as out-of-band buffers. When pickling fails, the object graph is probed piece by piece to name
the culprit (an argument, or a global or closure variable of the function or of a helper it
calls), because cloudpickle's own error ("cannot pickle '_thread.lock' object") does not say
which variable held it. A call over the size limit is refused the same way, naming its
biggest parts.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import cloudpickle

from bulletin_core.pickling import caller
from bulletin_core.pickling.pickler import human, reason, size_of, type_name
from bulletin_core.pickling.shipped import Shipped
from sdk._errors import SerializationError, StateTooLarge

_ADVICE = (
    "Create such objects inside the function instead of referencing them from the notebook, "
    "or pass something that pickles (a path, a config, plain data) and build the object "
    "remotely."
)


def pack_call(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    max_bytes: int,
    **flags: Any,
) -> caller.Sent:
    """The envelope of one call. Raises ``SerializationError`` naming what cannot be pickled,
    ``StateTooLarge`` naming the biggest parts of a call over ``max_bytes``."""
    try:
        sent = caller.pack_call(fn, args, dict(kwargs), **flags)
    except Exception as exc:
        raise SerializationError(_explain(fn, args, kwargs, exc)) from None
    total = sent.packed.state_bytes
    if max_bytes and total > max_bytes:
        raise StateTooLarge(_too_large(fn, args, kwargs, total, max_bytes))
    return sent


def ship_function(fn: Callable[..., Any], token: str) -> Shipped | None:
    """``fn`` pickled once for the items of one map (see ``caller.ship_function``). Raises
    ``SerializationError`` naming what cannot be pickled."""
    try:
        return caller.ship_function(fn, token)
    except Exception as exc:
        raise SerializationError(_explain(fn, (), {}, exc)) from None


def _explain(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any], exc: Exception
) -> str:
    culprit = _culprit_in_arguments(args, kwargs)
    function = _function_behind(fn)
    if culprit is None and function is not None:
        culprit = _culprit_in_function(function, function, set())
    if culprit is None:
        name = getattr(fn, "__qualname__", repr(fn))
        return f"Cannot send the call to {name} to the cluster: {reason(exc)}. {_ADVICE}"
    return f"{culprit} cannot be sent to the node: {reason(exc)}. {_ADVICE}"


def _too_large(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any], total: int, limit: int
) -> str:
    parts = [(f"argument {i} ({type_name(v)})", v) for i, v in enumerate(args)]
    parts += [(f"keyword argument {k!r} ({type_name(v)})", v) for k, v in kwargs.items()]
    function = _function_behind(fn)
    if function is not None:
        parts += _all_references(function, function, set())
    sizes = sorted(((size_of(value), label) for label, value in parts), reverse=True)
    biggest = ", ".join(f"{label}: {human(size)}" for size, label in sizes[:3] if size)
    return (
        f"The call to {getattr(fn, '__qualname__', fn)!s} is {human(total)}, over the "
        f"cluster's limit of {human(limit)} (max_state_bytes); biggest parts: {biggest}. "
        "Send less (save big data to a file the nodes can read and pass its path), or ask "
        "the admin to raise the limit."
    )


def _culprit_in_arguments(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
    for index, value in enumerate(args):
        if not _pickles(value):
            return f"argument {index} ({type_name(value)})"
    for key, value in kwargs.items():
        if not _pickles(value):
            return f"keyword argument {key!r} ({type_name(value)})"
    return None


def _culprit_in_function(
    fn: types.FunctionType, called: types.FunctionType, seen: set[int]
) -> str | None:
    """Describe the first unpicklable variable ``fn`` references, looking into helpers."""
    seen.add(id(fn))
    for label, value in _references(fn, called):
        if _pickles(value):
            continue
        helper = _function_behind(value)
        if helper is not None and id(helper) not in seen:
            deeper = _culprit_in_function(helper, called, seen)
            if deeper is not None:
                return deeper
        return f"{label} ({type_name(value)})"
    return None


def _all_references(
    fn: types.FunctionType, called: types.FunctionType, seen: set[int]
) -> list[tuple[str, Any]]:
    """Every variable shipped with ``fn``, through the helpers it calls."""
    seen.add(id(fn))
    found = []
    for label, value in _references(fn, called):
        helper = _function_behind(value)
        if helper is not None:
            if id(helper) not in seen:
                found += _all_references(helper, called, seen)
            continue
        found.append((f"{label} ({type_name(value)})", value))
    return found


def _references(fn: types.FunctionType, called: types.FunctionType) -> Iterator[tuple[str, Any]]:
    """The variables cloudpickle ships with ``fn``; a local helper module is shipped whole,
    so its attributes stand in for it."""
    of = "" if fn is called else f" (used by {fn.__qualname__})"
    for name, label, value in _variables(fn, of):
        if not isinstance(value, types.ModuleType):
            yield label, value
        elif _by_value(value):
            for attribute, inner in vars(value).items():
                if not attribute.startswith("__"):
                    yield f"{name}.{attribute} (of local module {name!r}{of})", inner


def _variables(fn: types.FunctionType, of: str) -> Iterator[tuple[str, str, Any]]:
    """(name, label, value) of the globals, closure cells and defaults of ``fn``."""
    for name in dict.fromkeys(_global_names(fn.__code__)):
        if name in fn.__globals__:
            yield name, f"global {name!r}{of}", fn.__globals__[name]
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
        try:
            yield name, f"closure variable {name!r} of {fn.__qualname__}", cell.cell_contents
        except ValueError:  # an empty cell: the variable was never assigned
            continue
    for index, default in enumerate(fn.__defaults__ or ()):
        yield "", f"default value {index} of a parameter of {fn.__qualname__}", default
    for name, default in (fn.__kwdefaults__ or {}).items():
        yield name, f"the default of parameter {name!r} of {fn.__qualname__}", default


def _by_value(module: types.ModuleType) -> bool:
    check = getattr(cloudpickle.cloudpickle, "_is_registered_pickle_by_value", None)
    return bool(check(module)) if check is not None else False


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
        size_of(value)  # the envelope's own pickler: tensors are not copied
    except Exception:
        return False
    return True
