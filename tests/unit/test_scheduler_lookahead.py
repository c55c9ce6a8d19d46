"""What a round is shown of a long queue (scheduler.lookahead), live and in the replay."""

from __future__ import annotations

from scheduler import Pending, Plan, Snapshot, lookahead, policies
from scheduler.model import NodeCapacity
from scheduler.replay import Cluster, Simulator
from scheduler.traces import Job


def calls(spec: str) -> list[Pending]:
    """'aab' -> calls 0 (a), 1 (a), 2 (b): the user of each, in submission order."""
    return [Pending(str(i), 1, user=u) for i, u in enumerate(spec)]


def ids(shown: list[Pending]) -> list[str]:
    return [c.id for c in shown]


def test_each_users_heads_in_turns_then_in_submission_order() -> None:
    queue = calls("aaaabbc")
    assert ids(lookahead.shown(queue[::-1], [], 100)) == ids(queue)  # all, in order
    per2 = lookahead.visible(queue, 2, 100, lambda c: c.user, lambda c: int(c.id))
    assert ids(per2) == ["0", "1", "4", "5", "6"]  # a's first two, b's two, c's one
    # At most 4: the first turn (a0, b4, c6), then the second in submission order (a1).
    most4 = lookahead.visible(queue, 2, 4, lambda c: c.user, lambda c: int(c.id))
    assert ids(most4) == ["0", "1", "4", "6"]


def test_a_round_looks_further_the_more_is_free() -> None:
    full, free3 = NodeCapacity(0, [], 0), NodeCapacity(1, [0, 1, 2], 1)
    assert lookahead.per_user([full], 5000) == 16
    assert lookahead.per_user([full, free3], 5000) == 16 + 16 * 4  # GPUs and CPU slots
    assert lookahead.per_user([free3] * 1000, 100) == 100  # never past the batch
    down = NodeCapacity(2, [0, 1, 2, 3], 0, draining=True)  # a replay's failed node
    assert lookahead.per_user([full, down], 5000) == 16
    assert len(lookahead.shown(calls("a" * 50), [full])) == 16


class Recording:
    """fifo, remembering how many calls each round was shown; said to preempt (so the replay
    asks it at each arrival, as it asks the fair policy) unless told otherwise."""

    name, uses_quotas = "fifo", False

    def __init__(self, preempts: bool = True) -> None:
        self.fifo = policies.get("fifo")
        self.seen: list[int] = []
        self.preempts = preempts

    def plan(self, snapshot: Snapshot, why: object = None) -> Plan:
        self.seen.append(len(snapshot.pending))
        return self.fifo.plan(snapshot)


def test_the_replay_shows_rounds_only_what_a_live_round_reads() -> None:
    # One 1-GPU node busy for 1000 s, then 40 short calls of one user behind it.
    jobs = [Job("long", 0, 1000, 1, user="u")]
    jobs += [Job(str(i), 1 + i, 10, 1, user="u") for i in range(40)]
    everything = Recording()
    Simulator(jobs, everything, Cluster.uniform(1, 1), {}).run()
    assert max(everything.seen) == 40
    live = Recording()
    sim = Simulator(jobs, live, Cluster.uniform(1, 1), {}, look_ahead=5000)
    sim.run()
    # Arrivals while the node is busy: 16 at most; when it frees, 16 + 16 for the free GPU.
    assert max(live.seen[:40]) == 16 and max(live.seen) == 32
    assert len(sim.completed) == 41


def test_a_policy_that_never_preempts_is_not_asked_while_no_gpu_is_free() -> None:
    # As above: the 40 calls arrive while the only GPU is busy; fifo could place none of
    # them, so the replay asks it only when the GPU frees (and at the first arrival).
    jobs = [Job("long", 0, 1000, 1, user="u")]
    jobs += [Job(str(i), 1 + i, 10, 1, user="u") for i in range(40)]
    asked, every = Recording(preempts=False), Recording()
    quiet, busy = Simulator(jobs, asked, Cluster.uniform(1, 1), {}), Simulator(
        jobs, every, Cluster.uniform(1, 1), {}
    )
    assert quiet.run()["plans"] == len(asked.seen) == 41  # the first arrival and 40 frees
    assert busy.run()["plans"] == len(every.seen) == 81  # and each of the 40 arrivals
    assert quiet.completed == busy.completed  # the same outcome
    unsaid = Recording()  # (a policy registered before policies said so: asked as before)
    del unsaid.preempts
    assert Simulator(jobs, unsaid, Cluster.uniform(1, 1), {}).run()["plans"] == 81
