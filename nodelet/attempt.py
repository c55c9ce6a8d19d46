"""One attempt at one invocation, from ``start`` to ``complete``.

The nodelet never unpickles anything here: payload and result are opaque bytes passed between
the gateway and the worker process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec

from bulletin import wire
from nodelet.backoff import Backoff
from nodelet.client import GatewayClient
from nodelet.errors import GatewayUnavailable, NodeletError, StaleAttempt
from nodelet.logs import LogShipper
from nodelet.workers import Worker, WorkerPool

log = logging.getLogger(__name__)

#: How long output may keep flowing after the worker and its process group are gone
#: (only a grandchild that left the group can hold the pipes open that long).
EOF_GRACE_S = 2.0
_T = TypeVar("_T")
_outcome_decoder = msgspec.msgpack.Decoder(wire.WorkerOutcome)


class Attempt:
    """Runs one assignment end to end in a worker process; :meth:`kill` abandons it."""

    def __init__(
        self,
        assignment: wire.Assignment,
        *,
        client: GatewayClient,
        pool: WorkerPool,
        work_dir: str,
        inline_limit: int,
        log_flush_s: float,
    ) -> None:
        self.assignment = assignment
        self.ref = wire.Attempt(invocation_id=assignment.invocation_id, epoch=assignment.epoch)
        self._client = client
        self._pool = pool
        self._work_dir = work_dir
        self._inline_limit = inline_limit
        self._log_flush_s = log_flush_s
        self._worker: Worker | None = None
        self.task: asyncio.Task[None] | None = None
        self.killed = False
        # When the gateway last (re)started this attempt's lease, by the local monotonic clock:
        # the lease began when the assignment was made, just before it reached us.
        self.renewed_at = time.monotonic()

    @property
    def name(self) -> str:
        return f"attempt-{self.ref.invocation_id}-{self.ref.epoch}"

    def __str__(self) -> str:
        return f"invocation {self.ref.invocation_id} epoch {self.ref.epoch}"

    def start(self) -> asyncio.Task[None]:
        """Run the attempt in a named task, kept on ``self.task``."""
        self.task = asyncio.create_task(self.run(), name=self.name)
        return self.task

    def kill(self) -> None:
        """Kill the worker's process group and abandon the attempt without completing it."""
        self.killed = True
        if self._worker is not None:
            self._worker.kill()
        if self.task is not None:
            self.task.cancel()

    async def run(self) -> None:
        """Run to completion. Gateway refusals end the attempt quietly; nothing is raised."""
        try:
            await self._run()
        except StaleAttempt as exc:
            log.info("%s is no longer ours (%s); dropped", self, exc)
        except (NodeletError, OSError) as exc:
            # Not completing leaves the call to be requeued when its lease lapses.
            log.error("%s abandoned: %s", self, exc)
        except Exception:
            log.exception("%s crashed; abandoned", self)
        finally:
            await self._reap()

    async def _run(self) -> None:
        assignment = self.assignment
        # Marking the attempt started is not on the call's critical path: the worker starts
        # at once, and a revoked attempt (409) is killed as soon as the answer comes.
        started = asyncio.create_task(self._start(), name=f"{self.name}-start")
        try:
            payload = assignment.payload
            if payload is None:
                payload = await self._client.payload(assignment.invocation_id, assignment.epoch)
            attempt_dir = tempfile.mkdtemp(prefix="attempt-", dir=self._work_dir)
            try:
                request = await self._execute(payload, attempt_dir)
            finally:
                shutil.rmtree(attempt_dir, ignore_errors=True)
            await started
        finally:
            started.cancel()
        await self._complete(request)

    async def _start(self) -> None:
        try:
            await self._client.start(self.ref.invocation_id, self.ref.epoch)
        except StaleAttempt:
            if self._worker is not None:
                self._worker.kill()
            raise
        except NodeletError as exc:
            # The call may still complete: the gateway accepts it from an assigned attempt.
            log.warning("%s: could not mark it started (%s); running it anyway", self, exc)

    async def _execute(self, payload: bytes, attempt_dir: str) -> wire.CompleteRequest:
        key = (self.assignment.owner, tuple(self.assignment.gpu_indices))
        worker = self._worker = await self._pool.acquire(key)
        task = wire.WorkerTask(
            invocation_id=self.ref.invocation_id,
            payload=payload,
            result_path=os.path.join(attempt_dir, "outcome.msgpack"),
            gpu_indices=list(self.assignment.gpu_indices),
            # Random per call: the user's own output cannot end the call early.
            end_marker=b"\x00\x00bulletin-end-" + secrets.token_hex(8).encode() + b"\x00",
        )
        shipper = LogShipper(
            self._client, self.ref, flush_s=self._log_flush_s, on_stale=worker.kill
        )
        tasks = self._ship_output(shipper, worker, task.end_marker)
        try:
            timed_out, finished = await self._supervise(worker, task, tasks[1:])
            await _drain(tasks[1:])
            shipper.close()
            await tasks[0]
        finally:
            for pending in tasks:
                pending.cancel()
        if shipper.stale is not None:
            raise shipper.stale
        report = self._report(task.result_path, worker.returncode, timed_out)
        if finished and not self.killed:
            self._worker = None
            self._pool.release(worker, key)
        return report

    def _ship_output(
        self, shipper: LogShipper, worker: Worker, marker: bytes
    ) -> list[asyncio.Task[Any]]:
        """The sender task, then one reader task per pipe."""
        return [
            asyncio.create_task(shipper.run(), name=f"{self.name}-logs"),
            asyncio.create_task(
                shipper.pump(worker.stdout, wire.Stream.STDOUT, marker), name=f"{self.name}-out"
            ),
            asyncio.create_task(
                shipper.pump(worker.stderr, wire.Stream.STDERR, marker), name=f"{self.name}-err"
            ),
        ]

    async def _supervise(
        self, worker: Worker, task: wire.WorkerTask, pumps: list[asyncio.Task[Any]]
    ) -> tuple[bool, bool]:
        """Hand over the task and wait until the call's output ends (the worker stays, warm)
        or the worker exits. Returns (timed out, finished with the worker alive)."""
        if not await worker.send(task):
            # Not the call's fault: abandoned, it is requeued when its lease lapses.
            raise NodeletError("the worker died before it received the call")
        exited = asyncio.create_task(worker.wait())
        ended = asyncio.create_task(asyncio.wait(pumps))
        try:
            done, _ = await asyncio.wait(
                {exited, ended},
                timeout=self.assignment.timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            ended.cancel()
        if ended in done and all(p.result() for p in pumps) and worker.returncode is None:
            exited.cancel()
            return False, True
        if not done:
            log.info("%s exceeded its %s s limit; killing it", self, self.assignment.timeout_s)
        # Also kills what the call left running, which would otherwise hold the pipes open.
        worker.kill()
        await exited
        return not done, False

    def _report(
        self, result_path: str, returncode: int | None, timed_out: bool
    ) -> wire.CompleteRequest:
        epoch = self.ref.epoch
        if timed_out:
            return wire.CompleteRequest(
                epoch=epoch,
                state="timed_out",
                error_message=(
                    f"the call exceeded its time limit of {self.assignment.timeout_s:g} s "
                    "and was killed"
                ),
            )
        outcome = _read_outcome(result_path)
        if outcome is None:
            return wire.CompleteRequest(
                epoch=epoch,
                state="failed",
                error_kind=wire.ErrorKind.WORKER_DIED,
                error_message=describe_exit(returncode),
            )
        return wire.CompleteRequest(
            epoch=epoch,
            state="succeeded" if outcome.ok else "failed",
            error_kind=outcome.error_kind,
            error_type=outcome.error_type,
            error_message=outcome.error_message,
            traceback=outcome.traceback,
            result=outcome.result,
        )

    async def _complete(self, request: wire.CompleteRequest) -> None:
        if request.result is not None and len(request.result) > self._inline_limit:
            blob = await _retrying(self._upload, request.result)
            request = msgspec.structs.replace(request, result=None, result_blob=blob.id)
        await _retrying(self._client.complete, self.ref.invocation_id, request)
        log.info("%s completed: %s", self, request.state)

    async def _upload(self, result: bytes) -> wire.BlobRef:
        return await self._client.upload_result(self.ref.invocation_id, self.ref.epoch, result)

    async def _reap(self) -> None:
        worker = self._worker
        if worker is None:
            return
        worker.kill()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(worker.wait(), EOF_GRACE_S)


async def _drain(pumps: list[asyncio.Task[None]]) -> None:
    """Wait for both pipes to reach EOF, giving up on output held open by an escaped process."""
    _, pending = await asyncio.wait(pumps, timeout=EOF_GRACE_S)
    if pending:
        log.warning("worker output still open %.0f s after it exited; cut off", EOF_GRACE_S)
    for pump in pumps:
        if pump.done() and not pump.cancelled() and pump.exception() is not None:
            log.warning("reading worker output failed: %s", pump.exception())


def _read_outcome(path: str) -> wire.WorkerOutcome | None:
    try:
        with open(path, "rb") as file:
            return _outcome_decoder.decode(file.read())
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError) as exc:
        log.warning("unreadable worker outcome %s: %s", path, exc)
        return None


def describe_exit(returncode: int | None) -> str:
    """Why a worker that left no outcome died, in words a user can act on."""
    if returncode is None:
        return "worker process vanished without leaving a result"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        message = f"worker process was killed by signal {-returncode} ({name})"
        if -returncode == signal.SIGKILL:
            message += " — often the out-of-memory killer"
        return message
    return f"worker process exited with code {returncode} without leaving a result"


async def _retrying(call: Callable[..., Awaitable[_T]], *args: Any) -> _T:
    """Retry while the gateway is unavailable; the calls retried here are idempotent."""
    backoff = Backoff()
    while True:
        try:
            return await call(*args)
        except GatewayUnavailable as exc:
            log.warning("gateway unavailable (%s); retrying", exc)
            await backoff.sleep()
