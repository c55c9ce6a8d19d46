"""The administration commands (``bulletin migrate``, ``db``, ``user``, ``token``, ``group``,
``usage``, ``node``) and ``bulletin replay``: thin click commands over :mod:`bulletin.admin` and
:mod:`scheduler.replay`, each importing what it runs only when it runs. ``bulletin apply`` is
in :mod:`bulletin.apply`."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

import click
import msgspec

if TYPE_CHECKING:
    from gateway import db

database_option = click.option(
    "--database-url",
    envvar="BULLETIN_DATABASE_URL",
    required=True,
    show_envvar=True,
    help="postgresql://user:password@host/db",
)


@click.command()
@database_option
def migrate(database_url: str) -> None:
    """Apply the schema migrations the database lacks."""
    from bulletin import admin

    applied = asyncio.run(admin.migrate(database_url))
    click.echo("applied: " + ", ".join(applied) if applied else "the schema is up to date")


@click.group("db")
def db_group() -> None:
    """Set up Bulletin's database on a PostgreSQL server (production; 'up' does it itself)."""


@db_group.command("setup")
@click.option(
    "--superuser-url",
    envvar="BULLETIN_SUPERUSER_URL",
    required=True,
    show_envvar=True,
    help="A superuser's URL of the server, e.g. postgresql:///postgres?host=/run/postgresql",
)
@click.option("--role", default="bulletin", show_default=True, help="The gateway's role.")
@click.option("--database", default="bulletin", show_default=True, help="Bulletin's database.")
@click.option(
    "--password-file",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The role's password: read from this file if it exists (not world-readable), else "
    "generated and written there, mode 0600.",
)
def db_setup(superuser_url: str, role: str, database: str, password_file: Path) -> None:
    """Make ROLE a plain login role (no superuser, no CREATEDB/CREATEROLE) owning DATABASE;
    print its URL without the password. Idempotent: run it on every deploy."""
    import secrets

    from bulletin import admin
    from bulletin.secretfiles import SecretFileError, read_secret, write_secret

    try:
        if password_file.exists():
            password = read_secret(password_file)
        else:
            password = secrets.token_urlsafe(24)
            write_secret(password_file, password + "\n")
        asyncio.run(admin.ensure_role(superuser_url, role, password, database))
    except (admin.AdminError, SecretFileError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(admin.role_url(superuser_url, role, database))
    click.echo(
        f"role {role} owns database {database}; its password is in {password_file}. The "
        f"gateway's BULLETIN_DATABASE_URL is the URL above with ':PASSWORD' after '{role}'; "
        "it applies the migrations when it starts.",
        err=True,
    )


@click.group()
def user() -> None:
    """Manage users."""


@user.command("add")
@click.argument("name")
@click.option("--admin", "is_admin", is_flag=True, help="Make the user an administrator.")
@click.option(
    "--group",
    default=None,
    help="The user's group, the quota unit (default: 'default'); moves an existing user.",
)
@database_option
def user_add(name: str, is_admin: bool, group: str | None, database_url: str) -> None:
    """Create user NAME (if new) and print a new token for them."""
    from bulletin import admin

    try:
        token = asyncio.run(admin.add_user(database_url, name, is_admin=is_admin, group=group))
    except admin.AdminError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(token)


@user.command("set-group")
@click.argument("name")
@click.argument("group_name", metavar="GROUP")
@database_option
def user_set_group(name: str, group_name: str, database_url: str) -> None:
    """Move user NAME to GROUP (their queued and later calls count against its quota)."""
    from bulletin import admin

    try:
        asyncio.run(admin.set_user_group(database_url, name, group_name))
    except admin.AdminError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"user {name} is in group {group_name}")


@click.group()
def token() -> None:
    """Manage users' tokens: create, list, revoke (only their hashes are stored)."""


@token.command("create")
@click.argument("user_name", metavar="USER")
@click.option("--name", default="", help="A label, shown in 'token list' (e.g. 'laptop').")
@click.option(
    "--expires-in-days",
    type=click.FloatRange(min=0, min_open=True, max=36500),
    default=None,
    help="Days it stays valid [default: until revoked].",
)
@database_option
def token_create(
    user_name: str, name: str, expires_in_days: float | None, database_url: str
) -> None:
    """Print a new token for USER (shown once: only its hash is kept)."""
    from bulletin import admin

    expires_s = None if expires_in_days is None else expires_in_days * 86400
    try:
        click.echo(
            asyncio.run(admin.create_token(database_url, user_name, name=name, expires_s=expires_s))
        )
    except admin.AdminError as exc:
        raise click.ClickException(str(exc)) from None


@token.command("list")
@click.option("--owner", default=None, help="Only this user's (or node's) tokens.")
@database_option
def token_list(owner: str | None, database_url: str) -> None:
    """Tokens: id, kind, owner, label, first characters, and whether they still work."""
    import time

    from bulletin import admin

    now = time.time()
    for t in asyncio.run(admin.tokens(database_url, owner)):
        if t.revoked_at is not None:
            state = "revoked"
        elif t.expires_at is not None and t.expires_at <= now:
            state = "expired"
        elif t.expires_at is not None:
            state = f"valid for {(t.expires_at - now) / 86400:.1f} more days"
        else:
            state = "valid"
        label = f" {t.name!r}" if t.name else ""
        click.echo(f"{t.id}: {t.kind} token of {t.owner}{label}, {t.hint or '?'}, {state}")


@token.command("revoke")
@click.argument("token_id", metavar="ID", type=int)
@database_option
def token_revoke(token_id: int, database_url: str) -> None:
    """Revoke token ID at once (its next request gets 401)."""
    from bulletin import admin

    try:
        asyncio.run(admin.revoke_token(database_url, token_id))
    except admin.AdminError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"token {token_id} is revoked")


@click.group()
def group() -> None:
    """Manage groups: the quota unit of the fair scheduler (see docs/scheduling.md)."""


#: The most GPUs a quota may name (as the admin API's wire.GroupQuota).
MOST_GPUS = 1_000_000


@group.command("set")
@click.argument("name")
@click.option(
    "--guaranteed",
    type=click.IntRange(0, MOST_GPUS),
    default=None,
    help="GPUs the group always gets back, preempting other groups' borrowed work "
    "[default: unchanged; 0 for a new group].",
)
@click.option(
    "--borrow-limit",
    type=click.IntRange(0, MOST_GPUS),
    default=None,
    help="How many GPUs beyond the guarantee it may borrow while idle "
    "[default: unchanged; no limit for a new group].",
)
@click.option("--no-borrow-limit", is_flag=True, help="Let it borrow every idle GPU.")
@click.option(
    "--model",
    default=None,
    help="Set the group's quota for its GPUs of this model (e.g. A100) instead: the options "
    "above then apply to that model's GPUs (a new model quota: 0 guaranteed, no limit).",
)
@click.option("--drop-model", is_flag=True, help="Remove the group's quota for --model.")
@database_option
def group_set(
    name: str,
    guaranteed: int | None,
    borrow_limit: int | None,
    no_borrow_limit: bool,
    model: str | None,
    drop_model: bool,
    database_url: str,
) -> None:
    """Create group NAME or change its quota (options left out keep their value), or its
    quota for one GPU model (--model)."""
    from bulletin import admin
    from bulletin_core import wire

    try:
        msgspec.convert(name, wire.GroupName)
    except msgspec.ValidationError:
        raise click.BadParameter(wire.SLUG_RULE, param_hint="NAME") from None
    if no_borrow_limit and borrow_limit is not None:
        raise click.UsageError("give --borrow-limit N or --no-borrow-limit, not both")
    if model is not None:
        try:
            msgspec.convert(model, wire.QuotaModel)
        except msgspec.ValidationError:
            raise click.BadParameter(
                "one GPU model: 1 to 64 letters, digits, spaces, '.', '_' and '-'",
                param_hint="--model",
            ) from None
    if drop_model and (model is None or guaranteed is not None or borrow_limit is not None
                       or no_borrow_limit):  # fmt: skip
        raise click.UsageError("--drop-model needs --model MODEL and no other option")
    try:
        row = asyncio.run(
            admin.change_group(
                database_url,
                name,
                guaranteed=guaranteed,
                borrow_limit=admin.NO_LIMIT if no_borrow_limit else borrow_limit,
                model=model,
                drop_model=drop_model,
            )
        )
    except admin.AdminError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"group {name}: {describe_group(row)}")


def describe_group(row: db.GroupRow) -> str:
    """``8 GPUs guaranteed, borrows up to 4 more; A100: 2 guaranteed, borrows no more``."""

    def said(guaranteed: int, limit: int | None) -> str:
        more = "no limit" if limit is None else f"up to {limit} more"
        return f"{guaranteed} GPUs guaranteed, borrows {more}"

    parts = [said(row.guaranteed_gpus, row.borrow_limit_gpus)]
    parts += [f"{m.model}: {said(m.guaranteed_gpus, m.borrow_limit_gpus)}" for m in row.models]
    return "; ".join(parts)


@group.command("list")
@database_option
def group_list(database_url: str) -> None:
    """Groups, their quotas and how many users each has."""
    from bulletin import admin

    for g in asyncio.run(admin.groups(database_url)):
        limit = "no limit" if g.borrow_limit_gpus is None else str(g.borrow_limit_gpus)
        click.echo(
            f"{g.name}: {g.guaranteed_gpus} GPUs guaranteed, borrow limit {limit}, {g.users} users"
        )
        for m in g.models:
            limit = "no limit" if m.borrow_limit_gpus is None else str(m.borrow_limit_gpus)
            click.echo(f"  {m.model}: {m.guaranteed_gpus} guaranteed, borrow limit {limit}")


@click.command()
@click.option("--days", type=click.IntRange(1, 3660), default=30, show_default=True)
@database_option
def usage(days: int, database_url: str) -> None:
    """GPU-hours per user and group over the last DAYS days (UTC), most first."""
    from bulletin import admin

    rows = asyncio.run(admin.usage(database_url, days))
    if not rows:
        click.echo(f"no GPU use recorded in the last {days} days")
    for r in rows:
        click.echo(f"{r.user} ({r.group}): {r.gpu_seconds / 3600:.2f} GPU-hours, {r.calls} calls")


@click.group()
def node() -> None:
    """Manage nodes."""


@node.command("add")
@click.argument("name")
@click.option(
    "--replace",
    is_flag=True,
    help="Revoke the node's other tokens (a reinstalled node, a token that may have leaked).",
)
@database_option
def node_add(name: str, replace: bool, database_url: str) -> None:
    """Create node NAME (if new) and print a node token for its nodelet's --token-file. A
    removed node comes back in service (not draining), with this new token. Its earlier
    tokens keep working unless --replace is given."""
    from bulletin import admin

    click.echo(asyncio.run(admin.add_node(database_url, name, replace=replace)))


@node.command("drain")
@click.argument("name")
@click.option(
    "--reason",
    default="",
    help="Why, shown in 'bulletin node list' [default: the reason it drains for already, "
    "else 'drained by an admin'].",
)
@click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(min=0),
    default=0,
    show_default=True,
    metavar="SECONDS",
    help="Then wait up to SECONDS until it runs no call, and say how many still run "
    "(0: do not wait).",
)
@database_option
def node_drain(name: str, reason: str, wait_s: float, database_url: str) -> None:
    """Give node NAME no new work; the calls it runs finish. Undo with 'node undrain'.

    Prints 'node NAME is draining: it gets no new work', or 'node NAME was already
    draining (REASON)' if it was: it keeps the reason it was drained for. With --wait, then 'node
    NAME runs no calls', or 'node NAME still runs N call(s) after SECONDS s' when the wait
    ends first; the exit status is 0 either way (restarting its nodelet then hands back what
    still runs, to be queued again without using a retry).
    """
    from bulletin import admin

    before = asyncio.run(admin.drain(database_url, name, reason or None))
    if before is None:
        raise click.ClickException(f"no node named {name!r} (see 'bulletin node list')")
    if not before.draining:
        click.echo(f"node {name} is draining: it gets no new work")
    else:
        click.echo(f"node {name} was already draining ({before.reason or 'no reason given'})")
    if wait_s > 0:
        held = asyncio.run(admin.wait_idle(database_url, name, wait_s))
        click.echo(
            f"node {name} runs no calls"
            if held == 0
            else f"node {name} still runs {held} call(s) after {wait_s:g} s"
        )


@node.command("undrain")
@click.argument("name")
@click.option(
    "--if-reason",
    metavar="REASON",
    help="Only if it drains for exactly this reason (a script undoing its own drain and no "
    "admin's).",
)
@database_option
def node_undrain(name: str, if_reason: str | None, database_url: str) -> None:
    """Let node NAME take work again (after a GPU fault is dealt with, or maintenance).
    Prints 'node NAME takes work again', 'node NAME was not draining', or with --if-reason,
    'node NAME drains for another reason (REASON): left draining'."""
    from bulletin import admin

    before = asyncio.run(admin.undrain(database_url, name, if_reason=if_reason))
    if before is None:
        raise click.ClickException(f"no node named {name!r} (see 'bulletin node list')")
    if not before.draining:
        click.echo(f"node {name} was not draining")
    elif if_reason is not None and before.reason != if_reason:
        click.echo(f"node {name} drains for another reason ({before.reason}): left draining")
    else:
        click.echo(f"node {name} takes work again")


@node.command("remove")
@click.argument("name")
@database_option
def node_remove(name: str, database_url: str) -> None:
    """Deregister node NAME: revoke its node tokens (its nodelet's next request is refused,
    401) and never place work on it again; 'node list' no longer shows it, while its calls'
    history stays. It must be draining and run no call: 'bulletin node drain NAME --wait
    SECONDS', then stop its nodelet (exit status 1 otherwise). 'bulletin node add NAME'
    brings it back, in service, with a new token.

    Prints 'node NAME removed', or 'no node named NAME' when there is none (or it was
    removed already: the exit status is 0).
    """
    from bulletin import admin

    try:
        removed = asyncio.run(admin.remove_node(database_url, name))
    except admin.AdminError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"node {name} removed" if removed else f"no node named {name}")


@node.command("list")
@database_option
def node_list(database_url: str) -> None:
    """Nodes, whether they take work, and their GPUs' last reported health."""
    import time

    from bulletin import admin
    from nodelet.gpus import describe

    for status in asyncio.run(admin.nodes(database_url)):
        heard = (
            "never heard from"
            if status.last_heartbeat is None
            else f"heard {time.time() - status.last_heartbeat:.0f} s ago"
        )
        state = f"DRAINING ({status.drain_reason})" if status.draining else "in service"
        click.echo(
            f"{status.name}: {status.gpus} GPUs, {status.cpu_slots} CPU slots, {heard}, {state}"
        )
        for gpu in status.gpu_health:
            click.echo(f"  {describe(gpu)}")


@click.command(
    context_settings={"ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def replay(args: tuple[str, ...]) -> None:
    """Replay a job trace through a scheduling policy on a virtual clock and print its
    metrics: bulletin replay TRACE.csv --policy fair --nodes 64 --gpus-per-node 8 (--help
    for all options)."""
    from scheduler.replay import main as replay_main

    raise SystemExit(replay_main(list(args)))
