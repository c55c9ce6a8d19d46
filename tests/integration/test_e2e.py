"""A user's calls through the sdk, end to end: real gateway, PostgreSQL, nodelet and worker
processes on loopback; only the GPUs are fake."""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time
from pathlib import Path

import cloudpickle
import psutil
import pytest

import sdk
from tests.conftest import Cluster, wait_until

# Functions below travel by value, as a notebook's would (this module is not on the nodes).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class NotebookError(Exception):
    """An exception class the user defined in their notebook."""


def test_call_returns_the_result_and_streams_prints_live(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    @sdk.function(gpus=1)
    def train_step(x: int) -> int:
        import socket

        print("hello from", socket.gethostname())
        return x * 2

    assert train_step(21) == 42
    assert f"hello from {os.uname().nodename}\n" in capsys.readouterr().out


def test_remote_exception_keeps_its_type_and_the_remote_traceback(cluster: Cluster) -> None:
    @sdk.function()
    def explode(n: int) -> None:
        def deeper() -> None:
            raise NotebookError(f"bad input {n}")

        deeper()

    with pytest.raises(NotebookError, match="bad input 7") as info:
        explode(7)
    remote = getattr(info.value, "remote_traceback", "")
    assert "in deeper" in remote and "NotebookError: bad input 7" in remote


def test_an_exception_that_cannot_be_unpickled_arrives_as_remote_error(cluster: Cluster) -> None:
    @sdk.function()
    def unpicklable() -> None:
        class Local(Exception):
            def __reduce__(self) -> object:
                raise TypeError("nope")

        raise Local("from a local class")

    with pytest.raises(sdk.RemoteError) as info:
        unpicklable()
    assert "from a local class" in str(info.value)
    assert "unpicklable" in (info.value.remote_traceback or "")


def test_stdout_and_stderr_arrive_in_order_with_none_lost_or_duplicated(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    @sdk.function()
    def chatty(n: int) -> int:
        for i in range(n):
            print(f"line {i}")
            if i % 500 == 0:
                print(f"warn {i}", file=sys.stderr)
        for pct in (10, 50, 100):
            print(f"\rprogress {pct}%", end="", flush=True)
        print()
        return n

    assert chatty(3000) == 3000
    out, err = capsys.readouterr()
    expected = "".join(f"line {i}\n" for i in range(3000)) + (
        "\rprogress 10%\rprogress 50%\rprogress 100%\n"
    )
    assert out == expected
    assert err == "".join(f"warn {i}\n" for i in range(0, 3000, 500))


def test_spawn_and_reattach_by_id(cluster: Cluster) -> None:
    @sdk.function()
    def slow_square(x: int) -> int:
        time.sleep(0.5)
        return x * x

    call = slow_square.spawn(9)
    assert call.status() in {"queued", "assigned", "running"}
    again = sdk.Call.from_id(call.id)  # e.g. after a kernel restart
    assert again.result(timeout=30) == 81
    assert call.status() == "succeeded"
    with pytest.raises(sdk.NotFoundError):
        sdk.Call.from_id("00000000-0000-0000-0000-000000000000")


def test_result_timeout_leaves_the_call_running(cluster: Cluster) -> None:
    @sdk.function()
    def nap() -> str:
        time.sleep(2)
        return "rested"

    call = nap.spawn()
    with pytest.raises(sdk.ResultTimeout):
        call.result(timeout=0.2)
    assert call.result(timeout=30) == "rested"


def test_cancel_of_a_running_call_kills_the_worker_process_group(
    cluster: Cluster, tmp_path: Path
) -> None:
    pidfile = tmp_path / "pids"

    @sdk.function(gpus=1)
    def hang(path: str) -> None:
        import subprocess

        child = subprocess.Popen(["sleep", "300"])
        with open(path, "w") as f:
            f.write(f"{os.getpid()} {child.pid}")
        time.sleep(300)

    call = hang.spawn(str(pidfile))
    wait_until(lambda: pidfile.exists() and pidfile.read_text().count(" ") == 1, 30, "pids")
    pids = [psutil.Process(int(p)) for p in pidfile.read_text().split()]
    call.cancel()
    _, alive = psutil.wait_procs(pids, timeout=10)
    assert not alive, "the worker or its child survived the cancel"
    assert call.status() == "cancelled"
    with pytest.raises(sdk.CallCancelled):
        call.result(timeout=10)


def test_map_yields_in_input_order_and_batches_requests(cluster: Cluster) -> None:
    @sdk.function()
    def inc(x: int) -> int:
        return x + 1

    client = sdk.connect(cluster.url, cluster.token)
    submits = []
    client.request_hooks.append(
        lambda method, path: submits.append(path) if path == "/v1/invocations" else None
    )
    assert list(inc.map(range(600))) == list(range(1, 601))
    assert 2 <= len(submits) <= 3, "map must submit in batches, not one request per item"


def test_map_raises_a_failed_item_when_reached_unless_asked_to_return_it(
    cluster: Cluster,
) -> None:
    @sdk.function()
    def inverse(x: int) -> float:
        return 1 / x

    results = inverse.map([1, 2, 0, 4])
    assert next(results) == 1.0
    assert next(results) == 0.5
    with pytest.raises(ZeroDivisionError):
        next(results)
    got = list(inverse.map([1, 0, 4], return_exceptions=True))
    assert got[0] == 1.0 and isinstance(got[1], ZeroDivisionError) and got[2] == 0.25


LOADED: list[int] = []


def test_a_maps_items_on_one_worker_share_what_the_function_loaded_into_its_globals(
    cluster: Cluster,
) -> None:
    """A map's function is pickled once and loaded once per worker and map: what an item
    leaves in a global (a model loaded on first use), the items that worker runs next see,
    as in a Ray or Modal worker. Another map starts from the notebook's values again, and
    the notebook's own never change."""

    @sdk.function()
    def remember(x: int) -> tuple[int, list[int]]:
        LOADED.append(x)
        return os.getpid(), list(LOADED)

    earlier: set[int] = set()
    for first in (0, 1000):
        by_worker: dict[int, list[list[int]]] = {}
        items = range(first, first + 60)
        for x, (pid, seen) in zip(items, remember.map(items), strict=True):
            assert x in seen and not earlier & set(seen)
            by_worker.setdefault(pid, []).append(seen)
        for pid, seens in by_worker.items():
            seens.sort(key=len)
            # One function object per worker: each item saw what the earlier ones left.
            assert all(a == b[: len(a)] for a, b in itertools.pairwise(seens)), pid
            assert len(seens[-1]) == len(seens) and len(set(seens[-1])) == len(seens)
        earlier |= set(range(first, first + 60))
    assert any(len(seens) > 1 for seens in by_worker.values())
    assert LOADED == []


def test_cpu_only_and_gpu_calls_see_their_devices(cluster: Cluster) -> None:
    def visible() -> str:
        return os.environ["CUDA_VISIBLE_DEVICES"]

    assert sdk.function(gpus=0)(visible)() == ""
    assert sdk.function(gpus=1)(visible)() in {"0", "1"}
    assert sorted(sdk.function(gpus=2)(visible)().split(",")) == ["0", "1"]


def test_big_payloads_and_results_travel_as_streamed_blobs(cluster: Cluster) -> None:
    data = os.urandom(3 << 20)

    @sdk.function()
    def echo_reversed(blob: bytes) -> bytes:
        return blob[::-1] + blob

    assert echo_reversed(data) == data[::-1] + data


def test_timeout_stops_the_call(cluster: Cluster) -> None:
    @sdk.function(timeout=0.5)
    def forever() -> None:
        time.sleep(60)

    started = time.monotonic()
    with pytest.raises(sdk.CallTimedOut):
        forever()
    assert time.monotonic() - started < 15


def test_nodelet_killed_mid_call_without_retries_fails_as_node_lost(
    cluster: Cluster, tmp_path: Path
) -> None:
    marker = tmp_path / "started"

    @sdk.function(gpus=1, max_retries=0)
    def long_job(path: str) -> str:
        open(path, "w").close()
        time.sleep(60)
        return "done"

    call = long_job.spawn(str(marker))
    wait_until(marker.exists, 30, "the call to start")
    cluster.nodelets[0].send_signal(signal.SIGKILL)
    with pytest.raises(sdk.NodeLostError, match="node lost"):
        call.result(timeout=30)


def test_nodelet_killed_mid_call_with_retries_is_requeued_onto_another_node(
    cluster: Cluster, tmp_path: Path
) -> None:
    first = tmp_path / "attempt-1"

    @sdk.function(gpus=1, max_retries=1)
    def resumable(path: str) -> str:
        import socket

        if not os.path.exists(path):
            open(path, "w").close()
            time.sleep(60)
        return f"finished on attempt 2 at {socket.gethostname()}"

    call = resumable.spawn(str(first))
    wait_until(first.exists, 30, "the first attempt to start")
    victim = cluster.nodelets[0]
    victim.send_signal(signal.SIGKILL)
    cluster.start_nodelet("node-b")
    assert call.result(timeout=60).startswith("finished on attempt 2")
    info = call.info()
    assert info.attempts == 2 and info.node == "node-b"


def test_warm_workers_serve_one_user_again_but_never_another_user(cluster: Cluster) -> None:
    @sdk.function(gpus=1)
    def which_process() -> tuple[int, str | None]:
        leaked = os.environ.get("LEFT_BY_LAST_CALL")
        os.environ["LEFT_BY_LAST_CALL"] = "yes"
        return os.getpid(), leaked

    first, second = which_process(), which_process()
    assert first[0] == second[0], "a second call of the same user should find a warm worker"
    assert second[1] is None, "the warm worker kept the previous call's environment"
    sdk.connect(cluster.url, cluster.add_user("bob"))
    theirs = which_process()
    assert theirs[0] != first[0], "a warm worker was shared across users"


def test_a_call_no_node_could_ever_run_is_rejected_at_submit(cluster: Cluster) -> None:
    wait_until(lambda: _registered(cluster), 30, "the nodelet to register")

    @sdk.function(gpus=3)
    def too_big() -> None:
        pass

    with pytest.raises(sdk.InvalidRequest, match="needs 3 GPUs but the largest node has 2"):
        too_big()


def _registered(cluster: Cluster) -> bool:
    return "registered" in (cluster.dir / "node-a.log").read_text()


CTRL_C_SCRIPT = """
import os, sys, time, sdk

@sdk.function()
def hang(path):
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(300)

try:
    hang(sys.argv[1])
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_ctrl_c_in_the_caller_cancels_the_call_and_kills_its_worker(
    cluster: Cluster, tmp_path: Path
) -> None:
    import subprocess

    pidfile = tmp_path / "pid"
    env = {**os.environ, "BULLETIN_URL": cluster.url, "BULLETIN_TOKEN": cluster.token}
    env.pop("BULLETIN_CONFIG", None)
    caller = subprocess.Popen(
        [sys.executable, "-c", CTRL_C_SCRIPT, str(pidfile)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    wait_until(lambda: pidfile.exists() and pidfile.read_text(), 30, "the call to start")
    worker = psutil.Process(int(pidfile.read_text()))
    caller.send_signal(signal.SIGINT)
    out, _ = caller.communicate(timeout=30)
    assert "interrupted" in out
    _, alive = psutil.wait_procs([worker], timeout=10)
    assert not alive, "the remote work kept running after Ctrl-C"
    [call] = sdk.Client(cluster.url, cluster.token).invocations(limit=1)
    assert call.state == "cancelled"


def test_a_stopping_nodelet_hands_its_calls_back_without_using_a_retry(
    cluster: Cluster, tmp_path: Path
) -> None:
    first = tmp_path / "attempt-1"

    @sdk.function(gpus=1, max_retries=0)
    def interrupted_once(path: str) -> str:
        if not os.path.exists(path):
            open(path, "w").close()
            time.sleep(60)
        return "ran to the end"

    call = interrupted_once.spawn(str(first))
    wait_until(first.exists, 30, "the first attempt to start")
    cluster.nodelets[0].send_signal(signal.SIGTERM)  # an admin restarting the node agent
    assert cluster.nodelets[0].wait(15) == 0
    assert call.status() == "queued", "the call should be back in the queue at once"
    cluster.start_nodelet("node-b")
    assert call.result(timeout=60) == "ran to the end"
    assert call.info().attempts == 1


def test_the_readme_example_runs_as_written(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, object] = {"__name__": "__main__"}
    exec(compile(code, "README.md", "exec"), namespace)
    assert f"hello from {os.uname().nodename}" in capsys.readouterr().out
    assert namespace["train_step"](21) == 42  # type: ignore[operator]


def test_a_map_abandoned_by_an_exception_cancels_its_unfinished_calls(cluster: Cluster) -> None:
    @sdk.function()
    def first_fails(x: int) -> int:
        if x == 0:
            raise ValueError("item 0 is bad")
        time.sleep(60)
        return x

    with pytest.raises(ValueError, match="item 0 is bad"):
        list(first_fails.map(range(10)))
    states = [i.state for i in sdk.Client(cluster.url, cluster.token).invocations(limit=10)]
    assert sorted(states) == ["cancelled"] * 9 + ["failed"]
