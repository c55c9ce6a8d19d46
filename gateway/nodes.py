"""Node routes: the nodelet's side. A node token works only here, and only for work leased
to its own node; every write is fenced by ``(invocation_id, epoch)`` (409 when stale)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bulletin_core import shared, wire
from gateway import auth, db
from gateway.errors import Conflict, NotFound, Unprocessable
from gateway.http import body, int_param, reply, store_blob, stream_blob
from gateway.invocations import valid_id
from scheduler import chunk_size

log = logging.getLogger(__name__)

STALE = (
    "this attempt is not leased to your node at this epoch (cancelled, expired, reassigned, "
    "finished, or another node's)"
)


def _stale(invocation_id: str) -> Conflict:
    return Conflict(f"invocation {invocation_id}: {STALE}; discard its result", code="stale_epoch")


async def register(request: Request) -> Response:
    node = await auth.principal(request, "node")
    req = await body(request, wire.RegisterRequest)
    if req.protocol_version < wire.MIN_PROTOCOL_VERSION:
        raise Unprocessable(
            f"nodelet protocol {req.protocol_version} is too old; this gateway needs "
            f"{wire.MIN_PROTOCOL_VERSION}..{wire.PROTOCOL_VERSION}: upgrade the nodelet"
        )
    if req.name != node.name:
        raise Conflict(f"this token belongs to node {node.name!r}, not {req.name!r}")
    assert node.node_id is not None
    async with request.app.state.pool.acquire() as conn:
        incarnation, taken = await db.register_node(
            conn, node.node_id, req.gpus, req.cpu_slots, req.protocol_version
        )
    if taken:
        log.warning(
            "node %s registered again (incarnation %d): took back what it held before: %s",
            node.name,
            incarnation,
            ", ".join(f"{i}->{state}" for i, state in taken),
        )
    config = request.app.state.config
    return reply(
        wire.RegisterResponse(
            node_id=node.node_id,
            incarnation=incarnation,
            lease_s=config.lease_s,
            heartbeat_s=config.heartbeat_s,
            long_poll_s=config.long_poll_s,
            inline_limit=config.inline_limit,
            shared_dir=config.shared_dir or None,
            shared_dir_id=request.app.state.shared_dir_id,
        )
    )


async def leave(request: Request) -> Response:
    node = await auth.node(request)
    assert node.node_id is not None
    await db.leave(request.app.state.pool, node.node_id, node.incarnation)
    return Response(status_code=204)


async def heartbeat(request: Request) -> Response:
    node = await auth.node(request)
    assert node.node_id is not None
    req = await body(request, wire.HeartbeatRequest)
    lease_s = request.app.state.config.lease_s
    async with request.app.state.relaxed.acquire() as conn:
        orders, drain = await db.heartbeat(
            conn, node.node_id, node.incarnation, req.running, lease_s, req.gpu_health, req.warm
        )
    return reply(
        wire.HeartbeatResponse(
            revoked=orders.revoked,
            lease_s=lease_s,
            draining=drain.draining,
            drain_reason=drain.reason,
            preempt=_preemptions(request, orders.preempt),
        )
    )


def _preemptions(
    request: Request,
    orders: list[tuple[wire.Attempt, str]],
    known: Sequence[wire.Attempt] = (),
) -> list[wire.Preemption]:
    """Preemption orders for the node, with the configured grace; ``known``: the attempts
    it already preempts (not news)."""
    grace_s = request.app.state.config.preemption_grace_s
    return [
        wire.Preemption(
            invocation_id=a.invocation_id, epoch=a.epoch, grace_s=grace_s, reason=reason
        )
        for a, reason in orders
        if a not in known
    ]


async def poll(request: Request) -> Response:
    """Long-poll for new assignments and revocations of this node."""
    node = await auth.node(request)
    node_id, incarnation = node.node_id, node.incarnation
    assert node_id is not None
    req = await body(request, wire.PollRequest)
    config, relaxed = request.app.state.config, request.app.state.relaxed
    deadline = time.monotonic() + min(max(req.timeout_s, 0.0), config.long_poll_s)
    key, hub = f"n:{node_id}", request.app.state.hub
    running = [a.invocation_id for a in req.running]
    async with hub.subscribe([key], handovers=True) as sub:
        handed: db.Handed | None = None
        mark = hub.mark(key)
        # Answered here a moment ago, nothing has changed since (Polls): wait at once.
        unchanged = hub.polls.unchanged(node_id, incarnation, mark, running)
        while True:
            if handed is not None and handed.incarnation == incarnation:
                # Work a submission committed on this gateway handed over as all the news:
                # delivered as it committed (stamped so), nothing else changed meanwhile.
                orders, work = db.StopOrders([], []), handed.work
            elif unchanged:
                orders, work = db.StopOrders([], []), []
            else:
                mark = hub.mark(key)  # before the read: a change after it wakes this poll
                orders, work = await db.poll(
                    relaxed, node_id, incarnation, req.running, config.inline_limit, config.lease_s
                )
            unchanged = False
            preempt = _preemptions(request, orders.preempt, req.preempting)
            remaining = deadline - time.monotonic()
            if work or orders.revoked or preempt or remaining <= 0:
                hub.polls.answered(node_id, incarnation, mark, [a.invocation_id for a in work])
                return reply(
                    wire.PollResponse(assignments=work, revoked=orders.revoked, preempt=preempt)
                )
            await sub.wait(min(remaining, config.recheck_s))
            handed = sub.take_handed().get(key)
            mark = hub.mark(key)  # a handover comes with its own wake


async def start(request: Request) -> Response:
    node_id = await auth.node_id(request)
    invocation_id = valid_id(request.path_params["id"])
    req = await body(request, wire.StartRequest)
    if not await db.start(request.app.state.relaxed, node_id, invocation_id, req.epoch):
        raise _stale(invocation_id)
    return Response(status_code=204)


async def release(request: Request) -> Response:
    node_id = await auth.node_id(request)
    invocation_id = valid_id(request.path_params["id"])
    req = await body(request, wire.ReleaseRequest)
    async with request.app.state.pool.acquire() as conn:
        if not await db.release(conn, node_id, invocation_id, req.epoch):
            raise _stale(invocation_id)
    return Response(status_code=204)


async def payload(request: Request) -> Response:
    node_id = await auth.node_id(request)
    invocation_id = valid_id(request.path_params["id"])
    epoch = int_param(request, "epoch")
    pool = request.app.state.pool
    source = await db.payload_source(pool, node_id, invocation_id, epoch)
    if source is None:
        raise _stale(invocation_id)
    if source.file is not None:
        raise NotFound(
            f"the payload of invocation {invocation_id} is the file {source.file} of the "
            "shared directory (Assignment.payload_file): read it there",
            code="payload_is_a_file",
        )
    if source.blob is None:
        return Response(source.inline or b"", media_type=wire.OCTET_STREAM)
    return stream_blob(pool, source.blob, source.size)


async def logs(request: Request) -> Response:
    node_id = await auth.node_id(request)
    invocation_id = valid_id(request.path_params["id"])
    req = await body(request, wire.LogsRequest)
    async with request.app.state.relaxed.acquire() as conn:
        if not await db.append_logs(conn, node_id, invocation_id, req):
            raise _stale(invocation_id)
    return Response(status_code=204)


async def put_result(request: Request) -> Response:
    node_id = await auth.node_id(request)
    invocation_id = valid_id(request.path_params["id"])
    epoch = int_param(request, "epoch")
    owner = await db.attempt_owner(request.app.state.pool, node_id, invocation_id, epoch)
    if owner is None:
        raise _stale(invocation_id)
    # The result blob belongs to the call's owner, who alone may download it.
    return reply(await store_blob(request, owner.id), 201)


async def complete(request: Request) -> Response:
    node_id = await auth.node_id(request)
    invocation_id = valid_id(request.path_params["id"])
    req = await body(request, wire.CompleteRequest)
    _check_result(request, req)
    if req.result_file is not None:
        await _check_result_file(request, node_id, invocation_id, req)
    hub = request.app.state.hub
    key = f"i:{invocation_id}"
    handed = [invocation_id] if hub.awaits_handover(key) else []
    outcome = [(invocation_id, req)]
    async with request.app.state.pool.acquire() as conn, hub.holding(conn.get_server_pid()):
        if req.logs:  # its last output first, in the same transaction
            logs = wire.LogsRequest(epoch=req.epoch, first_seq=req.logs_first_seq, chunks=req.logs)
            async with conn.transaction():
                taken = {}
                if await db.append_logs_in(conn, node_id, invocation_id, logs):
                    taken = await db.complete(conn, node_id, outcome, handed)
                    if not taken:
                        raise _stale(invocation_id)  # rolls the chunks back with it
        else:
            taken = await db.complete(conn, node_id, outcome, handed)
        if not taken:
            raise _stale(invocation_id)
        # Committed: its caller, waiting here, has its result now.
        hub.woke(conn.get_server_pid(), [key], {key: taken[invocation_id]})
    if handed:
        await asyncio.sleep(0)  # the caller's answer goes out before the node's
    return Response(status_code=204)


async def complete_many(request: Request) -> Response:
    """Commit many attempts' outcomes in one transaction, and give the node the next items
    of the maps whose items it completed (``db.top_up``)."""
    node = await auth.node(request)
    node_id = node.node_id
    assert node_id is not None
    req = await body(request, wire.CompleteManyRequest)
    ids = [valid_id(c.invocation_id) for c in req.completions]
    if len(set(ids)) != len(ids):
        raise Unprocessable("two completions name the same invocation")
    for completion in req.completions:
        _check_result(request, completion)
        if completion.result_file is not None:
            await _check_result_file(request, node_id, completion.invocation_id, completion)
    config, hub = request.app.state.config, request.app.state.hub
    outcomes = list(zip(ids, req.completions, strict=True))
    handed = [i for i in ids if hub.awaits_handover(f"i:{i}")]
    async with request.app.state.pool.acquire() as conn, hub.holding(conn.get_server_pid()):
        async with conn.transaction():
            # The node's row first, as a scheduling round locks it: no lock-order deadlock.
            open_ = await db.lock_node_for_work(conn, node_id, node.incarnation)
            for invocation_id, c in outcomes:
                if c.logs:  # its last output first (nothing if the attempt is stale)
                    first = c.logs_first_seq
                    logs = wire.LogsRequest(epoch=c.epoch, first_seq=first, chunks=c.logs)
                    await db.append_logs_in(conn, node_id, invocation_id, logs)
            completed = await db.complete_in(conn, node_id, outcomes, handed)
            assignments: list[wire.Assignment] = []
            if open_ and req.take_more:
                by_id = dict(outcomes)
                wants = {
                    c.lease: (c.id, chunk_size(c.gpus, _seconds(by_id[c.id]), c.max_retries))
                    for c in completed
                    if c.mapped
                }
                assignments = await db.top_up(
                    conn,
                    node_id,
                    wants,
                    lease_s=config.lease_s,
                    inline_limit=config.inline_limit,
                    late_s=config.caller_late_s,
                )
            await db.wake_if_freed(conn, node_id, sorted({c.lease for c in completed}))
            done = {c.id for c in completed}
        # Committed: their callers, waiting here, have their results now.
        news = {f"i:{c.id}": c.invocation for c in completed}
        hub.woke(conn.get_server_pid(), news, news)
    return reply(
        wire.CompleteManyResponse(
            done=[i for i in ids if i in done],
            stale=[i for i in ids if i not in done],
            assignments=assignments,
        )
    )


def _seconds(req: wire.CompleteRequest) -> float | None:
    """How long the attempt held its slot for its call, by the node's clock."""
    began = req.worker_acquired if req.worker_acquired is not None else req.started
    if began is None or req.finished is None:
        return None
    return max(0.0, req.finished - began)


def _check_result(request: Request, req: wire.CompleteRequest) -> None:
    given = [r for r in (req.result, req.result_blob, req.result_file) if r is not None]
    if len(given) > 1:
        raise Unprocessable("give at most one of result, result_blob and result_file")
    if req.result_json is not None:
        # Served as is inside every answer about the invocation: it must be JSON.
        if len(req.result_json) > request.app.state.config.inline_limit:
            raise Unprocessable("result_json is over the inline limit")
        try:
            msgspec.json.decode(req.result_json)
        except (msgspec.DecodeError, RecursionError):
            raise Unprocessable("result_json is not valid JSON (or nested too deeply)") from None


async def _check_result_file(
    request: Request, node_id: int, invocation_id: str, req: wire.CompleteRequest
) -> None:
    """A result file is accepted only under the one name derived from the invocation, its
    owner and the epoch: in the owner's own directory, which no one else can write to. So
    a call cannot pass off another user's file as its result."""
    if not request.app.state.config.shared_dir:
        raise Unprocessable("result_file: this cluster has no shared directory")
    owner = await db.attempt_owner(request.app.state.pool, node_id, invocation_id, req.epoch)
    if owner is None:
        raise _stale(invocation_id)
    try:
        expected = shared.result_name(owner.name, invocation_id, req.epoch)
    except ValueError as exc:
        raise Unprocessable(f"result_file: {exc}") from None
    if req.result_file != expected:
        raise Unprocessable(
            f"result_file {req.result_file} is not this attempt's: its result file can only "
            f"be {expected}",
            code="result_file_not_bound",
        )


ROUTES = [
    Route("/v1/node/register", register, methods=["POST"]),
    Route("/v1/node/leave", leave, methods=["POST"]),
    Route("/v1/node/heartbeat", heartbeat, methods=["POST"]),
    Route("/v1/node/poll", poll, methods=["POST"]),
    Route("/v1/node/invocations/{id}/start", start, methods=["POST"]),
    Route("/v1/node/invocations/{id}/release", release, methods=["POST"]),
    Route("/v1/node/invocations/{id}/payload", payload, methods=["GET"]),
    Route("/v1/node/invocations/{id}/logs", logs, methods=["POST"]),
    Route("/v1/node/invocations/{id}/result", put_result, methods=["PUT"]),
    Route("/v1/node/invocations/{id}/complete", complete, methods=["POST"]),
    Route("/v1/node/complete", complete_many, methods=["POST"]),
]
