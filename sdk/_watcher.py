"""Waiting for invocations: long-polling the gateway and printing remote logs live.

The watcher remembers, per invocation, how many log chunks it has printed and passes that as
``log_after``, so a chunk is printed once and in order however the long-polls fall. An
invocation counts as finished only once it is terminal *and* its log is drained
(``log_count`` reached), so the last lines a function prints are never lost.
"""

from __future__ import annotations

import codecs
import logging
import sys
import time
from collections.abc import Iterable, Sequence

from bulletin_core import wire
from bulletin_core.backoff import Backoff
from sdk._client import Client, retry_schedule
from sdk._errors import GatewayUnreachable

_log = logging.getLogger("sdk")


class LogPrinter:
    """Writes remote log chunks to this process's stdout and stderr as they arrive.

    Each invocation's stream has its own incremental UTF-8 decoder, so a character split
    across chunks is written whole. ``sys.stdout`` is looked up at each write because
    Jupyter swaps it per cell. The text is written exactly as it came (``\\r`` progress
    bars included) and flushed at once.
    """

    def __init__(self) -> None:
        self._decoders: dict[tuple[str, wire.Stream], codecs.IncrementalDecoder] = {}
        self._printed: dict[str, int] = {}

    def printed(self, invocation_id: str) -> int:
        """The number of the last chunk printed for an invocation (0 for none)."""
        return self._printed.get(invocation_id, 0)

    def write(self, chunks: Iterable[wire.LogChunk]) -> set[str]:
        """Print the chunks not printed yet, in order; returns the invocations that had any."""
        fresh: set[str] = set()
        for chunk in sorted(chunks, key=lambda c: (c.invocation_id, c.n)):
            if chunk.n <= self.printed(chunk.invocation_id):
                continue  # an overlapping answer: already printed
            self._printed[chunk.invocation_id] = chunk.n
            _emit(chunk.stream, self._decoder(chunk.invocation_id, chunk.stream).decode(chunk.data))
            fresh.add(chunk.invocation_id)
        return fresh

    def close(self, invocation_id: str) -> None:
        """Flush what the decoders of a finished invocation still hold, and forget it (a
        map of many items keeps nothing of those it is done with)."""
        self._printed.pop(invocation_id, None)
        for stream in wire.Stream:
            decoder = self._decoders.pop((invocation_id, stream), None)
            if decoder is not None:
                _emit(stream, decoder.decode(b"", final=True))

    def _decoder(self, invocation_id: str, stream: wire.Stream) -> codecs.IncrementalDecoder:
        key = (invocation_id, stream)
        if key not in self._decoders:
            self._decoders[key] = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return self._decoders[key]


def _emit(stream: wire.Stream, text: str) -> None:
    target = sys.stdout if stream == wire.Stream.STDOUT else sys.stderr
    if text and target is not None:
        target.write(text)
        target.flush()


class Watcher:
    """Long-polls for a set of invocations, printing their logs, until they finish."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self.printer = LogPrinter()
        # Terminal invocations whose log may not be drained yet, and whether they already
        # had one round to deliver it.
        self._terminal: dict[str, wire.Invocation] = {}
        self._waited: set[str] = set()
        #: Since when (monotonic) the gateway has been unreachable; None while it answers.
        self._outage_since: float | None = None
        #: The pauses between rounds of the current outage (each round already retried for
        #: the client's retry deadline), jittered so that many notebooks' waits spread out.
        self._backoff: Backoff | None = None

    def poll(self, ids: Sequence[str], timeout_s: float) -> dict[str, wire.Invocation]:
        """One round of long-polls over ``ids``; returns those that finished, by id (none
        while the gateway is unreachable, for up to the client's ``outage_patience_s``: it
        may be restarting; the wait re-attaches once it is back)."""
        try:
            found = self._poll(ids, timeout_s)
        except GatewayUnreachable as exc:
            self._unreachable(ids, exc)
            return {}
        if self._outage_since is not None:
            _log.warning("The gateway is back; still waiting for %d call(s).", len(ids))
            self._outage_since = None
            self._backoff = None
        return found

    def _unreachable(self, ids: Sequence[str], exc: GatewayUnreachable) -> None:
        now = time.monotonic()
        if self._outage_since is None:
            # The client already retried for its retry deadline before giving up.
            self._outage_since = now - self._client.retry_deadline_s
            _log.warning(
                "The gateway is unreachable (%s); still waiting for %d call(s) for up to "
                "%.0f s, as it may be restarting (Ctrl-C stops waiting and cancels them).",
                exc,
                len(ids),
                self._client.outage_patience_s,
            )
        if now - self._outage_since >= self._client.outage_patience_s:
            raise exc
        if self._backoff is None:
            self._backoff = retry_schedule(
                self._client.backoff_initial_s, self._client.backoff_max_s
            )
        self._backoff.sleep_sync()

    def _poll(self, ids: Sequence[str], timeout_s: float) -> dict[str, wire.Invocation]:
        batches = [ids[i : i + wire.MAX_WATCH] for i in range(0, len(ids), wire.MAX_WATCH)]
        fresh: set[str] = set()
        for batch in batches:
            # Several batches share the hold so that news in a later one is not held back.
            answer = self._client.watch(self._items(batch), timeout_s=timeout_s / len(batches))
            fresh |= self._note(answer.invocations, answer.logs)
        return {i: self._terminal.pop(i) for i in ids if self._drained(i, fresh)}

    def take(
        self,
        ids: Sequence[str],
        invocations: Iterable[wire.Invocation],
        logs: Iterable[wire.LogChunk],
    ) -> dict[str, wire.Invocation]:
        """A round's news that came another way (a submission that waited): print its logs;
        returns those of ``ids`` that finished, as :meth:`poll` does."""
        fresh = self._note(invocations, logs)
        return {i: self._terminal.pop(i) for i in ids if self._drained(i, fresh)}

    def _note(
        self, invocations: Iterable[wire.Invocation], logs: Iterable[wire.LogChunk]
    ) -> set[str]:
        fresh = self.printer.write(logs)
        self._terminal.update((i.id, i) for i in invocations if i.state.terminal)
        return fresh

    def _items(self, ids: Sequence[str]) -> list[wire.WatchItem]:
        return [wire.WatchItem(id=i, log_after=self.printer.printed(i)) for i in ids]

    def _drained(self, invocation_id: str, fresh: set[str]) -> bool:
        invocation = self._terminal.get(invocation_id)
        if invocation is None:
            return False
        # A round that brought no new chunk after the terminal state means the gateway has
        # no more to give, whatever log_count says.
        stalled = invocation_id in self._waited and invocation_id not in fresh
        if self.printer.printed(invocation_id) < invocation.log_count and not stalled:
            self._waited.add(invocation_id)
            return False
        self._waited.discard(invocation_id)
        self.printer.close(invocation_id)
        return True
