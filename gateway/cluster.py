"""What clients are told of the cluster (``GET /v1/cluster``; a node, ``GET /v1/node/cluster``),
and the upkeep of its shared directory: the gateway makes its layout and id at start
(:func:`bulletin_core.shared.prepare`) and sweeps the payload and result files callers left
behind."""

from __future__ import annotations

import asyncio
import logging

import asyncpg
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bulletin_core import shared, wire
from gateway import auth, db
from gateway.config import GatewayConfig
from gateway.http import reply

log = logging.getLogger(__name__)


async def prepare(config: GatewayConfig) -> str | None:
    """The shared directory's cluster id, after making its layout; None without one."""
    if not config.shared_dir:
        return None
    cluster_id = await asyncio.to_thread(shared.prepare, config.shared_dir)
    log.info("shared directory %s (cluster id %s)", config.shared_dir, cluster_id)
    return cluster_id


async def sweep_forever(config: GatewayConfig, pool: asyncpg.Pool) -> None:
    """Delete payload and result files older than ``shared_ttl_s``, at start and then every
    ``sweep_interval_s``, but not the payload of a call that may still run (queued for
    long, or retried). Several replicas may sweep at once: deleting twice is harmless."""
    while True:
        try:
            keep = frozenset(await db.live_payload_files(pool))
            removed = await asyncio.to_thread(
                shared.sweep, config.shared_dir, config.shared_ttl_s, keep
            )
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:  # next round
            log.warning("could not sweep the shared directory %s: %s", config.shared_dir, exc)
        else:
            if removed:
                log.info("swept %d old files from %s", removed, config.shared_dir)
        await asyncio.sleep(config.sweep_interval_s)


def info(
    request: Request, user: str | None = None, node: str | None = None
) -> wire.ClusterInfo:
    config: GatewayConfig = request.app.state.config
    return wire.ClusterInfo(
        inline_limit=config.inline_limit,
        max_state_bytes=config.max_state_bytes,
        shared_dir=config.shared_dir or None,
        shared_dir_id=request.app.state.shared_dir_id,
        user=user,
        node=node,
        shared_ttl_s=config.shared_ttl_s if config.shared_dir else None,
        keepalive_s=config.caller_keepalive_s,
    )


async def get_cluster(request: Request) -> Response:
    caller = await auth.principal(request, "user")
    return reply(info(request, user=caller.name))


async def get_node_cluster(request: Request) -> Response:
    """The same for a node, naming it: read only, and with no incarnation to name (unlike
    the other node routes), so it may be asked while a nodelet of the node runs
    (``bulletin doctor node``)."""
    caller = await auth.principal(request, "node")
    return reply(info(request, node=caller.name))


ROUTES = [
    Route("/v1/cluster", get_cluster, methods=["GET"]),
    Route("/v1/node/cluster", get_node_cluster, methods=["GET"]),
]
