"""The agent's shutdown and the attempt's exit descriptions, without a gateway."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from pathlib import Path

import pytest

from bulletin_core import wire
from nodelet.agent import Node, serve
from nodelet.attempt import EOF_GRACE_S, Attempt, describe_exit
from nodelet.config import NodeletConfig


def _stop_after(delay_s: float, config: NodeletConfig) -> float:
    """Run serve() and set its stop event after ``delay_s``; how long serve() took."""

    async def main() -> float:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(delay_s, stop.set)
        started = time.monotonic()
        await asyncio.wait_for(serve(config, stop), 10)
        return time.monotonic() - started

    return asyncio.run(main())


def _config(url: str, tmp_path: Path) -> NodeletConfig:
    return NodeletConfig(
        gateway_url=url,
        token="bn_test",
        fake_gpus=1,
        spare_workers=1,
        work_dir=str(tmp_path),
        state_dir=str(tmp_path / "state"),
    )


def test_stop_while_the_gateway_refuses_connections(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Nothing listens on the port: registration keeps failing and backing off.
    elapsed = _stop_after(0.5, _config(f"http://127.0.0.1:{port}", tmp_path))
    assert elapsed < 2.5
    assert tmp_path.is_dir()  # a work_dir the operator chose is left in place


def test_stop_while_registration_hangs(tmp_path: Path) -> None:
    # A gateway that accepts connections but never answers: registration would wait for the
    # full HTTP timeout (10 s), yet stop must not.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        elapsed = _stop_after(0.5, _config(f"http://127.0.0.1:{port}", tmp_path))
    assert elapsed < 2.5


@pytest.mark.parametrize(
    ("returncode", "message"),
    [
        (
            -signal.SIGKILL,
            "worker process was killed by signal 9 (SIGKILL) — often the out-of-memory killer",
        ),
        (-signal.SIGSEGV, "worker process was killed by signal 11 (SIGSEGV)"),
        (3, "worker process exited with code 3 without leaving a result"),
        (None, "worker process vanished without leaving a result"),
    ],
)
def test_worker_exit_descriptions(returncode: int | None, message: str) -> None:
    assert describe_exit(returncode) == message


class _SlowToDie:
    """Stands in for a worker whose processes take a while to be gone once killed."""

    pid = 1

    def __init__(self, dying_s: float) -> None:
        self.dying_s = dying_s
        self.kills = 0
        self.gone_at: float | None = None

    def kill(self) -> None:
        self.kills += 1

    async def wait(self) -> int:
        await asyncio.sleep(self.dying_s)
        self.gone_at = time.monotonic()
        return -signal.SIGKILL


def test_a_killed_attempts_task_ends_only_once_its_worker_and_all_it_started_are_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The next attempt on its GPUs waits for this task (Node._launch): it must not end
    # while the killed attempt's processes still run, however often it is killed.
    async def main() -> tuple[_SlowToDie, float]:
        assignment = wire.Assignment(invocation_id="inv", epoch=1, gpu_indices=[0])
        attempt = Attempt(assignment, client=None, pool=None, facts=None)  # type: ignore[arg-type]
        worker = _SlowToDie(EOF_GRACE_S + 0.5)

        async def runs(behind: Attempt | None) -> None:
            attempt._worker = worker  # type: ignore[assignment]
            await asyncio.sleep(600)

        monkeypatch.setattr(attempt, "_run", runs)
        task = attempt.start()
        await asyncio.sleep(0.05)
        attempt.kill()
        await asyncio.sleep(0.2)
        attempt.kill()  # killed again (revoked, then the node stops)
        await asyncio.wait([task])
        assert task.cancelled()
        return worker, time.monotonic()

    worker, ended = asyncio.run(main())
    assert worker.gone_at is not None and ended >= worker.gone_at


class _Completions:
    async def complete(self, *args: object, **kwargs: object) -> None:
        return None


def test_an_attempt_starts_only_once_every_other_attempt_on_its_gpus_has_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An attempt the gateway no longer knows of (a database crash lost its assignment)
    # keeps running until the next poll revokes it: an assignment of its GPU meanwhile
    # must wait for it. Other GPUs, and CPU-only calls, do not wait.
    async def main() -> list[str]:
        events: list[str] = []
        release = asyncio.Event()

        async def runs(self: Attempt, behind: Attempt | None) -> None:
            events.append(f"start {self.ref.invocation_id}")
            if self.ref.invocation_id == "orphan":
                await release.wait()
            events.append(f"end {self.ref.invocation_id}")

        monkeypatch.setattr(Attempt, "_run", runs)
        node = Node.__new__(Node)
        node.attempts, node._lease_tails = {}, {}
        node._client = node._pool = node._facts = None  # type: ignore[assignment]
        node.completions = _Completions()  # type: ignore[assignment]
        node._launch(wire.Assignment(invocation_id="orphan", epoch=1, gpu_indices=[0]))
        await asyncio.sleep(0.05)
        node._launch(wire.Assignment(invocation_id="same-gpu", epoch=1, gpu_indices=[0]))
        node._launch(wire.Assignment(invocation_id="other-gpu", epoch=1, gpu_indices=[1]))
        node._launch(wire.Assignment(invocation_id="cpu", epoch=1, gpu_indices=[]))
        await asyncio.sleep(0.1)
        assert "start same-gpu" not in events
        release.set()
        await asyncio.wait([a.task for a in node.attempts.values() if a.task is not None])
        return events

    events = asyncio.run(main())
    assert {"start other-gpu", "start cpu"} <= set(events[: events.index("end orphan")])
    assert events.index("start same-gpu") > events.index("end orphan")
