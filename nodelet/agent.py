"""The node agent's main loop: register, then poll for work, heartbeat and keep workers warm.

Three named background tasks run until ``stop`` is set: the poll loop (starts an
:class:`~nodelet.attempt.Attempt` per assignment), the heartbeat loop (renews leases, and
kills every attempt itself when it cannot renew in time: DESIGN.md invariant 3), and the
worker pool's maintainer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
import signal
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from bulletin_core import shared, wire
from bulletin_core.backoff import Backoff
from nodelet.accounts import Accounts, unreachable
from nodelet.attempt import Attempt, NodeFacts, removals_done
from nodelet.client import GatewayClient
from nodelet.completions import Completions
from nodelet.config import NodeletConfig
from nodelet.errors import AuthRejected, GatewayUnavailable, NodeletError, Superseded
from nodelet.gpus import GpuProvider, choose_provider, describe
from nodelet.leftovers import sweep, temporary_work_dir
from nodelet.limits import device_rule
from nodelet.pool import WorkerPool

log = logging.getLogger(__name__)

#: How long shutdown waits for killed attempts to wind down.
SHUTDOWN_GRACE_S = 1.0
#: A heartbeat that took this much longer than its timeout to fail was frozen in flight.
FROZEN_S = 1.0
#: How long the check that this node sees the shared directory may take (a hung NFS mount).
SHARED_CHECK_S = 10.0
#: The exit status of a nodelet that another start of its node superseded. A service
#: manager must not restart it (systemd: ``RestartPreventExitStatus=3``): two nodelets of one
#: node would supersede each other forever.
SUPERSEDED_EXIT = 3
#: The exit status of a nodelet whose token the gateway refuses (revoked: the node was removed,
#: or the token replaced). Restarting it cannot help until a new token is in place
#: (systemd: ``RestartPreventExitStatus=3 4``).
REJECTED_EXIT = 4
_T = TypeVar("_T")


def run(config: NodeletConfig) -> None:
    """Serve until SIGINT or SIGTERM; exit with status 4 (:data:`REJECTED_EXIT`) if the
    gateway refuses the node's token, 3 (:data:`SUPERSEDED_EXIT`) if another start of the
    node superseded this one, 1 if the gateway refuses the node otherwise."""
    try:
        asyncio.run(_serve_until_signalled(config))
    except Superseded as exc:
        log.critical(
            "nodelet stopped: %s; exit status %d (superseded: another start of this node took "
            "it over; do not restart this one, e.g. systemd RestartPreventExitStatus=%d)",
            exc,
            SUPERSEDED_EXIT,
            SUPERSEDED_EXIT,
        )
        raise SystemExit(SUPERSEDED_EXIT) from None
    except AuthRejected as exc:
        log.critical(
            "nodelet stopped: %s; exit status %d (put a new token in place, e.g. 'bulletin node "
            "add %s --replace', before starting it again; systemd RestartPreventExitStatus=%d)",
            exc,
            REJECTED_EXIT,
            config.name,
            REJECTED_EXIT,
        )
        raise SystemExit(REJECTED_EXIT) from None
    except (NodeletError, ValueError) as exc:  # ValueError: a setting it cannot serve with
        log.critical("nodelet stopped: %s", exc)
        raise SystemExit(1) from None


async def _serve_until_signalled(config: NodeletConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        loop.add_signal_handler(signum, stop.set)
    try:
        await serve(config, stop)
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)


async def serve(config: NodeletConfig, stop: asyncio.Event) -> None:
    """Register the node and run it until ``stop`` is set.

    Raises AuthRejected when the token is refused, GatewayRejected when registration is.
    """
    accounts = Accounts.from_setting(config.user_mapping, config.trusted_users)
    if not accounts.single_tenant:
        accounts.check_interpreter()
    log.info("calls: %s", accounts.describe())
    if accounts.single_tenant and accounts.trusted and os.geteuid() == 0:
        log.warning(
            "trusted_users' calls run as root on this node: they can do anything root can "
            "(read every secret, change the node); run it with --user-mapping instead unless "
            "they are its administrators"
        )
    # Before the node registers: kill whatever an earlier nodelet of this node left running.
    await asyncio.to_thread(sweep, config)
    work_dir = config.work_dir or await asyncio.to_thread(temporary_work_dir)
    if not accounts.single_tenant:
        os.chmod(work_dir, 0o711)  # workers switched to users' accounts pass through it
        blocked = unreachable([work_dir])
        if blocked is not None:
            raise ValueError(
                f"work_dir {work_dir}: workers switched to their users' accounts cannot reach "
                f"it through {blocked}: choose a work directory under directories every "
                "account may traverse (e.g. /var/lib/bulletin-nodelet)"
            )
    client = GatewayClient(
        config.gateway_url, config.token, timeout_s=config.http_timeout_s, ca_file=config.ca_file
    )
    gpus = choose_provider(
        config.fake_gpus,
        node=config.name,
        fault_file=config.fake_gpu_faults or None,
        device_dir=config.fake_gpu_device_dir or None,
        model=config.fake_gpu_model,
    )
    pool: WorkerPool | None = None
    try:
        registration = await _unless_stopped(_register(client, config, gpus), stop)
        if registration is not None:
            pool = await asyncio.to_thread(worker_pool, config, work_dir, gpus)
            facts = NodeFacts(
                node=config.name,
                work_dir=work_dir,
                inline_limit=registration.inline_limit,
                log_flush_s=config.log_flush_s,
                gpus=gpus,
                cluster_shared_dir=registration.shared_dir,
                shared_dir=await shared_dir_seen(registration),
                accounts=accounts,
            )
            discovered = await asyncio.to_thread(gpus.discover)
            pool.set_gpu_spares(
                spare_gpu_sets([g.index for g in discovered], config.spare_shapes),
                config.gpu_spare_workers,
            )
            node = Node(config, client, pool, registration, facts)
            await node.run(stop)
    finally:
        if pool is not None:
            await pool.close()
        await client.aclose()
        await asyncio.to_thread(gpus.close)
        await removals_done(SHUTDOWN_GRACE_S * 10)
        if not config.work_dir:
            try:  # what is left of attempts whose removal did not finish: fd-based, no links
                await asyncio.to_thread(shutil.rmtree, work_dir, ignore_errors=True)
            except RecursionError:
                log.warning("could not remove %s (nested too deeply); left in place", work_dir)


def worker_pool(config: NodeletConfig, work_dir: str, gpus: GpuProvider) -> WorkerPool:
    """The worker pool, its limits detected for this machine and these GPUs."""
    devices = {
        index: tuple(rule for rule in map(device_rule, files) if rule is not None)
        for index, files in gpus.device_files().items()
    }
    return WorkerPool.from_config(config, cwd=work_dir, gpu_devices=devices)


def spare_gpu_sets(indices: Sequence[int], shapes: Sequence[int]) -> list[tuple[int, ...]]:
    """The GPU sets that get spare workers: for each shape N, every aligned block of N of the
    node's GPUs (a shape bigger than the node gets none)."""
    ordered = sorted(indices)
    return [
        tuple(ordered[start : start + n])
        for n in shapes
        for start in range(0, len(ordered) - n + 1, n)
    ]


async def _unless_stopped(work: Coroutine[Any, Any, _T], stop: asyncio.Event) -> _T | None:
    """The result of ``work``, or None if ``stop`` is set first (then ``work`` is cancelled)."""
    task = asyncio.create_task(work, name="nodelet-register")
    stopped = asyncio.create_task(stop.wait(), name="nodelet-stop")
    await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not task.done():
        task.cancel()
        await asyncio.wait([task])
        return None
    return task.result()


async def _register(
    client: GatewayClient, config: NodeletConfig, provider: GpuProvider
) -> wire.RegisterResponse:
    """Register, retrying while the gateway is down."""
    gpus = await asyncio.to_thread(provider.discover)
    request = wire.RegisterRequest(
        name=config.name, gpus=gpus, cpu_slots=config.effective_cpu_slots
    )
    backoff = Backoff()
    while True:
        try:
            response = await client.register(request)
        except GatewayUnavailable as exc:
            log.warning("cannot register with %s (%s); retrying", config.gateway_url, exc)
            await backoff.sleep()
            continue
        log.info(
            "registered as %r (node %d) with %d GPUs, %d CPU slots",
            config.name,
            response.node_id,
            len(gpus),
            request.cpu_slots,
        )
        return response


async def shared_dir_seen(registration: wire.RegisterResponse) -> str | None:
    """The cluster's shared directory if this node sees it (the same path holding the same
    cluster id), else None, with a warning: such a node cannot run calls whose payload is a
    file there, and sends big results as blobs."""
    root = registration.shared_dir
    if root is None:
        return None
    check = asyncio.to_thread(shared.sees, root, registration.shared_dir_id)
    try:
        seen = await asyncio.wait_for(check, SHARED_CHECK_S)
    except TimeoutError:
        seen = False
    if seen:
        log.info("the cluster's shared directory %s is mounted here", root)
        return root
    log.warning(
        "this node does not see the cluster's shared directory %s (missing, or holding another "
        "cluster's id in %s): calls whose payload is a file there will fail on this node; "
        "mount the shared directory at the same path on every node",
        root,
        shared.MARKER,
    )
    return None


class Node:
    """A registered node: runs its attempts and its background loops."""

    def __init__(
        self,
        config: NodeletConfig,
        client: GatewayClient,
        pool: WorkerPool,
        registration: wire.RegisterResponse,
        facts: NodeFacts,
    ) -> None:
        self.config = config
        self.registration = registration
        self.lease_s = registration.lease_s
        self.attempts: dict[tuple[str, int], Attempt] = {}
        #: The last attempt of each map lease (Assignment.lease): the next one runs after it.
        self._lease_tails: dict[str, Attempt] = {}
        self._stopping = False
        self._client = client
        self.completions = Completions(client, self._launch_all, lambda: not self._stopping)
        self._pool = pool
        self._facts = facts
        # The GPUs' latest health sample, and critical reports not yet delivered (an XID is
        # in one sample only: it must not be lost to the next sample before a heartbeat).
        self._health: dict[int, wire.GpuHealthReport] = {}
        self._critical: dict[int, wire.GpuHealthReport] = {}
        self._draining: bool | None = None
        #: The last heartbeat was answered: the gateway's database is unavailable.
        self._database_down = False

    def running(self) -> list[wire.Attempt]:
        """The attempts this node still runs; killed ones are already given up."""
        return [attempt.ref for attempt in self._live()]

    def _live(self) -> list[Attempt]:
        return [attempt for attempt in self.attempts.values() if not attempt.killed]

    async def run(self, stop: asyncio.Event) -> None:
        """Run the loops until ``stop`` is set or one of them fails; then kill every attempt."""
        loops = [
            asyncio.create_task(self._poll_loop(), name="nodelet-poll"),
            asyncio.create_task(self._heartbeat_loop(), name="nodelet-heartbeat"),
            asyncio.create_task(self._pool.maintain(), name="nodelet-worker-pool"),
            asyncio.create_task(self._health_loop(), name="nodelet-gpu-health"),
        ]
        stopped = asyncio.create_task(stop.wait(), name="nodelet-stop")
        try:
            await asyncio.wait([*loops, stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._stopping = True
            for task in [*loops, stopped]:
                task.cancel()
            await asyncio.wait([*loops, stopped])
            handed_back = self.running()
            await self._kill_all("the nodelet is stopping")
            await self.completions.aclose()
            await self._release(handed_back)
        for task in loops:
            failure = None if task.cancelled() else task.exception()
            if failure is not None:
                raise failure

    async def _poll_loop(self) -> None:
        backoff = Backoff()
        while True:
            try:
                response = await self._client.poll(
                    self.running(),
                    hold_s=self.registration.long_poll_s,
                    preempting=[a.ref for a in self._live() if a.preempting],
                )
            except (AuthRejected, Superseded):
                raise
            except NodeletError as exc:
                log.warning("poll failed (%s); retrying", exc)
                await backoff.sleep()
                continue
            backoff.reset()
            self._revoke(response.revoked)
            self._preempt(response.preempt)
            self._launch_all(response.assignments)

    def _launch_all(self, assignments: list[wire.Assignment]) -> None:
        for assignment in assignments:
            self._launch(assignment)

    def _launch(self, assignment: wire.Assignment) -> None:
        key = (assignment.invocation_id, assignment.epoch)
        if key in self.attempts:
            return  # already running: the gateway did not see it in `running` yet
        attempt = Attempt(
            assignment,
            client=self._client,
            pool=self._pool,
            facts=self._facts,
            complete=functools.partial(
                self.completions.complete, mapped=assignment.lease is not None
            ),
        )
        self.attempts[key] = attempt
        behind = None
        if assignment.lease is not None:  # after the lease's attempts this node holds
            behind = self._lease_tails.get(assignment.lease)
            self._lease_tails[assignment.lease] = attempt
        # A GPU is never in two live attempts: this one starts once every other attempt on
        # its GPUs has ended. One revoked in the same answer that gives its GPUs to this one
        # is still dying; one that just completed is still finishing; one the gateway no
        # longer knows of (a database crash lost its assignment, committed without waiting
        # for its WAL flush) runs until the next poll revokes it. The attempts of its own
        # map lease run one after the other anyway (``behind``). Calls that asked for part of
        # a GPU share it: they run beside each other (the gateway keeps their parts within 1).
        gpus = set(assignment.gpu_indices)
        share = assignment.gpu_share < 1
        holding = [
            a.task
            for a in (self.attempts.values() if gpus else ())
            if a is not attempt
            and a.task is not None
            and not a.task.done()
            and gpus & set(a.assignment.gpu_indices)
            and (assignment.lease is None or a.assignment.lease != assignment.lease)
            and not (share and a.assignment.gpu_share < 1)
        ]
        attempt.start(after=holding, behind=behind).add_done_callback(
            lambda _: self._ended(key, attempt)
        )
        if behind is None:
            log.info(
                "started %s (%s) on GPUs %s",
                attempt,
                assignment.function_name or "unnamed function",
                assignment.gpu_indices,
            )
        else:
            log.debug("queued %s behind %s in its lease", attempt, behind)

    def _ended(self, key: tuple[str, int], attempt: Attempt) -> None:
        self.attempts.pop(key, None)
        lease = attempt.assignment.lease
        if lease is not None and self._lease_tails.get(lease) is attempt:
            del self._lease_tails[lease]

    def _revoke(self, revoked: list[wire.Attempt]) -> None:
        for ref in revoked:
            attempt = self.attempts.get((ref.invocation_id, ref.epoch))
            if attempt is not None:
                log.info("%s revoked by the gateway; killing it", attempt)
                attempt.kill()

    def _preempt(self, orders: list[wire.Preemption]) -> None:
        for order in orders:
            attempt = self.attempts.get((order.invocation_id, order.epoch))
            if attempt is not None:
                attempt.preempt(order.grace_s, order.reason)

    async def _heartbeat_loop(self) -> None:
        asked_again = False
        while True:
            sent = time.monotonic()
            held = self._live()
            # Past the deadline (frozen, starved), a lease may have lapsed and the call run
            # elsewhere: only a real renewal, naming what is still ours, keeps it then.
            in_time = self._until_deadline() > 0
            timeout_s = self._heartbeat_timeout()
            if await self._heartbeat([a.ref for a in held], timeout_s=timeout_s, in_time=in_time):
                for attempt in held:
                    attempt.renewed_at = sent  # the gateway renewed as of (after) this moment
            elif not asked_again and time.monotonic() - sent > timeout_s + FROZEN_S:
                # It failed because this process was frozen (or starved) while it was in
                # flight, not for want of an answer: ask once more before killing anything.
                asked_again = True
                continue
            asked_again = False
            self._kill_expiring()
            pause = self.registration.heartbeat_s - (time.monotonic() - sent)
            await asyncio.sleep(max(0.01, min(pause, self._until_deadline())))

    async def _heartbeat(
        self, running: list[wire.Attempt], *, timeout_s: float, in_time: bool = True
    ) -> bool:
        """One heartbeat; True if it renewed the leases of ``running``, or if the gateway
        answered that its database is unavailable and the heartbeat was sent ``in_time``
        (before the kill deadline). Then nobody can expire a lease until the database is
        back, and the scheduling leader gives every lease a full term from then before it
        expires any (docs/architecture.md, fencing): the node keeps its calls."""
        health = [self._critical.get(i, report) for i, report in sorted(self._health.items())]
        reported = dict(self._critical)
        try:
            response = await self._client.heartbeat(
                running, gpu_health=health, warm=self._pool.warm_functions(), timeout_s=timeout_s
            )
        except (AuthRejected, Superseded):
            raise
        except GatewayUnavailable as exc:
            if exc.database_down:
                if not self._database_down:
                    log.warning(
                        "the gateway's database is unavailable; keeping the %d running "
                        "attempts (nobody can reassign them meanwhile)",
                        len(running),
                    )
                self._database_down = True
                return in_time
            log.warning("heartbeat failed: %s", exc)
            return False
        except NodeletError as exc:
            log.warning("heartbeat failed: %s", exc)
            return False
        if self._database_down:
            log.info("the gateway's database is back")
            self._database_down = False
        for index, report in reported.items():
            if self._critical.get(index) is report:
                del self._critical[index]
        self.lease_s = response.lease_s
        self._revoke(response.revoked)
        self._preempt(response.preempt)
        self._note_draining(response)
        return True

    def _note_draining(self, response: wire.HeartbeatResponse) -> None:
        if response.draining == self._draining:
            return
        if response.draining:
            log.warning("this node is draining: no new work (%s)", response.drain_reason)
        elif self._draining is not None:
            log.info("this node takes work again")
        self._draining = response.draining

    async def _health_loop(self) -> None:
        """Sample the GPUs' health every heartbeat interval (in a thread: NVML blocks)."""
        provider = self._facts.gpus
        while True:
            try:
                sample = await asyncio.to_thread(provider.health)
            except Exception:
                log.exception("sampling GPU health failed")
                sample = []
            for report in sample:
                self._health[report.index] = report
                if report.critical is not None:
                    if report.index not in self._critical:
                        log.error("GPU must leave service: %s", describe(report))
                    self._critical[report.index] = report
            await asyncio.sleep(self.registration.heartbeat_s)

    def _heartbeat_timeout(self) -> float:
        # A heartbeat still in flight at the kill deadline is as good as a failed one. Past
        # the deadline (the nodelet was stopped, or starved), one heartbeat is still worth
        # its answer: what it renews was still this node's (a lease that ran out meanwhile
        # comes back revoked), so a storm the leader held back does not kill every call.
        until = self._until_deadline()
        if until <= 0:
            return min(self.config.http_timeout_s, self.registration.heartbeat_s)
        return min(self.config.http_timeout_s, max(until, 0.05))

    def _until_deadline(self) -> float:
        """Seconds until the first live attempt must be killed for want of a renewal."""
        renewals = [a.renewed_at for a in self._live()]
        if not renewals:
            return self.config.http_timeout_s
        return min(renewals) + self._grace_s() - time.monotonic()

    def _kill_expiring(self) -> None:
        """Kill attempts whose lease may expire before another renewal: they will be requeued
        elsewhere, and must not run twice (DESIGN.md invariant 3)."""
        now = time.monotonic()
        for attempt in self._live():
            if now - attempt.renewed_at >= self._grace_s():
                log.warning(
                    "%s: no lease renewal for %.1f s (lease %.1f s); killing it before its "
                    "lease expires and it is requeued elsewhere",
                    attempt,
                    now - attempt.renewed_at,
                    self.lease_s,
                )
                attempt.kill()

    def _grace_s(self) -> float:
        """How long the node may go without renewing before it must kill its attempts."""
        heartbeat_s = self.registration.heartbeat_s
        return self.lease_s - max(heartbeat_s, 0.25 * self.lease_s)

    async def _release(self, attempts: list[wire.Attempt]) -> None:
        """Hand killed attempts back so their calls run elsewhere now, not after their lease
        lapses, and without using up a retry. Best effort: a lease still lapses otherwise."""

        try:
            # First, so that what is handed back is not placed on this node again.
            await self._client.leave(timeout_s=SHUTDOWN_GRACE_S)
        except NodeletError as exc:
            log.info("could not tell the gateway this node is leaving (%s)", exc)
            return

        async def one(attempt: wire.Attempt) -> None:
            try:
                await self._client.release(
                    attempt.invocation_id, attempt.epoch, timeout_s=SHUTDOWN_GRACE_S
                )
            except NodeletError as exc:
                log.info("could not hand back %s (%s)", attempt.invocation_id, exc)

        await asyncio.gather(*(one(a) for a in attempts))

    async def _kill_all(self, why: str) -> None:
        attempts = list(self.attempts.values())
        if not attempts:
            return
        log.info("killing %d attempts: %s", len(attempts), why)
        for attempt in attempts:
            attempt.kill()
        tasks = [attempt.task for attempt in attempts if attempt.task is not None]
        await asyncio.wait(tasks, timeout=SHUTDOWN_GRACE_S)
