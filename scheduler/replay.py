"""Trace replay: the scheduling policies, unchanged, on a virtual clock.

``python -m scheduler.replay TRACE.csv --policy fair --nodes 64 --gpus-per-node 8``
(also ``bulletin replay``). Trace and quota formats: :mod:`scheduler.traces`; metrics:
:mod:`scheduler.metrics`.

The simulation is event driven: job arrivals and completions. After each instant's events it
builds a :class:`~scheduler.model.Snapshot` (nodes with their free GPUs, running and pending
jobs, quotas, decayed usage per group and user) and calls the policy's ``plan`` — only when
something is pending and either a GPU is free or a job just arrived (an arrival may trigger
reclaim), since nothing else can change a plan; and again at the same instant when a plan
preempted without grace or stopped short (``Plan.more``). Each job's expected duration is its
true remaining run time (exact time limits: the best case for backfill). Each job is whole
GPUs on whole nodes as the policy placed it; a gang bigger than a node holds whole nodes. A job
whose ``num_gpus`` is a fraction below 1 holds that share of one GPU, packed with other such
jobs (of its own user, unless ``--share-across-users``) and counted as that share in quotas,
usage and utilisation; sharing does not slow it down here (a live GPU's sharers contend for
its compute).
Policy settings other than the starvation guard are the defaults; ``--half-life-s`` sets the
fair-share half-life of the usage fed to the policy.

Preemption: a preempted job keeps its GPUs for the grace period (``--grace-s``, default 0),
then goes back to the queue with its original submit time and its remaining work. By default
it resumes from a checkpoint taken when it stopped, losing nothing; ``--preemption-cost-s``
adds that much work each time it is preempted (the work since its last checkpoint and the
restart: reloading the checkpoint, warming up again). A job's attained service (GPU-seconds
of all its runs, lost work included) goes with it back to the queue. Jobs that could never fit
(more GPUs than the cluster, a GPU model it lacks, above their group's quota ceiling under
``fair``) are rejected at submit time and counted as ``rejected``.

Policies: the live ones (:mod:`scheduler.policies`) and the replay-only yardsticks of
:mod:`scheduler.yardsticks` (``las``, ``srtf``). ``--jobs-out FILE`` writes one CSV row per job
(when it was submitted, first started and completed, its queueing, preemptions and attained
service, and its fate: ``completed``, ``failed`` or ``cancelled`` as the trace's ``status``
says, ``rejected`` or ``pending``) for inspection. A trace's ``status`` shapes the outcome only:
a failed or cancelled job holds its GPUs for its ``duration`` (how long it ran before it
failed or was cancelled) like any other; ``completed`` counts every job that ran to its end,
``failed`` and ``cancelled`` those of them that ended so.
"""

from __future__ import annotations

import argparse
import csv
import heapq
import json
import math
import sys
import time
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from scheduler import lookahead, policies, traces, yardsticks
from scheduler.admission import never_fits
from scheduler.fairshare import DEFAULT_HALF_LIFE_S, UsageMeter
from scheduler.metrics import Recorder
from scheduler.model import (
    EPSILON,
    Ends,
    Gpu,
    NodeCapacity,
    Pending,
    Plan,
    Quota,
    Running,
    SchedulerError,
    SharedGpu,
    Snapshot,
    Standing,
)
from scheduler.policies import Policy
from scheduler.queue import Queue
from scheduler.traces import Job

FINISH, STOP, DOWN, UP = 0, 1, 2, 3
#: ``--jobs-out``'s columns: times in trace seconds, empty where a job never got that far.
JOB_COLUMNS = (
    "job",
    "group",
    "user",
    "gpus",
    "gpu_type",
    "submit",
    "duration",
    "start",
    "end",
    "queue_s",
    "jct_s",
    "preemptions",
    "interruptions",
    "attained_gpu_s",
    "fate",
)
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class Cluster:
    #: (GPUs, GPU model) of each node, in node order; "" when models do not matter.
    layout: tuple[tuple[int, str], ...]

    @classmethod
    def uniform(cls, nodes: int, gpus_per_node: int, models: Sequence[str] = ()) -> Cluster:
        """``nodes`` nodes of ``gpus_per_node`` GPUs, their models cycled from ``models``."""
        cycle = tuple(models) or ("",)
        return cls(tuple((gpus_per_node, cycle[i % len(cycle)]) for i in range(nodes)))

    @property
    def gpus(self) -> int:
        return sum(g for g, _ in self.layout)

    def build(self) -> list[NodeCapacity]:
        out = []
        for i, (gpus, model) in enumerate(self.layout):
            inventory = tuple(Gpu(g, model) for g in range(gpus))
            out.append(NodeCapacity(i, list(range(gpus)), 0, inventory))
        return out


class Usage(Mapping[K, float]):
    """A meter's decayed usage as of ``now``, worked out only for the keys a policy reads."""

    def __init__(self, meter: UsageMeter[K], now: float) -> None:
        self.meter = meter
        self.now = now

    def __getitem__(self, key: K) -> float:
        return self.meter.value(key, self.now)

    def __iter__(self) -> Iterator[K]:
        return iter(self.meter.keys())

    def __len__(self) -> int:
        return len(self.meter.keys())


class Simulator:
    """One replay of ``jobs`` through ``policy`` on ``cluster``."""

    def __init__(
        self,
        jobs: Sequence[Job],
        policy: Policy,
        cluster: Cluster,
        quotas: Mapping[str, Quota],
        half_life_s: float = DEFAULT_HALF_LIFE_S,
        grace_s: float = 0.0,
        preemption_cost_s: float = 0.0,
        look_ahead: int | None = None,
        failures: Sequence[tuple[int, float, float | None]] = (),
        share_across_users: bool = False,
    ) -> None:
        self.jobs = list(jobs)
        self.share_across_users = share_across_users
        self.policy = policy
        #: Whether to ask the policy at an arrival while no GPU is free (a policy that never
        #: preempts places nothing then; one registered without saying is asked).
        self.preempts = getattr(policy, "preempts", True)
        self.cluster = cluster
        self.quotas = dict(quotas)
        self.grace_s = grace_s
        self.preemption_cost_s = preemption_cost_s
        #: Show each round only what a live round would read (scheduler.lookahead), at most
        #: this many calls; None: every pending call.
        self.look_ahead = look_ahead
        self.nodes = cluster.build()
        self.free = cluster.gpus  # whole GPUs free on live nodes
        #: Per node, its shared GPUs' runs (by GPU index, then call id).
        self.sharing: dict[int, dict[int, dict[str, Running]]] = {}
        #: Shared GPUs with room left (node, GPU), and jobs asking for a share pending.
        self.open_shares: set[tuple[int, int]] = set()
        self.pending_shares = 0
        #: Pending jobs in queue order (a requeued call keeps its place, as it does live),
        #: in tiers by the policy's classes of service where it has them (scheduler.fair).
        self.pending = Queue(
            getattr(policy, "las_thresholds", ()),
            getattr(policy, "shortest_first", False),
            getattr(policy, "queue_rank", None),  # (a yardstick's order, kept)
            # (the views the policy reads of a queue: all of them unless it says otherwise)
            kinds=getattr(policy, "queue_kinds", True),
            tiers=getattr(policy, "queue_tiers", True),
        )
        self.running: dict[str, Running] = {}
        #: The running calls' expected ends per node (Snapshot.ends), kept as they change.
        self.ends = Ends()
        #: The running calls in the policy's standing order, where it has one
        #: (Snapshot.standing), kept as they change.
        key = getattr(policy, "standing_key", None)
        self.standing = Standing(key) if key is not None else None
        #: GPUs held per group by the running calls not being preempted (Snapshot.held):
        #: their whole GPUs, and the shares of a GPU by call, summed exactly (math.fsum, as
        #: Book does), so that no rounding builds up as calls come and go.
        self.held: dict[str, float] = {}
        self.whole: dict[str, int] = {}
        self.parts: dict[str, dict[str, float]] = {}
        self.remaining = [j.duration for j in self.jobs]
        #: GPU-seconds each job received in its runs before the current one.
        self.attained = [0.0] * len(self.jobs)
        self.preempted = [0] * len(self.jobs)
        #: Runs cut short by their node failing, per job.
        self.interrupted = [0] * len(self.jobs)
        self.outages = [0] * len(self.nodes)  # outages under way, per node
        self.node_failures = 0
        #: The calls the last round's plan reserved for (the next round's Snapshot.reserved).
        self.reserved: dict[str, float] = {}
        self.reserved_on: Mapping[str, tuple[int, ...]] = {}
        self.promised: Mapping[str, tuple[int, ...]] = {}
        self.generation = [0] * len(self.jobs)
        self.events: list[tuple[float, int, int, int, int]] = []  # (t, seq, kind, job, gen)
        self.seq = 0
        self.groups = UsageMeter[str](half_life_s)
        self.users = UsageMeter[tuple[str, str]](half_life_s)
        groups = sorted({j.group for j in self.jobs})
        self.record = Recorder(self.free, traces.weights(self.quotas, groups))
        self.plans = self.preemptions = 0
        #: Per job index: when it first started, and when it completed.
        self.started: dict[int, float] = {}
        self.completed: dict[int, float] = {}
        self.verdicts: dict[tuple[float, str | None, str], str | None] = {}
        #: Jobs refused at submission (they could never fit).
        self.rejected: set[int] = set()
        for node, down, up in failures:
            self.push_node(down, DOWN, node)
            if up is not None:
                self.push_node(up, UP, node)

    def run(self) -> dict[str, float]:
        wall = time.perf_counter()
        arrivals, i = self.jobs, 0
        while i < len(arrivals) or self.events:
            now = min(
                arrivals[i].submit if i < len(arrivals) else float("inf"),
                self.events[0][0] if self.events else float("inf"),
            )
            self.record.advance(now)
            arrived = False
            while i < len(arrivals) and arrivals[i].submit <= now:
                arrived |= self.arrive(i)
                i += 1
            again, rounds = True, 0
            while again:
                while self.events and self.events[0][0] <= now:
                    _, _, kind, job, gen = heapq.heappop(self.events)
                    if kind >= DOWN:
                        (self.down if kind == DOWN else self.up)(job, now)
                    elif gen == self.generation[job]:
                        (self.finish if kind == FINISH else self.stop)(job, now)
                room = self.free > 0 or bool(self.open_shares and self.pending_shares)
                if not (self.pending and (room or (arrived and self.preempts))):
                    break
                rounds += 1
                if rounds > 10_000:  # every round preempts and places at one instant
                    raise SchedulerError(f"plans do not settle at t={now}: a policy livelock")
                plan = self.plan(now)
                self.apply(plan, now)
                # Plan again at this instant if the plan stopped short and did something, or
                # preempted without grace (the victims are gone now).
                again = bool(plan or plan.preemptions) and (
                    plan.more or bool(plan.preemptions and self.grace_s <= 0)
                )
        out = self.record.summary()
        out.update(
            preemptions=self.preemptions,
            node_failures=self.node_failures,
            interruptions=sum(self.interrupted),
            rejected=len(self.rejected),
            jobs=len(self.jobs),
            completed=len(self.record.jct),
            failed=sum(self.jobs[i].status == "failed" for i in self.completed),
            cancelled=sum(self.jobs[i].status == "cancelled" for i in self.completed),
            plans=self.plans,
            wall_s=time.perf_counter() - wall,
        )
        return out

    def write_jobs(self, path: str) -> None:
        """One CSV row per job of the trace, in its order: what became of it."""
        with open(path, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(JOB_COLUMNS)
            for i, job in enumerate(self.jobs):
                start, end = self.started.get(i), self.completed.get(i)
                if i in self.completed:
                    fate = job.status
                else:  # a replay ends with nothing running
                    fate = "rejected" if i in self.rejected else "pending"
                out.writerow(
                    [
                        i,
                        job.group,
                        job.user,
                        job.gpus,
                        job.gpu_type or "",
                        _num(job.submit),
                        _num(job.duration),
                        "" if start is None else _num(start),
                        "" if end is None else _num(end),
                        "" if start is None else _num(start - job.submit),
                        "" if end is None else _num(end - job.submit),
                        self.preempted[i],
                        self.interrupted[i],
                        _num(self.attained[i]),
                        fate,
                    ]
                )

    # ----------------------------------------------------------------- events

    def arrive(self, i: int) -> bool:
        job = self.jobs[i]
        self.record.arrived(job.submit)
        call = self.call(i, job.duration)
        if job.gpus <= 0 or self.never_fits(call) is not None:
            self.rejected.add(i)
            return False
        self.add_pending(i, call)
        self.record.want(job.group, job.gpus)
        return True

    def call(self, i: int, expected_s: float, queued_time: float | None = None) -> Pending:
        """Job ``i`` as a pending call."""
        job = self.jobs[i]
        whole = job.gpus >= 1
        return Pending(
            str(i),
            int(job.gpus) if whole else 1,
            job.user,
            job.group,
            gpu_model=job.gpu_type,
            submit_time=job.submit,
            expected_s=expected_s,
            attained_gpu_s=self.attained[i],
            queued_time=queued_time,
            share=1.0 if whole else job.gpus,
        )

    def add_pending(self, i: int, call: Pending) -> None:
        self.pending.add(call, i)
        self.pending_shares += call.share != 1.0

    def never_fits(self, call: Pending) -> str | None:
        """Submit-time rejection, remembered per kind of call (the cluster never changes)."""
        key = (call.amount, call.gpu_model, call.group)
        if key not in self.verdicts:
            quotas = self.quotas if self.policy.uses_quotas else None
            self.verdicts[key] = never_fits(call, self.nodes, quotas)
        return self.verdicts[key]

    def finish(self, i: int, now: float) -> None:
        run = self.release(i, now)
        self.attained[i] = run.attained(now)
        job = self.jobs[i]
        self.record.want(job.group, -job.gpus)
        self.record.finished(job.submit, job.duration, now)
        self.completed[i] = now

    def stop(self, i: int, now: float) -> None:
        """A preempted job's grace is over: it gives its GPUs back and queues again."""
        self.requeue(i, now)
        self.preempted[i] += 1

    def down(self, n: int, now: float) -> None:
        """Node ``n`` fails: the jobs on it stop at once (their work since the last checkpoint
        lost, as at a preemption) and queue again; nothing is placed on it until it is up."""
        self.outages[n] += 1
        node = self.nodes[n]
        if self.outages[n] > 1:
            return  # already down
        self.node_failures += 1
        hit = [int(r.id) for r in self.running.values() if any(p.node_id == n for p in r.parts)]
        for i in hit:
            self.requeue(i, now)
            self.interrupted[i] += 1
        node.draining = True
        self.free -= len(node.free_gpus)

    def up(self, n: int, now: float) -> None:
        self.outages[n] -= 1
        if self.outages[n] == 0:
            node = self.nodes[n]
            node.draining = False
            self.free += len(node.free_gpus)

    def requeue(self, i: int, now: float) -> None:
        """Job ``i`` stops running and queues again with its remaining work."""
        run = self.release(i, now)
        self.remaining[i] -= now - run.start_time
        self.remaining[i] += self.preemption_cost_s
        self.attained[i] = run.attained(now)
        self.add_pending(i, self.call(i, self.remaining[i], queued_time=now))

    def release(self, i: int, now: float) -> Running:
        run = self.running.pop(str(i))
        self.ends.remove(run)
        if self.standing is not None:
            self.standing.remove(run)
        if not run.preempting:
            self.hold(run, -1)
        self.generation[i] += 1
        if run.share != 1.0:
            node_id, index = run.node_id, run.gpu_indices[0]
            holders = self.sharing[node_id][index]
            del holders[run.id]
            if not holders:  # the last of its calls: the GPU is free again
                del self.sharing[node_id][index]
                self.nodes[node_id].free_gpus.append(index)
                self.free += 1
            self.reshare(node_id)
        else:
            for part in run.parts:
                self.nodes[part.node_id].free_gpus.extend(part.gpu_indices)
            self.free += run.gpus
        self.note_held(run.group, run.user, -run.amount, now)
        return run

    def reshare(self, node_id: int) -> None:
        """Show the node's shared GPUs as they are now (``NodeCapacity.shared``)."""
        shared = SharedGpu.of(r for h in self.sharing.get(node_id, {}).values() for r in h.values())
        self.open_shares -= {(node_id, g.index) for g in self.nodes[node_id].shared}
        self.open_shares |= {(node_id, g.index) for g in shared if g.left > EPSILON}
        self.nodes[node_id].shared = shared

    def hold(self, run: Running, sign: int) -> None:
        """Count a running call's GPUs in (``sign`` 1) or out of (-1) :attr:`held`."""
        group = run.group
        whole = self.whole.get(group, 0)
        parts = self.parts.setdefault(group, {})
        if run.share == 1.0:
            whole = self.whole[group] = whole + sign * run.gpus
        elif sign > 0:
            parts[run.id] = run.share
        else:
            del parts[run.id]
        self.held[group] = whole + math.fsum(parts.values()) if parts else whole

    def note_held(self, group: str, user: str, gpus: float, now: float) -> None:
        self.groups.change(group, gpus, now)
        self.users.change((group, user), gpus, now)
        self.record.hold(group, gpus)

    def push(self, t: float, kind: int, job: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, job, self.generation[job]))

    def push_node(self, t: float, kind: int, node: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, node, 0))

    # ----------------------------------------------------------------- planning

    def plan(self, now: float) -> Plan:
        self.plans += 1
        pending: Sequence[Pending] = self.pending
        if self.look_ahead is not None:
            pending = lookahead.shown(pending, self.nodes, self.look_ahead)
        snapshot = Snapshot(
            nodes=self.nodes,
            pending=pending,
            running=list(self.running.values()),
            quotas=self.quotas,
            usage=Usage(self.groups, now),
            user_usage=Usage(self.users, now),
            now=now,
            reserved=self.reserved,
            reserved_on=self.reserved_on,
            promised=self.promised,
            share_across_users=self.share_across_users,
            ends=self.ends,
            held=self.held,
            standing=self.standing,
        )
        out = self.policy.plan(snapshot)
        self.reserved = dict(out.reserved)
        self.reserved_on = out.reserved_on
        self.promised = out.promised
        return out

    def apply(self, plan: Plan, now: float) -> None:
        for d in plan:
            call = self.pending.pop(d.invocation_id)
            self.pending_shares -= call.share != 1.0
            i = int(call.id)
            holders: dict[str, Running] = {}
            if call.share != 1.0:
                holders = self.sharing.setdefault(d.node_id, {}).setdefault(d.gpu_indices[0], {})
            for part in d.parts:
                taken = set(part.gpu_indices)
                node = self.nodes[part.node_id]
                if call.share == 1.0 or not holders:  # (a share on a GPU free till now)
                    node.free_gpus = [g for g in node.free_gpus if g not in taken]
                    self.free -= len(taken)
            run = Running(
                call.id,
                d.node_id,
                d.gpu_indices,
                call.user,
                call.group,
                start_time=now,
                expected_s=self.remaining[i],
                borrowed=d.borrowed,
                more=d.more,
                attained_gpu_s=self.attained[i],
                queued_time=call.waiting_since,
                share=call.share,
            )
            self.running[call.id] = run
            self.ends.add(run)
            if self.standing is not None:
                self.standing.add(run)
            self.hold(run, 1)
            if call.share != 1.0:
                holders[call.id] = run
                self.reshare(d.node_id)
            self.started.setdefault(i, now)
            self.note_held(call.group, call.user, run.amount, now)
            self.push(now + self.remaining[i], FINISH, i)
        for p in plan.preemptions:
            run = self.running[p.invocation_id]
            if run.preempting:
                continue  # already told: its notice stands
            self.preemptions += 1
            self.running[run.id] = told = replace(run, preempting=True)
            if self.standing is not None:
                self.standing.remove(run)
                self.standing.add(told)
            self.hold(run, -1)
            self.push(now + self.grace_s, STOP, int(run.id))


@dataclass(frozen=True, slots=True)
class Options:
    """One replay's settings (the command line's flags)."""

    policy: str = "fifo"
    nodes: int = 32
    gpus_per_node: int = 8
    quota_file: str | None = None
    half_life_s: float = DEFAULT_HALF_LIFE_S
    grace_s: float = 0.0
    #: Work a job redoes each time it is preempted (lost work and restart), seconds.
    preemption_cost_s: float = 0.0
    #: GPU models cycled over the nodes; without them jobs' gpu_type is ignored.
    models: tuple[str, ...] = ()
    #: The fair policy's starvation guard, seconds (None: the policy's default; 0: off).
    starve_after_s: float | None = None
    #: Write one CSV row per job here (``JOB_COLUMNS``).
    jobs_out: str | None = None
    #: A nodes file (scheduler.traces.read_nodes): the cluster, in place of the three above.
    nodes_file: str | None = None
    #: Show rounds only what a live round reads, at most this many calls (None: all).
    look_ahead: int | None = None
    #: A node failures file (scheduler.traces.read_failures).
    node_failures: str | None = None
    #: Jobs of different users may share a GPU (jobs asking for part of one).
    share_across_users: bool = False
    #: The fair policy's least attained service (off: fair-share order only), and the least
    #: a job runs before it may preempt it (None: the policy's default).
    least_attained: bool = True
    min_run_s: float | None = None
    #: The fair policy's shelter for calls on whole nodes (see scheduler.fair, step 3).
    shelter_whole_nodes: bool = True
    #: The fair policy's fair share among borrowers (step 4) and its margin (None: default).
    share_preemption: bool = True
    share_margin: float | None = None
    #: The fair policy's order inside a user's calls of one class: shortest expected first
    #: (the replay gives each job its true remaining duration as its expected duration).
    shortest_first: bool = True


def policy_names() -> list[str]:
    """Every policy a replay can run: the live ones and the yardsticks."""
    return sorted({*policies.POLICIES, *yardsticks.YARDSTICKS})


def get_policy(name: str, **settings: object) -> Policy:
    if name in yardsticks.YARDSTICKS:
        return yardsticks.YARDSTICKS[name](**settings)
    return policies.get(name, **settings)


def replay(trace: str | Sequence[Job], options: Options) -> dict[str, float]:
    """Replay a trace (a file, or jobs already read) and return its metrics
    (see :mod:`scheduler.metrics`)."""
    jobs = traces.read(trace) if isinstance(trace, str) else list(trace)
    if options.nodes_file:
        cluster = Cluster(tuple(traces.read_nodes(options.nodes_file)))
    else:
        cluster = Cluster.uniform(options.nodes, options.gpus_per_node, options.models)
    ignored = 0
    if not any(model for _, model in cluster.layout):
        ignored = sum(1 for j in jobs if j.gpu_type)
        jobs = [replace(j, gpu_type=None) if j.gpu_type else j for j in jobs]
    capacity = cluster.gpus
    failures: list[tuple[int, float, float | None]] = []
    if options.node_failures:
        failures = traces.read_failures(options.node_failures, len(cluster.layout))
    if options.quota_file:
        quotas = traces.read_quotas(options.quota_file)
    else:
        quotas = traces.derive_quotas(jobs, capacity)
    settings: dict[str, object] = {}
    if options.starve_after_s is not None:
        settings["starve_after_s"] = options.starve_after_s or None
    if not options.least_attained:
        settings["las_thresholds"] = ()
    if options.min_run_s is not None:
        settings["min_run_s"] = options.min_run_s
    if not options.shelter_whole_nodes:
        settings["shelter_whole_nodes"] = False
    if not options.share_preemption:
        settings["share_preemption"] = False
    if options.share_margin is not None:
        settings["share_margin"] = options.share_margin
    if not options.shortest_first:
        settings["shortest_first"] = False
    sim = Simulator(
        jobs,
        get_policy(options.policy, **settings),
        cluster,
        quotas,
        options.half_life_s,
        options.grace_s,
        options.preemption_cost_s,
        options.look_ahead,
        failures,
        options.share_across_users,
    )
    out = sim.run()
    out.update(nodes=len(sim.nodes), gpus=capacity, gpu_types_ignored=ignored)
    if options.jobs_out:
        sim.write_jobs(options.jobs_out)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bulletin replay",
        description="Replay a job trace through a scheduling policy on a virtual clock.",
    )
    p.add_argument("trace", help="CSV trace: plain, Philly or Tiresias (see scheduler.traces)")
    p.add_argument(
        "--policy",
        default="fifo",
        choices=policy_names(),
        help="a live policy, or a replay-only yardstick (las, srtf: scheduler.yardsticks)",
    )
    p.add_argument("--nodes", type=int, help="nodes of the cluster (default 32)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs of each node (default 8)")
    p.add_argument(
        "--nodes-file",
        metavar="FILE",
        help="CSV gpus,model,count: a cluster of mixed nodes (in place of --nodes, "
        "--gpus-per-node and --node-models)",
    )
    p.add_argument("--quota-file", help='JSON: {"group": {"guaranteed": 8, "borrow_limit": 64}}')
    p.add_argument("--format", choices=["text", "json"], default="text")
    p.add_argument("--half-life-s", type=float, default=DEFAULT_HALF_LIFE_S)
    p.add_argument("--grace-s", type=float, default=0.0, help="preemption notice period")
    p.add_argument(
        "--preemption-cost-s",
        "--restart-overhead-s",
        dest="preemption_cost_s",
        type=float,
        default=0.0,
        help="work a job redoes each time it is preempted: lost work and restart (seconds)",
    )
    p.add_argument("--jobs-out", metavar="FILE", help="write one CSV row per job here")
    p.add_argument(
        "--node-failures",
        metavar="FILE",
        help="CSV node,down,up: outages; the jobs on a failing node queue again",
    )
    p.add_argument(
        "--look-ahead",
        type=int,
        nargs="?",
        const=lookahead.MOST,
        metavar="MOST",
        help="show each round only what a live round reads: each user's first 16 + 16 per "
        f"free GPU, at most MOST in all (default {lookahead.MOST}, the gateway's --plan-batch)",
    )
    p.add_argument(
        "--share-across-users",
        action="store_true",
        help="jobs asking for part of a GPU may share one with other users' jobs (default: "
        "only with their own user's)",
    )
    p.add_argument(
        "--node-models",
        default="",
        help="comma-separated GPU models, cycled over the nodes; enables gpu_type",
    )
    p.add_argument(
        "--starve-after-s",
        type=float,
        default=None,
        help="fair: wait after which a whole-node call gets a reservation "
        "(default 43200; 0: never)",
    )
    p.add_argument(
        "--no-least-attained",
        dest="least_attained",
        action="store_false",
        help="fair: fair-share order only, no least attained service (2D-LAS)",
    )
    p.add_argument(
        "--min-run-s",
        type=float,
        default=None,
        help="fair: the least a job runs before least attained service may preempt it "
        "(default 0)",
    )
    p.add_argument(
        "--no-whole-node-shelter",
        dest="shelter_whole_nodes",
        action="store_false",
        help="fair: a job on whole nodes gives way to smaller jobs under least attained "
        "service as often as they ask (default: once at most)",
    )
    p.add_argument(
        "--no-share-preemption",
        dest="share_preemption",
        action="store_false",
        help="fair: no fair share among borrowers (a group that borrows less for its weight "
        "does not take another's borrowed jobs)",
    )
    p.add_argument(
        "--share-margin",
        type=float,
        default=None,
        help="fair: how much more a group must borrow for its weight than the asking job's "
        "for fair share among borrowers to take its jobs (default 8)",
    )
    p.add_argument(
        "--no-shortest-first",
        dest="shortest_first",
        action="store_false",
        help="fair: a user's jobs of one class of service in queue order (default: the "
        "shortest expected first; the replay expects each job's true duration)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``bulletin replay``: print the metrics; 0 on success, 2 on bad input."""
    args = parser().parse_args(argv)
    shaped = [f for f in ("nodes", "gpus_per_node", "node_models") if getattr(args, f)]
    if args.nodes_file and shaped:
        flags = ", ".join("--" + f.replace("_", "-") for f in shaped)
        print(f"--nodes-file describes the whole cluster: drop {flags}", file=sys.stderr)
        return 2
    args.nodes = 32 if args.nodes is None else args.nodes
    args.gpus_per_node = 8 if args.gpus_per_node is None else args.gpus_per_node
    if args.nodes < 1 or args.gpus_per_node < 1:
        print("--nodes and --gpus-per-node must be at least 1", file=sys.stderr)
        return 2
    fair_only = [
        flag
        for flag, given in (
            ("--starve-after-s", args.starve_after_s is not None),
            ("--no-least-attained", not args.least_attained),
            ("--min-run-s", args.min_run_s is not None),
            ("--no-whole-node-shelter", not args.shelter_whole_nodes),
            ("--no-share-preemption", not args.share_preemption),
            ("--share-margin", args.share_margin is not None),
            ("--no-shortest-first", not args.shortest_first),
        )
        if given
    ]
    if fair_only and args.policy != "fair":
        print(f"{', '.join(fair_only)}: settings of --policy fair only", file=sys.stderr)
        return 2
    if args.min_run_s is not None and args.min_run_s < 0:
        print("--min-run-s cannot be negative", file=sys.stderr)
        return 2
    if args.share_margin is not None and not args.share_margin > 0:
        print("--share-margin must be above 0 (0 would let two groups swap calls back "
              "and forth)", file=sys.stderr)  # fmt: skip
        return 2
    if args.look_ahead is not None and args.look_ahead < 1:
        print("--look-ahead must be at least 1", file=sys.stderr)
        return 2
    if args.preemption_cost_s < 0 or args.grace_s < 0:
        print("--preemption-cost-s and --grace-s cannot be negative", file=sys.stderr)
        return 2
    if args.starve_after_s is not None and args.starve_after_s < 0:
        print("--starve-after-s cannot be negative (0 turns the guard off)", file=sys.stderr)
        return 2
    options = Options(
        args.policy,
        args.nodes,
        args.gpus_per_node,
        args.quota_file,
        args.half_life_s,
        args.grace_s,
        args.preemption_cost_s,
        tuple(m for m in args.node_models.split(",") if m),
        args.starve_after_s,
        args.jobs_out,
        args.nodes_file,
        args.look_ahead,
        args.node_failures,
        args.share_across_users,
        args.least_attained,
        args.min_run_s,
        args.shelter_whole_nodes,
        args.share_preemption,
        args.share_margin,
        args.shortest_first,
    )
    try:
        metrics = replay(args.trace, options)
    except traces.TraceError as exc:
        print(exc, file=sys.stderr)
        return 2
    result = {"policy": args.policy, "nodes": args.nodes, "gpus_per_node": args.gpus_per_node}
    if args.nodes_file:
        result["gpus_per_node"] = "mixed"
    result.update(metrics)
    if metrics["gpu_types_ignored"]:
        print(
            f"{metrics['gpu_types_ignored']:.0f} jobs ask for a GPU model (gpu_type) but the "
            "cluster's nodes have none: their models were ignored; give --node-models, or a "
            "--nodes-file with a model column",
            file=sys.stderr,
        )
    if args.format == "json":
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>14}: {value:.4g}" if isinstance(value, float) else f"{key:>14}: {value}")
    return 0


def _num(value: float) -> str:
    return f"{value:.0f}" if value == int(value) else f"{value:.3f}"


if __name__ == "__main__":
    sys.exit(main())
