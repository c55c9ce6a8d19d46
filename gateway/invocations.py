"""User routes: submit, read, cancel and watch invocations; upload and fetch blobs."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from typing import BinaryIO

import asyncpg
import msgspec
from starlette.convertors import Convertor, register_url_convertor
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bulletin_core import shared, wire
from gateway import auth, db, idempotency, scheduling
from gateway.config import GatewayConfig
from gateway.errors import Conflict, Forbidden, NotFound, PayloadTooLarge, Unprocessable
from gateway.http import (
    body,
    int_param,
    no_room_for_calls,
    reply,
    store_blob,
    stream_blob,
    stream_file,
    wait_param,
)
from gateway.notify import GatewayStopping, Hub, Subscription
from scheduler import Pending, never_fits, placement

MAX_LOG_CHUNKS = 10_000
FAN_IN_LINGER_S = 0.005
MAX_ANSWER_RESULT_BYTES = 16 << 20


def _check_call(
    spec: wire.CallSpec, index: int, config: GatewayConfig, user: str
) -> wire.CallSpec:
    # What one field says (ranges, lengths, patterns) was checked when the body was decoded
    # (wire.CallSpec's msgspec.Meta); here: the rules across fields, and the cluster's.
    where = f"calls[{index}]"
    ways = [p for p in (spec.payload, spec.payload_blob, spec.payload_file) if p is not None]
    if len(ways) != 1:
        raise Unprocessable(f"{where} needs exactly one of payload, payload_blob and payload_file")
    if spec.payload is not None and len(spec.payload) > config.inline_limit:
        raise PayloadTooLarge(
            f"{where}.payload is {len(spec.payload)} bytes, over the inline limit of "
            f"{config.inline_limit}: upload it with PUT /v1/blobs and pass payload_blob",
            code="payload_too_large",
        )
    if spec.payload_file is not None:
        _check_payload_file(spec.payload_file, where, config.shared_dir, user)
    if not spec.idempotency_key:
        # Without a key a retried request cannot be recognised; each call stands alone.
        spec = msgspec.structs.replace(spec, idempotency_key=uuid.uuid4().hex)
    return spec


def _check_payload_file(name: str, where: str, root: str, user: str) -> None:
    """A payload file must be in the submitter's own directory of the shared directory,
    which only their account can write to: nobody can submit another's payload as theirs."""
    if not root:
        raise Unprocessable(
            f"{where}.payload_file: this cluster has no shared directory; upload the payload "
            "with PUT /v1/blobs and pass payload_blob"
        )
    if not shared.is_payload_of(name, user):
        raise Unprocessable(
            f"{where}.payload_file {name} is not a payload file of yours: yours go in "
            f"{shared.user_dir(user) if shared.valid_user(user) else 'your user directory'}/",
            code="payload_file_not_yours",
        )


def _check_one_map(calls: list[wire.CallSpec]) -> None:
    """The items of one map ask for the same resources and priority: a node finishing one
    may run the next in its place (``db.top_up``)."""
    first = _shape(calls[0])
    for i, call in enumerate(calls):
        if _shape(call) != first:
            raise Unprocessable(
                f"calls[{i}] asks for other resources or priority than calls[0], and map_id "
                "makes them items of one map: submit calls that differ without map_id (or as "
                "maps of their own)",
                code="map_items_differ",
            )


def _shape(call: wire.CallSpec) -> tuple[object, ...]:
    return (
        call.gpus,
        call.priority,
        call.gpu_model,
        call.gpu_memory_mb,
        call.expected_s,
        call.timeout_s,
        call.caller_session,
    )


async def submit(request: Request) -> Response:
    caller = await auth.principal(request, "user")
    assert caller.user_id is not None
    owner = caller.user_id
    wait = wait_param(request)
    req = await body(request, wire.SubmitRequest)
    key = idempotency.key_of(request)
    request_hash = idempotency.fingerprint(request, msgspec.json.encode(req))
    if key is not None and (ids := await idempotency.earlier(request, owner, key, request_hash)):
        return await _submitted(request, owner, ids, wait, replayed=True)
    config = request.app.state.config
    calls = [_check_call(c, i, config, caller.name) for i, c in enumerate(req.calls)]
    raised = [i for i, c in enumerate(calls) if c.priority > 0]
    if raised and not caller.is_admin:
        raise Unprocessable(
            f"calls[{raised[0]}].priority is {calls[raised[0]].priority}: only administrators "
            "may raise a call's priority above 0; a negative priority lets others go first",
            code="priority_not_allowed",
        )
    if req.map_id is not None:
        _check_one_map(calls)
    await check_fits(request, caller.group, calls)
    keys = [c.idempotency_key for c in calls]
    if len(set(keys)) != len(keys):
        raise Unprocessable("two calls in one request share an idempotency_key")
    blobs = {valid_id(c.payload_blob) for c in calls if c.payload_blob is not None}
    if blobs:
        missing = blobs - await db.owned_blobs(request.app.state.pool, owner, list(blobs))
        if missing:
            raise Unprocessable(
                f"payload_blob {sorted(missing)[0]} is not a complete blob of yours"
            )
    new_ids = [str(uuid.uuid4()) for _ in calls]
    hub = request.app.state.hub
    # A submission that waits commits without waiting for its WAL flush: its caller is told
    # nothing until its answer, which is durable first (_submitted).
    pool = request.app.state.relaxed if wait > 0 else request.app.state.pool
    async with contextlib.AsyncExitStack() as waiting:
        sub = None
        if wait > 0:
            # Before the calls exist, so that no news of them can come before it: the wait
            # need not read them before it first sleeps.
            watched = (f"i:{i}" for i in new_ids)
            sub = await waiting.enter_async_context(hub.subscribe(watched, handovers=True))
        try:
            async with pool.acquire() as conn, hub.holding(conn.get_server_pid()):
                async with conn.transaction():
                    made = await db.insert_calls(
                        conn,
                        owner,
                        calls,
                        None if key is None else (key, request_hash),
                        new_ids,
                        map_id=None if req.map_id is None else valid_id(req.map_id),
                        storage_limit=config.user_storage_bytes,
                        adding_bytes=sum(c.payload_size for c in calls if c.payload_file),
                        place_within=config.node_timeout_s if config.place_at_submit else None,
                    )
                    nodes, handed = await place(request, conn, caller, calls, made)
                wake_nodes(hub, conn.get_server_pid(), nodes, handed)
        except db.NoRoom as exc:
            raise no_room_for_calls(request, exc.blobs, exc.shared) from None
        except db.KeyTaken:  # a concurrent duplicate committed first
            assert key is not None
            earlier = await idempotency.earlier(request, owner, key, request_hash)
            assert earlier is not None
            return await _submitted(request, owner, earlier, wait, replayed=True)
        # Calls that existed before (a retry) may have news already: those are read first.
        made_here = made.ids == new_ids
        unread = sub if made_here else None
        return await _submitted(request, owner, made.ids, wait, unread=unread, made_here=made_here)


async def place(
    request: Request,
    conn: asyncpg.Connection,
    caller: db.Principal,
    calls: list[wire.CallSpec],
    made: db.Submitted,
) -> tuple[set[int], dict[int, db.Handed]]:
    """Place the calls the submission created at once if the cluster has room and nothing
    else waits (``scheduling.place_at_once``), else wake the leader to plan them. Returns
    the nodes given work, and the work of those whose poll waits on this gateway."""
    config: GatewayConfig = request.app.state.config
    hub = request.app.state.hub
    fresh = [
        Pending(
            invocation_id,
            wire.split_gpus(call.gpus)[0],
            user=caller.name,
            group=caller.group,
            function=call.function_name,
            gpu_model=call.gpu_model,
            min_memory_mib=call.gpu_memory_mb or 0,
            priority=call.priority,
            submit_time=made.fresh[invocation_id],
            expected_s=call.expected_s if call.expected_s is not None else call.timeout_s,
            share=wire.split_gpus(call.gpus)[1],
        )
        for invocation_id, call in zip(made.ids, calls, strict=True)
        if invocation_id in made.fresh
    ]
    placed, handed = await scheduling.place_at_once(
        conn, config, fresh, made.nodes, lambda node: hub.awaits_handover(f"n:{node}")
    )
    if len(placed) < len(fresh):
        await db.wake_scheduler(conn)
    return {node for _, node in placed}, handed


def wake_nodes(hub: Hub, pid: int, nodes: set[int], handed: dict[int, db.Handed]) -> None:
    """Once the transaction that gave ``nodes`` work (``place``) committed on backend
    ``pid``: wake them, their polls waiting here taking the work ``handed`` over."""
    work = {f"n:{node}": given for node, given in handed.items()}
    hub.woke(pid, [f"n:{node}" for node in nodes], work)


async def _submitted(
    request: Request,
    owner: int,
    ids: list[str],
    wait: float,
    *,
    replayed: bool = False,
    unread: Subscription | None = None,
    made_here: bool = False,
) -> Response:
    """The ids; with ``wait``, also the news of the calls (finished ones with their results,
    log chunks) once there is any or ``wait`` seconds have passed, as a watch answers.
    ``unread``: the calls were just made, under this subscription to their news.
    ``made_here``: every one of them was made by this request's own commit (else some are
    an earlier request's, which may not be on disk yet)."""
    keepalive_s = request.app.state.config.caller_keepalive_s
    answer = wire.SubmitResponse(ids=ids, keepalive_s=keepalive_s)
    if wait > 0:
        try:
            found = await news(request, owner, dict.fromkeys(ids, 0), wait, unread=unread)
        except GatewayStopping:
            pass  # the calls exist: the caller watches them elsewhere
        else:
            answer = msgspec.structs.replace(answer, invocations=found.invocations, logs=found.logs)
    if wait > 0 or not made_here:
        await durable(request, ids, answer.invocations)
    response = reply(answer, 201)
    if replayed:
        response.headers.update(idempotency.REPLAYED)
    return response


async def durable(request: Request, ids: list[str], answered: list[wire.Invocation]) -> None:
    """Before answering with the ids of calls that may have been committed without waiting
    for the WAL flush (those of a request that waits; an earlier request's, replayed for an
    idempotency key, which may still be waiting): unless the answer gives every one of them
    terminal, which only a later, durable commit can have made them (a completion, a
    cancellation, an expiry: its flush took the submission's WAL with it), wait until they
    are on disk. A database crash before then loses calls nobody was told of: the caller's
    retry submits them again."""
    terminal = {i.id for i in answered if i.state.terminal}
    if not terminal.issuperset(ids):
        await db.make_durable(request.app.state.pool)


async def check_fits(request: Request, group: str, calls: list[wire.CallSpec]) -> None:
    """Reject a call no node could ever run, rather than queueing it for ever: more GPUs than
    the owner's group may ever hold (under a policy with quotas), GPU models or memory no
    node has, or more GPUs than one node has that it may use (a call runs on one node).
    While no node has registered yet, calls wait."""
    distinct = {(c.gpus, c.gpu_model, c.gpu_memory_mb) for c in calls if c.gpus > 0}
    if not distinct:
        return
    pool, config = request.app.state.pool, request.app.state.config
    nodes = [scheduling.node_capacity(n) for n in await db.registered_nodes(pool)]
    quotas = {}
    if config.policy().uses_quotas:
        groups = await db.groups(pool)
        quotas = {g.name: scheduling.group_quota(g) for g in groups}
    for amount, model, memory in sorted(distinct, key=lambda d: -d[0]):
        gpus, share = wire.split_gpus(amount)
        call = Pending("new", gpus, group=group, gpu_model=model, min_memory_mib=memory or 0,
                       share=share)  # fmt: skip
        reason = never_fits(call, nodes, quotas)
        largest = placement.largest_for(nodes, call)
        if reason is None and nodes and gpus > largest:
            reason = (
                f"needs {gpus} GPUs on one node, and the largest node here has {largest} it "
                "may use; a call runs on one node: ask for fewer GPUs, or spread the work "
                "over several calls"
            )
        if reason is not None:
            raise Unprocessable(reason, code="never_fits")


class _InvocationSegment(Convertor[str]):
    """An invocation id in a path: any segment but the names of the routes beside it."""

    regex = "(?!(?:watch|cancel)$)[^/]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("invocation", _InvocationSegment())


#: An id as the gateway writes them: already canonical, nothing to parse (a map's watch
#: names hundreds at each poll).
_CANONICAL_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def valid_id(value: str) -> str:
    """``value`` as the canonical form of the uuid it spells; NotFound if it spells none."""
    if _CANONICAL_ID.fullmatch(value):
        return value
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise NotFound(f"no invocation or blob with id {value!r}") from None


async def _one(request: Request, owner: int | None, invocation_id: str) -> wire.Invocation:
    """The invocation, if ``owner`` owns it (None: anyone's, for administrators)."""
    found = await db.get_invocations(request.app.state.pool, owner, [valid_id(invocation_id)])
    if not found:
        raise NotFound(f"no invocation {invocation_id} (ids are per user)")
    return found[0]


async def reader(request: Request) -> tuple[int, int | None]:
    """The caller's user id, and whose invocations they may read: their own (their id), or
    anyone's (None) for an administrator."""
    caller = await auth.principal(request, "user")
    assert caller.user_id is not None
    return caller.user_id, None if caller.is_admin else caller.user_id


async def get_invocation(request: Request) -> Response:
    user, owner = await reader(request)
    found = await _one(request, owner, request.path_params["id"])
    [found] = await fetched(request, user, [found])
    return reply(found)


async def get_result(request: Request) -> Response:
    """The pickled outcome of a terminal invocation, wherever it is kept (inline, a blob, a
    file of the shared directory), as ``application/octet-stream``: for a JSON invocation
    whose result is not JSON, load it with ``sdk.Call.from_id(id).result()``."""
    _, owner = await reader(request)
    found = await _one(request, owner, request.path_params["id"])
    if not found.state.terminal:
        raise Conflict(
            f"invocation {found.id} is {found.state}: it has no result yet; poll "
            f"GET /v1/invocations/{found.id} until it is terminal",
            code="not_finished",
        )
    pool = request.app.state.pool
    if found.result is not None:
        return Response(found.result, media_type=wire.OCTET_STREAM)
    if found.result_blob is not None:
        size = await db.blob_size(pool, found.result_blob, None)
        if size is not None:
            return stream_blob(pool, found.result_blob, size)
    root = request.app.state.config.shared_dir
    if found.result_file is not None and root:
        return stream_file(await _shared_result(root, found))
    raise NotFound(
        f"invocation {found.id} has no result to fetch (it ended {found.state} without one, "
        "or its result was purged)",
        code="no_result",
    )


async def _shared_result(root: str, found: wire.Invocation) -> BinaryIO:
    """The result file of ``found`` in the shared directory, opened as the gateway may: a
    regular file of its user directory's owner, never through a link."""
    assert found.result_file is not None
    try:
        return await asyncio.to_thread(shared.open_file, root, found.result_file)
    except FileNotFoundError:
        raise NotFound(
            f"invocation {found.id}'s result file {found.result_file} is gone from the shared "
            "directory: it is deleted once its caller loaded it, and swept after shared_ttl_s",
            code="no_result",
        ) from None
    except PermissionError:
        # A user's directory is their account's alone (0700): a gateway running as a
        # service account cannot read it, only its owner can.
        raise Conflict(
            f"invocation {found.id}'s result is the file {root}/{found.result_file} of the "
            "cluster's shared directory, which only its owner's account can read: load it on "
            "a machine that mounts the shared directory, as that account "
            f"(sdk.Call.from_id({found.id!r}).result())",
            code="result_in_shared_dir",
        ) from None
    except (OSError, ValueError) as exc:  # UnsafeSharedDir: a link, another's file...
        raise NotFound(
            f"invocation {found.id}'s result file cannot be served: {exc}", code="no_result"
        ) from None


async def fetched(
    request: Request, user: int, found: list[wire.Invocation]
) -> list[wire.Invocation]:
    """Stamp the first fetch by their owner (``user``) of terminal invocations on their
    timeline."""
    fresh = [i.id for i in found if i.state.terminal and i.timeline.fetched is None]
    if not fresh:
        return found
    stamped = await db.mark_fetched(request.app.state.relaxed, user, fresh)
    return [
        msgspec.structs.replace(
            i, timeline=msgspec.structs.replace(i.timeline, fetched=stamped[i.id])
        )
        if i.id in stamped
        else i
        for i in found
    ]


async def list_invocations(request: Request) -> Response:
    caller = await auth.principal(request, "user")
    assert caller.user_id is not None
    limit = int_param(request, "limit", 100)
    if not 1 <= limit <= 1000:
        raise Unprocessable("limit must be between 1 and 1000")
    owner, pool = caller.user_id, request.app.state.pool
    name = request.query_params.get("owner")
    if name is not None and name != caller.name:
        if not caller.is_admin:
            raise Forbidden(
                "only administrators list other users' invocations; leave out owner= to list yours",
                code="not_admin",
            )
        found = await db.find_user(pool, name) if "\x00" not in name else None
        if found is None:
            raise NotFound(f"no user {name!r}")
        owner = found
    return reply(await db.list_invocations(pool, owner, limit))


async def cancel(request: Request) -> Response:
    owner = await auth.user_id(request)
    invocation_id = valid_id(request.path_params["id"])
    async with request.app.state.pool.acquire() as conn:
        await db.cancel(conn, owner, [invocation_id])
    return reply(await _one(request, owner, invocation_id))  # 404 if not the caller's


async def cancel_many(request: Request) -> Response:
    owner = await auth.user_id(request)
    req = await body(request, wire.CancelRequest)
    async with request.app.state.pool.acquire() as conn:
        cancelled = await db.cancel(conn, owner, [valid_id(i) for i in req.ids])
    return reply(wire.CancelResponse(cancelled=cancelled))


async def watch(request: Request) -> Response:
    """Long-poll: answer at once if any watched call is terminal or has unseen logs."""
    owner = await auth.user_id(request)
    req = await body(request, wire.WatchRequest)
    seen = {valid_id(i.id): i.log_after for i in req.items}
    try:
        return reply(await news(request, owner, seen, req.timeout_s, strict=True))
    except db.NotOwned as exc:
        raise NotFound(f"no invocation {exc.args[0]} (ids are per user)") from None


async def news(
    request: Request,
    owner: int,
    seen: dict[str, int],
    hold_s: float,
    *,
    unread: Subscription | None = None,
    strict: bool = False,
) -> wire.WatchResponse:
    """Wait (at most ``hold_s``, capped by ``long_poll_s``) until one of the owner's
    invocations in ``seen`` (id: log chunks seen) is terminal or has unseen log chunks;
    then those, with their results and new chunks (or nothing, when the hold ran out).
    ``unread``: a subscription to their news taken before they were made, so there is none
    to read before the first wait. ``strict``: ``db.NotOwned`` for an id in ``seen`` that
    is not the owner's (checked by the first read)."""
    deadline = time.monotonic() + min(max(hold_s, 0.0), request.app.state.config.long_poll_s)
    if unread is not None:
        found = await _news(request, owner, seen, deadline, unread, read_first=False)
    else:
        watched = (f"i:{i}" for i in seen)
        async with request.app.state.hub.subscribe(watched, handovers=True) as sub:
            found = await _news(
                request, owner, seen, deadline, sub, read_first=True, strict=strict
            )
    found = _within_answer_size(found)
    with_logs = [(f.id, seen[f.id]) for f in found if f.log_count > seen[f.id]]
    pool = request.app.state.pool
    logs = await db.logs_after(pool, with_logs, MAX_LOG_CHUNKS) if with_logs else []
    return wire.WatchResponse(invocations=found, logs=logs)


async def _news(
    request: Request,
    owner: int,
    seen: dict[str, int],
    deadline: float,
    sub: Subscription,
    *,
    read_first: bool,
    strict: bool = False,
) -> list[wire.Invocation]:
    config = request.app.state.config
    every = list(seen.items())
    cursors = every
    found: list[wire.Invocation] = []
    while True:
        if read_first and cursors:
            # The first fetch of a finished call is stamped as it is read (a stamp a database
            # crash loses costs nothing: the relaxed pool). One that does not fit this answer
            # (_within_answer_size) comes with the next, stamped a little early.
            relaxed = request.app.state.relaxed
            found += await db.changed_fetched(relaxed, owner, cursors, strict=strict)
        read_first, strict = True, False
        remaining = deadline - time.monotonic()
        if found or remaining <= 0:
            return found
        woken = await sub.wait(min(remaining, config.recheck_s))
        if woken and len(every) > 1:
            # Fan-out: let a few more completions land so one answer carries many.
            await asyncio.sleep(FAN_IN_LINGER_S)
        # Woken: re-read only the calls whose notifications came (a map watches up to
        # MAX_WATCH, and reading them all at every completion costs more than the rest of
        # the map), but those whose completion this gateway committed and handed over,
        # finished, fetched stamp and all (Hub.woke). The timer's recheck, or a wake for
        # everything, re-reads them all.
        fired = sub.take_fired() if woken else None
        handed = sub.take_handed()
        found = [handed[f"i:{i}"] for i in seen if f"i:{i}" in handed]
        if fired is None:
            cursors = [(i, n) for i, n in every if f"i:{i}" not in handed]
        else:
            cursors = [(i, seen[i]) for i in seen if f"i:{i}" in fired and f"i:{i}" not in handed]


def _within_answer_size(found: list[wire.Invocation]) -> list[wire.Invocation]:
    """As many as fit in one answer's result budget (at least one): when a map's calls all
    finish at once, the rest come with the next watch instead of one huge answer."""
    kept: list[wire.Invocation] = []
    size = 0
    for invocation in found:
        size += len(invocation.result or b"")
        if isinstance(invocation.result_json, msgspec.Raw):
            size += len(invocation.result_json)
        if kept and size > MAX_ANSWER_RESULT_BYTES:
            break
        kept.append(invocation)
    return kept


async def keep_alive(request: Request) -> Response:
    """The caller session is still waiting for its calls (CallSpec.caller_session)."""
    owner = await auth.user_id(request)
    session = valid_id(request.path_params["id"])
    if not await db.keep_alive(request.app.state.relaxed, owner, session):
        raise NotFound(
            f"no caller session {session} of yours: a session is made by submitting calls "
            "that name it (CallSpec.caller_session)",
            code="no_session",
        )
    return Response(status_code=204)


async def put_blob(request: Request) -> Response:
    owner = await auth.user_id(request)
    return reply(await store_blob(request, owner, by_user=True), 201)


async def get_blob(request: Request) -> Response:
    owner = await auth.user_id(request)
    blob_id = valid_id(request.path_params["id"])
    pool = request.app.state.pool
    size = await db.blob_size(pool, blob_id, owner)
    if size is None:
        raise NotFound(f"no blob {blob_id} (blobs are per user)")
    return stream_blob(pool, blob_id, size)


ROUTES = [
    Route("/v1/invocations", submit, methods=["POST"]),
    Route("/v1/invocations", list_invocations, methods=["GET"]),
    Route("/v1/invocations/watch", watch, methods=["POST"]),
    Route("/v1/invocations/cancel", cancel_many, methods=["POST"]),
    # Not "watch" or "cancel": those name the POST routes above (a GET of them is a 405).
    Route("/v1/invocations/{id:invocation}", get_invocation, methods=["GET"]),
    Route("/v1/invocations/{id}/result", get_result, methods=["GET"]),
    Route("/v1/invocations/{id}/cancel", cancel, methods=["POST"]),
    Route("/v1/sessions/{id}/keepalive", keep_alive, methods=["POST"]),
    Route("/v1/blobs", put_blob, methods=["PUT"]),
    Route("/v1/blobs/{id}", get_blob, methods=["GET"]),
]
