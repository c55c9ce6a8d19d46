"""Quotas with borrowing, reclaim and fair share, on static snapshots; submit-time checks."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler import (
    Gpu,
    NodeCapacity,
    Part,
    Pending,
    Quota,
    Running,
    Snapshot,
    UnknownPolicyError,
    explain,
    never_fits,
    plan,
)
from scheduler.fair import Fair
from scheduler.fairshare import fair_order


def node(i: int, free: list[int], size: int = 4, model: str = "A100") -> NodeCapacity:
    return NodeCapacity(i, free, 0, tuple(Gpu(g, model, 40960) for g in range(size)))


def run(
    rid: str,
    node_id: int,
    gpus: tuple[int, ...],
    group: str,
    start: float,
    borrowed: bool = True,
    **kw: object,
) -> Running:
    return Running(rid, node_id, gpus, group=group, start_time=start, borrowed=borrowed,
                   **kw)  # type: ignore[arg-type]  # fmt: skip


QUOTAS = {"a": Quota(4, None), "b": Quota(4, 2)}


def test_calls_within_the_guarantee_are_nominal_the_rest_borrow() -> None:
    snap = Snapshot(
        [node(1, [0, 1, 2, 3]), node(2, [0, 1, 2, 3])],
        [Pending("a1", 3, group="a"), Pending("a2", 2, group="a")],
        quotas=QUOTAS,
    )
    out = plan(snap, "fair")
    assert [(d.invocation_id, d.borrowed) for d in out] == [("a1", False), ("a2", True)]


def test_a_group_never_exceeds_its_ceiling() -> None:
    snap = Snapshot(
        [node(1, [0, 1, 2, 3]), node(2, [0, 1, 2, 3])],
        [Pending(f"b{i}", 1, group="b") for i in range(8)],
        quotas=QUOTAS,
    )
    assert len(plan(snap, "fair")) == 6
    assert "quota ceiling" in explain(snap, "fair")["b6"][1]


def test_reclaim_preempts_the_youngest_borrowed_calls_just_enough() -> None:
    # Group b borrows all of node 1 (its guarantee is 4 but it holds 4 + these); a wants 2.
    running = [
        run("old", 1, (0,), "b", start=10),
        run("young", 1, (1,), "b", start=30),
        run("mid", 1, (2, 3), "b", start=20),
        run("nominal", 2, (0, 1, 2, 3), "b", start=0, borrowed=False),
    ]
    snap = Snapshot([node(1, []), node(2, [])], [Pending("a1", 2, group="a")], running,
                    quotas=QUOTAS, now=100)  # fmt: skip
    out = plan(snap, "fair")
    assert list(out) == []  # the victims still hold the GPUs: a1 starts next round
    assert [p.invocation_id for p in out.preemptions] == ["young", "mid"]
    assert "reclaimed for group a" in out.preemptions[0].reason
    assert "reclaiming GPUs on node 1" in explain(snap, "fair")["a1"][1]


def test_reclaim_in_flight_is_not_repeated() -> None:
    running = [
        run("old", 1, (0,), "b", start=10),
        run("young", 1, (1,), "b", start=30, preempting=True),
        run("mid", 1, (2, 3), "b", start=20),
        run("nominal", 2, (0, 1, 2, 3), "b", start=0, borrowed=False),
    ]
    snap = Snapshot([node(1, []), node(2, [])], [Pending("a1", 1, group="a")], running,
                    quotas=QUOTAS)  # fmt: skip
    out = plan(snap, "fair")
    assert list(out) == [] and out.preemptions == []


def test_reclaim_never_takes_a_group_below_its_guarantee() -> None:
    running = [run(f"b{i}", 1, (i,), "b", start=i) for i in range(4)]  # exactly b's guarantee
    snap = Snapshot([node(1, [])], [Pending("a1", 1, group="a")], running, quotas=QUOTAS)
    out = plan(snap, "fair")
    assert out.preemptions == []
    assert "nothing borrowed to reclaim" in explain(snap, "fair")["a1"][1]


def test_borrowers_cannot_take_room_being_reclaimed() -> None:
    running = [
        run("b1", 1, (0, 1), "b", start=1),
        run("b2", 1, (2,), "b", start=2),
        run("bn", 2, (0, 1, 2, 3), "b", start=0, borrowed=False),
    ]
    pending = [Pending("a1", 2, group="a"), Pending("c1", 1, group="c")]
    snap = Snapshot([node(1, [3]), node(2, [])], pending, running, quotas=QUOTAS)
    out = plan(snap, "fair")
    assert [p.invocation_id for p in out.preemptions] == ["b2"]
    assert list(out) == []  # node 1's free GPU 3 is kept for a1


def test_fair_share_orders_borrowers_by_decayed_usage_per_guaranteed_gpu() -> None:
    pending = [Pending("x", 1, group="heavy"), Pending("y", 1, group="light")]
    quotas = {"heavy": Quota(10), "light": Quota(1)}
    order = fair_order(pending, {"heavy": 500.0, "light": 100.0}, {}, quotas)
    assert [c.id for c in order] == ["x", "y"]  # 50 per GPU against 100
    order = fair_order(pending, {"heavy": 5000.0, "light": 100.0}, {}, quotas)
    assert [c.id for c in order] == ["y", "x"]


def test_priority_comes_before_fair_share_and_users_before_queue_order() -> None:
    pending = [
        Pending("p0", 1, group="g", user="u1"),
        Pending("p1", 1, group="g", user="u2"),
        Pending("urgent", 1, group="g", user="u1", priority=5),
    ]
    order = fair_order(pending, {}, {("g", "u1"): 10.0})
    assert [c.id for c in order] == ["urgent", "p1", "p0"]


def test_groups_without_a_quota_borrow_everything_and_can_be_reclaimed() -> None:
    snap = Snapshot([node(1, [0, 1, 2, 3])], [Pending(f"z{i}", 1, group="zz") for i in range(4)])
    out = plan(snap, "fair")
    assert len(out) == 4 and all(d.borrowed for d in out)


def test_unknown_policy_names_the_choices() -> None:
    with pytest.raises(UnknownPolicyError, match="fair"):
        plan(Snapshot([], []), "lottery")


def test_never_fits_names_the_reason() -> None:
    nodes = [node(1, [], size=8), node(2, [], size=8, model="V100")]
    assert never_fits(Pending("ok", 8), nodes) is None
    assert never_fits(Pending("gang", 16), nodes) is None
    assert "largest node has 8" in (never_fits(Pending("big", 17), nodes) or "")
    assert "no node has H100" in (never_fits(Pending("h", 1, gpu_model="H100"), nodes) or "")
    either = Pending("h", 1, gpu_model="H100|L40S")
    assert "no node has H100 or L40S GPUs" in (never_fits(either, nodes) or "")
    msg = never_fits(Pending("m", 1, min_memory_mib=80000), nodes) or ""
    assert "at least 80000 MiB" in msg
    assert "largest node has 8" in (never_fits(Pending("a", 9, gpu_model="A100"), nodes) or "")
    assert "may hold at most 6" in (never_fits(Pending("q", 7, group="b"), nodes, QUOTAS) or "")
    assert never_fits(Pending("q", 6, group="b"), nodes, QUOTAS) is None
    assert never_fits(Pending("any", 64), []) is None  # no nodes yet: cannot judge


def test_a_round_reclaims_for_a_bounded_number_of_calls_and_says_so() -> None:
    running = [run(f"b{i}", 1 + i // 4, (i % 4,), "b", start=i) for i in range(8)]
    quotas = {"a": Quota(6), "b": Quota(0)}
    pending = [Pending(f"a{i}", 1, group="a") for i in range(6)]
    snap = Snapshot([node(1, []), node(2, [])], pending, running, quotas=quotas)
    out = plan(snap, Fair(max_reclaims=2))
    assert len(out.preemptions) == 2 and out.more
    everything = plan(snap, "fair")
    assert len(everything.preemptions) == 6 and not everything.more
    assert [p.invocation_id for p in everything.preemptions][:2] == ["b7", "b6"]  # youngest


def test_the_starvation_guard_reserves_room_for_a_long_waiting_big_call() -> None:
    # c's 4-GPU call is above its guarantee; small borrowers would take every freed GPU.
    running = [run("x", 1, (0, 1), "b", start=0, expected_s=100.0)]
    pending = [Pending("big", 4, group="c", submit_time=0), Pending("small", 1, group="b",
               submit_time=900, expected_s=500.0)]  # fmt: skip
    quotas = {"b": Quota(2), "c": Quota(2)}
    snap = Snapshot([node(1, [2, 3])], pending, running, quotas=quotas, now=1000)
    assert [d.invocation_id for d in plan(snap, "fair")] == ["small"]
    guarded = Fair(starve_after_s=600)
    assert plan(snap, guarded) == []
    assert "reserved for it" in explain(snap, guarded)["big"][1]


#: fair with the starvation guard on, at its usual bound.
# The guard alone (an hour: the times below are built for it; LAS off).
GUARD = Fair(starve_after_s=3600.0, las_thresholds=())


def starving_cluster(now: float, pending_more: list[Pending]) -> Snapshot:
    """Group c's whole-node (4-GPU) call has waited 2 h; node 1 frees up at t=now+100 (x
    ends), node 2 at now+5000 (y ends); group b holds both nodes' busy GPUs as borrowers."""
    running = [
        run("x", 1, (0, 1), "b", start=0, expected_s=now + 100.0),
        run("y", 2, (0, 1, 2), "b", start=0, expected_s=now + 5000.0),
    ]
    pending = [Pending("big", 4, group="c", submit_time=now - 7200), *pending_more]
    quotas = {"a": Quota(2), "b": Quota(0), "c": Quota(0)}
    return Snapshot([node(1, [2, 3]), node(2, [3])], pending, running, quotas=quotas, now=now)


def test_the_guard_holds_a_starving_whole_node_call_s_room_against_guaranteed_calls() -> None:
    # a's 1-GPU call is within a's guarantee and would run for an hour: it would take node 1's
    # free GPUs and push big's reservation back by that hour. It gets node 2's free GPU; the
    # second one is kept off node 1 and, held out only by the reservation, reclaims nothing.
    a1 = Pending("a1", 1, group="a", submit_time=9_000, expected_s=3600.0)
    a2 = Pending("a2", 1, group="a", submit_time=9_001, expected_s=3600.0)
    snap = starving_cluster(10_000, [a1, a2])
    out = plan(snap, GUARD)
    assert [(d.invocation_id, d.node_id) for d in out] == [("a1", 2)]
    assert out.preemptions == []
    why = explain(snap, GUARD)
    assert "reserved for it" in why["big"][1]
    assert "reserved for call big" in why["a2"][1] and "nothing is reclaimed" in why["a2"][1]
    # Without the guard the second call takes node 1 for an hour, and big waits on.
    free = plan(snap, Fair(starve_after_s=None))
    assert [(d.invocation_id, d.node_id) for d in free] == [("a1", 2), ("a2", 1)]


def test_the_guard_reserves_for_the_oldest_starving_call_of_each_group() -> None:
    # Three busy 4-GPU nodes free up one after the other. Group a has two whole-node calls
    # that starved, c one, younger than both: a's first and c's get the first two nodes; a's
    # second waits for a's first to start (before, a's two took the first two nodes and c's
    # call, stuck behind another group's calls, came last).
    now = 20_000
    running = [run(f"x{i}", i, (0, 1, 2, 3), "b", start=0, expected_s=now + 100.0 * i)
               for i in (1, 2, 3)]  # fmt: skip
    pending = [Pending("a1", 4, group="a", submit_time=now - 9000),
               Pending("a2", 4, group="a", submit_time=now - 8000),
               Pending("c1", 4, group="c", submit_time=now - 7200)]  # fmt: skip
    quotas = {"a": Quota(0), "b": Quota(0), "c": Quota(0)}
    nodes = [node(i, []) for i in (1, 2, 3)]
    out = plan(Snapshot(nodes, pending, running, quotas=quotas, now=now), GUARD)
    assert out.reserved == {"a1": now + 100.0, "c1": now + 200.0}
    # Once a's first has started, its second is the group's oldest; older than c's call, but
    # c's was reserved for last round and keeps its turn (else the older call, served first,
    # would take the room promised to it).
    running = [*running[1:], run("a1", 1, (0, 1, 2, 3), "a", start=now + 100,
                                 expected_s=1000.0)]  # fmt: skip
    snap = Snapshot(nodes, pending[1:], running, quotas=quotas, now=now + 100,
                    reserved={"c1": now + 200.0})  # fmt: skip
    assert plan(snap, GUARD).reserved == {"c1": now + 200.0, "a2": now + 300.0}


def test_a_call_that_ends_before_the_reservation_may_use_its_gpus() -> None:
    quick = Pending("quick", 2, group="b", submit_time=9_500, expected_s=50.0)
    slow = Pending("slow", 1, group="b", submit_time=9_600, expected_s=500.0)
    out = plan(starving_cluster(10_000, [quick, slow]), GUARD)
    assert {(d.invocation_id, d.node_id) for d in out} == {("quick", 1), ("slow", 2)}


def test_a_short_call_backfills_behind_a_long_one_of_its_kind_that_could_not() -> None:
    # b's two 1-GPU borrowers are alike but for their durations: the first would delay big's
    # reservation (node 1) and node 2's free GPU went to an earlier call; the second ends
    # before the reservation is due and takes a reserved GPU (a round skips calls like one
    # that found no room only while no reservation is open).
    first = Pending("first", 1, group="b", submit_time=9_400, expected_s=10.0)
    slow = Pending("slow", 1, group="b", submit_time=9_500, expected_s=500.0)
    quick = Pending("quick", 1, group="b", submit_time=9_600, expected_s=50.0)
    out = plan(starving_cluster(10_000, [first, slow, quick]), GUARD)
    assert {(d.invocation_id, d.node_id) for d in out} == {("first", 2), ("quick", 1)}


def test_a_borrower_may_not_backfill_where_a_guaranteed_call_waits() -> None:
    # a's call waits for node 1's reserved GPUs (it would not end before big starts); b's
    # quick borrower would end in time, but taking them would leave a's call nothing idle to
    # wait on: it would reclaim the borrower, which would backfill again, round after round.
    waiting = Pending("a1", 2, group="a", submit_time=9_000, expected_s=3600.0)
    quick = Pending("quick", 2, group="b", submit_time=9_500, expected_s=50.0)
    out = plan(starving_cluster(10_000, [waiting, quick]), GUARD)
    assert list(out) == [] and out.preemptions == []
    alone = plan(starving_cluster(10_000, [quick]), GUARD)  # nobody waits: it backfills
    assert [(d.invocation_id, d.node_id) for d in alone] == [("quick", 1)]


def test_only_whole_node_calls_past_the_bound_get_reservations() -> None:
    now = 10_000.0
    for call, guarded in [
        (Pending("big", 4, group="c", submit_time=now - 7200), True),
        (Pending("big", 4, group="c", submit_time=now - 600), False),  # not waited long enough
        (Pending("big", 3, group="c", submit_time=now - 7200), False),  # less than a node
        # Preempted an hour and a half after it was submitted: it has waited only 10 minutes.
        (Pending("big", 4, group="c", submit_time=now - 7200, queued_time=now - 600), False),
    ]:
        # small needs node 1's two free GPUs for longer than node 1 takes to free up.
        small = Pending("small", 2, group="b", submit_time=now - 60, expected_s=9_000.0)
        snap = starving_cluster(now, [small])
        snap = Snapshot(snap.nodes, [call, small], snap.running, snap.quotas, now=now)
        started = [d.invocation_id for d in plan(snap, GUARD)]
        assert ("small" in started) is not guarded, call
        assert ("reserved for it" in explain(snap, GUARD)["big"][1]) is guarded, call


def starved_share_cluster(now: float, others: list[Pending], w_waited: float) -> Snapshot:
    """starving_cluster with a third node, which "w" holds: a whole-node call that waited
    ``w_waited`` before it started; ``small`` (2 GPUs) waits on node 1."""
    small = Pending("small", 2, group="b", submit_time=now - 60, expected_s=9_000.0)
    snap = starving_cluster(now, [small, *others])
    w = Running("w", 3, (0, 1, 2, 3), group="c", start_time=now - 50,
                queued_time=now - 50 - w_waited)  # fmt: skip
    return Snapshot([*snap.nodes, node(3, [])], snap.pending, [*snap.running, w], snap.quotas,
                    now=now)  # fmt: skip


def test_starved_whole_node_calls_take_the_cluster_in_proportion_to_what_they_ask() -> None:
    # big (4 GPUs) has waited two hours; w (4 GPUs) ran after a long wait. Starved whole-node
    # calls may hold their share of the GPUs that calls which waited that long ask for or
    # hold, of the 12-GPU cluster: next to six 3-GPU calls that is 8/26 (3.7 GPUs), less than
    # w holds, and big gets no reservation (small starts on node 1, as without the guard).
    # Next to nothing else, or a 1-GPU call no node can take (neither a whole-node call nor
    # one the guard stops at), big keeps node 1.
    now = 10_000.0
    threes = [Pending(f"other{i}", 3, group="d", submit_time=now - 7200) for i in range(6)]
    h100 = Pending("other", 1, group="d", submit_time=now - 7300, gpu_model="H100")
    for others, guarded in [(threes, False), ([], True), ([h100], True)]:
        snap = starved_share_cluster(now, others, 8000)
        started = [d.invocation_id for d in plan(snap, GUARD)]
        assert ("small" in started) is not guarded, others
        assert ("reserved for it" in explain(snap, GUARD)["big"][1]) is guarded, others
    # w counts because it starved: one that started as soon as it was queued does not.
    snap = starved_share_cluster(now, threes, 10)
    assert "small" not in [d.invocation_id for d in plan(snap, GUARD)]


def test_a_call_reserved_for_last_round_keeps_its_reservation_beyond_the_share() -> None:
    now = 10_000.0
    threes = [Pending(f"other{i}", 3, group="d", submit_time=now - 7200) for i in range(6)]
    snap = starved_share_cluster(now, threes, 8000)
    assert "big" not in plan(snap, GUARD).reserved
    kept = Snapshot(snap.nodes, snap.pending, snap.running, snap.quotas, now=now,
                    reserved={"big": 0.0})  # fmt: skip
    out = plan(kept, GUARD)
    assert "big" in out.reserved and "small" not in [d.invocation_id for d in out]


def test_a_call_bigger_than_its_share_still_gets_its_turn() -> None:
    # Two busy 8-GPU nodes; a 16-GPU gang and a 1-GPU call have both waited two hours. The
    # gang's share is 16/17 of the cluster, less than it needs: it is let in all the same
    # (the share is not yet spent), else it would wait for as long as anyone else did.
    now = 10_000.0
    running = [run(f"r{i}", i, tuple(range(8)), "b", start=0, expected_s=now + 100.0 * i)
               for i in (1, 2)]  # fmt: skip
    pending = [Pending("gang", 16, group="c", submit_time=now - 7200),
               Pending("one", 1, group="b", submit_time=now - 7200)]  # fmt: skip
    snap = Snapshot([node(1, [], size=8), node(2, [], size=8)], pending, running,
                    quotas={"b": Quota(0), "c": Quota(0)}, now=now)  # fmt: skip
    assert plan(snap, GUARD).reserved == {"gang": now + 200.0}


def two_borrowers() -> list[Running]:
    """b's borrowers on GPUs 0-1 of nodes 1 and 2: "old" started after waiting two hours,
    "new" (the older run) at once."""
    return [
        Running("old", 1, (0, 1), group="b", start_time=10_000, borrowed=True,
                queued_time=10_000 - 7200),
        Running("new", 2, (0, 1), group="b", start_time=9_000, borrowed=True,
                queued_time=9_000),
    ]  # fmt: skip


def test_a_gang_that_starved_is_not_reclaimed_once_it_runs() -> None:
    # Group a (guarantee 4) wants its GPUs back from b's borrowers, each a gang on two whole
    # 2-GPU nodes: the one that waited two hours before it started (the guard's kind of
    # call, and the hardest to place again) is left alone, the one that started at once is
    # preempted.
    running = [dataclasses.replace(r, node_id=2 * i + 1, more=(Part(2 * i + 2, (0, 1)),))
               for i, r in enumerate(two_borrowers())]  # fmt: skip
    quotas = {"a": Quota(4), "b": Quota(0)}
    nodes = [node(i, [], size=2) for i in (1, 2, 3, 4)]
    snap = Snapshot(nodes, [Pending("a1", 4, group="a")], running, quotas=quotas, now=10_100)
    assert [p.invocation_id for p in plan(snap, GUARD).preemptions] == ["new"]
    unguarded = plan(snap, Fair(starve_after_s=None)).preemptions
    assert [p.invocation_id for p in unguarded] == ["old"]  # the youngest, without the guard


def test_a_whole_node_call_on_one_node_that_starved_may_be_reclaimed() -> None:
    # The same borrowers each on one whole 2-GPU node: kept in place, every such call on an
    # overloaded cluster (where all of them wait past the bound) froze much of the cluster
    # (session 20). The youngest goes, as without the guard; the guard serves it again.
    running = two_borrowers()
    quotas = {"a": Quota(2), "b": Quota(0)}
    snap = Snapshot([node(1, [], size=2), node(2, [], size=2)], [Pending("a1", 2, group="a")],
                    running, quotas=quotas, now=10_100)  # fmt: skip
    assert [p.invocation_id for p in plan(snap, GUARD).preemptions] == ["old"]


def test_a_smaller_call_that_waited_as_long_may_be_reclaimed() -> None:
    # The same two borrowers on half of 4-GPU nodes: not the guard's kind of call, so the
    # wait does not protect them (overloaded, every call waits past the bound, and a
    # guarantee must still be honoured): the youngest goes, as without the guard.
    running = two_borrowers()
    quotas = {"a": Quota(4), "b": Quota(0)}
    snap = Snapshot([node(1, [2, 3]), node(2, [2, 3])], [Pending("a1", 4, group="a")], running,
                    quotas=quotas, now=10_100)  # fmt: skip
    assert [p.invocation_id for p in plan(snap, GUARD).preemptions] == ["old"]


def gang_cluster(busy_small: bool) -> list[NodeCapacity]:
    """Two free 8-GPU nodes and a 4-GPU node, busy (group b holds it) or free."""
    return [
        node(1, [0, 1, 2, 3, 4, 5, 6, 7], size=8),
        node(2, [0, 1, 2, 3, 4, 5, 6, 7], size=8),
        node(3, [] if busy_small else [0, 1, 2, 3]),
    ]


def test_a_gang_takes_the_fewest_whole_gpus_and_never_passes_its_ceiling() -> None:
    # The case hypothesis found: group a holds 1 of at most 13 GPUs and asks for 12, more than
    # any node has. Two whole 8-GPU nodes would give it 16 (a at 17); an 8 and a 4 give 12.
    nodes = [node(0, [], size=4), *gang_cluster(busy_small=False)]
    running = [
        run("a0", 0, (0,), "a", start=0, borrowed=False, preemptible=False),
        run("gone", 0, (1, 2, 3), "a", start=0, preempting=True),
    ]
    quotas = {"a": Quota(0, 13)}
    snap = Snapshot(nodes, [Pending("g", 12, group="a")], running, quotas=quotas, now=50)
    (d,) = plan(snap, "fair")
    assert [(p.node_id, len(p.gpu_indices)) for p in d.parts] == [(1, 8), (3, 4)]
    assert d.borrowed
    # With the 4-GPU node busy, only 16 GPUs would do: the gang waits, and says why.
    running.append(run("b0", 3, (0, 1, 2, 3), "b", start=0))
    snap = Snapshot([*nodes[:3], node(3, [])], [Pending("g", 12, group="a")], running,
                    quotas=quotas, now=50)  # fmt: skip
    assert list(plan(snap, "fair")) == []
    reason = explain(snap, "fair")["g"][1]
    assert "quota ceiling" in reason and "would take 16" in reason
    assert list(plan(snap, Fair(starve_after_s=0))) == []  # nor does the guard bend it


def test_a_gang_within_its_guarantee_reclaims_whole_nodes_within_its_ceiling() -> None:
    # a may hold 13; the free 8-GPU nodes alone would give its 12-GPU gang 16, so reclaim
    # clears the 4-GPU node b borrows instead, and a's book is charged the 12 it will take.
    running = [run("b0", 3, (0, 1, 2, 3), "b", start=0)]
    quotas = {"a": Quota(12, 1), "b": Quota(0)}
    pending = [Pending("g", 12, group="a"), Pending("a1", 1, group="a"),
               Pending("a2", 1, group="a")]  # fmt: skip
    snap = Snapshot(gang_cluster(busy_small=True), pending, running, quotas=quotas)
    out = plan(snap, "fair")
    assert [p.invocation_id for p in out.preemptions] == ["b0"]
    assert [d.invocation_id for d in out] == ["a1"]  # 12 promised + 1: at the ceiling


def test_never_fits_a_gang_whose_whole_nodes_pass_its_ceiling() -> None:
    quotas = {"a": Quota(0, 13)}
    eights = gang_cluster(busy_small=False)[:2]
    msg = never_fits(Pending("g", 12, group="a"), eights, quotas) or ""
    assert "have 16 GPUs" in msg and "may hold at most 13" in msg
    assert never_fits(Pending("g", 16, group="a"), eights, {"a": Quota(0, 16)}) is None
    # An 8 and a 4 hold it in 12, even while the 4-GPU node is busy: it waits, never refused.
    assert never_fits(Pending("g", 12, group="a"), gang_cluster(True), quotas) is None
    assert never_fits(Pending("g", 13, group="a"), gang_cluster(True), quotas) is not None


def test_a_flood_of_whole_node_calls_gets_no_reservation_past_its_group_s_ceiling() -> None:
    # Group x may hold 4 GPUs and holds them; it floods the queue with whole-node calls that
    # all waited two hours. They get no reservation (nor enlarge what y's call may take):
    # y's call, younger, gets node 1's room.
    now = 10_000.0
    running = [run("x0", 1, (0, 1), "x", start=0, expected_s=now + 100.0),
               run("x1", 2, (0, 1), "x", start=0, expected_s=now + 100.0)]  # fmt: skip
    flood = [Pending(f"f{i}", 4, group="x", submit_time=now - 9000 + i) for i in range(20)]
    mine = Pending("y1", 4, group="y", submit_time=now - 7200)
    snap = Snapshot([node(1, [2, 3]), node(2, [2, 3])], [*flood, mine], running,
                    quotas={"x": Quota(0, 4), "y": Quota(0)}, now=now)  # fmt: skip
    out = plan(snap, GUARD)
    assert set(out.reserved) == {"y1"}
    assert "quota ceiling" in explain(snap, GUARD)["f0"][1]


def test_reclaim_preempts_a_gang_on_two_cleared_nodes_once() -> None:
    g2 = tuple(Gpu(i, "") for i in range(2))
    nodes = [NodeCapacity(i, [], 0, g2) for i in range(3)]
    running = [
        Running("0", 0, (0,), "u1", "a", start_time=0.0, expected_s=48),
        Running("1", 0, (1,), "u1", "b", start_time=18.5, expected_s=185, borrowed=True),
        Running("2", 1, (0, 1), "u1", "b", start_time=27.4, expected_s=31, borrowed=True,
                more=(Part(2, (0, 1)),)),
    ]  # fmt: skip
    snap = Snapshot(nodes, [Pending("3", 3, "u1", "a", submit_time=37.0, expected_s=98)],
                    running, {"a": Quota(6, 1), "b": Quota(0, 6)}, now=37.0)  # fmt: skip
    victims = [p.invocation_id for p in plan(snap, Fair()).preemptions]
    assert victims == ["2"], "the gang on nodes 1 and 2 is told to stop once"


def test_a_user_s_calls_of_one_class_go_shortest_expected_first() -> None:
    # One free GPU. ann queued a long call, then one without a duration, then a short one:
    # the short one starts (her own order only); in queue order, the first.
    free = [node(1, [0])]
    mine = [Pending("long", 1, "ann", "a", submit_time=1.0, expected_s=9_000.0),
            Pending("blind", 1, "ann", "a", submit_time=2.0),
            Pending("short", 1, "ann", "a", submit_time=3.0, expected_s=60.0)]  # fmt: skip
    snap = Snapshot(free, mine, [], {"a": Quota(4)}, now=10.0)
    assert [d.invocation_id for d in plan(snap, Fair())] == ["short"]
    assert [d.invocation_id for d in plan(snap, Fair(shortest_first=False))] == ["long"]
    two = dataclasses.replace(snap, nodes=[node(1, [0, 1])])
    assert [d.invocation_id for d in plan(two, Fair())] == ["short", "long"]  # (blind last)
    # Another user's shorter call does not go ahead of ann's: buckets keep fair order
    # (equal usage: by name), whatever durations their calls claim.
    bob = Pending("bob", 1, "bob", "a", submit_time=0.0, expected_s=1.0)
    both = dataclasses.replace(snap, pending=[bob, *mine])
    assert [d.invocation_id for d in plan(both, Fair())] == ["short"]
