"""Worker processes, pre-started so a call never waits for Python to boot, and kept warm
after a call for the next call of the same owner on the same GPUs (never across owners).

Workers are always exec'd (``python -m nodelet.worker``), never forked: forking a process that
has imported torch or created a CUDA context is unsafe. Each worker leads its own session, so
killing its process group also kills whatever the user's code spawned. With a cgroup memory
limit (:mod:`nodelet.limits`) each worker also has a cgroup of its own, which catches what
left the process group too.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib.util
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from bulletin import wire
from nodelet.config import worker_env_names
from nodelet.limits import Cgroup, Limiter
from nodelet.worker import frame

if TYPE_CHECKING:
    from nodelet.config import NodeletConfig

log = logging.getLogger(__name__)

#: Set in a worker's environment: warm torch up before the first call (nodelet.worker).
WARM_TORCH = "BULLETIN_WARM_TORCH"

#: How often the pool checks that its idle workers are still alive.
_CHECK_S = 1.0
_RESPAWN_BACKOFF_MAX_S = 5.0
#: How often a terminated worker's process group is checked for survivors.
_STOP_POLL_S = 0.05
#: How long a dead worker's cgroup may stay busy (its processes dying) before it is left.
_CGROUP_REMOVE_S = 2.0


class Worker:
    """A handle on one worker process."""

    def __init__(self, process: asyncio.subprocess.Process, cgroup: Cgroup | None = None) -> None:
        self.process = process
        #: The worker's own cgroup, under a cgroup memory limit; removed once it has exited.
        self.cgroup = cgroup
        #: Whether the worker was already running when a call got it (a spare, or warm from
        #: an earlier call); False when it was started for the call.
        self.warm = False
        #: Calls it ran, and the function of the last one (warm workers that ran the same
        #: function are preferred: module-level caches such as a loaded model survive).
        self.calls = 0
        self.last_function: str | None = None
        #: The user name of the owner of its last call (reported with its function).
        self.last_owner: str | None = None
        self._cgroup_removed: asyncio.Future[None] | None = None

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
            stdin.write(prefix)
            stdin.write(body)
            await stdin.drain()
            if not task.end_marker:
                stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            log.warning("worker %d exited before it received its task", self.pid)
            return False
        return True

    def kill(self) -> None:
        """SIGKILL the worker's whole process group: the worker and anything it spawned
        (and, in its cgroup, what left the group)."""
        with contextlib.suppress(ProcessLookupError):  # already gone, children and all
            os.killpg(self.process.pid, signal.SIGKILL)
        if self.cgroup is not None:
            self.cgroup.kill()

    async def stop(self, grace_s: float, *, call_ended: Callable[[], bool] | None = None) -> bool:
        """SIGTERM the worker's process group, then SIGKILL it if anything of it is still
        running after ``grace_s``. True if it had to be killed. A call that handles SIGTERM
        may end (``call_ended()``) with its worker alive: then the group is killed at once."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.returncode is None or group_members(self.pid):
            if call_ended is not None and call_ended():
                self.kill()
                return False
            if time.monotonic() >= deadline:
                self.kill()
                return True
            await asyncio.sleep(_STOP_POLL_S)
        return False

    async def wait(self) -> int:
        """Wait for the worker to exit; then remove its cgroup, killing what is left in it."""
        returncode = await self.process.wait()
        if self.cgroup is not None:
            if self._cgroup_removed is None:
                self._cgroup_removed = asyncio.ensure_future(_remove(self.cgroup))
            await asyncio.shield(self._cgroup_removed)
        return returncode

    def oom_kills(self) -> int:
        """How many of the worker's processes the kernel killed at its cgroup's memory
        limit so far (0 without a cgroup)."""
        return self.cgroup.oom_kills() if self.cgroup is not None else 0


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as file:
                # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
                fields = file.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[0] != b"Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


async def _remove(cgroup: Cgroup) -> None:
    deadline = time.monotonic() + _CGROUP_REMOVE_S
    try:
        while not cgroup.try_remove():
            if time.monotonic() >= deadline:
                log.warning("cgroup %s is still busy; left in place", cgroup.path)
                return
            await asyncio.sleep(0.02)
    except OSError as exc:
        log.warning("cannot remove cgroup %s: %s", cgroup.path, exc)


#: How a worker process is started.
WORKER_COMMAND = (sys.executable, "-m", "nodelet.worker")


async def spawn_worker(
    *,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    command: Sequence[str] = WORKER_COMMAND,
    limiter: Limiter | None = None,
    gpus: Sequence[int] = (),
    passed_env: Sequence[tuple[str, str | None]] = (),
) -> Worker:
    """Start one worker process (``command``, which speaks the protocol of
    :mod:`nodelet.worker`), confined by ``limiter`` (allowed ``gpus``' device files), with
    the environment of :func:`worker_env`; it waits for its task on stdin."""
    process = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=cwd,
        env=worker_env(env, passed_env),
        start_new_session=True,
    )
    if limiter is None:
        return Worker(process)
    try:
        # The worker runs nothing of a call before it is confined: it waits for its task.
        return Worker(process, limiter.apply(process.pid, gpus))
    except OSError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
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
    at a call's time limit has between SIGTERM and SIGKILL."""

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

    @classmethod
    def from_config(
        cls,
        config: NodeletConfig,
        *,
        cwd: str | None = None,
        gpu_devices: Mapping[int, tuple[str, ...]] | None = None,
    ) -> WorkerPool:
        """The pool a nodelet runs with ``config``, given its GPUs' device rules: detects
        (and logs) how each limit is enforced."""
        warm = config.warm_torch and importlib.util.find_spec("torch") is not None
        limiter = Limiter.detect(
            config.memory_limit_mb, cpus=config.cpu_limit, gpu_devices=gpu_devices
        )
        return cls(
            config.spare_workers,
            cwd=cwd,
            env={WARM_TORCH: "1"} if warm else {},
            limiter=limiter,
            kill_grace_s=config.kill_grace_s,
            max_calls=config.worker_max_calls,
            max_rss_mb=config.worker_max_rss_mb,
            passed_env=worker_env_names(config.worker_env),
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
            rss = _rss_mb(worker.pid)
            if rss is not None and rss > self.max_rss_mb:
                return f"{rss} MiB resident, over {self.max_rss_mb} MiB (worker_max_rss_mb)"
        return None

    def _expire_warm(self) -> None:
        deadline = time.monotonic() - self.warm_idle_s
        while self._warm and self._warm[0][2] < deadline:
            self._retire(self._warm.popleft()[1])

    async def maintain(self) -> None:
        """Run until cancelled, keeping ``spares`` idle workers alive."""
        backoff = 0.1
        while not self._closed:
            try:
                await self._refill()
                backoff = 0.1
            except OSError as exc:
                log.error("cannot start a worker process (%s); retrying in %.1f s", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _RESPAWN_BACKOFF_MAX_S)
                continue
            self._wanted.clear()
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
        await asyncio.gather(*self._reapers)
        self.limiter.close()

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
        return await spawn_worker(
            cwd=self._cwd,
            env=env,
            command=self.command,
            limiter=self.limiter,
            gpus=gpus or (),
            passed_env=self.passed_env,
        )

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


def _rss_mb(pid: int) -> int | None:
    """A process's resident memory in MiB (VmRSS), or None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
