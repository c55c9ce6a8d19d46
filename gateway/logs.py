"""Server-Sent Events stream of an invocation's log output, resumable from a cursor.

``GET /v1/invocations/{id}/logs`` answers ``text/event-stream``: one event per log chunk, in
order, while the call runs and after it ended, then one ``end`` event, then the stream closes.

    id: 3
    event: stdout
    data: {"n":3,"stream":"stdout","text":"epoch 1 loss 0.31\\n"}

    event: end
    data: {"state":"succeeded","log_count":3}

- ``id`` is the chunk's number ``n`` (1, 2, ... per invocation, as ``wire.LogChunk.n``);
  ``event`` is its stream, ``stdout`` or ``stderr``. ``data`` is always ONE line of JSON:
  the chunk's text travels JSON-encoded, so newlines, a missing final newline and the
  ``\\r`` of progress bars come through exactly (SSE itself would turn every CR, LF and CRLF
  into a line break). A client concatenates the ``text`` of one stream's events to get
  that stream's output.
- Chunk boundaries fall anywhere in the byte stream. The bytes are decoded as UTF-8 per
  stream, incrementally: a character split between two chunks of a stream comes whole with
  the chunk that completes it, so an event's text is the same however the stream was
  resumed (for valid UTF-8). Invalid bytes become U+FFFD; a character still incomplete
  when the output ends is dropped.
- The stream starts after the cursor: the ``Last-Event-ID`` header (what a browser's
  EventSource sends when it reconnects) or else the ``?after=N`` query parameter; the
  header wins, so an EventSource opened on ``...?after=N`` resumes where it was, not at
  ``N``. Both default to 0 (the whole log); a cursor past the log just waits for more.
- ``end`` (no ``id``, so it leaves the client's last event id at the last chunk) comes once
  the invocation is terminal and every chunk was sent; its data is the terminal ``state``
  and the number of chunks the log has (``log_count``, the last chunk's id). The gateway
  then closes the stream; a client must not reconnect after ``end`` (an EventSource
  would: close it on ``end``), and would only get ``end`` again if it did.
- While the call runs the stream waits for new chunks (woken by the notification hub,
  re-reading every ``recheck_s``) and sends the comment line ``: keep-alive`` after
  ``KEEPALIVE_S`` (at most the gateway's ``long_poll_s``) without an event, so proxies
  keep an idle stream open.

Chunks are read ``BATCH`` at a time, so a huge log streams without being held in memory; a
client that reads slowly slows the reads. The stream ends when the client goes away
(Starlette cancels it).
"""

from __future__ import annotations

import codecs
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Literal

import asyncpg
import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from bulletin_core import wire
from gateway import db
from gateway.errors import BadRequest
from gateway.http import int_param
from gateway.invocations import _one, reader
from gateway.notify import GatewayStopping

log = logging.getLogger(__name__)

#: Most seconds a stream stays silent: then it sends a ``: keep-alive`` comment.
KEEPALIVE_S = 15.0
#: Log chunks read per query.
BATCH = 1000
#: How many chunks before a resume cursor are searched for the start of a UTF-8 character
#: that the first chunk after it completes.
LOOKBACK = 16
EVENT_STREAM = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEP_ALIVE = b": keep-alive\n\n"

_CURSOR = re.compile(r"[0-9]{1,10}")
_json = msgspec.json.Encoder()


def _cursor(request: Request) -> int:
    """Where the stream starts: after this chunk number (0: from the first). The header wins
    (an EventSource reconnects to the same URL, ``?after=`` included, with its last id)."""
    header = request.headers.get("last-event-id", "").strip()
    if header:
        if not _CURSOR.fullmatch(header) or int(header) >= 2**31:
            raise BadRequest(
                f"Last-Event-ID must be the id of a log event (a chunk number), not {header[:40]!r}"
            )
        return int(header)
    after = int_param(request, "after", 0)
    if after < 0:
        raise BadRequest("query parameter 'after' is a chunk number: 0 or more")
    return after


class _Text:
    """Each stream's bytes decoded as UTF-8 incrementally, so a character split between
    chunks comes whole with the chunk that completes it. After a resume, a stream whose
    first chunk starts inside a character first reads the bytes before the cursor."""

    def __init__(self, pool: asyncpg.Pool, invocation_id: str, resumed_after: int) -> None:
        self._pool = pool
        self._id = invocation_id
        self._resumed_after = resumed_after
        self._decoders: dict[wire.Stream, codecs.IncrementalDecoder] = {}

    async def of(self, chunk: wire.LogChunk) -> str:
        decoder = self._decoders.get(chunk.stream)
        if decoder is None:
            decoder = self._decoders[chunk.stream] = codecs.getincrementaldecoder("utf-8")(
                errors="replace"
            )
            if self._resumed_after > 0 and chunk.data[:1] and chunk.data[0] & 0xC0 == 0x80:
                decoder.decode(await self._tail(chunk.stream))  # what it completes, not sent
        return decoder.decode(chunk.data)

    async def _tail(self, stream: wire.Stream) -> bytes:
        """The last bytes (enough for any unfinished character) of ``stream`` up to the
        cursor."""
        start = max(0, self._resumed_after - LOOKBACK)
        before = await db.logs_after(self._pool, [(self._id, start)], self._resumed_after - start)
        return b"".join(c.data[-3:] for c in before if c.stream == stream)[-3:]


def _event(chunk: wire.LogChunk, text: str) -> bytes:
    stream: Literal["stdout", "stderr"] = (
        "stdout" if chunk.stream is wire.Stream.STDOUT else "stderr"
    )
    data = _json.encode(wire.LogEvent(n=chunk.n, stream=stream, text=text))
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (chunk.n, stream.encode(), data)


def _end(invocation: wire.Invocation) -> bytes:
    data = _json.encode(wire.LogEnd(state=invocation.state, log_count=invocation.log_count))
    return b"event: end\ndata: %s\n\n" % data


async def _events(
    request: Request, owner: int | None, known: wire.Invocation, sent: int
) -> AsyncIterator[bytes]:
    """The stream's body. ``known`` was read before this subscribes: the first wait re-reads
    the row after subscribing, so no change falls between the two."""
    pool: asyncpg.Pool = request.app.state.pool
    config = request.app.state.config
    keepalive = min(KEEPALIVE_S, config.long_poll_s)
    text = _Text(pool, known.id, sent)
    try:
        async with request.app.state.hub.subscribe([f"i:{known.id}"]) as sub:
            while True:
                # Every chunk up to known.log_count is committed (the count is updated with the
                # chunks); a terminal invocation gets no more, so this drain sends them all.
                while True:
                    chunks = await db.logs_after(pool, [(known.id, sent)], BATCH)
                    for chunk in chunks:
                        yield _event(chunk, await text.of(chunk))
                        sent = chunk.n
                    if len(chunks) < BATCH:
                        break
                if known.state.terminal:
                    yield _end(known)
                    return
                quiet_since = time.monotonic()
                while not (found := await db.changed(pool, owner, [(known.id, sent)])):
                    quiet = time.monotonic() - quiet_since
                    if quiet >= keepalive:
                        if not await db.get_invocations(pool, owner, [known.id]):
                            return  # purged (retention) while the stream was open
                        yield KEEP_ALIVE
                        quiet_since, quiet = time.monotonic(), 0.0
                    await sub.wait(min(config.recheck_s, keepalive - quiet))
                known = found[0]
    except GatewayStopping:
        return  # the stream just ends: the client resumes from its last event id
    finally:
        log.debug("log stream of %s closed after chunk %d", known.id, sent)


async def stream_logs(request: Request) -> Response:
    _, owner = await reader(request)  # None: an administrator, who reads anyone's
    invocation = await _one(request, owner, request.path_params["id"])  # 404 if not theirs
    after = _cursor(request)
    if request.method == "HEAD":
        return Response(media_type=EVENT_STREAM, headers=HEADERS)
    return StreamingResponse(
        _events(request, owner, invocation, after), media_type=EVENT_STREAM, headers=HEADERS
    )


ROUTES: list[Route] = [Route("/v1/invocations/{id}/logs", stream_logs, methods=["GET"])]
