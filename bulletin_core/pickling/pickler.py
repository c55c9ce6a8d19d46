"""The pickler every envelope is written with: cloudpickle, protocol 5, tensors and arrays as
out-of-band buffers."""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Callable
from typing import Any

import cloudpickle

from bulletin_core.pickling import envelope, tensors

PROTOCOL = 5


class Pickler(cloudpickle.Pickler):
    """cloudpickle's pickler, with plain tensors reduced to raw out-of-band buffers."""

    def __init__(self, file: io.BytesIO, buffers: list[pickle.PickleBuffer]) -> None:
        super().__init__(file, protocol=PROTOCOL, buffer_callback=buffers.append)
        self.keep: list[Any] = []
        self.uses_torch = False

    def reducer_override(self, obj: Any) -> Any:
        if tensors.is_plain_tensor(obj):
            self.uses_torch = True
            reduced = tensors.reduce(obj, self.keep)
            if reduced is not NotImplemented:
                return reduced
        return super().reducer_override(obj)


def pack(
    obj: Any,
    *,
    make: Callable[[io.BytesIO, list[pickle.PickleBuffer]], Pickler] = Pickler,
    **flags: Any,
) -> tuple[envelope.Packed, Pickler]:
    """Pickle ``obj`` into an envelope (buffers still views of the objects' memory); also
    returns the pickler, whose memo the caller may need. ``flags`` go into the header."""
    buffers: list[pickle.PickleBuffer] = []
    file = io.BytesIO()
    pickler = make(file, buffers)
    pickler.dump(obj)
    data = file.getvalue()
    views = [buffer.raw() for buffer in buffers]
    header = envelope.header(
        pickle_size=len(data),
        buffers=[view.nbytes for view in views],
        uses_torch=pickler.uses_torch or _names_torch(data),
        **flags,
    )
    return envelope.Packed(header, data, views, keep=[*pickler.keep, *buffers]), pickler


# A module name a pickle imports from: a short string "torch" or "torch.<...>", memoized.
_TORCH_GLOBAL = re.compile(rb"\x8c.torch(?:\.[A-Za-z0-9_.]*)?\x94", re.DOTALL)


def _names_torch(data: bytes) -> bool:
    return tensors.torch_module() is not None and _TORCH_GLOBAL.search(data) is not None


def size_of(obj: Any) -> int:
    """Bytes ``obj`` adds to an envelope (pickle plus buffers), without copying buffers."""
    buffers: list[pickle.PickleBuffer] = []
    file = io.BytesIO()
    Pickler(file, buffers).dump(obj)
    return file.tell() + sum(buffer.raw().nbytes for buffer in buffers)


def type_name(obj: object) -> str:
    """The qualified name of ``obj``'s type (or of ``obj``, a class), without ``builtins.``."""
    cls = obj if isinstance(obj, type) else type(obj)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def reason(exc: BaseException) -> str:
    """``'TypeError: cannot pickle ...'``: an exception as error messages quote it."""
    return f"{type(exc).__name__}: {exc}"


def human(nbytes: int) -> str:
    """``1610612736`` -> ``'1.5 GiB'``."""
    size = float(nbytes)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
