"""Notebook state, in a real Jupyter kernel (nbclient + ipykernel) against a cluster with a
shared directory started by the test: globals come back, big tensors travel through the
shared directory and through HTTP, and Ctrl-C (a kernel interrupt) stops the remote call."""

from __future__ import annotations

import asyncio
import os
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

import sdk
from tests.conftest import Cluster, wait_until

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")


class Kernel:
    """One kernel; ``run`` executes a cell and returns its printed output."""

    def __init__(self, client: NotebookClient) -> None:
        self.client = client
        self.count = 0

    def run(self, source: str) -> str:
        cell = nbformat.v4.new_code_cell(textwrap.dedent(source))
        self.client.nb.cells.append(cell)
        self.client.execute_cell(cell, len(self.client.nb.cells) - 1)
        return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


@contextmanager
def kernel(cluster: Cluster, directory: Path) -> Iterator[Kernel]:
    env = {
        **os.environ,
        "BULLETIN_URL": cluster.url,
        "BULLETIN_TOKEN": cluster.token,
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    env.pop("BULLETIN_CONFIG", None)
    client = NotebookClient(
        nbformat.v4.new_notebook(),
        timeout=180,
        kernel_name="python3",
        resources={"metadata": {"path": str(directory)}},
    )
    with client.setup_kernel(env=env, cwd=str(directory)):
        yield Kernel(client)


@pytest.fixture
def nas_cluster(shared_gateway: Cluster) -> Cluster:
    shared_gateway.start_nodelet()
    return shared_gateway


def test_globals_the_call_changed_come_back_into_the_notebook(
    nas_cluster: Cluster, tmp_path: Path
) -> None:
    notebook_dir = tmp_path / "notebook"
    notebook_dir.mkdir()
    # A helper module next to the notebook: importable there, not on the node.
    (notebook_dir / "local_helpers.py").write_text(
        "FACTOR = 3\n\ndef scale(x):\n    return x * FACTOR\n"
    )
    with kernel(nas_cluster, notebook_dir) as nb:
        out = nb.run(
            """
            import socket, torch, sdk

            images = []
            same_images = images
            model = torch.nn.Linear(4, 4)
            weight = model.weight
            step = 0
            table = {"runs": [1]}
            runs = table["runs"]

            class Tracker:
                def __init__(self):
                    self.seen = []

            tracker = Tracker()

            def record(n):  # a helper: the function reaches tracker only through it
                tracker.seen.append(n)

            @sdk.function(gpus=1)
            def sample(n):
                global step, created_remotely
                for _ in range(n):
                    images.append(model(torch.randn(1, 4)))
                step += n
                table["runs"].append(n)
                record(n)
                with torch.no_grad():
                    model.weight.add_(1.0)
                created_remotely = "made on " + socket.gethostname()
                return len(images)

            before = weight.detach().clone()
            print(sample(3))
            """
        )
        assert out == "3\n"
        out = nb.run(
            """
            assert same_images is images and len(images) == 3
            assert all(t.device.type == "cpu" and t.shape == (1, 4) for t in images)
            assert all(t.requires_grad and t.dtype == torch.float32 for t in images)
            assert step == 3 and runs == [1, 3] and table["runs"] is runs
            assert tracker.seen == [3] and isinstance(tracker, Tracker)
            assert model.weight is weight and torch.equal(weight.detach(), before + 1)
            assert weight.requires_grad
            print(created_remotely)
            """
        )
        assert out.startswith("made on ")
        out = nb.run(
            """
            import importlib.util, local_helpers

            @sdk.function()
            def use_helper(x):
                return local_helpers.scale(x), importlib.util.find_spec("local_helpers") is None

            print(use_helper(2), use_helper(5))
            """
        )
        assert out == "(6, True) (15, True)\n"  # shipped by value: the node cannot import it
        out = nb.run(
            """
            counter = []

            @sdk.function()
            def bump():
                counter.append(len(counter))
                return "bumped"

            call = bump.spawn()
            while call.status() != "succeeded":
                pass
            print("before result()", counter)
            print(call.result(), counter, call.result(), counter)
            print("map", list(bump.map(range(0))), sorted(set(bump.map([], []))), counter)
            """
        )
        assert out == "before result() []\nbumped [0] bumped [0]\nmap [] [] [0]\n"
        out = nb.run(
            """
            import warnings, time
            flag = "old"

            @sdk.function()
            def set_flag():
                global flag
                time.sleep(0.5)
                flag = "remote"

            pending = set_flag.spawn()
            flag = "notebook"  # changed here while the call runs
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                pending.result()
            print(flag, pending.remote_globals["flag"], caught[0].category.__name__)
            """
        )
        assert out == "notebook remote StateSyncWarning\n"


def test_an_unpicklable_global_is_named_and_nothing_is_submitted(
    nas_cluster: Cluster, tmp_path: Path
) -> None:
    user = sdk.Client(nas_cluster.url, nas_cluster.token)
    with kernel(nas_cluster, tmp_path) as nb:
        out = nb.run(
            """
            import sqlite3, sdk
            conn = sqlite3.connect(":memory:")

            @sdk.function()
            def query():
                return conn.execute("select 1").fetchall()

            try:
                query()
            except sdk.SerializationError as exc:
                print(exc)
            """
        )
    assert out.startswith(
        "global 'conn' (sqlite3.Connection) cannot be sent to the node: TypeError: "
    )
    assert user.invocations() == []


@pytest.mark.parametrize("via", ["shared directory", "HTTP"])
def test_a_200_mib_tensor_goes_to_the_node_and_comes_back_changed(
    nas_cluster: Cluster, tmp_path: Path, via: str
) -> None:
    pytest.importorskip("torch")
    with kernel(nas_cluster, tmp_path) as nb:
        out = nb.run(
            f"""
            import torch, sdk
            sdk.connect().use_shared_dir = {via == "shared directory"}
            big = torch.zeros(50 * 1024 * 1024)  # 200 MiB
            alias = big

            @sdk.function(gpus=1)
            def touch():
                big.add_(1)
                return float(big.sum())

            call = touch.spawn()
            total = call.result(timeout=150)
            info = call.info()
            print(total, alias is big, float(big[-1]))
            print("file" if info.result_file else "blob" if info.result_blob else "inline")
            """
        )
    total, same, last, how = out.split()
    assert float(total) == 50 * 1024 * 1024 and same == "True" and float(last) == 1.0
    assert how == ("file" if via == "shared directory" else "blob")
    # Consumed files are deleted (in the background: unlinking 200 MiB takes a while).
    mine = tmp_path / "nas" / "bulletin" / "users" / "alice"
    assert mine.is_dir() == (via == "shared directory")  # the user's own, made on first use
    left = lambda: list(mine.iterdir()) if mine.exists() else []  # noqa: E731
    wait_until(lambda: not left(), 10, "the payload and result files to be deleted")


def test_ctrl_c_in_the_notebook_stops_the_remote_call_and_its_children(
    nas_cluster: Cluster, tmp_path: Path
) -> None:
    pids = tmp_path / "pids"
    user = sdk.Client(nas_cluster.url, nas_cluster.token)
    with kernel(nas_cluster, tmp_path) as nb:
        nb.run(
            """
            import sdk

            @sdk.function(gpus=1)
            def long_call(path):
                import os, subprocess, time
                child = subprocess.Popen(["sleep", "300"])  # like a DataLoader worker
                with open(path + ".tmp", "w") as file:
                    file.write(f"{os.getpid()} {child.pid}")
                os.rename(path + ".tmp", path)
                time.sleep(300)
            """
        )
        failure: list[BaseException] = []

        def cell() -> None:
            try:
                nb.run(f"long_call({str(pids)!r})")
            except BaseException as exc:
                failure.append(exc)

        runner = threading.Thread(target=cell)
        runner.start()
        wait_until(pids.exists, 60, "the remote call to start")
        worker_pid, child_pid = map(int, pids.read_text().split())
        started = time.monotonic()
        # What the notebook's stop button does: interrupt the kernel (SIGINT).
        asyncio.run(nb.client.km.interrupt_kernel())
        runner.join(30)
        took = time.monotonic() - started
    assert not runner.is_alive()
    assert failure and isinstance(failure[0], CellExecutionError), failure
    assert "KeyboardInterrupt" in str(failure[0])
    assert took < 5, f"the cell took {took:.1f} s to stop (target: under 1 s)"
    wait_until(lambda: not _alive(child_pid), 10, "the call's child process to be killed")
    [invocation] = user.invocations()
    assert invocation.state == "cancelled"
    print(f"interrupt to KeyboardInterrupt: {took * 1000:.0f} ms; worker pid {worker_pid}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"  # a zombie is dead, waiting to be reaped
    except FileNotFoundError:
        return False
