"""One attempt at one invocation, from ``start`` to ``complete``.

The nodelet never unpickles anything here: payload and result are opaque bytes (envelopes)
passed between the gateway and the worker process. A small payload goes to the worker inline;
a big one as a file: the owner's in the shared directory (which the worker, as the owner,
opens itself), or a download into the attempt's directory. A big result comes back as a
file: one in the shared directory, under the one name the attempt may use, is passed on by
that name; one in the attempt's ``out`` directory (the worker's ``spill_dir``) is streamed up
as a blob before the directory is removed.

The attempt's directory is the nodelet's; ``out`` in it is the call's account's, and is
read only through a descriptor (:mod:`nodelet.userfiles`): nothing the user puts there is
followed, waited on or read past its limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import os
import secrets
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import msgspec

from bulletin_core import shared, wire
from bulletin_core.backoff import Backoff
from nodelet.accounts import AccountError, Accounts
from nodelet.client import GatewayClient
from nodelet.errors import (
    GatewayRejected,
    GatewayUnavailable,
    NodeletError,
    StaleAttempt,
    UntrustedFile,
    UntrustedOutcome,
)
from nodelet.gpus import GpuProvider
from nodelet.logs import LogShipper
from nodelet.pool import Worker, WorkerPool
from nodelet.userfiles import make_private_dir, open_owned
from nodelet.worker_main import SPILLED

log = logging.getLogger(__name__)

#: How long output may keep flowing after the worker and all it started are gone.
EOF_GRACE_S = 2.0
#: How long a killed attempt waits for its worker and all it started to be gone, before
#: its GPUs may go to the next attempt anyway (with a warning).
REAP_S = 10.0
#: The most output (bytes) kept back to go with the completion; more is posted first.
HANDED_OVER_BYTES = 1024 * 1024
#: How long an attempt runs before the nodelet marks it started (state ``running``); one
#: that completes sooner is never marked.
START_AFTER_S = 0.05
#: The worker's files in the attempt's ``out`` directory, and the payload the nodelet
#: downloaded into the attempt's own.
OUT = "out"
PAYLOAD = "payload.bin"
#: An outcome holds at most an inline result, its JSON and three texts the worker cuts to
#: 64 KiB each: anything bigger was not written by the worker.
_OUTCOME_SLACK = 1 << 20
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """What every attempt of a node shares."""

    node: str
    #: Attempts make their directories here.
    work_dir: str
    #: The gateway's inline limit: results up to it go inline, bigger ones as files.
    inline_limit: int
    log_flush_s: float
    gpus: GpuProvider
    #: The cluster's shared directory as the gateway names it, whether this node sees it or not.
    cluster_shared_dir: str | None = None
    #: The same, only when this node sees it (``bulletin_core.shared.sees``).
    shared_dir: str | None = None
    #: Whose Unix account runs a call (single-tenant: the nodelet's own).
    accounts: Accounts = field(default_factory=Accounts)


class _Ending(enum.Enum):
    """How a call's run in its worker ended."""

    FINISHED = "finished"  # its output ended; the worker is alive and may be kept warm
    EXITED = "exited"  # the worker exited (crashed, or was killed by something else)
    TIMED_OUT = "timed out"  # stopped at its time limit by SIGTERM
    TIMED_OUT_KILLED = "timed out, killed"  # ... and still running after the grace: SIGKILL


@dataclass(frozen=True, slots=True)
class Report:
    """What to complete the attempt with, the worker's result file if it left one, and why
    the worker must not run another call, if it must not."""

    request: wire.CompleteRequest
    result_path: str | None = None
    spoilt: str | None = None


#: Entries of ``out`` the nodelet unlinks itself, at once, when there are no more (and no
#: directory among them); otherwise they are removed as the account, in a process.
_AT_ONCE = 8


#: Emptied attempt directories kept for the next call of the same warm-worker owner (see
#: ``_warm_owner``: a colleague's function never shares one with the owner's own code) and
#: account, at most this many each and ``_KEEP_MAX`` in all, for at most ``_KEEP_S``: making
#: and removing two directories costs more here than a short call itself (the kernel frees
#: a removed directory's inode at its last close, ~150 µs).
_KEEP_PER_OWNER = 4
_KEEP_MAX = 64
_KEEP_S = 60.0
#: What the nodelet unlinks on its event loop: files of at most this many bytes allocated
#: (freeing a big file's blocks takes a while), in an ``out`` whose directory file is at
#: most this big (one that once held very many names stays big, and slow to list).
_AT_ONCE_BYTES = 1 << 20
_AT_ONCE_DIR_BYTES = 64 * 1024

_KeepKey = tuple[str, str, int, int]  # work dir, warm owner, uid, gid


@dataclass(slots=True)
class _Files:
    """An attempt's directory (the nodelet's), and ``out`` in it: the call's account's,
    held open from the moment it was made."""

    path: str
    fd: int
    out_fd: int
    #: Who must own what the worker leaves in ``out``.
    uid: int
    gid: int
    #: Whose calls may reuse it once it is emptied (see ``keep``: ``_warm_owner``), and
    #: where it was made.
    owner: str
    work_dir: str
    #: The call ended cleanly (nothing it started is left running): once emptied, the
    #: directory may serve the owner's next call instead of being removed.
    keep: bool = False
    #: A payload was downloaded into it (``PAYLOAD``): unlinked before it is kept.
    has_payload: bool = False

    @classmethod
    def make(cls, work_dir: str, run_as: wire.RunAs | None, owner: str) -> _Files:
        """A directory for an attempt of ``owner``'s: an emptied one of theirs kept from an
        earlier call under the same account, else a new one."""
        uid, gid = (run_as.uid, run_as.gid) if run_as else (os.geteuid(), os.getegid())
        _expire_kept()
        kept = _kept.get((work_dir, owner, uid, gid))
        while kept:
            files, _ = kept.pop()
            if not kept:
                del _kept[(work_dir, owner, uid, gid)]
            if files._ready_again():
                return files
            _remove_later(files)  # keep is False: removed, never kept again
        path = tempfile.mkdtemp(prefix="attempt-", dir=work_dir)
        fd = out_fd = -1
        try:
            if run_as is not None:
                os.chmod(path, 0o711)  # the account passes through to its own ``out``
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            out_fd = make_private_dir(fd, OUT, uid, gid)
        except BaseException:
            for opened in (fd, out_fd):
                if opened >= 0:
                    os.close(opened)
            shutil.rmtree(path, ignore_errors=True)
            raise
        return cls(path, fd, out_fd, uid, gid, owner, work_dir)

    def _ready_again(self) -> bool:
        """Whether a kept directory is as a new one would be: ``out`` still the account's,
        still the directory at ``out`` (nothing mounted over it), small and empty (a process
        of the last call's may have written since), mode 0700 again (its owner may have
        changed it)."""
        self.keep = False
        try:
            info = os.fstat(self.out_fd)
            named = os.stat(OUT, dir_fd=self.fd, follow_symlinks=False)
            if (
                info.st_uid != self.uid
                or not stat.S_ISDIR(info.st_mode)
                or (named.st_dev, named.st_ino) != (info.st_dev, info.st_ino)
                or info.st_size > _AT_ONCE_DIR_BYTES
            ):
                return False
            with os.scandir(self.out_fd) as entries:
                if next(entries, None) is not None:
                    return False
            os.fchmod(self.out_fd, 0o700)
        except OSError:
            return False
        return True

    @property
    def out(self) -> str:
        return os.path.join(self.path, OUT)

    async def close(self) -> None:
        """Remove the attempt's directory. When ``out`` holds no more than a few entries
        and no directory (what a call usually leaves: its outcome), they are unlinked at
        once through the descriptor of ``out``: no path is followed and nothing recursed
        into, so a link swapped in is only unlinked itself. Anything bigger is removed as
        the call's own account, in a process of its own (``find -delete``): a tree made to
        exhaust the nodelet's descriptors or stack, or links swapped in meanwhile, cost only
        that process, and can only touch the account's own files. Then the nodelet removes
        what is its own, entry by entry, never recursing into what the account controls.
        An emptied directory of a call that ended cleanly (``keep``) may be kept instead,
        for the next call of the same owner under the same account."""
        emptied = self._emptied_at_once()
        if emptied and self.keep and self._kept_for_next():
            return  # its descriptors stay open with it
        try:
            if not (emptied and self._removed_own_at_once()):
                if self.uid == os.geteuid():  # single-tenant: the same account, trusted
                    await asyncio.to_thread(shutil.rmtree, self.path, ignore_errors=True)
                else:
                    await self._empty_out_as_the_account()
                    await asyncio.to_thread(self._remove_own)
        except (OSError, RecursionError) as exc:
            log.warning("could not remove %s (%s); left in place", self.path, exc)
        finally:
            os.close(self.out_fd)
            os.close(self.fd)

    def kept_now(self) -> bool:
        """Empty the directory of a call that ended cleanly and keep it for the owner's next
        call at once, when what the call left there is a few small files (its outcome, read
        already) and there is room; False: it is closed later, as usual. The next item of a
        map starts as soon as this one's worker is free, before its outcome is sent: kept
        only once that was sent, its directory was never there to be reused."""
        return self.keep and self._emptied_at_once() and self._kept_for_next()

    def _removed_own_at_once(self) -> bool:
        """Remove the emptied directory at once; False if that failed."""
        try:
            self._remove_own()
        except OSError:  # a process of the call's left more meanwhile: the slow path
            return False
        return True

    def _kept_for_next(self) -> bool:
        """Keep the emptied directory for the owner's next call, if there is room."""
        key = (self.work_dir, self.owner, self.uid, self.gid)
        held = len(_kept.get(key, ()))
        if _closing or held >= _KEEP_PER_OWNER or sum(map(len, _kept.values())) >= _KEEP_MAX:
            return False
        if self.has_payload:
            try:
                os.unlink(PAYLOAD, dir_fd=self.fd)
            except FileNotFoundError:
                pass
            except OSError:
                return False
            self.has_payload = False
        _kept.setdefault(key, []).append((self, time.monotonic()))
        return True

    def _emptied_at_once(self) -> bool:
        """Unlink what ``out`` holds if that is at most ``_AT_ONCE`` entries, none of them
        a directory; False (the rest left for the slow path) otherwise."""
        names: list[str] = []
        try:
            if os.fstat(self.out_fd).st_size > _AT_ONCE_DIR_BYTES:
                return False
            with os.scandir(self.out_fd) as entries:
                for entry in entries:
                    if len(names) == _AT_ONCE:
                        return False
                    info = entry.stat(follow_symlinks=False)
                    if stat.S_ISDIR(info.st_mode) or info.st_blocks * 512 > _AT_ONCE_BYTES:
                        return False
                    names.append(entry.name)
        except OSError:
            return False
        for name in names:
            try:
                os.unlink(name, dir_fd=self.out_fd)
            except FileNotFoundError:
                continue
            except OSError:  # a directory (EISDIR), or a file made immutable
                return False
        return True

    async def _empty_out_as_the_account(self) -> None:
        process = await asyncio.create_subprocess_exec(
            "find", self.out, "-xdev", "-mindepth", "1", "-delete",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            user=self.uid,
            group=self.gid,
            extra_groups=[],
            cwd="/",
        )  # fmt: skip
        await process.wait()

    def _remove_own(self) -> None:
        os.rmdir(OUT, dir_fd=self.fd)  # fails, and stays, if the account put more there
        with contextlib.suppress(FileNotFoundError):
            os.unlink(PAYLOAD, dir_fd=self.fd)
        os.rmdir(self.path)


class Attempt:
    """Runs one assignment end to end in a worker process; :meth:`kill` abandons it."""

    def __init__(
        self,
        assignment: wire.Assignment,
        *,
        client: GatewayClient,
        pool: WorkerPool,
        facts: NodeFacts,
        complete: Callable[[str, wire.CompleteRequest], Awaitable[None]] | None = None,
    ) -> None:
        self.assignment = assignment
        self.ref = wire.Attempt(invocation_id=assignment.invocation_id, epoch=assignment.epoch)
        self._client = client
        self._pool = pool
        self._facts = facts
        #: Sends the outcome (``Completions.complete``: batched with others).
        self._complete_with = complete
        self._worker: Worker | None = None
        self.task: asyncio.Task[None] | None = None
        #: Set once the attempt no longer holds its slot: its worker given back (its outcome
        #: may still be on its way) or gone. The next attempt of its lease starts then.
        self.freed = asyncio.Event()
        #: Set once its call went to its worker (or the attempt ended): the next attempt of
        #: its lease gets ready then (its directory, its task), to start at ``freed``.
        self.sent = asyncio.Event()
        self.killed = False
        #: The scheduler preempts this attempt (see :meth:`preempt`).
        self.preempting = False
        #: Its directory was kept for the owner's next call once its outcome was read.
        self._files_kept = False
        self._preempt_grace_s = 0.0
        self._stopper: asyncio.Task[bool] | None = None
        # When the gateway last (re)started this attempt's lease, by the local monotonic clock:
        # the lease began when the assignment was made, just before it reached us.
        self.renewed_at = time.monotonic()

    @property
    def name(self) -> str:
        return f"attempt-{self.ref.invocation_id}-{self.ref.epoch}"

    def __str__(self) -> str:
        return f"invocation {self.ref.invocation_id} epoch {self.ref.epoch}"

    def start(
        self, after: Sequence[asyncio.Task[None]] = (), behind: Attempt | None = None
    ) -> asyncio.Task[None]:
        """Run the attempt in a named task, kept on ``self.task``, once the ``after`` tasks
        (the other attempts on the same GPUs: dying, finishing, or not yet revoked) are done
        and the attempt
        ``behind`` (the one before it in its lease) freed its slot."""
        self.task = asyncio.create_task(self._run_after(after, behind), name=self.name)
        return self.task

    async def _run_after(self, after: Sequence[asyncio.Task[None]], behind: Attempt | None) -> None:
        try:
            if after:
                await asyncio.wait(after)
            await self.run(behind)
        finally:
            self.sent.set()
            self.freed.set()

    def kill(self) -> None:
        """Kill the worker and all it started, and abandon the attempt without completing it."""
        self.killed = True
        if self._worker is not None:
            self._worker.kill()
        if self.task is not None:
            self.task.cancel()

    def preempt(self, grace_s: float, reason: str) -> None:
        """Stop the call so its GPUs go to another group: SIGTERM to its processes (its
        notice: a handler may save a checkpoint), SIGKILL after ``grace_s``; then hand it back
        to be queued again. A call that succeeds within the grace completes. Idempotent."""
        if self.preempting or self.killed:
            return
        self.preempting = True
        self._preempt_grace_s = grace_s
        log.info("%s preempted (%s): SIGTERM now, SIGKILL after %g s", self, reason, grace_s)
        if self._worker is not None:
            self._stop_for_preemption(self._worker)

    def _stop_for_preemption(self, worker: Worker) -> None:
        self._stopper = asyncio.create_task(
            worker.stop(self._preempt_grace_s), name=f"{self.name}-preempt"
        )

    async def run(self, behind: Attempt | None = None) -> None:
        """Run to completion (after ``behind``, the attempt before it in its lease). Gateway
        refusals end the attempt quietly; nothing is raised."""
        try:
            await self._run(behind)
        except StaleAttempt as exc:
            log.info("%s is no longer ours (%s); dropped", self, exc)
        except (NodeletError, OSError) as exc:
            # Not completing leaves the call to be requeued when its lease lapses.
            log.error("%s abandoned: %s", self, exc)
            await self._hand_back_if_preempted()
        except Exception:
            log.exception("%s crashed; abandoned", self)
            await self._hand_back_if_preempted()
        finally:
            await self._reap()

    async def _run(self, behind: Attempt | None) -> None:
        files: _Files | None = None
        try:
            # Made ready while the attempt before it in its lease runs (its directory, its
            # task): once that one gives the worker back, only the handing over is left.
            if behind is not None:
                await behind.sent.wait()
            prepared = await self._task()
            if not isinstance(prepared, Report):
                files = prepared[0]
            if behind is not None:
                await behind.freed.wait()
            # Marking the attempt started is not on the call's critical path: the worker
            # starts at once, and a revoked attempt (409) is killed as soon as the answer
            # comes. A call that ends within START_AFTER_S is never marked: its completion
            # says it all (the gateway takes it from an assigned attempt), one request fewer
            # per short call.
            starting = _Starting(self)
            try:
                report: Report | None
                if isinstance(prepared, Report):
                    report = prepared  # the call cannot run on this node
                else:
                    ready, task = prepared
                    # None: preempted before it started.
                    report = None if self.preempting else await self._execute(task, ready)
                await starting.refused()  # the attempt is stale: that ends it
            finally:
                starting.cancel()  # not sent yet, or in flight: the completion supersedes it
            if report is None or (self.preempting and report.request.state != "succeeded"):
                # Its processes are gone before its GPUs are given to someone else.
                await self._reap()
                if report is not None:
                    await self._post_logs(report.request)
                await self._hand_back()
                return
            await self._complete(report, None if self._files_kept else files)
        finally:
            if files is not None and not self._files_kept:
                _remove_later(files)

    async def _task(self) -> tuple[_Files, wire.WorkerTask] | Report:
        """The worker's task and the attempt's files, with the payload inline or in a file; a
        failure report when the node must not run the call, or cannot see its payload."""
        assignment, facts = self.assignment, self._facts
        accounts, owner, admin = facts.accounts, assignment.owner_name, assignment.owner_admin
        try:
            if accounts.single_tenant:  # no lookup: nothing to wait for
                run_as = accounts.run_as(owner, admin=admin)
            else:  # off the event loop: account lookups may go to LDAP and take seconds
                run_as = await asyncio.to_thread(accounts.run_as, owner, admin=admin)
        except AccountError as exc:
            return self._failed(
                wire.ErrorKind.NOT_PERMITTED, f"node {facts.node!r} cannot run the call: {exc}"
            )
        payload_file = assignment.payload_file
        if payload_file is not None:
            problem = self._payload_file_problem(payload_file)
            if problem is not None:
                return self._failed(wire.ErrorKind.BAD_PAYLOAD, problem)
        # Local directory operations, made here at once: a cancellation cannot strand them.
        files = _Files.make(facts.work_dir, run_as, _warm_owner(assignment))
        try:
            payload_path = None
            if assignment.payload is None and payload_file is None:
                payload_path = await self._download_payload(files, run_as)
            task = wire.WorkerTask(
                invocation_id=self.ref.invocation_id,
                payload=assignment.payload,
                payload_path=payload_path,
                payload_file=payload_file,
                arguments=assignment.arguments,
                gpu_indices=list(assignment.gpu_indices),
                gpu_share=assignment.gpu_share,
                device=facts.gpus.device(assignment.gpu_indices),
                inline_limit=facts.inline_limit,
                shared_dir=facts.shared_dir,
                shared_result=self._shared_result(),
                spill_dir=files.out,
                env=self._pool.limiter.task_env(),
                run_as=run_as,
                # Random per call: the user's own output cannot end the call early.
                end_marker=b"\x00\x00bulletin-end-" + secrets.token_hex(8).encode() + b"\x00",
            )
        except BaseException:
            _remove_later(files)
            raise
        return files, task

    def _payload_file_problem(self, relative: str) -> str | None:
        """Why the worker cannot read its payload file from the shared directory, or None."""
        facts = self._facts
        if facts.shared_dir is None:
            return (
                f"the call's payload is a file in the cluster's shared directory "
                f"{facts.cluster_shared_dir!r}, which node {facts.node!r} does not see: mount "
                "the shared directory at the same path on every node (a job for the cluster's "
                "admin)"
            )
        if not shared.is_payload_of(relative, self.assignment.owner_name):
            # The gateway never assigns another's file; refused here all the same.
            return f"the payload file {relative} is not in the directory of the call's owner"
        return None

    def _shared_result(self) -> str | None:
        """The one name this attempt's result may have in the shared directory."""
        if self._facts.shared_dir is None:
            return None
        try:
            return shared.result_name(self.assignment.owner_name, *self._ids)
        except ValueError:  # an owner name that cannot name a directory
            return None

    async def _download_payload(self, files: _Files, run_as: wire.RunAs | None) -> str:
        """Download the payload into a new file of the attempt's directory, which only the
        call's account may read."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(PAYLOAD, flags, 0o600, dir_fd=files.fd)
        files.has_payload = True
        try:
            if run_as is not None:
                os.fchown(fd, run_as.uid, run_as.gid)
            await _retrying(self._client.payload_to_file, *self._ids, fd)
        finally:
            os.close(fd)
        return os.path.join(files.path, PAYLOAD)

    @property
    def _ids(self) -> tuple[str, int]:
        return self.ref.invocation_id, self.ref.epoch

    def _failed(self, kind: wire.ErrorKind | None, message: str) -> Report:
        return Report(
            wire.CompleteRequest(
                epoch=self.ref.epoch, state="failed", error_kind=kind, error_message=message
            )
        )

    async def mark_started(self) -> None:
        """Mark the attempt started (state ``running``) at the gateway."""
        try:
            await self._client.start(self.ref.invocation_id, self.ref.epoch)
        except StaleAttempt:
            if self._worker is not None:
                self._worker.kill()
            raise
        except NodeletError as exc:
            # The call may still complete: the gateway accepts it from an assigned attempt.
            log.warning("%s: could not mark it started (%s); running it anyway", self, exc)

    async def _execute(self, task: wire.WorkerTask, files: _Files) -> Report | None:
        key = (_warm_owner(self.assignment), tuple(self.assignment.gpu_indices))
        function = self.assignment.function_name or None
        worker = await self._pool.acquire(key, function)
        if self.preempting:  # preempted while the worker was being acquired: it ran nothing
            self._pool.release(worker, key, function=worker.last_function, owner=worker.last_owner)
            return None
        self._worker = worker
        acquired = time.time()
        oom_kills = worker.oom_kills()  # a warm worker's cgroup counts earlier calls' too
        # The call first: what reads its output and outcome is set up while it runs (what
        # it writes meanwhile waits in the pipes).
        if not await worker.send(task):
            # Not the call's fault: abandoned, it is requeued when its lease lapses.
            raise NodeletError("the worker died before it received the call")
        self.sent.set()
        shipper = LogShipper(
            self._client, self.ref, flush_s=self._facts.log_flush_s, on_stale=worker.kill
        )
        shipper.send_as_output_comes(f"{self.name}-logs")
        pumps = self._pump_output(shipper, worker, task.end_marker)
        # Read while the call runs: a big outcome is written before the end markers, and
        # would not fit the pipe's buffer.
        limit = 2 * self._facts.inline_limit + _OUTCOME_SLACK
        reading = asyncio.create_task(
            worker.read_outcome(self.ref.invocation_id, limit), name=f"{self.name}-outcome"
        )
        clean = True
        try:
            ending = await self._supervise(worker, pumps)
            if ending is _Ending.FINISHED:
                # Before the result: nothing of the call outlives it.
                clean = await worker.end_call()
            elif ending is _Ending.EXITED and worker.returncode == 0:
                log.info(
                    "%s: worker %d exited after the call (its last: the call left a thread "
                    "running, or it ends its worker itself)",
                    self,
                    worker.pid,
                )
            await _drain(pumps)
            # The last chunks go with the completion, one request instead of two.
            shipper.hand_over(HANDED_OVER_BYTES)
            await shipper.sent()
        except BaseException:
            reading.cancel()
            raise
        finally:
            shipper.cancel()
            for pending in pumps:
                pending.cancel()
        if shipper.stale is not None:
            reading.cancel()
            raise shipper.stale
        report = await self._report(worker, ending, oom_kills, reading)
        first_seq, rest = shipper.rest()
        more = {
            "worker_acquired": acquired,
            "warm": worker.warm,
            "logs": rest,
            "logs_first_seq": first_seq,
        }
        report = replace(report, request=msgspec.structs.replace(report.request, **more))
        if ending is _Ending.FINISHED and not self.killed and not self.preempting:
            files.keep = clean  # nothing of the call is left running to write there
            # Nothing of the directory is needed any more unless a result file is in it.
            self._files_kept = report.result_path is None and files.kept_now()
            self._worker = None
            self._pool.release(
                worker,
                key,
                function=function,
                owner=self.assignment.owner_name,
                recycle=report.spoilt
                or _broken_cuda(report.request)
                or (None if clean else "what its call started could not all be killed"),
            )
            self.freed.set()
        return report

    def _pump_output(
        self, shipper: LogShipper, worker: Worker, marker: bytes
    ) -> list[asyncio.Task[bool]]:
        """One reader task per pipe."""
        return [
            asyncio.create_task(
                shipper.pump(worker.stdout, wire.Stream.STDOUT, marker), name=f"{self.name}-out"
            ),
            asyncio.create_task(
                shipper.pump(worker.stderr, wire.Stream.STDERR, marker), name=f"{self.name}-err"
            ),
        ]

    async def _supervise(self, worker: Worker, pumps: list[asyncio.Task[bool]]) -> _Ending:
        """Wait until the call handed over ends its output (the worker stays, warm) or the
        worker exits. At the time limit, the worker and everything it started get SIGTERM,
        then SIGKILL after the pool's ``kill_grace_s``."""
        exited = worker.finished()
        ended = await _first(exited, pumps, self.assignment.timeout_s)
        if ended and _marked(pumps) and worker.returncode is None:
            return _Ending.FINISHED
        if ended:
            # Also kills what the call left running, which would otherwise hold the pipes open.
            worker.kill()
            await asyncio.shield(exited)
            return _Ending.EXITED
        grace = self._pool.kill_grace_s
        log.info(
            "%s exceeded its %g s limit; terminating it (SIGKILL after %g s)",
            self,
            self.assignment.timeout_s,
            grace,
        )
        killed = await worker.stop(grace, call_ended=lambda: _marked(pumps))
        await asyncio.shield(exited)
        return _Ending.TIMED_OUT_KILLED if killed else _Ending.TIMED_OUT

    async def _report(
        self,
        worker: Worker,
        ending: _Ending,
        oom_kills: int,
        reading: asyncio.Task[wire.WorkerOutcome | None],
    ) -> Report:
        epoch = self.ref.epoch
        if ending in (_Ending.TIMED_OUT, _Ending.TIMED_OUT_KILLED):
            reading.cancel()
            message = (
                f"the call exceeded its time limit of {self.assignment.timeout_s:g} s and was "
                "terminated (SIGTERM to its processes)"
            )
            if ending is _Ending.TIMED_OUT_KILLED:
                grace = self._pool.kill_grace_s
                message += f", then killed (SIGKILL) as it was still running {grace:g} s later"
            return Report(
                wire.CompleteRequest(epoch=epoch, state="timed_out", error_message=message)
            )
        # Written before the end markers, or before the worker exited: there by now, but
        # for a pipe the call's leftovers held open (killed meanwhile).
        if not reading.done():
            await asyncio.wait([reading], timeout=EOF_GRACE_S)
        if not reading.done():
            reading.cancel()
        try:
            outcome = reading.result() if reading.done() and not reading.cancelled() else None
        except UntrustedOutcome as exc:
            failed = self._failed(wire.ErrorKind.WORKER_DIED, f"the worker's outcome: {exc}")
            return replace(failed, spoilt="its outcome pipe carried what is not an outcome")
        limiter = self._pool.limiter
        if worker.oom_kills() > oom_kills:
            if outcome is None:
                return self._failed(
                    wire.ErrorKind.OUT_OF_MEMORY,
                    f"the call was killed at its memory limit of {limiter.describe()}",
                )
            log.info("%s: a process of the call was killed at its memory limit", self)
        if outcome is None and ending is _Ending.FINISHED:
            failed = self._failed(
                wire.ErrorKind.WORKER_DIED,
                "the call ended without an outcome: its code closed the worker's outcome pipe",
            )
            return replace(failed, spoilt="its outcome pipe was closed")
        if outcome is None:
            message = describe_exit(worker.returncode)
            if limiter.mechanism == "rlimit":
                message += (
                    f"; it ran under a limit of {limiter.describe()}, and native code that "
                    "cannot allocate memory often crashes"
                )
            return self._failed(wire.ErrorKind.WORKER_CRASHED, message)
        request = wire.CompleteRequest(
            epoch=epoch,
            state="succeeded" if outcome.ok else "failed",
            error_kind=outcome.error_kind,
            error_type=outcome.error_type,
            error_message=outcome.error_message,
            traceback=outcome.traceback,
            result=outcome.result,
            started=outcome.started,
            finished=outcome.finished,
            result_json=outcome.result_json,
            result_json_error=outcome.result_json_error,
            result_size=max(0, outcome.result_size),
        )
        return Report(request, outcome.result_path)

    async def _post_logs(self, request: wire.CompleteRequest) -> None:
        """Post the log chunks kept for a completion that will not be sent (best effort)."""
        if not request.logs:
            return
        logs = wire.LogsRequest(
            epoch=request.epoch, first_seq=request.logs_first_seq, chunks=request.logs
        )
        try:
            await self._client.logs(self.ref.invocation_id, logs)
        except NodeletError as exc:
            log.warning("%s: its last output was lost (%s)", self, exc)

    async def _complete(self, report: Report, files: _Files | None) -> None:
        # Whatever outcome is sent in the end, the output kept for it goes with it.
        output = {"logs": report.request.logs, "logs_first_seq": report.request.logs_first_seq}
        request = report.request
        if report.result_path is not None and files is not None:
            request = await self._result_file(request, report.result_path, files)
        elif request.result is not None and len(request.result) > self._facts.inline_limit:
            request = await self._result_blob(request, self._client.upload_result, request.result)
        request = msgspec.structs.replace(request, **output)
        try:
            await _retrying(self._send_outcome, self.ref.invocation_id, request)
        except GatewayRejected as exc:
            if exc.status != 422:
                raise
            # The outcome the call's account left is not one the gateway takes (its code
            # may write it itself: text with NUL, JSON that is none, sizes out of range).
            # Abandoned, the call would be requeued and its code run again: it fails, once.
            request = self._failed(
                wire.ErrorKind.WORKER_DIED,
                f"the call's outcome was refused by the gateway ({exc.detail}): the worker "
                "did not write it, or the call's code wrote over it",
            ).request
            # Its output on its own, so that output the gateway refuses cannot refuse this too.
            await self._post_logs(msgspec.structs.replace(request, **output))
            await _retrying(self._send_outcome, self.ref.invocation_id, request)
        except StaleAttempt:
            if request.result_file is not None and self._facts.shared_dir is not None:
                # Nobody will read a discarded result: do not leave it to the sweeper.
                root, names = self._facts.shared_dir, [request.result_file]
                await asyncio.to_thread(shared.remove, root, names)
            raise
        log.info("%s completed: %s", self, request.state)

    async def _send_outcome(self, invocation_id: str, request: wire.CompleteRequest) -> None:
        send = self._complete_with or self._client.complete
        await send(invocation_id, request)

    async def _result_file(
        self, request: wire.CompleteRequest, path: str, files: _Files
    ) -> wire.CompleteRequest:
        """Pass on the result file in the shared directory by the one name this attempt may
        use; stream the one the worker spilled into ``out`` up as a blob; refuse any other
        (a call's code may write its outcome itself, naming any file: another user's
        result, the node's token)."""
        shared_result = self._shared_result()
        root = self._facts.shared_dir
        if shared_result and root and path == os.path.join(root, shared_result):
            return msgspec.structs.replace(request, result=None, result_file=shared_result)
        request = msgspec.structs.replace(request, result_size=0)  # a blob counts its own
        if path != os.path.join(files.out, SPILLED):
            return self._failed(
                wire.ErrorKind.WORKER_DIED,
                f"the worker's outcome names {path} as its result, which is neither its "
                "spill_dir's result.bin nor the attempt's own file of the shared directory: "
                "refused",
            ).request
        try:
            opened = await asyncio.to_thread(open_owned, files.out_fd, SPILLED, files.uid)
        except FileNotFoundError:
            message = f"the worker's result file {path} is missing"
            return self._failed(wire.ErrorKind.WORKER_DIED, message).request
        except UntrustedFile as exc:
            message = f"the worker's result file: {exc}"
            return self._failed(wire.ErrorKind.WORKER_DIED, message).request
        try:
            return await self._result_blob(request, self._client.upload_result_file, opened)
        except UntrustedFile as exc:
            message = f"the worker's result file: {exc}"
            return self._failed(wire.ErrorKind.WORKER_DIED, message).request
        finally:
            os.close(opened.fd)

    async def _result_blob(
        self,
        request: wire.CompleteRequest,
        upload: Callable[[str, int, Any], Awaitable[wire.BlobRef]],
        source: Any,
    ) -> wire.CompleteRequest:
        """The request with its result uploaded as a blob (``upload(id, epoch, source)``);
        a failed one if the gateway refuses the result as too big."""
        try:
            blob = await _retrying(upload, *self._ids, source)
        except GatewayRejected as exc:
            if exc.status != 413:
                raise
            return self._failed(
                wire.ErrorKind.USER, f"the call's result could not be stored: {exc.detail}"
            ).request
        return msgspec.structs.replace(request, result=None, result_blob=blob.id)

    async def _hand_back_if_preempted(self) -> None:
        """After a failure: a preempted attempt is still handed back (best effort), so its
        call does not wait for the lease to lapse."""
        if not self.preempting:
            return
        await self._reap()
        try:
            await self._hand_back()
        except NodeletError as exc:
            log.warning("%s: could not hand it back (%s); its lease will lapse", self, exc)

    async def _hand_back(self) -> None:
        """Give a preempted attempt back: its call is queued again, the attempt not counted
        against its retries."""
        await _retrying(
            functools.partial(self._client.release, timeout_s=self._client.timeout_s), *self._ids
        )
        log.info("%s handed back after preemption; it is queued again", self)

    async def _reap(self) -> None:
        """Kill the attempt's worker, if it still has one, and wait until the worker and all
        it started are gone (at most :data:`REAP_S`): the attempt's task ends only then, and
        the next attempt on its GPUs waits for it (``Node._launch``). Killed again meanwhile
        (its task cancelled again), it still waits, then ends cancelled."""
        if self._stopper is not None:
            self._stopper.cancel()
        worker, self._worker = self._worker, None
        if worker is None:
            return
        worker.kill()
        gone = asyncio.ensure_future(asyncio.wait_for(worker.wait(), REAP_S))
        cancelled = False
        while not gone.done():
            try:
                await asyncio.shield(gone)
            except asyncio.CancelledError:
                cancelled = True
            except TimeoutError:
                break
        if not gone.cancelled() and isinstance(gone.exception(), TimeoutError):
            log.warning(
                "%s: worker %d, or something its call started, still runs %g s after it was "
                "killed; its GPUs are given on all the same",
                self,
                worker.pid,
                REAP_S,
            )
        if cancelled:
            raise asyncio.CancelledError


class _Starting:
    """Marks an attempt started once it ran :data:`START_AFTER_S` (a timer, then a task: most
    calls end sooner, and cost neither a task nor a request)."""

    def __init__(self, attempt: Attempt) -> None:
        self._attempt = attempt
        self._task: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(START_AFTER_S, self._begin)

    def _begin(self) -> None:
        name = f"{self._attempt.name}-start"
        self._task = asyncio.create_task(self._attempt.mark_started(), name=name)

    async def refused(self) -> None:
        """Raise the gateway's refusal (``StaleAttempt``) if marking it started was refused."""
        if self._task is not None and self._task.done():
            await self._task

    def cancel(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()


async def _first(
    exited: asyncio.Future[int], pumps: list[asyncio.Task[bool]], timeout_s: float | None
) -> bool:
    """Wait until the worker has ``exited`` or every pump has ended, for at most
    ``timeout_s``: False if that passed first. Callbacks, not tasks: this is once per call."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[bool] = loop.create_future()
    left = len(pumps)

    def settle(value: bool) -> None:
        if not waiter.done():
            waiter.set_result(value)

    def ended(_: object) -> None:
        settle(True)

    def pumped(_: object) -> None:
        nonlocal left
        left -= 1
        if left == 0:
            ended(None)

    exited.add_done_callback(ended)
    for pump in pumps:
        pump.add_done_callback(pumped)
    timer = None
    if timeout_s is not None:
        timer = loop.call_later(timeout_s, settle, False)
    try:
        return await waiter
    finally:
        if timer is not None:
            timer.cancel()
        exited.remove_done_callback(ended)  # the worker's: it outlives this call
        for pump in pumps:
            pump.remove_done_callback(pumped)


async def _drain(pumps: list[asyncio.Task[bool]]) -> None:
    """Wait for both pipes to reach EOF, giving up on output held open by an escaped process."""
    if all(pump.done() for pump in pumps):
        pending: set[asyncio.Task[bool]] = set()
    else:
        _, pending = await asyncio.wait(pumps, timeout=EOF_GRACE_S)
    if pending:
        log.warning("worker output still open %.0f s after it exited; cut off", EOF_GRACE_S)
    for pump in pumps:
        if pump.done() and not pump.cancelled() and pump.exception() is not None:
            log.warning("reading worker output failed: %s", pump.exception())


def _marked(pumps: list[asyncio.Task[Any]]) -> bool:
    """Whether both pipes reached the call's end marker: its output ended, worker alive."""
    return all(
        p.done() and not p.cancelled() and p.exception() is None and p.result() for p in pumps
    )


#: Attempt directories being removed (kept referenced until they are).
_removing: set[asyncio.Task[None]] = set()
#: Emptied attempt directories kept for their owner's next call, with when they were kept.
_kept: dict[_KeepKey, list[tuple[_Files, float]]] = {}
#: The nodelet is stopping: nothing more is kept.
_closing = False


def _expire_kept() -> None:
    """Remove the kept directories nobody reused for ``_KEEP_S``."""
    old = time.monotonic() - _KEEP_S
    for key in [k for k, kept in _kept.items() if kept[0][1] < old]:
        stale = [f for f, at in _kept[key] if at < old]
        fresh = [(f, at) for f, at in _kept[key] if at >= old]
        if fresh:
            _kept[key] = fresh
        else:
            del _kept[key]
        for files in stale:
            files.keep = False
            _remove_later(files)


def _remove_later(files: _Files) -> None:
    """Remove an attempt's directory in a task of its own: the attempt is over (a late
    revocation, which cancels its task, must not cut the removal short), and a big tree
    left by the call takes a while."""
    task = asyncio.create_task(files.close(), name=f"remove-{os.path.basename(files.path)}")
    _removing.add(task)
    task.add_done_callback(_removing.discard)


async def removals_done(timeout_s: float) -> None:
    """Remove the attempt directories kept for later calls, and wait (at most
    ``timeout_s``) for those being removed."""
    global _closing
    _closing = True
    for kept in _kept.values():
        for files, _ in kept:
            files.keep = False
            _remove_later(files)
    _kept.clear()
    try:
        await _removals(timeout_s)
    finally:
        _closing = False  # a node started again in this process keeps directories again


async def _removals(timeout_s: float) -> None:
    if _removing:
        await asyncio.wait(set(_removing), timeout=timeout_s)


def _warm_owner(assignment: wire.Assignment) -> str:
    """Whose warm workers may run the call: the owner's, or, for another user's registered
    function, those that ran only that user's code for this owner. Code stays behind in a
    worker (patched modules, threads): a colleague's function must not be able to tamper
    with the owner's own later results, which the owner's sdk trusts."""
    code = assignment.function_owner
    if not code or code == assignment.owner_name:
        return assignment.owner
    return f"{assignment.owner}:{code}"


def _broken_cuda(request: wire.CompleteRequest) -> str | None:
    """Why a worker must not run another call after this one: a CUDA error other than out
    of memory leaves its CUDA context unusable."""
    text = f"{request.error_type or ''} {request.error_message or ''}"
    if "CUDA error" in text and "out of memory" not in text:
        return "its call hit a CUDA error (the CUDA context is not reusable)"
    return None


def describe_exit(returncode: int | None) -> str:
    """Why a worker that left no outcome died, in words a user can act on."""
    if returncode is None:
        return "worker process vanished without leaving a result"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        message = f"worker process was killed by signal {-returncode} ({name})"
        if -returncode == signal.SIGKILL:
            message += " — often the out-of-memory killer"
        return message
    return f"worker process exited with code {returncode} without leaving a result"


async def _retrying(call: Callable[..., Awaitable[_T]], *args: Any) -> _T:
    """Retry while the gateway is unavailable; the calls retried here are idempotent."""
    backoff = Backoff()
    while True:
        try:
            return await call(*args)
        except GatewayUnavailable as exc:
            log.warning("gateway unavailable (%s); retrying", exc)
            await backoff.sleep()
