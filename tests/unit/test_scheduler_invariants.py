"""Hypothesis properties of the policies and the replay's yardsticks: no GPU handed out twice,
no gang split or partial, constraints and quotas kept, guarantees won back, and no group
starved in a replay."""

from __future__ import annotations

import bisect
import math
import random
from collections import Counter, defaultdict
from collections.abc import Iterable

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import (
    Gpu,
    NodeCapacity,
    Part,
    Pending,
    Plan,
    Policy,
    Quota,
    Running,
    SharedGpu,
    Snapshot,
    placement,
    plan,
)
from scheduler.backfill import Horizon, releases, reserve
from scheduler.capacity import Capacity
from scheduler.core import resolve
from scheduler.fair import Fair
from scheduler.reclaim import protected, starved, starved_whole
from scheduler.replay import Cluster, Simulator
from scheduler.traces import Job
from scheduler.yardsticks import Las, Srtf

GROUPS = ["a", "b", "c"]


USERS = ["ann", "bob"]
SHARES = [0.25, 0.5, 0.3, 0.75]


@st.composite
def snapshots(draw: st.DrawFn, one_gpu: bool = False, shares: bool = True) -> Snapshot:
    """A consistent cluster: free GPUs are exactly those no running call holds. Unless
    ``one_gpu`` (or not ``shares``), some GPUs are shared by calls holding part of one, and
    some pending calls ask for part of one."""
    shares = shares and not one_gpu
    across = shares and draw(st.booleans())  # calls of different users may share a GPU
    nodes: list[NodeCapacity] = []
    running: list[Running] = []
    for i in range(draw(st.integers(1, 6))):
        size = 4 if one_gpu else draw(st.sampled_from([4, 8]))
        model = "A100" if one_gpu else draw(st.sampled_from(["A100", "H100"]))
        links = None if one_gpu else draw(st.sampled_from([None, 2]))
        gpus = tuple(Gpu(g, model, 40960, None if links is None else g // 4) for g in range(size))
        free = list(range(size))
        shared: list[SharedGpu] = []
        while free:
            if not draw(st.booleans()):
                break
            if shares and draw(st.integers(0, 3)) == 0:  # a GPU shared by 1-3 calls
                index, free = free[0], free[1:]
                parts = draw(st.lists(st.sampled_from(SHARES), min_size=1, max_size=3))
                while sum(parts) > 1:
                    parts.pop()
                users = set()
                owner = draw(st.sampled_from(USERS))
                for part in parts or [0.5]:
                    user = draw(st.sampled_from(USERS)) if across else owner
                    users.add(user)
                    running.append(Running(
                        f"r{len(running)}", i, (index,), user, draw(st.sampled_from(GROUPS)),
                        start_time=draw(st.floats(0, 100)),
                        expected_s=draw(st.none() | st.floats(1, 99)),
                        borrowed=draw(st.booleans()), preemptible=draw(st.booleans()),
                        preempting=draw(st.booleans()), share=part,
                    ))  # fmt: skip
                shared.append(SharedGpu(index, sum(parts or [0.5]), frozenset(users)))
                continue
            n = 1 if one_gpu else draw(st.integers(1, len(free)))
            taken, free = tuple(free[:n]), free[n:]
            running.append(Running(
                f"r{len(running)}", i, taken, group=draw(st.sampled_from(GROUPS)),
                start_time=draw(st.floats(0, 100)), expected_s=draw(st.none() | st.floats(1, 99)),
                borrowed=draw(st.booleans()), preemptible=draw(st.booleans()) or one_gpu,
                preempting=draw(st.booleans()) and not one_gpu,
                queued_time=draw(st.none() | st.floats(-7200, 0)),
                attained_gpu_s=draw(st.sampled_from([0.0, 0.0, 50.0, 500.0])),
            ))  # fmt: skip
        nodes.append(NodeCapacity(i, free, draw(st.integers(0, 2)), gpus,
                                  draining=draw(st.booleans()) and not one_gpu,
                                  shared=tuple(shared)))  # fmt: skip
    sizes = st.just(1) if one_gpu else st.sampled_from([0, 1, 2, 3, 4, 8, 12, 16])
    share = st.sampled_from([1.0, *SHARES]) if shares else st.just(1.0)
    pending = []
    for j in range(draw(st.integers(0, 25))):
        part = draw(share)
        pending.append(Pending(
            f"p{j}", 1 if part != 1.0 else draw(sizes), draw(st.sampled_from(USERS)),
            draw(st.sampled_from(GROUPS)),
            gpu_model=None if one_gpu else draw(st.sampled_from([None, None, "H100"])),
            expected_s=draw(st.none() | st.floats(1, 200)), share=part,
            attained_gpu_s=draw(st.sampled_from([0.0, 0.0, 50.0, 500.0])),
        ))  # fmt: skip
    quotas = {
        g: Quota(draw(st.integers(0, 8)), draw(st.none() | st.integers(0, 16)), draw(models()))
        for g in GROUPS
    }
    if one_gpu:  # guarantees the cluster can honour
        total = sum(len(n.gpus) for n in nodes)
        quotas = {g: Quota(total // len(GROUPS)) for g in GROUPS}
    return Snapshot(nodes, pending, running, quotas, now=50.0, share_across_users=across)


def models() -> st.SearchStrategy[tuple[tuple[str, Quota], ...]]:
    """Quotas per model, mostly none."""
    quota = st.builds(Quota, st.integers(0, 8), st.none() | st.integers(0, 8))
    one = st.tuples(st.sampled_from(["H100", "A100"]), quota)
    return st.just(()) | st.lists(one, max_size=2, unique_by=lambda m: m[0]).map(tuple)


def held_of_model(snap: Snapshot) -> dict[tuple[str, str], float]:
    """GPUs each group holds of each model its quota lists (calls not already stopping)."""
    out: dict[tuple[str, str], float] = defaultdict(float)
    for r in snap.running:
        if not r.preempting:
            count_models(snap, r.group, r.parts, out, r.share)
    return out


def count_models(
    snap: Snapshot,
    group: str,
    parts: Iterable[Part],
    out: dict[tuple[str, str], float],
    sign: float,
) -> None:
    models = dict(snap.quotas[group].models) if group in snap.quotas else {}
    names = {(n.node_id, g.index): g.model for n in snap.nodes for g in n.gpus}
    for part in parts:
        for index in part.gpu_indices:
            model = names.get((part.node_id, index), "")
            for listed in models:  # (at most one of H100 and A100 names a GPU)
                if listed.casefold() in model.casefold():
                    out[(group, listed)] += sign


def held(snap: Snapshot) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for r in snap.running:
        if not r.preempting:
            out[r.group] += r.amount
    return out


POLICIES: list[str | Policy] = [
    "fifo", "fair", Fair(starve_after_s=0), Las((10.0, 100.0)), Srtf(),
    # Least attained service at this scale's thresholds (fair's are 1 and 10 GPU-hours).
    Fair(las_thresholds=(10.0, 100.0)), Fair(las_thresholds=(10.0, 100.0), min_run_s=20.0),
]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(snapshots(), st.sampled_from(POLICIES))
def test_plans_never_double_book_split_or_bend_the_rules(
    snap: Snapshot, policy: str | Policy
) -> None:
    out = plan(snap, policy)
    calls = {c.id: c for c in snap.pending}
    nodes = {n.node_id: n for n in snap.nodes}
    held_gpus = {(p.node_id, g) for r in snap.running for p in r.parts for g in p.gpu_indices}
    used: Counter[tuple[int, int]] = Counter()
    # A shared GPU: how much of it is taken, and by whose calls (before and after the plan).
    shared = {(n.node_id, s.index): (s.used, set(s.users)) for n in snap.nodes for s in n.shared}
    assert len({d.invocation_id for d in out}) == len(out)
    for d in out:
        call = calls[d.invocation_id]
        for part in d.parts:
            node = nodes[part.node_id]
            assert not node.draining
            by_index = {g.index: g for g in node.gpus}
            assert all(placement.gpu_ok(by_index[g], call) for g in part.gpu_indices)
            if call.share != 1.0:  # part of one GPU: a free one, or one shared already
                (gpu,) = part.gpu_indices
                key = (part.node_id, gpu)
                assert key in shared or gpu in node.free_gpus, (call, part)
                taken, users = shared.setdefault(key, (0.0, set()))
                shared[key] = (taken + call.share, users | {call.user})
                held_gpus.discard(key)
                continue
            assert set(part.gpu_indices) <= set(node.free_gpus)
            used.update((part.node_id, g) for g in part.gpu_indices)
        got = sum(len(p.gpu_indices) for p in d.parts)
        if len(d.parts) == 1:
            assert got == call.gpus  # a single-node gang, complete
        else:  # whole nodes, only for calls bigger than any node that qualifies
            assert got >= call.gpus
            assert all(len(p.gpu_indices) == len(nodes[p.node_id].gpus) for p in d.parts)
            assert call.gpus > Capacity(snap.nodes).largest_for(call)
    assert all(n == 1 for n in used.values())
    assert not set(used) & held_gpus
    assert not set(used) & set(shared)  # a whole-GPU call never on a shared GPU
    for taken, users in shared.values():  # never more than the whole GPU, nor shared across
        assert taken <= 1 + 1e-9  # users unless the round allows it
        assert snap.share_across_users or len(users) <= 1
    # A node is held for one call at most: room freed for a call is never also reserved.
    promised = [n for nodes_of in out.promised.values() for n in nodes_of]
    reserved = [n for nodes_of in out.reserved_on.values() for n in nodes_of]
    assert len(set(reserved)) == len(reserved) and not set(promised) & set(reserved)
    check_preemptions(snap, out, policy)


def check_preemptions(snap: Snapshot, out: Plan, policy: str | Policy) -> None:
    running = {r.id: r for r in snap.running}
    victims = [p.invocation_id for p in out.preemptions]
    assert len(set(victims)) == len(victims)
    if policy == "fifo":
        assert not victims
    for v in victims:
        assert running[v].preemptible and not running[v].preempting
    chosen = resolve(policy)
    nodes = {n.node_id: n for n in snap.nodes}
    if isinstance(chosen, Fair):  # the guard's calls are never sent back
        assert not any(protected(running[v], chosen.starve_after_s, nodes) for v in victims)
        for p in out.preemptions:  # (nor swapped out, on one node either)
            if "least attained service" in p.reason or "fair share among" in p.reason:
                run = running[p.invocation_id]
                assert not starved_whole(run, chosen.starve_after_s, nodes), p
    after = held(snap)
    before = dict(after)
    calls = {c.id: c for c in snap.pending}
    if isinstance(chosen, Fair) and chosen.las_thresholds:  # a swap for less served calls:
        rank = chosen.las_thresholds  # (only of a strictly higher class, run long enough, of
        for p in out.preemptions:  # the call's group or borrowed)
            if "least attained service" not in p.reason:
                continue
            run, call = running[p.invocation_id], calls[p.reason.split()[3]]
            assert snap.now - run.start_time >= chosen.min_run_s
            assert bisect.bisect_right(rank, run.attained(snap.now)) > bisect.bisect_right(
                rank, call.attained_gpu_s
            )
            assert run.group == call.group or run.borrowed
            assert call.id in out.promised
            assert not starved_whole(run, chosen.starve_after_s, nodes)  # (the guard's)
            sizes = {n.node_id: len(n.gpus) for n in snap.nodes}
            whole = all(0 < sizes[p.node_id] <= len(p.gpu_indices) for p in run.parts)
            if chosen.shelter_whole_nodes and whole and run.attained_gpu_s > 0:
                # (sheltered: only a call as big as its nodes may take its place)
                assert call.gpus >= max(sizes[p.node_id] for p in run.parts)
    for v in victims:
        after[running[v].group] -= running[v].amount
    if isinstance(chosen, Fair):  # least attained service never takes a group's calls for
        for p in out.preemptions:  # another group's below its guarantee
            run = running[p.invocation_id]
            if "least attained service" in p.reason and f"of group {run.group}," not in p.reason:
                assert after[run.group] >= snap.quotas[run.group].guaranteed - 1e-9, run.group
    for d in out:
        call = calls[d.invocation_id]
        after[call.group] += call.share * sum(len(p.gpu_indices) for p in d.parts)
    if resolve(policy).uses_quotas:
        of_model = held_of_model(snap)
        model_before = dict(of_model)
        for v in victims:
            count_models(snap, running[v].group, running[v].parts, of_model, -running[v].share)
        for d in out:
            call = calls[d.invocation_id]
            count_models(snap, call.group, d.parts, of_model, call.share)
        for (g, model), n in of_model.items():  # nor a ceiling per model
            quota = dict(snap.quotas[g].models)[model]
            assert n <= max(quota.ceiling, model_before.get((g, model), 0)) + 1e-9, (g, model)
        for g, n in after.items():
            quota = snap.quotas[g]  # placing never passes a ceiling
            assert n <= max(quota.ceiling, before.get(g, 0)) + 1e-9
            if before.get(g, 0) > quota.guaranteed:  # reclaim stops at the guarantee...
                assert n >= quota.guaranteed - 1e-9 or any(  # ...unless a call straddles it
                    running[v].group == g for v in victims
                )
    # A shared GPU comes back only when all its calls go: reclaim takes all or none of them.
    if isinstance(resolve(policy), Fair):
        stopping = set(victims) | {r.id for r in snap.running if r.preempting}
        for r in snap.running:
            if r.id in victims and r.share != 1.0:
                sharers = [o for o in snap.running if o.share != 1.0 and o.parts == r.parts]
                assert all(o.id in stopping for o in sharers), (r, sharers)


def settle(snap: Snapshot, policy: Policy) -> Snapshot:
    """Apply plans (preempted calls leave at once and queue again; the room a round preempted
    for stays promised to its call, as the gateway's leader keeps it) until nothing
    changes."""
    for _ in range(60):
        out = plan(snap, policy)
        if not out and not out.preemptions:
            return snap
        nodes = {n.node_id: NodeCapacity(n.node_id, list(n.free_gpus), 0, n.gpus)
                 for n in snap.nodes}  # fmt: skip
        running = {r.id: r for r in snap.running}
        pending = {c.id: c for c in snap.pending}
        for p in out.preemptions:
            victim = running.pop(p.invocation_id)
            nodes[victim.node_id].free_gpus += list(victim.gpu_indices)
            pending[victim.id] = Pending(victim.id, victim.gpus, group=victim.group)
        for d in out:
            call = pending.pop(d.invocation_id)
            nodes[d.node_id].free_gpus = [
                g for g in nodes[d.node_id].free_gpus if g not in d.gpu_indices
            ]
            running[call.id] = Running(call.id, d.node_id, d.gpu_indices, group=call.group,
                                       start_time=snap.now, borrowed=d.borrowed)  # fmt: skip
        snap = Snapshot(list(nodes.values()), list(pending.values()), list(running.values()),
                        snap.quotas, now=snap.now + 1, promised=out.promised)  # fmt: skip
    raise AssertionError("plans kept changing the cluster")


@st.composite
def starving_snapshots(draw: st.DrawFn, guarantees: bool = False) -> Snapshot:
    """Busy 4-GPU nodes (ends known, some held by whole-node calls) and a queue of whole-node
    and smaller calls that have all waited: where the guard's share binds. With
    ``guarantees``, groups are guaranteed GPUs and the running calls are any group's: some
    borrow, and the guard's calls reclaim."""
    nodes, running = [], []
    for i in range(draw(st.integers(2, 12 if guarantees else 8))):
        nodes.append(NodeCapacity(i, [], 0, tuple(Gpu(g, "A100", 40960) for g in range(4))))
        busy = draw(st.sampled_from([(0, 1, 2, 3), (0, 1, 2), (0, 1)]))
        if guarantees and len(busy) < 4 and draw(st.booleans()):  # (two calls on the node)
            running.append(Running(f"s{i}", i, (3,), group=draw(st.sampled_from(GROUPS)),
                                   start_time=0.0, expected_s=draw(st.floats(10, 1000)),
                                   queued_time=0.0))  # fmt: skip
        group = draw(st.sampled_from(GROUPS)) if guarantees else "a"
        running.append(Running(f"r{i}", i, busy, group=group, start_time=0.0,
                               expected_s=draw(st.floats(10, 1000)), queued_time=0.0))  # fmt: skip
    sizes = draw(st.lists(st.sampled_from([4, 4, 8, 1, 2, 3]), min_size=1, max_size=16))
    # (some short enough to backfill into a reservation, ending before it is due)
    pending = [Pending(f"p{j}", n, group=draw(st.sampled_from(GROUPS)), submit_time=float(j),
                       expected_s=draw(st.sampled_from([None, 5.0, 50.0, 5000.0])))
               for j, n in enumerate(sizes)]  # fmt: skip
    quotas = {g: Quota(draw(st.integers(0, 12)) if guarantees else 0) for g in GROUPS}
    return Snapshot(nodes, pending, running, quotas, now=10_000.0)


@settings(max_examples=1500, deadline=None)
@given(starving_snapshots(guarantees=True), st.sampled_from([(), (10.0, 100.0)]))
def test_room_reclaimed_for_a_call_is_never_reserved_for_another(
    snap: Snapshot, thresholds: tuple[float, ...]
) -> None:
    # The guard reserves nodes after reclaim may have looked at them: reclaim must not then
    # free them for another call (both would count on the same GPUs).
    out = plan(snap, Fair(starve_after_s=0.0, las_thresholds=thresholds))
    promised = [n for nodes_of in out.promised.values() for n in nodes_of]
    reserved = [n for nodes_of in out.reserved_on.values() for n in nodes_of]
    assert len(set(reserved)) == len(reserved) and not set(promised) & set(reserved)


@settings(max_examples=200, deadline=None)
@given(st.one_of(snapshots(), starving_snapshots()))
def test_starved_calls_take_the_cluster_in_proportion_to_their_demand(snap: Snapshot) -> None:
    """The whole-node calls running after a wait past the bound, and the calls a plan
    reserves for, hold at most the share of the cluster's GPUs that such calls (waiting or
    running) make of all calls that waited past the bound (waiting, or running after it),
    overrun by one call at most (the last let in); no share binds when no other call
    waited that long."""
    out = plan(snap, Fair(starve_after_s=0.0))
    if not out.reserved:
        return
    size = {n.node_id: len(n.gpus) for n in snap.nodes}
    cap = Capacity(snap.nodes)
    waiting = [c for c in snap.pending if c.waiting_since <= snap.now]
    whole = sum(c.gpus for c in waiting if c.gpus and c.gpus >= cap.largest_for(c))
    held = sum(
        r.gpus for r in snap.running
        if all(len(p.gpu_indices) >= size[p.node_id] > 0 for p in r.parts) and starved(r, 0.0)
    )  # fmt: skip
    gpus = {c.id: c.gpus for c in snap.pending}
    if whole >= sum(c.gpus for c in waiting):
        return  # nobody else waited past the bound
    share = (whole + held) / (sum(c.gpus for c in waiting) + held)
    reserved = [gpus[c] for c in out.reserved]
    assert held + sum(reserved) - max(reserved) < share * sum(size.values()) + 1e-9


@settings(max_examples=150, deadline=None)
@given(snapshots(one_gpu=True), st.sampled_from([None, 0.0]))
def test_groups_get_their_guarantee_back_when_they_have_work(
    snap: Snapshot, starve_after_s: float | None
) -> None:
    final = settle(snap, Fair(starve_after_s=starve_after_s))
    have = held(final)
    waiting = Counter(c.group for c in final.pending)
    for g, quota in final.quotas.items():
        demand = have.get(g, 0) + waiting[g]
        assert have.get(g, 0) >= min(quota.guaranteed, demand), (g, have, waiting)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(1, 4), min_size=2, max_size=4),
    st.integers(4, 6),
    st.integers(0, 2**16),
)
def test_no_group_starves_under_sustained_demand(sizes: list[int], nodes: int, seed: int) -> None:
    """Every group submits a steady stream that alone would fill the cluster, and the first
    group also dumps a long backlog at t=0. Each group is guaranteed at least one of its calls
    (the rest of the cluster goes to the first), so its first call starts, reclaiming borrowed
    GPUs if need be, and every job completes. Not always at once: reclaim stops at the first
    group's guarantee, and what it may take back can lie on other nodes than the room the call
    needs (1 borrowed GPU here, 1 free there, the call needs 2 on one node), so the call may
    wait for the first such room to free up; never as long as the backlog's calls run."""
    rng = random.Random(seed)
    jobs = [Job(f"hog{i}", 0.0, 500.0, rng.choice([1, 2, 4]), group="g0") for i in range(30)]
    for g, size in enumerate(sizes):
        t = 1.0 + g
        while t < 1000:
            jobs.append(Job(f"{g}-{t}", t, rng.uniform(20, 200), size, group=f"g{g}"))
            t += rng.uniform(5, 40)
    jobs.sort(key=lambda j: j.submit)
    capacity = nodes * 4
    quotas = {f"g{g}": Quota(size) for g, size in enumerate(sizes)}
    quotas["g0"] = Quota(capacity - sum(sizes[1:]))
    sim = Simulator(jobs, Fair(starve_after_s=200), Cluster.uniform(nodes, 4), quotas)
    sim.run()
    assert not sim.rejected and len(sim.completed) == len(jobs)
    first: dict[str, tuple[float, float]] = {}  # group -> (first submit, first start)
    for i, job in enumerate(jobs):
        submit, start = first.get(job.group, (job.submit, sim.started[i]))
        first[job.group] = (min(submit, job.submit), min(start, sim.started[i]))
    assert all(start - submit < 500.0 for submit, start in first.values()), first


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 400),
            st.integers(5, 300),
            st.sampled_from([1, 2, 3, 4, 4, 8]),
            st.sampled_from(GROUPS),
        ),
        min_size=4,
        max_size=40,
    ),
    st.integers(2, 4),
    st.sampled_from(["fifo", "fair"]),
    st.lists(st.integers(0, 4), min_size=3, max_size=3),
)
def test_a_reserved_call_starts_no_later_than_its_reservation(
    specs: list[tuple[int, int, int, str]], nodes: int, name: str, guarantees: list[int]
) -> None:
    """Replayed with exact durations (the running calls' ends are known), a call that was
    reserved for starts no later than the first reservation promised it: FIFO's head, and
    under ``fair`` every whole-node call (4 or 8 GPUs on 4-GPU nodes) that waited past the
    bound, whatever its group and the others' guarantees."""
    jobs = [Job(str(i), float(t), float(d), g, group=grp) for i, (t, d, g, grp) in
            enumerate(specs)]  # fmt: skip
    jobs.sort(key=lambda j: j.submit)
    policy: Policy = Fair(starve_after_s=30.0) if name == "fair" else resolve("fifo")
    quotas = {g: Quota(n) for g, n in zip(GROUPS, guarantees, strict=True)}
    sim = Simulator(jobs, policy, Cluster.uniform(nodes, 4), quotas)
    late = reservations_kept(sim)
    assert len(sim.completed) + len(sim.rejected) == len(jobs)
    assert not late, {i: (jobs[i], started, due) for i, (started, due) in late.items()}


def reservations_kept(sim: Simulator) -> dict[int, tuple[float, float]]:
    """Replay ``sim``; the calls that started later than the first reservation promised them
    (call -> (started, promised))."""
    promised: dict[int, float] = {}
    planner = sim.plan

    def plan_and_note(now: float) -> Plan:
        out = planner(now)
        for call_id, start in out.reserved.items():
            promised.setdefault(int(call_id), start)
        return out

    sim.plan = plan_and_note  # type: ignore[method-assign]
    sim.run()
    return {i: (sim.started[i], s) for i, s in promised.items() if sim.started[i] > s + 1e-6}


@settings(max_examples=300, deadline=None)
@given(snapshots(), st.data())
def test_the_horizon_reserves_what_reserve_does(snap: Snapshot, data: st.DataObject) -> None:
    """fair's fast path for whole-node reservations gives each call the nodes and start time
    the general reservation gives it, one after another as in a round."""
    general, fast = Capacity(snap.nodes), Capacity(snap.nodes)
    assert Horizon.serves(snap.nodes, fast)  # one model per node, inventories known
    rel = releases(snap, [])
    horizon = Horizon(snap, rel)
    for call in snap.pending:
        if not call.gpus or call.gpus < general.largest_for(call):
            continue  # not a whole-node call
        limit = data.draw(st.sampled_from([math.inf, 8, 12, 16]))
        a = reserve(call, general, snap, rel, limit=limit)
        b = horizon.reserve(call, fast, limit=limit)
        assert (a is None) == (b is None), (call, a, b)
        if a is not None and b is not None:
            assert (a.start, a.spare) == (b.start, b.spare), call


@settings(max_examples=300, deadline=None)
@given(st.one_of(snapshots(), starving_snapshots()), st.sampled_from(POLICIES[:3]))
def test_explaining_a_plan_does_not_change_it(snap: Snapshot, policy: str | Policy) -> None:
    # A plan skips calls like ones that already found no room only when it is not explaining
    # (call.status() explains every call): the skip must never change what starts.
    chosen = resolve(policy)
    quick = chosen.plan(snap)
    why: dict[str, tuple[int, str]] = {}
    explained = chosen.plan(snap, why)
    assert [(d.invocation_id, d.parts, d.borrowed) for d in quick] == [
        (d.invocation_id, d.parts, d.borrowed) for d in explained
    ]
    assert quick.preemptions == explained.preemptions
    assert quick.reserved == explained.reserved and quick.more == explained.more
    assert set(why) == {c.id for c in snap.pending}
