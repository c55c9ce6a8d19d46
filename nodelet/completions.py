"""Attempts' outcomes, many per request (``POST /v1/node/complete``).

An outcome handed in while a request is in flight goes with the next one, so that a node
running short calls back to back sends one request per batch of them rather than one per
call, and the answer brings the next items of the maps completed (``Assignment.lease``),
which the node starts while their results are still on their way. Each caller waits for its
own outcome's answer and gets what the single-attempt route would give it: nothing when it
was committed, :class:`~nodelet.errors.StaleAttempt` when it was discarded, the request's
error otherwise (the caller retries while the gateway is unavailable). A batch the gateway
refuses as a whole (422: one outcome it does not take) is sent again one outcome at a time,
so that one call's outcome cannot refuse the others'; a gateway without the route (an older
one) gets every outcome on its own from then on. An outcome that goes alone and is no map
item's (nothing to take next) takes the single-attempt route: one statement, where a batch
also locks the node for the next items.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import NamedTuple

import msgspec

from bulletin_core import wire
from nodelet.client import GatewayClient
from nodelet.errors import GatewayRejected, NodeletError, StaleAttempt

log = logging.getLogger(__name__)

#: The most bytes of inline results one request carries (one outcome may be bigger).
BATCH_BYTES = 8 * 1024 * 1024


class _Pending(NamedTuple):
    invocation_id: str
    request: wire.CompleteRequest
    done: asyncio.Future[None]
    #: A map item's: the batch's answer may bring the map's next items.
    mapped: bool


class Completions:
    """The node's outcome sender: one request in flight at a time."""

    def __init__(
        self,
        client: GatewayClient,
        on_assignments: Callable[[list[wire.Assignment]], None],
        take_more: Callable[[], bool],
    ) -> None:
        self._client = client
        self._on_assignments = on_assignments
        self._take_more = take_more
        self._pending: collections.deque[_Pending] = collections.deque()
        self._sender: asyncio.Task[None] | None = None
        #: False once the gateway answered that it has no batch route.
        self._batched = True

    async def complete(
        self, invocation_id: str, request: wire.CompleteRequest, *, mapped: bool = True
    ) -> None:
        """Send one attempt's outcome (with others in flight meanwhile); raises as
        ``GatewayClient.complete`` does. ``mapped``: the attempt is a map item's (its
        assignment had a ``lease``), so the answer may bring the map's next items."""
        if not self._batched:
            await self._client.complete(invocation_id, request)
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(invocation_id, request, done, mapped))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_all(), name="nodelet-completions")
        await done

    async def aclose(self) -> None:
        if self._sender is not None:
            self._sender.cancel()
            await asyncio.wait([self._sender])
        for pending in self._pending:
            pending.done.cancel()
        self._pending.clear()

    async def _send_all(self) -> None:
        while self._pending:
            batch = self._take()
            try:
                await self._send(batch)
            except asyncio.CancelledError:
                for pending in batch:
                    pending.done.cancel()
                raise
            except Exception as exc:  # not the gateway's answer: a fault of this node's
                log.exception("sending %d outcomes failed", len(batch))
                for pending in batch:
                    if not pending.done.done():
                        pending.done.set_exception(exc)

    def _take(self) -> list[_Pending]:
        batch: list[_Pending] = []
        size = 0
        while self._pending and len(batch) < wire.MAX_COMPLETE:
            pending = self._pending[0]
            request = pending.request
            size += len(request.result or b"") + sum(len(c.data) for c in request.logs)
            if batch and size > BATCH_BYTES:
                break
            self._pending.popleft()
            if not pending.done.done():  # its attempt was killed meanwhile: nobody waits
                batch.append(pending)
        return batch

    async def _send(self, batch: list[_Pending]) -> None:
        if not batch:
            return
        if len(batch) == 1 and not batch[0].mapped:
            await self._send_one(batch[0])
            return
        completions = [
            wire.Completion(invocation_id=p.invocation_id, **msgspec.structs.asdict(p.request))
            for p in batch
        ]
        try:
            answer = await self._client.complete_many(completions, take_more=self._take_more())
        except GatewayRejected as exc:
            if exc.status in (404, 405):
                log.info("the gateway takes no batched completions; sending them one by one")
                self._batched = False
            await asyncio.gather(*(self._send_one(pending) for pending in batch))
            return
        except NodeletError as exc:
            for pending in batch:
                if not pending.done.done():
                    pending.done.set_exception(exc)
            return
        committed = set(answer.done)
        for invocation_id, _, done, _ in batch:
            if done.done():
                continue
            if invocation_id in committed:
                done.set_result(None)
            else:
                done.set_exception(
                    StaleAttempt(
                        f"invocation {invocation_id}: the gateway discarded its outcome (the "
                        "attempt is no longer this node's at its epoch)",
                        status=409,
                    )
                )
        if answer.assignments:
            self._on_assignments(answer.assignments)

    async def _send_one(self, pending: _Pending) -> None:
        done = pending.done
        try:
            await self._client.complete(pending.invocation_id, pending.request)
        except Exception as exc:  # the caller's: it handles it as a single send's
            if not done.done():
                done.set_exception(exc)
        else:
            if not done.done():
                done.set_result(None)
