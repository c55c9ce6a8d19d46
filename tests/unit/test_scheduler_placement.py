"""Gang placement filter and rank steps on static node lists, and the indexed version."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Gpu, NodeCapacity, Pending, Snapshot, capacity, plan
from scheduler import placement as pl
from scheduler.capacity import Capacity


def node(
    i: int, free: list[int], size: int = 8, model: str = "A100", links: int = 0, **kw: object
) -> NodeCapacity:
    """An 8-GPU node; ``links`` NVLink groups of equal size (0: topology unknown)."""
    per = size // links if links else 0
    gpus = tuple(Gpu(g, model, 40960, g // per if links else None) for g in range(size))
    return NodeCapacity(i, free, 0, gpus, **kw)  # type: ignore[arg-type]


def test_gpu_filter_matches_model_case_insensitively_and_memory() -> None:
    gpu = Gpu(0, "A100", 40960)
    assert pl.gpu_ok(gpu, Pending("a", 1, gpu_model="a100"))
    assert not pl.gpu_ok(gpu, Pending("a", 1, gpu_model="H100"))
    assert pl.gpu_ok(gpu, Pending("a", 1, min_memory_mib=40960))
    assert not pl.gpu_ok(gpu, Pending("a", 1, min_memory_mib=40961))


def test_a_model_asked_for_matches_the_nvml_names_that_contain_it() -> None:
    nvml = Gpu(0, "NVIDIA A100-SXM4-80GB", 81920)
    assert pl.gpu_ok(nvml, Pending("a", 1, gpu_model="A100"))
    assert pl.gpu_ok(nvml, Pending("a", 1, gpu_model="a100-sxm4"))
    assert not pl.gpu_ok(nvml, Pending("a", 1, gpu_model="H100"))
    nodes = [NodeCapacity(1, [0], 0, (Gpu(0, "NVIDIA H100 80GB HBM3", 81920),)), node(2, [0])]
    [decision] = plan(Snapshot(nodes, [Pending("h", 1, gpu_model="H100")]))
    assert decision.node_id == 1


def test_a_call_may_accept_any_of_several_models() -> None:
    either = Pending("e", 2, gpu_model="V100M16|V100M32")
    assert pl.gpu_ok(Gpu(0, "Tesla V100M32"), either) and pl.gpu_ok(Gpu(0, "V100M16"), either)
    assert not pl.gpu_ok(Gpu(0, "Tesla V100M8"), either)
    nodes = [node(1, [0, 1], model="H100"), node(2, [0, 1, 2], model="V100M32")]
    [decision] = plan(Snapshot(nodes, [either]))
    assert decision.node_id == 2
    # A node mixing the two gives the call some of each: each GPU is one of them.
    mixed = NodeCapacity(3, [0, 1], 0, (Gpu(0, "V100M16"), Gpu(1, "V100M32"), Gpu(2, "T4")))
    [decision] = plan(Snapshot([mixed], [either]))
    assert decision.gpu_indices == (0, 1)
    assert pl.model_words("V100M16|V100M32|A100") == "V100M16, V100M32 or A100"


def test_a_call_any_model_will_do_for_leaves_the_scarce_model_free() -> None:
    # Three free A100 nodes and one H100 node with 2 free GPUs, the best fit by free count.
    nodes = [node(i, list(range(8))) for i in range(3)] + [node(3, [0, 1], model="H100")]
    out = plan(Snapshot(nodes, [Pending("any", 2), Pending("h100", 2, gpu_model="H100")]))
    assert [(d.invocation_id, d.node_id) for d in out] == [("any", 0), ("h100", 3)]
    # A100 full: the unconstrained call takes the H100 after all (never left waiting).
    busy = [node(i, []) for i in range(3)] + [node(3, [0, 1], model="H100")]
    [decision] = plan(Snapshot(busy, [Pending("any", 2)]))
    assert decision.node_id == 3
    # A call that accepts both models goes to the more plentiful one too.
    either = Pending("e", 1, gpu_model="A100|H100")
    assert plan(Snapshot(nodes, [either]))[0].node_id == 0
    # Draining nodes do not count: with the A100s draining, H100 is the plenty.
    assert pl.plenty([node(0, [], draining=True), node(1, [], model="H100")]) == {"h100": 8}


def test_a_gang_any_model_will_do_for_leaves_the_scarce_model_free() -> None:
    # Free: an H100 node first in order, then two A100 nodes. A 16-GPU gang that takes any
    # model goes to the A100s, so the H100 call starts too.
    nodes = [node(0, list(range(8)), model="H100")] + [node(i, list(range(8))) for i in (1, 2)]
    nodes.append(node(3, [], model="A100"))  # (busy: the A100s are the plenty, 24 against 8)
    out = plan(Snapshot(nodes, [Pending("gang", 16), Pending("h100", 8, gpu_model="H100")]))
    assert sorted((d.invocation_id, d.node_id, *(p.node_id for p in d.more)) for d in out) == [
        ("gang", 1, 2), ("h100", 0)]  # fmt: skip


def test_usable_gpus_skip_draining_nodes_and_unknown_inventory_for_constrained_calls() -> None:
    assert pl.usable(node(1, [3, 1], draining=True), [3, 1], Pending("a", 1)) == []
    bare = NodeCapacity(2, [0, 1])
    assert pl.usable(bare, [1, 0], Pending("a", 1)) == [0, 1]
    assert pl.usable(bare, [1, 0], Pending("a", 1, gpu_model="A100")) == []


def test_choose_takes_the_tightest_nvlink_group_that_holds_the_call() -> None:
    n = node(1, [], links=2)  # GPUs 0-3 and 4-7
    assert pl.choose(n, [0, 1, 2, 4, 5], 2) == ((4, 5), True)
    assert pl.choose(n, [0, 1, 2, 4, 5], 3) == ((0, 1, 2), True)
    gpus, connected = pl.choose(n, [0, 1, 4, 5, 6], 4)
    assert not connected and len(gpus) == 4 and {4, 5, 6} <= set(gpus)


def test_choose_without_topology_takes_the_lowest_indices() -> None:
    assert pl.choose(node(1, []), [2, 5, 7], 2) == ((2, 5), True)


def test_rank_prefers_connected_then_best_fit_then_warm_then_order() -> None:
    call = Pending("c", 2, user="u", function="f")
    split = node(1, [0, 4], links=2)  # fits exactly but across groups
    loose = node(2, [0, 1, 2, 3, 4], links=2)
    tight = node(3, [0, 1, 2], links=2)
    warm = node(4, [0, 1, 2], links=2, warm=frozenset({("u", "f")}))
    ranked = pl.rank([split, loose, tight, warm], call)
    assert [n.node_id for n in ranked] == [4, 3, 2, 1]


def test_a_node_must_hold_the_whole_call() -> None:
    assert pl.rank([node(1, [0]), node(2, [1])], Pending("c", 2)) == []


def nodes_strategy() -> st.SearchStrategy[list[NodeCapacity]]:
    one = st.builds(
        lambda free, links, model, warm, draining: (free, links, model, warm, draining),
        st.sets(st.integers(0, 7)),
        st.sampled_from([0, 2, 4]),
        st.sampled_from(["A100", "H100"]),
        st.booleans(),
        st.booleans(),
    )
    return st.lists(one, max_size=12).map(
        lambda specs: [
            node(
                i,
                sorted(free),
                links=links,
                model=model,
                draining=drain,
                warm=frozenset({("u", "f")}) if warm else frozenset(),
            )
            for i, (free, links, model, warm, drain) in enumerate(specs)
        ]
    )


calls = st.builds(
    lambda n, model: Pending("c", n, user="u", function="f", gpu_model=model),
    st.integers(1, 8),
    st.sampled_from([None, "A100", "H100"]),
)


@given(nodes_strategy(), calls)
def test_the_index_picks_a_node_ranked_as_high_as_the_reference(
    nodes: list[NodeCapacity], call: Pending
) -> None:
    reference = pl.rank(nodes, call)
    found = Capacity(nodes).find(call)
    if not reference:
        assert found is None
        return
    assert found is not None
    state, gpus = found

    many = pl.plenty(nodes)

    def key(n: NodeCapacity) -> tuple[int, int, int, int]:
        return pl.rank_key(n, pl.usable(n, n.free_gpus, call), call, 0, pl.node_plenty(n, many))[:4]

    assert key(state.node) == key(reference[0])
    assert len(gpus) == call.gpus and set(gpus) <= set(state.node.free_gpus)


def test_a_gang_bigger_than_any_node_gets_whole_free_nodes_all_at_once() -> None:
    nodes = [node(1, list(range(8))), node(2, [0, 1, 2]), node(3, list(range(8)))]
    (d,) = plan(Snapshot(nodes, [Pending("big", 12)]))
    assert [(p.node_id, p.gpu_indices) for p in d.parts] == [
        (1, tuple(range(8))),
        (3, tuple(range(8))),
    ]
    # One whole node short: nothing at all, never a partial gang.
    assert plan(Snapshot(nodes, [Pending("huge", 17)])) == []


def test_whole_nodes_need_a_known_inventory_and_no_draining() -> None:
    bare = [NodeCapacity(1, list(range(8))), NodeCapacity(2, list(range(8)))]
    assert plan(Snapshot(bare, [Pending("big", 16)])) == []
    nodes = [node(1, list(range(8))), node(2, list(range(8)), draining=True)]
    assert plan(Snapshot(nodes, [Pending("big", 16)])) == []


def test_constraints_filter_nodes_and_draining_nodes_get_nothing() -> None:
    nodes = [
        node(1, list(range(8)), model="A100"),
        node(2, list(range(8)), model="H100", draining=True),
        node(3, [0, 1], model="H100"),
    ]
    nodes[1].free_cpu_slots = 4
    out = plan(Snapshot(nodes, [Pending("h", 2, gpu_model="H100"), Pending("h2", 1,
               gpu_model="H100"), Pending("cpu", 0)]))  # fmt: skip
    assert [(d.invocation_id, d.node_id) for d in out] == [("h", 3)]


def test_warm_worker_breaks_ties_between_equal_nodes() -> None:
    nodes = [node(1, [0, 1]), node(2, [0, 1], warm=frozenset({("ann", "train")}))]
    (d,) = plan(Snapshot(nodes, [Pending("c", 1, user="ann", function="train")]))
    assert d.node_id == 2
    (d,) = plan(Snapshot(nodes, [Pending("c", 1, user="bob", function="train")]))
    assert d.node_id == 1


def test_best_fit_keeps_the_big_hole_for_the_big_call() -> None:
    nodes = [node(1, list(range(8))), node(2, [0, 1])]
    out = plan(Snapshot(nodes, [Pending("small", 2), Pending("big", 8)]))
    assert [(d.invocation_id, d.node_id) for d in out] == [("small", 2), ("big", 1)]


@given(st.lists(st.sampled_from([1, 2, 4, 6, 8]), max_size=7), st.integers(0, 40))
def test_whole_nodes_for_a_gang_are_the_fewest_gpus_then_the_fewest_nodes(
    sizes: list[int], n: int
) -> None:
    from itertools import combinations

    sets = [c for k in range(len(sizes) + 1) for c in combinations(range(len(sizes)), k)]
    fits = [(sum(sizes[i] for i in c), len(c)) for c in sets if sum(sizes[i] for i in c) >= n]
    picked = pl.fewest_whole(sizes, n)
    if not fits:
        assert picked is None
        return
    assert picked is not None and picked == sorted(set(picked))
    assert (sum(sizes[i] for i in picked), len(picked)) == min(fits)


def test_a_gang_gets_an_8_and_a_4_rather_than_two_8s() -> None:
    nodes = [node(1, list(range(8))), node(2, list(range(8))), node(3, [0, 1, 2, 3], size=4)]
    (d,) = plan(Snapshot(nodes, [Pending("big", 12)]))
    assert [(p.node_id, len(p.gpu_indices)) for p in d.parts] == [(1, 8), (3, 4)]


def mixed_nodes_strategy() -> st.SearchStrategy[list[NodeCapacity]]:
    """Nodes of 4 or 8 GPUs (or an unknown inventory), some mixing models or memory sizes,
    some draining."""
    gpu = st.tuples(st.sampled_from(["A100", "H100"]), st.sampled_from([40960, 81920]))
    one = st.tuples(st.sampled_from([0, 4, 8]), st.integers(0, 3), st.booleans(), gpu, gpu)

    def build(i: int, size: int, mixed: int, draining: bool, first: tuple[str, int],
              other: tuple[str, int]) -> NodeCapacity:  # fmt: skip
        kinds = [first, other] if mixed == 0 else [first]  # (a quarter of them mixed)
        gpus = tuple(Gpu(g, *kinds[g % len(kinds)]) for g in range(size))
        return NodeCapacity(i, list(range(size or 3)), 0, gpus, draining=draining and i % 2 == 0)

    return st.lists(one, max_size=10).map(
        lambda specs: [build(i, *spec) for i, spec in enumerate(specs)]
    )


any_call = st.builds(
    lambda n, model, memory: Pending("c", n, gpu_model=model, min_memory_mib=memory),
    st.integers(0, 9),
    st.sampled_from([None, "A100", "H100", "a100|h100"]),
    st.sampled_from([0, 81920]),
)


@settings(max_examples=400)
@given(mixed_nodes_strategy(), st.lists(any_call, min_size=1, max_size=4))
def test_nodes_judged_by_shape_are_the_nodes_judged_one_by_one(
    nodes: list[NodeCapacity], asked: list[Pending]
) -> None:
    # Fits and Capacity.largest_for judge each shape of node once: the same answers as
    # asking every node, whatever the order the kinds of call come in.
    fits, cap = pl.Fits(nodes), Capacity(nodes)
    for call in asked:
        assert fits(call) == [n for n in nodes if not n.draining and pl.node_fits_ever(n, call)]
        assert cap.largest_for(call) == pl.largest_for(nodes, call)
        wholes = {n.node_id for n in nodes if not n.draining and pl.whole_node_ok(n, call)}
        assert fits.wholes(call) == wholes


@settings(max_examples=300)
@given(mixed_nodes_strategy(), st.lists(any_call, min_size=1, max_size=6),
       st.lists(any_call, max_size=5), st.sets(st.integers(0, 8)))  # fmt: skip
def test_nodes_hidden_for_a_while_come_back_as_they_were(
    nodes: list[NodeCapacity], inside: list[Pending], after: list[Pending], hide: set[int]
) -> None:
    # Capacity.hiding (the guard keeps other reservations' nodes from a call): nothing is
    # placed on a hidden node meanwhile; afterwards the capacity answers as one built afresh
    # from what is still free (what failed while they were hidden is forgotten).
    cap = Capacity(nodes)
    taken: dict[int, set[int]] = {}
    with cap.hiding(n.node_id for n in nodes if n.node_id in hide):
        for call in inside:
            for part in cap.place(call) or ():
                assert part.node_id not in hide
                taken.setdefault(part.node_id, set()).update(part.gpu_indices)
    left = [dataclasses.replace(n, free_gpus=[g for g in n.free_gpus
                                             if g not in taken.get(n.node_id, ())])
            for n in nodes]  # fmt: skip
    fresh = Capacity(left)
    assert cap.free_gpus == fresh.free_gpus
    for call in after:
        assert (cap.place(call) is None) == (fresh.place(call) is None)
        assert cap.free_gpus == fresh.free_gpus


def test_a_node_s_kind_is_its_own_inventory_s_however_many_inventories_come_and_go() -> None:
    # Inventories are remembered by the identity of their tuple (a replay's nodes keep
    # theirs). Tuples made and dropped one after another, past the memo's bound, each read
    # as what they are: a dropped tuple's id, reused by the next, is never mistaken for it.
    for i in range(3 * pl._MEMO):
        model = f"m{i % 7}"
        mixed = i % 5 == 0
        linked = i % 3 == 0
        gpus = (Gpu(0, model, 80, 0 if linked else None), Gpu(1, "other" if mixed else model, 80))
        node = NodeCapacity(i, [0, 1], 0, gpus)
        assert capacity.kind(node) == (None if mixed else (model, 80))
        assert pl.shape(node) == (None if mixed else (model, 80, 2))
        assert pl.choose(node, [0, 1], 2) == ((0, 1), not linked)
        assert pl.plenty([node]) == ({model: 1, "other": 1} if mixed else {model: 2})
        assert len(pl._memo) <= pl._MEMO
