"""The worker's side of JSON invocations: arguments in, the returned value out as JSON or a
reason it cannot be."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from nodelet import jsoncall


def test_arguments_are_positional_and_keyword() -> None:
    assert jsoncall.arguments(b'{"args": [1, "a"], "kwargs": {"k": null}}') == (
        (1, "a"),
        {"k": None},
    )
    assert jsoncall.arguments(b"{}") == ((), {})


@pytest.mark.parametrize("raw", [b"[]", b'{"args": {}}', b'{"kwargs": [1]}', b"nope"])
def test_arguments_of_the_wrong_shape_are_refused(raw: bytes) -> None:
    with pytest.raises(ValueError):
        jsoncall.arguments(raw)


@dataclasses.dataclass
class Point:
    x: int
    y: float


class FakeArray:
    def tolist(self) -> list[list[int]]:
        return [[1, 2], [3, 4]]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"a": [1, 2.5, None, True]}, {"a": [1, 2.5, None, True]}),
        ((1, 2), [1, 2]),
        (Point(1, 2.0), {"x": 1, "y": 2.0}),
        (FakeArray(), [[1, 2], [3, 4]]),
        ({3}, [3]),
        ("héllo ✓", "héllo ✓"),
        ({1: "int keys become strings"}, {"1": "int keys become strings"}),
    ],
)
def test_plain_values_come_back_as_json(value: object, expected: object) -> None:
    data, error = jsoncall.encode(value, 1 << 20)
    assert error is None and data is not None
    assert json.loads(data) == expected


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (1 + 2j, "complex"),
        (math.nan, "NaN or infinity"),
        ({(1, 2): "tuple key"}, "keys must be"),
        ("\ud800", "lone surrogate"),
        (b"bytes", "bytes"),
    ],
)
def test_values_that_are_not_json_say_why_and_where_the_pickle_is(value: object, why: str) -> None:
    data, error = jsoncall.encode(value, 1 << 20)
    assert data is None and error is not None
    assert why in error and "/v1/invocations/{id}/result" in error


def test_a_json_result_over_the_limit_is_refused() -> None:
    data, error = jsoncall.encode(list(range(1000)), 100)
    assert data is None and error is not None and "over the limit" in error


class Awkward:
    def tolist(self) -> list[int]:
        raise RuntimeError("cannot list this")


def test_an_object_that_fails_to_convert_is_a_reason_not_a_crash() -> None:
    data, error = jsoncall.encode({"a": Awkward()}, 1 << 20)
    assert data is None and error is not None and "cannot list this" in error


def test_nesting_the_gateway_cannot_read_is_refused_here() -> None:
    deep: list[object] = ["[{ in a string ]}"]
    for _ in range(jsoncall.MAX_DEPTH - 1):
        deep = [deep]
    data, error = jsoncall.encode(deep, 1 << 20)
    assert error is None and data is not None
    data, error = jsoncall.encode([deep], 1 << 20)
    assert data is None and error is not None and "nested too deeply" in error


class Huge:
    nbytes = 10 << 30

    def tolist(self) -> list[int]:
        raise AssertionError("must not be listed: it is known to be too big")


def test_a_huge_array_is_refused_before_it_is_listed() -> None:
    data, error = jsoncall.encode([Huge()], 1 << 20)
    assert data is None and error is not None and "over the limit" in error
