"""The worker's side of a JSON invocation (a registered function invoked over HTTP): the
arguments come as JSON, and the returned value goes back as JSON too (beside the pickled
outcome), when it can be."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from bulletin_core.pickling.pickler import human, type_name


def arguments(raw: bytes) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` from ``{"args": [...], "kwargs": {...}}``; ValueError if not."""
    loaded = json.loads(raw)
    if not (
        isinstance(loaded, dict)
        and isinstance(loaded.get("args", []), list)
        and isinstance(loaded.get("kwargs", {}), dict)
    ):
        raise ValueError('JSON arguments must be {"args": [...], "kwargs": {...}}')
    return tuple(loaded.get("args", [])), dict(loaded.get("kwargs", {}))


def encode(value: Any, limit: int) -> tuple[bytes | None, str | None]:
    """``value`` as JSON (arrays and tensors as nested lists, dataclasses as objects, sets
    as lists), or why it cannot be: ``(json, None)`` or ``(None, reason)``."""
    how = (
        "return plain JSON types (dict, list, str, int, float, bool, None), or load the "
        "pickled result (GET /v1/invocations/{id}/result) in Python with "
        "sdk.Call.from_id(id).result(), which refuses a result made by another user's "
        "function: unpickling runs code that function chose, so pass trust='<its owner>' only "
        "if you trust them"
    )
    too_big = (
        f"the function's result is over the limit of {human(limit)} for a JSON result; {how}"
    )

    def default(obj: Any) -> Any:
        if _nbytes(obj) > limit:  # before .tolist() makes a huge nested list
            raise _TooBig
        return _default(obj)

    try:
        text = json.dumps(
            value, default=default, allow_nan=False, ensure_ascii=False, separators=(",", ":")
        )
        data = text.encode()
        if len(data) <= limit and _depth(data) > MAX_DEPTH:
            raise RecursionError(data)
    except _TooBig:
        return None, too_big
    except Exception as exc:  # whatever a user's object does when asked: never the call's fate
        reason = f"{type_name(exc)}: {exc}"
        if isinstance(exc, UnicodeEncodeError):
            reason = "a string holds a lone surrogate, which JSON text cannot carry"
        elif "Out of range float" in reason:
            reason = "it holds NaN or infinity, which JSON has no numbers for"
        elif isinstance(exc, RecursionError):
            reason = f"it is nested too deeply (more than {MAX_DEPTH} levels)"
        elif isinstance(exc, TypeError):
            reason = str(exc)
        return None, f"the {type_name(value)} the function returned is not JSON: {reason}; {how}"
    if len(data) > limit:
        return None, too_big
    return data, None


class _TooBig(Exception):
    pass


#: The deepest nesting of arrays and objects a JSON result may have: the gateway checks the
#: JSON it relays, and that must never run out of stack.
MAX_DEPTH = 200
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def _depth(data: bytes) -> int:
    """How deeply arrays and objects nest in a JSON text."""
    deepest = depth = 0
    for byte in _STRING.sub(b"", data):
        if byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif byte in b"]}":
            depth -= 1
    return deepest


def _nbytes(obj: Any) -> int:
    """The size of an array's or tensor's data (0 for anything else)."""
    nbytes = getattr(obj, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    numel, element_size = getattr(obj, "numel", None), getattr(obj, "element_size", None)
    if callable(numel) and callable(element_size):
        try:
            return int(numel()) * int(element_size())
        except Exception:
            return 0
    return 0


def _default(obj: Any) -> Any:
    """What JSON has no type for, but has an obvious shape in it."""
    if hasattr(obj, "tolist") and callable(obj.tolist):  # numpy arrays and scalars, tensors
        return obj.tolist()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    raise TypeError(f"an object of type {type_name(obj)} is not JSON-serialisable")
