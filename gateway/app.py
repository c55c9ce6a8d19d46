"""The gateway's ASGI application: routes, error mapping, and the lifespan that owns the
database pool, the notification hub and the scheduler loop (``gateway/server.py`` serves it)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from importlib import resources

import asyncpg
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import (
    admin,
    auth,
    cluster,
    db,
    functions,
    invocations,
    logs,
    nodes,
    retention,
    scheduling,
)
from gateway.config import GatewayConfig
from gateway.errors import HANDLERS
from gateway.expiry import Outages
from gateway.hosts import AllowedHosts
from gateway.notify import Hub

log = logging.getLogger(__name__)
#: How long opening a database connection may take before the request answers 503
#: db_unavailable (asyncpg's default is 60 s: a node's heartbeat gives up long before).
CONNECT_TIMEOUT_S = 5.0


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def openapi(request: Request) -> Response:
    await auth.principal(request, "user")
    text = resources.files("gateway").joinpath("openapi.yaml").read_text()
    return Response(text, media_type="application/yaml")


async def _keep_session(conn: asyncpg.Connection) -> None:
    """What a pooled connection needs between uses beyond asyncpg's own rollback of an open
    transaction: nothing. asyncpg's default reset (unlock advisory locks, CLOSE ALL, UNLISTEN,
    RESET ALL) is one more round trip per use; the pools' users set no session state (advisory
    locks are transaction-scoped, LISTEN and the leader lock have connections of their own)."""


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    config: GatewayConfig = app.state.config
    # First, so that a shared directory that is not there stops the gateway at once.
    app.state.shared_dir_id = await cluster.prepare(config)
    pool = await asyncpg.create_pool(
        config.database_url,
        min_size=2,
        max_size=config.pool_size,
        timeout=CONNECT_TIMEOUT_S,
        reset=_keep_session,
    )
    # Commits on this pool do not wait for their WAL flush (a few ms of fsync per commit, on
    # the path of every call). Only for writes a database crash may lose without harm: node
    # writes (delivery and start stamps: a call still completes from 'assigned'; lease
    # renewals: the next heartbeat renews again; log chunks), and the submissions (with
    # their placement) of requests that wait for their result, whose answer is made
    # durable before it is sent (invocations.durable; a node running a call whose
    # assignment a crash lost has it revoked at its next poll, and starts nothing else on
    # its GPUs meanwhile). Other submissions, cancellations and results always use the
    # durable pool.
    relaxed = await asyncpg.create_pool(
        config.database_url,
        min_size=1,
        max_size=config.pool_size,
        server_settings={"synchronous_commit": "off"},
        timeout=CONNECT_TIMEOUT_S,
        reset=_keep_session,
    )
    async with pool.acquire() as conn:
        applied = await db.migrate(conn)
    if applied:
        log.info("applied migrations: %s", ", ".join(applied))
    hub = Hub(config.database_url)
    app.state.pool, app.state.relaxed, app.state.hub = pool, relaxed, hub
    tokens: auth.TokenCache = app.state.tokens
    outages = app.state.outages
    tasks = {
        "notify-hub": asyncio.create_task(hub.run(), name="notify-hub"),
        "token-cache": asyncio.create_task(tokens.follow(hub), name="token-cache"),
        "scheduler": asyncio.create_task(scheduling.run(hub, config, outages), name="scheduler"),
        "purge": asyncio.create_task(retention.purge_forever(config, pool), name="purge"),
    }
    if config.shared_dir:
        tasks["shared-sweep"] = asyncio.create_task(
            cluster.sweep_forever(config, pool), name="shared-sweep"
        )
    try:
        yield
    finally:
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        await asyncio.wait_for(asyncio.gather(pool.close(), relaxed.close()), 10)


def create_app(config: GatewayConfig) -> Starlette:
    # Tried in this order (no two match the same path): the routes every call takes first,
    # the nodes' (a poll and a completion per call) and the submission.
    routes = [
        *nodes.ROUTES,
        *invocations.ROUTES,
        Route("/healthz", healthz),
        Route("/openapi.yaml", openapi),
        *logs.ROUTES,
        *functions.ROUTES,
        *cluster.ROUTES,
        *admin.ROUTES,
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(AllowedHosts, hosts=config.hosts)] if config.hosts else [],
        exception_handlers=HANDLERS,
        lifespan=lifespan,
    )
    app.state.config = config
    app.state.tokens = auth.TokenCache(config.token_cache_s)
    # When this gateway last found its database unavailable (the scheduler holds expiry).
    app.state.outages = Outages()
    return app
