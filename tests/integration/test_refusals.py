"""Cheap refusals, written as attacks on a real gateway and PostgreSQL: a flood of unknown
tokens is refused without the database while valid tokens keep working; a repeated bad
token costs no second lookup; slowloris connections are closed while long-polls, streams and
slow uploads are not; a foreign Host header is refused; a user's blobs are bounded by their
storage limit, but a node's result never is; an empty blob is refused.

That a refusal did not touch the database is shown by holding an ACCESS EXCLUSIVE lock on
the tokens table: every token lookup blocks behind it (a request with a valid token visibly
hangs), so an answer that comes back fast was decided without one."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import asyncpg
import httpx
import msgspec
import pytest

from bulletin_core import wire
from tests.conftest import Cluster, running

PROBLEM = "application/problem+json"


def unknown_token() -> str:
    """A well-formed user token that no database knows."""
    return "bu_" + secrets.token_urlsafe(32)


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def assert_problem(r: httpx.Response, status: int, code: str) -> dict[str, object]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"] == PROBLEM, r.headers
    problem: dict[str, object] = r.json()
    assert problem["status"] == status and problem["code"] == code, problem
    return problem


@pytest.fixture
def cluster_with(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Cluster]]:
    """``cluster_with(**options)``: a gateway started with these options."""
    with contextlib.ExitStack() as stack:

        def start(**options: str) -> Cluster:
            cluster = Cluster(database_url, tmp_path)
            return stack.enter_context(running(cluster, request, options=options))

        yield start


@contextlib.contextmanager
def tokens_locked(database_url: str) -> Iterator[None]:
    """Hold an ACCESS EXCLUSIVE lock on the tokens table: every token lookup waits for it."""
    locked, release = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    async def hold() -> None:
        conn = await asyncpg.connect(database_url)
        try:
            async with conn.transaction():
                await conn.execute("LOCK TABLE tokens IN ACCESS EXCLUSIVE MODE")
                locked.set()
                await asyncio.to_thread(release.wait)
        finally:
            await conn.close()

    def run() -> None:
        try:
            asyncio.run(hold())
        except BaseException as exc:  # reported by the test's thread
            failed.append(exc)
            locked.set()

    holder = threading.Thread(target=run, daemon=True)
    holder.start()
    assert locked.wait(10) and not failed, failed
    try:
        yield
    finally:
        release.set()
        holder.join(10)


def read_answer(sock: socket.socket) -> bytes:
    """An HTTP answer with a Content-Length, read off a raw socket."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += (more := sock.recv(65536))
        assert more, f"the connection closed before a whole answer head: {answer!r}"
    head, _, body = answer.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.lower().split(b"\r\n")
        if line.startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def blocked(future: Future[httpx.Response], seconds: float = 0.7) -> bool:
    """Whether a request is still waiting after ``seconds`` (for the locked table)."""
    time.sleep(seconds)
    return not future.done()


# ------------------------------------------------------------------------ failed authentication


def test_a_flood_of_unknown_tokens_is_refused_without_the_database_while_valid_tokens_work(
    cluster_with: Callable[..., Cluster],
) -> None:
    hold = 0.3
    options = {
        "auth-failure-burst": "5",
        "auth-failure-rate-per-s": "0.1",
        "auth-failure-delay-s": str(hold),
    }
    gateway: Cluster = cluster_with(**options)
    user = httpx.Client(base_url=gateway.url, headers=bearer(gateway.token), timeout=30)
    node = registered_node(gateway, "n1")
    assert user.get("/v1/cluster").status_code == 200  # a token that works
    assert node.post("/v1/node/leave").status_code == 204

    attacker = httpx.Client(base_url=gateway.url, timeout=2)
    for _ in range(5):  # the address's budget: looked up, then the same 401 as ever
        r = attacker.get("/v1/cluster", headers=bearer(unknown_token()))
        assert_problem(r, 401, "unauthorized")

    def guess(path: str = "/v1/cluster") -> tuple[httpx.Response, float]:
        started = time.monotonic()
        r = attacker.get(path, headers=bearer(unknown_token()))
        return r, time.monotonic() - started

    with ThreadPoolExecutor(50) as pool:
        # Past it: 429 with Retry-After, each held a while (but all at once, not in turn);
        # the user and the node are served meanwhile.
        started = time.monotonic()
        flood = [pool.submit(guess, "/v1/invocations") for _ in range(50)]
        assert user.get("/v1/cluster").status_code == 200
        assert node.post("/v1/node/leave").status_code == 204
        for future in flood:
            r, took = future.result()
            assert_problem(r, 429, "auth_rate_limited")
            assert int(r.headers["retry-after"]) >= 1 and took >= hold - 0.05
        assert time.monotonic() - started < 5 * hold

        with tokens_locked(gateway.database_url):
            # They would wait for the lock (and time out) if they looked the token up.
            flood = [pool.submit(guess) for _ in range(100)]
            for future in flood:
                assert_problem(future.result()[0], 429, "auth_rate_limited")
            assert_problem(attacker.get("/v1/cluster"), 429, "auth_rate_limited")  # no token
            # A valid token is still looked up (so it waits for the lock here): never refused
            # for the attacker's failures on its address.
            legit = pool.submit(user.get, "/v1/cluster")
            assert blocked(legit)
        assert legit.result(10).status_code == 200


def registered_node(gateway: Cluster, name: str) -> httpx.Client:
    """A client of node ``name``, registered (its requests name its incarnation)."""
    node = httpx.Client(
        base_url=gateway.url, headers=bearer(gateway.node_token(name).read_text()), timeout=30
    )
    register = wire.RegisterRequest(name=name, gpus=[], cpu_slots=1)
    registered = node.post("/v1/node/register", content=msgspec.json.encode(register))
    assert registered.is_success, registered.text
    node.headers[wire.INCARNATION_HEADER] = str(registered.json()["incarnation"])
    return node


def test_a_flood_on_the_user_routes_does_not_lock_a_nodelet_out_of_the_node_routes(
    cluster_with: Callable[..., Cluster],
) -> None:
    """Users of a node share its address with its nodelet (their calls run there). Their
    bad tokens on the user routes empty the user routes' budget of that address, not the
    node routes', so a nodelet whose token has not worked on this replica yet (it just
    restarted) is still served."""
    gateway: Cluster = cluster_with(
        **{"auth-failure-burst": "3", "auth-failure-rate-per-s": "0.01"}
    )
    attacker = httpx.Client(base_url=gateway.url, timeout=5)
    for _ in range(6):
        attacker.get("/v1/invocations", headers=bearer(unknown_token()))
    assert_problem(
        attacker.get("/v1/invocations", headers=bearer(unknown_token())), 429, "auth_rate_limited"
    )
    fresh_node = httpx.Client(
        base_url=gateway.url, headers=bearer(gateway.node_token("n1").read_text()), timeout=5
    )
    register = wire.RegisterRequest(name="n1", gpus=[], cpu_slots=1)
    # A restarted nodelet's first request.
    assert fresh_node.post("/v1/node/register", content=msgspec.json.encode(register)).is_success
    # ... while a user whose token has not worked yet waits for the flood to end.
    newcomer = httpx.Client(base_url=gateway.url, headers=bearer(gateway.add_user("bob")))
    assert_problem(newcomer.get("/v1/cluster"), 429, "auth_rate_limited")


def test_a_client_cannot_claim_another_address_to_refill_its_budget(
    cluster_with: Callable[..., Cluster],
) -> None:
    # The budget is the TCP peer's: X-Forwarded-For and friends are not believed.
    gateway: Cluster = cluster_with(
        **{"auth-failure-burst": "3", "auth-failure-rate-per-s": "0.01"}
    )
    attacker = httpx.Client(base_url=gateway.url, timeout=5)
    for _ in range(3):
        attacker.get("/v1/invocations", headers=bearer(unknown_token()))
    for n in range(5):
        forged = {
            **bearer(unknown_token()),
            "X-Forwarded-For": f"10.0.{n}.1",
            "X-Real-IP": f"10.1.{n}.1",
            "Forwarded": f"for=10.2.{n}.1",
        }
        assert_problem(attacker.get("/v1/invocations", headers=forged), 429, "auth_rate_limited")


def test_a_bad_token_sent_again_costs_no_lookup_and_gets_the_same_401(
    cluster_with: Callable[..., Cluster],
) -> None:
    gateway: Cluster = cluster_with(**{"auth-negative-cache-s": "60"})
    client = httpx.Client(base_url=gateway.url, timeout=2)
    bad = unknown_token()
    first = client.get("/v1/invocations", headers=bearer(bad))
    assert_problem(first, 401, "unauthorized")
    with ThreadPoolExecutor(1) as pool, tokens_locked(gateway.database_url):
        for _ in range(5):
            again = client.get("/v1/invocations", headers=bearer(bad))
            assert again.status_code == 401 and again.content == first.content
            assert again.headers["www-authenticate"] == "Bearer"
        # Another unknown token needs the database, which the lock holds up.
        other = pool.submit(client.get, "/v1/invocations", headers=bearer(unknown_token()))
        assert blocked(other)
    assert other.result(10).content == first.content


def test_a_revoked_token_stops_working_at_once(gateway: Cluster) -> None:
    from bulletin import admin

    token = asyncio.run(admin.create_token(gateway.database_url, "alice", name="laptop"))
    client = httpx.Client(base_url=gateway.url, headers=bearer(token), timeout=10)
    for _ in range(3):  # known good now: exempt from its address's failure budget
        assert client.get("/v1/invocations").status_code == 200
    [listed] = [
        t for t in asyncio.run(admin.tokens(gateway.database_url, "alice")) if t.name == "laptop"
    ]
    asyncio.run(admin.revoke_token(gateway.database_url, listed.id))
    assert_problem(client.get("/v1/invocations"), 401, "unauthorized")


# --------------------------------------------------------------------------------- slow clients


def test_slowloris_connections_are_closed_and_others_are_served(
    cluster_with: Callable[..., Cluster],
) -> None:
    options = {"header-timeout-s": "1", "idle-timeout-s": "1"}
    gateway: Cluster = cluster_with(**options)
    port = int(gateway.url.rsplit(":", 1)[1])
    silent = socket.create_connection(("127.0.0.1", port))
    slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(50)]
    started = time.monotonic()
    for sock in slow:
        sock.sendall(b"GET /v1/cluster HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        sock.setblocking(False)
    closed: dict[socket.socket, float] = {}
    received: dict[socket.socket, bytes] = {sock: b"" for sock in slow}
    served = False
    while len(closed) < len(slow) and time.monotonic() - started < 6:
        open_ = [s for s in slow if s not in closed]
        readable, _, _ = select.select(open_, [], [], 0.2)
        for sock in readable:
            try:
                data = sock.recv(4096)
            except ConnectionResetError:  # it sent a line just as the gateway closed
                data = b""
            received[sock] += data
            if not data:
                closed[sock] = time.monotonic() - started
        for sock in open_:  # a header line every 0.2 s, but never a whole head
            if sock not in readable and time.monotonic() - started < 0.9:
                with contextlib.suppress(OSError):
                    sock.send(b"X-Slow: 1\r\n")
        if not served:  # a normal client meanwhile
            r = httpx.get(f"{gateway.url}/v1/cluster", headers=bearer(gateway.token), timeout=5)
            served = r.status_code == 200
    assert served
    assert len(closed) == len(slow), f"{len(slow) - len(closed)} slow connections still open"
    assert max(closed.values()) < 1 + 2.0
    for data in received.values():  # told why, in the one error shape
        assert data.startswith(b"HTTP/1.1 408 "), data[:100]
        assert b"application/problem+json" in data and b'"code":"header_timeout"' in data
    silent.settimeout(3)
    assert silent.recv(100) == b""  # a connection that never sends is closed as well
    for sock in [silent, *slow]:
        sock.close()

    # On a kept-alive connection, the next head is timed from its first byte; and a
    # connection that sends nothing more is closed after idle_timeout_s.
    request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as kept,
        socket.create_connection(("127.0.0.1", port), timeout=5) as idle,
    ):
        for sock in (kept, idle):
            sock.sendall(request)
            assert read_answer(sock).startswith(b"HTTP/1.1 200 ")
        time.sleep(0.5)
        kept.sendall(b"GET /healthz HTTP/1.1\r\n")
        started = time.monotonic()
        assert read_answer(kept).startswith(b"HTTP/1.1 408 ")
        assert kept.recv(100) == b"" and time.monotonic() - started < 1 + 1.0
        assert idle.recv(100) == b""


def test_long_polls_streams_and_slow_uploads_outlast_the_header_timeout(
    cluster_with: Callable[..., Cluster],
) -> None:
    gateway: Cluster = cluster_with(**{"header-timeout-s": "1"})
    user = httpx.Client(base_url=gateway.url, headers=bearer(gateway.token), timeout=30)
    call = wire.CallSpec(idempotency_key=uuid.uuid4().hex, payload=b"opaque")
    r = user.post("/v1/invocations", content=msgspec.json.encode(wire.SubmitRequest(calls=[call])))
    [queued] = r.json()["ids"]  # no node: it stays queued

    hold = 2.0  # twice the header timeout

    def watch() -> None:  # a long-poll with nothing to say
        request = wire.WatchRequest(items=[wire.WatchItem(id=queued)], timeout_s=hold)
        started = time.monotonic()
        r = user.post("/v1/invocations/watch", content=msgspec.json.encode(request))
        assert r.status_code == 200 and time.monotonic() - started >= hold - 0.1

    def logs() -> None:  # a queued call's log stream: the read times out, nothing closes it
        with (
            pytest.raises(httpx.ReadTimeout),
            user.stream("GET", f"/v1/invocations/{queued}/logs", timeout=hold) as stream,
        ):
            assert stream.status_code == 200
            for _ in stream.iter_raw():
                pass

    def upload() -> None:  # a body that trickles in: its head was whole, so it is not cut
        def trickle() -> Iterator[bytes]:
            for _ in range(10):
                yield b"x" * 1024
                time.sleep(hold / 10)

        r = user.put("/v1/blobs", content=trickle())
        assert r.status_code == 201 and r.json()["size"] == 10 * 1024

    with ThreadPoolExecutor(3) as pool:
        for done in [pool.submit(watch), pool.submit(logs), pool.submit(upload)]:
            done.result()


def test_a_client_that_half_closes_after_its_request_still_gets_the_answer(
    gateway: Cluster,
) -> None:
    """``nc -N``, some health checkers and proxies end their side once the request is sent:
    the answer (held until its writer yields: gateway/writes.py) must still go out."""
    port = int(gateway.url.rsplit(":", 1)[1])
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            sock.shutdown(socket.SHUT_WR)
            assert read_answer(sock).startswith(b"HTTP/1.1 200 ")


def test_a_pipelined_head_is_timed_from_its_turn_and_blank_lines_do_not_hold_a_connection(
    cluster_with: Callable[..., Cluster],
) -> None:
    gateway: Cluster = cluster_with(**{"header-timeout-s": "1", "idle-timeout-s": "5"})
    port = int(gateway.url.rsplit(":", 1)[1])
    user = httpx.Client(base_url=gateway.url, headers=bearer(gateway.token), timeout=30)
    call = wire.CallSpec(idempotency_key=uuid.uuid4().hex, payload=b"opaque")
    r = user.post("/v1/invocations", content=msgspec.json.encode(wire.SubmitRequest(calls=[call])))
    [queued] = r.json()["ids"]  # no node: it stays queued
    watch = msgspec.json.encode(wire.WatchRequest(items=[wire.WatchItem(id=queued)], timeout_s=2))
    auth = f"Authorization: Bearer {gateway.token}\r\n".encode()
    long_poll = (
        b"POST /v1/invocations/watch HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth
        + b"Content-Type: application/json\r\nContent-Length: "
        + str(len(watch)).encode() + b"\r\n\r\n" + watch
    )  # fmt: skip
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        # A long-poll twice the header timeout, and the start of the next request behind it.
        sock.sendall(long_poll + b"GET /healthz HTTP/1.1\r\n")
        started = time.monotonic()
        first = read_answer(sock)
        assert first.startswith(b"HTTP/1.1 200 ") and time.monotonic() - started >= 1.9
        sock.sendall(b"Host: 127.0.0.1\r\n\r\n")  # its turn came just now: in time
        assert read_answer(sock).startswith(b"HTTP/1.1 200 ")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as blank:
        started = time.monotonic()
        closed = False
        while time.monotonic() - started < 4 and not closed:
            with contextlib.suppress(OSError):
                blank.sendall(b"\r\n")  # the parser skips blank lines before a request
            readable, _, _ = select.select([blank], [], [], 0.2)
            if readable:
                with contextlib.suppress(ConnectionResetError):
                    closed = blank.recv(100) == b""
                closed = True
        assert closed and time.monotonic() - started < 1 + 1.5


# -------------------------------------------------------------------------------- allowed hosts


def test_a_host_that_is_not_allowed_gets_400(cluster_with: Callable[..., Cluster]) -> None:
    gateway: Cluster = cluster_with(**{"allowed-hosts": "bulletin.example.org, 127.0.0.1"})
    user = httpx.Client(base_url=gateway.url, headers=bearer(gateway.token), timeout=10)
    assert user.get("/v1/cluster").status_code == 200  # Host: 127.0.0.1:<port>
    named = user.get("/v1/cluster", headers={"host": "Bulletin.Example.org:8420"})
    assert named.status_code == 200
    r = user.get("/v1/cluster", headers={"host": "evil.example.com"})
    problem = assert_problem(r, 400, "host_not_allowed")
    assert "bulletin.example.org" in str(problem["detail"]) and "evil" in str(problem["detail"])
    assert httpx.get(f"{gateway.url}/healthz", headers={"host": "10.0.0.7"}).status_code == 200


# ------------------------------------------------------------------------------------- storage


def test_a_users_blobs_are_bounded_but_a_nodes_result_never_is(
    cluster_with: Callable[..., Cluster],
) -> None:
    gateway: Cluster = cluster_with(**{"user-storage-mb": "1"})
    alice = httpx.Client(base_url=gateway.url, headers=bearer(gateway.token), timeout=30)
    bob = httpx.Client(base_url=gateway.url, headers=bearer(gateway.add_user("bob")), timeout=30)
    kib = 1024
    assert alice.put("/v1/blobs", content=b"a" * 600 * kib).status_code == 201

    declared = alice.put("/v1/blobs", content=b"b" * 600 * kib)
    detail = str(assert_problem(declared, 507, "storage_quota_exceeded")["detail"])
    assert "you store 0.6 MiB" in detail and "1.0 MiB" in detail and "user_storage_mb" in detail
    assert "retention" in detail and "administrator" in detail
    streamed = alice.put("/v1/blobs", content=iter([b"c" * 100 * kib] * 6))
    assert_problem(streamed, 507, "storage_quota_exceeded")
    # What the refused uploads stored was deleted: the rest of the limit is still there.
    assert alice.put("/v1/blobs", content=b"d" * 400 * kib).status_code == 201
    assert bob.put("/v1/blobs", content=b"e" * 900 * kib).status_code == 201  # bob's own limit

    # A node's result of alice's call, twice her limit, is stored and reaches her.
    node = registered_node(gateway, "n1")
    call = wire.CallSpec(idempotency_key=uuid.uuid4().hex, payload=b"opaque")
    [call_id] = alice.post(
        "/v1/invocations", content=msgspec.json.encode(wire.SubmitRequest(calls=[call]))
    ).json()["ids"]
    poll = msgspec.json.encode(wire.PollRequest(running=[], timeout_s=5))
    [work] = msgspec.json.decode(
        node.post("/v1/node/poll", content=poll).content, type=wire.PollResponse
    ).assignments
    result = secrets.token_bytes(2 << 20)
    stored = node.put(
        f"/v1/node/invocations/{call_id}/result", params={"epoch": work.epoch}, content=result
    )
    assert stored.status_code == 201, stored.text
    done = wire.CompleteRequest(
        epoch=work.epoch, state="succeeded", result_blob=stored.json()["id"]
    )
    r = node.post(f"/v1/node/invocations/{call_id}/complete", content=msgspec.json.encode(done))
    assert r.is_success, r.text
    assert alice.get(f"/v1/invocations/{call_id}/result").content == result
    # It counts towards her storage: she is over it now.
    detail = str(
        assert_problem(alice.put("/v1/blobs", content=b"f"), 507, "storage_quota_exceeded")[
            "detail"
        ]
    )
    assert "you store 3.0 MiB" in detail
    # ... so her new calls are refused before they run (their results could not be), with
    # what to do; Bob's are not.
    another = wire.CallSpec(idempotency_key=uuid.uuid4().hex, payload=b"opaque")
    again = alice.post(
        "/v1/invocations", content=msgspec.json.encode(wire.SubmitRequest(calls=[another]))
    )
    detail = str(assert_problem(again, 507, "storage_quota_exceeded")["detail"])
    assert "no room for the results of new calls" in detail and "retention" in detail
    # JSON invocations too: a colleague's shared function invoked by her makes a call of hers.
    registration = wire.FunctionRegistration(payload=b"opaque")
    assert bob.put("/v1/functions/f", content=msgspec.json.encode(registration)).is_success
    shared = wire.FunctionRegistration(payload=b"opaque", visibility="cluster")
    assert bob.put("/v1/functions/g", content=msgspec.json.encode(shared)).is_success
    invoked = alice.post("/v1/functions/g/invoke", params={"owner": "bob"}, json={"args": []})
    assert_problem(invoked, 507, "storage_quota_exceeded")
    assert bob.post("/v1/functions/f/invoke", json={"args": []}).status_code == 202
    theirs = wire.CallSpec(idempotency_key=uuid.uuid4().hex, payload=b"opaque")
    accepted = bob.post(
        "/v1/invocations", content=msgspec.json.encode(wire.SubmitRequest(calls=[theirs]))
    )
    assert accepted.status_code == 201, accepted.text


def test_a_streamed_body_is_stopped_when_it_crosses_the_storage_limit(
    cluster_with: Callable[..., Cluster],
) -> None:
    gateway: Cluster = cluster_with(**{"user-storage-mb": "1"})
    port = int(gateway.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"PUT /v1/blobs HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
            b"Authorization: Bearer " + gateway.token.encode() + b"\r\n\r\n"
        )
        piece = b"x" * (256 << 10)
        for _ in range(6):  # 1.5 MiB, and the body never ends
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        answer = read_answer(sock)
    assert answer.startswith(b"HTTP/1.1 507 "), answer[:200]
    assert b"storage_quota_exceeded" in answer


def test_an_empty_blob_is_refused(gateway: Cluster) -> None:
    user = httpx.Client(base_url=gateway.url, headers=bearer(gateway.token), timeout=10)
    problem = assert_problem(user.put("/v1/blobs", content=b""), 422, "empty_blob")
    assert "at least one byte" in str(problem["detail"])
    assert_problem(user.put("/v1/blobs", content=iter([b""])), 422, "empty_blob")  # chunked
    assert user.put("/v1/blobs", content=b"x").status_code == 201
