"""Registered functions: stored by value under a name (``PUT /v1/functions/{name}``),
listed, inspected, unregistered, and invoked with plain JSON
(``POST /v1/functions/{name}/invoke``) by their owner or, when shared, by colleagues.

A version is a content hash: the first 16 hex digits of the SHA-256 of the pickled function
and the resources its invocations ask for. The gateway never unpickles the function
(invariant 5): the worker calls it with the JSON arguments and sends the result back as
JSON beside the pickled one.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
import uuid

import asyncpg
import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route

from bulletin_core import wire
from gateway import auth, db, idempotency, invocations
from gateway.errors import NotFound, PayloadTooLarge, Unprocessable
from gateway.http import JSON, body, checked, no_room_for_calls, reply, wait_param
from gateway.notify import GatewayStopping, Subscription

FUNCTION_NAME_RULE = f"not a function name: {wire.SLUG_RULE}"


def _name(request: Request) -> str:
    name = request.path_params["name"]
    return checked("name", name, wire.FunctionName, FUNCTION_NAME_RULE, code="invalid_name")


def _owner(request: Request) -> str | None:
    owner = request.query_params.get("owner")
    if owner is None:
        return None
    return checked("owner", owner, wire.Name, "not a user name (at most 200 characters, no NUL)")


def _version(request: Request) -> str | None:
    version = request.query_params.get("version")
    if version is None:
        return None
    what = "not a function version (16 hex digits, as GET /v1/functions/{name}/versions lists)"
    return checked("version", version, wire.FunctionVersion, what)


def _not_found(name: str, owner: str | None, version: str | None) -> NotFound:
    whose = "of yours" if owner is None else f"of {owner!r} shared with you"
    which = "" if version is None else f" at version {version}"
    return NotFound(
        f"no function {name!r}{which} {whose} (GET /v1/functions lists them)",
        code="no_function",
    )


async def register(request: Request) -> Response:
    caller = await auth.principal(request, "user")
    assert caller.user_id is not None
    name = _name(request)
    registration = await body(request, wire.FunctionRegistration)
    config, pool = request.app.state.config, request.app.state.pool
    if (registration.payload is None) == (registration.payload_blob is None):
        raise Unprocessable("a registration needs exactly one of payload and payload_blob")
    if registration.payload is not None:
        size = len(registration.payload)
        if size > config.inline_limit:
            raise PayloadTooLarge(
                f"payload is {size} bytes, over the inline limit of {config.inline_limit}: "
                "upload it with PUT /v1/blobs and pass payload_blob",
                code="payload_too_large",
            )
        digest = hashlib.sha256(registration.payload)
    else:
        blob = invocations.valid_id(registration.payload_blob or "")
        found = await db.blob_size(pool, blob, caller.user_id)
        if found is None:
            raise Unprocessable(f"payload_blob {blob} is not a complete blob of yours")
        size, digest, seq = found, hashlib.sha256(), 0
        while (chunk := await db.blob_chunk(pool, blob, seq)) is not None:
            digest.update(chunk)
            seq += 1
    resources = registration.resources
    await invocations.check_fits(request, caller.group, [_spec(resources)])
    digest.update(msgspec.json.encode(resources))
    version = digest.hexdigest()[:16]
    try:
        async with pool.acquire() as conn:
            row, created = await db.register_function(
                conn, caller.user_id, name, version, registration, size
            )
    except asyncpg.ForeignKeyViolationError:  # the blob was purged meanwhile
        raise Unprocessable(
            f"payload_blob {registration.payload_blob} is gone: upload it again"
        ) from None
    return reply(row.info, 201 if created else 200)


def _spec(resources: wire.FunctionResourcesInfo, name: str = "") -> wire.CallSpec:
    """A call of a registered function with these resources, as the scheduler weighs it."""
    return wire.CallSpec(
        function_name=name,
        gpus=resources.gpus,
        gpu_model=resources.gpu_model,
        gpu_memory_mb=resources.gpu_memory_mb,
        timeout_s=resources.timeout_s,
        max_retries=resources.max_retries,
        expected_s=resources.expected_s,
    )


async def list_functions(request: Request) -> Response:
    caller = await auth.principal(request, "user")
    found = await db.list_functions(request.app.state.pool, caller, _owner(request))
    return reply(found)


async def get_function(request: Request) -> Response:
    caller = await auth.principal(request, "user")
    name, owner, version = _name(request), _owner(request), _version(request)
    found = await db.find_function(request.app.state.pool, caller, owner, name, version)
    if found is None:
        raise _not_found(name, owner, version)
    return reply(found.info)


async def versions(request: Request) -> Response:
    caller = await auth.principal(request, "user")
    name, owner = _name(request), _owner(request)
    found = await db.list_functions(request.app.state.pool, caller, owner, name)
    if not found:
        raise _not_found(name, owner, None)
    return reply(found)


async def unregister(request: Request) -> Response:
    owner = await auth.user_id(request)
    name = _name(request)
    if not await db.delete_function(request.app.state.pool, owner, name):
        raise _not_found(name, None, None)
    return Response(status_code=204)


async def invoke(request: Request) -> Response:
    caller = await auth.principal(request, "user")
    assert caller.user_id is not None
    user = caller.user_id
    name, owner, version = _name(request), _owner(request), _version(request)
    wait = wait_param(request)
    arguments = msgspec.json.encode(await body(request, wire.InvokeRequest))
    key = idempotency.key_of(request)
    request_hash = idempotency.fingerprint(
        request, (owner or "").encode(), (version or "").encode(), arguments
    )
    if key is not None:
        replay = await idempotency.earlier(request, user, key, request_hash)
        if replay is not None:
            return await _replay(request, user, key, replay, wait)
    config, pool = request.app.state.config, request.app.state.pool
    if len(arguments) > config.inline_limit:
        raise PayloadTooLarge(
            f"the arguments are {len(arguments)} bytes of JSON, over the limit of "
            f"{config.inline_limit}: pass big data by reference (a path on the shared "
            "directory, a URL), or call the function from the sdk",
            code="arguments_too_large",
        )
    # Shared with the caller, or the caller's own: an administrator reads others' private
    # functions but does not run them.
    found = await db.find_function(pool, caller, owner, name, version, to_run=True)
    if found is None:
        raise _not_found(name, owner, version)
    spec = _spec(found.info.resources, found.info.name)
    await invocations.check_fits(request, caller.group, [spec])
    http_key = None if key is None else (key, request_hash)
    invocation_id = str(uuid.uuid4())
    hub = request.app.state.hub
    # Before the call exists, so that no news of it can come before it (see answer). A
    # request that does not wait takes no handover: a result handed over is stamped fetched.
    async with hub.subscribe([f"i:{invocation_id}"], handovers=wait > 0) as sub:
        try:
            # Waiting, it commits without waiting for the WAL flush (invocations.durable).
            submitting = request.app.state.relaxed if wait > 0 else pool
            async with submitting.acquire() as conn, hub.holding(conn.get_server_pid()):
                async with conn.transaction():
                    made = await db.invoke(
                        conn,
                        user,
                        found.id,
                        arguments,
                        http_key,
                        invocation_id=invocation_id,
                        storage_limit=config.user_storage_bytes,
                        place_within=config.node_timeout_s if config.place_at_submit else None,
                    )
                    nodes, handed = await invocations.place(request, conn, caller, [spec], made)
                invocations.wake_nodes(hub, conn.get_server_pid(), nodes, handed)
        except db.NoRoom as exc:
            raise no_room_for_calls(request, exc.blobs, exc.shared) from None
        except db.KeyTaken:
            assert key is not None
            replay = await idempotency.earlier(request, user, key, request_hash)
            assert replay is not None
            return await _replay(request, user, key, replay, wait)
        except db.FunctionGone:  # unregistered meanwhile
            raise _not_found(name, owner, version) from None
        try:
            return await answer(request, user, invocation_id, wait, unread=sub)
        finally:
            if key is not None:
                await idempotency.answered(request, user, key)


async def _replay(request: Request, user: int, key: str, ids: list[str], wait: float) -> Response:
    await idempotency.answered(request, user, key)  # a key taken over after its holder died
    return await answer(request, user, ids[0], wait, replayed=True)


async def answer(
    request: Request,
    owner: int,
    invocation_id: str,
    wait: float,
    *,
    replayed: bool = False,
    unread: Subscription | None = None,
) -> Response:
    """The invocation once it is terminal or ``wait`` seconds have passed: 200 when it is
    terminal, else 202 with its ``Location`` to poll. ``unread``: a subscription to its news
    taken before it was made, so that it may wait before it first reads it."""
    config, pool = request.app.state.config, request.app.state.pool
    deadline = time.monotonic() + wait
    key = f"i:{invocation_id}"
    async with contextlib.AsyncExitStack() as stack:
        sub: Subscription = unread if unread is not None else await stack.enter_async_context(
            request.app.state.hub.subscribe([key], handovers=wait > 0)
        )
        found: wire.Invocation | None = None
        read = unread is None
        while True:
            late = time.monotonic() >= deadline
            if late:
                # Answered with what is read now: a result finishing meanwhile is no longer
                # handed over (and stamped fetched) to this request, which will not take it.
                sub.handovers = False
            if read:
                got = await db.get_invocations(pool, owner, [invocation_id])
                if not got:  # purged (a replay long after)
                    raise NotFound(
                        f"invocation {invocation_id} is gone: it ended longer ago than this "
                        "cluster keeps invocations (retention_s)"
                    )
                found = got[0]
            if found is not None and (found.state.terminal or late):
                break
            read = True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                continue  # to read once more, taking no handover, and answer with that
            try:
                await sub.wait(min(remaining, config.recheck_s))
            except GatewayStopping:
                deadline = 0.0  # 202 with its Location: the invocation exists, poll it there
                continue
            # Finished here: handed over, fetched stamp and all (Hub.woke); else read again.
            if (handed := sub.take_handed().get(key)) is not None:
                found, read = handed, False
    assert found is not None  # read, or handed over, before the loop ended
    if wait > 0 or replayed:
        await invocations.durable(request, [invocation_id], [found])
    location = f"/v1/invocations/{invocation_id}"
    if found.state.terminal:
        [found] = await invocations.fetched(request, owner, [found])
    status = 200 if found.state.terminal else 202
    headers = {"Location": location, **(idempotency.REPLAYED if replayed else {})}
    return Response(msgspec.json.encode(found), status, headers=headers, media_type=JSON)


async def bad_path(request: Request) -> Response:
    """Paths under /v1/functions/ that no route above takes: a wrong method on a good path
    (405), or a name that is not one, such as one with '/' or '..' in it (422)."""
    await auth.principal(request, "user")
    allowed = sorted(
        {
            method
            for route in ROUTES[:-1]
            if route.matches(request.scope)[0] is Match.PARTIAL
            for method in route.methods or ()
        }
    )
    if allowed:
        raise HTTPException(405, headers={"Allow": ", ".join(allowed)})
    rest = request.path_params["rest"]
    raise Unprocessable(
        f"{rest!r} does not name a function (or a route of one): {wire.SLUG_RULE}",
        code="invalid_name",
    )


ROUTES = [
    Route("/v1/functions", list_functions, methods=["GET"]),
    Route("/v1/functions/{name}", register, methods=["PUT"]),
    Route("/v1/functions/{name}", get_function, methods=["GET"]),
    Route("/v1/functions/{name}", unregister, methods=["DELETE"]),
    Route("/v1/functions/{name}/versions", versions, methods=["GET"]),
    Route("/v1/functions/{name}/invoke", invoke, methods=["POST"]),
    # Last: what the routes above do not take.
    Route(
        "/v1/functions/{rest:path}",
        bad_path,
        methods=["GET", "PUT", "POST", "DELETE", "PATCH"],
        include_in_schema=False,
    ),
]
