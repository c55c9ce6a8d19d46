"""The gateway's domain errors and their one mapping to RFC 9457 problem+json.

ApiError
 +-- BadRequest (400)       malformed body or parameter
 +-- Unauthorized (401)     missing or unknown token
 +-- Forbidden (403)        a token of the wrong kind for this route
 +-- NotFound (404)         no such object, or another user's
 +-- Conflict (409)         a stale attempt (fencing) or a clash of names
 +-- PayloadTooLarge (413)  a body over a configured limit
 +-- Unprocessable (422)    well-formed but invalid
A lost database connection answers 503 with Retry-After (clients retry).
No response ever carries a stack trace.
"""

from __future__ import annotations

import logging

import asyncpg
import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from bulletin import wire

log = logging.getLogger(__name__)
PROBLEM = "application/problem+json"


class ApiError(Exception):
    status = 500
    title = "Internal Server Error"

    def __init__(self, detail: str, *, code: str = "") -> None:
        super().__init__(detail)
        self.detail = detail
        self.code = code


class BadRequest(ApiError):
    status, title = 400, "Bad Request"


class Unauthorized(ApiError):
    status, title = 401, "Unauthorized"


class Forbidden(ApiError):
    status, title = 403, "Forbidden"


class NotFound(ApiError):
    status, title = 404, "Not Found"


class Conflict(ApiError):
    status, title = 409, "Conflict"


class PayloadTooLarge(ApiError):
    status, title = 413, "Content Too Large"


class Unprocessable(ApiError):
    status, title = 422, "Unprocessable Content"


def problem(status: int, title: str, detail: str, code: str = "") -> Response:
    body = wire.Problem(title=title, status=status, detail=detail, code=code)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return Response(msgspec.json.encode(body), status, headers=headers, media_type=PROBLEM)


async def on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return problem(exc.status, exc.title, exc.detail, exc.code)


async def on_validation_error(request: Request, exc: Exception) -> Response:
    return problem(422, "Unprocessable Content", f"invalid request body: {exc}", "invalid_body")


async def on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return problem(exc.status_code, _title(exc.status_code), str(exc.detail))


async def on_database_unavailable(request: Request, exc: Exception) -> Response:
    log.warning("database unavailable on %s %s: %s", request.method, request.url.path, exc)
    response = problem(
        503, "Service Unavailable", "the database is unavailable; retry shortly", "db_unavailable"
    )
    response.headers["Retry-After"] = "1"
    return response


async def on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return problem(500, "Internal Server Error", "the gateway hit an unexpected error; see its log")


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
    ConnectionError: on_database_unavailable,
    msgspec.ValidationError: on_validation_error,
    msgspec.DecodeError: on_validation_error,
    HTTPException: on_http_exception,
    Exception: on_unexpected,
}
