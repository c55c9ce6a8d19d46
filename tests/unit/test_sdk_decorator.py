"""``@sdk.function()``: arguments are checked when the decorator is applied, with messages
that say what to do; the result wraps the function, runs it locally on demand and pickles."""

from __future__ import annotations

import functools
import pickle
import re
from typing import Any

import cloudpickle
import pytest

import sdk
from sdk._function import Options


def double(x: int) -> int:
    """Twice x."""
    return 2 * x


remote_double = sdk.function(gpus=1, max_retries=3, timeout=5, name="dbl")(double)


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decorating never needs a cluster: make sure none could be found."""
    for name in ("BULLETIN_CONFIG", "BULLETIN_URL", "BULLETIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("sdk._config._default", None)


def test_without_parentheses_says_to_add_them() -> None:
    with pytest.raises(TypeError, match=re.escape("use @sdk.function() with parentheses")):

        @sdk.function
        def f() -> None:
            pass


def test_positional_arguments_are_refused_as_keyword_only() -> None:
    with pytest.raises(TypeError, match="keyword-only") as info:
        sdk.function(1)  # type: ignore[call-overload]
    assert "gpus" in str(info.value)


@pytest.mark.parametrize(("key", "suggestion"), [("gpuss", "gpus"), ("retries", "max_retries")])
def test_unknown_keyword_suggests_the_closest(key: str, suggestion: str) -> None:
    with pytest.raises(TypeError) as info:
        sdk.function(**{key: 1})  # type: ignore[call-overload]
    message = str(info.value)
    assert repr(key) in message
    assert f"Did you mean {suggestion!r}?" in message
    valid = (
        "gpus, gpu, gpu_memory_gb, priority, max_retries, timeout, expected_duration, name, "
        "move_to_device, sync_globals"
    )
    assert f"Valid arguments: {valid}." in message


def test_unknown_keyword_without_a_close_one_lists_the_valid() -> None:
    with pytest.raises(TypeError) as info:
        sdk.function(queue="long")  # type: ignore[call-overload]
    assert "'queue'" in str(info.value)
    assert "Did you mean" not in str(info.value)
    assert "gpus, gpu, gpu_memory_gb, priority, max_retries, timeout" in str(info.value)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"gpu": 1}, TypeError, "gpu names a GPU model, such as gpu='A100'; for a number of GPUs"),
        ({"gpu": "A100; drop"}, ValueError, "gpu must be part of a GPU model name"),
        ({"gpu": "A100|H100"}, ValueError, "or a list of them such as ['A100', 'H100']"),
        ({"gpu": ["A100", ""]}, ValueError, "gpu must be part of a GPU model name"),
        ({"gpu": ["A100", 80]}, ValueError, "gpu must be part of a GPU model name"),
        ({"gpu": []}, ValueError, "gpu may list 1 to 8 GPU models (any of them will do), got 0"),
        ({"gpu": ["A100"] * 9}, ValueError, "gpu may list 1 to 8 GPU models"),
        (
            {"gpu_memory_gb": 0},
            ValueError,
            "gpu_memory_gb must be above 0 and at most 1000000000 GiB (or None), got 0",
        ),
        ({"priority": 5000}, ValueError, "priority must be at least -1000 and at most 1000"),
        ({"priority": 1.5}, TypeError, "priority must be an int"),
        (
            {"expected_duration": -1},
            ValueError,
            "expected_duration must be above 0 and at most 1000000000 seconds",
        ),
    ],
)
def test_scheduling_options_are_checked(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        sdk.function(**options)


def test_scheduling_options_are_kept() -> None:
    fn = sdk.function(gpus=2, gpu="A100", gpu_memory_gb=39.5, priority=7, expected_duration=60)(
        lambda: None
    )
    options = fn._options
    assert (options.gpu, options.gpu_memory_gb, options.priority) == ("A100", 39.5, 7)
    assert options.expected_duration == 60.0
    either = sdk.function(gpus=1, gpu=["V100M16", "V100M32"])(lambda: None)
    assert either._options.gpu == "V100M16|V100M32"  # the wire's form: any of them
    assert sdk.function(gpu=("H100",))(lambda: None)._options.gpu == "H100"


def test_negative_gpus() -> None:
    rule = "gpus must be at least 0 and at most 2147483647, got -1"
    with pytest.raises(ValueError, match=re.escape(rule)):
        sdk.function(gpus=-1)


@pytest.mark.parametrize("bad", [True, 1.0, 2.5, "1", None])
def test_gpus_must_be_whole_or_part_of_one(bad: Any) -> None:
    with pytest.raises(TypeError, match="gpus must be a whole number of GPUs, or part of one"):
        sdk.function(gpus=bad)


def test_part_of_a_gpu_is_sent_as_asked() -> None:
    assert sdk.function(gpus=0.25)(lambda: None)._options.gpus == 0.25


@pytest.mark.parametrize("bad", [-1, 11])
def test_max_retries_range(bad: int) -> None:
    rule = f"max_retries must be at least 0 and at most 10, got {bad}"
    with pytest.raises(ValueError, match=rule):
        sdk.function(max_retries=bad)


@pytest.mark.parametrize("bad", [False, 2.0, "2"])
def test_max_retries_must_be_an_int(bad: Any) -> None:
    with pytest.raises(TypeError, match="max_retries must be an int"):
        sdk.function(max_retries=bad)


@pytest.mark.parametrize("bad", [0, -3, float("inf"), float("nan")])
def test_timeout_must_be_positive(bad: float) -> None:
    rule = "timeout must be above 0 and at most 1000000000 seconds (or None)"
    with pytest.raises(ValueError, match=re.escape(rule)):
        sdk.function(timeout=bad)


@pytest.mark.parametrize("bad", [True, "10", [1]])
def test_timeout_must_be_a_number(bad: Any) -> None:
    with pytest.raises(TypeError, match="timeout must be a number of seconds or None"):
        sdk.function(timeout=bad)


@pytest.mark.parametrize("bad", ["", "   "])
def test_name_must_not_be_empty(bad: str) -> None:
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        sdk.function(name=bad)


def test_name_must_be_a_string() -> None:
    with pytest.raises(TypeError, match="name must be a string or None, got 3"):
        sdk.function(name=3)  # type: ignore[call-overload]


def test_valid_options_are_kept() -> None:
    assert remote_double.options == Options(gpus=1, max_retries=3, timeout=5.0, name="dbl")
    assert sdk.function()(double).options == Options(gpus=0, max_retries=2, timeout=None)
    assert sdk.function(max_retries=0, timeout=0.5)(double).options.timeout == 0.5


class NotAFunction:
    def method(self) -> None:
        pass


@pytest.mark.parametrize(
    "target",
    [NotAFunction, NotAFunction().method, len, functools.partial(double, 1), 42],
    ids=["class", "bound-method", "builtin", "partial", "int"],
)
def test_only_functions_can_be_decorated(target: Any) -> None:
    with pytest.raises(TypeError, match=re.escape("@sdk.function() decorates functions")):
        sdk.function()(target)


def test_async_and_generator_functions_are_refused() -> None:
    async def coroutine() -> None:
        pass

    def generator() -> Any:
        yield 1

    with pytest.raises(TypeError, match="async"):
        sdk.function()(coroutine)
    with pytest.raises(TypeError, match="generator"):
        sdk.function()(generator)


def test_decorating_twice_is_refused() -> None:
    with pytest.raises(TypeError, match="already decorated"):
        sdk.function()(remote_double)


def test_wraps_the_function() -> None:
    assert isinstance(remote_double, sdk.Function)
    assert remote_double.__name__ == "double"
    assert remote_double.__qualname__ == "double"
    assert remote_double.__doc__ == "Twice x."
    assert remote_double.__module__ == __name__
    assert remote_double.__wrapped__ is double


def test_local_calls_the_original_in_process() -> None:
    seen = []

    @sdk.function(gpus=8)
    def record(x: int, *, y: int = 0) -> int:
        seen.append((x, y))
        return x + y

    assert record.local(1, y=2) == 3
    assert seen == [(1, 2)]


def test_pickles_by_reference_and_by_value() -> None:
    for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)):
        copy = loads(dumps(remote_double))
        assert isinstance(copy, sdk.Function)
        assert copy.options == remote_double.options
        assert copy.local(4) == 8


def test_a_function_calling_another_decorated_one_pickles() -> None:
    @sdk.function()
    def inner(x: int) -> int:
        return x + 1

    @sdk.function(gpus=1)
    def outer(x: int) -> int:
        return inner.local(x) * 10

    copy = cloudpickle.loads(cloudpickle.dumps(outer))
    assert copy.local(1) == 20
    assert copy.options.gpus == 1


def test_a_recursive_decorated_function_pickles() -> None:
    @sdk.function()
    def countdown(n: int) -> int:
        return 0 if n == 0 else 1 + countdown.local(n - 1)

    assert cloudpickle.loads(cloudpickle.dumps(countdown)).local(3) == 3


@pytest.mark.parametrize(
    ("name", "visibility"), [("../etc", "private"), ("a b", "group"), ("ok", "everyone")]
)
def test_register_refuses_bad_names_and_visibility_before_sending_anything(
    name: str, visibility: str
) -> None:
    @sdk.function()
    def f() -> None: ...

    with pytest.raises(ValueError, match=r"cannot register|visibility must be one of"):
        f.register(name, visibility=visibility)
