"""``fair``'s least attained service (Tiresias's 2D-LAS inside groups and among borrowers):
the order by class, the swap step's victims (its own group's calls, other groups' borrowed
ones, never a guarantee, a fresh run or a starved call), and the room promised across rounds."""

from __future__ import annotations

from scheduler import Gpu, NodeCapacity, Pending, Quota, Running, Snapshot, explain
from scheduler.fair import Fair
from scheduler.replay import Cluster, Simulator
from scheduler.traces import Job

NOW = 100_000.0
LAS = Fair(las_thresholds=(3_600.0, 36_000.0), min_run_s=600.0)
GPUS = tuple(Gpu(g, "A100", 40960) for g in range(4))


def node(free: list[int], node_id: int = 0) -> NodeCapacity:
    return NodeCapacity(node_id, free, 0, GPUS)


def run(
    i: str, gpus: tuple[int, ...], group: str = "g", attained: float = 50_000.0, **kw: object
) -> Running:
    """A run that started an hour ago with ``attained`` GPU-seconds before it."""
    kw = {"queued_time": NOW - 3_700, **kw}
    return Running(i, 0, gpus, "ann", group, start_time=NOW - 3_600, attained_gpu_s=attained,
                   **kw)  # type: ignore[arg-type]  # fmt: skip


def call(i: str, gpus: int = 1, group: str = "g", attained: float = 0.0, **kw: object) -> Pending:
    return Pending(i, gpus, "bob", group, submit_time=NOW - 10, attained_gpu_s=attained,
                   **kw)  # type: ignore[arg-type]  # fmt: skip


def snap(running: list[Running], pending: list[Pending], **kw: object) -> Snapshot:
    quotas = kw.pop("quotas", {"g": Quota(2), "h": Quota(2)})
    return Snapshot([node([])], pending, running, quotas, now=NOW, **kw)  # type: ignore[arg-type]


def preempted(plan: list) -> set[str]:  # type: ignore[type-arg]
    return {p.invocation_id for p in plan.preemptions}  # type: ignore[attr-defined]


def test_a_new_call_takes_the_place_of_its_group_s_call_that_received_more_service() -> None:
    running = [run("long", (0, 1)), run("young", (2, 3), attained=0.0)]
    out = LAS.plan(snap(running, [call("new", 2)]))
    # "young" received 2 GPUs x 1 h = 7,200 GPU-s (class 1), "long" 57,200 (class 2).
    assert preempted(out) == {"long"}
    assert out.promised == {"new": (0,)}
    assert not list(out)
    without = Fair(las_thresholds=()).plan(snap(running, [call("new", 2)]))
    assert not preempted(without) and not without.promised


def test_no_swap_within_a_class_for_a_fresh_run_or_a_call_that_starved() -> None:
    assert not preempted(LAS.plan(snap([run("same", (0, 1, 2, 3), attained=0.0)], [
        call("new", 2, attained=7_200.0)])))  # fmt: skip
    fresh = Running("fresh", 0, (0, 1, 2, 3), "ann", "g", start_time=NOW - 60,
                    attained_gpu_s=50_000.0)  # fmt: skip
    assert not preempted(LAS.plan(snap([fresh], [call("new")])))
    starved = run("starved", (0, 1, 2, 3), queued_time=NOW - 3_600 - 13 * 3_600)
    assert not preempted(LAS.plan(snap([starved], [call("new")])))


def test_a_call_is_not_swapped_out_in_the_instant_it_started() -> None:
    # Without a minimum run time, a call that starts in this instant (in the replay, a victim
    # that went straight back onto other room) stays: swapping it out again at once is how
    # swaps and reclaim chased each other round after round at one instant.
    eager = Fair(las_thresholds=(3_600.0, 36_000.0))
    idle = Running("other", 0, (2, 3), "ann", "g", start_time=NOW - 60)  # (class 0)
    now = Running("now", 0, (0, 1), "ann", "g", start_time=NOW, attained_gpu_s=50_000.0)
    assert not preempted(eager.plan(snap([now, idle], [call("new")])))
    before = Running("before", 0, (0, 1), "ann", "g", start_time=NOW - 1,
                     attained_gpu_s=50_000.0)  # fmt: skip
    assert preempted(eager.plan(snap([before, idle], [call("new")]))) == {"before"}


def test_a_smaller_call_that_waited_past_the_bound_may_still_give_way() -> None:
    # Only the guard's kind of call (on whole nodes) is kept in place after a long wait: on an
    # overloaded cluster every call waits past the bound, and least attained service would
    # have nothing left to take.
    waited = run("waited", (0, 1), queued_time=NOW - 3_600 - 13 * 3_600)
    idle = run("other", (2, 3), attained=0.0)
    assert preempted(LAS.plan(snap([waited, idle], [call("new", 2)]))) == {"waited"}


def test_other_groups_give_way_only_with_borrowed_calls_above_their_guarantee() -> None:
    held = [run("h1", (0, 1), "h"), run("h2", (2, 3), "h")]
    quotas = {"g": Quota(0), "h": Quota(4)}  # (g borrows: reclaim has no say)
    assert not preempted(LAS.plan(snap(held, [call("new", 2)], quotas=quotas)))
    # h is guaranteed 2: it borrows the other two, and only those may go.
    borrowed = [run("h1", (0, 1), "h", borrowed=True), run("h2", (2, 3), "h")]
    quotas = {"g": Quota(0), "h": Quota(2)}
    out = LAS.plan(snap(borrowed, [call("new", 2)], quotas=quotas))
    assert preempted(out) == {"h1"}
    # Two borrowed runs, but h may lose only down to its guarantee: one of them goes.
    both = [run("h1", (0, 1), "h", borrowed=True), run("h2", (2, 3), "h", borrowed=True)]
    out = LAS.plan(snap(both, [call("a", 2), call("b", 2)], quotas=quotas))
    assert len(preempted(out)) == 1


def test_a_swap_never_takes_another_group_below_its_guarantee() -> None:
    # h holds 4 GPUs, guaranteed 3: one more than its guarantee, but its borrowed run holds
    # two. Taking it would leave h short, and h would reclaim them at once, round after
    # round (the replay found such a loop): it stays. Guaranteed 2, h may lose it.
    borrowed = [run("h1", (0, 1), "h", borrowed=True), run("h2", (2, 3), "h")]
    short = {"g": Quota(0), "h": Quota(3)}
    assert not preempted(LAS.plan(snap(borrowed, [call("new", 2)], quotas=short)))
    enough = {"g": Quota(0), "h": Quota(2)}
    assert preempted(LAS.plan(snap(borrowed, [call("new", 2)], quotas=enough))) == {"h1"}


def test_the_group_s_ceiling_holds_for_the_swapped_room() -> None:
    quotas = {"g": Quota(0, 2), "h": Quota(0)}
    theirs = run("theirs", (2, 3), "h", borrowed=True, attained=900_000.0)
    running = [run("mine", (0, 1)), theirs]
    # g holds its ceiling of 2: a call of g may only take its own call's place, GPUs for GPUs.
    out = LAS.plan(snap(running, [call("new", 2)], quotas=quotas))
    assert preempted(out) == {"mine"}
    assert not preempted(LAS.plan(snap(running, [call("big", 3)], quotas=quotas)))


def test_lower_classes_ask_first_and_the_reason_says_what_happens() -> None:
    running = [run("long", (0, 1, 2, 3))]
    pending = [call("mid", 4, attained=7_200.0), call("new", 4)]
    out = LAS.plan(snap(running, pending))
    assert out.promised.keys() == {"new"}
    why = explain(snap(running, pending), LAS)
    assert "least attained service" in why["new"][1]
    assert "preempted on node 0" in why["new"][1]


def test_a_promised_call_starts_first_on_the_room_its_swap_freed() -> None:
    # The victim has gone; "other" (group h, less usage: first in fair order) must not take
    # the two GPUs "new" was promised.
    pending = [call("other", 2, "h"), call("new", 2)]
    snapshot = Snapshot([node([2, 3])], pending, [run("kept", (0, 1), attained=0.0)],
                        {"g": Quota(2), "h": Quota(2)}, usage={"g": 1e9}, now=NOW,
                        promised={"new": (0,)})  # fmt: skip
    out = LAS.plan(snapshot)
    assert [d.invocation_id for d in out] == ["new"]
    # While its victims are still leaving, the node is kept for it and the promise stands.
    leaving = run("long", (2, 3), preempting=True)
    snapshot = Snapshot([node([])], pending, [run("kept", (0, 1), attained=0.0), leaving],
                        {"g": Quota(2), "h": Quota(2)}, now=NOW,
                        promised={"new": (0,)})  # fmt: skip
    out = LAS.plan(snapshot)
    assert out.promised == {"new": (0,)} and not preempted(out)


def test_in_a_replay_short_jobs_stop_waiting_behind_long_ones() -> None:
    # One group, one node: a 20-hour job holds it; 30 one-hour jobs arrive after two hours.
    jobs = [Job("long", 0.0, 72_000.0, 4, group="g")]
    jobs += [Job(str(i), 7_200.0 + i, 3_600.0, 1, group="g") for i in range(30)]

    def queue(policy: Fair) -> float:
        sim = Simulator(jobs, policy, Cluster.uniform(1, 4), {"g": Quota(4)}, 86_400.0)
        return sim.run()["avg_queue_s"]

    # (The starvation guard off: else it reserves the node for the long job once preempted.)
    fifo_like = queue(Fair(las_thresholds=(), starve_after_s=None))
    las = queue(Fair(las_thresholds=(3_600.0, 36_000.0), min_run_s=600.0, starve_after_s=None))
    assert las < fifo_like / 3, (las, fifo_like)


def test_a_call_never_takes_the_place_of_a_call_of_higher_priority() -> None:
    # ("nice" calls, below 0, go after others: they may not preempt them either.)
    running = [run("urgent", (0, 1, 2, 3), attained=0.0, priority=1000)]  # (never sheltered)
    assert not preempted(LAS.plan(snap(running, [call("nice", 2, priority=-1000)])))
    assert preempted(LAS.plan(snap(running, [call("admin", 2, priority=1000)]))) == {"urgent"}


def test_a_promise_holds_while_another_group_s_call_leaves_and_reclaim_keeps_off() -> None:
    # Round 1 swapped out h's borrowed call for "new"; it is still within its grace. Round 2
    # neither preempts more for "new" nor lets reclaim count the leaving GPUs for group k's
    # call within its guarantee.
    quotas = {"g": Quota(0), "h": Quota(0), "k": Quota(4)}
    running = [run("leaving", (0, 1), "h", borrowed=True, preempting=True),
               run("mine", (2, 3), "g", attained=0.0),
               Running("other", 1, (0, 1, 2, 3), "ann", "h", start_time=NOW - 3_600,
                       borrowed=True)]  # fmt: skip
    snapshot = Snapshot([node([]), node([], 1)], [call("new", 2), call("nominal", 2, "k")],
                        running, quotas, now=NOW, promised={"new": (0,)})  # fmt: skip
    out = LAS.plan(snapshot)
    assert out.promised["new"] == (0,)
    assert not any("least attained" in p.reason for p in out.preemptions)
    # Reclaim for k's call preempts h's other call rather than count on the promised room;
    # the room it reclaims is promised to that call in turn.
    assert preempted(out) == {"other"}
    assert out.promised == {"new": (0,), "nominal": (1,)}


def test_a_call_on_whole_nodes_gives_way_to_smaller_calls_once_at_most() -> None:
    # "whole" holds all four GPUs of node 0 and received more service than "new" (1 GPU):
    # 14,400 GPU-s in its first run.
    once = run("whole", (0, 1, 2, 3), attained=0.0)
    assert preempted(LAS.plan(snap([once], [call("new")]))) == {"whole"}
    # Sent back to the queue once already (service before this run): sheltered from it...
    again = run("whole", (0, 1, 2, 3), attained=50_000.0)
    assert not preempted(LAS.plan(snap([again], [call("new")])))
    # ...but not from a call that needs whole nodes too, nor without the shelter.
    assert preempted(LAS.plan(snap([again], [call("big", 4)]))) == {"whole"}
    bare = Fair(las_thresholds=(3_600.0, 36_000.0), min_run_s=600.0, shelter_whole_nodes=False)
    assert preempted(bare.plan(snap([again], [call("new")]))) == {"whole"}
    # A call on part of a node is no shelter's: it gives way as often as it is asked.
    part = run("part", (0, 1), attained=50_000.0)
    assert preempted(LAS.plan(snap([part], [call("new")]))) == {"part"}


def test_a_smaller_call_kept_off_a_sheltered_run_leaves_it_to_a_bigger_one() -> None:
    # "small" may not take the sheltered run and finds nothing; that says nothing of "big",
    # which may (a failure is remembered only for calls that may take no more).
    again = run("whole", (0, 1, 2, 3), attained=50_000.0)
    out = LAS.plan(snap([again], [call("small", 1), call("big", 4)]))
    assert preempted(out) == {"whole"} and set(out.promised) == {"big"}
    # Likewise a call of lower priority that found nothing, before one that may take more.
    urgent = run("urgent", (0, 1, 2, 3), attained=0.0, priority=5)
    out = LAS.plan(snap([urgent], [call("nice", 1, priority=-1), call("admin", 1, priority=5)]))
    assert preempted(out) == {"urgent"} and set(out.promised) == {"admin"}


def test_on_mixed_nodes_a_sheltered_run_gives_way_to_a_call_of_its_node_s_size() -> None:
    small = NodeCapacity(0, [], 0, GPUS)  # 4 GPUs
    big = NodeCapacity(1, [], 0, tuple(Gpu(g, "A100", 40960) for g in range(8)))
    held = [run("small-node", (0, 1, 2, 3), attained=50_000.0),
            Running("big-node", 1, tuple(range(8)), "ann", "g", start_time=NOW - 3_600,
                    attained_gpu_s=50_000.0, queued_time=NOW - 3_700)]  # fmt: skip
    quotas = {"g": Quota(12), "h": Quota(2)}
    four = Snapshot([small, big], [call("four", 4)], held, quotas, now=NOW)
    assert preempted(LAS.plan(four)) == {"small-node"}
    one = Snapshot([small, big], [call("one", 1)], held, quotas, now=NOW)
    assert not preempted(LAS.plan(one))
