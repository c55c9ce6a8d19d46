"""Worker processes, pre-started so a call never waits for Python to boot, and kept warm
after a call for the next call of the same owner on the same GPUs (never across owners).

Workers are always exec'd (``python -m nodelet.worker_main``), never forked: forking a process that
has imported torch or created a CUDA context is unsafe. Each worker leads its own session.

Nothing a call starts outlives it. Where the machine has a usable cgroup
(:attr:`Limiter.tracking <nodelet.limits.Limiter.tracking>`), each worker has one of its own,
which everything it starts stays in, setsid or double-forked daemons alike; else the worker is
a child subreaper that adopts its descendants' orphans, so its process tree holds them (and
the nodelet adopts the orphans of a worker that died). When a call ends the worker kills what
it can itself; then the nodelet kills whatever is left but the worker (:meth:`Worker.end_call`),
and does not keep a worker warm when something of its call survives that. Stopped or
discarded, the whole cgroup or tree is killed, and :meth:`Worker.wait` returns once all of it
is gone (or, bounded, says what is not). Finding and killing processes reads ``/proc`` and may
take a while (a tree that keeps forking): the nodelet does it in threads, never in its event
loop, which must keep every call's heartbeat going. Each worker holds the read end of a
pipe whose write end only the nodelet has (its *lifeline*): when the nodelet dies, the worker
kills its tree and exits (:mod:`nodelet.worker_main`). The pool records its workers and cgroups in
the node's state directory, for the next nodelet to sweep (:mod:`nodelet.leftovers`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import importlib.util
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from bulletin_core import wire
from bulletin_core.backoff import Backoff
from nodelet import procs
from nodelet.config import worker_env_names
from nodelet.leftovers import NodeState, base_name, open_state
from nodelet.limits import Cgroup, Limiter, LimitUnavailable
from nodelet.outcomes import Outcomes
from nodelet.worker_main import KILL_WAIT_S, LIFELINE_ENV, OUTCOME_ENV, frame

if TYPE_CHECKING:
    from nodelet.config import NodeletConfig

log = logging.getLogger(__name__)

#: Set in a worker's environment: warm torch up before the first call (nodelet.worker_main).
WARM_TORCH = "BULLETIN_WARM_TORCH"

#: How often the pool checks that its idle workers are still alive.
_CHECK_S = 1.0
_RESPAWN_BACKOFF_MAX_S = 5.0
#: How often a terminated worker's processes are checked for survivors.
_STOP_POLL_S = 0.05
#: How often the processes a finished call left are checked while they die.
_END_POLL_S = 0.005
#: How long a dead worker's cgroup may stay busy (its processes dying) before it is left.
_CGROUP_REMOVE_S = 2.0
#: How long a dead worker's pipes may stay open once what it started was killed.
_PIPES_CLOSE_S = 2.0
#: How long a dead worker's process tree (no cgroup) may take to be gone once killed.
_TREE_GONE_S = 2.0
#: How long the processes a finished call left may take to die, per kill.
_END_KILL_S = 0.5


class Worker:
    """A handle on one worker process, and on everything it starts: its cgroup (``cgroup``)
    where it has one, else its process tree (``tree``)."""

    def __init__(
        self,
        process: asyncio.subprocess.Process,
        cgroup: Cgroup | None = None,
        *,
        start: int | None = None,
        exited: asyncio.Future[None] | None = None,
        outcomes: Outcomes | None = None,
    ) -> None:
        self.process = process
        #: The read end of the worker's outcome pipe (nodelet.worker_main).
        self.outcomes = outcomes
        # Done when the process exits (Process.wait() also waits for its pipes to close,
        # which what a call left running may hold open).
        self._exited = exited
        #: The worker's own cgroup; removed once it has exited.
        self.cgroup = cgroup
        #: Its start time (``/proc/PID/stat``): with the pid, who it is (nodelet.procs).
        self.start = start
        #: What it started, found by descent, where it has no cgroup.
        self.tree = procs.Tree(process.pid, start)
        #: Being stopped with a grace (SIGTERM, then SIGKILL): what it leaves is not swept.
        self.stopping = False
        self._not_stopping = asyncio.Event()
        self._not_stopping.set()
        #: Whether the worker was already running when a call got it (a spare, or warm from
        #: an earlier call); False when it was started for the call.
        self.warm = False
        #: Calls it ran, and the function of the last one (warm workers that ran the same
        #: function are preferred: module-level caches such as a loaded model survive).
        self.calls = 0
        self.last_function: str | None = None
        #: The user name of the owner of its last call (reported with its function).
        self.last_owner: str | None = None
        self._finished: asyncio.Future[int] | None = None
        # Kills run in a thread (kill): the one running, and whether another was asked since.
        self._killer: asyncio.Task[None] | None = None
        self._kill_again = False

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    @property
    def stdout(self) -> asyncio.StreamReader:
        assert self.process.stdout is not None  # started with stdout=PIPE
        return self.process.stdout

    @property
    def stderr(self) -> asyncio.StreamReader:
        assert self.process.stderr is not None  # started with stderr=PIPE
        return self.process.stderr

    async def send(self, task: wire.WorkerTask) -> bool:
        """Hand the worker a call (closing its stdin after a call without an end marker: the
        worker's last). False if the worker is already gone."""
        stdin = self.process.stdin
        assert stdin is not None  # started with stdin=PIPE
        prefix, body = frame(task)
        try:
            stdin.write(prefix + body)  # one write: the worker wakes once, to a whole task
            await stdin.drain()
            if not task.end_marker:
                stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            log.warning("worker %d exited before it received its task", self.pid)
            return False
        return True

    async def read_outcome(self, invocation_id: str, max_bytes: int) -> wire.WorkerOutcome | None:
        """The outcome the worker writes after the call of ``invocation_id``; None when its
        outcome pipe ends first (the worker died, or the call closed the pipe). An outcome
        of another call is skipped (the call's code may write any bytes there: what it
        writes for itself is its own outcome, as a value it returns would be).
        ``UntrustedOutcome`` for what is not an outcome of at most ``max_bytes`` (nothing
        after it can be trusted either: the worker must not run another call)."""
        if self.outcomes is None:
            return None
        return await self.outcomes.read(invocation_id, max_bytes)

    def members(self) -> procs.Identities:
        """The live processes of the worker: itself (while it runs) and all it started."""
        return self.cgroup.members() if self.cgroup is not None else self.tree.members()

    def kill(self) -> None:
        """SIGKILL the worker and everything it started: its whole cgroup, or process tree.
        In a thread, started now (a tree that keeps forking takes a while to stop): ``wait()``
        waits for it too. Outside an event loop, at once."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._kill_now()
            return
        self._kill_again = True
        if self._killer is None:
            self._killer = loop.create_task(self._killing(), name=f"kill-worker-{self.pid}")

    async def _killing(self) -> None:
        try:
            while self._kill_again:  # a kill asked while one ran: what it found may be new
                self._kill_again = False
                try:
                    await asyncio.to_thread(self._kill_now)
                except OSError as exc:  # a cgroup file that cannot be written (removed?)
                    log.warning("killing worker %d failed: %s", self.pid, exc)
        finally:
            self._killer = None

    def _kill_now(self) -> None:
        if self.cgroup is not None:
            self.cgroup.kill()
        else:
            self.tree.kill()

    async def _killed(self) -> None:
        """Wait for the kills asked so far to be done."""
        while self._killer is not None:
            await asyncio.shield(self._killer)

    async def end_call(self) -> bool:
        """Kill what the finished call left running, all but the worker (kept warm for the
        next call), and wait (briefly) until it is gone; again while something survives (a
        freeze that timed out, a process forked meanwhile). The worker killed what it could
        itself before it ended the call; this takes what it may not signal (a process that
        became root through a setuid program) or missed. False if something of the call
        still runs: the worker must not be kept warm."""
        if not self._may_have_others():  # the common case, checked without a thread
            return True
        left = await asyncio.to_thread(self._kill_others, time.monotonic() + KILL_WAIT_S)
        log.info(
            "worker %d: killed what its call left running%s",
            self.pid,
            f"; {sorted(left)} still running" if left else "",
        )
        return not left

    def _may_have_others(self) -> bool:
        """Whether something but the worker may be in its cgroup or tree (cheap: no stat of
        each process, no descent)."""
        if self.cgroup is not None:
            return self.cgroup.has_others(self.pid)
        return self.tree.has_others(self.pid)

    def _kill_others(self, deadline: float) -> procs.Identities:
        """Kill all but the worker, again until nothing else is left or ``deadline`` (a
        monotonic time) passes; what is still left. Blocking: run in a thread."""
        tracked = self.cgroup if self.cgroup is not None else self.tree
        while True:
            tracked.kill(spare=self.pid)
            until = min(deadline, time.monotonic() + _END_KILL_S)
            while (left := self._others()) and time.monotonic() < until:
                time.sleep(_END_POLL_S)
            if not left or time.monotonic() >= deadline:
                return left

    def _others(self) -> procs.Identities:
        return {p: s for p, s in self.members().items() if p != self.pid}

    async def stop(self, grace_s: float, *, call_ended: Callable[[], bool] | None = None) -> bool:
        """SIGTERM the worker and all it started, then SIGKILL them if any is still running
        after ``grace_s``. True if they had to be killed. A call that handles SIGTERM may end
        (``call_ended()``) with its worker alive: then they are killed at once."""
        self.stopping = True
        self._not_stopping.clear()
        try:
            tracked = self.cgroup if self.cgroup is not None else self.tree
            await asyncio.to_thread(tracked.signal, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while self.returncode is None or await self._has_members():
                if call_ended is not None and call_ended():
                    self.kill()
                    return False
                if time.monotonic() >= deadline:
                    self.kill()
                    return True
                await asyncio.sleep(_STOP_POLL_S)
            return False
        finally:
            self.stopping = False
            self._not_stopping.set()

    async def _has_members(self) -> bool:
        return bool(await asyncio.to_thread(self.members))

    async def exited(self) -> int:
        """Wait for the worker process to exit (only that); its exit status."""
        if self._exited is not None:
            await asyncio.shield(self._exited)
        else:
            await self.process.wait()
        assert self.returncode is not None  # set before the protocol hears of the exit
        return self.returncode

    async def wait(self) -> int:
        """Wait for the worker to exit; then kill whatever is left of what it started (once
        a stop's grace is over) and remove its cgroup. Its exit status."""
        return await asyncio.shield(self.finished())

    def finished(self) -> asyncio.Future[int]:
        """The future :meth:`wait` waits for (one per worker: never cancel it)."""
        if self._finished is None:
            self._finished = asyncio.ensure_future(self._finish())
        return self._finished

    async def _finish(self) -> int:
        returncode = await self.exited()
        await self._not_stopping.wait()
        await self._killed()
        if self.cgroup is not None:
            await _remove(self.cgroup)
        else:
            left = await asyncio.to_thread(self._kill_tree, _TREE_GONE_S)
            if left:
                log.warning(
                    "worker %d exited; processes %s it started are still running %g s after "
                    "they were killed",
                    self.pid,
                    sorted(left),
                    _TREE_GONE_S,
                )
        with contextlib.suppress(TimeoutError):  # its pipes close as what held them dies
            await asyncio.wait_for(self.process.wait(), _PIPES_CLOSE_S)
        if self.outcomes is not None:
            self.outcomes.close()
        return returncode

    def _kill_tree(self, timeout_s: float) -> procs.Identities:
        """Kill what is left of the tree of a worker that exited, and wait (at most
        ``timeout_s``) until it is gone; what still runs. Blocking: run in a thread."""
        return procs.wait_gone(self.tree.kill(), timeout_s)

    def oom_kills(self) -> int:
        """How many of the worker's processes the kernel killed at its cgroup's memory
        limit so far (0 without a cgroup)."""
        return self.cgroup.oom_kills() if self.cgroup is not None else 0


async def _remove(cgroup: Cgroup) -> None:
    """Kill what is in the cgroup and remove it, once all of it is gone (at most
    :data:`_CGROUP_REMOVE_S`)."""
    deadline = time.monotonic() + _CGROUP_REMOVE_S
    cgroup.close()
    try:
        while not await asyncio.to_thread(cgroup.try_remove):
            if time.monotonic() >= deadline:
                log.warning("cgroup %s is still busy; left in place", cgroup.path)
                return
            await asyncio.sleep(0.02)
    except OSError as exc:
        log.warning("cannot remove cgroup %s: %s", cgroup.path, exc)


#: How a worker process is started.
WORKER_COMMAND = (sys.executable, "-m", "nodelet.worker_main")


class _Protocol(asyncio.subprocess.SubprocessStreamProtocol):
    """asyncio's protocol of a process with pipes, which also tells when the process exits."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=2**16, loop=loop)
        self.exited: asyncio.Future[None] = loop.create_future()

    def process_exited(self) -> None:
        super().process_exited()
        if not self.exited.done():
            self.exited.set_result(None)


async def spawn_worker(
    *,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    command: Sequence[str] = WORKER_COMMAND,
    limiter: Limiter | None = None,
    gpus: Sequence[int] = (),
    passed_env: Sequence[tuple[str, str | None]] = (),
    lifeline: int | None = None,
) -> Worker:
    """Start one worker process (``command``, which speaks the protocol of
    :mod:`nodelet.worker_main`), confined by ``limiter`` (allowed ``gpus``' device files), with
    the environment of :func:`worker_env`; it waits for its task on stdin. ``lifeline`` is
    the read end of a pipe the worker watches: it ends when the write end is closed."""
    extra = dict(env or {})
    passed = []
    if lifeline is not None:
        extra[LIFELINE_ENV] = str(lifeline)
        passed.append(lifeline)
    # The outcome pipe: its write end the worker's alone, its read end the nodelet's.
    outcome_read, outcome_write = os.pipe()
    extra[OUTCOME_ENV] = str(outcome_write)
    passed.append(outcome_write)
    loop = asyncio.get_running_loop()
    try:
        transport, protocol = await loop.subprocess_exec(
            lambda: _Protocol(loop),
            *command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=cwd,
            env=worker_env(extra, passed_env),
            start_new_session=True,
            pass_fds=passed,
        )
    except BaseException:
        os.close(outcome_read)
        raise
    finally:
        os.close(outcome_write)
    process = asyncio.subprocess.Process(transport, protocol, loop)
    try:
        outcomes = await Outcomes.open(outcome_read)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        raise
    # Ours until reaped: its pid cannot name another process yet.
    start = procs.start_time(process.pid)
    if limiter is None:
        return Worker(process, start=start, exited=protocol.exited, outcomes=outcomes)
    try:
        # The worker runs nothing of a call before it is confined: it waits for its task.
        cgroup = limiter.apply(process.pid, gpus)
        return Worker(process, cgroup, start=start, exited=protocol.exited, outcomes=outcomes)
    except OSError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        outcomes.close()
        raise


#: What a worker gets of the nodelet's environment: what finds programs and libraries
#: (PYTHONPATH: the same Bulletin as the nodelet), the locale and the time zone; plus the
#: names the admin adds (``worker_env``). Nothing else: the nodelet's own settings and
#: whatever its service was started with (database URLs, tokens) never reach a worker,
#: whose user can read its whole memory, before and after it switches accounts.
PASSED_ENV = frozenset(
    {"PATH", "LANG", "LANGUAGE", "TZ", "LD_LIBRARY_PATH", "PYTHONPATH", "CUDA_HOME", "CUDA_PATH"}
)


def worker_env(
    extra: Mapping[str, str] | None = None, passed: Sequence[tuple[str, str | None]] = ()
) -> dict[str, str]:
    """A worker's environment: the allowed part of the nodelet's (:data:`PASSED_ENV`, locale
    variables, and ``passed``: names, or names with a value of their own), then ``extra``;
    unbuffered so logs stream as they are written."""
    env = {k: v for k, v in os.environ.items() if k in PASSED_ENV or k.startswith("LC_")}
    for name, value in passed:
        if value is not None:
            env[name] = value
        elif name in os.environ:
            env[name] = os.environ[name]
    env.update(extra or {})
    env.setdefault("PATH", os.defpath)
    env["PYTHONUNBUFFERED"] = "1"
    return env


#: Who may reuse a warm worker: the same owner on the same GPU indices.
WarmKey = tuple[str, tuple[int, ...]]


class WorkerPool:
    """Keeps ``spares`` fresh idle workers started (:meth:`maintain` refills it in the
    background) and up to ``max_warm`` warm ones, each reserved for its :data:`WarmKey`.
    Every worker is confined by ``limiter``; ``kill_grace_s`` is how long a worker stopped
    at a call's time limit has between SIGTERM and SIGKILL. With ``state``, the workers and
    their cgroups are recorded in the node's state directory as they come and go; with
    ``adopt_orphans`` (this process is a child subreaper), the orphans a dead worker's tree
    leaves with this process are killed and reaped."""

    def __init__(
        self,
        spares: int,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        max_warm: int = 8,
        warm_idle_s: float = 300.0,
        command: Sequence[str] = WORKER_COMMAND,
        limiter: Limiter | None = None,
        kill_grace_s: float = 10.0,
        max_calls: int = 0,
        max_rss_mb: int = 0,
        passed_env: Sequence[tuple[str, str | None]] = (),
        state: NodeState | None = None,
        adopt_orphans: bool = False,
    ) -> None:
        self.spares = spares
        self.passed_env = tuple(passed_env)
        #: A worker is recycled after this many calls, or once its resident memory is over
        #: this many MiB after a call (0: no bound).
        self.max_calls = max_calls
        self.max_rss_mb = max_rss_mb
        self.limiter = limiter or Limiter()
        self.kill_grace_s = kill_grace_s
        self.command = tuple(command)
        self.max_warm = max_warm
        self.warm_idle_s = warm_idle_s
        self._cwd = cwd
        self._env = dict(env or {})
        self._idle: collections.deque[Worker] = collections.deque()
        # Spares started with their GPUs (CUDA_VISIBLE_DEVICES), so a warmed one has its CUDA
        # context before a call arrives: how many per GPU set, and those started.
        self.gpu_spares: dict[tuple[int, ...], int] = {}
        self._gpu_idle: dict[tuple[int, ...], collections.deque[Worker]] = {}
        # Oldest first: (key, worker, monotonic time it went idle).
        self._warm: collections.deque[tuple[WarmKey, Worker, float]] = collections.deque()
        self._wanted = asyncio.Event()
        self._closed = False
        self._reapers: set[asyncio.Task[int]] = set()
        # Every worker started and not yet reaped (or still being stopped), wherever it is.
        self._started: dict[int, Worker] = {}
        self._watchers: set[asyncio.Task[int]] = set()
        self._spawning = 0
        self._state = state
        self._adopt_orphans = adopt_orphans
        # Orphans being killed (in threads), and the tasks killing them.
        self._killing_orphans: procs.Identities = {}
        self._orphan_kills: set[asyncio.Task[None]] = set()
        # Its write end is the nodelet's alone: a worker sees EOF when the nodelet is gone.
        self._lifeline_read, self._lifeline_write = os.pipe()
        self._record()

    @classmethod
    def from_config(
        cls,
        config: NodeletConfig,
        *,
        cwd: str | None = None,
        gpu_devices: Mapping[int, tuple[str, ...]] | None = None,
    ) -> WorkerPool:
        """The pool a nodelet runs with ``config``, given its GPUs' device rules: detects
        (and logs) how each limit is enforced and how the processes of calls are tracked
        (with the subreaper, this process becomes one), and records its workers in the
        node's state directory. ValueError if the tracking asked for is not usable here, or
        the state directory is not safe to use."""
        warm = config.warm_torch and importlib.util.find_spec("torch") is not None
        state = open_state(config)
        try:
            limiter = Limiter.detect(
                config.memory_limit_mb,
                cpus=config.cpu_limit,
                gpu_devices=gpu_devices,
                tracking=config.process_tracking,
                name=base_name(config.name, state.path),
            )
        except LimitUnavailable as exc:
            state.close()
            raise ValueError(str(exc)) from None
        subreaper = limiter.tracking == "subreaper"
        if subreaper:
            procs.become_subreaper()  # the orphans of a worker that dies come here
        return cls(
            config.spare_workers,
            cwd=cwd,
            env={WARM_TORCH: "1"} if warm else {},
            limiter=limiter,
            kill_grace_s=config.kill_grace_s,
            max_calls=config.worker_max_calls,
            max_rss_mb=config.worker_max_rss_mb,
            passed_env=worker_env_names(config.worker_env),
            state=state,
            adopt_orphans=subreaper,
        )

    async def acquire(self, key: WarmKey | None = None, function: str | None = None) -> Worker:
        """A started worker: a warm one of ``key`` (one that last ran ``function`` first),
        else a fresh idle one (then refilled), else a new one."""
        candidates = [e for e in reversed(self._warm) if e[0] == key and e[1].returncode is None]
        candidates.sort(key=lambda e: e[1].last_function != function)  # stable: newest first
        for entry in candidates[:1]:
            self._warm.remove(entry)
            log.debug("warm-pool hit: worker %d, warm from a call of %s", entry[1].pid, key)
            entry[1].warm = True
            return entry[1]
        if key is not None:
            self._evict_overlapping(key)
        self._wanted.set()
        gpu_idle = self._gpu_idle.get(key[1]) if key is not None else None
        while gpu_idle:
            worker = gpu_idle.popleft()
            if worker.returncode is None:
                log.debug("warm-pool miss for %s: spare worker %d of its GPUs", key, worker.pid)
                worker.warm = True
                return worker
            await self._discard(worker)
        while self._idle:
            worker = self._idle.popleft()
            if worker.returncode is None:
                log.debug("warm-pool miss for %s: spare worker %d", key, worker.pid)
                worker.warm = True
                return await self._grant(worker, key)
            await self._discard(worker)
        worker = await self._spawn()
        log.info("warm-pool miss for %s: no spare worker, started %d for the call", key, worker.pid)
        worker.warm = False
        return await self._grant(worker, key)

    async def _grant(self, worker: Worker, key: WarmKey | None) -> Worker:
        """Allow a worker started without GPUs its call's GPUs' device files."""
        if key is None or not key[1] or worker.cgroup is None:
            return worker
        try:
            worker.cgroup.allow_gpus(key[1])
        except OSError:
            worker.kill()
            await worker.wait()
            raise
        return worker

    def _evict_overlapping(self, key: WarmKey) -> None:
        """Kill warm workers of other keys on any of ``key``'s GPUs: they may hold memory
        (a CUDA context, cached allocations) on a GPU that is now someone else's."""
        gpus = set(key[1])
        for entry in [e for e in self._warm if e[0] != key and gpus & set(e[0][1])]:
            self._warm.remove(entry)
            self._retire(entry[1])

    def _retire(self, worker: Worker) -> None:
        """Kill a warm worker and reap it in the background (close() waits for the rest)."""
        worker.kill()
        reaper = asyncio.create_task(worker.wait(), name=f"reap-worker-{worker.pid}")
        self._reapers.add(reaper)
        reaper.add_done_callback(self._reapers.discard)

    def release(
        self,
        worker: Worker,
        key: WarmKey,
        *,
        function: str | None = None,
        owner: str | None = None,
        recycle: str | None = None,
    ) -> None:
        """Keep a worker that finished a call cleanly, warm for the next call of ``key``
        (unless its memory limit forbids another call: RLIMIT_AS cannot be raised back), or
        recycle it: for ``recycle`` (a reason, e.g. a CUDA error), after ``max_calls`` calls,
        or over ``max_rss_mb``. The spares refill in the background."""
        worker.calls += 1
        worker.last_function, worker.last_owner = function, owner
        recycle = recycle or self._worn_out(worker)
        if recycle is not None:
            log.info("worker %d recycled: %s", worker.pid, recycle)
        if (
            recycle is not None
            or self._closed
            or self.max_warm == 0
            or worker.returncode is not None
            or not self.limiter.reuses_workers
        ):
            self._retire(worker)
            return
        self._warm.append((key, worker, time.monotonic()))
        while len(self._warm) > self.max_warm:
            self._retire(self._warm.popleft()[1])

    def warm_functions(self) -> list[wire.WarmWorker]:
        """(owner, function) of each live warm worker, for the scheduler's affinity."""
        pairs = {
            (w.last_owner, w.last_function)
            for _, w, _ in self._warm
            if w.returncode is None and w.last_owner and w.last_function
        }
        return [wire.WarmWorker(owner=o, function=f) for o, f in sorted(pairs)]

    def _worn_out(self, worker: Worker) -> str | None:
        if self.max_calls and worker.calls >= self.max_calls:
            return f"it ran {worker.calls} calls (worker_max_calls)"
        if self.max_rss_mb:
            rss = procs.rss_mb(worker.pid)
            if rss is not None and rss > self.max_rss_mb:
                return f"{rss} MiB resident, over {self.max_rss_mb} MiB (worker_max_rss_mb)"
        return None

    def _expire_warm(self) -> None:
        deadline = time.monotonic() - self.warm_idle_s
        while self._warm and self._warm[0][2] < deadline:
            self._retire(self._warm.popleft()[1])

    async def maintain(self) -> None:
        """Run until cancelled, keeping ``spares`` idle workers alive."""
        backoff = Backoff(0.1, _RESPAWN_BACKOFF_MAX_S)
        while not self._closed:
            try:
                await self._refill()
                backoff.reset()
            except OSError as exc:
                delay = backoff.next_delay()
                log.error("cannot start a worker process (%s); retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                continue
            self._wanted.clear()
            self._kill_orphans()
            with contextlib.suppress(TimeoutError):  # time for the periodic liveness check
                await asyncio.wait_for(self._wanted.wait(), _CHECK_S)

    def set_gpu_spares(self, gpu_sets: Sequence[tuple[int, ...]], count: int) -> None:
        """Keep ``count`` spares started with each of ``gpu_sets`` (filled by maintain)."""
        self.gpu_spares = {gpus: count for gpus in gpu_sets if count > 0}
        self._wanted.set()

    async def close(self) -> None:
        """Kill every idle and warm worker. Workers already acquired belong to their attempts."""
        self._closed = True
        gpu_idle = [w for workers in self._gpu_idle.values() for w in workers]
        idle = [*self._idle, *gpu_idle, *(w for _, w, _ in self._warm)]
        self._idle, self._warm, self._gpu_idle = collections.deque(), collections.deque(), {}
        for worker in idle:
            worker.kill()
        for worker in idle:
            await worker.wait()
        await asyncio.gather(*self._reapers, *self._orphan_kills)
        for watcher in list(self._watchers):  # of workers that attempts still hold
            watcher.cancel()
        self.limiter.close()
        self._record()
        if self._state is not None:
            self._state.close()
            self._state = None
        # Whatever worker is left (its attempt did not kill it) ends itself now.
        os.close(self._lifeline_write)
        os.close(self._lifeline_read)
        self._lifeline_read = -1

    async def _refill(self) -> None:
        self._expire_warm()
        for worker in [w for w in self._idle if w.returncode is not None]:
            self._idle.remove(worker)
            await self._discard(worker)
        while len(self._idle) < self.spares and not self._closed:
            worker = await self._spawn()
            if self._closed:
                worker.kill()  # close() ran while this one was starting
                await worker.wait()
            else:
                self._idle.append(worker)
        for gpus, count in self.gpu_spares.items():
            idle = self._gpu_idle.setdefault(gpus, collections.deque())
            for worker in [w for w in idle if w.returncode is not None]:
                idle.remove(worker)
                await self._discard(worker)
            while len(idle) < count and not self._closed:
                worker = await self._spawn(gpus)
                if self._closed:
                    worker.kill()
                    await worker.wait()
                else:
                    idle.append(worker)

    async def _spawn(self, gpus: tuple[int, ...] | None = None) -> Worker:
        env = self._env
        if gpus is not None:
            visible = ",".join(map(str, gpus))
            env = {**env, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": visible}
        self._spawning += 1  # a worker not yet known must not be taken for an orphan
        try:
            worker = await spawn_worker(
                cwd=self._cwd,
                env=env,
                command=self.command,
                limiter=self.limiter,
                gpus=gpus or (),
                passed_env=self.passed_env,
                lifeline=self._lifeline_read if self._lifeline_read >= 0 else None,
            )
        finally:
            self._spawning -= 1
        self._started[worker.pid] = worker
        self._record()
        watcher = asyncio.create_task(worker.exited(), name=f"watch-worker-{worker.pid}")
        self._watchers.add(watcher)
        watcher.add_done_callback(self._exited)
        return worker

    def _exited(self, watcher: asyncio.Task[int]) -> None:
        self._watchers.discard(watcher)
        self._record()
        self._kill_orphans()

    def _record(self) -> None:
        """Record the live workers and the cgroup directories in the state directory."""
        if self._state is None:
            return
        workers = {
            w.pid: w.start
            for w in self._started.values()
            if w.returncode is None and w.start is not None
        }
        try:
            self._state.record(self.limiter.cgroup_bases(), workers)
        except OSError as exc:
            log.error("cannot record the workers in %s: %s", self._state.path, exc)

    def _kill_orphans(self) -> None:
        """Kill (and reap) the processes a dead worker's tree left with this process, its
        subreaper: with no cgroup, nothing else would find them. Not while a worker starts
        (it is in a session of its own before it is known), nor what a worker being stopped
        still has of its grace. This process's own children are looked at here (cheap: the
        kernel's lists of them); what is found is killed in a thread."""
        self._started = {
            p: w for p, w in self._started.items() if w.returncode is None or w.stopping
        }
        if not self._adopt_orphans or self._spawning:
            return
        graced = {p for w in self._started.values() if w.stopping for p in w.tree.seen}
        orphans: procs.Identities = {}
        for pid, stat in procs.adopted(self._started.keys()).items():
            if stat.alive and pid not in graced and pid not in self._killing_orphans:
                log.warning("killing process %d, left running by a worker that died", pid)
                orphans[pid] = stat.start
            elif not stat.alive:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
        if orphans:
            self._killing_orphans.update(orphans)
            task = asyncio.create_task(self._kill_trees(orphans), name="kill-orphans")
            self._orphan_kills.add(task)
            task.add_done_callback(self._orphan_kills.discard)

    async def _kill_trees(self, roots: procs.Identities) -> None:
        try:
            await asyncio.to_thread(procs.stop_and_kill, functools.partial(procs.tree, roots))
        finally:
            for pid in roots:
                self._killing_orphans.pop(pid, None)

    async def _discard(self, worker: Worker) -> None:
        # An idle worker that died on its own usually failed to start; its stderr says why.
        stderr = await worker.stderr.read()
        await worker.wait()  # also removes its cgroup
        log.warning(
            "idle worker %d exited with %s: %s",
            worker.pid,
            worker.returncode,
            stderr.decode(errors="replace").strip()[-2000:] or "no output",
        )
