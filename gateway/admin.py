"""Admin routes: groups and their quotas (per GPU model too), users' groups, and usage. An
administrator's user token only (403 for others); the same operations exist as ``bulletin``
commands that talk to the database directly."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bulletin_core import wire
from gateway import auth, db
from gateway.errors import NotFound, Unprocessable
from gateway.http import body, checked, int_param, reply
from scheduler.quotas import case_clash

#: The longest usage period one request may ask for, in days.
MAX_USAGE_DAYS = 3660


def _group(row: db.GroupRow) -> wire.Group:
    return wire.Group(
        name=row.name,
        guaranteed_gpus=row.guaranteed_gpus,
        borrow_limit_gpus=row.borrow_limit_gpus,
        users=row.users,
        models={
            m.model: wire.ModelQuota(
                guaranteed_gpus=m.guaranteed_gpus, borrow_limit_gpus=m.borrow_limit_gpus
            )
            for m in row.models
        },
    )


def _group_name(request: Request) -> str:
    return checked("name", request.path_params["name"], wire.GroupName, wire.SLUG_RULE)


async def list_groups(request: Request) -> Response:
    await auth.admin(request)
    return reply([_group(g) for g in await db.groups(request.app.state.pool)])


async def put_group(request: Request) -> Response:
    await auth.admin(request)
    name = _group_name(request)
    quota = await body(request, wire.GroupQuota)
    models = None
    if quota.models is not None:
        models = [
            db.ModelQuotaRow(model, q.guaranteed_gpus, q.borrow_limit_gpus)
            for model, q in sorted(quota.models.items())
        ]
        clash = case_clash([m.model for m in models])
        if clash:
            raise Unprocessable(clash)
    async with request.app.state.pool.acquire() as conn:
        row = await db.set_group(
            conn, name, quota.guaranteed_gpus, quota.borrow_limit_gpus, models
        )
    return reply(_group(row))



async def put_user_group(request: Request) -> Response:
    await auth.admin(request)
    user = checked("name", request.path_params["name"], wire.Name, "not a user name")
    req = await body(request, wire.UserGroup)
    pool = request.app.state.pool
    if not await db.group_exists(pool, req.group):
        raise Unprocessable(
            f"no group {req.group!r}: create it first (PUT /v1/admin/groups/{req.group})"
        )
    if not await db.set_user_group(pool, user, req.group):
        raise NotFound(f"no user {user!r}")
    return Response(status_code=204)


async def usage(request: Request) -> Response:
    await auth.admin(request)
    days = int_param(request, "days", default=30)
    if not 1 <= days <= MAX_USAGE_DAYS:
        raise Unprocessable(f"days must be between 1 and {MAX_USAGE_DAYS}, got {days}")
    rows = await db.usage(request.app.state.pool, days)
    return reply(
        [
            wire.UsageEntry(user=r.user, group=r.group, gpu_seconds=r.gpu_seconds, calls=r.calls)
            for r in rows
        ]
    )


ROUTES = [
    Route("/v1/admin/groups", list_groups, methods=["GET"]),
    Route("/v1/admin/groups/{name}", put_group, methods=["PUT"]),
    Route("/v1/admin/users/{name}/group", put_user_group, methods=["PUT"]),
    Route("/v1/admin/usage", usage, methods=["GET"]),
]
