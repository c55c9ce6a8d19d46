"""The sdk's two HTTP paths, the lean client for small JSON exchanges (bulletin_core/http1.py)
and httpx (streams, or every request when the environment names a proxy), answer and refuse
alike. Against a real uvicorn whose app answers as each test scripts it (the answers of a
gateway that is restarting or rate-limiting): 503s retried with the same idempotency key,
Retry-After honoured, a 429 past the deadline raised at once, errors mapped, a refused
connection reported as unreachable."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import msgspec
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import sdk
from bulletin_core import wire
from tests.appserver import serving

SUBMIT = msgspec.json.Decoder(wire.SubmitRequest)
script: list[Response] = []
received: list[tuple[float, bytes]] = []


def problem(status: int, detail: str, headers: dict[str, str] | None = None) -> Response:
    body = msgspec.json.encode(wire.Problem(title="scripted", status=status, detail=detail))
    return Response(body, status, headers=headers, media_type="application/problem+json")


async def scripted(request: Request) -> Response:
    received.append((time.monotonic(), await request.body()))
    return script.pop(0)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    app = Starlette(
        routes=[
            Route("/v1/invocations", scripted, methods=["POST"]),
            Route("/v1/invocations/{id}", scripted),
        ]
    )
    with serving(app) as url:
        yield url


@pytest.fixture(params=["lean", "httpx"])
def client(request: pytest.FixtureRequest, server: str) -> Iterator[sdk.Client]:
    client = sdk.Client(server, "bu_test")
    if request.param == "httpx":
        client._fast = None
    assert (client._fast is not None) == (request.param == "lean")
    client.backoff_initial_s = 0.001
    client.backoff_max_s = 0.01
    client.retry_deadline_s = 5
    script.clear()
    received.clear()
    yield client
    client.close()


def spec() -> wire.CallSpec:
    return wire.CallSpec(idempotency_key="k" * 32, function_name="f", payload=b"x")


def test_a_503_is_retried_after_its_retry_after_with_the_same_key(client: sdk.Client) -> None:
    script[:] = [
        problem(503, "restarting", {"Retry-After": "0.2"}),
        problem(502, "restarting"),
        Response(msgspec.json.encode(wire.SubmitResponse(ids=["i-1"])), 201),
    ]
    assert client.submit([spec()]) == ["i-1"]
    assert len(received) == 3
    assert received[1][0] - received[0][0] >= 0.2
    keys = {SUBMIT.decode(body).calls[0].idempotency_key for _, body in received}
    assert keys == {"k" * 32}


def test_a_429_past_the_deadline_is_rate_limited_at_once(client: sdk.Client) -> None:
    client.retry_deadline_s = 1
    script[:] = [problem(429, "too many requests", {"Retry-After": "30"})]
    started = time.monotonic()
    with pytest.raises(sdk.RateLimited) as info:
        client.get("i-7")
    assert time.monotonic() - started < 1 and len(received) == 1
    assert (info.value.status, info.value.retry_after) == (429, 30)
    assert "too many requests" in str(info.value)


@pytest.mark.parametrize(
    ("status", "kind"),
    [(401, sdk.AuthError), (404, sdk.NotFoundError), (422, sdk.InvalidRequest)],
)
def test_error_answers_raise_the_same_exceptions(
    client: sdk.Client, status: int, kind: type[Exception]
) -> None:
    script[:] = [problem(status, "scripted refusal")]
    with pytest.raises(kind, match="scripted refusal"):
        client.get("i-7")


def test_an_answer_that_is_not_what_the_route_returns_is_a_gateway_error(
    client: sdk.Client,
) -> None:
    script[:] = [Response(b"<html>a proxy's page</html>", 200, media_type="text/html")]
    with pytest.raises(sdk.GatewayError, match="Unexpected answer to GET"):
        client.get("i-7")


def test_a_refused_connection_is_unreachable_after_the_deadline(client: sdk.Client) -> None:
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    refused = sdk.Client(f"http://127.0.0.1:{port}", "bu_test")
    if client._fast is None:
        refused._fast = None  # the httpx path, as the client under test
    refused.backoff_initial_s, refused.backoff_max_s = 0.001, 0.01
    refused.retry_deadline_s = 0.3
    with pytest.raises(sdk.GatewayUnreachable, match=f"127.0.0.1:{port}"):
        refused.get("i-7")
    refused.close()
