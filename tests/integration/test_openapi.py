"""The hand-written OpenAPI contract (``openapi.yaml``) held against the gateway: every route is
described and every description is routed, the message schemas are exactly the wire Structs,
the gateway serves the file, and a property-based run of the user routes against a real gateway
and PostgreSQL gets only answers the contract documents."""

from __future__ import annotations

import base64
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import hypothesis
import msgspec
import pytest
import schemathesis
import yaml
from hypothesis import strategies as st
from schemathesis import GenerationMode, checks
from starlette.routing import Route

from bulletin_core import wire
from gateway.app import create_app
from gateway.config import GatewayConfig
from scripts import openapi
from tests.conftest import ROOT, Cluster, running

SPEC_PATH = ROOT / "openapi.yaml"
HTTP_STRUCTS = openapi.HTTP_STRUCTS
HTTP_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}
PROBLEM_REF = "#/components/schemas/Problem"

#: Structs that never cross HTTP (worker stdin/stdout, the client config file).
NOT_HTTP = {
    wire.WorkerTask,
    wire.WorkerOutcome,
    wire.ClientConfig,
    wire.PickleHeader,
    wire.RunAs,
}

#: What the property-based run checks of every answer.
CONFORMANCE = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
    checks.response_headers_conformance,
]
EXAMPLES_PER_OPERATION = 20
AWKWARD = "\x00\x01\t\n\"\\'%_aé€\u2028\U0001f600"


def load_spec() -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load(SPEC_PATH.read_text())
    return spec


def operations(spec: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (method.upper(), path): op
        for path, item in spec["paths"].items()
        for method, op in item.items()
        if method in HTTP_METHODS
    }


def resolve(spec: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        found: Any = spec
        for part in node["$ref"].removeprefix("#/").split("/"):
            found = found[part]
        node = found
    return node


def test_the_spec_is_a_valid_openapi_3_1_document() -> None:
    from openapi_spec_validator import validate

    # ASCII only: the gateway reads the file in the locale's encoding.
    SPEC_PATH.read_bytes().decode("ascii")
    spec = load_spec()
    assert spec["openapi"] == "3.1.0"
    validate(spec)


def test_every_route_is_in_the_spec_and_every_operation_is_routed() -> None:
    app = create_app(GatewayConfig(database_url="postgresql://unused"))
    routed = {
        (method, re.sub(r"{(\w+):\w+}", r"{\1}", route.path))  # {id:invocation}: {id}
        for route in app.routes
        # Not in the schema: what answers paths no route takes (/v1/functions/a/b: 422).
        if isinstance(route, Route) and route.include_in_schema
        for method in route.methods or ()
        if method != "HEAD"
    }
    assert all(isinstance(route, Route) for route in app.routes)  # no Mount hides routes
    assert set(operations(load_spec())) == routed


def test_the_message_schemas_are_exactly_the_wire_structs() -> None:
    every_struct = {
        value
        for value in vars(wire).values()
        if isinstance(value, type)
        and issubclass(value, msgspec.Struct)
        and not value.__name__.startswith("_")
    }
    # A new message must be added to scripts/openapi.py's HTTP_STRUCTS or to NOT_HTTP.
    assert every_struct == set(HTTP_STRUCTS) | NOT_HTTP
    text = SPEC_PATH.read_text()
    out_of_date = "openapi.yaml components/schemas are out of date: run .venv/bin/python "
    out_of_date += "scripts/openapi.py"
    changed = openapi.changed(load_spec()["components"]["schemas"], openapi.schemas())
    assert not changed, f"{out_of_date} (changed: {', '.join(changed)})"
    # ... and written as the script writes them, so that running it changes nothing.
    assert openapi.render(text) == text, f"{out_of_date} (formatting only)"


def test_the_published_constraints_are_what_the_gateway_enforces() -> None:
    """A few of the rules, as the schema states them (from wire.py's msgspec.Meta)."""
    schemas = openapi.schemas()
    call = schemas["CallSpec"]["properties"]
    whole, part = call["gpus"]["anyOf"]  # whole GPUs, or part of one
    assert (whole["type"], whole["minimum"], whole["maximum"]) == ("integer", 0, 2**31 - 1)
    assert (part["type"], part["minimum"], part["exclusiveMaximum"]) == ("number", 0.05, 1)
    assert (call["max_retries"]["minimum"], call["max_retries"]["maximum"]) == (0, 10)
    assert call["timeout_s"]["anyOf"][0]["exclusiveMinimum"] == 0
    assert "0: CPU only" in call["gpus"]["description"]
    calls = schemas["SubmitRequest"]["properties"]["calls"]
    assert (calls["minItems"], calls["maxItems"]) == (1, wire.MAX_SUBMIT)
    assert schemas["WatchItem"]["properties"]["log_after"]["minimum"] == 0
    assert schemas["RegisterRequest"]["properties"]["cpu_slots"]["minimum"] == 0


def test_requests_refuse_unknown_fields_and_answers_ignore_them() -> None:
    """What the gateway decodes from clients says ``additionalProperties: false`` (it answers
    422 ``unknown_field``); what clients decode from the gateway does not, so that answers
    may gain fields without breaking older sdks and nodelets (bulletin_core/wire.py)."""
    spec = load_spec()
    requests: set[str] = set()
    for op in operations(spec).values():
        media = op.get("requestBody", {}).get("content", {}).get("application/json")
        if media is not None:
            requests.add(media["schema"]["$ref"].rsplit("/", 1)[1])
    assert requests, "no JSON request bodies found"
    schemas = spec["components"]["schemas"]

    def reached(name: str, seen: set[str]) -> set[str]:
        found = {name} if schemas[name].get("type") == "object" else set()
        seen.add(name)
        for ref in re.findall(r"'\$ref': '#/components/schemas/(\w+)'", repr(schemas[name])):
            if ref not in seen:
                found |= reached(ref, seen)
        return found

    strict = set().union(*(reached(name, set()) for name in requests))
    assert {"CallSpec", "GpuInfo", "Attempt", "FunctionResources", "WatchItem"} <= strict
    for name, schema in schemas.items():
        if schema.get("type") != "object":
            continue
        closed = schema.get("additionalProperties") is False
        if name in strict:
            assert closed, f"{name} is (in) a request: it must refuse unknown fields"
        else:
            assert not closed, f"{name} is only in answers: it must ignore unknown fields"


def test_every_operation_is_secured_and_every_error_is_a_problem() -> None:
    spec = load_spec()
    assert spec["security"] == [{"bearerAuth": []}]
    for (method, path), op in operations(spec).items():
        where = f"{method} {path}"
        assert op.get("security", spec["security"]) == (
            [] if path == "/healthz" else spec["security"]
        ), where
        assert op.get("operationId") and op.get("description"), where
        for status, response in op["responses"].items():
            content = resolve(spec, response).get("content", {})
            if int(status) >= 400:
                assert list(content) == ["application/problem+json"], f"{where} {status}"
                assert content["application/problem+json"]["schema"] == {"$ref": PROBLEM_REF}
            elif int(status) == 204:
                assert not content, f"{where} {status}"
        if path != "/healthz":
            assert {"401", "403"} <= set(op["responses"]), where
        params = [resolve(spec, p) for p in spec["paths"][path].get("parameters", [])]
        for param in params:
            if param["in"] == "path" and param["name"] == "id":
                assert param["schema"] == {"type": "string", "format": "uuid"}, where
            elif param["in"] == "path":  # a name: the route checks it (422 when bad)
                assert param["schema"] == {"type": "string"}, where


def test_every_operation_documents_the_errors_common_to_its_kind() -> None:
    """The answers every route of a kind may give, from shared components/responses: 400 and
    415 where there is a JSON body (415 also for raw bytes), 429 on user-token routes (the rate
    limit), and 503 with Retry-After wherever the database is used (every route with a
    token)."""
    spec = load_spec()
    for (method, path), op in operations(spec).items():
        where = f"{method} {path}"
        responses = op["responses"]
        body = op.get("requestBody", {}).get("content", {})
        expected: dict[str, str] = {}
        if "application/json" in body:
            expected |= {"400": "MalformedJson", "415": "UnsupportedJsonType"}
            assert "413" in responses, where
        if "application/octet-stream" in body:
            expected["415"] = "UnsupportedBytesType"
        if path != "/healthz":
            expected["503"] = "Unavailable"
            if not path.startswith("/v1/node/"):
                expected["429"] = "RateLimited"
        for status, name in expected.items():
            assert responses.get(status) == {"$ref": f"#/components/responses/{name}"}, (
                f"{where} {status}"
            )
    for name in ("RateLimited", "Unavailable"):
        header = spec["components"]["responses"][name]["headers"]["Retry-After"]
        assert header["required"] and header["schema"] == {"type": "integer", "minimum": 1}


def test_the_gateway_serves_this_document_to_token_holders(gateway: Cluster) -> None:
    url = f"{gateway.url}/openapi.yaml"
    assert httpx.get(url).status_code == 401
    r = httpx.get(url, headers={"authorization": f"Bearer {gateway.token}"})
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/yaml"
    assert yaml.safe_load(r.text) == load_spec()


def test_the_request_examples_are_wire_messages() -> None:
    spec = load_spec()
    seen = 0
    for (method, path), op in operations(spec).items():
        media = op.get("requestBody", {}).get("content", {}).get("application/json")
        if media is None:
            continue
        struct = getattr(wire, media["schema"]["$ref"].rsplit("/", 1)[1])
        assert "example" in media, f"{method} {path}"
        msgspec.convert(media["example"], struct)  # raises if the example is not a valid message
        seen += 1
    assert seen


# ------------------------------------------------------------ generated requests vs the gateway


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class Harness:
    """Sends schemathesis cases to a real gateway and collects the answers that break the spec."""

    def __init__(self, gateway: Cluster) -> None:
        self.schema = schemathesis.openapi.from_path(SPEC_PATH, config=schemathesis.Config())
        self.url = gateway.url
        self.user = {"authorization": f"Bearer {gateway.token}"}
        self.failures: list[str] = []
        self.statuses: dict[str, Counter[int]] = {}

    def operation(self, label: str) -> schemathesis.APIOperation:
        return self.schema.find_operation_by_label(label)  # type: ignore[return-value]

    def fuzz(
        self,
        label: str,
        strategy: st.SearchStrategy[schemathesis.Case],
        examples: int = EXAMPLES_PER_OPERATION,
        token: dict[str, str] | None = None,
    ) -> None:
        """Send up to ``examples`` cases drawn from ``strategy``; record the first that breaks
        the spec (shrunk) under ``label``."""
        # A fresh connection per request: uvicorn drops a kept-alive one after a 500, which
        # would blame the next request for the previous one's failure.
        headers = {**(token or self.user), "connection": "close"}
        seen = self.statuses[label] = Counter()

        @hypothesis.settings(
            max_examples=examples,
            deadline=None,
            derandomize=True,  # the same requests every run: no flakes, failures reproduce
            database=None,
            suppress_health_check=list(hypothesis.HealthCheck),
            phases=[hypothesis.Phase.generate, hypothesis.Phase.shrink],
            report_multiple_bugs=False,
        )
        @hypothesis.given(case=strategy)
        def conforms(case: schemathesis.Case) -> None:
            response = case.call(base_url=self.url, headers=headers, timeout=30)
            seen[response.status_code] += 1
            case.validate_response(response, checks=CONFORMANCE, headers=headers)

        try:
            conforms()
        except hypothesis.errors.Unsatisfiable:
            pass  # nothing of this kind to generate, e.g. invalid input for a route without any
        except (Exception, BaseExceptionGroup) as exc:  # schemathesis raises a FailureGroup
            notes = "\n".join(getattr(exc, "__notes__", []))
            self.failures.append(f"{label}:\n{exc}\n{notes}")


def text(size: int) -> st.SearchStrategy[str]:
    """Any text, or text of the characters that trouble JSON, encodings and databases."""
    return st.text(max_size=size) | st.text(st.sampled_from(AWKWARD), max_size=size)


@pytest.fixture
def unlimited(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Cluster]:
    """Like the ``gateway`` fixture, without the per-user rate limit: a fast machine could
    send the generated requests faster than it allows, and 429s would starve the checks of
    the happy paths (429 is documented, so it would not fail them)."""
    # A short ?wait= bound: generated invocations never finish here (there is no node).
    options = {"rate-limit-per-s": "0", "max-wait-s": "0.3"}
    with running(Cluster(database_url, tmp_path), request, options=options) as cluster:
        yield cluster


def test_user_routes_answer_only_what_the_spec_documents(unlimited: Cluster) -> None:
    """Schemathesis sends every user route requests generated from the spec, valid and invalid,
    then plausible ones that reach the happy paths, and checks each answer against the spec:
    no 5xx, only documented status codes and content types, bodies that match their schemas."""
    gateway = unlimited
    h = Harness(gateway)
    user = httpx.Client(base_url=gateway.url, headers=h.user, timeout=30)
    # Real objects, so that generated requests also reach the answers of the happy paths.
    blob = user.put("/v1/blobs", content=b"payload").json()["id"]
    submitted = user.post(
        "/v1/invocations",
        json={
            "calls": [
                {"payload": b64(b"call"), "function_name": "f"},
                {"payload_blob": blob},
                {"payload": ""},
            ]
        },
    )
    queued, done, other = submitted.json()["ids"]
    assert user.post(f"/v1/invocations/{done}/cancel").json()["state"] == "cancelled"
    unknown = "00000000-0000-4000-8000-000000000000"
    node = {"authorization": f"Bearer {gateway.node_token('n1').read_text()}"}

    user_routes = [result.ok() for result in h.schema.get_all_operations()]
    user_routes = [op for op in user_routes if not op.path.startswith("/v1/node/")]
    assert len(user_routes) == 24
    # Admin routes as an administrator (the plain user's token gets 403 there, checked below).
    root = {"authorization": f"Bearer {gateway.add_user('root', is_admin=True)}"}
    for op in user_routes:
        token = root if op.path.startswith("/v1/admin/") else None
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            h.fuzz(f"{op.label} ({mode.value})", op.as_strategy(generation_mode=mode), token=token)
        for strategy in op.get_strategies_from_examples():
            h.fuzz(f"{op.label} (examples)", strategy, examples=1, token=token)
        if op.path.startswith("/v1/admin/"):
            h.fuzz(f"{op.label} (user token)", op.as_strategy(), examples=3)
            assert set(h.statuses[f"{op.label} (user token)"]) == {403}, op.label
        if op.path != "/healthz":
            h.fuzz(f"{op.label} (node token)", op.as_strategy(), examples=3, token=node)
            assert set(h.statuses[f"{op.label} (node token)"]) == {403}, op.label

    def own(label: str, ids: list[str]) -> None:
        op = h.operation(label)
        h.fuzz(
            f"{label} (own ids)",
            st.sampled_from(ids).flatmap(lambda i: op.as_strategy(path_parameters={"id": i})),
            examples=2 * len(ids),
        )

    own("GET /v1/invocations/{id}", [queued, done])
    own("POST /v1/invocations/{id}/cancel", [done, other])
    own("GET /v1/blobs/{id}", [blob])
    # Only terminal ones: a queued invocation's log stream stays open while it waits.
    own("GET /v1/invocations/{id}/logs", [done])
    own("GET /v1/invocations/{id}/result", [done, queued])

    # A registered function (the gateway never unpickles it, so any bytes do), and requests
    # naming it.
    registered = user.put("/v1/functions/echo", json={"payload": b64(b"fn")})
    assert registered.status_code == 201, registered.text
    for label in (
        "GET /v1/functions/{name}",
        "GET /v1/functions/{name}/versions",
        "POST /v1/functions/{name}/invoke",
        "PUT /v1/functions/{name}",
    ):
        op = h.operation(label)
        h.fuzz(
            f"{label} (own name)",
            st.sampled_from(["echo", "nope"]).flatmap(
                lambda n, op=op: op.as_strategy(path_parameters={"name": n})
            ),
            examples=6,
        )

    # Submissions shaped like the sdk's: valid by the gateway's rules, with values that stretch
    # them (any text, any number of GPUs, tiny and huge timeouts), and some invalid payloads.
    payloads = st.one_of(
        st.builds(lambda p: {"payload": b64(p)}, st.binary(max_size=64)),
        st.builds(lambda b: {"payload_blob": b}, st.sampled_from([blob, blob, unknown, "nope"])),
        st.sampled_from([{}, {"payload": b64(b"x"), "payload_blob": blob}]),
        # This gateway has no shared directory: a payload file is refused (422).
        st.sampled_from([{"payload_file": "bulletin/payloads/p.bin"}]),
    )
    options = st.fixed_dictionaries(
        {},
        optional={
            "idempotency_key": text(200),
            "function_name": text(40),
            "gpus": st.integers(min_value=0),
            "max_retries": st.integers(min_value=0, max_value=10),
            "timeout_s": st.none() | st.floats(min_value=0, exclude_min=True, allow_infinity=False),
            "priority": st.integers(min_value=-1000, max_value=1000),
            "gpu_model": st.none() | st.sampled_from(["A100", "Fake", "H100 80GB", "A100|Fake"]),
            "gpu_memory_mb": st.none() | st.integers(min_value=0, max_value=2**31 - 1),
            "expected_s": st.none() | st.floats(min_value=1e-3, max_value=1e9),
        },
    )
    calls = st.builds(lambda p, o: {**p, **o}, payloads, options)
    submit = h.operation("POST /v1/invocations")
    h.fuzz(
        "POST /v1/invocations (plausible calls)",
        st.builds(
            lambda c: submit.Case(body={"calls": c}, media_type="application/json"),
            st.lists(calls, min_size=1, max_size=3),
        ),
        examples=60,
    )

    # Watches of this user's invocations with any log cursor; a short timeout_s, as those not
    # yet terminal hold the answer for it.
    items = st.lists(
        st.fixed_dictionaries(
            {"id": st.sampled_from([done, queued, unknown])}, optional={"log_after": st.integers()}
        ),
        max_size=3,
    )
    watch = h.operation("POST /v1/invocations/watch")
    h.fuzz(
        "POST /v1/invocations/watch (own ids)",
        st.builds(
            lambda i, t: watch.Case(
                body={"items": i, "timeout_s": t}, media_type="application/json"
            ),
            items,
            st.floats(min_value=-1, max_value=0.05),
        ),
        examples=40,
    )

    assert not h.failures, "\n\n".join(h.failures)
    # The plausible requests did reach the happy paths.
    for label, status in [
        ("POST /v1/invocations (plausible calls)", 201),
        ("POST /v1/invocations/watch (own ids)", 200),
        ("GET /v1/invocations/{id} (own ids)", 200),
        ("POST /v1/invocations/{id}/cancel (own ids)", 200),
        ("GET /v1/blobs/{id} (own ids)", 200),
        ("GET /v1/invocations/{id}/logs (own ids)", 200),
        ("GET /v1/functions/{name} (own name)", 200),
        ("POST /v1/functions/{name}/invoke (own name)", 202),
        ("PUT /v1/blobs (positive)", 201),
    ]:
        assert h.statuses[label][status] > 0, (label, h.statuses[label])

