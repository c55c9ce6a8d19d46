"""The starvation guard and what it keeps in place, on clusters of mixed node sizes, with
quotas per GPU model and across rounds: cases a review of the guard per group found
(scheduler.fair, scheduler.reclaim, scheduler.quotas)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Gpu, NodeCapacity, Pending, Plan, Quota, Running, Snapshot, plan
from scheduler.fair import Fair, _served
from scheduler.replay import Cluster, Simulator
from scheduler.traces import Job
from tests.unit.test_scheduler_invariants import reservations_kept

NOW = 100_000.0
GUARD = Fair(starve_after_s=3600.0, las_thresholds=())
LAS = Fair(las_thresholds=(3_600.0, 36_000.0), min_run_s=600.0)


def node(i: int, free: list[int], size: int = 4, model: str = "A100") -> NodeCapacity:
    return NodeCapacity(i, free, 0, tuple(Gpu(g, model, 40960) for g in range(size)))


def preempted(out: Plan) -> set[str]:
    return {p.invocation_id for p in out.preemptions}


# --- only whole-node calls of their kind are kept in place (reclaim.protected) -------------


def test_mixed_sizes_a_small_call_on_a_small_node_is_not_the_guard_s_kind() -> None:
    # A 4-GPU node and an 8-GPU node. b's 4-GPU borrower waited 2 h and landed on the 4-GPU
    # node: it is not a whole-node call for the guard (the largest node has 8), yet
    # protected() shelters it because it happens to fill its (small) node. Group a, within
    # its guarantee of 4, can then reclaim nothing and never gets its guarantee.
    running = [
        Running("b8", 2, tuple(range(8)), group="b", start_time=NOW - 600, preemptible=False),
        Running("b4", 1, (0, 1, 2, 3), group="b", start_time=NOW - 600, borrowed=True,
                queued_time=NOW - 600 - 7200),
    ]
    quotas = {"a": Quota(4), "b": Quota(8)}
    snap = Snapshot([node(1, [], 4), node(2, [], 8)], [Pending("a1", 4, group="a",
                    submit_time=NOW - 10)], running, quotas, now=NOW)
    # The same borrower on half of an 8-GPU node is reclaimed (control):
    fill = Running("b4'", 1, (4, 5, 6, 7), group="b", start_time=NOW - 600, preemptible=False)
    control = Snapshot([node(1, [], 8), node(2, [], 8)],
                       [Pending("a1", 4, group="a", submit_time=NOW - 10)],
                       [*running, fill], quotas, now=NOW)
    assert preempted(plan(control, GUARD)) == {"b4"}
    assert preempted(plan(snap, GUARD)) == {"b4"}  # (it was protected)


def test_mixed_sizes_las_swaps_a_small_call_on_a_small_node() -> None:
    # Same gap for least attained service: a 4-GPU run of the asking group's own, that
    # waited past the bound and fills a 4-GPU node (with an 8-GPU node in the cluster).
    policy = Fair(starve_after_s=3600.0, las_thresholds=(3_600.0, 36_000.0))
    running = [
        Running("big", 2, tuple(range(8)), group="g", start_time=NOW - 600,
                attained_gpu_s=0.0, preemptible=False),
        Running("old", 1, (0, 1, 2, 3), group="g", start_time=NOW - 3600,
                attained_gpu_s=50_000.0, queued_time=NOW - 3600 - 7200),
    ]
    snap = Snapshot([node(1, [], 4), node(2, [], 8)],
                    [Pending("new", 4, group="g", submit_time=NOW - 10)], running,
                    {"g": Quota(0)}, now=NOW)
    assert preempted(plan(snap, policy)) == {"old"}


def test_las_never_takes_a_group_below_its_total_guarantee_with_model_quotas() -> None:
    # h: 8 guaranteed in all, 4 of them A100. It holds 8 A100 (4 above the A100 guarantee:
    # h2 is borrowed) and 2 V100: 10 GPUs, 2 above its guarantee. Taking h2 (4 GPUs) leaves
    # h 6 < 8. reclaimable(keep=True) checks only the A100 count (8 - 4 >= 4) for a run on
    # listed models, never the group's total.
    quotas = {"g": Quota(0), "h": Quota(8, None, (("A100", Quota(4)),))}
    running = [
        Running("h1", 0, (0, 1, 2, 3), group="h", start_time=NOW - 3600, queued_time=NOW - 3700),
        Running("h2", 0, (4, 5, 6, 7), group="h", start_time=NOW - 3600, borrowed=True,
                attained_gpu_s=50_000.0, queued_time=NOW - 3700),
        Running("h3", 1, (0, 1), group="h", start_time=NOW - 3600, borrowed=True,
                queued_time=NOW - 3700),
    ]
    snap = Snapshot([node(0, [], 8, "A100"), node(1, [], 2, "V100")],
                    [Pending("new", 4, group="g", submit_time=NOW - 10)], running, quotas,
                    now=NOW)
    out = plan(snap, LAS)
    left = 10 - sum(r.gpus for r in running if r.id in preempted(out))
    assert left >= 8, (preempted(out), left)


def P(i: str, group: str, t: float, gpus: int = 4) -> Pending:
    return Pending(i, gpus, group=group, submit_time=t)


def test_the_guard_serves_reserved_calls_first_then_each_group_s_first() -> None:
    starving = [P("a1", "a", 1), P("a2", "a", 2), P("b1", "b", 3), P("c1", "c", 4)]
    order, heads = _served(starving, {"gone": 0.0, "c1": 5.0, "a2": 6.0})
    assert [c.id for c in order] == ["c1", "a2", "a1", "b1"]
    assert [c.id for c in heads] == ["c1", "a2", "b1"]  # (unknown reserved ids dropped)
    # A reserved call whose group changed is served under its group of now.
    order, heads = _served([P("a1", "a", 1), P("b1", "b", 3), P("c1", "a", 4)], {"c1": 5.0})
    assert [c.id for c in heads] == ["c1", "b1"]


# --- a group's call the guard cannot serve does not block the group's next -----------------


LATER = 20_000.0
#: Group a's first starving call cannot be served this round, its second can: (its calls,
#: what runs, quotas, nodes). First, a 16-GPU gang past a's ceiling (a holds 4 of 16);
#: second, an H100 call while a holds its H100 ceiling (no model left to it).
BLOCKED_HEADS = {
    "past its ceiling": (
        [Pending("gang", 16, group="a", submit_time=LATER - 9000),
         Pending("a8", 8, group="a", submit_time=LATER - 8000)],
        [Running("x1", 1, tuple(range(8)), group="b", borrowed=True, expected_s=LATER + 100),
         Running("x2", 2, tuple(range(8)), group="b", borrowed=True, expected_s=LATER + 200),
         Running("mine", 3, tuple(range(4)), group="a", borrowed=True,
                 expected_s=LATER + 5000)],
        {"a": Quota(0, 16), "b": Quota(0)},
        [node(1, [], 8), node(2, [], 8), node(3, [4, 5, 6, 7], 8)],
    ),
    "no model left to it": (
        [Pending("h8", 8, group="a", submit_time=LATER - 9000, gpu_model="H100"),
         Pending("a8", 8, group="a", submit_time=LATER - 8000, gpu_model="A100")],
        [Running("x1", 1, tuple(range(8)), group="b", borrowed=True, expected_s=LATER + 100),
         Running("h", 2, tuple(range(8)), group="a", borrowed=True, expected_s=LATER + 5000)],
        {"a": Quota(0, None, (("H100", Quota(0, 8)),)), "b": Quota(0)},
        [node(1, [], 8, "A100"), node(2, [], 8, "H100")],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BLOCKED_HEADS))
def test_a_group_s_starving_call_the_guard_cannot_serve_does_not_block_the_next(
    case: str,
) -> None:
    # The guard must serve a's younger call, a8 (session 17's guard per group served each
    # group's first starving call only: skipped, a got no reservation at all).
    pending, running, quotas, nodes = BLOCKED_HEADS[case]
    out = plan(Snapshot(nodes, pending, running, quotas=quotas, now=LATER), GUARD)
    assert "a8" in out.reserved, out.reserved


# --- a reserved call that reclaims keeps its turn ------------------------------------------


def test_a_reserved_call_that_reclaims_keeps_its_turn_and_starts_in_time() -> None:
    # Found by test_a_reserved_call_starts_no_later_than_its_reservation with more examples:
    # b's 4-GPU call (job 6) is reserved for t=166 at t=31; at t=164 it reclaims a 1-GPU
    # borrower instead of waiting 2 s. It must keep its turn (Plan.reserved) so that the next
    # round, at the same instant, gives it the room it reclaimed, not a's gang.
    specs = [(0, 31, 3, "a"), (0, 164, 8, "b"), (0, 168, 1, "a"), (1, 5, 8, "a"),
             (0, 166, 1, "a"), (1, 5, 8, "a"), (1, 5, 4, "b")]
    jobs = sorted((Job(str(i), float(t), float(d), g, group=grp)
                   for i, (t, d, g, grp) in enumerate(specs)), key=lambda j: j.submit)
    quotas = {"a": Quota(0), "b": Quota(4), "c": Quota(0)}
    sim = Simulator(jobs, Fair(starve_after_s=30.0), Cluster.uniform(4, 4), quotas)
    assert reservations_kept(sim) == {}  # (it was {6: (169.0, 166.0)})
    assert len(sim.completed) == len(jobs)


# --- found by the review, fixed in session 19 ----------------------------------------------


def test_a_reserved_borrower_does_not_take_room_reclaimed_for_an_older_guaranteed_call() -> None:
    # 3 x 4-GPU nodes. b (guaranteed 8) holds node 1 (ends now+100) and node 2 nominally
    # and borrows node 3. Two starving whole-node calls: a's A (older, within a's guarantee
    # of 4) and c's C (c guaranteed nothing), which the previous round reserved for.
    now = 20_000.0
    nodes = [node(1, []), node(2, []), node(3, [])]
    x = [Running("x1", 1, (0, 1, 2, 3), group="b", start_time=0, expected_s=now + 100.0),
         Running("x2", 2, (0, 1, 2, 3), group="b", start_time=0, expected_s=now + 9000.0),
         Running("x3", 3, (0, 1, 2, 3), group="b", start_time=10, borrowed=True,
                 expected_s=now + 9000.0)]
    A = Pending("A", 4, group="a", submit_time=now - 9000)
    C = Pending("C", 4, group="c", submit_time=now - 8000)
    quotas = {"a": Quota(4), "b": Quota(8), "c": Quota(0)}
    r1 = plan(Snapshot(nodes, [A, C], x, quotas=quotas, now=now, reserved={"C": now + 100}),
              GUARD)
    assert preempted(r1) == {"x3"} and r1.reserved == {"C": now + 100.0}  # reclaimed for A
    assert r1.promised == {"A": (3,)}  # (the room is A's: the leader keeps promises)
    # Next instant: x3 has gone, node 3 is free. It was reclaimed for A (guaranteed).
    nodes2 = [node(1, []), node(2, []), node(3, [0, 1, 2, 3])]
    r2 = plan(Snapshot(nodes2, [A, C, Pending("x3", 4, group="b", submit_time=10,
                                              queued_time=now)],
                       x[:2], quotas=quotas, now=now + 1, reserved=dict(r1.reserved),
                       reserved_on=dict(r1.reserved_on), promised=dict(r1.promised)), GUARD)
    started = {d.invocation_id: d.node_id for d in r2}
    assert started.get("A") == 3, (started, r2.reserved)
    assert r2.reserved == {"C": now + 100.0}  # C still waits for node 1, due as before


def test_two_reservations_due_together_on_mixed_nodes_both_start() -> None:
    # Last round reserved the 12-GPU gang G on the three 4-GPU nodes and B (8 GPUs) on the
    # 8-GPU node, both due now. Now all four nodes are free: both fit, and G must start where
    # it was reserved, not where placement likes best (8 + 4), or B, reserved for now, waits.
    now = 20_000.0
    nodes = [node(0, [0, 1, 2, 3]), node(1, [0, 1, 2, 3]), node(2, [0, 1, 2, 3]),
             node(3, list(range(8)), 8)]
    pending = [Pending("G", 12, group="c", submit_time=now - 9000),
               Pending("B", 8, group="b", submit_time=now - 8000)]
    snap = Snapshot(nodes, pending, [], quotas={}, now=now, reserved={"G": now, "B": now},
                    reserved_on={"G": (0, 1, 2), "B": (3,)})
    out = plan(snap, GUARD)
    assert {d.invocation_id: (d.node_id, *(p.node_id for p in d.more)) for d in out} == {
        "G": (0, 1, 2), "B": (3,)}  # fmt: skip
    # The reservations say where: a round that reserves says so for the next.
    busy = [node(0, []), node(1, []), node(2, []), node(3, [], 8)]
    running = [Running(str(i), i, tuple(range(4 if i < 3 else 8)), group="x", start_time=0,
                       expected_s=now + 60 * (i + 1)) for i in range(4)]  # fmt: skip
    out = plan(Snapshot(busy, pending, running, quotas={}, now=now), GUARD)
    assert out.reserved_on == {"G": (0, 1, 2), "B": (3,)}
    # A node reserved on that is not free (its call overran) sends the call elsewhere.
    late = Snapshot([node(0, [0, 1, 2, 3]), *nodes[1:], node(4, list(range(8)), 8)],
                    [pending[1]], [], quotas={}, now=now, reserved={"B": now},
                    reserved_on={"B": (5,)})  # (no node 5 now)
    assert [d.invocation_id for d in plan(late, GUARD)] == ["B"]


def test_a_gang_due_does_not_take_the_node_reserved_for_another() -> None:
    # Found by a review of an earlier attempt (a due call started on the nodes a reservation
    # made afresh would take: the first two 8-GPU nodes, all nodes being ready now): nodes of
    # 8, 8 and 4 GPUs; G (12) was reserved on node 2 and node 0, B (8) on node 1, both due
    # now, all free. Both must start.
    now = 442.0
    nodes = [node(0, list(range(8)), 8), node(1, list(range(8)), 8), node(2, [0, 1, 2, 3])]
    pending = [Pending("G", 12, group="b", submit_time=224.0),
               Pending("B", 8, group="c", submit_time=272.0)]
    snap = Snapshot(nodes, pending, [], quotas={}, now=now, reserved={"G": now, "B": now},
                    reserved_on={"G": (2, 0), "B": (1,)})
    out = plan(snap, Fair(starve_after_s=30.0, las_thresholds=()))
    assert {d.invocation_id for d in out} == {"G", "B"}


# (Mixed: a node mixing models, one GPU busy for long, makes the guard reserve by passing over the
# nodes, not by its horizon of ready times; a call of either model walks reclaim's
# candidates for a constrained call.)
VARIANTS = pytest.mark.parametrize(("mixed", "model"), [(False, None), (True, None),
                                                        (False, "H100|A100")])


def busy_mixed(now: float) -> tuple[list[NodeCapacity], list[Running]]:
    gpus = (Gpu(0, "H100", 40960), Gpu(1, "A100", 40960))
    return ([NodeCapacity(9, [1], 0, gpus)],
            [Running("m", 9, (0,), group="d", start_time=0, expected_s=now * 9)])


@VARIANTS
def test_a_reserved_call_that_fits_elsewhere_leaves_another_reservation_s_room(
    mixed: bool, model: str | None
) -> None:
    # X (any model) was reserved on the H100 node 0, due in 100 s; Y (A100 only) on the A100
    # node 1, due in 300 s. Node 1's call ended early: it is free now. X goes first (it was
    # reserved first) and fits node 1 now; taking it, Y (no other A100) would wait for X to
    # end, long past its reservation. X keeps to its own node; Y starts now.
    now = 20_000.0
    nodes = [node(0, [], 8, "H100"), node(1, list(range(8)), 8)]
    busy = [Running("r", 0, tuple(range(8)), group="c", start_time=0, expected_s=now + 100.0)]
    if mixed:
        nodes, busy = nodes + busy_mixed(now)[0], busy + busy_mixed(now)[1]
    pending = [Pending("X", 8, group="a", submit_time=now - 9000, expected_s=50_000.0,
                       gpu_model=model),
               Pending("Y", 8, group="b", submit_time=now - 8000, gpu_model="A100")]
    snap = Snapshot(nodes, pending, busy, quotas={}, now=now,
                    reserved={"X": now + 100, "Y": now + 300},
                    reserved_on={"X": (0,), "Y": (1,)})
    out = plan(snap, GUARD)
    assert [(d.invocation_id, d.node_id) for d in out] == [("Y", 1)]
    assert out.reserved == {"X": now + 100}
    # X may start there if it ends before Y is due (backfill), and Y's room is its own only
    # while Y still waits: once Y is gone, X takes node 1.
    short = dataclasses.replace(pending[0], expected_s=200.0)
    snap = dataclasses.replace(snap, pending=[short, pending[1]])
    assert {d.invocation_id for d in plan(snap, GUARD)} == {"X"}
    gone = dataclasses.replace(snap, pending=pending[:1])
    assert [(d.invocation_id, d.node_id) for d in plan(gone, GUARD)] == [("X", 1)]


@VARIANTS
def test_a_reserved_call_does_not_reclaim_another_reservation_s_room(
    mixed: bool, model: str | None
) -> None:
    # As above, but node 1 holds a borrower (group c's, ending when Y is due) and X is
    # within its group's guarantee: reclaiming that borrower for X would hand X the node Y
    # waits for. X waits for its own node instead; nothing is preempted.
    now = 20_000.0
    nodes = [node(0, [], 8, "H100"), node(1, [], 8)]
    running = [Running("r", 0, tuple(range(8)), group="d", start_time=0,
                       expected_s=now + 100.0),
               Running("b", 1, tuple(range(8)), group="c", start_time=0, borrowed=True,
                       expected_s=now + 300.0)]
    if mixed:
        nodes, running = nodes + busy_mixed(now)[0], running + busy_mixed(now)[1]
    pending = [Pending("X", 8, group="a", submit_time=now - 9000, expected_s=50_000.0,
                       gpu_model=model),
               Pending("Y", 8, group="b", submit_time=now - 8000, gpu_model="A100")]
    quotas = {"a": Quota(8), "b": Quota(0), "c": Quota(0), "d": Quota(16)}
    snap = Snapshot(nodes, pending, running, quotas=quotas, now=now,
                    reserved={"X": now + 100, "Y": now + 300},
                    reserved_on={"X": (0,), "Y": (1,)})
    out = plan(snap, GUARD)
    assert not out.preemptions and not list(out)
    assert out.reserved_on == {"X": (0,), "Y": (1,)}
    # (Without Y's claim, X reclaims node 1 from the borrower.)
    alone = dataclasses.replace(snap, pending=pending[:1])
    assert preempted(plan(alone, GUARD)) == {"b"}


# --- replays on mixed clusters --------------------------------------------------------------

GROUPS = ["a", "b", "c"]


@st.composite
def mixed_replays(draw: st.DrawFn) -> tuple[list[Job], Cluster, dict[str, Quota], Fair]:
    """A short trace on 2 to 4 nodes of 4 or 8 GPUs, A100 or H100, with calls of a model or
    of any, shares of a GPU and gangs; quotas with and without ceilings and per model
    guarantees; the guard with and without least attained service."""
    layout = tuple(draw(st.lists(st.sampled_from([(4, "A100"), (8, "A100"), (4, "H100"),
                                                  (8, "H100")]), min_size=2, max_size=4)))
    specs = draw(st.lists(st.tuples(
        st.integers(0, 400), st.integers(5, 300),
        st.sampled_from([0.5, 1, 2, 3, 4, 4, 8, 8, 12, 16]), st.sampled_from(GROUPS),
        st.sampled_from([None, None, "A100", "H100"])), min_size=4, max_size=40))
    jobs = sorted((Job(str(i), float(t), float(d), g, group=grp, gpu_type=m)
                   for i, (t, d, g, grp, m) in enumerate(specs)), key=lambda j: j.submit)
    per_model = st.builds(Quota, st.integers(0, 8))  # (guarantees per model, no ceilings)
    models = st.just(()) | st.lists(st.tuples(st.sampled_from(["A100", "H100"]), per_model),
                                    max_size=2, unique_by=lambda m: m[0]).map(tuple)
    quotas = {g: Quota(draw(st.integers(0, 8)), draw(st.none() | st.integers(0, 16)),
                       draw(models)) for g in GROUPS}  # fmt: skip
    policy = draw(st.sampled_from([
        Fair(starve_after_s=30.0, las_thresholds=(50.0, 500.0)),
        Fair(starve_after_s=30.0, las_thresholds=(50.0, 500.0), min_run_s=10.0),
        Fair(starve_after_s=30.0, las_thresholds=()),
    ]))  # fmt: skip
    return jobs, Cluster(layout), quotas, policy


@settings(max_examples=150, deadline=None)
@given(mixed_replays())
def test_replays_on_mixed_clusters_settle_finish_and_keep_reservations(
    case: tuple[list[Job], Cluster, dict[str, Quota], Fair],
) -> None:
    # Every job ends or is refused at submission, no instant's plans loop (the replay raises),
    # and a reserved call starts no later than its first reservation, on nodes of any size
    # (its reservation's nodes are kept from round to round), unless its group has a
    # ceiling (a later call of the group may take the room under it: not fixed yet).
    jobs, cluster, quotas, policy = case
    sim = Simulator(jobs, policy, cluster, quotas)
    late = reservations_kept(sim)
    assert len(sim.completed) + len(sim.rejected) == len(jobs)
    assert not {i for i in late if quotas[jobs[i].group].borrow_limit is None}, late
