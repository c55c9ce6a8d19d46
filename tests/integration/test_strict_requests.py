"""Requests are strict: a field its message does not have is a 422 ``unknown_field`` that
names it with its path and says what to do, on every kind of route (user, node, admin), at
any depth, and nothing of the request is applied. Answers stay tolerant: the sdk and the
nodelet read answers with fields they do not know. Real gateway, real PostgreSQL."""

from __future__ import annotations

import base64
import uuid
from typing import Any

import httpx
import hypothesis
import msgspec
import pytest
from hypothesis import strategies as st

from bulletin_core import wire
from tests.conftest import Cluster

PROBLEM = "application/problem+json"


def client(cluster: Cluster, token: str) -> httpx.Client:
    return httpx.Client(
        base_url=cluster.url, headers={"authorization": f"Bearer {token}"}, timeout=30
    )


def assert_unknown(r: httpx.Response, path: str) -> str:
    """``r`` is the 422 that names the unknown field at ``path``; returns its detail."""
    assert r.status_code == 422, (r.status_code, r.text)
    assert r.headers["content-type"] == PROBLEM
    problem = r.json()
    assert problem["code"] == "unknown_field", problem
    detail: str = problem["detail"]
    assert f"`{path}`" in detail, detail
    assert "Remove it or fix its spelling" in detail, detail
    return detail


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def gateway(module_gateway: Cluster) -> Cluster:
    """One gateway for the module: every test here is refused, or reads."""
    return module_gateway


def test_a_user_request_with_an_unknown_field_gets_422_naming_it(gateway: Cluster) -> None:
    user = client(gateway, gateway.token)
    call = {"payload": b64(b"call"), "gpuz": 1}
    detail = assert_unknown(user.post("/v1/invocations", json={"calls": [call]}), "$.calls[0].gpuz")
    assert "unknown field `gpuz`" in detail
    assert user.get("/v1/invocations").json() == []  # nothing was submitted
    # Abuse: the service a call received (least attained service ranks calls by it) and
    # the scheduler's promises are the gateway's to keep; a submission cannot set them.
    for forged in ("attained_gpu_s", "promised", "queued_at"):
        call = {"payload": b64(b"call"), forged: 0}
        r = user.post("/v1/invocations", json={"calls": [call]})
        assert_unknown(r, f"$.calls[0].{forged}")
    assert user.get("/v1/invocations").json() == []
    # At the top, and in the other user messages.
    submit = {"calls": [{"payload": ""}], "dry_run": True}
    assert_unknown(user.post("/v1/invocations", json=submit), "$.dry_run")
    watch = {"items": [{"id": str(uuid.uuid4()), "log_before": 3}]}
    assert_unknown(user.post("/v1/invocations/watch", json=watch), "$.items[0].log_before")
    cancel = {"ids": [str(uuid.uuid4())], "all": 1}
    assert_unknown(user.post("/v1/invocations/cancel", json=cancel), "$.all")
    # A registration's resources, nested: nothing is registered.
    registration = {"payload": b64(b"fn"), "resources": {"gpus": 1, "gpu": "A100"}}
    assert_unknown(user.put("/v1/functions/f", json=registration), "$.resources.gpu")
    assert user.get("/v1/functions").json() == []
    # JSON arguments: a misspelt `args` is refused, not a call without arguments.
    assert user.put("/v1/functions/f", json={"payload": b64(b"fn")}).status_code == 201
    r = user.post("/v1/functions/f/invoke", json={"arg": [1]})
    assert_unknown(r, "$.arg")


def test_a_node_request_with_an_unknown_field_gets_422_naming_it(gateway: Cluster) -> None:
    node = client(gateway, gateway.node_token("n1").read_text())
    gpu = {"index": 0, "uuid": "g0", "name": "Fake", "memory_mb": 1, "fake": True}
    register = {"name": "n1", "gpus": [{**gpu, "ecc": 0}], "cpu_slots": 1}
    assert_unknown(node.post("/v1/node/register", json=register), "$.gpus[0].ecc")
    register["gpus"] = [gpu]
    r = node.post("/v1/node/register", json=register)
    assert r.status_code == 200, r.text
    node.headers[wire.INCARNATION_HEADER] = str(r.json()["incarnation"])
    attempt = {"invocation_id": str(uuid.uuid4()), "epoch": 1, "lease": 5}
    r = node.post("/v1/node/heartbeat", json={"running": [attempt]})
    assert_unknown(r, "$.running[0].lease")
    complete = {"epoch": 1, "state": "succeeded", "reslut": b64(b"r")}
    r = node.post(f"/v1/node/invocations/{uuid.uuid4()}/complete", json=complete)
    assert_unknown(r, "$.reslut")


def test_an_admin_request_with_an_unknown_field_gets_422_and_changes_nothing(
    gateway: Cluster,
) -> None:
    root = client(gateway, gateway.add_user("root", is_admin=True))
    quota = {"guaranteed_gpus": 4, "borow_limit_gpus": 2}  # a typo: no limit would be set
    assert_unknown(root.put("/v1/admin/groups/vision", json=quota), "$.borow_limit_gpus")
    assert "vision" not in [g["name"] for g in root.get("/v1/admin/groups").json()]
    assert root.put("/v1/admin/groups/vision", json={"guaranteed_gpus": 4}).status_code == 200
    r = root.put("/v1/admin/users/alice/group", json={"group": "vision", "role": "x"})
    assert_unknown(r, "$.role")


def test_a_body_cut_short_after_an_unknown_field_is_malformed_json(gateway: Cluster) -> None:
    """msgspec stops at the unknown field before reading the rest: the body is still checked
    for being JSON at all (400), and strings the database cannot store are still 422."""
    user = client(gateway, gateway.token)
    headers = {"content-type": "application/json"}
    for body in (b'{"calls": [{"gpuz": 1}, ', b'{"calls": [{"gpuz": ' + b"[" * 100_000 + b"}]}"):
        r = user.post("/v1/invocations", content=body, headers=headers)
        assert r.status_code == 400 and r.json()["code"] == "malformed_json", r.text
    r = user.post("/v1/invocations", content=b'{"calls": [{"gpuz": "\\ud800"}]}', headers=headers)
    assert r.status_code == 422 and r.json()["code"] == "invalid_string", r.text


#: Valid bodies of user routes (route, body), each with where in it a field may be added.
_VALID: list[tuple[str, str, dict[str, Any], list[str]]] = [
    ("POST", "/v1/invocations", {"calls": [{"payload": ""}]}, ["", "calls.0"]),
    (
        "POST",
        "/v1/invocations/watch",
        {"items": [{"id": str(uuid.uuid4())}], "timeout_s": 0},
        ["", "items.0"],
    ),
    ("POST", "/v1/invocations/cancel", {"ids": [str(uuid.uuid4())]}, [""]),
    ("PUT", "/v1/functions/g", {"payload": "", "resources": {}}, ["", "resources"]),
]
_FIELD_NAMES = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40).filter(
    lambda name: name not in _KNOWN
)
_KNOWN = {
    field
    for struct in (
        wire.SubmitRequest,
        wire.CallSpec,
        wire.WatchRequest,
        wire.WatchItem,
        wire.CancelRequest,
        wire.FunctionRegistration,
        wire.FunctionResources,
    )
    for field in struct.__struct_fields__
}


def test_any_unknown_field_anywhere_in_a_user_request_is_named(gateway: Cluster) -> None:
    """Property: adding any field a message does not have, at any of its levels, to a body
    the gateway takes gets 422 ``unknown_field`` naming exactly that path."""
    user = client(gateway, gateway.token)

    @hypothesis.settings(
        max_examples=40,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(
        route=st.sampled_from(_VALID),
        name=_FIELD_NAMES,
        value=st.none() | st.integers() | st.text(max_size=5) | st.lists(st.integers()),
        data=st.data(),
    )
    def named(route: Any, name: str, value: Any, data: st.DataObject) -> None:
        method, path, valid, places = route
        body = msgspec.json.decode(msgspec.json.encode(valid))  # a deep copy
        place = data.draw(st.sampled_from(places))
        target, where = body, "$"
        for step in filter(None, place.split(".")):
            target = target[int(step)] if step.isdigit() else target[step]
            where += f"[{step}]" if step.isdigit() else f".{step}"
        target[name] = value
        r = user.request(method, path, content=msgspec.json.encode(body))
        detail = assert_unknown(r, f"{where}.{name}")
        assert f"unknown field `{name}`" in detail

    named()


def test_answers_with_fields_this_version_does_not_know_are_read() -> None:
    """What the sdk and the nodelet decode from a gateway ignores fields added later, nested
    ones too (FunctionInfo.resources is not the strict FunctionResources)."""
    resources = {"gpus": 1, "cpu_memory_mb": 512}
    info = {
        "name": "f",
        "version": "0" * 16,
        "owner": "alice",
        "visibility": "private",
        "description": "",
        "resources": resources,
        "payload_size": 1,
        "created": 1.0,
        "registered": 1.0,
        "latest": True,
        "shiny_new_field": [1],
    }
    decoded = msgspec.json.decode(msgspec.json.encode(info), type=wire.FunctionInfo)
    assert decoded.resources.gpus == 1
    invocation = {"id": "x", "state": "queued", "timeline": {"queued_again": 1.0}, "new": 1}
    assert msgspec.json.decode(msgspec.json.encode(invocation), type=wire.Invocation).id == "x"
    poll = {"assignments": [{"invocation_id": "x", "epoch": 1, "gpu_indices": [], "n": 1}]}
    msgspec.json.decode(msgspec.json.encode({**poll, "revoked": []}), type=wire.PollResponse)
    # ... while the strict request twin refuses them.
    try:
        msgspec.convert(resources, wire.FunctionResources)
    except msgspec.ValidationError as exc:
        assert "unknown field `cpu_memory_mb`" in str(exc)
    else:
        raise AssertionError("FunctionResources took an unknown field")
