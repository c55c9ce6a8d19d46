"""A map's function pickled once (bulletin_core.pickling.shipped): each item's envelope
carries those bytes, and a worker (here, this process's remote side) loads the function once
per map and keeps it for the map's next items; never for another map, never for other bytes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from bulletin_core.pickling import caller, remote, shipped
from tests.unit.test_pickling_sync import notebook


@pytest.fixture(autouse=True)
def nothing_kept() -> Iterator[None]:
    shipped.forget()
    yield
    shipped.forget()


def ship(fn: Any, token: str) -> shipped.Shipped:
    shipped_fn = caller.ship_function(fn, token)
    assert shipped_fn is not None
    return shipped_fn


def run_item(ship: shipped.Shipped, fn: Any, *args: Any) -> Any:
    """One item as a worker runs it: its envelope made as ``map`` makes it, loaded, called."""
    sent = caller.pack_call(fn, args, {}, sync=False, shipped=ship)
    assert sent.sync is None
    call = remote.open_call(sent.packed.tobytes(), where="node 'test'")
    loaded, largs, lkwargs = call.load()
    call.prepare("cpu")
    try:
        return loaded, loaded(*largs, **lkwargs)
    finally:
        call.finish()


COUNTING = """
    seen = []

    def count(x):
        seen.append(x)
        return list(seen)
    """


def test_a_maps_items_share_the_function_a_worker_loaded_once_and_other_maps_do_not() -> None:
    ns = notebook(COUNTING)
    ship_1 = ship(ns["count"], "map-1")
    first, got = run_item(ship_1, ns["count"], 1)
    again, got_again = run_item(ship_1, ns["count"], 2)
    assert again is first  # loaded once for the map
    assert (got, got_again) == ([1], [1, 2])  # what an item left in a global, the next sees
    other, fresh = run_item(ship(ns["count"], "map-2"), ns["count"], 3)
    assert other is not first and fresh == [3]
    assert ns["seen"] == []  # nothing comes back into the notebook from a map


def test_every_items_envelope_holds_the_functions_pickle_made_once() -> None:
    ns = notebook(COUNTING)
    one = ship(ns["count"], "map")
    for x in (1, 2):
        item = caller.pack_call(ns["count"], (x,), {}, sync=False, shipped=one).packed
        assert item.pickle.count(one.data) == 1


def test_a_token_never_stands_for_other_bytes_than_its_own() -> None:
    """The attack: an item that names the token of a map the worker already loaded, with
    bytes of its own, must run its own function, not the one kept for that token; and the
    map's own items still get theirs."""
    ns = notebook(COUNTING)
    honest = ship(ns["count"], "token")
    kept, _ = run_item(honest, ns["count"], 1)
    evil = notebook("def count(x):\n    return 'forged'\n")
    forged = ship(evil["count"], "token")
    assert forged.data != honest.data
    loaded, got = run_item(forged, evil["count"], 2)
    assert loaded is not kept and got == "forged"
    again, got_again = run_item(honest, ns["count"], 3)
    assert again is kept and got_again == [1, 3]


def test_a_worker_keeps_only_the_last_few_maps_functions() -> None:
    ns = notebook(COUNTING)
    ships = [ship(ns["count"], f"map-{n}") for n in range(shipped.KEEP + 1)]
    first, _ = run_item(ships[0], ns["count"], 0)
    for later in ships[1:]:
        run_item(later, ns["count"], 0)
    assert len(shipped._loaded) == shipped.KEEP
    reloaded, got = run_item(ships[0], ns["count"], 1)
    assert reloaded is not first and got == [1]


def test_a_function_holding_tensors_is_pickled_with_every_item() -> None:
    torch = pytest.importorskip("torch")
    ns = notebook("def scale(x):\n    return float((weights * x).sum())\n")
    ns["weights"] = torch.ones(1000)
    assert caller.ship_function(ns["scale"], "map") is None
