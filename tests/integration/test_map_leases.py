"""Items of a map in slot leases (gateway/db/slots.py), driven over plain HTTP against a real
gateway and PostgreSQL, playing the nodelet by hand: a node that completes an item of a map
gets the map's next items in the answer while nothing else waits, never while anyone
else's call does, and a lease counts for capacity once."""

from __future__ import annotations

import asyncio
import itertools
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import cloudpickle
import msgspec
import pytest

import sdk
from bulletin_core import wire
from scheduler import chunk_size
from tests.conftest import Cluster, running
from tests.integration.test_gateway_api import Http, call, poll, status, submit

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def gateway(database_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """A gateway whose leases and node timeout outlast a test that plays the node by hand
    (and sends no heartbeats)."""
    slow = {"lease-s": "60", "node-timeout-s": "60", "heartbeat-s": "5"}
    with running(Cluster(database_url, tmp_path), request, options=slow) as cluster:
        yield cluster


def register(cluster: Cluster, name: str = "n1", cpu_slots: int = 1) -> Http:
    node = Http(cluster.url, cluster.node_token(name).read_text())
    request = wire.RegisterRequest(name=name, gpus=[], cpu_slots=cpu_slots)
    r = node.post("/v1/node/register", request)
    assert r.status_code == 200, r.text
    node.client.headers[wire.INCARNATION_HEADER] = str(r.json()["incarnation"])
    return node


def submit_map(user: Http, n: int, map_id: str | None = None, **kw: object) -> list[str]:
    request = wire.SubmitRequest(
        calls=[call(gpus=0, **kw) for _ in range(n)], map_id=map_id or str(uuid.uuid4())
    )
    r = user.post("/v1/invocations", request)
    assert r.status_code == 201, r.text
    return msgspec.json.decode(r.content, type=wire.SubmitResponse).ids


def outcome(a: wire.Assignment, *, epoch: int | None = None) -> wire.Completion:
    now = time.time()
    return wire.Completion(
        invocation_id=a.invocation_id,
        epoch=a.epoch if epoch is None else epoch,
        state="succeeded",
        result=b"result of " + a.invocation_id.encode(),
        worker_acquired=now - 0.001,
        started=now - 0.001,
        finished=now,
    )


def complete_many(
    node: Http, *completions: wire.Completion, take_more: bool = True
) -> wire.CompleteManyResponse:
    request = wire.CompleteManyRequest(completions=list(completions), take_more=take_more)
    r = node.post("/v1/node/complete", request)
    assert r.status_code == 200, r.text
    return msgspec.json.decode(r.content, type=wire.CompleteManyResponse)


def refs(assignments: list[wire.Assignment]) -> list[wire.Attempt]:
    return [wire.Attempt(invocation_id=a.invocation_id, epoch=a.epoch) for a in assignments]


def test_a_node_completing_an_item_of_a_map_gets_its_next_items_in_the_same_lease(
    gateway: Cluster,
) -> None:
    user = Http(gateway.url, gateway.token)
    node = register(gateway)
    ids = submit_map(user, 40)
    [head] = poll(node).assignments  # the one slot: the scheduler places one item
    assert head.invocation_id == ids[0] and head.lease == ids[0]

    answer = complete_many(node, outcome(head))
    assert answer.done == [ids[0]] and answer.stale == []
    ahead = chunk_size(0, 0.001)
    assert 1 < ahead < 39
    # The map's next items, in queue order, to run one after another in the head's lease.
    assert [a.invocation_id for a in answer.assignments] == ids[1 : 1 + ahead]
    assert {a.lease for a in answer.assignments} == {ids[0]}
    assert all(a.payload == b"opaque" for a in answer.assignments)
    given = answer.assignments
    assert status(user, ids[1]).state == "assigned" and status(user, ids[1]).node == "n1"
    assert status(user, ids[1 + ahead]).state == "queued"
    # Held by the node, they are not delivered again.
    again = poll(node, refs(given))
    assert again.assignments == [] and again.revoked == []

    # The lease is topped up to as many unfinished items as before, never more.
    answer = complete_many(node, *map(outcome, given[:3]))
    assert answer.done == [a.invocation_id for a in given[:3]]
    assert [a.invocation_id for a in answer.assignments] == ids[1 + ahead : 4 + ahead]
    held = given[3:] + answer.assignments
    while held:
        answer = complete_many(node, *map(outcome, held))
        held = answer.assignments
    finished = [status(user, i) for i in ids]
    assert {i.state for i in finished} == {"succeeded"}
    assert {i.attempts for i in finished} == {1}


def test_items_that_may_not_be_retried_are_given_one_at_a_time(gateway: Cluster) -> None:
    """A lost node's attempts count against their calls' retries, run or not: of a map that
    may not be retried, a node holds only the item it runs."""
    user = Http(gateway.url, gateway.token)
    node = register(gateway)
    ids = submit_map(user, 5, max_retries=0)
    [head] = poll(node).assignments
    answer = complete_many(node, outcome(head))
    assert [a.invocation_id for a in answer.assignments] == [ids[1]]


def test_a_map_gets_no_more_of_a_slot_while_another_users_call_waits(gateway: Cluster) -> None:
    user = Http(gateway.url, gateway.token)
    bob = Http(gateway.url, gateway.add_user("bob", is_admin=True))
    node = register(gateway)
    ids = submit_map(user, 10)
    [head] = poll(node).assignments
    [bobs] = submit(bob, call(gpus=0, priority=1))
    assert status(bob, bobs).state == "queued"  # the one slot is the map's

    answer = complete_many(node, outcome(head))
    assert answer.done == [ids[0]] and answer.assignments == []
    # The lease ended: the scheduler gives the slot to whoever stands first, bob (his
    # call's priority is higher).
    [work] = poll(node).assignments
    assert work.invocation_id == bobs and work.lease is None
    assert status(user, ids[1]).state == "queued"


@pytest.mark.parametrize("other", ["0" * 32, "f" * 32], ids=["before it", "after it"])
def test_a_map_gets_no_more_of_a_slot_while_another_map_of_its_owner_waits(
    gateway: Cluster, other: str
) -> None:
    """Whichever side of the map the other one falls on in the queue's index order, the
    completion's answer gives no more of the map: the slot goes back to the scheduler."""
    user = Http(gateway.url, gateway.token)
    node = register(gateway)
    ids = submit_map(user, 10)
    [head] = poll(node).assignments
    [waiting] = submit_map(user, 1, map_id=str(uuid.UUID(other)))
    answer = complete_many(node, outcome(head))
    assert answer.done == [ids[0]] and answer.assignments == []  # the scheduler's to give
    assert status(user, waiting).state == "queued"


def test_another_users_calls_under_the_same_map_id_never_join_the_map(gateway: Cluster) -> None:
    """A map id is no key to another's map: bob's calls sent with alice's map id wait as
    bob's, and stop her leases from taking the slot from them."""
    alice = Http(gateway.url, gateway.token)
    bob = Http(gateway.url, gateway.add_user("bob", is_admin=True))
    node = register(gateway)
    map_id = str(uuid.uuid4())
    ids = submit_map(alice, 5, map_id)
    [head] = poll(node).assignments
    [bobs] = submit_map(bob, 1, map_id, priority=1)

    answer = complete_many(node, outcome(head))
    assert answer.assignments == []
    [work] = poll(node).assignments
    assert work.invocation_id == bobs
    answer = complete_many(node, outcome(work))
    assert answer.done == [bobs] and answer.assignments == []  # bob's map has no more
    [work] = poll(node).assignments
    assert work.invocation_id == ids[1]


def test_a_lease_counts_for_one_slot_however_many_items_it_holds(gateway: Cluster) -> None:
    user = Http(gateway.url, gateway.add_user("carol", is_admin=True))  # may raise priority
    node = register(gateway, cpu_slots=2)
    ids = submit_map(user, 60)
    first = poll(node).assignments
    assert [a.invocation_id for a in first] == ids[:2]  # both slots
    answer = complete_many(node, outcome(first[0]))
    held = [first[1], *answer.assignments]
    assert len(answer.assignments) > 2

    # Another call of the same user, which goes first: it waits for a slot.
    [other] = submit(user, call(gpus=0, priority=1))
    answer = complete_many(node, outcome(first[1]))
    assert answer.assignments == []  # something else waits now
    held = held[1:]
    # The second lease ended and its slot is free: the scheduler places the other call
    # there, beside the first lease's many items.
    work = poll(node, refs(held)).assignments
    assert [a.invocation_id for a in work] == [other]
    # No third slot: nothing more is placed through a long poll (rounds every second)
    # while the two leases hold; once the first lease's items are all done, its one slot
    # goes to the call first in the queue (the map's next item: fifo), and only that.
    [more] = submit(user, call(gpus=0))
    assert poll(node, refs([*held, *work])).assignments == []
    first_waiting = next(i for i in ids if status(user, i).state == "queued")
    answer = complete_many(node, *map(outcome, held))
    assert answer.assignments == []
    placed = poll(node, refs(work)).assignments
    assert [a.invocation_id for a in placed] == [first_waiting]
    assert status(user, more).state == "queued"


def test_a_stale_outcome_in_a_batch_is_discarded_and_the_others_committed(
    gateway: Cluster,
) -> None:
    user = Http(gateway.url, gateway.token)
    node = register(gateway, cpu_slots=2)
    ids = submit(user, call(gpus=0), call(gpus=0))
    work = poll(node).assignments
    assert len(work) == 2  # placed at submission, one per slot
    good, old = sorted(work, key=lambda a: ids.index(a.invocation_id))
    answer = complete_many(node, outcome(good), outcome(old, epoch=old.epoch + 7))
    assert answer.done == [good.invocation_id] and answer.stale == [old.invocation_id]
    assert status(user, good.invocation_id).state == "succeeded"
    assert status(user, old.invocation_id).state == "assigned"
    # Sent again, both are already settled: the committed one is not taken twice.
    answer = complete_many(node, outcome(good), outcome(old))
    assert answer.done == [old.invocation_id] and answer.stale == [good.invocation_id]


def test_a_node_cannot_complete_another_nodes_items_nor_take_their_map(
    gateway: Cluster,
) -> None:
    user = Http(gateway.url, gateway.token)
    n1, n2 = register(gateway, "n1"), register(gateway, "n2")
    ids = submit_map(user, 10)
    work = poll(n1).assignments or poll(n2).assignments
    [head] = work
    owner, other = (n1, n2) if status(user, head.invocation_id).node == "n1" else (n2, n1)
    answer = complete_many(other, outcome(head))
    assert answer.done == [] and answer.stale == [head.invocation_id]
    assert answer.assignments == []
    assert status(user, head.invocation_id).state == "assigned"
    assert status(user, ids[2]).state == "queued"  # one item per node's slot, no more
    # The same outcome twice in one request is refused whole.
    twice = wire.CompleteManyRequest(completions=[outcome(head), outcome(head)])
    r = owner.post("/v1/node/complete", twice)
    assert r.status_code == 422 and "same invocation" in r.json()["detail"]
    assert status(user, head.invocation_id).state == "assigned"


def test_items_of_one_map_must_ask_for_the_same_resources(gateway: Cluster) -> None:
    user = Http(gateway.url, gateway.token)
    request = wire.SubmitRequest(
        calls=[call(gpus=0), call(gpus=0, timeout_s=5.0)], map_id=str(uuid.uuid4())
    )
    r = user.post("/v1/invocations", request)
    assert r.status_code == 422 and r.json()["code"] == "map_items_differ"
    assert "calls[1]" in r.json()["detail"]
    assert user.get("/v1/invocations").json() == []


# ---------------------------------------------------------------- with a real nodelet and sdk


def square(x: int) -> int:
    return x * x


def nap_then_square(x: int) -> int:
    time.sleep(0.002)
    return x * x


def items_in_leases(cluster: Cluster) -> tuple[int, int]:
    """How many invocations ran in another's lease, and how many there are."""

    async def count() -> tuple[int, int]:
        conn = await asyncpg.connect(cluster.database_url)
        try:
            row = await conn.fetchrow(
                "SELECT count(*) FILTER (WHERE lease_id IS NOT NULL), count(*) FROM invocations"
            )
        finally:
            await conn.close()
        assert row is not None
        return int(row[0]), int(row[1])

    return asyncio.run(count())


def test_a_map_runs_its_items_one_after_another_in_its_slot_each_an_invocation_of_its_own(
    gateway: Cluster,
) -> None:
    gateway.start_nodelet(fake_gpus=0, cpu_slots=1)
    sdk.connect(gateway.url, gateway.token)
    fn = sdk.function(gpus=0)(square)
    assert list(fn.map(range(300))) == [x * x for x in range(300)]

    user = Http(gateway.url, gateway.token)
    r = user.get("/v1/invocations", params={"limit": 500})
    listed = msgspec.json.decode(r.content, type=list[wire.Invocation])
    assert len(listed) == 300 and {i.state for i in listed} == {"succeeded"}
    assert {i.attempts for i in listed} == {1}
    # One slot: never two items at once, though most were on the node ahead of their turn.
    runs = sorted((i.timeline.started, i.timeline.finished) for i in listed)
    assert all(s is not None and f is not None for s, f in runs)
    for (_, finished), (started, _) in itertools.pairwise(runs):
        assert started >= finished  # type: ignore[operator]
    in_leases, total = items_in_leases(gateway)
    assert total == 300 and in_leases >= 250, "the map's items did not run in slot leases"


def test_a_map_whose_node_is_killed_and_restarted_loses_no_item(gateway: Cluster) -> None:
    """The items a killed nodelet held ahead in its leases are taken back when its node
    registers again, and run; every item's one result comes back, in order."""
    first = gateway.start_nodelet(fake_gpus=0, cpu_slots=1)
    sdk.connect(gateway.url, gateway.token)
    fn = sdk.function(gpus=0)(nap_then_square)
    results = fn.map(range(400))
    got = [next(results) for _ in range(50)]
    first.send_signal(signal.SIGKILL)
    first.wait()
    gateway.start_nodelet(fake_gpus=0, cpu_slots=1)
    got += list(results)
    assert got == [x * x for x in range(400)]
    user = Http(gateway.url, gateway.token)
    r = user.get("/v1/invocations", params={"limit": 500})
    listed = msgspec.json.decode(r.content, type=list[wire.Invocation])
    assert {i.state for i in listed} == {"succeeded"}
    assert max(i.attempts for i in listed) == 2  # those the killed node held, run again
