"""``bulletin apply``: the cluster's groups and users as data, through the real command on a
real database (and a real gateway for the tokens it mints). It changes only what the file
lists, says what it changed (nothing on a second run), mints tokens only when asked, and
refuses a bad file or an unknown group before anything changes."""

from __future__ import annotations

import asyncio
import json

import pytest
from click.testing import CliRunner, Result

from bulletin import admin, cli
from gateway import db
from tests.conftest import Cluster
from tests.integration.test_gateway_api import Http

SPEC = {
    "groups": {
        "vision": {"guaranteed": 16, "borrow_limit": 32},
        "nlp": {"guaranteed": 0, "borrow_limit": None},
    },
    "users": {"alice": {"group": "vision", "admin": False}, "bob": {"group": "nlp", "admin": True}},
}


def apply(database_url: str, spec: object) -> Result:
    """``bulletin apply -`` with ``spec`` (JSON-encoded unless a str) on stdin."""
    text = spec if isinstance(spec, str) else json.dumps(spec)
    env = {"BULLETIN_DATABASE_URL": database_url}
    return CliRunner().invoke(cli, ["apply", "-"], input=text, env=env)


def applied(database_url: str, spec: object) -> dict[str, object]:
    result = apply(database_url, spec)
    assert result.exit_code == 0, result.output
    outcome = json.loads(result.stdout)
    assert isinstance(outcome, dict) and set(outcome) == {"changed", "tokens"}
    if not outcome["tokens"]:
        assert "bu_" not in result.output, "a token printed though none was asked for"
    return outcome


def groups(database_url: str) -> dict[str, tuple[int, int | None]]:
    rows = asyncio.run(admin.groups(database_url))
    return {g.name: (g.guaranteed_gpus, g.borrow_limit_gpus) for g in rows}


def users(database_url: str, *names: str) -> dict[str, tuple[str, bool]]:
    async def read() -> dict[str, db.UserRow]:
        async with admin.connection(database_url) as conn:
            return await db.find_users(conn, list(names))

    return {u.name: (u.group, u.is_admin) for u in asyncio.run(read()).values()}


def test_apply_makes_what_is_listed_once_and_leaves_the_rest(database_url: str) -> None:
    asyncio.run(admin.set_group(database_url, "old", 2, 2))
    asyncio.run(admin.add_user(database_url, "carol", group="old", is_admin=True))
    first = applied(database_url, SPEC)
    assert first == {
        "changed": [
            "group vision created (guaranteed 16, borrow limit 32)",
            "group nlp created (guaranteed 0, no borrow limit)",
            "user alice created in vision",
            "user bob created in nlp as admin",
        ],
        "tokens": {},
    }
    assert groups(database_url) == {
        "default": (0, None),
        "nlp": (0, None),
        "old": (2, 2),
        "vision": (16, 32),
    }
    assert users(database_url, "alice", "bob", "carol") == {
        "alice": ("vision", False),
        "bob": ("nlp", True),
        "carol": ("old", True),  # not listed: left alone
    }
    assert applied(database_url, SPEC) == {"changed": [], "tokens": {}}
    # Left out: guaranteed 0, no borrow limit, group 'default', not an admin.
    defaults: dict[str, object] = {"groups": {"nlp": {}}, "users": {"dave": {}}}
    assert applied(database_url, defaults)["changed"] == ["user dave created in default"]


def test_a_changed_quota_group_or_admin_flag_is_applied_and_reported(database_url: str) -> None:
    applied(database_url, SPEC)
    changed = {
        "groups": {"vision": {"guaranteed": 8}, "nlp": {"guaranteed": 0}},
        "users": {"alice": {"group": "nlp", "admin": True}, "bob": {"group": "nlp"}},
    }
    assert applied(database_url, changed)["changed"] == [
        "group vision changed (guaranteed 8, no borrow limit; was guaranteed 16, borrow limit 32)",
        "user alice moved from vision to nlp",
        "user alice made admin",
        "user bob is no longer admin",
    ]
    assert groups(database_url)["vision"] == (8, None)
    assert users(database_url, "alice", "bob") == {"alice": ("nlp", True), "bob": ("nlp", False)}
    assert applied(database_url, changed)["changed"] == []


def test_quotas_per_model_are_applied_exactly_as_listed(database_url: str) -> None:
    spec = {"groups": {"vision": {"guaranteed": 8, "models": {
        "A100": {"guaranteed": 4, "borrow_limit": 0}, "H100": {}}}}}  # fmt: skip
    assert applied(database_url, spec)["changed"] == [
        "group vision created (guaranteed 8, no borrow limit; A100: guaranteed 4, borrow "
        "limit 0; H100: guaranteed 0, no borrow limit)"
    ]
    [vision] = [g for g in asyncio.run(admin.groups(database_url)) if g.name == "vision"]
    assert vision.models == (db.ModelQuotaRow("A100", 4, 0), db.ModelQuotaRow("H100", 0, None))
    assert applied(database_url, spec)["changed"] == []
    # A group listed without models has none: the file says the whole quota.
    assert applied(database_url, {"groups": {"vision": {"guaranteed": 8}}})["changed"] == [
        "group vision changed (guaranteed 8, no borrow limit; was guaranteed 8, no borrow "
        "limit; A100: guaranteed 4, borrow limit 0; H100: guaranteed 0, no borrow limit)"
    ]
    [vision] = [g for g in asyncio.run(admin.groups(database_url)) if g.name == "vision"]
    assert vision.models == ()


def test_two_changes_of_a_group_s_models_at_once_leave_the_later_one(database_url: str) -> None:
    """Each change replaces the group's quotas per model: the one that waited for the other's
    lock sees what it wrote, and keeps nothing of it."""

    async def race() -> tuple[db.ModelQuotaRow, ...]:
        connect = admin.connection
        async with connect(database_url) as first, connect(database_url) as second:
            b, c = [db.ModelQuotaRow("B100", 1, None)], [db.ModelQuotaRow("C100", 2, None)]
            async with first.transaction():
                await db.set_group(first, "vision", 0, None, b)
                later = asyncio.create_task(db.set_group(second, "vision", 0, None, c))
                await asyncio.sleep(0.5)
                assert not later.done()  # it waits for the first's lock
            return (await later).models

    assert asyncio.run(race()) == (db.ModelQuotaRow("C100", 2, None),)


def test_tokens_for_mints_a_token_that_works(module_gateway: Cluster) -> None:
    spec = {
        "groups": {"vision": {"guaranteed": 1}},
        "users": {"alice": {}, "erin": {"group": "vision"}},
        "tokens_for": ["erin", "alice", "erin"],
    }
    outcome = applied(module_gateway.database_url, spec)
    assert outcome["changed"] == [
        "group vision created (guaranteed 1, no borrow limit)",
        "user erin created in vision",
        "user erin got a new token",
        "user alice got a new token",
    ]
    tokens = outcome["tokens"]
    assert isinstance(tokens, dict) and sorted(tokens) == ["alice", "erin"]
    for token in tokens.values():
        assert Http(module_gateway.url, token).get("/v1/invocations").status_code == 200
    listed = asyncio.run(admin.tokens(module_gateway.database_url, "erin"))
    assert [(t.name, t.hint) for t in listed] == [("bulletin apply", tokens["erin"][:9] + "…")]
    # The older token of alice (the fixture's) still works.
    assert Http(module_gateway.url, module_gateway.token).get("/v1/invocations").status_code == 200
    again = applied(module_gateway.database_url, {**spec, "tokens_for": []})
    assert again == {"changed": [], "tokens": {}}


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ({"groups": {"vision": {"guaranteed": -1}}}, '`$.groups["vision"].guaranteed`'),
        ({"groups": {"vision": {"guaranteed": 1_000_001}}}, "<= 1000000"),
        (
            {"groups": {"vision": {"guarantee": 1}}},
            'unknown field `guarantee` - at `$.groups["vision"]`',
        ),
        ({"groups": {"vision": []}}, 'Expected `object`, got `array` - at `$.groups["vision"]`'),
        ({"users": {"alice": {"admin": "yes"}}}, '`$.users["alice"].admin`'),
        ({"users": {"al ice": {}}}, "users: 'al ice' is not a name: use letters"),
        ({"users": {"alice": {"group": "a/b"}}}, '`$.users["alice"].group`'),
        ({"users": {"alice": {}}, "tokens_for": ["bob"]}, "tokens_for names 'bob', not listed in"),
        ({"group": {}}, "unknown field `group`"),
        (
            {"groups": {"v": {"models": {"A100|H100": {}}}}},
            '`$.groups["v"].models`',
        ),
        (
            {"groups": {"v": {"models": {"A100": {}, "a100": {}}}}},
            "differ only in case",
        ),
        ({"groups": {"v": {"models": {"A100": {"guaranteed": -1}}}}}, "guaranteed"),
        ("{not json", "not JSON"),
    ],
)
def test_a_bad_file_is_refused_naming_the_field(database_url: str, spec: object, said: str) -> None:
    result = apply(database_url, spec)
    assert result.exit_code == 2, result.output
    assert said in result.stderr and "bulletin apply --help" in result.stderr
    assert result.stdout == ""


def test_an_unknown_group_is_refused_before_anything_changes(database_url: str) -> None:
    spec = {
        "groups": {"vision": {}},
        "users": {"alice": {"group": "vision"}, "eve": {"group": "nope"}},
        "tokens_for": ["alice"],
    }
    result = apply(database_url, spec)
    assert result.exit_code == 1 and result.stdout == ""
    assert 'users["eve"].group: no group \'nope\': list it under "groups"' in result.stderr
    assert groups(database_url) == {"default": (0, None)}
    assert users(database_url, "alice", "eve") == {}
