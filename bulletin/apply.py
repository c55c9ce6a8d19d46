"""``bulletin apply FILE``: the cluster's groups and users as data, made so in one
transaction. A rollout playbook runs it on every deploy; it says what it changed, so that a
second run with the same file reports nothing, and mints tokens only when asked."""

from __future__ import annotations

import asyncio
from typing import Annotated, BinaryIO

import asyncpg
import click
import msgspec

from bulletin import admin
from bulletin.commands import MOST_GPUS, database_option
from bulletin_core import wire
from gateway import db
from scheduler.quotas import case_clash

#: The label of the tokens it mints, shown by 'bulletin token list'.
TOKEN_LABEL = "bulletin apply"

Gpus = Annotated[int, msgspec.Meta(ge=0, le=MOST_GPUS)]


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A group's quota for one GPU model, as ``bulletin group set --model`` takes it."""

    guaranteed: Gpus = 0
    #: None (or left out): no limit.
    borrow_limit: Gpus | None = None


class GroupSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A group's whole quota, as ``bulletin group set`` takes it, and its quotas per model."""

    guaranteed: Gpus = 0
    #: None (or left out): the group may borrow every idle GPU.
    borrow_limit: Gpus | None = None
    models: Annotated[
        dict[wire.QuotaModel, ModelSpec], msgspec.Meta(max_length=wire.MAX_QUOTA_MODELS)
    ] = {}

    def __post_init__(self) -> None:
        clash = case_clash(self.models)
        if clash:
            raise ValueError(clash)

    def rows(self) -> list[db.ModelQuotaRow]:
        return [
            db.ModelQuotaRow(model, spec.guaranteed, spec.borrow_limit)
            for model, spec in sorted(self.models.items())
        ]


class UserSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    group: wire.GroupName = "default"
    admin: bool = False


class Spec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What FILE holds: groups and users by name, and the users to mint a token for."""

    groups: dict[wire.GroupName, GroupSpec] = {}
    users: dict[wire.Slug, UserSpec] = {}
    tokens_for: list[wire.Slug] = []

    def __post_init__(self) -> None:
        strangers = [name for name in self.tokens_for if name not in self.users]
        if strangers:
            raise ValueError(
                f"tokens_for names {', '.join(map(repr, strangers))}, not listed in users: "
                "list them there too"
            )


class Outcome(msgspec.Struct, frozen=True, kw_only=True):
    """What ``apply`` prints: each change made, in words, and the tokens minted by user."""

    changed: list[str]
    tokens: dict[str, str]


class SpecError(ValueError):
    """FILE is not a Spec; the message names the field."""


_DECODER = msgspec.json.Decoder(Spec)
_ENTRIES = {"groups": GroupSpec, "users": UserSpec}
_HINT = " (the format: bulletin apply --help)"


def decode(data: bytes) -> Spec:
    try:
        return _DECODER.decode(data)
    except msgspec.ValidationError as exc:
        raise SpecError((_named(data) or str(exc)) + _HINT) from None
    except msgspec.DecodeError as exc:
        raise SpecError(f"not JSON: {exc}{_HINT}") from None


def _named(data: bytes) -> str | None:
    """The first bad group or user, named (msgspec says ``$.groups[...]`` and stops at the
    first error too)."""
    doc = msgspec.json.decode(data)
    for section, kind in _ENTRIES.items():
        entries = doc.get(section) if isinstance(doc, dict) else None
        for name, entry in entries.items() if isinstance(entries, dict) else ():
            where = f'$.{section}["{name}"]'
            try:
                msgspec.convert(name, wire.Slug)
            except msgspec.ValidationError:
                return f"{section}: {name!r} is not a name: {wire.SLUG_RULE}"
            try:
                msgspec.convert(entry, kind)
            except msgspec.ValidationError as exc:
                said = str(exc)
                return said.replace("`$", f"`{where}") if "`$" in said else f"{said} - at `{where}`"
    return None


def _quota(guaranteed: int, borrow_limit: int | None, models: list[db.ModelQuotaRow]) -> str:
    limit = "no borrow limit" if borrow_limit is None else f"borrow limit {borrow_limit}"
    said = f"guaranteed {guaranteed}, {limit}"
    for m in models:
        said += f"; {m.model}: {_quota(m.guaranteed_gpus, m.borrow_limit_gpus, [])}"
    return said


async def _apply_group(
    conn: asyncpg.Connection, name: str, want: GroupSpec, old: db.GroupRow | None
) -> list[str]:
    wanted = (want.guaranteed, want.borrow_limit, want.rows())
    if old and (old.guaranteed_gpus, old.borrow_limit_gpus, list(old.models)) == wanted:
        return []
    await db.set_group(conn, name, *wanted)
    new = _quota(*wanted)
    if old is None:
        return [f"group {name} created ({new})"]
    was = _quota(old.guaranteed_gpus, old.borrow_limit_gpus, list(old.models))
    return [f"group {name} changed ({new}; was {was})"]


async def _apply_user(
    conn: asyncpg.Connection, name: str, want: UserSpec, old: db.UserRow | None
) -> tuple[int, list[str]]:
    """The user's id, and what changed. Moving a user or changing their admin flag needs
    nothing else: both are read from the user's row whenever they count (planning, a
    request's authentication)."""
    if old is None:
        user_id = await db.create_user(conn, name, is_admin=want.admin, group=want.group)
        made = f"user {name} created in {want.group}" + (" as admin" if want.admin else "")
        return user_id, [made]
    changed = []
    if old.group != want.group:
        await db.set_user_group(conn, name, want.group)
        changed.append(f"user {name} moved from {old.group} to {want.group}")
    if old.is_admin != want.admin:
        await db.set_user_admin(conn, name, want.admin)
        changed.append(f"user {name} " + ("made admin" if want.admin else "is no longer admin"))
    return old.id, changed


def _missing_groups(spec: Spec, existing: dict[str, db.GroupRow]) -> list[str]:
    return [
        f'users["{name}"].group: no group {user.group!r}: list it under "groups" or create it '
        f"with 'bulletin group set {user.group}'"
        for name, user in spec.users.items()
        if user.group not in spec.groups and user.group not in existing
    ]


async def apply(database_url: str, spec: Spec) -> Outcome:
    """Make the listed groups and users as ``spec`` says, in one transaction (nothing
    changes if anything is refused), and mint a token for each of ``spec.tokens_for``."""
    changed: list[str] = []
    async with admin.connection(database_url) as conn, conn.transaction():
        existing = {g.name: g for g in await db.groups(conn)}
        missing = _missing_groups(spec, existing)
        if missing:
            raise admin.AdminError("; ".join(missing))
        for name, group in spec.groups.items():
            changed += await _apply_group(conn, name, group, existing.get(name))
        users = await db.find_users(conn, list(spec.users))
        ids = {}
        for name, user in spec.users.items():
            ids[name], done = await _apply_user(conn, name, user, users.get(name))
            changed += done
        tokens = {}
        for name in dict.fromkeys(spec.tokens_for):
            tokens[name] = await admin.mint_token(conn, ids[name], name=TOKEN_LABEL)
            changed.append(f"user {name} got a new token")
    return Outcome(changed=changed, tokens=tokens)


@click.command("apply")
@click.argument("file", type=click.File("rb"))
@database_option
def command(file: BinaryIO, database_url: str) -> None:
    """Make the cluster's groups and users as FILE (JSON; '-': stdin) says, in one
    transaction, and print what changed. Idempotent: run it on every deploy.

    \b
    {"groups": {"vision": {"guaranteed": 16, "borrow_limit": 32,
                           "models": {"A100": {"guaranteed": 8, "borrow_limit": 0}}},
                "nlp": {"guaranteed": 0, "borrow_limit": null}},
     "users": {"alice": {"group": "vision", "admin": false},
               "bob": {"group": "nlp", "admin": true}},
     "tokens_for": ["alice"]}

    Every listed group gets exactly the listed quota, created if missing ("guaranteed": GPUs
    it always gets back, default 0; "borrow_limit": GPUs it may borrow beyond that, null or
    left out for no limit; each 0 to 1000000; "models": its quotas per GPU model, in the same
    form, exactly these, none when left out). Every listed user is created if missing, put
    in "group" (default "default"; it must be listed or exist already) and made an
    administrator or not as "admin" says (default false). Groups and users not listed are
    left alone: nothing is deleted. Each user named in "tokens_for" (who must be listed in
    "users") gets a new token, labelled 'bulletin apply'; earlier tokens keep working.

    \b
    Prints one JSON object on stdout:
    {"changed": ["group vision created (guaranteed 16, borrow limit 32)",
                 "user alice created in vision", "user alice got a new token"],
     "tokens": {"alice": "bu_..."}}

    "changed" is empty when nothing changed. Tokens are printed only there, once (only
    their hashes are stored). A FILE that is not valid is refused (exit status 2), as is a
    user's unknown group (exit status 1), before anything changes.
    """
    try:
        spec = decode(file.read())
    except SpecError as exc:
        raise click.BadParameter(str(exc), param_hint="FILE") from None
    try:
        outcome = asyncio.run(apply(database_url, spec))
    except admin.AdminError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(msgspec.json.encode(outcome).decode())
