"""The gateway's domain errors and their one mapping to RFC 9457 problem+json.

ApiError                          default ``code``
 +-- BadRequest (400)             bad_request             malformed body or parameter
 +-- Unauthorized (401)           unauthorized            missing or unknown token
 +-- Forbidden (403)              forbidden               a token of the wrong kind here
 +-- NotFound (404)               not_found               no such object, or another user's
 +-- Conflict (409)               conflict                a stale attempt, a clash of names
 +-- PayloadTooLarge (413)        too_large               a body over a configured limit
 +-- UnsupportedMediaType (415)   unsupported_media_type  a body of the wrong Content-Type
 +-- Unprocessable (422)          invalid_request         well-formed but invalid
 +-- TooManyRequests (429)        rate_limited            over the per-user rate limit
 +-- ServiceUnavailable (503)     unavailable             the database is unreachable
 +-- InsufficientStorage (507)    storage_quota_exceeded  over the user's storage limit
429 and 503 carry Retry-After (clients retry). Every problem has a ``code``; the full list
is in docs/http-api.md. No response ever carries a stack trace.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping

import asyncpg
import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Match, Route

from bulletin_core import wire

log = logging.getLogger(__name__)
PROBLEM = "application/problem+json"


class ApiError(Exception):
    status = 500
    title = "Internal Server Error"
    #: The problem's ``code`` when none is given.
    default_code = "internal"

    def __init__(
        self, detail: str, *, code: str = "", headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.code = code or self.default_code
        self.headers = dict(headers or {})


class BadRequest(ApiError):
    status, title, default_code = 400, "Bad Request", "bad_request"


class Unauthorized(ApiError):
    status, title, default_code = 401, "Unauthorized", "unauthorized"


class Forbidden(ApiError):
    status, title, default_code = 403, "Forbidden", "forbidden"


class NotFound(ApiError):
    status, title, default_code = 404, "Not Found", "not_found"


class Conflict(ApiError):
    status, title, default_code = 409, "Conflict", "conflict"


class PayloadTooLarge(ApiError):
    status, title, default_code = 413, "Content Too Large", "too_large"


class UnsupportedMediaType(ApiError):
    status, title, default_code = 415, "Unsupported Media Type", "unsupported_media_type"


class Unprocessable(ApiError):
    status, title, default_code = 422, "Unprocessable Content", "invalid_request"


class TooManyRequests(ApiError):
    status, title, default_code = 429, "Too Many Requests", "rate_limited"

    def __init__(self, detail: str, *, retry_after: int, code: str = "") -> None:
        super().__init__(detail, code=code, headers={"Retry-After": str(max(1, retry_after))})


class ServiceUnavailable(ApiError):
    status, title, default_code = 503, "Service Unavailable", "unavailable"

    def __init__(self, detail: str, *, retry_after: int = 1, code: str = "") -> None:
        super().__init__(detail, code=code, headers={"Retry-After": str(max(1, retry_after))})


class InsufficientStorage(ApiError):
    status, title, default_code = 507, "Insufficient Storage", "storage_quota_exceeded"


#: What a client retrying a 503 for a lost database waits first, in seconds.
DATABASE_RETRY_AFTER_S = 1


def problem(
    status: int,
    title: str,
    detail: str,
    code: str = "",
    headers: Mapping[str, str] | None = None,
) -> Response:
    body = wire.Problem(title=title, status=status, detail=detail, code=code)
    extra = dict(headers or {})
    if status == 401:
        extra["WWW-Authenticate"] = "Bearer"
    return Response(msgspec.json.encode(body), status, headers=extra, media_type=PROBLEM)


async def on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return problem(exc.status, exc.title, exc.detail, exc.code, exc.headers)


async def on_validation_error(request: Request, exc: Exception) -> Response:
    return problem(422, "Unprocessable Content", f"invalid request body: {exc}", "invalid_body")


async def on_decode_error(request: Request, exc: Exception) -> Response:
    return problem(400, "Bad Request", f"malformed JSON body: {exc}", "malformed_json")


#: Codes of the errors the router itself raises.
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


async def on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    status = exc.status_code
    detail = str(exc.detail)
    headers = dict(exc.headers or {})
    if status == 404:
        detail = f"no route {request.url.path}: see the API contract at GET /openapi.yaml"
    elif status == 405:
        allowed = _allowed_methods(request)
        headers = {**headers, "Allow": ", ".join(allowed)}
        detail = (
            f"{request.method} is not allowed on {request.url.path}; use {' or '.join(allowed)}"
        )
    code = _HTTP_CODES.get(status, "http_error")
    return problem(status, _title(status), detail, code, headers)


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route takes on this path (Starlette's own Allow names only the
    first route's, and a path may have a route per method)."""
    methods: set[str] = set()
    for route in request.app.routes:
        # Not the catch-alls that answer paths no route takes (they take every method).
        if not isinstance(route, Route) or not route.include_in_schema:
            continue
        if route.matches(request.scope)[0] != Match.NONE:
            methods |= route.methods or set()
    return sorted(methods)


async def on_database_unavailable(request: Request, exc: Exception) -> Response:
    if isinstance(exc, OSError) and not _is_connection_failure(exc):
        return await on_unexpected(request, exc)
    log.warning("database unavailable on %s %s: %s", request.method, request.url.path, exc)
    request.app.state.outages.note()  # the scheduling leader holds expiry (gateway/expiry.py)
    error = ServiceUnavailable(
        f"the database is unavailable; retry in {DATABASE_RETRY_AFTER_S} s or more",
        retry_after=DATABASE_RETRY_AFTER_S,
        code="db_unavailable",
    )
    return await on_api_error(request, error)


def _is_connection_failure(exc: OSError) -> bool:
    """Whether an OSError is a failed or lost network connection (to the database: the
    gateway makes no other), not a file error (the shared directory)."""
    return (
        isinstance(exc, ConnectionError | TimeoutError | socket.gaierror)
        # asyncio's connect to a host with several addresses, all refused.
        or str(exc).startswith("Multiple exceptions:")
    )


async def on_client_gone(request: Request, exc: Exception) -> Response:
    # The client went away before its body was in (a nodelet cancels a start that its
    # completion makes moot): nobody reads the answer, and nothing was done.
    log.debug("client went away during %s %s", request.method, request.url.path)
    return problem(
        400, "Bad Request", "the client went away before its body was in", "client_gone"
    )


async def on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return problem(
        500,
        "Internal Server Error",
        "the gateway hit an unexpected error; see its log",
        ApiError.default_code,
    )


def _title(status: int) -> str:
    from http import HTTPStatus

    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


HANDLERS = {
    ApiError: on_api_error,
    # A lost or refused database connection is transient (a restart, a failover): the
    # clients retry a 503, and the pool replaces the dead connection.
    asyncpg.PostgresConnectionError: on_database_unavailable,
    asyncpg.InterfaceError: on_database_unavailable,
    asyncpg.exceptions.InternalClientError: on_database_unavailable,  # a connection cut mid-use
    asyncpg.exceptions.OperatorInterventionError: on_database_unavailable,
    asyncpg.exceptions.TooManyConnectionsError: on_database_unavailable,
    OSError: on_database_unavailable,  # connection failures only; file errors are a 500
    msgspec.ValidationError: on_validation_error,
    msgspec.DecodeError: on_decode_error,
    HTTPException: on_http_exception,
    ClientDisconnect: on_client_gone,
    Exception: on_unexpected,
}
