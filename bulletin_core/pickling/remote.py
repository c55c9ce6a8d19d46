"""The worker's side of a call: load it, move it to the device, run it, and pack what comes
back: the return value (or exception) and the notebook globals the call changed.

How changes are found. The caller keeps the pickler's memo of the call; the worker keeps the
unpickler's memo; both number every memoized object the same way, so a memo index names one
object on both sides. After loading (and the device move) the worker takes a shallow snapshot
of every mutable object of the call (lists, dicts, sets, bytearrays, deques, instances,
tensors, arrays; tuples and frozensets for what they contain). After the call, an object whose
snapshot differs changed; an object that reaches a changed one is "deep-changed". The
outcome is pickled with ``persistent_id`` standing in for every object that came from the
caller: an unchanged one as a reference to the caller's own object, a changed one as that
reference plus its new contents, which the caller applies in place (``caller.py``), so
aliases in the notebook see the change. Globals rebound, created (``global x``), deleted or
deep-changed come back; the rest do not.
"""

from __future__ import annotations

import inspect
import io
import pickle
import sys
import types
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle

from bulletin_core.pickling import envelope, tensors
from bulletin_core.pickling.pickler import Pickler, human, pack, reason, size_of, type_name

_MISSING = object()
_IMMUTABLE = ("tuple", "frozenset")


class BadCall(Exception):
    """The envelope does not hold a ``(function, args, kwargs)`` call."""


@dataclass
class _Tracked:
    index: int
    kind: str
    obj: Any
    before: Any = None


@dataclass
class Outcome:
    """The packed outcome; notes say what was left out; ``problem`` why the return value
    could not be sent (the call then fails, with its state applied)."""

    packed: envelope.Packed
    notes: list[str]
    problem: str | None = None


class RemoteCall:
    """One call on the worker: ``load``, ``prepare``, run it, ``pack_outcome``."""

    def __init__(self, opened: envelope.Opened) -> None:
        self.header = opened.header
        self._opened = opened
        self.namespace: dict[str, Any] | None = None
        self._memo: dict[int, Any] = {}
        self._tracked: dict[int, _Tracked] = {}
        self._bindings: dict[str, Any] = {}
        self.fn: Any = None
        self.args: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] = {}
        self._default_device = False

    def load(self) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        """Unpickle the call (the only place a worker unpickles user data)."""
        unpickler = envelope.RenamingUnpickler(
            io.BytesIO(self._opened.pickle), buffers=self._opened.buffers
        )
        loaded = unpickler.load()
        if not (isinstance(loaded, tuple) and len(loaded) == 3 and callable(loaded[0])):
            raise BadCall(f"the payload is a pickled {type(loaded).__name__}, not a call")
        fn, args, kwargs = loaded
        self.fn, self.args, self.kwargs = fn, tuple(args), dict(kwargs)
        if self.header.sync and inspect.isfunction(fn):
            self._memo = unpickler.memo.copy()
            self.namespace = fn.__globals__
        return fn, self.args, self.kwargs

    def prepare(self, device: str) -> None:
        """Move tensors and modules to ``device`` and make it torch's default device for the
        call (unless the caller opted out), then take the snapshots changes are measured
        against. ``finish`` undoes the default device."""
        roots: list[Any] = [self.fn, self.args, self.kwargs]
        if self.namespace is not None:
            roots += [v for k, v in self.namespace.items() if not _dunder(k)]
        replaced: dict[int, Any] = {}
        # Everything a call's envelope holds loads onto the CPU: for a CPU call, nothing moves.
        if self.header.move_to_device and device != "cpu":
            replaced = tensors.move(roots, device)
            # Tensors the function makes (torch.randn(...)) land next to the moved ones.
            self._default_device = tensors.set_default_device(device, self.header.torch)
        if self.namespace is None:
            return
        for index, obj in self._memo.items():
            obj = replaced.get(id(obj), obj)
            kind = _kind(obj)
            if kind is not None:
                self._tracked[id(obj)] = _Tracked(index, kind, obj, _snapshot(kind, obj))
        self._memo = {}
        self._bindings = {k: v for k, v in self.namespace.items() if not _dunder(k)}

    def finish(self) -> None:
        """Undo what ``prepare`` changed in the process (the default device)."""
        if self._default_device:
            tensors.set_default_device(None, None)
            self._default_device = False

    def pack_outcome(self, value: Any, error: BaseException | None) -> Outcome:
        """Pickle ``(value, error, changed globals, deleted globals, notes, touched)``; the
        error travels as its own pickle, so one that cannot be loaded there does not take
        the state with it.

        What cannot be pickled is left out and said why: a global or another changed object
        of the notebook (a note), the return value (``Outcome.problem``: the call fails, its
        state still comes back). An outcome over the caller's size limit raises
        ``ResultError``.
        """
        changed, deleted, deep, shallow = self._changes()
        notes: list[str] = []
        problem = None
        # Changed objects of the caller that no changed global reaches any more (an alias,
        # an argument, a closure still holds them): sent as well, so every change arrives.
        touched = [
            t.obj
            for key, t in self._tracked.items()
            if key in shallow and t.kind not in _IMMUTABLE and t.obj is not self.namespace
        ]
        pickled_error = _pickled_error(error)

        def make(file: io.BytesIO, buffers: list[pickle.PickleBuffer]) -> Pickler:
            return _SyncPickler(file, buffers, self._tracked, deep, shallow)

        while True:
            try:
                outcome = (value, pickled_error, changed, deleted, notes, touched)
                packed, _ = pack(outcome, make=make, sync=self.header.sync)
                break
            except Exception as exc:
                culprit = _unpicklable(value, changed, touched, make)
                if culprit is None:
                    raise ResultError(f"the outcome could not be pickled: {reason(exc)}") from None
                if culprit == "":
                    problem = (
                        f"the return value (a {type_name(value)}) could not be pickled: "
                        f"{reason(exc)}; return plain data, tensors or picklable objects"
                    )
                    value = None
                elif isinstance(culprit, str):
                    notes.append(
                        f"global {culprit!r} ({type_name(changed[culprit])}) was changed by the "
                        f"call but cannot be sent back: {reason(exc)}; it keeps its old value"
                    )
                    del changed[culprit]
                else:
                    notes.append(
                        f"a {type_name(touched[culprit])} of the notebook was changed by the call "
                        f"but cannot be sent back: {reason(exc)}; it keeps its old contents"
                    )
                    del touched[culprit]
        limit = self.header.max_result_bytes
        if limit and packed.state_bytes > limit:
            raise ResultError(self._too_large(value, changed, packed.state_bytes, limit))
        return Outcome(packed, notes, problem)

    # ------------------------------------------------------------------ internals

    def _changes(self) -> tuple[dict[str, Any], list[str], set[int], set[int]]:
        if self.namespace is None:
            return {}, [], set(), set()
        shallow, deep = self._changed_objects()
        changed = {}
        for name, value in self.namespace.items():
            if _dunder(name):
                continue
            old = self._bindings.get(name, _MISSING)
            if value is not old or id(value) in deep:
                changed[name] = value
        deleted = [name for name in self._bindings if name not in self.namespace]
        return changed, deleted, deep, shallow

    def _changed_objects(self) -> tuple[set[int], set[int]]:
        """Ids of the tracked objects that changed, and of those that reach one that did."""
        tracked = self._tracked
        shallow = {key for key, t in tracked.items() if not _same(t.kind, t.before, t.obj)}
        parents: dict[int, list[int]] = {}
        for key, t in tracked.items():
            for child in _children(t.kind, t.obj):
                entry = tracked.get(id(child))
                if entry is not None and entry.obj is child:
                    parents.setdefault(id(child), []).append(key)
        deep = set(shallow)
        stack = list(shallow)
        while stack:
            for parent in parents.get(stack.pop(), ()):
                if parent not in deep:
                    deep.add(parent)
                    stack.append(parent)
        return shallow, deep

    def _too_large(self, value: Any, changed: dict[str, Any], total: int, limit: int) -> str:
        sizes = [
            (size_of(obj), f"global {name!r} ({type_name(obj)})") for name, obj in changed.items()
        ]
        sizes.append((size_of(value), f"the return value ({type_name(value)})"))
        sizes.sort(reverse=True)
        biggest = ", ".join(f"{what}: {human(size)}" for size, what in sizes[:3])
        return (
            f"what the call sends back is {human(total)}, over the limit of {human(limit)} "
            f"(max_state_bytes); largest parts: {biggest}. Return less (save big results to "
            "files), or ask the admin to raise the limit."
        )


class ResultError(Exception):
    """The outcome cannot be sent back (unpicklable return value, or too large)."""


class _SyncPickler(Pickler):
    """Pickles the outcome with the caller's objects replaced by references (and the new
    contents of those that changed)."""

    def __init__(
        self,
        file: io.BytesIO,
        buffers: list[pickle.PickleBuffer],
        tracked: dict[int, _Tracked],
        deep: set[int],
        shallow: set[int],
    ) -> None:
        super().__init__(file, buffers)
        self._tracked = tracked
        self._deep = deep
        self._shallow = shallow
        self._sent: set[int] = set()

    def persistent_id(self, obj: Any) -> Any:
        entry = self._tracked.get(id(obj))
        if entry is None or entry.obj is not obj:
            return None
        key = id(obj)
        if key not in self._deep:
            return ("r", entry.index)
        if entry.kind in _IMMUTABLE:
            return None  # re-created with its (updated) contents; memoized after the first
        if key in self._sent:
            return ("r", entry.index)
        self._sent.add(key)
        if entry.kind == "tensor":
            if key not in self._shallow:
                return ("r", entry.index)
            return ("t", entry.index, obj.detach(), obj.requires_grad)
        if entry.kind == "array":
            if key not in self._shallow:
                return ("r", entry.index)
            return ("a", entry.index, obj.view(type(obj)))
        state = _state(entry.kind, obj, entry.before)
        return ("u", entry.index, entry.kind, type(obj).__qualname__, state)


# ------------------------------------------------------------------ kinds of tracked objects


#: The kind of each type whose kind its instances all share (not tensors' and arrays', which
#: depend on the object): a call's memo holds dozens of objects (code, names, helpers of
#: cloudpickle's), looked at on every call of a warm worker. Forgotten past _KINDS_MAX types.
_KINDS: dict[type, str | None] = {}
_KINDS_MAX = 4096


def _kind(obj: Any) -> str | None:
    cls = type(obj)
    try:
        return _KINDS[cls]
    except KeyError:
        pass
    kind = _kind_of(obj)
    if kind not in ("tensor", "array") and not _per_object(cls):
        if len(_KINDS) >= _KINDS_MAX:
            _KINDS.clear()
        _KINDS[cls] = kind
    return kind


def _per_object(cls: type) -> bool:
    """Whether instances of ``cls`` may differ in kind (tensors, arrays: dense or not)."""
    torch = tensors.torch_module()
    if torch is not None and issubclass(cls, torch.Tensor):
        return True
    numpy = sys.modules.get("numpy")
    return numpy is not None and issubclass(cls, numpy.ndarray)


def _kind_of(obj: Any) -> str | None:
    if isinstance(obj, list):
        return "list"
    if isinstance(obj, dict):
        return "dict"
    if isinstance(obj, set):
        return "set"
    if isinstance(obj, bytearray):
        return "bytearray"
    if isinstance(obj, deque):
        return "deque"
    if isinstance(obj, tuple):
        return "tuple"
    if isinstance(obj, frozenset):
        return "frozenset"
    torch = tensors.torch_module()
    if torch is not None and isinstance(obj, torch.Tensor):
        # Sparse, quantized, nested and meta tensors only come back when rebound.
        return "tensor" if tensors.dense(obj) else None
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.ndarray):
        contiguous = obj.flags.c_contiguous or obj.flags.f_contiguous
        return "array" if obj.dtype != object and contiguous else None
    if _plain_instance(obj):
        return "object"
    return None


def _plain_instance(obj: Any) -> bool:
    """An instance reduced by the default ``object.__reduce_ex__`` (so its state is its
    attributes, which can be replaced in place): notebook classes, torch modules and
    optimizers, dataclasses."""
    cls = type(obj)
    if isinstance(obj, (type, types.ModuleType)) or inspect.isroutine(obj):
        return False
    if not (hasattr(obj, "__dict__") or _slots(cls)):
        return False
    return cls.__reduce_ex__ is object.__reduce_ex__ and cls.__reduce__ is object.__reduce__


def _snapshot(kind: str, obj: Any) -> Any:
    if kind in ("list", "tuple", "deque", "set", "frozenset"):
        return list(obj)
    if kind == "dict":
        return list(obj.items())
    if kind == "bytearray":
        return (len(obj), zlib.crc32(obj))
    if kind == "tensor":
        # The version counter misses writes through .data and some kernels' in-place
        # updates (batch norm's running statistics): the contents are fingerprinted too.
        return (
            type(obj),
            obj._version,
            obj.data_ptr(),
            tuple(obj.shape),
            obj.dtype,
            obj.device,
            obj.requires_grad,
            tensors.fingerprint(obj),
        )
    if kind == "array":
        return (obj.shape, obj.dtype, obj.strides, zlib.crc32(obj.ravel(order="K")))
    return _instance_items(obj)


def _same(kind: str, before: Any, obj: Any) -> bool:
    if kind in ("list", "tuple", "deque"):
        return len(obj) == len(before) and all(a is b for a, b in zip(obj, before, strict=True))
    if kind in ("set", "frozenset"):
        return len(obj) == len(before) and {id(x) for x in obj} == {id(x) for x in before}
    if kind in ("dict", "object"):
        now = list(obj.items()) if kind == "dict" else _instance_items(obj)
        return len(now) == len(before) and all(
            a[0] is b[0] and a[1] is b[1] for a, b in zip(now, before, strict=True)
        )
    return bool(before == _snapshot(kind, obj))


def _instance_items(obj: Any) -> list[Any]:
    items = list(getattr(obj, "__dict__", {}).items())
    for slot in _slots(type(obj)):
        items.append((slot, getattr(obj, slot, _MISSING)))
    return items


def _slots(cls: type) -> list[str]:
    names: list[str] = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [s for s in slots if s != "__dict__"]
    return names


def _children(kind: str, obj: Any) -> list[Any]:
    if kind in ("list", "tuple", "deque", "set", "frozenset"):
        return list(obj)
    if kind == "dict":
        return [*obj.keys(), *obj.values()]
    if kind == "object":
        return [value for _, value in _instance_items(obj)]
    return []


def _state(kind: str, obj: Any, before: Any) -> Any:
    if kind in ("list", "deque", "set"):
        return list(obj)
    if kind == "dict":
        return list(obj.items())
    if kind == "bytearray":
        return bytes(obj)
    # An instance: only the attributes the call set or deleted, so attributes its pickled
    # state leaves out (caches, locks) and __setstate__ side effects are not disturbed.
    old = {name: value for name, value in before}
    now = _instance_items(obj)
    changed = {name: value for name, value in now if old.get(name, _MISSING) is not value}
    present = {name for name, value in now if value is not _MISSING}
    deleted = [name for name, value in before if value is not _MISSING and name not in present]
    return {name: v for name, v in changed.items() if v is not _MISSING}, deleted


def _unpicklable(
    value: Any,
    changed: dict[str, Any],
    touched: list[Any],
    make: Callable[[io.BytesIO, list[pickle.PickleBuffer]], Pickler],
) -> str | int | None:
    """What in an outcome cannot be pickled: "" (the value), a global's name, the index of
    a touched object, or None."""
    if not _pickles(value, make):
        return ""
    for name, obj in changed.items():
        if not _pickles(obj, make):
            return name
    for index, obj in enumerate(touched):
        if not _pickles(obj, make):
            return index
    return None


def _pickled_error(error: BaseException | None) -> bytes | None:
    """The exception pickled on its own, if it also unpickles (a custom exception whose
    __init__ takes other arguments than it passes to Exception does not); else None, and
    its type, message and traceback travel as text only."""
    if error is None:
        return None
    try:
        data = cloudpickle.dumps(error, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(data)
    except Exception:
        return None
    return data


def _pickles(obj: Any, make: Callable[[io.BytesIO, list[pickle.PickleBuffer]], Pickler]) -> bool:
    try:
        make(io.BytesIO(), []).dump(obj)
    except Exception:
        return False
    return True


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def open_call(source: bytes | int | str, *, where: str) -> RemoteCall:
    """Open a call envelope (bytes, a file descriptor, which is closed, or a file path) and
    check versions before anything is unpickled. Raises ``envelope.EnvelopeError`` or
    ``VersionSkew``."""
    if isinstance(source, int):
        opened = envelope.open_fd(source, "the call's payload file")
    elif isinstance(source, str):
        opened = envelope.open_file(source)
    else:
        opened = envelope.open_bytes(source)
    problem = envelope.skew(opened.header, they="the notebook", we=where)
    if problem is not None:
        raise VersionSkew(problem)
    return RemoteCall(opened)


class VersionSkew(Exception):
    """Caller and worker cannot exchange pickles (Python, cloudpickle or torch versions)."""
