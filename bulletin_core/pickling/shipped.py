"""A function pickled once and sent with many calls: the items of one ``map``.

The caller pickles the function once per map (``Shipped``) and each item's envelope holds
those bytes where the function would be, with the map's token. A worker unpickles the
function the first time it meets a ``(token, bytes)`` pair and runs the map's later items it
is handed with the same function object (``load``): globals the function sets are seen by
the later items that worker runs, as in a Ray or Modal worker, while separate maps never
share a function object. The key is the pickle itself, compared whole: whatever a caller
sends, it only ever gets back what its own bytes unpickle to.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from bulletin_core.pickling import envelope

#: Functions a worker keeps loaded (the last maps it ran), and the biggest pickle it keeps.
KEEP = 4
KEEP_BYTES = 1 << 20

_loaded: OrderedDict[tuple[str, bytes], Callable[..., Any]] = OrderedDict()


class Shipped:
    """A function's pickle (without out-of-band buffers) standing for the function in the
    envelopes of one map's items."""

    __slots__ = ("data", "token")

    def __init__(self, token: str, data: bytes) -> None:
        self.token = token
        self.data = data

    def __reduce__(self) -> tuple[Callable[[str, bytes], Any], tuple[str, bytes]]:
        return load, (self.token, self.data)


def load(token: str, data: bytes) -> Any:
    """The function ``data`` is the pickle of, loaded once per map (``token``) and worker."""
    key = (token, data)
    fn = _loaded.get(key)
    if fn is not None:
        _loaded.move_to_end(key)
        return fn
    fn = envelope.RenamingUnpickler(io.BytesIO(data)).load()
    if len(data) <= KEEP_BYTES:
        _loaded[key] = fn
        while len(_loaded) > KEEP:
            _loaded.popitem(last=False)
    return fn


def forget() -> None:
    """Drop every kept function."""
    _loaded.clear()
