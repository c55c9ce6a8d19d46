"""What a database crash may and may not take. A submission that waits for its result
commits without waiting for its WAL flush (its caller is told nothing until its answer);
its answer is on disk before it is sent. Each test runs its own PostgreSQL, crashed with an
immediate stop (WAL not yet flushed is lost, the next start recovers) while its WAL writer
flushes only every 10 s, so that nothing but a durable commit puts a commit on disk."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import msgspec
import pytest

from bulletin import admin
from bulletin.pgserver import EmbeddedPostgres
from bulletin_core import wire
from gateway import db
from tests import accounts
from tests.conftest import Cluster, running
from tests.integration.test_gateway_api import Http, call, register


@pytest.fixture
def crashable() -> Iterator[EmbeddedPostgres]:
    """A PostgreSQL of this test's own, whose WAL writer waits 10 s between flushes."""
    with accounts.traversable_dir("bulletin-crash-") as parent:
        pg = EmbeddedPostgres(parent / "pgdata")
        server_url = pg.start()
        try:
            asyncio.run(_slow_wal_writer(server_url))
            yield pg
        finally:
            pg.stop()


async def _slow_wal_writer(server_url: str) -> None:
    conn = await asyncpg.connect(server_url)
    try:
        await conn.execute("ALTER SYSTEM SET wal_writer_delay = '10s'")
        await conn.execute("SELECT pg_reload_conf()")
    finally:
        await conn.close()


def _crash_and_recover(pg: EmbeddedPostgres) -> None:
    pg.stop(mode="immediate")
    pg.start()


async def _async_commit(url: str, value: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("SET synchronous_commit = off")
        await conn.execute("INSERT INTO probe VALUES ($1)", value)
    finally:
        await conn.close()


async def _make_durable(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await db.make_durable(conn)
    finally:
        await conn.close()


async def _probes(url: str) -> set[str]:
    conn = await asyncpg.connect(url)
    try:
        return {r["value"] for r in await conn.fetch("SELECT value FROM probe")}
    finally:
        await conn.close()


@contextlib.contextmanager
def _gateway(
    pg: EmbeddedPostgres, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Cluster]:
    """A gateway on ``pg``'s database ``bulletin``, with one node registered that never
    polls (calls are placed on it at once, and never run)."""
    asyncio.run(admin.ensure_database(pg.url(), "bulletin"))
    cluster = Cluster(pg.url("bulletin"), tmp_path)
    with running(cluster, request):
        register(cluster, "n1")
        yield cluster


async def _state(url: str, invocation_id: str) -> str | None:
    """The invocation's state in the database, None when it is not there."""
    conn = await asyncpg.connect(url)
    try:
        found = await conn.fetchval(
            "SELECT state FROM invocations WHERE id = $1", uuid.UUID(invocation_id)
        )
        return None if found is None else str(found)
    finally:
        await conn.close()


def test_make_durable_puts_every_asynchronous_commit_before_it_on_disk(
    crashable: EmbeddedPostgres,
) -> None:
    url = crashable.url()

    async def table() -> None:
        conn = await asyncpg.connect(url)
        try:
            await conn.execute("CREATE TABLE probe (value text)")
        finally:
            await conn.close()

    asyncio.run(table())
    # The control: a crash takes an asynchronous commit nothing flushed since.
    asyncio.run(_async_commit(url, "lost"))
    _crash_and_recover(crashable)
    assert asyncio.run(_probes(url)) == set()
    asyncio.run(_async_commit(url, "kept"))
    asyncio.run(_make_durable(url))
    _crash_and_recover(crashable)
    assert asyncio.run(_probes(url)) == {"kept"}


def test_a_waiting_submission_answered_without_its_result_survives_a_database_crash(
    crashable: EmbeddedPostgres, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    with _gateway(crashable, tmp_path, request) as cluster:
        user = Http(cluster.url, cluster.token)
        answer = user.post("/v1/invocations?wait=0.3", wire.SubmitRequest(calls=[call()]))
        assert answer.status_code == 201, answer.text
        submitted = msgspec.json.decode(answer.content, type=wire.SubmitResponse)
        assert not any(i.state.terminal for i in submitted.invocations)
        # At once: the answer came, so the call must be on disk by now.
        _crash_and_recover(crashable)
        assert asyncio.run(_state(crashable.url("bulletin"), submitted.ids[0])) == "assigned"


def test_a_replayed_submission_is_on_disk_before_its_ids_are_given_again(
    crashable: EmbeddedPostgres, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # The first request waits for its call's result (its commit did not wait for the WAL
    # flush); a retry with the same Idempotency-Key that does not wait gets the same ids at
    # once: they must be on disk, although the first request has not answered yet.
    with _gateway(crashable, tmp_path, request) as cluster:
        user = Http(cluster.url, cluster.token)
        body = wire.SubmitRequest(calls=[call()])
        key = {"Idempotency-Key": uuid.uuid4().hex}
        waiting = threading.Thread(
            target=lambda: user.post("/v1/invocations?wait=20", body, headers=key), daemon=True
        )
        waiting.start()
        retry = Http(cluster.url, cluster.token)
        deadline = time.monotonic() + 10
        while True:  # until the first request's call exists (409 while it is being made)
            again = retry.post("/v1/invocations", body, headers=key)
            if again.status_code == 201 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert again.status_code == 201, again.text
        assert again.headers.get("idempotent-replayed") == "true"
        ids = msgspec.json.decode(again.content, type=wire.SubmitResponse).ids
        _crash_and_recover(crashable)
        assert asyncio.run(_state(crashable.url("bulletin"), ids[0])) == "assigned"
