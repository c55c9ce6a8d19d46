"""``@sdk.function()``: turning a notebook function into one that runs on the cluster."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import numbers
import re
import typing
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, NoReturn, ParamSpec, TypeVar, overload

import msgspec
import msgspec.inspect

from bulletin_core import meta, wire
from bulletin_core.pickling.shipped import Shipped
from sdk import _fanout, _serialize
from sdk._call import Call, Prepared, submit, submit_waiting
from sdk._client import Client
from sdk._config import default_client

P = ParamSpec("P")
R = TypeVar("R")

_VALID = (
    "gpus",
    "gpu",
    "gpu_memory_gb",
    "priority",
    "max_retries",
    "timeout",
    "expected_duration",
    "name",
    "move_to_device",
    "sync_globals",
)
MAX_RETRIES = wire.MAX_RETRIES


@dataclasses.dataclass(frozen=True)
class Options:
    """How a function's calls are submitted (validated by ``sdk.function``)."""

    gpus: int | float = 0
    gpu: str | None = None
    gpu_memory_gb: float | None = None
    priority: int = 0
    max_retries: int = 2
    timeout: float | None = None
    expected_duration: float | None = None
    name: str | None = None
    move_to_device: bool = True
    sync_globals: bool = True


class Function(Generic[P, R]):
    """A function that runs on the cluster when called. Made by ``@sdk.function()``.

    Calling it runs the function remotely and blocks until the result is back, printing
    the remote output live. ``.local()`` runs it here, ``.spawn()`` starts it without waiting,
    ``.map()`` runs it once per item.
    """

    # Set by functools.update_wrapper; declared for type checkers.
    __name__: str
    __qualname__: str
    __wrapped__: Callable[P, R]

    def __init__(self, fn: Callable[P, R], options: Options) -> None:
        self._fn = fn
        self._options = options
        #: The call made by the most recent blocking call of this function (its
        #: ``timings``, ``id``...), None before the first.
        self.last_call: Call[R] | None = None
        functools.update_wrapper(self, fn)

    def __repr__(self) -> str:
        return f"<sdk.Function {self._fn.__qualname__} gpus={self._options.gpus}>"

    def __reduce__(self) -> tuple[Callable[..., Function[P, R]], tuple[Any, ...]]:
        # Pickled as the original function plus options, so that a function referencing
        # another decorated function pickles too (the wrapper holds nothing else).
        return Function, (self._fn, self._options)

    @property
    def options(self) -> Options:
        """The options this function's calls are submitted with."""
        return self._options

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run remotely and return the result; Ctrl-C cancels the remote call, and so does
        the gateway when this process stops waiting (it dies: sdk/_liveness.py). The call is
        kept as ``last_call`` (see ``Call.timings``)."""
        client = default_client()
        with client.liveness.held():
            call = self.last_call = self._start(client, args, kwargs, attached=True, wait=True)
            return call.result()

    def local(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call the original function in this process."""
        return self._fn(*args, **kwargs)

    def spawn(self, *args: P.args, **kwargs: P.kwargs) -> Call[R]:
        """Start a remote call and return at once; ``Call.result()`` waits for it and applies
        the globals the call changed (when ``result()`` is first called, not before)."""
        return self._start(default_client(), args, kwargs, attached=False)

    def _start(
        self,
        client: Client,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        *,
        attached: bool,
        wait: bool = False,
    ) -> Call[R]:
        """Submit one call; ``attached``: this process waits for it (its session keeps it
        alive), else it is detached and outlives its caller. ``wait``: the submission also
        waits for its first news (one request for a short call, result included)."""
        prepared = self._prepare(
            client, args, kwargs, sync=self._options.sync_globals, attached=attached
        )
        try:
            if wait:
                news = submit_waiting(client, prepared.spec)
                return Call(news.ids[0], client, prepared=prepared, news=news)
            [invocation_id] = submit(client, [prepared.spec])
        except BaseException:
            prepared.discard()
            raise
        return Call(invocation_id, client, prepared=prepared)

    def map(self, *iterables: Iterable[Any], return_exceptions: bool = False) -> Iterator[Any]:
        """Call the function once per item of ``zip(*iterables)``; yield results in order.

        Lazy like the builtin ``map``: calls are submitted (in batches) as the results are
        consumed. A failed item raises its exception when reached, unless
        ``return_exceptions`` is true, in which case the exception object is yielded.
        Unfinished calls are cancelled when the iteration stops early (an exception, Ctrl-C,
        or a ``break``). Globals the function changes are not brought back by ``map`` (the
        items run in parallel: there is no one order to apply them in); return what you need.
        Items' output streams into the caller for the next 256 unfinished items (those whose
        results come next); a later item's output comes once it is among them.
        """
        if not iterables:
            raise TypeError("map() needs at least one iterable")
        client = default_client()
        calls = self._items(client, iterables)
        return _fanout.run(client, calls, return_exceptions=return_exceptions)

    def _items(self, client: Client, iterables: tuple[Iterable[Any], ...]) -> Iterator[Prepared]:
        """A map's calls, prepared as they are needed; the function is pickled once, with
        the first item (unless its pickle holds tensors or arrays: then with every item)."""
        shipped: Shipped | None = None
        for n, items in enumerate(zip(*iterables, strict=False)):
            if n == 0:
                shipped = _serialize.ship_function(self._fn, uuid.uuid4().hex)
            yield self._prepare(client, items, {}, sync=False, attached=True, shipped=shipped)

    def register(
        self, name: str | None = None, *, visibility: str = "private", description: str = ""
    ) -> wire.FunctionInfo:
        """Store this function on the cluster by value under ``name`` (default: the
        function's ``name`` option or its ``__name__``), so that it can be invoked with plain
        JSON over HTTP (``POST /v1/functions/{name}/invoke``) by you, or, with
        ``visibility="group"`` or ``"cluster"``, by the users of your group or of the whole
        cluster. Returns its description; ``version`` is a hash of the code and resources, so
        registering unchanged code again changes nothing, and older versions stay callable
        by version. Globals the function uses are captured as they are now; invocations
        never send state back (use a plain call for that)."""
        name = name if name is not None else (self._options.name or self._fn.__name__)
        try:
            name = msgspec.convert(name, wire.FunctionName)
        except msgspec.ValidationError:
            raise ValueError(f"cannot register as {name!r}: {wire.SLUG_RULE}") from None
        if visibility not in (kinds := typing.get_args(wire.Visibility)):
            raise ValueError(
                f"visibility must be one of {', '.join(map(repr, kinds))}, not {visibility!r}"
            )
        client = default_client()
        info = client.cluster()
        options = self._options
        sent = _serialize.pack_call(
            self._fn,
            (),
            {},
            max_bytes=info.max_state_bytes,
            sync=False,
            move_to_device=options.move_to_device,
            shared_results=False,
            max_result_bytes=info.max_state_bytes,
        )
        registration = wire.FunctionRegistration(
            resources=wire.FunctionResources(
                gpus=options.gpus,
                gpu_model=options.gpu,
                gpu_memory_mb=_mib(options.gpu_memory_gb),
                timeout_s=options.timeout,
                max_retries=options.max_retries,
                expected_s=options.expected_duration,
            ),
            visibility=visibility,  # type: ignore[arg-type]
            description=description,
        )
        packed = sent.packed
        if packed.nbytes <= min(client.inline_limit, info.inline_limit):
            registration = msgspec.structs.replace(registration, payload=packed.tobytes())
        else:
            blob = client.put_blob(packed.pieces, packed.nbytes)
            registration = msgspec.structs.replace(registration, payload_blob=blob.id)
        return client.register_function(name, registration)

    def _prepare(
        self,
        client: Client,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        *,
        sync: bool,
        attached: bool = False,
        shipped: Shipped | None = None,
    ) -> Prepared:
        info = client.cluster()
        root = client.shared_dir()
        options = self._options
        sent = _serialize.pack_call(
            self._fn,
            args,
            kwargs,
            max_bytes=info.max_state_bytes,
            sync=sync,
            move_to_device=options.move_to_device,
            shared_results=root is not None,
            max_result_bytes=info.max_state_bytes,
            shipped=shipped,
        )
        spec = wire.CallSpec(
            idempotency_key=uuid.uuid4().hex,
            function_name=options.name or self._fn.__qualname__,
            gpus=options.gpus,
            max_retries=options.max_retries,
            timeout_s=options.timeout,
            priority=options.priority,
            gpu_model=options.gpu,
            gpu_memory_mb=_mib(options.gpu_memory_gb),
            expected_s=options.expected_duration,
            caller_session=client.session if attached else None,
        )
        packed = sent.packed
        size = packed.nbytes
        if size <= min(client.inline_limit, info.inline_limit):
            return Prepared(_replace(spec, payload=packed.tobytes()), sent.sync)
        if root is not None and (written := client.write_payload_file(packed.pieces())):
            relative, path = written
            spec = _replace(spec, payload_file=relative, payload_size=size)
            return Prepared(spec, sent.sync, path)
        blob = client.put_blob(packed.pieces, size)
        return Prepared(_replace(spec, payload_blob=blob.id), sent.sync)


def _mib(gigabytes: float | None) -> int | None:
    """GB as on a card's label (10^9 bytes: an "80GB" H100 has 81,559 MiB) in MiB."""
    return None if gigabytes is None else math.floor(gigabytes * 1e9 / (1 << 20))


def _replace(spec: wire.CallSpec, **changes: Any) -> wire.CallSpec:
    return msgspec.structs.replace(spec, **changes)


@overload
def function(
    *,
    gpus: float = 0,
    gpu: str | Sequence[str] | None = None,
    gpu_memory_gb: float | None = None,
    priority: int = 0,
    max_retries: int = 2,
    timeout: float | None = None,
    expected_duration: float | None = None,
    name: str | None = None,
    move_to_device: bool = True,
    sync_globals: bool = True,
) -> Callable[[Callable[P, R]], Function[P, R]]: ...


@overload
def function(fn: Callable[..., Any], /) -> NoReturn: ...


def function(*args: Any, **kwargs: Any) -> Any:
    """Make a function run on the cluster when called.

    ``gpus``: GPUs per call (0: CPU only), all on one node; or part of one GPU (``0.25``),
    which the call shares with other such calls of yours (of anyone's, where the cluster
    allows it), its CUDA memory capped at that part (torch's per-process memory fraction;
    ``BULLETIN_GPU_SHARE`` in its environment says the part). ``gpu``: only GPUs whose model
    name contains this (``"A100"``, ``"H100"``), or one of a list (``["A100", "H100"]``: each
    GPU is one of them). ``gpu_memory_gb``: only GPUs with at least
    this much memory, in GB as on the card's label (``80`` takes an 80GB H100).
    ``priority`` (default 0): higher goes first, before fair share; users may lower it (to
    -1000) to let others go first, only administrators raise it (to 1000).
    ``expected_duration``: seconds the call is expected to take (lets the scheduler
    backfill; the ``timeout`` serves when not given). ``max_retries``: re-runs after
    infrastructure failures (node lost, worker died), 0 to 10; an exception raised by the
    function itself is never retried. ``timeout``: seconds a call may run, or None.
    ``name``: the name shown in listings and the dashboard (default: the function's
    qualified name).
    ``move_to_device``: move tensors and modules among the arguments and globals to the
    call's GPU before it runs (they always come back on the CPU). ``sync_globals``: bring
    back the globals the call changed and apply them here (see docs/notebook-state.md).

    Arguments are checked here, when the decorator is applied::

        @sdk.function(gpus=1)
        def train_step(x): ...
    """
    if args:
        raise TypeError(_positional_message(args))
    options = _options(kwargs)

    def decorate(fn: Callable[P, R]) -> Function[P, R]:
        return Function(_checked_target(fn), options)

    return decorate


def _positional_message(args: tuple[Any, ...]) -> str:
    if len(args) == 1 and callable(args[0]):
        return (
            "@sdk.function needs parentheses: use @sdk.function() with parentheses, "
            "e.g. @sdk.function(gpus=1)."
        )
    return (
        f"sdk.function() takes keyword-only arguments ({', '.join(_VALID)}), "
        f"but {len(args)} positional argument(s) were given."
    )


def _options(kwargs: Mapping[str, Any]) -> Options:
    for key in kwargs:
        if key not in _VALID:
            raise TypeError(_unknown_message(key))
    return Options(
        gpus=_gpus(kwargs.get("gpus", 0)),
        gpu=_gpu_model(kwargs.get("gpu")),
        gpu_memory_gb=_seconds_or_none("gpu_memory_gb", kwargs.get("gpu_memory_gb"), "GiB"),
        priority=_priority(kwargs.get("priority", 0)),
        max_retries=_max_retries(kwargs.get("max_retries", 2)),
        timeout=_timeout(kwargs.get("timeout")),
        expected_duration=_seconds_or_none(
            "expected_duration", kwargs.get("expected_duration"), "seconds"
        ),
        name=_name(kwargs.get("name")),
        move_to_device=_flag("move_to_device", kwargs.get("move_to_device", True)),
        sync_globals=_flag("sync_globals", kwargs.get("sync_globals", True)),
    )


def _unknown_message(key: str) -> str:
    close = difflib.get_close_matches(key, _VALID, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return (
        f"sdk.function() got an unexpected keyword argument {key!r}.{hint} "
        f"Valid arguments: {', '.join(_VALID)}."
    )


def _whole(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _checked(name: str, value: Any, kind: Any, unit: str = "") -> Any:
    """``value`` if it passes the gateway's own rule for it: ``kind``, a type of
    :mod:`bulletin_core.wire` whose ``msgspec.Meta`` the gateway decodes with (one source for both
    sides); else a ValueError that says the rule."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError:
        words = meta.rule(msgspec.inspect.type_info(kind))
        raise ValueError(f"{name} must be {words}{unit}, got {value!r}") from None


def _gpus(value: Any) -> int | float:
    if isinstance(value, float) and not isinstance(value, bool) and 0 < value < 1:
        return float(_checked("gpus", value, wire.GpuShare))  # part of one GPU
    if not _whole(value):
        raise TypeError(
            f"gpus must be a whole number of GPUs, or part of one between 0 and 1 "
            f"(gpus=0.25, at least {wire.MIN_GPU_SHARE:g}), got {value!r}"
        )
    return int(_checked("gpus", int(value), wire.GpuCount))


def _max_retries(value: Any) -> int:
    if not _whole(value):
        raise TypeError(f"max_retries must be an int, got {value!r}")
    return int(_checked("max_retries", int(value), wire.Retries))


def _timeout(value: Any) -> float | None:
    return _seconds_or_none("timeout", value, "seconds")


def _seconds_or_none(name: str, value: Any, unit: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of {unit} or None, got {value!r}")
    return float(_checked(name, float(value), wire.Seconds, f" {unit} (or None)"))


def _gpu_model(value: Any) -> str | None:
    """``gpu=``: one model, or a list of models any of which will do (sent as ``A|B``)."""
    if value is None:
        return None
    if _whole(value):
        raise TypeError(
            f"gpu names a GPU model, such as gpu='A100'; for a number of GPUs use gpus={value}"
        )
    models = list(value) if isinstance(value, list | tuple) else [value]
    if not models or len(models) > wire.MAX_GPU_MODELS:
        raise ValueError(
            f"gpu may list 1 to {wire.MAX_GPU_MODELS} GPU models (any of them will do), "
            f"got {len(models)}"
        )
    for model in models:
        if not isinstance(model, str) or not re.fullmatch(wire.ONE_GPU_MODEL, model):
            raise ValueError(
                "gpu must be part of a GPU model name such as 'A100', or a list of them such "
                "as ['A100', 'H100'] (letters, digits, spaces, '.', '_', '-'; at most 64 "
                f"each), got {value!r}"
            )
    return "|".join(models)


def _priority(value: Any) -> int:
    if not _whole(value):
        raise TypeError(f"priority must be an int, got {value!r}")
    return int(_checked("priority", int(value), wire.Priority))


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def _name(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"name must be a string or None, got {value!r}")
    if not value.strip():
        raise ValueError("name must be a non-empty string or None")
    return value


def _checked_target(fn: Any) -> Any:
    """Only plain synchronous functions can be shipped and called remotely."""
    if isinstance(fn, Function):
        raise TypeError(f"{fn!r} is already decorated with @sdk.function()")
    if not inspect.isfunction(fn):
        raise TypeError(
            f"@sdk.function() decorates functions (def or lambda), not {type(fn).__name__} {fn!r}"
        )
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise TypeError(f"@sdk.function() does not support async functions yet: {fn.__qualname__}")
    if inspect.isgeneratorfunction(fn):
        raise TypeError(
            f"@sdk.function() does not support generator functions: {fn.__qualname__} "
            "yields; return a list instead."
        )
    return fn


def functions(owner: str | None = None) -> list[wire.FunctionInfo]:
    """The functions you registered (``Function.register``), the latest version of each by
    name; with ``owner``, those of that user that are shared with you."""
    return default_client().functions(owner)


def unregister(name: str) -> None:
    """Remove every version of your registered function ``name``. Invocations already
    submitted still run."""
    default_client().unregister_function(name)
