"""Request decoding and response encoding with msgspec, plus streamed blob bodies."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import os
import re
import typing
from collections.abc import AsyncIterator
from typing import Any, BinaryIO, TypeVar

import asyncpg
import msgspec
import msgspec.inspect
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from bulletin_core import meta, wire
from gateway import db
from gateway.errors import (
    ApiError,
    BadRequest,
    InsufficientStorage,
    PayloadTooLarge,
    Unprocessable,
    UnsupportedMediaType,
)

T = TypeVar("T")
JSON = "application/json"
CHUNK = 4 << 20  # blob chunk rows; big enough to amortise a row, small enough to stream


@functools.cache
def _decoder(type_: Any) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(type_)


#: The pattern of wire.Text and wire.Name: strings PostgreSQL can store (no NUL).
_NO_NUL = typing.get_args(wire.Text)[1].pattern
#: How a string is invalid, in words, for every problem that says so.
STRING_RULE = (
    "strings must be valid Unicode: no NUL characters (\\u0000) and no lone surrogates "
    "(\\ud800-\\udfff not in a pair)"
)


async def body(request: Request, type_: type[T]) -> T:
    """Decode a JSON body as ``type_``. A body of another Content-Type gets 415, one over
    ``max_json_body`` 413 (decided before it is all read), one that is not JSON 400
    (``malformed_json``), and JSON that is not a ``type_`` 422 (``invalid_body``;
    ``unknown_field`` for a field the message does not have, ``invalid_string`` for strings
    PostgreSQL cannot store)."""
    require_json(request)
    limit = request.app.state.config.max_json_body
    declared = content_length(request)
    if declared is not None and declared > limit:
        raise _json_too_big(limit)
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > limit:
            raise _json_too_big(limit)
    if not data:
        raise BadRequest("this route needs a JSON body", code="malformed_json")
    try:
        result: T = _decoder(type_).decode(data)  # type: ignore[arg-type]
    except msgspec.ValidationError as exc:
        raise _not_json(data) or _invalid(exc, type_) from None
    except msgspec.DecodeError as exc:
        raise _undecodable(data, exc) from None
    except RecursionError:
        raise BadRequest("malformed JSON body: nested too deeply", code="malformed_json") from None
    return result


def _json_too_big(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"request body over {limit} bytes (the gateway setting max_json_body); upload big "
        "payloads as blobs",
        code="body_too_large",
    )


def _not_json(data: bytearray) -> ApiError | None:
    """The 400 (or 422 ``invalid_string``) of a body that is not JSON at all, else None.
    msgspec stops at the first value that is not the message's, before it has read the rest:
    ``{"calls": [{"gpuz": 1},`` is refused for ``gpuz``, though it is cut short."""
    try:
        msgspec.json.decode(data)
    except msgspec.ValidationError:
        return None  # JSON, with a number no float can hold: the message's error stands
    except msgspec.DecodeError as exc:
        return _undecodable(data, exc)
    except RecursionError:
        return BadRequest("malformed JSON body: nested too deeply", code="malformed_json")
    return None


#: msgspec's error for a field a strict message (wire._Request) does not have.
_UNKNOWN_FIELD = re.compile(
    r"Object contains unknown field `(?P<field>.*?)`(?: - at `(?P<at>[^`]*)`)?", re.DOTALL
)
#: How much of an unknown field's name a problem repeats.
_FIELD_SHOWN = 100


#: Where msgspec's message says the value is (absent: the body itself), and the field a
#: message says is missing.
_AT = re.compile(r" - at `(?P<at>\$[^`]*)`$")
_MISSING = re.compile(r"Object missing required field `(?P<field>[^`]*)`")
#: A step of such a path: `.name` (a field) or `[0]`, `[...]` (an item of a list or dict).
_STEP = re.compile(r"\.(\w+)|\[[^\]]*\]")


def _invalid(exc: msgspec.ValidationError, type_: Any) -> Unprocessable:
    """The 422 of a body that is JSON but not a ``type_``: msgspec's message (what it
    expected, and where: ``Expected `int` >= 0 - at `$.calls[0].gpus```), then the field's
    rule in words (its ``msgspec.Meta`` description in bulletin_core/wire.py, as openapi.yaml
    publishes it) and what to do."""
    message = str(exc)
    if unknown := _UNKNOWN_FIELD.fullmatch(message):
        return _unknown_field(unknown["field"], unknown["at"] or "$")
    if message.startswith(f"Expected `str` matching regex {_NO_NUL!r}"):
        where = message.partition(" - at ")[2]
        return Unprocessable(
            f"invalid request body: {STRING_RULE} - at {where or '`$`'}", code="invalid_string"
        )
    at = _AT.search(message)
    path = at["at"] if at else "$"
    if missing := _MISSING.match(message):
        path += f".{missing['field']}"
    steps = _STEP.findall(path)  # a field's name, or "" for an item
    rule = _description(type_, steps)
    said = f" `{steps[-1]}`: {rule}" if steps and steps[-1] and rule else ""
    what = getattr(type_, "__name__", "message")
    fix = "Add that field" if missing else "Fix that field" if steps else f"Send a {what}"
    return Unprocessable(
        f"invalid request body: {message}.{said} {fix} (the fields of every message and their "
        "rules are in the API contract, GET /openapi.yaml)",
        code="invalid_body",
    )


@functools.cache
def _type_info(type_: Any) -> msgspec.inspect.Type:
    return msgspec.inspect.type_info(type_)


def _description(type_: Any, steps: list[str]) -> str:
    """The description of what is at ``steps`` (``["calls", "", "gpus"]``: ``$.calls[0].gpus``)
    in a ``type_``; "" when it has none."""
    node: msgspec.inspect.Type | None = _type_info(type_)
    for name in steps:
        if node is None:
            break
        node = next(filter(None, (_step(kind, name) for kind in meta.kinds(node))), None)
    return meta.description(node) if node is not None and steps else ""


def _step(kind: msgspec.inspect.Type, name: str) -> msgspec.inspect.Type | None:
    """What is in a ``kind`` at the field ``name`` ("": at an item); None if nothing is."""
    if name and isinstance(kind, msgspec.inspect.StructType):
        return next((f.type for f in kind.fields if f.encode_name == name), None)
    if not name and isinstance(kind, msgspec.inspect.ListType):
        return kind.item_type
    if not name and isinstance(kind, msgspec.inspect.DictType):
        return kind.value_type
    return None


def _unknown_field(field: str, at: str) -> Unprocessable:
    if len(field) > _FIELD_SHOWN:
        field = field[:_FIELD_SHOWN] + "..."
    return Unprocessable(
        f"invalid request body: unknown field `{field}` at `{at}.{field}`: the message has "
        "no such field, and none is ignored. Remove it or fix its spelling (the fields of "
        "every message are in the API contract, GET /openapi.yaml); a client newer than this "
        "gateway needs the gateway upgraded first",
        code="unknown_field",
    )


def _undecodable(data: bytearray, exc: msgspec.DecodeError) -> ApiError:
    """400 for a body that is not JSON; 422 for JSON whose strings are not valid Unicode
    (msgspec refuses a lone surrogate such as "\\ud800" as if the body were malformed)."""
    try:
        value = json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return BadRequest(f"malformed JSON body: {exc}", code="malformed_json")
    if _has_lone_surrogate(value):
        return Unprocessable(f"invalid request body: {STRING_RULE}", code="invalid_string")
    return BadRequest(f"malformed JSON body: {exc}", code="malformed_json")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


_SURROGATE = re.compile("[\ud800-\udfff]")


def media_type(request: Request) -> tuple[str, dict[str, str]] | None:
    """The request's Content-Type, lower case, and its parameters; None when it has none."""
    header = request.headers.get("content-type")
    if header is None or not header.strip():
        return None
    kind, *params = header.split(";")
    options = {}
    for param in params:
        key, _, value = param.partition("=")
        options[key.strip().lower()] = value.strip().strip('"').lower()
    return kind.strip().lower(), options


def require_json(request: Request) -> None:
    """415 unless the body is JSON: ``application/json`` or ``application/*+json`` (UTF-8).
    A body without a Content-Type is read as JSON."""
    found = media_type(request)
    if found is None:
        return
    kind, options = found
    json_kind = kind == JSON or (kind.startswith("application/") and kind.endswith("+json"))
    if json_kind and options.get("charset", "utf-8") in ("utf-8", "utf8"):
        return
    raise UnsupportedMediaType(
        f"this route takes a JSON body: send `Content-Type: {JSON}` (UTF-8), not "
        f"{request.headers['content-type']!r}"
    )


def require_octet_stream(request: Request) -> None:
    """415 unless the body is raw bytes (``application/octet-stream``, or no Content-Type)."""
    found = media_type(request)
    if found is None or found[0] == wire.OCTET_STREAM:
        return
    raise UnsupportedMediaType(
        f"this route takes raw bytes: send `Content-Type: {wire.OCTET_STREAM}`, not "
        f"{request.headers['content-type']!r}"
    )


def content_length(request: Request) -> int | None:
    """The declared Content-Length; None without one (a chunked body). 400 if it is not a
    number (the HTTP server refuses most such requests before the gateway sees them)."""
    declared = request.headers.get("content-length")
    if declared is None:
        return None
    declared = declared.strip()
    if not declared.isascii() or not declared.isdigit():
        raise BadRequest(
            f"Content-Length must be a number of bytes, not {declared!r}", code="bad_request"
        )
    return int(declared)


def reply(value: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status, media_type=JSON)


def checked(key: str, value: str, kind: Any, what: str, *, code: str = "") -> str:
    """``value`` (of the path or query parameter ``key``) if it is a ``kind``, a constrained
    wire string; else 422 saying ``what`` it must be."""
    try:
        result: str = msgspec.convert(value, kind)
    except msgspec.ValidationError:
        raise Unprocessable(f"{key} {value!r}: {what}", code=code) from None
    return result


def wait_param(request: Request) -> float:
    """The ``wait`` query parameter: how long (seconds) a request may wait for its calls to
    finish before it answers (0 when absent), at most the gateway's ``max_wait_s``."""
    raw = request.query_params.get("wait")
    if raw is None:
        return 0.0
    most = request.app.state.config.max_wait_s
    try:
        wait = float(raw)
    except ValueError:
        wait = math.nan
    if not 0 <= wait <= most:
        raise Unprocessable(
            f"wait must be a number of seconds from 0 to {most:g} (this gateway's max_wait_s), "
            f"not {raw!r}; poll the invocation's Location for longer runs"
        )
    return wait


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


async def store_blob(request: Request, owner_id: int, *, by_user: bool = False) -> wire.BlobRef:
    """Stream the request body into a new blob of ``owner_id``, CHUNK bytes a row. A body over
    ``max_state_bytes`` gets 413, and what was stored of it is deleted.

    ``by_user``: the owner's own upload (PUT /v1/blobs). An empty one gets 422, and one that
    would take the owner's blobs over ``user_storage_mb`` gets 507: decided from its
    Content-Length before anything is stored, and for a streamed body as soon as it crosses
    the limit. Otherwise the body is a node's result of the owner's call, never refused for
    either (a finished result must not be lost), though it counts towards their storage."""
    require_octet_stream(request)
    config = request.app.state.config
    limit = config.max_state_bytes
    declared = content_length(request)
    if declared is not None and declared > limit:
        raise _too_big(f"{declared} bytes", limit)
    pool: asyncpg.Pool = request.app.state.pool
    storage = None
    if by_user:
        if declared == 0:
            raise _empty()
        storage = Storage.of(request, owner_id)
        if storage is not None:
            await storage.check(None, declared or 1, fresh=True, how=_how(declared))
    blob_id = await db.create_blob(pool, owner_id)
    try:
        size = await _store_chunks(request, pool, blob_id, limit, storage)
        if by_user and size == 0:
            raise _empty()
    except Exception:
        # Never left to look complete; a failed delete leaves an incomplete blob, never read.
        with contextlib.suppress(Exception):
            await db.delete_blob(pool, blob_id)
        raise
    await db.finish_blob(pool, blob_id, size)
    return wire.BlobRef(id=blob_id, size=size)


async def _store_chunks(
    request: Request, pool: asyncpg.Pool, blob_id: str, limit: int, storage: Storage | None
) -> int:
    pending = bytearray()
    seq = size = 0
    async for piece in request.stream():
        pending += piece
        size += len(piece)
        if size > limit:
            raise _too_big(f"{size} bytes or more", limit)
        if storage is not None and storage.over(size):
            await storage.check(blob_id, size, fresh=True)  # what it knew may be out of date
        while len(pending) >= CHUNK:
            await db.append_blob_chunk(pool, blob_id, seq, bytes(pending[:CHUNK]))
            del pending[:CHUNK]
            seq += 1
            if storage is not None:
                # Re-read every chunk: the owner's other uploads may be growing meanwhile.
                await storage.check(blob_id, size, fresh=True)
    if pending or seq == 0:
        await db.append_blob_chunk(pool, blob_id, seq, bytes(pending))
    return size


class Storage:
    """An uploading user's storage limit, and the bytes of their other blobs (as last read).
    Concurrent uploads of one user each re-read the others every CHUNK, so together they
    may pass the limit by at most a CHUNK each."""

    def __init__(self, pool: asyncpg.Pool, owner_id: int, limit: int, retention_s: float) -> None:
        self.pool, self.owner_id, self.limit, self.retention_s = pool, owner_id, limit, retention_s
        self.others = 0
        #: What they keep in the shared directory (read once, at the first fresh check).
        self.shared: int | None = None

    @classmethod
    def of(cls, request: Request, owner_id: int) -> Storage | None:
        """The limit of ``owner_id``; None when the gateway sets none."""
        config = request.app.state.config
        limit = config.user_storage_bytes
        if limit is None:
            return None
        return cls(request.app.state.pool, owner_id, limit, config.retention_s)

    def over(self, size: int) -> bool:
        return self.others + (self.shared or 0) + size > self.limit

    async def check(
        self, blob_id: str | None, size: int, *, fresh: bool = False, how: str = "streamed"
    ) -> None:
        """507 if a blob of ``size`` bytes takes the owner over the limit; ``how`` the size
        is known: "declared" (Content-Length), "streamed" (so far), "unknown" (not yet: 1).
        ``fresh``: re-read their other blobs first."""
        if fresh and self.shared is None:
            self.others, self.shared = await db.storage_usage(self.pool, self.owner_id, blob_id)
        elif fresh:
            self.others = await db.blob_usage(self.pool, self.owner_id, blob_id)
        if self.over(size):
            raise self._exceeded(size, how)

    def exceeded_by_calls(self) -> InsufficientStorage:
        """Why new calls are refused (their results would not fit)."""
        return self._exceeded(0, "calls")

    def _exceeded(self, size: int, how: str) -> InsufficientStorage:
        head = {
            "declared": f"this blob of {_size(size)} does not fit",
            "streamed": f"this blob does not fit (it passed {_size(size)})",
            "calls": "no room for the results of new calls, so they are refused until there is",
        }.get(how, "no room for another blob")
        days = self.retention_s / 86400
        return InsufficientStorage(
            f"over your storage limit: {head}: you store {_mib(self.others)} in other blobs "
            f"and {_mib(self.shared or 0)} in the shared directory, and each user may store "
            f"{_mib(self.limit)} (the gateway setting "
            f"user_storage_mb). Payloads and results are purged {days:g} days after their "
            "calls end (--retention-s): fetch results promptly and let old calls age out, "
            "unregister functions you no longer need, send less state, or ask an "
            "administrator to raise the limit",
            code="storage_quota_exceeded",
        )


async def room_for_calls(request: Request, owner_id: int, adding: int = 0) -> None:
    """507 if ``owner_id`` already stores as much as their storage limit (blobs, and files
    in the shared directory), or would with the ``adding`` bytes of the new calls' payload
    files: their results would take them past it, and results are never refused once a
    call ran (its result would be lost), so it is the calls that are refused, before they
    run."""
    storage = Storage.of(request, owner_id)
    if storage is not None:
        await storage.check(None, max(1, adding), fresh=True, how="calls")


def no_room_for_calls(request: Request, blobs: int, shared: int) -> InsufficientStorage:
    """The 507 of :func:`room_for_calls`, for a submission that found, in its own statement,
    that its owner stores ``blobs`` bytes in blobs and ``shared`` in the shared directory."""
    storage = Storage.of(request, 0)
    assert storage is not None  # only a gateway with a storage limit finds no room
    storage.others, storage.shared = blobs, shared
    return storage.exceeded_by_calls()


def _how(declared: int | None) -> str:
    return "unknown" if declared is None else "declared"


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"


def _size(size: int) -> str:
    return f"{size} bytes" if size < 1 << 20 else _mib(size)


def _empty() -> Unprocessable:
    return Unprocessable(
        "a blob needs at least one byte: send the bytes as the request body (an empty "
        "payload or result needs no blob)",
        code="empty_blob",
    )


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


def stream_file(file: BinaryIO) -> StreamingResponse:
    """Stream an open file (closed at the end), CHUNK bytes at a time off the event loop."""
    size = os.fstat(file.fileno()).st_size

    async def chunks() -> AsyncIterator[bytes]:
        # Exactly the size announced: the file's owner may change it meanwhile.
        left = size
        with file:
            while left > 0 and (data := await asyncio.to_thread(file.read, min(CHUNK, left))):
                left -= len(data)
                yield data

    return StreamingResponse(
        chunks(), media_type=wire.OCTET_STREAM, headers={"content-length": str(size)}
    )
