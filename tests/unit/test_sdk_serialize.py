"""Pickling calls: the payload is the original function with its arguments, and a failure
names the variable that cannot be pickled and says what to do."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from typing import Any

import cloudpickle
import pytest

import sdk
from sdk.serialize import dumps_call, loads

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


def explain(fn: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(sdk.SerializationError) as info:
        dumps_call(fn, args, kwargs)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    return str(info.value)


def test_payload_is_the_original_function_and_its_arguments() -> None:
    fn, args, kwargs = cloudpickle.loads(dumps_call(plain, (2,), {"y": 1}))
    assert (args, kwargs) == ((2,), {"y": 1})
    assert fn(*args, **kwargs) == 7


def test_a_global_lock_is_named() -> None:
    message = explain(uses_lock)
    assert "the global variable 'lock' of uses_lock (a _thread.lock) cannot be pickled" in message
    assert "cannot pickle '_thread.lock' object" in message
    assert "inside the function" in message


def test_a_global_used_through_a_helper_is_named() -> None:
    assert "the global variable 'lock' of helper" in explain(calls_helper)


def test_a_global_used_in_a_comprehension_is_named() -> None:
    assert "the global variable 'lock' of in_a_comprehension" in explain(in_a_comprehension)


def test_a_global_of_a_decorated_helper_is_named() -> None:
    remote_helper = sdk.function()(helper)

    def caller() -> None:
        remote_helper.local()

    assert "the global variable 'lock' of helper" in explain(caller)


def test_a_closure_variable_is_named() -> None:
    event_lock = threading.RLock()

    def closure() -> None:
        with event_lock:
            pass

    assert "the closure variable 'event_lock' of " in explain(closure)
    assert "_thread.RLock" in explain(closure)


def test_an_argument_is_named() -> None:
    message = explain(plain, 1, threading.Lock())
    assert "argument 1 (a _thread.lock) cannot be pickled" in message


def test_a_keyword_argument_is_named() -> None:
    message = explain(plain, 1, y=(i for i in range(3)))
    assert "keyword argument 'y' (a generator) cannot be pickled" in message


def test_a_default_value_is_named() -> None:
    def with_default(x: Any = lock) -> None:
        pass

    assert "default value 0 of a parameter of " in explain(with_default)


def test_results_unpickle() -> None:
    assert loads(bytearray(cloudpickle.dumps({"loss": 0.5}))) == {"loss": 0.5}
