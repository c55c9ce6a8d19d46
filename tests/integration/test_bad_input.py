"""Bad input and bad conditions get the documented problem, never a 500: bodies over the
limit (413, decided before the body is all read, with and without Content-Length), malformed
JSON (400), a wrong Content-Type (415), invalid values and strings PostgreSQL cannot store
(422), unknown ids and routes (404), wrong methods (405), the per-user rate limit (429), a
database that is down (503), and tokens used where they do not belong (403, 409). Real
gateway, real PostgreSQL; raw sockets where a test needs a request httpx will not send."""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from bulletin_core import wire
from tests.conftest import Cluster, running, wait_until
from tests.proxy import FaultProxy

PROBLEM = "application/problem+json"
JSON = {"content-type": "application/json"}
SMALL_JSON_BODY = 4096


def encode(msg: object) -> bytes:
    return msgspec.json.encode(msg)


def a_call(**kw: object) -> wire.CallSpec:
    return wire.CallSpec(idempotency_key=uuid.uuid4().hex, payload=b"opaque", **kw)  # type: ignore[arg-type]


def submit_body(**kw: object) -> bytes:
    return encode(wire.SubmitRequest(calls=[a_call(**kw)]))


def user_client(cluster: Cluster, token: str | None = None) -> httpx.Client:
    auth = {"authorization": f"Bearer {token or cluster.token}"}
    return httpx.Client(base_url=cluster.url, headers=auth, timeout=30)


def assert_problem(r: httpx.Response, status: int, code: str) -> dict[str, object]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"] == PROBLEM, r.headers
    problem: dict[str, object] = r.json()
    assert problem["status"] == status and problem["code"] == code, problem
    assert "Traceback" not in r.text
    return problem


def healthy(cluster: Cluster) -> bool:
    return httpx.get(f"{cluster.url}/healthz", timeout=5).status_code == 200


@pytest.fixture(scope="module")
def gateway(module_gateway: Cluster) -> Cluster:
    """One gateway for the tests of this module that are refused or only read: they cannot
    disturb each other (tests that need a cluster of their own start one)."""
    return module_gateway


@pytest.fixture
def own_gateway(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Cluster]:
    """A gateway of this test alone: for a test that must find the queue empty."""
    with running(Cluster(database_url, tmp_path), request) as cluster:
        yield cluster


@pytest.fixture
def small(database_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """A gateway whose JSON bodies may be at most SMALL_JSON_BODY bytes."""
    options = {"max-json-body": str(SMALL_JSON_BODY)}
    with running(Cluster(database_url, tmp_path), request, options=options) as cluster:
        yield cluster


# ------------------------------------------------------------------------ raw HTTP


class Raw:
    """One HTTP/1.1 connection on a socket: send exactly these bytes, read one answer."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        assert parts.hostname and parts.port
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=10)

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        data = b""
        while b"\r\n\r\n" not in data:
            piece = self.sock.recv(65536)
            assert piece, f"connection closed before an answer: {data!r}"
            data += piece
        head, _, rest = data.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        size = int(headers.get("content-length", "0"))
        while len(rest) < size:
            piece = self.sock.recv(65536)
            assert piece, "connection closed mid-answer"
            rest += piece
        return int(status_line.split()[1]), headers, rest[:size]


def request_head(cluster: Cluster, method: str, path: str, *headers: str) -> bytes:
    lines = [
        f"{method} {path} HTTP/1.1",
        "Host: gateway",
        f"Authorization: Bearer {cluster.token}",
        *headers,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


# ------------------------------------------------------------------------ 413


def test_a_declared_length_over_the_limit_gets_413_before_any_body_is_sent(
    small: Cluster,
) -> None:
    with Raw(small.url) as raw:
        raw.send(
            request_head(
                small,
                "POST",
                "/v1/invocations",
                "Content-Type: application/json",
                f"Content-Length: {100 * SMALL_JSON_BODY}",
            )
        )
        # Not one byte of the body: the answer comes from the declared length alone.
        status, headers, body = raw.answer()
    assert status == 413 and headers["content-type"] == PROBLEM
    assert msgspec.json.decode(body)["code"] == "body_too_large"
    assert healthy(small)


def test_a_chunked_body_over_the_limit_gets_413_while_the_client_is_still_sending(
    small: Cluster,
) -> None:
    with Raw(small.url) as raw:
        raw.send(
            request_head(
                small,
                "POST",
                "/v1/invocations",
                "Content-Type: application/json",
                "Transfer-Encoding: chunked",
            )
        )
        raw.send(chunk(b'{"calls": [' + b" " * (SMALL_JSON_BODY + 100)))
        # The body is not finished (no last chunk): the gateway answers anyway.
        status, headers, body = raw.answer()
    assert status == 413 and headers["content-type"] == PROBLEM
    assert msgspec.json.decode(body)["code"] == "body_too_large"
    assert healthy(small)


def test_bodies_over_the_limit_get_413_from_httpx_with_and_without_length(small: Cluster) -> None:
    user = user_client(small)
    big = b'{"calls": [' + b" " * (4 * SMALL_JSON_BODY) + b"]}"
    r = user.post("/v1/invocations", content=big, headers=JSON)  # Content-Length
    assert_problem(r, 413, "body_too_large")

    sent = []

    def pieces() -> Iterator[bytes]:  # no length: chunked
        for start in range(0, len(big), 1024):
            sent.append(start)
            yield big[start : start + 1024]

    r = user.post("/v1/invocations", content=pieces(), headers=JSON)
    assert "content-length" not in r.request.headers
    assert_problem(r, 413, "body_too_large")
    # A body within the limit is still fine afterwards.
    r = user.post("/v1/invocations", content=submit_body(), headers=JSON)
    assert r.status_code == 201, r.text
    assert healthy(small)


def test_a_content_length_that_is_not_a_number_gets_400_not_500(small: Cluster) -> None:
    with Raw(small.url) as raw:
        raw.send(
            request_head(
                small,
                "POST",
                "/v1/invocations",
                "Content-Type: application/json",
                "Content-Length: lots",
            )
        )
        status, _, _ = raw.answer()
    # The HTTP server itself refuses it, before the gateway sees the request.
    assert status == 400
    assert healthy(small)


# ------------------------------------------------------------------------ 400, 415, 422


@pytest.mark.parametrize(
    "data",
    [
        b"{not json",
        b'{"calls": [',
        b'{"calls": []} trailing',
        b"\xff\xfe",
        b'{"calls": [{"gpus": NaN}]}',
        b'{"calls": [{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]}",
    ],
    ids=["malformed", "truncated", "trailing", "not-utf8", "nan", "deep"],
)
def test_a_body_that_is_not_json_gets_400(gateway: Cluster, data: bytes) -> None:
    r = user_client(gateway).post("/v1/invocations", content=data, headers=JSON)
    problem = assert_problem(r, 400, "malformed_json")
    assert "malformed JSON" in str(problem["detail"])


def test_an_empty_body_gets_400(gateway: Cluster) -> None:
    r = user_client(gateway).post("/v1/invocations/watch", content=b"", headers=JSON)
    problem = assert_problem(r, 400, "malformed_json")
    assert "needs a JSON body" in str(problem["detail"])


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "application/json; charset=latin-1"],
)
def test_a_json_route_refuses_another_content_type_with_415(
    gateway: Cluster, content_type: str
) -> None:
    r = user_client(gateway).post(
        "/v1/invocations", content=submit_body(), headers={"content-type": content_type}
    )
    problem = assert_problem(r, 415, "unsupported_media_type")
    assert "Content-Type: application/json" in str(problem["detail"])


@pytest.mark.parametrize(
    "content_type",
    ["application/json", "Application/JSON; charset=UTF-8", "application/vnd.bulletin+json", None],
)
def test_json_media_types_are_accepted(gateway: Cluster, content_type: str | None) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    r = user_client(gateway).post("/v1/invocations", content=submit_body(), headers=headers)
    assert r.status_code == 201, r.text


def test_blob_uploads_take_octet_streams_and_refuse_json(gateway: Cluster) -> None:
    user = user_client(gateway)
    for headers in ({"content-type": "application/octet-stream"}, {}):
        assert user.put("/v1/blobs", content=b"raw", headers=headers).status_code == 201
    r = user.put("/v1/blobs", content=b"raw", headers=JSON)
    problem = assert_problem(r, 415, "unsupported_media_type")
    assert "application/octet-stream" in str(problem["detail"])


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("gpus", -1, ">= 0"),
        ("max_retries", 11, "<= 10"),
        ("max_retries", -1, ">= 0"),
        ("timeout_s", 0, "> 0"),
        ("expected_s", -5, "> 0"),
        # Model alternatives: at most 8, none empty (the published pattern).
        ("gpu_model", "A100||H100", "matching regex"),
        ("gpu_model", "A100|", "matching regex"),
        ("gpu_model", "|".join("ABCDEFGHI"), "matching regex"),
        ("gpu_model", "A100|H100;drop", "matching regex"),
    ],
)
def test_an_out_of_range_resource_gets_422_naming_the_field_and_the_rule(
    gateway: Cluster, field: str, value: int | str, rule: str
) -> None:
    # The same rule the published schema states (openapi.yaml: CallSpec), checked once.
    body = submit_body(**{field: value})
    r = user_client(gateway).post("/v1/invocations", content=body, headers=JSON)
    problem = assert_problem(r, 422, "invalid_body")
    assert f"calls[0].{field}" in str(problem["detail"]) and rule in str(problem["detail"])


def test_a_body_of_the_wrong_shape_gets_422_naming_the_field(gateway: Cluster) -> None:
    body = b'{"calls": [{"payload": "", "max_retries": "two"}]}'
    r = user_client(gateway).post("/v1/invocations", content=body, headers=JSON)
    problem = assert_problem(r, 422, "invalid_body")
    assert "$.calls[0].max_retries" in str(problem["detail"])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("function_name", "a\\u0000b"),  # NUL: PostgreSQL text cannot hold it
        ("idempotency_key", "\\u0000"),
        ("function_name", "\\ud800"),  # a lone high surrogate
        ("function_name", "x\\udc00y"),  # a lone low surrogate
        ("idempotency_key", "\\udfff\\ud800"),  # a pair in the wrong order
    ],
)
def test_strings_that_are_not_storable_unicode_get_422(
    gateway: Cluster, field: str, value: str
) -> None:
    body = f'{{"calls": [{{"payload": "", "{field}": "{value}"}}]}}'.encode()
    r = user_client(gateway).post("/v1/invocations", content=body, headers=JSON)
    problem = assert_problem(r, 422, "invalid_string")
    assert "valid Unicode" in str(problem["detail"])
    if "u0000" in value:
        assert f"$.calls[0].{field}" in str(problem["detail"])


def test_a_valid_surrogate_pair_is_fine(gateway: Cluster) -> None:
    body = b'{"calls": [{"payload": "", "function_name": "\\ud83d\\ude00"}]}'
    user = user_client(gateway)
    r = user.post("/v1/invocations", content=body, headers=JSON)
    assert r.status_code == 201, r.text
    [invocation_id] = r.json()["ids"]
    assert user.get(f"/v1/invocations/{invocation_id}").json()["function_name"] == "\U0001f600"


def test_a_nul_in_a_node_message_gets_422(gateway: Cluster) -> None:
    node = node_client(gateway, "n1")
    register(node, "n1")
    some_id = str(uuid.uuid4())
    body = b'{"epoch": 1, "state": "failed", "error_message": "bad\\u0000byte"}'
    r = node.post(f"/v1/node/invocations/{some_id}/complete", content=body, headers=JSON)
    problem = assert_problem(r, 422, "invalid_string")
    assert "$.error_message" in str(problem["detail"])


# ------------------------------------------------------------------------ 404, 405


#: A well-formed id no call has (fixed: every pytest-xdist worker must collect the same tests).
UNKNOWN_ID = "5f0c8c2e-7d4b-4c1a-9e3f-2b6a8d1c0e47"


@pytest.mark.parametrize("invocation_id", [UNKNOWN_ID, "garbage", "%00", "1" * 300])
def test_an_unknown_invocation_gets_404(gateway: Cluster, invocation_id: str) -> None:
    user = user_client(gateway)
    assert_problem(user.get(f"/v1/invocations/{invocation_id}"), 404, "not_found")
    assert_problem(user.post(f"/v1/invocations/{invocation_id}/cancel"), 404, "not_found")


def test_an_unknown_route_gets_404_problem(gateway: Cluster) -> None:
    assert_problem(user_client(gateway).get("/v1/nothing-here"), 404, "not_found")


def test_every_wrong_method_on_every_documented_path_gets_405_and_its_methods(
    gateway: Cluster,
) -> None:
    """Schemathesis found paths that answered 404 to a wrong method (GET on the POST-only
    /v1/invocations/watch was taken for an invocation id) or listed methods they do not take
    in Allow: every path of the contract, every method it does not document."""
    import yaml

    from tests.conftest import ROOT

    spec = yaml.safe_load((ROOT / "openapi.yaml").read_text())
    user = user_client(gateway)
    node = httpx.Client(
        base_url=gateway.url,
        headers={"Authorization": f"Bearer {gateway.node_token('n1').read_text()}"},
    )
    methods = {"get", "put", "post", "delete", "patch"}
    wrong = []
    for path, operations in spec["paths"].items():
        documented = {m.upper() for m in operations if m in methods}
        concrete = path.replace("{id}", str(uuid.uuid4())).replace("{name}", "fn")
        client = node if path.startswith("/v1/node/") else user
        for method in sorted(methods - {m.lower() for m in documented}):
            r = client.request(method.upper(), concrete)
            allowed = {m.strip() for m in r.headers.get("allow", "").split(",")} - {"HEAD", ""}
            if r.status_code != 405 or allowed != documented:
                wrong.append(f"{method.upper()} {path}: {r.status_code}, Allow {sorted(allowed)}")
    assert not wrong, wrong


def test_a_wrong_method_gets_405_problem_with_allow(gateway: Cluster) -> None:
    r = user_client(gateway).delete("/v1/invocations")
    problem = assert_problem(r, 405, "method_not_allowed")
    assert set(r.headers["allow"].replace(" ", "").split(",")) >= {"GET", "POST"}
    assert "DELETE" in str(problem["detail"])


# ------------------------------------------------------------------------ 429


def test_the_rate_limit_is_per_user_and_says_when_to_retry(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    options = {"rate-limit-per-s": "1", "rate-limit-burst": "3"}
    with running(Cluster(database_url, tmp_path), request, options=options) as cluster:
        alice = user_client(cluster)
        for _ in range(3):
            assert alice.get("/v1/invocations").status_code == 200
        r = alice.get("/v1/invocations")
        problem = assert_problem(r, 429, "rate_limited")
        assert int(r.headers["retry-after"]) >= 1
        assert "retry after" in str(problem["detail"])
        # Other users, nodes and the health check are not held back by alice's requests.
        bob = user_client(cluster, cluster.add_user("bob"))
        for _ in range(3):
            assert bob.get("/v1/invocations").status_code == 200
        node = node_client(cluster, "n1")
        register(node, "n1")
        for _ in range(10):
            r = node.post("/v1/node/heartbeat", content=b'{"running": []}', headers=JSON)
            assert r.status_code == 200, r.text
        assert all(healthy(cluster) for _ in range(10))
        # The bucket refills at 1 a second.
        time.sleep(1.1)
        assert alice.get("/v1/invocations").status_code == 200


# ------------------------------------------------------------------------ 503


class DatabaseProxy(FaultProxy):
    """A FaultProxy in front of PostgreSQL that can also be down: it cuts every open
    connection, and then either refuses new ones (its port closed: the database is not
    running) or accepts and closes them at once (a reset), until it is up again."""

    down = False

    def go_down(self, *, refuse: bool) -> None:
        self.down = True
        self.cut()
        if refuse:
            asyncio.run_coroutine_threadsafe(self._close_port(), self._loop).result(5)

    def come_up(self) -> None:
        self.down = False
        if self._server is None:
            asyncio.run_coroutine_threadsafe(self._open_port(), self._loop).result(5)

    _server: asyncio.Server | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._flowing.set()
        self._loop.run_until_complete(self._open_port())
        self._ready.set()
        self._loop.run_forever()

    async def _open_port(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _close_port(self) -> None:
        assert self._server is not None
        self._server.close()
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down:
            writer.close()
            return
        await super()._serve(reader, writer)


@pytest.mark.parametrize("refuse", [True, False], ids=["refused", "reset"])
def test_a_database_that_is_down_gets_503_with_retry_after_then_service_resumes(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest, refuse: bool
) -> None:
    port = urllib.parse.urlsplit(database_url).port
    assert port is not None
    with DatabaseProxy(port) as proxy:
        proxied = database_url.replace(f"127.0.0.1:{port}/", f"127.0.0.1:{proxy.port}/")
        assert proxied != database_url
        with running(Cluster(proxied, tmp_path), request) as cluster:
            user = user_client(cluster)
            assert user.get("/v1/invocations").status_code == 200
            proxy.go_down(refuse=refuse)
            for _ in range(5):  # open connections cut, new ones refused: all the same
                r = user.get("/v1/invocations")
                problem = assert_problem(r, 503, "db_unavailable")
                assert int(r.headers["retry-after"]) >= 1
                assert "retry" in str(problem["detail"])
                r = user.post("/v1/invocations", content=submit_body(), headers=JSON)
                assert_problem(r, 503, "db_unavailable")
            assert healthy(cluster)  # the process serves on: only the database is away
            proxy.come_up()
            statuses: list[int] = []

            def serving() -> bool:
                statuses.append(user.get("/v1/invocations").status_code)
                return statuses[-1] == 200

            wait_until(serving, 15, "the gateway to use the database again")
            assert set(statuses) <= {200, 503}, statuses
            r = user.post("/v1/invocations", content=submit_body(), headers=JSON)
            assert r.status_code == 201, r.text


# ------------------------------------------------------------------------ token kinds


def node_client(cluster: Cluster, name: str) -> httpx.Client:
    token = cluster.node_token(name).read_text()
    return httpx.Client(
        base_url=cluster.url, headers={"authorization": f"Bearer {token}"}, timeout=30
    )


def register(node: httpx.Client, name: str) -> None:
    gpu = wire.GpuInfo(index=0, uuid=f"{name}-g0", name="Fake", memory_mb=1, fake=True)
    body = encode(wire.RegisterRequest(name=name, gpus=[gpu], cpu_slots=1))
    r = node.post("/v1/node/register", content=body, headers=JSON)
    assert r.status_code == 200, r.text
    node.headers[wire.INCARNATION_HEADER] = str(r.json()["incarnation"])


def test_each_token_kind_gets_403_on_the_other_kinds_routes(gateway: Cluster) -> None:
    user = user_client(gateway)
    node = node_client(gateway, "n1")
    for path in ("/v1/invocations", "/v1/cluster", "/openapi.yaml", "/v1/admin/groups"):
        assert_problem(node.get(path), 403, "wrong_token")
    r = node.post("/v1/invocations", content=submit_body(), headers=JSON)
    assert_problem(r, 403, "wrong_token")
    for path in ("/v1/node/poll", "/v1/node/heartbeat"):
        r = user.post(path, content=b'{"running": []}', headers=JSON)
        assert_problem(r, 403, "wrong_token")
    r = user.post(f"/v1/node/invocations/{uuid.uuid4()}/start", content=b'{"epoch": 1}')
    assert_problem(r, 403, "wrong_token")


def test_a_node_cannot_act_on_an_attempt_leased_to_another_node(own_gateway: Cluster) -> None:
    gateway = own_gateway
    user = user_client(gateway)
    mine = node_client(gateway, "n1")
    register(mine, "n1")
    r = user.post("/v1/invocations", content=submit_body(gpus=1), headers=JSON)
    [invocation_id] = r.json()["ids"]
    r = mine.post("/v1/node/poll", content=b'{"running": [], "timeout_s": 10}', headers=JSON)
    [work] = msgspec.json.decode(r.content, type=wire.PollResponse).assignments
    assert work.invocation_id == invocation_id
    other = node_client(gateway, "n2")
    register(other, "n2")

    base, epoch = f"/v1/node/invocations/{invocation_id}", work.epoch
    refused = [
        other.post(f"{base}/start", content=encode(wire.StartRequest(epoch=epoch))),
        other.post(
            f"{base}/logs",
            content=encode(
                wire.LogsRequest(
                    epoch=epoch,
                    first_seq=0,
                    chunks=[wire.NodeLogChunk(stream=wire.Stream.STDOUT, data=b"forged")],
                )
            ),
        ),
        other.post(
            f"{base}/complete",
            content=encode(wire.CompleteRequest(epoch=epoch, state="succeeded", result=b"forged")),
        ),
        other.post(f"{base}/release", content=encode(wire.ReleaseRequest(epoch=epoch))),
        other.get(f"{base}/payload", params={"epoch": epoch}),
        other.put(f"{base}/result", params={"epoch": epoch}, content=b"forged"),
    ]
    for r in refused:
        assert_problem(r, 409, "stale_epoch")
    # Naming the attempt in its heartbeat renews nothing: it is answered as revoked.
    attempt = wire.Attempt(invocation_id=invocation_id, epoch=epoch)
    r = other.post("/v1/node/heartbeat", content=encode(wire.HeartbeatRequest(running=[attempt])))
    assert msgspec.json.decode(r.content, type=wire.HeartbeatResponse).revoked == [attempt]

    # Nothing of that was applied: the attempt is still n1's, and n1 finishes it.
    seen = msgspec.json.decode(
        user.get(f"/v1/invocations/{invocation_id}").content, type=wire.Invocation
    )
    assert (seen.state, seen.node, seen.log_count, seen.result) == ("assigned", "n1", 0, None)
    assert (
        mine.post(f"{base}/start", content=encode(wire.StartRequest(epoch=epoch))).status_code
        == 204
    )
    done = wire.CompleteRequest(epoch=epoch, state="succeeded", result=b"real")
    assert mine.post(f"{base}/complete", content=encode(done)).status_code == 204
    seen = msgspec.json.decode(
        user.get(f"/v1/invocations/{invocation_id}").content, type=wire.Invocation
    )
    assert (seen.state, seen.node, seen.result) == ("succeeded", "n1", b"real")
