"""Pickling calls: the payload is the original function with its arguments, and a failure
names the variable that cannot be pickled and says what to do."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import cloudpickle
import pytest

import sdk
from bulletin_core.pickling import caller, remote
from sdk._serialize import pack_call

lock = threading.Lock()
scale = 3


def uses_lock() -> int:
    with lock:
        return 1


def helper() -> None:
    with lock:
        pass


def calls_helper() -> None:
    helper()


def in_a_comprehension() -> list[bool]:
    return [lock.locked() for _ in range(2)]


def plain(x: int, *, y: int = 0) -> int:
    return x * scale + y


@pytest.fixture(autouse=True)
def by_value() -> Iterator[None]:
    """Pickle this module's functions by value, as a notebook's ``__main__`` would be."""
    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    yield
    cloudpickle.unregister_pickle_by_value(module)


def dumps_call(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], limit: int = 0) -> bytes:
    return pack_call(fn, args, kwargs, max_bytes=limit, sync=False).packed.tobytes()


def explain(fn: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(sdk.SerializationError) as info:
        dumps_call(fn, args, kwargs)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    return str(info.value)


def test_payload_is_the_original_function_and_its_arguments() -> None:
    fn, args, kwargs = remote.open_call(dumps_call(plain, (2,), {"y": 1}), where="here").load()
    assert (args, kwargs) == ((2,), {"y": 1})
    assert fn(*args, **kwargs) == 7


def test_a_global_lock_is_named() -> None:
    message = explain(uses_lock)
    assert message.startswith("global 'lock' (_thread.lock) cannot be sent to the node: ")
    assert "cannot pickle '_thread.lock' object" in message
    assert "inside the function" in message


def test_a_global_used_through_a_helper_is_named() -> None:
    assert "global 'lock' (used by helper) (_thread.lock)" in explain(calls_helper)


def test_a_global_used_in_a_comprehension_is_named() -> None:
    assert "global 'lock' (_thread.lock) cannot" in explain(in_a_comprehension)


def test_a_global_of_a_decorated_helper_is_named() -> None:
    remote_helper = sdk.function()(helper)

    def caller() -> None:
        remote_helper.local()

    assert "global 'lock' (used by helper)" in explain(caller)


def test_a_closure_variable_is_named() -> None:
    event_lock = threading.RLock()

    def closure() -> None:
        with event_lock:
            pass

    assert "closure variable 'event_lock' of " in explain(closure)
    assert "_thread.RLock" in explain(closure)


def test_an_argument_is_named() -> None:
    message = explain(plain, 1, threading.Lock())
    assert "argument 1 (_thread.lock) cannot be sent to the node" in message


def test_a_keyword_argument_is_named() -> None:
    message = explain(plain, 1, y=(i for i in range(3)))
    assert "keyword argument 'y' (generator) cannot be sent to the node" in message


def test_a_default_value_is_named() -> None:
    def with_default(x: Any = lock) -> None:
        pass

    assert "default value 0 of a parameter of " in explain(with_default)


def test_a_sqlite_connection_is_named_with_its_type() -> None:
    import sqlite3

    conn = sqlite3.connect(":memory:")
    try:

        def query() -> Any:
            return conn.execute("select 1").fetchall()

        message = explain(query)
    finally:
        conn.close()
    assert "closure variable 'conn' of " in message
    assert "(sqlite3.Connection) cannot be sent to the node: TypeError" in message


def test_a_call_over_the_limit_names_its_biggest_parts() -> None:
    big = bytearray(3 << 20)

    def uses(x: Any) -> int:
        return len(big) + len(x)

    with pytest.raises(sdk.StateTooLarge) as info:
        dumps_call(uses, (b"y" * (1 << 20),), {}, limit=2 << 20)
    message = str(info.value)
    assert "over the cluster's limit of 2.0 MiB (max_state_bytes)" in message
    assert "closure variable 'big' of " in message and "(bytearray): 3.0 MiB" in message
    assert "argument 0 (bytes): 1.0 MiB" in message


def test_an_unpicklable_attribute_of_a_local_helper_module_is_named(tmp_path: Any) -> None:
    (tmp_path / "lab_helpers_q.py").write_text(
        "import threading\nLOCK = threading.Lock()\n\ndef scale(x):\n    return 2 * x\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import lab_helpers_q  # type: ignore[import-not-found]

        def uses_module(x: int) -> int:
            return int(lab_helpers_q.scale(x))

        message = explain(uses_module, 1)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("lab_helpers_q", None)
        cloudpickle.unregister_pickle_by_value(lab_helpers_q)
    assert message.startswith(
        "lab_helpers_q.LOCK (of local module 'lab_helpers_q') (_thread.lock) cannot be sent"
    )


def test_threads_that_pickle_at_once_all_ship_a_new_local_module_by_value(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deciding whether a module is local takes a while (the first time, it reads the
    installed distributions): a thread that calls meanwhile waits for the decision instead of
    pickling the module by reference, which the node cannot import (bad_payload)."""
    (tmp_path / "lab_helpers_t.py").write_text("FACTOR = 3\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import lab_helpers_t  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(tmp_path))
    decide = caller._is_local

    def slowly(name: str, module: Any) -> bool:
        if name == "lab_helpers_t":
            time.sleep(0.2)
        return decide(name, module)

    monkeypatch.setattr(caller, "_is_local", slowly)
    registered = cloudpickle.cloudpickle._is_registered_pickle_by_value
    by_value: list[bool] = []

    def ship() -> None:
        caller.ship_local_modules()
        by_value.append(registered(lab_helpers_t))

    threads = [threading.Thread(target=ship) for _ in range(8)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
    finally:
        sys.modules.pop("lab_helpers_t", None)
        cloudpickle.unregister_pickle_by_value(lab_helpers_t)
    assert by_value == [True] * 8
