"""Registered functions, end to end: registered with the sdk, invoked with plain JSON over
HTTP (as ``curl`` would), polled, shared, retried with an Idempotency-Key, purged after their
retention time. Real gateway, PostgreSQL, nodelet and workers; only the GPUs are fake."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path
from typing import Any

import asyncpg
import cloudpickle
import httpx
import pytest

import sdk
from bulletin_core import wire
from tests.conftest import Cluster, running, wait_until

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SCALE = 3


def http(cluster: Cluster, token: str | None = None) -> httpx.Client:
    return httpx.Client(
        base_url=cluster.url,
        headers={"Authorization": f"Bearer {token or cluster.token}"},
        timeout=60,
    )


def invoke(
    client: httpx.Client, name: str, body: Any, *, wait: float | None = 30, **params: str
) -> httpx.Response:
    if wait is not None:
        params["wait"] = str(wait)
    return client.post(f"/v1/functions/{name}/invoke", json=body, params=params)


def poll(client: httpx.Client, location: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        answer = client.get(location)
        assert answer.status_code == 200, answer.text
        found: dict[str, Any] = answer.json()
        if found["state"] in ("succeeded", "failed", "timed_out", "cancelled"):
            return found
        time.sleep(0.1)
    raise AssertionError(f"{location} never finished")


def test_a_registered_function_is_invoked_with_json_and_answers_json(cluster: Cluster) -> None:
    @sdk.function(gpus=1, timeout=60)
    def embed(words: list[str], scale: int = 1) -> dict[str, Any]:
        return {"lengths": [len(w) * scale * SCALE for w in words], "n": len(words)}

    info = embed.register("embed", description="word lengths")
    assert (info.name, info.owner, info.latest) == ("embed", "alice", True)
    assert info.resources.gpus == 1 and info.resources.timeout_s == 60
    assert len(info.version) == 16 and info.description == "word lengths"

    with http(cluster) as client:
        answer = invoke(client, "embed", {"args": [["a", "bcd"]], "kwargs": {"scale": 2}})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["state"] == "succeeded"
        assert body["result_json"] == {"lengths": [6, 18], "n": 2}
        assert body["function_name"] == "embed" and body["function_version"] == info.version
        assert answer.headers["location"] == f"/v1/invocations/{body['id']}"
        assert body["timeline"]["started"] is not None and body["gpus"] == 1

        # Without ?wait: 202 at once, with a Location to poll.
        answer = invoke(client, "embed", {"args": [["xy"]]}, wait=None)
        assert answer.status_code == 202, answer.text
        assert answer.json()["state"] in ("queued", "assigned", "running")
        done = poll(client, answer.headers["location"])
        assert done["result_json"] == {"lengths": [6], "n": 1}
        assert done["timeline"]["stored"] is not None

        # The invocations are the caller's like any other: listed, and readable by id.
        listed = client.get("/v1/invocations").json()
        assert done["id"] in [i["id"] for i in listed]


def test_registering_unchanged_code_is_a_no_op_and_old_versions_stay_callable(
    cluster: Cluster,
) -> None:
    @sdk.function()
    def greet(name: str) -> str:
        return f"hello {name}"

    first = greet.register("greet")
    again = greet.register("greet")
    assert again.version == first.version and again.registered == first.registered

    @sdk.function()
    def greet2(name: str) -> str:
        return f"good day {name}"

    second = greet2.register("greet")
    assert second.version != first.version and second.latest
    assert [f.name for f in sdk.functions()] == ["greet"]
    assert sdk.functions()[0].version == second.version

    with http(cluster) as client:
        latest = invoke(client, "greet", {"args": ["ada"]}).json()
        old = invoke(client, "greet", {"args": ["ada"]}, version=first.version).json()
        assert (latest["result_json"], old["result_json"]) == ("good day ada", "hello ada")
        versions = client.get("/v1/functions/greet/versions").json()
        assert [v["version"] for v in versions] == [second.version, first.version]
        assert [v["latest"] for v in versions] == [True, False]
        assert client.get("/v1/functions/greet").json()["version"] == second.version
        missing = invoke(client, "greet", {}, version="0" * 16)
        assert missing.status_code == 404 and missing.json()["code"] == "no_function"

    # Registering the first code again makes it the latest again.
    assert greet.register("greet").latest
    with http(cluster) as client:
        assert invoke(client, "greet", {"args": ["bo"]}).json()["result_json"] == "hello bo"

    sdk.unregister("greet")
    assert sdk.functions() == []
    with http(cluster) as client:
        assert invoke(client, "greet", {"args": ["x"]}).status_code == 404


def test_results_that_are_not_json_say_so_and_stay_fetchable_pickled(cluster: Cluster) -> None:
    @sdk.function()
    def roots(n: int) -> complex:
        return complex(0, n)

    @sdk.function()
    def fails(n: int) -> None:
        raise ValueError(f"no good: {n}")

    roots.register("roots")
    fails.register("fails")
    with http(cluster) as client:
        body = invoke(client, "roots", {"args": [4]}).json()
        assert body["state"] == "succeeded" and body["result_json"] is None
        assert "complex" in body["result_json_error"]
        assert "/v1/invocations/{id}/result" in body["result_json_error"]
        pickled = client.get(f"/v1/invocations/{body['id']}/result")
        assert pickled.status_code == 200
        assert pickled.headers["content-type"] == "application/octet-stream"
        assert sdk.Call.from_id(body["id"]).result() == 4j

        failed = invoke(client, "fails", {"args": [3]})
        assert failed.status_code == 200  # the request worked; the function did not
        assert failed.json()["state"] == "failed"
        assert failed.json()["error_type"] == "ValueError"
        assert "no good: 3" in failed.json()["error_message"]

        wrong = invoke(client, "roots", {"args": [1, 2, 3]}).json()
        assert wrong["state"] == "failed" and wrong["error_type"] == "TypeError"


def test_bad_invocations_are_refused_with_what_to_do(cluster: Cluster) -> None:
    @sdk.function()
    def one(x: int) -> int:
        return x

    one.register("one")
    with http(cluster) as client:
        for body, where in (({"args": {"a": 1}}, "$.args"), ({"kwargs": []}, "$.kwargs")):
            answer = invoke(client, "one", body)
            assert answer.status_code == 422 and where in answer.json()["detail"]
        for wait in ("-1", "nan", "100000", "soon"):
            answer = client.post("/v1/functions/one/invoke", params={"wait": wait}, json={})
            assert answer.status_code == 422 and "wait" in answer.json()["detail"]
        assert invoke(client, "nope", {}).status_code == 404
        for path in (
            "/v1/functions/..%2F..%2Fetc/invoke",
            "/v1/functions/%2e%2e",
            "/v1/functions/a%00b",
        ):
            answer = client.get(path)
            assert answer.status_code == 422, (path, answer.text)
            assert answer.headers["content-type"] == "application/problem+json"
        answer = client.get("/v1/functions/one/invoke")
        assert answer.status_code == 405 and "POST" in answer.headers["allow"]
        assert httpx.get(f"{cluster.url}/v1/functions/a/b/c").status_code == 401
        answer = client.put("/v1/functions/bad%20name", json={"payload": ""})
        assert answer.status_code == 422 and "function name" in answer.json()["detail"]
        too_big = invoke(client, "one", {"args": ["x" * (2 << 20)]})
        assert too_big.status_code == 413


def test_sharing_lets_colleagues_invoke_but_never_see_each_others_invocations(
    cluster: Cluster,
) -> None:
    @sdk.function()
    def shout(text: str) -> str:
        return text.upper()

    shout.register("shout")
    bob = cluster.add_user("bob")
    with http(cluster, bob) as client:
        private = invoke(client, "shout", {"args": ["hi"]}, owner="alice")
        assert private.status_code == 404  # exactly like a function that does not exist
        assert client.get("/v1/functions", params={"owner": "alice"}).json() == []
    shout.register("shout", visibility="group")
    with http(cluster, bob) as client:
        answer = invoke(client, "shout", {"args": ["hi"]}, owner="alice")
        assert answer.status_code == 200 and answer.json()["result_json"] == "HI"
        bobs = answer.json()["id"]
        assert [
            f["name"] for f in client.get("/v1/functions", params={"owner": "alice"}).json()
        ] == ["shout"]
        # Bob cannot change or remove Alice's function: his own namespace has no 'shout'.
        assert client.delete("/v1/functions/shout").status_code == 404
    with http(cluster) as client:
        # The invocation is Bob's: Alice, the function's owner, does not see it.
        assert client.get(f"/v1/invocations/{bobs}").status_code == 404
    cluster.set_group("physics", 0)
    dave = cluster.add_user("dave", group="physics")
    with http(cluster, dave) as client:
        assert invoke(client, "shout", {"args": ["x"]}, owner="alice").status_code == 404
    shout.register("shout", visibility="cluster")
    with http(cluster, dave) as client:
        assert invoke(client, "shout", {"args": ["x"]}, owner="alice").json()["result_json"] == "X"
    admin = cluster.add_user("root", is_admin=True)
    with http(cluster, bob) as client:
        unfetched = invoke(client, "shout", {"args": ["y"]}, owner="alice", wait=None).json()
    with http(cluster, bob) as client:
        assert client.get("/v1/invocations", params={"owner": "alice"}).status_code == 403
    with http(cluster, admin) as client:
        assert client.get(f"/v1/invocations/{bobs}").status_code == 200  # admins see all
        listed = client.get("/v1/invocations", params={"owner": "bob"}).json()
        assert bobs in [i["id"] for i in listed]
        assert client.get("/v1/invocations", params={"owner": "nobody"}).status_code == 404
        # ... without stamping the owner's timeline as fetched.
        seen = poll(client, f"/v1/invocations/{unfetched['id']}")
        assert seen["result_json"] == "Y" and seen["timeline"]["fetched"] is None
    with http(cluster, bob) as client:
        fetched = client.get(f"/v1/invocations/{unfetched['id']}").json()["timeline"]["fetched"]
        assert fetched is not None
    shout.register("secret")
    with http(cluster, admin) as client:
        assert client.get("/v1/functions/secret", params={"owner": "alice"}).status_code == 200
        # Administrators read every function, but run only those shared with them.
        assert invoke(client, "secret", {"args": ["x"]}, owner="alice").status_code == 404


def test_an_idempotency_key_submits_once(cluster: Cluster) -> None:
    @sdk.function()
    def slow(seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    slow.register("slow")
    with http(cluster) as client:
        key = {"Idempotency-Key": "job-42"}
        first = client.post("/v1/functions/slow/invoke?wait=30", json={"args": [0]}, headers=key)
        assert first.status_code == 200
        again = client.post("/v1/functions/slow/invoke?wait=30", json={"args": [0]}, headers=key)
        assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
        assert again.headers["idempotent-replayed"] == "true"
        other = client.post("/v1/functions/slow/invoke", json={"args": [1]}, headers=key)
        assert other.status_code == 422 and other.json()["code"] == "idempotency_key_reused"

        # While the first request with a key is still in flight, a duplicate is a 409.
        key = {"Idempotency-Key": "job-43"}
        answers: list[httpx.Response] = []
        holder = threading.Thread(
            target=lambda: answers.append(
                client.post("/v1/functions/slow/invoke?wait=20", json={"args": [3]}, headers=key)
            )
        )
        holder.start()
        time.sleep(1.0)
        clash = client.post("/v1/functions/slow/invoke?wait=20", json={"args": [3]}, headers=key)
        assert clash.status_code == 409, clash.text
        assert (
            clash.json()["code"] == "idempotency_key_in_flight" and "retry-after" in clash.headers
        )
        holder.join()
        assert answers[0].status_code == 200
        replay = client.post("/v1/functions/slow/invoke", json={"args": [3]}, headers=key)
        assert replay.json()["id"] == answers[0].json()["id"]

        # A retry after a lost 202 gets the invocation as it is now: here, its result.
        key = {"Idempotency-Key": "job-44"}
        first = client.post("/v1/functions/slow/invoke", json={"args": [0.5]}, headers=key)
        assert first.status_code == 202
        later = client.post("/v1/functions/slow/invoke?wait=30", json={"args": [0.5]}, headers=key)
        assert later.status_code == 200 and later.json()["id"] == first.json()["id"]
        assert later.json()["result_json"] == 0.5

        # Copies of one request racing each other make one invocation.
        key = {"Idempotency-Key": "job-45"}
        racing: list[httpx.Response] = []

        def send() -> None:
            with http(cluster) as own:
                racing.append(
                    own.post("/v1/functions/slow/invoke", json={"args": [0]}, headers=key)
                )

        threads = [threading.Thread(target=send) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert {r.status_code for r in racing} <= {200, 202, 409}
        assert len({r.json()["id"] for r in racing if r.status_code != 409}) == 1

        # A JSON invocation is cancelled like any other.
        running = client.post("/v1/functions/slow/invoke", json={"args": [30]})
        cancelled = client.post(f"{running.headers['location']}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"

        # The same holds for the sdk's submission route.
        submitted = client.post(
            "/v1/invocations", json={"calls": []}, headers={"Idempotency-Key": "k"}
        )
        assert submitted.status_code == 422
        listed = client.get("/v1/invocations").json()
        assert len([i for i in listed if i["function_name"] == "slow"]) == 5


def test_finished_invocations_are_purged_after_their_retention_time(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    options = {"retention-s": "2", "purge-interval-s": "0.5", "inline-limit": "1024"}
    with running(
        Cluster(database_url, tmp_path), request, shared_dir=tmp_path / "nas", options=options
    ) as cluster:
        cluster.start_nodelet()
        sdk.connect(cluster.url, cluster.token)

        @sdk.function()
        def big(n: int) -> bytes:
            print("some log")
            return b"x" * n

        big.register("big")
        with http(cluster) as client:
            # A result the sdk has not fetched yet, in the shared directory...
            call = big.spawn(50_000)
            finished = poll(client, f"/v1/invocations/{call.id}")
            result_file = cluster.shared_dir / finished["result_file"]  # type: ignore[operator]
            assert result_file.exists()
            # ... and a JSON invocation's big result, in a blob.
            small = invoke(client, "big", {"args": [5000]}).json()
            assert small["result_blob"] is not None and small["log_count"] == 1
            assert client.get(f"/v1/blobs/{small['result_blob']}").status_code == 200
            wait_until(
                lambda: (
                    client.get(f"/v1/invocations/{call.id}").status_code == 404
                    and client.get(f"/v1/invocations/{small['id']}").status_code == 404
                ),
                30,
                "the purge of finished invocations",
            )
            assert not result_file.exists()
            assert client.get(f"/v1/blobs/{small['result_blob']}").status_code == 404
            # The registered function itself is not purged.
            assert invoke(client, "big", {"args": [3]}).json()["state"] == "succeeded"


def test_a_nodelet_older_than_protocol_5_gets_no_work(gateway: Cluster) -> None:
    """Older nodelets ran a mapped node's calls as root (before 4) or have no incarnation
    (before 5): they are refused at registration, and one that registered before the
    gateway was upgraded (and still polls) gets nothing; its node requests are refused,
    saying to upgrade, and what was assigned to it goes back to the queue when its lease
    lapses."""
    sdk.connect(gateway.url, gateway.token)

    @sdk.function()
    def add(a: int, b: int) -> int:
        return a + b

    add.register("add")
    node = {"Authorization": f"Bearer {gateway.node_token('old-node').read_text()}"}
    with http(gateway) as client:
        old = {"name": "old-node", "gpus": [], "cpu_slots": 1, "protocol_version": 4}
        refused = client.post("/v1/node/register", json=old, headers=node)
        assert refused.status_code == 422 and "upgrade the nodelet" in refused.json()["detail"]
        registered = client.post(
            "/v1/node/register",
            json={**old, "protocol_version": wire.PROTOCOL_VERSION},
            headers=node,
        )
        assert registered.status_code == 200, registered.text
        node_id = registered.json()["node_id"]
        # As if it had registered with the gateway before this one.
        asyncio.run(_sql(gateway, "UPDATE nodes SET protocol_version = 4 WHERE id = $1", node_id))
        queued = invoke(client, "add", {"args": [1, 2]}, wait=None).json()
        time.sleep(2.5)  # two scheduling rounds
        assert client.get(f"/v1/invocations/{queued['id']}").json()["state"] == "queued"
        # What an older gateway had assigned to it is not delivered: its poll is refused.
        asyncio.run(
            _sql(
                gateway,
                "UPDATE invocations SET state = 'assigned', node_id = $1, epoch = epoch + 1,"
                " attempts = attempts + 1, lease_expires_at = now() + interval '1 second'"
                " WHERE id = $2::uuid",
                node_id,
                queued["id"],
            )
        )
        polled = client.post("/v1/node/poll", json={"running": [], "timeout_s": 0.1}, headers=node)
        assert polled.status_code == 422, polled.text
        assert polled.json()["code"] == "incarnation_missing"
        assert "upgrade the nodelet" in polled.json()["detail"]
        # Its lease lapses and the call is queued again (a retry: max_retries allows it).
        wait_until(
            lambda: client.get(f"/v1/invocations/{queued['id']}").json()["state"] == "queued",
            10,
            "the lapsed lease to be expired",
        )


async def _sql(cluster: Cluster, statement: str, *args: Any) -> None:
    conn = await asyncpg.connect(cluster.database_url)
    try:
        await conn.execute(statement, *args)
    finally:
        await conn.close()


def test_a_result_file_swapped_for_a_link_is_never_served(
    shared_gateway: Cluster, tmp_path: Path
) -> None:
    cluster = shared_gateway
    cluster.start_nodelet()
    sdk.connect(cluster.url, cluster.token)

    @sdk.function()
    def big() -> bytes:
        return b"r" * (2 << 20)

    secret = tmp_path / "gateway-secret.txt"
    secret.write_text("the gateway's database password")
    with http(cluster) as client:
        call = big.spawn()
        done = poll(client, f"/v1/invocations/{call.id}")
        path = cluster.shared_dir / done["result_file"]  # type: ignore[operator]
        served = client.get(f"/v1/invocations/{call.id}/result")
        assert served.status_code == 200 and len(served.content) > 2 << 20
        path.unlink()
        path.symlink_to(secret)
        refused = client.get(f"/v1/invocations/{call.id}/result")
        assert refused.status_code == 404 and refused.json()["code"] == "no_result"
        assert "password" not in refused.text


class Planted:
    """What a colleague's function may return: unpickling it runs code of their choosing."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (exec, ("import builtins; builtins.PLANTED_BY_ALICE = True",))


def test_a_result_made_by_another_users_code_is_unpickled_only_if_trusted(
    cluster: Cluster,
) -> None:
    import builtins

    @sdk.function()
    def gift(n: int) -> Planted:
        return Planted()

    gift.register("gift", visibility="cluster")
    bob = cluster.add_user("bob")
    with http(cluster, bob) as client:
        body = invoke(client, "gift", {"args": [1]}, owner="alice").json()
    assert body["state"] == "succeeded" and body["code_owner"] == "alice"
    # The note on the JSON result recommends nothing unsafe.
    assert "trust" in body["result_json_error"] and "only if you trust" in body["result_json_error"]
    sdk.connect(cluster.url, bob)
    call = sdk.Call.from_id(body["id"])
    for trust in (False, "mallory"):
        with pytest.raises(sdk.UntrustedResult) as refused:
            call.result(timeout=30, trust=trust)
        assert refused.value.code_owner == "alice"
        assert "result(trust='alice')" in str(refused.value)
    assert not hasattr(builtins, "PLANTED_BY_ALICE"), "unpickled without being trusted"
    # Trusted by name: loaded (and the colleague's code ran here, as the caller chose).
    assert call.result(timeout=30, trust="alice") is None
    assert builtins.PLANTED_BY_ALICE is True
    del builtins.PLANTED_BY_ALICE
    # Results of one's own code need no trust: one's calls, one's own registered functions.
    own = sdk.function()(lambda: 41 + 1).spawn()
    assert own.result(timeout=30) == 42
    assert call.info().code_owner == "alice" and own.info().code_owner == "bob"


def test_a_colleagues_function_never_shares_a_worker_with_the_callers_own_calls(
    cluster: Cluster,
) -> None:
    """Code stays behind in a warm worker (a patched module, a thread): a worker that ran
    Alice's function for Bob is not reused for Bob's own calls, whose results Bob's sdk
    unpickles without asking; nor is the directory it ran in (a thread left there could
    write over Bob's own call's outcome)."""

    @sdk.function()
    def plant() -> list[Any]:
        import builtins
        import os

        builtins.PLANTED_BY_ALICE = True  # type: ignore[attr-defined]
        return [os.getpid(), os.getcwd()]

    plant.register("plant", visibility="cluster")
    bob = cluster.add_user("bob")
    with http(cluster, bob) as client:
        planted_in, planted_at = invoke(client, "plant", {}, owner="alice").json()["result_json"]
        again, again_at = invoke(client, "plant", {}, owner="alice").json()["result_json"]
    assert isinstance(planted_in, int) and again == planted_in  # its own warm worker

    def own() -> tuple[int, bool, str]:
        import builtins
        import os

        return os.getpid(), hasattr(builtins, "PLANTED_BY_ALICE"), os.getcwd()

    sdk.connect(cluster.url, bob)
    for _ in range(3):
        pid, planted, here = sdk.function()(own)()
        assert pid != planted_in and not planted
        assert here not in (planted_at, again_at)
