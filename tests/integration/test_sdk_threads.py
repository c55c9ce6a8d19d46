"""The sdk from many threads at once: first calls, spawns and maps of functions that use a
local helper module (one next to the notebook, which the node cannot import) all run, and
all come back right. Real gateway, PostgreSQL, nodelet and workers."""

from __future__ import annotations

import importlib
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import sdk
from tests.conftest import Cluster

# Functions below travel by value, as a notebook's would (this module is not on the nodes).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

THREADS = 12
#: Big enough that a call's payload is written to the shared directory, where there is one.
BIG = 3 << 19


@pytest.fixture(params=["gateway", "shared-dir"])
def via(request: pytest.FixtureRequest) -> tuple[Cluster, bytes]:
    """A cluster, and what every call carries: nothing much, or (with a shared directory)
    enough to go through it, so that threads also set up its use at once."""
    if request.param == "gateway":
        return request.getfixturevalue("cluster"), b""
    cluster: Cluster = request.getfixturevalue("shared_gateway")
    cluster.start_nodelet()
    sdk.connect(cluster.url, cluster.token)
    return cluster, b"x" * BIG


@pytest.fixture
def helper(tmp_path: Path) -> Any:
    """A helper module imported here for the first time, under a name no node can import
    (the sdk must ship it by value)."""
    name = f"lab_helpers_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{name}.py").write_text("FACTOR = 3\n\ndef scale(x):\n    return x * FACTOR\n")
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


def test_threads_making_first_calls_with_a_local_module_all_get_their_results(
    via: tuple[Cluster, bytes], helper: Any
) -> None:
    """Each thread makes its first call at once (a barrier), by calling, spawning or mapping a
    function of its own that uses the helper module: none may be sent before the sdk has
    decided to ship the module by value (they were, and failed with bad_payload)."""
    cluster, pad = via

    def task(kind: str, n: int) -> Callable[[], Any]:
        @sdk.function(name=f"{kind}-{n}")
        def use(x: int, padding: bytes) -> tuple[int, int]:
            return int(helper.scale(x)), len(padding)

        if kind == "call":
            return lambda: [use(n, pad)]
        if kind == "spawn":
            calls = lambda: [use.spawn(n, pad), use.spawn(n + 1, pad)]  # noqa: E731
            return lambda: [call.result(timeout=120) for call in calls()]
        return lambda: list(use.map(range(n, n + 3), [pad] * 3))

    kinds = ["call", "spawn", "map"]
    jobs = [(kinds[n % 3], n) for n in range(THREADS)]
    items = {"call": 1, "spawn": 2, "map": 3}
    expected = {
        (kind, n): [(3 * x, len(pad)) for x in range(n, n + items[kind])] for kind, n in jobs
    }
    start = threading.Barrier(THREADS)
    results: dict[tuple[str, int], Any] = {}

    def run(kind: str, n: int) -> None:
        work = task(kind, n)
        start.wait(timeout=30)
        try:
            results[kind, n] = work()
        except Exception as exc:  # reported below, with every other thread's
            results[kind, n] = exc

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=240)
    assert not any(thread.is_alive() for thread in threads), "a thread never finished"
    assert len(results) == THREADS
    wrong = {job: got for job, got in results.items() if got != expected[job]}
    shown = "; ".join(f"{job}: {str(got)[:400]}" for job, got in list(wrong.items())[:2])
    assert not wrong, f"{len(wrong)} of {THREADS} threads went wrong, e.g. {shown}"
    if pad:  # the payloads went through the caller's own directory there
        assert cluster.shared_dir is not None
        assert (cluster.shared_dir / "bulletin/users/alice").is_dir()
