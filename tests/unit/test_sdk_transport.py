"""The sdk's HTTP layer (its httpx path), faked with respx only where a real gateway cannot
be made to answer that way: 503s, 429s and refused connections (retries, Retry-After,
GatewayUnreachable, RateLimited), and the chunks a big payload is streamed in. Status
mapping is checked on plain ``httpx.Response`` objects."""

from __future__ import annotations

import email.utils
import itertools
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import respx

import sdk
from bulletin_core import wire
from bulletin_core.backoff import Backoff
from bulletin_core.pickling import remote
from sdk import _client
from sdk import _config as config
from sdk._client import UPLOAD_CHUNK, error_for, retry_after, retry_schedule

URL = "http://gateway.test"
SUBMIT = msgspec.json.Decoder(wire.SubmitRequest)


BLOB_ID = "9f1c2a52-4a1e-4d7c-9a55-0d9a3b2f6e11"


def double(x: object) -> object:
    return x


# What a gateway without a shared directory says of itself.
CLUSTER = {"inline_limit": 1 << 20, "max_state_bytes": 16 << 30}


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> Iterator[sdk.Client]:
    monkeypatch.setattr(config, "_default", None)
    client = sdk.connect(URL, "bu_test")
    # respx fakes httpx: every request takes it here. The lean client's answers are mapped
    # the same way (tests/integration/test_sdk_http_paths.py holds both paths to that).
    client._fast = None
    client.backoff_initial_s = 0.001
    client.backoff_max_s = 0.01
    client.retry_deadline_s = 0.3
    yield client
    client.close()


def problem(status: int, headers: dict[str, str] | None = None) -> httpx.Response:
    body = wire.Problem(title="Service Unavailable", status=status, detail="restarting")
    return httpx.Response(status, content=msgspec.json.encode(body), headers=headers)


def rate_limited(after: str) -> httpx.Response:
    body = wire.Problem(
        title="Too Many Requests", status=429, detail="too many requests", code="rate_limited"
    )
    return httpx.Response(429, content=msgspec.json.encode(body), headers={"Retry-After": after})


INVOCATION = wire.Invocation(id="i-7", state=wire.State.QUEUED)


def test_submit_retries_503_with_the_same_idempotency_keys(client: sdk.Client) -> None:
    sent: list[wire.SubmitRequest] = []

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.headers["Authorization"] == "Bearer bu_test"
        sent.append(SUBMIT.decode(request.content))
        if len(sent) <= 2:
            return problem(503)
        return httpx.Response(201, content=msgspec.json.encode(wire.SubmitResponse(ids=["i-1"])))

    with respx.mock(base_url=URL) as router:
        router.get("/v1/cluster").mock(return_value=httpx.Response(200, json=CLUSTER))
        router.post("/v1/invocations").mock(side_effect=answer)
        call = sdk.function(gpus=1, timeout=9)(double).spawn(21)

    assert call.id == "i-1"
    assert len(sent) == 3
    keys = {request.calls[0].idempotency_key for request in sent}
    assert len(keys) == 1
    assert len(keys.pop()) == 32
    spec = sent[-1].calls[0]
    assert (spec.gpus, spec.timeout_s, spec.function_name) == (1, 9.0, "double")
    assert spec.payload is not None
    assert spec.payload_blob is None
    fn, args, kwargs = remote.open_call(spec.payload, where="here").load()
    assert fn.__qualname__ == "double" and not isinstance(fn, sdk.Function)
    assert (args, kwargs) == ((21,), {})


def test_persistent_connect_error_is_gateway_unreachable(client: sdk.Client) -> None:
    with respx.mock(base_url=URL) as router:
        router.get("/v1/cluster").mock(return_value=httpx.Response(200, json=CLUSTER))
        route = router.post("/v1/invocations").mock(side_effect=httpx.ConnectError("refused"))
        start = time.monotonic()
        with pytest.raises(sdk.GatewayUnreachable) as info:
            sdk.function()(double).spawn(1)
    assert time.monotonic() - start < 2
    assert route.call_count > 2
    error = info.value
    assert not isinstance(error, httpx.HTTPError)
    assert error.__cause__ is None
    assert error.__suppress_context__
    assert URL in str(error)
    assert "ConnectError: refused" in str(error)


def test_persistent_503_on_a_read_is_gateway_unreachable(client: sdk.Client) -> None:
    with respx.mock(base_url=URL) as router:
        route = router.get("/v1/invocations/i-9").mock(return_value=problem(503))
        with pytest.raises(sdk.GatewayUnreachable, match="HTTP 503"):
            sdk.Call.from_id("i-9")
    assert route.call_count > 2


def test_retries_wait_full_jitter_under_a_cap_doubling_to_the_maximum(
    client: sdk.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    drawn: list[tuple[float, float]] = []

    class Recorded(Backoff):
        def next_delay(self) -> float:
            cap = self.cap
            delay = super().next_delay()
            drawn.append((delay, cap))
            return delay

    monkeypatch.setattr(_client, "Backoff", Recorded)
    with respx.mock(base_url=URL) as router:
        router.get("/v1/invocations/i-9").mock(return_value=problem(503))
        with pytest.raises(sdk.GatewayUnreachable):
            client.get("i-9")
    caps = [cap for _, cap in drawn]
    assert caps[:5] == pytest.approx([0.001, 0.002, 0.004, 0.008, 0.01])
    assert all(cap == pytest.approx(0.01) for cap in caps[4:])
    assert all(0 <= delay <= cap for delay, cap in drawn)
    assert len({delay for delay, _ in drawn}) > 1, "drawn, not a fixed schedule"


def test_429_is_retried_after_what_retry_after_asks(client: sdk.Client) -> None:
    client.retry_deadline_s = 5
    answers = iter([rate_limited("0.3"), rate_limited("0.3")])
    times: list[float] = []

    def answer(request: httpx.Request) -> httpx.Response:
        times.append(time.monotonic())
        ok = httpx.Response(200, content=msgspec.json.encode(INVOCATION))
        return next(answers, ok)

    with respx.mock(base_url=URL) as router:
        router.get("/v1/invocations/i-7").mock(side_effect=answer)
        assert client.get("i-7").id == "i-7"
    assert len(times) == 3
    # Each retry waited what the gateway asked, not the (much shorter) backoff.
    assert all(later - earlier >= 0.3 for earlier, later in itertools.pairwise(times))


def test_429_past_the_retry_deadline_is_rate_limited_at_once(client: sdk.Client) -> None:
    client.retry_deadline_s = 1
    with respx.mock(base_url=URL) as router:
        route = router.get("/v1/invocations/i-7").mock(return_value=rate_limited("30"))
        start = time.monotonic()
        with pytest.raises(sdk.RateLimited) as info:
            client.get("i-7")
    # Waiting 30 s would overrun the deadline: no sleep, no second try.
    assert time.monotonic() - start < 1
    assert route.call_count == 1
    error = info.value
    assert isinstance(error, sdk.GatewayError) and not isinstance(error, sdk.GatewayUnreachable)
    assert (error.status, error.retry_after) == (429, 30)
    assert "too many requests" in str(error)
    assert error.__cause__ is None and error.__suppress_context__


def test_503_with_retry_after_waits_for_it(client: sdk.Client) -> None:
    client.retry_deadline_s = 5
    answers = iter([problem(503, {"Retry-After": "0.2"})])
    times: list[float] = []

    def answer(request: httpx.Request) -> httpx.Response:
        times.append(time.monotonic())
        return next(answers, httpx.Response(200, content=msgspec.json.encode(INVOCATION)))

    with respx.mock(base_url=URL) as router:
        router.get("/v1/invocations/i-7").mock(side_effect=answer)
        client.get("i-7")
    assert len(times) == 2 and times[1] - times[0] >= 0.2


@pytest.mark.parametrize(
    ("header", "seconds"),
    [("3", 3.0), ("0", 0.0), ("-2", 0.0), ("soon", 0.0), ("inf", 0.0), ("", 0.0), (None, 0.0)],
)
def test_retry_after_is_read_as_seconds(header: str | None, seconds: float) -> None:
    headers = {} if header is None else {"Retry-After": header}
    assert retry_after(httpx.Response(429, headers=headers)) == seconds


def test_retry_after_may_be_an_http_date() -> None:
    later = email.utils.formatdate(time.time() + 60, usegmt=True)
    assert 50 < retry_after(httpx.Response(429, headers={"Retry-After": later})) <= 60
    earlier = email.utils.formatdate(time.time() - 60, usegmt=True)
    assert retry_after(httpx.Response(429, headers={"Retry-After": earlier})) == 0


def test_big_payload_is_uploaded_first_in_chunks(client: sdk.Client) -> None:
    client.inline_limit = 1024
    chunks: list[int] = []
    uploaded: dict[str, bytes] = {}
    specs: list[wire.CallSpec] = []

    def count_chunks(request: httpx.Request) -> None:
        # Runs before respx reads the body: record the pieces httpx is handed.
        if request.url.path == "/v1/blobs":
            pieces = request.stream

            def counted() -> Iterator[bytes]:
                for piece in pieces:  # type: ignore[union-attr]
                    chunks.append(len(piece))
                    yield piece

            request.stream = _Stream(counted())

    client._http.event_hooks["request"].append(count_chunks)

    def store(request: httpx.Request) -> httpx.Response:
        uploaded["body"] = request.content
        uploaded["length"] = request.headers["Content-Length"].encode()
        ref = wire.BlobRef(id=BLOB_ID, size=len(request.content))
        return httpx.Response(201, content=msgspec.json.encode(ref))

    def submit(request: httpx.Request) -> httpx.Response:
        specs.extend(SUBMIT.decode(request.content).calls)
        return httpx.Response(201, content=msgspec.json.encode(wire.SubmitResponse(ids=["i-2"])))

    big = bytes(9 * 1024 * 1024)
    with respx.mock(base_url=URL) as router:
        router.get("/v1/cluster").mock(return_value=httpx.Response(200, json=CLUSTER))
        router.put("/v1/blobs").mock(side_effect=store)
        router.post("/v1/invocations").mock(side_effect=submit)
        sdk.function()(double).spawn(big)

    body = uploaded["body"]
    assert len(chunks) >= 3
    assert max(chunks) <= UPLOAD_CHUNK
    assert sum(chunks) == len(body) == int(uploaded["length"])
    assert specs[0].payload is None
    assert specs[0].payload_blob == BLOB_ID
    fn, args, _ = remote.open_call(body, where="here").load()
    assert fn.__qualname__ == "double" and fn(4) == double(4)  # shipped by value
    assert args == (big,)


class _Stream(httpx.SyncByteStream):
    def __init__(self, pieces: Iterator[bytes]) -> None:
        self._pieces = pieces

    def __iter__(self) -> Iterator[bytes]:
        return self._pieces


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (401, sdk.AuthError),
        (403, sdk.AuthError),
        (404, sdk.NotFoundError),
        (400, sdk.InvalidRequest),
        (413, sdk.InvalidRequest),
        (415, sdk.InvalidRequest),
        (422, sdk.InvalidRequest),
        (429, sdk.RateLimited),
        (409, sdk.GatewayError),
        (500, sdk.GatewayError),
    ],
)
def test_error_statuses_map_to_sdk_exceptions(status: int, kind: type[Exception]) -> None:
    body = wire.Problem(title="Nope", status=status, detail="gpus=9 can never fit")
    error = error_for(httpx.Response(status, content=msgspec.json.encode(body)))
    assert type(error) is kind
    assert error.status == status
    assert error.detail == "gpus=9 can never fit"
    assert "gpus=9 can never fit" in str(error)


def test_auth_error_says_to_check_the_token() -> None:
    error = error_for(httpx.Response(401, content=b'{"title": "Unauthorized", "status": 401}'))
    assert "Unauthorized" in str(error)
    assert "BULLETIN_TOKEN" in str(error)
    assert "client.toml" in str(error)


def test_an_answer_that_is_not_problem_json_keeps_its_text() -> None:
    error = error_for(httpx.Response(500, text="<html>proxy error</html>"))
    assert type(error) is sdk.GatewayError
    assert "<html>proxy error</html>" in str(error)


@pytest.mark.parametrize(("initial", "most"), [(5.0, 1.0), (0.0, 0.0), (-1.0, 2.0)])
def test_backoff_settings_a_user_got_wrong_still_retry(initial: float, most: float) -> None:
    # Client.backoff_initial_s / backoff_max_s are the user's to set: a first delay above the
    # maximum, or none at all, must still give a schedule, never a ValueError per request.
    schedule = retry_schedule(initial, most)
    delays = [schedule.next_delay() for _ in range(5)]
    assert all(0 <= d <= max(most, 0.001) for d in delays)
