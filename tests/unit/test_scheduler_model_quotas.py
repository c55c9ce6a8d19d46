"""Quotas per GPU model (Kueue's resource flavours): ceilings, guarantees and reclaim per
model, on static snapshots; submit-time checks."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from scheduler import Gpu, NodeCapacity, Pending, Quota, Running, Snapshot, explain, never_fits
from scheduler import plan as plan_round
from scheduler.fair import Fair
from scheduler.model import Part
from scheduler.quotas import Book, model_of

FAIR = Fair(starve_after_s=None)


def plan(snap: Snapshot):  # type: ignore[no-untyped-def]
    return plan_round(snap, FAIR)


def node(i: int, free: list[int], model: str, size: int = 4) -> NodeCapacity:
    return NodeCapacity(
        i, free, 0, tuple(Gpu(g, f"NVIDIA {model}-SXM4", 81920) for g in range(size))
    )


def run(rid: str, node_id: int, gpus: tuple[int, ...], group: str, start: float = 0.0,
        borrowed: bool = True) -> Running:  # fmt: skip
    return Running(rid, node_id, gpus, group=group, start_time=start, borrowed=borrowed)


def a100_only(guaranteed: int, borrow_limit: int | None) -> tuple[tuple[str, Quota], ...]:
    return (("A100", Quota(guaranteed, borrow_limit)),)


def test_a_group_holds_no_more_of_a_model_than_its_quota_for_it() -> None:
    quotas = {"vision": Quota(0, None, a100_only(0, 2))}
    snap = Snapshot(
        [node(1, [0, 1, 2, 3], "A100"), node(2, [0, 1, 2, 3], "H100")],
        [Pending(f"a{i}", 1, group="vision", gpu_model="A100") for i in range(3)]
        + [Pending("any", 2, group="vision")],
        quotas=quotas,
    )
    out = plan(snap)
    where = {d.invocation_id: d.node_id for d in out}
    assert where == {"a0": 1, "a1": 1, "any": 2}  # the third A100 call waits
    reason = explain(snap, FAIR)["a2"][1]
    assert "quota for the GPU models" in reason and "2 of at most 2 A100" in reason
    # Another group without a quota for A100 is not held back.
    other = Snapshot(snap.nodes, [Pending("n", 4, group="nlp", gpu_model="A100")], quotas=quotas)
    assert [d.invocation_id for d in plan(other)] == ["n"]


def test_gpus_past_a_model_s_guarantee_are_borrowed_and_nominal_calls_go_where_guaranteed() -> None:
    # vision is guaranteed 4 GPUs in all, none of them A100s; A100s are the plentiful model,
    # so a call any model will do for would go there, but within its guarantee it goes to
    # the H100s, and an A100 call is borrowed however little the group holds.
    quotas = {"vision": Quota(4, None, a100_only(0, None))}
    nodes = [node(1, [0, 1, 2, 3], "A100"), node(2, [0, 1, 2, 3], "A100"),
             node(3, [0, 1, 2, 3], "H100")]  # fmt: skip
    snap = Snapshot(
        nodes,
        [Pending("any", 2, group="vision"), Pending("a100", 1, group="vision", gpu_model="A100")],
        quotas=quotas,
    )
    out = {d.invocation_id: d for d in plan(snap)}
    assert (out["any"].node_id, out["any"].borrowed) == (3, False)
    assert out["a100"].node_id in (1, 2) and out["a100"].borrowed
    # Without the quota per model the same call goes to the plentiful A100s.
    plain = Snapshot(nodes, snap.pending, quotas={"vision": Quota(4, None)})
    assert {d.invocation_id: d.node_id for d in plan(plain)}["any"] in (1, 2)


def test_a_group_reclaims_its_guaranteed_model_from_a_group_borrowing_it() -> None:
    # nlp holds every A100, within its guarantee of 8 GPUs in all but past its A100 guarantee
    # of 0: vision, guaranteed 4 A100s, takes two back, from nlp's youngest A100 calls.
    quotas = {
        "nlp": Quota(8, None, a100_only(0, None)),
        "vision": Quota(4, None, a100_only(4, 0)),
    }
    running = [run("old", 1, (0, 1), "nlp", start=1), run("young", 1, (2, 3), "nlp", start=5),
               run("h100", 2, (0, 1, 2, 3), "nlp", start=9, borrowed=False)]  # fmt: skip
    snap = Snapshot(
        [node(1, [], "A100"), node(2, [], "H100")],
        [Pending("v", 2, group="vision", gpu_model="A100")],
        running,
        quotas=quotas,
        now=100,
    )
    out = plan(snap)
    assert [p.invocation_id for p in out.preemptions] == ["young"]
    # Without its quota per model nlp is within its guarantee, and nothing is reclaimed.
    quotas["nlp"] = Quota(8, None)
    alone = Snapshot(snap.nodes, snap.pending, running, quotas=quotas, now=100)
    assert plan(alone).preemptions == []


def test_reclaim_never_takes_a_group_below_its_guarantee_of_a_model() -> None:
    # nlp holds 4 A100s and is guaranteed 2 of them: only two come back, though vision wants 4.
    quotas = {
        "nlp": Quota(8, None, a100_only(2, None)),
        "vision": Quota(4, None, a100_only(4, 0)),
    }
    running = [run(f"n{i}", 1, (i,), "nlp", start=i) for i in range(4)]
    snap = Snapshot(
        [node(1, [], "A100"), node(2, [0, 1, 2, 3], "A100")],
        [Pending("v", 4, group="vision", gpu_model="A100")],
        running,
        quotas=quotas,
        now=100,
    )
    assert plan(snap).preemptions == []  # node 2 is free: it simply starts there
    busy = Snapshot([node(1, [], "A100")], snap.pending, running, quotas=quotas, now=100)
    assert plan(busy).preemptions == []  # 2 are all nlp can give back: not enough for 4
    small = Snapshot(busy.nodes, [Pending("v", 2, group="vision", gpu_model="A100")], running,
                     quotas=quotas, now=100)  # fmt: skip
    assert [p.invocation_id for p in plan(small).preemptions] == ["n3", "n2"]


def test_a_gpu_counts_against_the_longest_model_that_names_it() -> None:
    models = (("A100", Quota(1)), ("A100-SXM4-80GB", Quota(2)), ("H100", Quota(3)))
    assert model_of(models, "NVIDIA A100-SXM4-80GB") == "A100-SXM4-80GB"
    assert model_of(models, "NVIDIA A100-PCIE-40GB") == "A100"
    assert model_of(models, "nvidia h100 80gb hbm3") == "H100"
    assert model_of(models, "Tesla V100-SXM2-32GB") is None


def test_a_call_that_only_one_model_at_its_ceiling_could_hold_is_refused_at_submission() -> None:
    quotas = {"vision": Quota(0, None, a100_only(0, 2))}
    nodes = [node(1, [], "A100", size=8), node(2, [], "H100", size=2)]
    reason = never_fits(Pending("x", 4, group="vision", gpu_model="A100"), nodes, quotas)
    assert reason is not None
    assert "at most 2 A100" in reason and "quota" in reason
    # Any model: only the A100 node has 4 GPUs, and the group may hold only 2 of them.
    reason = never_fits(Pending("y", 4, group="vision"), nodes, quotas)
    assert reason is not None and "at most 2" in reason
    assert never_fits(Pending("z", 2, group="vision"), nodes, quotas) is None
    assert never_fits(Pending("w", 4, group="nlp", gpu_model="A100"), nodes, quotas) is None


def test_no_other_name_for_a_model_gets_a_group_past_its_quota_for_it() -> None:
    # The quota is for GPUs whose model name has "A100" in it, whatever the call says.
    quotas = {"vision": Quota(0, None, a100_only(0, 1))}
    running = [run("held", 1, (0,), "vision")]
    for asked in ("a100", "SXM4", "NVIDIA A100-SXM4", "H100|a100", "A100|A100"):
        snap = Snapshot(
            [node(1, [1, 2, 3], "A100"), node(2, [], "H100")],
            [Pending("x", 1, group="vision", gpu_model=asked)],
            running,
            quotas=quotas,
        )
        assert list(plan(snap)) == [], asked
    # A node reporting a model name with "|" in it is not read as alternatives ("NVIDIA" or
    # "H100", the first of which the A100s' name has in it).
    odd = NodeCapacity(3, [], 0, (Gpu(0, "NVIDIA|H100"), Gpu(1, "NVIDIA|H100")))  # (busy)
    snap = Snapshot([node(1, [1, 2, 3], "A100"), odd], [Pending("y", 1, group="vision")],
                    running, quotas=quotas)  # fmt: skip
    assert [d.node_id for d in plan(snap) if d.node_id == 1] == []


def test_a_call_kept_off_a_model_is_not_split_over_nodes_as_a_gang() -> None:
    # 4 GPUs fit the A100 node, where the group may take only 2 more: the H100 nodes have 2
    # each, and the call must not become a gang on both (a live call runs on one node).
    quotas = {"vision": Quota(0, None, a100_only(0, 4))}
    nodes = [node(1, [2, 3], "A100"), node(2, [0, 1], "H100", size=2),
             node(3, [0, 1], "H100", size=2)]  # fmt: skip
    running = [run("r", 1, (0, 1), "vision")]
    snap = Snapshot(nodes, [Pending("x", 4, group="vision")], running, quotas=quotas, now=10)
    for policy in (FAIR, Fair(starve_after_s=0)):
        assert list(plan_round(snap, policy)) == []


def test_a_gang_on_whole_nodes_stays_within_the_model_s_ceiling() -> None:
    # A100 ceiling 8, 3 held; a 5-GPU gang would take two whole 3-GPU nodes: 9.
    quotas = {"vision": Quota(0, None, a100_only(0, 8))}
    nodes = [node(1, [], "A100", size=3), node(2, [0, 1, 2], "A100", size=3),
             node(3, [0, 1, 2], "A100", size=3)]  # fmt: skip
    running = [run("r", 1, (0, 1, 2), "vision")]
    snap = Snapshot(nodes, [Pending("g", 5, group="vision")], running, quotas=quotas, now=10)
    for policy in (FAIR, Fair(starve_after_s=0)):
        assert list(plan_round(snap, policy)) == []


def test_a_node_model_name_with_a_bar_is_never_a_way_past_the_ceiling() -> None:
    quotas = {"vision": Quota(0, None, a100_only(0, 1))}
    odd = NodeCapacity(1, [1, 2, 3], 0, tuple(Gpu(g, "NVIDIA A100|SXM4") for g in range(4)))
    snap = Snapshot([odd], [Pending("x", 2, group="vision")], [run("r", 1, (0,), "vision")],
                    quotas=quotas, now=10)  # fmt: skip
    assert list(plan(snap)) == []


def test_reclaim_leaves_a_group_its_guarantee_of_a_model_whatever_it_holds_in_all() -> None:
    # vision is guaranteed 4 in all and 4 A100s; it holds 4 A100s and 4 borrowed H100s, so
    # it is above its guarantee in all: its A100s still stay (the H100 call is no use to an
    # A100 call), and nlp's A100 call waits.
    quotas = {"vision": Quota(4, None, a100_only(4, 0)), "nlp": Quota(4, None)}
    running = [run("va", 1, (0, 1, 2, 3), "vision", start=5, borrowed=False),
               run("vh", 2, (0, 1, 2, 3), "vision", start=1)]  # fmt: skip
    snap = Snapshot([node(1, [], "A100"), node(2, [], "H100")],
                    [Pending("n", 4, group="nlp", gpu_model="A100")], running, quotas=quotas,
                    now=10)  # fmt: skip
    assert plan(snap).preemptions == []


RUNS = st.tuples(
    st.integers(0, 3),
    st.sets(st.integers(0, 5), min_size=1),
    st.sampled_from(["nlp", "vision"]),
    st.sampled_from([1.0, 0.5]),
)


@given(st.lists(RUNS, max_size=12), st.integers(0, 6), st.integers(0, 6))
def test_a_group_s_gpus_per_model_are_counted_alike_from_the_nodes_or_from_the_runs(
    specs: list[tuple[int, set[int], str, float]], guaranteed: int, limit: int
) -> None:
    # The Book counts a run's GPUs per model from the nodes' inventories (by node when all
    # its GPUs are of one model), or from the run's own gpu_models: the same holdings either
    # way, the same models kept from a call and the same room for it.
    both = tuple(Gpu(g, f"NVIDIA {'A100-SXM4' if g % 2 else 'H100'}", 81920) for g in range(4))
    nodes = [node(0, [], "A100"), node(1, [], "H100"), NodeCapacity(2, [], 0, both),
             node(3, [], "L40S")]  # fmt: skip
    names = {n.node_id: {g.index: g.model for g in n.gpus} for n in nodes}
    per_model = (("A100", Quota(guaranteed, limit)), ("H100", Quota(guaranteed // 2, None)))
    quotas = {"nlp": Quota(4, 8, per_model), "vision": Quota(2, None)}
    runs, named = [], []
    for i, (node_id, indices, group, share) in enumerate(specs):
        taken = tuple(sorted(indices))[:1] if share != 1.0 else tuple(sorted(indices))
        plain = Running(f"r{i}", node_id, taken, group=group, share=share)
        runs.append(plain)
        models = tuple(names[node_id].get(g, "") for g in taken)  # (4, 5: not in inventory)
        named.append(Running(f"r{i}", node_id, taken, group=group, share=share, gpu_models=models))
    by_nodes, by_runs = Book(runs, quotas, nodes=nodes), Book(named, quotas, nodes=nodes)
    assert dict(by_nodes.used) == dict(by_runs.used)
    assert {k: v for k, v in by_nodes.model_used.items() if v} == {
        k: v for k, v in by_runs.model_used.items() if v
    }
    for model in (None, "A100", "H100", "A100|H100"):
        for gpus in (1, 2, 4):
            call = Pending("c", gpus, group="nlp", gpu_model=model)
            for nominal in (False, True):
                kept = by_nodes.restrict(call, nominal)
                assert kept == by_runs.restrict(call, nominal)
                if kept is not None:
                    assert by_nodes.limit(call, kept) == by_runs.limit(call, kept)
    # Charging a new call counts its GPUs per model as the runs' own names would.
    for book in (by_nodes, by_runs):
        book.take("nlp", (Part(2, (0, 1)),))
    assert by_nodes.model_used[("nlp", "A100")] == by_runs.model_used[("nlp", "A100")]
    assert by_nodes.model_used[("nlp", "H100")] == by_runs.model_used[("nlp", "H100")]
