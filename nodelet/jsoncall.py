"""The worker's side of a JSON invocation (a registered function invoked over HTTP): the
arguments come as JSON, and the returned value goes back as JSON too (beside the pickled
outcome), when it can be."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from bulletin.pickling.pickler import human, type_name


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
    how = "fetch the pickled result (GET /v1/invocations/{id}/result, or sdk.Call.from_id(id)"
    how += ".result()), or return plain JSON types (dict, list, str, int, float, bool, None)"
    try:
        text = json.dumps(
            value, default=_default, allow_nan=False, ensure_ascii=False, separators=(",", ":")
        )
        data = text.encode()
    except (TypeError, ValueError, RecursionError, UnicodeEncodeError) as exc:
        reason = str(exc)
        if isinstance(exc, UnicodeEncodeError):
            reason = "a string holds a lone surrogate, which JSON text cannot carry"
        elif "Out of range float" in reason:
            reason = "it holds NaN or infinity, which JSON has no numbers for"
        return None, f"the {type_name(value)} the function returned is not JSON: {reason}; {how}"
    if len(data) > limit:
        return None, (
            f"the function's result is {human(len(data))} as JSON, over the limit of "
            f"{human(limit)} for a JSON result; {how}"
        )
    return data, None


def _default(obj: Any) -> Any:
    """What JSON has no type for, but has an obvious shape in it."""
    if hasattr(obj, "tolist") and callable(obj.tolist):  # numpy arrays and scalars, tensors
        return obj.tolist()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    raise TypeError(f"an object of type {type_name(obj)} is not JSON-serialisable")
