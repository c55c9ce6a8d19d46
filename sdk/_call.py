"""A handle on one remote invocation, and the submit/cancel steps every call goes through."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

from bulletin_core import shared, wire
from bulletin_core.pickling import caller
from sdk import _outcome
from sdk._client import Client
from sdk._config import default_client
from sdk._errors import BulletinError, ResultTimeout
from sdk._watcher import Watcher

R = TypeVar("R")

_log = logging.getLogger(__name__)

#: How long best-effort cancellation (after Ctrl-C, or of an abandoned map) may take in all.
CANCEL_DEADLINE_S = 3.0


@dataclasses.dataclass
class Prepared:
    """A call ready to submit, and what the caller keeps until its outcome is back."""

    spec: wire.CallSpec
    sync: caller.Sync | None = None
    payload_path: str | None = None  # a payload file in the shared directory, ours to delete

    def discard(self) -> None:
        """Delete the payload file, once the call can no longer run (again)."""
        if self.payload_path is not None:
            shared.remove_later(self.payload_path)
            self.payload_path = None


class Status(str):
    """A call's state, with where it stands in the queue and why it waits while queued
    (``position`` 1 is next; None before the scheduler has looked at it), and how often it was
    preempted. Compares and prints as the state; ``repr`` says the rest."""

    position: int | None
    reason: str | None
    preemptions: int
    #: Why it was preempted the last time, if it was.
    preempt_reason: str | None

    def __new__(
        cls,
        state: str,
        position: int | None = None,
        reason: str | None = None,
        preemptions: int = 0,
        preempt_reason: str | None = None,
    ) -> Status:
        status = super().__new__(cls, state)
        status.position, status.reason = position, reason
        status.preemptions, status.preempt_reason = preemptions, preempt_reason
        return status

    def __repr__(self) -> str:
        details = []
        if self.position is not None:
            details.append(f"position {self.position}")
        if self.reason:
            details.append(self.reason)
        if self.preemptions:
            why = f": {self.preempt_reason}" if self.preempt_reason else ""
            details.append(f"preempted {self.preemptions} time(s){why}")
        return f"<Status {self}" + (f" ({'; '.join(details)})" if details else "") + ">"


class Call(Generic[R]):
    """A remote invocation: wait for its result, cancel it, or look at its state.

    Made by ``Function.spawn``, or by ``Call.from_id`` to re-attach to an invocation made
    earlier (for instance before a kernel restart).
    """

    def __init__(
        self,
        invocation_id: str,
        client: Client,
        *,
        prepared: Prepared | None = None,
        news: wire.SubmitResponse | None = None,
    ) -> None:
        self._id = invocation_id
        self._client = client
        self._watcher = Watcher(client)
        self._final: wire.Invocation | None = None
        if news is not None:  # the submission waited: its answer is the first watch round
            self._final = self._watcher.take([invocation_id], news.invocations, news.logs).get(
                invocation_id
            )
        self._prepared = prepared
        self._resolved: _outcome.Resolved | None = None
        self._resolving = threading.Lock()

    @classmethod
    def from_id(cls, invocation_id: str, *, client: Client | None = None) -> Call[Any]:
        """Re-attach to an invocation by id. Raises ``NotFoundError`` if there is none."""
        client = client or default_client()
        client.get(invocation_id)  # fail here, not at the first result()
        return cls(invocation_id, client)

    def __repr__(self) -> str:
        return f"<sdk.Call {self._id}>"

    @property
    def id(self) -> str:
        """The invocation id."""
        return self._id

    def result(self, timeout: float | None = None, *, trust: bool | str = False) -> R:
        """Wait for the call and return its value, printing its output live meanwhile.

        The first time it returns (or raises the call's own exception), the globals the call
        changed are applied to the notebook, as if the function had run here; later calls
        return the same value without applying anything again.

        Re-raises the remote exception (see ``sdk.BulletinError``). With ``timeout`` (seconds),
        raises ``ResultTimeout`` when the wait runs out; the call keeps running. Ctrl-C
        cancels the call and re-raises ``KeyboardInterrupt``.

        A result made by another user's code (a colleague's registered function invoked over
        HTTP, or, for an administrator, another user's call) is not unpickled, which would
        run code they chose here: ``UntrustedResult`` is raised, unless ``trust`` names that
        user (or is True: anyone).
        """
        with self._resolving:  # one thread loads and applies the outcome; others wait
            refused = self._resolved is not None and self._resolved.untrusted
            if self._resolved is None or (refused and trust):
                self._resolve(timeout, trust)
        assert self._resolved is not None
        value: R = self._resolved.unwrap()
        return value

    def _resolve(self, timeout: float | None, trust: bool | str = False) -> None:
        try:
            invocation = self._wait(timeout)
        except KeyboardInterrupt:
            cancel_quietly(self._client, [self._id])
            self._release()
            raise
        prepared = self._prepared
        # Interrupted or failed (Ctrl-C while a big result downloads, the gateway away), the
        # outcome is not applied yet: keep what applying it needs, result() may be retried.
        self._resolved = _outcome.resolve(
            invocation, self._client, prepared.sync if prepared else None, trust=trust
        )
        self._release()

    @property
    def timings(self) -> wire.Timeline:
        """When each step of the call happened (epoch seconds, None where not reached):
        ``submitted, scheduled, delivered, worker_acquired, started, finished, stored,
        fetched``, and ``warm`` (whether its worker process was already running)."""
        if self._final is not None and self._final.timeline.fetched is not None:
            return self._final.timeline
        return self.info().timeline

    @property
    def remote_globals(self) -> dict[str, Any]:
        """What the call sent back for each global it changed (empty before ``result()``),
        including those not applied because the notebook changed them meanwhile."""
        return dict(self._resolved.remote_globals) if self._resolved else {}

    def _release(self) -> None:
        # The outcome is in (or the call is abandoned): drop the payload file and the
        # references kept to the notebook's objects.
        if self._prepared is not None:
            self._prepared.discard()
            self._prepared.sync = None

    def cancel(self) -> None:
        """Ask the gateway to cancel the call; cancelling a finished call changes nothing."""
        self._client.cancel(self._id)

    def status(self) -> Status:
        """The current state: queued, assigned, running, succeeded, failed, timed_out,
        cancelled. A string (``call.status() == "queued"``) that, while queued, also says
        where the call stands and why it waits (``.position``, ``.reason``)."""
        info = self.info()
        return Status(
            info.state.value,
            info.queue_position,
            info.wait_reason,
            info.preemptions,
            info.preempt_reason,
        )

    def info(self) -> wire.Invocation:
        """Everything the gateway knows of the call (state, node, attempts, timeline...)."""
        return self._client.get(self._id)

    def _wait(self, timeout: float | None) -> wire.Invocation:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._final is None:
            hold = self._client.watch_timeout_s
            if deadline is not None:
                hold = max(0.0, min(hold, deadline - time.monotonic()))
            self._final = self._watcher.poll([self._id], hold).get(self._id)
            if self._final is None and deadline is not None and time.monotonic() >= deadline:
                raise ResultTimeout(
                    f"Call {self._id} did not finish within {timeout:g} s; it keeps running. "
                    "Call .result() again to keep waiting, or .cancel() to stop it.",
                    invocation_id=self._id,
                )
        return self._final


def submit(
    client: Client, specs: Sequence[wire.CallSpec], *, map_id: str | None = None
) -> list[str]:
    """Submit calls (``map_id``: as items of that map); if Ctrl-C interrupts, cancel
    whatever the gateway may have created."""
    try:
        return client.submit(specs, map_id=map_id)
    except KeyboardInterrupt:
        _withdraw(client, specs)
        raise


def submit_waiting(client: Client, spec: wire.CallSpec) -> wire.SubmitResponse:
    """Submit one call and wait for its first news in the same request (see
    ``Client.submit_waiting``); if Ctrl-C interrupts, cancel it if it was created."""
    try:
        return client.submit_waiting(spec, client.watch_timeout_s)
    except KeyboardInterrupt:
        _withdraw(client, [spec])
        raise


def _withdraw(client: Client, specs: Sequence[wire.CallSpec]) -> None:
    # Re-submitting with the same idempotency keys is the only way to learn the ids of the
    # calls that were created; those that were not get created only to be cancelled at once.
    try:
        ids = client.submit(specs, deadline_s=CANCEL_DEADLINE_S)
    except BulletinError as exc:
        _log.warning(
            "Could not cancel an interrupted submission of %d call(s): %s", len(specs), exc
        )
        return
    cancel_quietly(client, ids)


def cancel_quietly(client: Client, ids: Sequence[str]) -> None:
    """Best-effort cancellation, in as few requests as the gateway allows, bounded by
    ``CANCEL_DEADLINE_S`` in all; never raises."""
    deadline = time.monotonic() + CANCEL_DEADLINE_S
    failed: list[str] = []
    for start in range(0, len(ids), wire.MAX_WATCH):
        batch = list(ids[start : start + wire.MAX_WATCH])
        left = deadline - time.monotonic()
        if left <= 0 or not _cancel(client, batch, left):
            failed += batch
    if failed:
        _log.warning(
            "Could not cancel %d call(s); they may keep running: %s", len(failed), failed[:10]
        )


def _cancel(client: Client, ids: list[str], deadline_s: float) -> bool:
    try:
        if len(ids) == 1:
            client.cancel(ids[0], deadline_s=deadline_s)
        else:
            client.cancel_many(ids, deadline_s=deadline_s)
    except BulletinError:
        return False
    return True
