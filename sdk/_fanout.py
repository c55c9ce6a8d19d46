"""``Function.map``: many calls, submitted and watched in batches, results in input order.

Call specs are pulled lazily from an iterator, so an item is pickled only when its batch is
about to be submitted and its payload is dropped once the batch is sent. At most ``WINDOW``
calls are outstanding (submitted, result not yet yielded), which bounds memory; a watch names
the first ``WATCH_AHEAD`` unfinished ones.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Iterator
from typing import Any

from bulletin_core import wire
from sdk import _outcome
from sdk._call import Prepared, cancel_quietly, submit
from sdk._client import Client
from sdk._watcher import Watcher

#: Calls per POST /v1/invocations (the gateway takes up to wire.MAX_SUBMIT).
SUBMIT_BATCH = 500
#: A batch is also cut once its inline payloads reach this many bytes, so that one request
#: body stays a reasonable size however big the items are.
BATCH_BYTES = 16 * 1024 * 1024
WINDOW = 2 * SUBMIT_BATCH
#: A watch names the first this many unfinished calls, not the whole window: the gateway
#: reads every call a watch names each time it is asked, and results are yielded in order
#: anyway. The later calls' logs stream once they are among these.
WATCH_AHEAD = 256


def run(client: Client, calls: Iterator[Prepared], *, return_exceptions: bool) -> Iterator[Any]:
    """Submit ``calls`` and yield their results in order. See ``Function.map``."""
    fanout = _Fanout(client, calls)
    # While the map is collected (even when the caller pauses between items), its session
    # keeps its calls alive; once this process is gone, the gateway cancels them.
    with client.liveness.held():
        try:
            yield from fanout.results(return_exceptions)
        finally:
            # Ctrl-C, an item's exception or an abandoned generator: nobody will read the rest.
            fanout.cancel_unfinished()


class _Fanout:
    def __init__(self, client: Client, calls: Iterator[Prepared]) -> None:
        self._client = client
        self._calls = calls
        self._files: dict[str, Prepared] = {}  # calls whose payload file is ours to delete
        self._exhausted = False
        self._watcher = Watcher(client)
        self._order: deque[str] = deque()  # submitted, not yet yielded, input order
        self._finished: dict[str, wire.Invocation] = {}
        # Every batch names the map: a node finishing an item may be given the next at once.
        self._map_id = str(uuid.uuid4())

    def results(self, return_exceptions: bool) -> Iterator[Any]:
        self._top_up()
        while self._order:
            head = self._order[0]
            if head not in self._finished:
                self._watch()
                continue
            self._order.popleft()
            yield self._outcome(self._finished.pop(head), return_exceptions)
            self._top_up()

    def cancel_unfinished(self) -> None:
        cancel_quietly(self._client, self._unfinished())
        for prepared in self._files.values():
            prepared.discard()
        self._files.clear()

    def _top_up(self) -> None:
        # Only whole batches (or the last one): topping up after every yield would send one
        # request per item.
        while not self._exhausted and WINDOW - len(self._order) >= SUBMIT_BATCH:
            batch = self._next_batch()
            if not batch:
                continue
            try:
                specs = [prepared.spec for prepared in batch]
                ids = submit(self._client, specs, map_id=self._map_id)
            except BaseException:
                for prepared in batch:
                    prepared.discard()
                raise
            self._order.extend(ids)
            self._files.update((i, p) for i, p in zip(ids, batch, strict=True) if p.payload_path)

    def _next_batch(self) -> list[Prepared]:
        batch: list[Prepared] = []
        size = 0
        for prepared in self._calls:
            batch.append(prepared)
            size += len(prepared.spec.payload or b"")
            if len(batch) >= SUBMIT_BATCH or size >= BATCH_BYTES:
                return batch
        self._exhausted = True
        return batch

    def _watch(self) -> None:
        ids = self._unfinished()[:WATCH_AHEAD]
        self._finished.update(self._watcher.poll(ids, self._client.watch_timeout_s))

    def _unfinished(self) -> list[str]:
        return [i for i in self._order if i not in self._finished]

    def _outcome(self, invocation: wire.Invocation, return_exceptions: bool) -> Any:
        prepared = self._files.pop(invocation.id, None)
        if prepared is not None:
            prepared.discard()
        resolved = _outcome.resolve(invocation, self._client)
        if resolved.error is not None and return_exceptions:
            return resolved.error
        return resolved.unwrap()
