"""Notebook state through a real cluster, from the sdk's side: what Call.result() applies,
once, and what re-attaching by id can and cannot load."""

from __future__ import annotations

import textwrap
import threading
from typing import Any

import pytest

import sdk
from tests.conftest import Cluster


def notebook(source: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "__main__", "sdk": sdk}
    exec(textwrap.dedent(source), namespace)
    return namespace


def test_concurrent_result_calls_apply_the_state_once(cluster: Cluster) -> None:
    ns = notebook(
        """
        items = []

        @sdk.function()
        def grow():
            items.append(len(items))
            return list(items)
        """
    )
    call = ns["grow"].spawn()
    results: list[Any] = []

    def wait() -> None:
        results.append(call.result(timeout=60))

    threads = [threading.Thread(target=wait) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == [[0]] * 4
    assert ns["items"] == [0]
    assert call.remote_globals == {"items": [0]}


def test_reattaching_by_id_loads_values_but_not_notebook_state(cluster: Cluster) -> None:
    ns = notebook(
        """
        items = [1]

        @sdk.function()
        def same():
            items.append(2)
            return items  # the notebook's own list

        @sdk.function()
        def plain():
            return 42
        """
    )
    call = ns["same"].spawn()
    again = sdk.Call.from_id(call.id)
    with pytest.raises(sdk.SerializationError, match="refers to notebook state"):
        again.result(timeout=60)
    assert call.result() is ns["items"] and ns["items"] == [1, 2]
    assert sdk.Call.from_id(ns["plain"].spawn().id).result(timeout=60) == 42
