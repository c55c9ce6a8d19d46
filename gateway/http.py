"""Request decoding and response encoding with msgspec, plus streamed blob bodies."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import asyncpg
import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from bulletin import wire
from gateway import db
from gateway.errors import BadRequest, PayloadTooLarge

T = TypeVar("T")
JSON = "application/json"
CHUNK = 4 << 20  # blob chunk rows; big enough to amortise a row, small enough to stream


@functools.cache
def _decoder(type_: Any) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(type_)


async def body(request: Request, type_: type[T]) -> T:
    """Decode a JSON body as ``type_``; invalid bodies raise msgspec errors (→ 422)."""
    limit = request.app.state.config.max_json_body
    declared = request.headers.get("content-length")
    if declared is not None and int(declared) > limit:
        raise PayloadTooLarge(f"request body over {limit} bytes; upload big payloads as blobs")
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > limit:
            raise PayloadTooLarge(f"request body over {limit} bytes; upload big payloads as blobs")
    if not data:
        raise BadRequest("this route needs a JSON body")
    result: T = _decoder(type_).decode(data)  # type: ignore[arg-type]
    return result


def reply(value: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status, media_type=JSON)


def int_param(request: Request, name: str, default: int | None = None) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        if default is None:
            raise BadRequest(f"query parameter '{name}' is required")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"query parameter '{name}' must be an integer, not {raw!r}") from None
    if not -(2**31) <= value < 2**31:
        raise BadRequest(f"query parameter '{name}' is out of range")
    return value


async def store_blob(request: Request, owner_id: int) -> wire.BlobRef:
    """Stream the request body into a new blob of ``owner_id``, CHUNK bytes a row. A body over
    ``max_state_bytes`` gets 413, and what was stored of it is deleted."""
    limit = request.app.state.config.max_state_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_big(f"{int(declared)} bytes", limit)
    pool: asyncpg.Pool = request.app.state.pool
    blob_id = await db.create_blob(pool, owner_id)
    try:
        size = await _store_chunks(request, pool, blob_id, limit)
    except Exception:
        # Never left to look complete; a failed delete leaves an incomplete blob, never read.
        with contextlib.suppress(Exception):
            await db.delete_blob(pool, blob_id)
        raise
    await db.finish_blob(pool, blob_id, size)
    return wire.BlobRef(id=blob_id, size=size)


async def _store_chunks(request: Request, pool: asyncpg.Pool, blob_id: str, limit: int) -> int:
    pending = bytearray()
    seq = size = 0
    async for piece in request.stream():
        pending += piece
        size += len(piece)
        if size > limit:
            raise _too_big(f"{size} bytes or more", limit)
        while len(pending) >= CHUNK:
            await db.append_blob_chunk(pool, blob_id, seq, bytes(pending[:CHUNK]))
            del pending[:CHUNK]
            seq += 1
    if pending or seq == 0:
        await db.append_blob_chunk(pool, blob_id, seq, bytes(pending))
    return size


def _too_big(size: str, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the body is {size}, over this cluster's limit of {limit} bytes for a payload or "
        "result (the gateway setting max_state_bytes): send less state with the call, or "
        "ask the admin to raise the limit",
        code="state_too_large",
    )


def stream_blob(pool: asyncpg.Pool, blob_id: str, size: int) -> StreamingResponse:
    async def chunks() -> AsyncIterator[bytes]:
        seq = 0
        while (data := await db.blob_chunk(pool, blob_id, seq)) is not None:
            yield data
            seq += 1

    return StreamingResponse(
        chunks(), media_type=wire.OCTET_STREAM, headers={"content-length": str(size)}
    )
