"""The caller's side of a call: pickle it (keeping what names its objects), and load what
comes back, applying the changed state in place and the changed globals to the namespace.
See ``remote.py`` for how changes are found and sent."""

from __future__ import annotations

import contextlib
import importlib.metadata
import inspect
import io
import os
import pickle
import site
import sys
import sysconfig
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from bulletin_core.pickling import envelope
from bulletin_core.pickling.pickler import pack
from bulletin_core.pickling.shipped import Shipped

MISSING: Any = type("Missing", (), {"__repr__": lambda self: "<unbound>"})()
#: Our own packages: always pickled by reference (the envelope's helpers live in them).
_OURS = frozenset({"bulletin_core", "bulletin", "sdk", "nodelet", "gateway", "scheduler"})


@dataclass
class Sync:
    """What a call that syncs globals keeps until its outcome is applied."""

    memo: dict[int, Any]  # the pickler's memo: index -> the caller's object
    namespace: dict[str, Any]  # the function's globals (the notebook's namespace)
    shipped: dict[str, Any]  # names the call may change -> their value when it was sent


@dataclass
class Sent:
    packed: envelope.Packed
    sync: Sync | None


@dataclass
class Returned:
    """A loaded outcome; ``changed`` is what the call sent back for each global."""

    value: Any
    error: BaseException | None
    changed: dict[str, Any]
    deleted: list[str]
    notes: list[str] = field(default_factory=list)


def pack_call(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    sync: bool,
    shipped: Shipped | None = None,
    **flags: Any,
) -> Sent:
    """Pickle a call. With ``sync``, keep what is needed to apply its changes later. With
    ``shipped`` (``fn`` pickled already, for a map's items), those bytes stand for ``fn``."""
    if shipped is not None:
        return Sent(pack((shipped, args, kwargs), sync=False, **flags)[0], None)
    ship_local_modules()
    sync = sync and inspect.isfunction(fn) and not _by_reference(fn)
    packed, pickler = pack((fn, args, kwargs), sync=sync, **flags)
    if not sync:
        return Sent(packed, None)
    # Not the temporaries that hold tensor memory for the buffers (a GPU tensor's CPU copy):
    # only objects that were the notebook's can be named by what comes back.
    memo = {index: obj for index, obj in pickler.memo.copy().values() if not _holds_buffer(obj)}
    namespace = fn.__globals__
    names: set[str] = set()
    for obj in memo.values():
        if inspect.isfunction(obj) and obj.__globals__ is namespace:
            names.update(code_names(obj.__code__))
    values = {name: namespace.get(name, MISSING) for name in names}
    return Sent(packed, Sync(memo, namespace, values))


def ship_function(fn: Callable[..., Any], token: str) -> Shipped | None:
    """``fn`` pickled once for the items of one map (``token``), or None when its pickle
    holds out-of-band buffers (tensors, arrays: each item then pickles the function itself).
    Raises what pickling ``fn`` raises."""
    ship_local_modules()
    packed, _ = pack(fn, sync=False)
    if packed.buffers:
        return None
    return Shipped(token, packed.pickle)


def _holds_buffer(obj: Any) -> bool:
    if isinstance(obj, pickle.PickleBuffer):
        return True
    return type(obj) is tuple and any(isinstance(item, pickle.PickleBuffer) for item in obj)


def code_names(code: types.CodeType) -> Iterator[str]:
    """Global (and attribute) names a code object and the code nested in it use."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from code_names(const)


def load_outcome(opened: envelope.Opened, sync: Sync | None) -> Returned:
    """Unpickle an outcome; apply its state changes (in place) and globals (to the namespace)."""
    unpickler = _Unpickler(io.BytesIO(opened.pickle), opened.buffers, sync)
    value, pickled_error, changed, deleted, notes, _touched = unpickler.load()
    # Containers keyed by objects are filled last, after those objects got their state.
    for _, apply in sorted(unpickler.deferred, key=lambda item: item[0]):
        apply()
    returned = Returned(value, _error(pickled_error), changed, deleted, list(notes))
    if sync is not None:
        returned.notes += apply_globals(sync, changed, deleted)
    return returned


def _error(data: bytes | None) -> BaseException | None:
    """The call's exception, or None when it did not raise or cannot be loaded here (its
    text still describes it)."""
    if data is None:
        return None
    try:
        error = pickle.loads(data)
    except Exception:
        return None
    return error if isinstance(error, BaseException) else None


def apply_globals(sync: Sync, changed: dict[str, Any], deleted: list[str]) -> list[str]:
    """Bind the changed globals in the namespace. A name the notebook itself rebound while the
    call ran keeps the notebook's value (a note says so). Returns the notes."""
    namespace, notes = sync.namespace, []
    for name, value in changed.items():
        if _rebound_meanwhile(sync, name):
            notes.append(
                f"global {name!r} was changed in the notebook while the call ran: kept the "
                f"notebook's value; the call's value is in call.remote_globals[{name!r}]"
            )
            continue
        namespace[name] = _at_home(value, namespace)
    for name in deleted:
        if _rebound_meanwhile(sync, name):
            notes.append(f"global {name!r} was deleted by the call but changed here meanwhile")
        else:
            namespace.pop(name, None)
    return notes


def _rebound_meanwhile(sync: Sync, name: str) -> bool:
    return name in sync.shipped and sync.namespace.get(name, MISSING) is not sync.shipped[name]


def _at_home(value: Any, namespace: dict[str, Any]) -> Any:
    """A function the call defined comes back with a private copy of its globals: rebuild
    it over the notebook's namespace, as if it had been defined here."""
    if not inspect.isfunction(value) or value.__globals__ is namespace:
        return value
    if value.__globals__.get("__name__") != namespace.get("__name__"):
        return value
    rebuilt = types.FunctionType(
        value.__code__, namespace, value.__name__, value.__defaults__, value.__closure__
    )
    rebuilt.__kwdefaults__ = value.__kwdefaults__
    rebuilt.__qualname__ = value.__qualname__
    rebuilt.__doc__ = value.__doc__
    rebuilt.__dict__.update(value.__dict__)
    rebuilt.__module__ = value.__module__
    return rebuilt


class SyncError(pickle.UnpicklingError):
    """The outcome refers to objects this process does not have."""


class _Unpickler(envelope.RenamingUnpickler):
    def __init__(self, file: io.BytesIO, buffers: list[memoryview], sync: Sync | None) -> None:
        super().__init__(file, buffers=buffers)
        self._sync = sync
        self.deferred: list[tuple[int, Callable[[], None]]] = []

    def persistent_load(self, pid: Any) -> Any:
        if self._sync is None:
            raise SyncError(
                "the result refers to notebook state of the process that submitted the call "
                "(for instance it returns a global it changed): fetch it from that process"
            )
        tag, index = pid[0], pid[1]
        try:
            obj = self._sync.memo[index]
        except KeyError:
            raise SyncError(f"the result refers to object #{index}, which was not sent") from None
        if tag == "r":
            return obj
        if tag == "t":
            self.deferred.append((0, lambda: _set_tensor(obj, pid[2], pid[3])))
            return obj
        if tag == "a":
            new = pid[2]
            if obj.shape != new.shape or obj.dtype != new.dtype or not obj.flags.writeable:
                return new  # cannot be updated in place: the new array replaces it
            self.deferred.append((0, lambda: obj.__setitem__(Ellipsis, new)))
            return obj
        kind, type_name, state = pid[2], pid[3], pid[4]
        if type(obj).__qualname__ != type_name:
            raise SyncError(
                f"the result updates object #{index} as a {type_name}, but it is a "
                f"{type(obj).__qualname__} here"
            )
        order = 1 if kind in ("dict", "set") else 0
        self.deferred.append((order, lambda: _APPLY[kind](obj, state)))
        return obj


def _set_tensor(tensor: Any, new: Any, requires_grad: bool) -> None:
    tensor.data = new
    if tensor.is_leaf and tensor.requires_grad != requires_grad:
        tensor.requires_grad_(requires_grad)


def _set_list(obj: Any, state: list[Any]) -> None:
    obj[:] = state


def _set_dict(obj: Any, state: list[tuple[Any, Any]]) -> None:
    obj.clear()
    for key, value in state:  # not update(): Counter.update adds counts
        obj[key] = value


def _set_set(obj: Any, state: list[Any]) -> None:
    obj.clear()
    obj.update(state)


def _set_deque(obj: Any, state: list[Any]) -> None:
    obj.clear()
    obj.extend(state)


def _set_object(obj: Any, state: tuple[dict[str, Any], list[str]]) -> None:
    """Set the attributes the call set and delete those it deleted, bypassing __setattr__
    and __setstate__ as unpickling does; the others are left alone."""
    changed, deleted = state
    attributes = getattr(obj, "__dict__", None)
    for name, value in changed.items():
        if attributes is not None and not _is_slot(obj, name):
            attributes[name] = value
        else:
            object.__setattr__(obj, name, value)
    for name in deleted:
        if attributes is not None and name in attributes:
            del attributes[name]
        else:
            with contextlib.suppress(AttributeError):
                object.__delattr__(obj, name)


def _is_slot(obj: Any, name: str) -> bool:
    return any(name in (getattr(k, "__slots__", ()) or ()) for k in type(obj).__mro__)


_APPLY: dict[str, Callable[[Any, Any], None]] = {
    "list": _set_list,
    "bytearray": _set_list,
    "dict": _set_dict,
    "set": _set_set,
    "deque": _set_deque,
    "object": _set_object,
}


# ------------------------------------------------------------------ local helper modules

_checked: set[str] = set()
#: Every name of sys.modules looked at so far: a call looks at the ones imported since.
_seen: set[str] = set()
_installed: set[str] | None = None
#: Held while modules are looked at: a module another thread has not decided on yet must
#: not be pickled meanwhile (it would go by reference, and the node cannot import it).
_shipping = threading.Lock()


def ship_local_modules() -> None:
    """Have cloudpickle ship by value the modules imported here that are not installed:
    helper modules next to the notebook, which the nodes cannot import. Thread-safe: when it
    returns, every module imported before it was called is decided on."""
    with _shipping:
        new = sys.modules.keys() - _seen
        _seen.update(new)
        for name in new:
            top = name.partition(".")[0]
            if top in _checked:
                continue
            module = sys.modules.get(top)
            if module is not None and _is_local(top, module):
                cloudpickle.register_pickle_by_value(module)
            # Only once decided: until then, other threads wait above instead of skipping it.
            _checked.add(top)


def _is_local(name: str, module: types.ModuleType) -> bool:
    if name in _OURS or name == "__main__" or name in sys.stdlib_module_names:
        return False
    path = getattr(module, "__file__", None)
    if not path:
        return False
    path = os.path.realpath(path)
    if any(path.startswith(root + os.sep) for root in _installed_roots()):
        return False
    return name not in _distribution_packages()


def _installed_roots() -> list[str]:
    roots = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.update(site.getsitepackages())
    roots.add(site.getusersitepackages())
    return [os.path.realpath(root) for root in roots]


def _distribution_packages() -> set[str]:
    global _installed
    if _installed is None:
        _installed = set(importlib.metadata.packages_distributions())
    return _installed


def _by_reference(fn: Callable[..., Any]) -> bool:
    """Whether cloudpickle pickles ``fn`` by reference (an importable module's function)."""
    check = getattr(cloudpickle.cloudpickle, "_should_pickle_by_reference", None)
    if check is None:  # pragma: no cover - older cloudpickle
        return getattr(fn, "__module__", "__main__") != "__main__"
    return bool(check(fn))
