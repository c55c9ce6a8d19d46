"""The worker process: runs calls handed to it on stdin, one at a time.

Started as ``python -m nodelet.worker_main`` by :mod:`nodelet.pool`. It reads length-prefixed
msgpack :class:`~bulletin_core.wire.WorkerTask`s from stdin, checks and unpickles each call (the
only place on a node where user data is unpickled; see :mod:`bulletin_core.pickling.remote`),
moves its tensors to the call's device, runs it with stdout/stderr on the nodelet's pipes, and
writes a :class:`~bulletin_core.wire.WorkerOutcome` on its *outcome pipe* (the descriptor
``BULLETIN_OUTCOME_FD`` names, whose read end only the nodelet has): the pickled return value
(or exception) and the globals the call changed, inline or in a file. After a call it kills
what the call spawned, restores its environment, working directory and ``sys.path``, and
writes the task's end marker to both pipes; a task without an end marker is its last. The
outcome goes just before the markers, so once the nodelet has read both markers the outcome
is in its pipe (a big one is read as it is written: the nodelet reads the outcome pipe while
the call runs). A pipe, not a file: making, renaming, reading and unlinking a file for every
call cost a third of a short call's time in the worker.

A call that leaves a thread of its own running (one it started and did not end) makes the
call the worker's last: a thread can go on computing on a GPU the scheduler counts free, or
start processes after the call's were killed. The worker says so on the call's stderr,
writes the outcome, kills what the call started and exits without an end marker: the
nodelet reports the outcome and starts no other call in it.

The worker is a child subreaper (:func:`nodelet.procs.become_subreaper`): the orphans of what
a call starts (a double-forked daemon, the children of a setsid child that exited) are
re-parented to it, so everything a call started descends from it, and is killed after the
call. A thread watches its *lifeline*, a pipe whose write end only the nodelet holds: when
the nodelet dies, the worker kills everything it started and exits.

When the task asks for it (:data:`nodelet.limits.RLIMIT_ENV`), the worker limits its own
address space before it unpickles the call, and reports a ``MemoryError`` as out of memory.

Imports stay light (stdlib, cloudpickle, msgspec, our wire and pickling modules): a worker
must start fast.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import IO, Any

import msgspec

from bulletin_core import shared, wire
from bulletin_core.pickling import envelope, remote
from bulletin_core.pickling.pickler import type_name
from nodelet import jsoncall, limits, procs

#: Longest error message or traceback kept (the middle of a longer one is cut).
MAX_ERROR_TEXT = 64 * 1024
#: The environment variable naming the worker's lifeline descriptor (nodelet.pool).
LIFELINE_ENV = "BULLETIN_LIFELINE_FD"
#: The environment variable naming the descriptor the worker writes outcomes to (nodelet.pool).
OUTCOME_ENV = "BULLETIN_OUTCOME_FD"
_task_decoder = msgspec.msgpack.Decoder(wire.WorkerTask)
_encoder = msgspec.msgpack.Encoder()


def frame(task: wire.WorkerTask) -> tuple[bytes, bytes]:
    """The length prefix and body a worker expects on its stdin."""
    body = _encoder.encode(task)
    return len(body).to_bytes(4, "big"), body


def read_task(stream: IO[bytes]) -> wire.WorkerTask | None:
    """One framed task from ``stream``, or None when it closes before a whole task arrives."""
    prefix = stream.read(4)
    if len(prefix) < 4:
        return None
    body = stream.read(int.from_bytes(prefix, "big"))
    return _task_decoder.decode(body)


def watch_lifeline() -> None:
    """Die with the nodelet, and take everything the calls started along: a thread waits for
    EOF on the lifeline (the nodelet's death closes its write end, whenever it happens), then
    kills this worker's descendants and exits. What it may not kill (a process that became
    root through a setuid program) keeps it alive, as their subreaper, so that the nodelet's
    next start finds it in its record and kills it with them. Without a lifeline (a worker
    started by hand), nothing is watched."""
    fd = os.environ.pop(LIFELINE_ENV, "")
    if fd.isdigit():
        os.set_inheritable(int(fd), False)  # not passed on to what calls run
        threading.Thread(
            target=_outlive_nothing, args=(int(fd),), name="bulletin-lifeline", daemon=True
        ).start()


def _outlive_nothing(fd: int) -> None:
    while True:
        try:
            if not os.read(fd, 4096):
                break
        except InterruptedError:
            continue
        except OSError:
            break  # the call closed it: a lost lifeline, as good as EOF
    while kill_leftovers():
        time.sleep(1.0)
    os._exit(1)


def run_task(task: wire.WorkerTask) -> wire.WorkerOutcome:
    """Become the call's account, prepare the environment, check and unpickle the call, run
    it, pack its outcome."""
    # First of all: nothing of the call, not even its payload file, is touched as root.
    if task.run_as is not None:
        become(task.run_as, task.spill_dir)
    else:
        private(task.spill_dir)
    os.environ.update(task.env)
    # The gateway's GPU choice wins over anything in task.env.
    # NVML numbers GPUs by PCI bus; CUDA's default order (fastest first) may differ.
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, task.gpu_indices))
    cap_gpu_memory(task.gpu_share)
    limit_mb = limits.set_address_space_limit(task.env)
    where = f"node {socket.gethostname()!r}"
    try:
        remote_call = remote.open_call(_payload(task), where=where)
    except remote.VersionSkew as exc:
        return _failure(wire.ErrorKind.VERSION_SKEW, "VersionSkew", str(exc))
    except PermissionError as exc:
        if task.payload_file is None:
            return _bad_payload(exc)
        return _failure(
            wire.ErrorKind.BAD_PAYLOAD,
            type_name(exc),
            f"the call's payload file {task.payload_file} cannot be read by this worker's "
            f"account (uid {os.geteuid()}): {exc.strerror}. A user's directory of the shared "
            "directory is theirs alone; on a single-tenant node workers run as the nodelet's "
            "account. Run the node with a user mapping (--user-mapping same-name), or send "
            "big state through the gateway (sdk.Client.use_shared_dir = False)",
        )
    except (envelope.EnvelopeError, OSError) as exc:
        return _bad_payload(exc)
    try:
        fn, args, kwargs = remote_call.load()
    except Exception as exc:
        if isinstance(exc, MemoryError) and limit_mb is not None:
            return _out_of_memory(exc, limit_mb)
        return _bad_payload(exc)
    if task.arguments is not None:
        try:
            args, kwargs = jsoncall.arguments(task.arguments)
        except ValueError as exc:
            return _bad_payload(exc)
    try:
        remote_call.prepare(task.device)
    except Exception as exc:
        remote_call.finish()
        return _failure(
            wire.ErrorKind.USER,
            type_name(exc),
            f"moving the call's tensors and modules to {task.device} failed: "
            f"{type_name(exc)}: {exc}",
            user_traceback(exc),
        )
    return call(remote_call, fn, args, kwargs, task)


def call(
    remote_call: remote.RemoteCall,
    fn: Any,
    args: Any,
    kwargs: Any,
    task: wire.WorkerTask,
) -> wire.WorkerOutcome:
    """Run ``fn(*args, **kwargs)`` and describe how it went."""
    value, error = None, None
    started = time.time()
    try:
        value = fn(*args, **kwargs)
    except BaseException as exc:
        # BaseException: sys.exit() or KeyboardInterrupt in user code is still the user's doing.
        error = exc
    finally:
        finished = time.time()
        remote_call.finish()
    limit_mb = limits.address_space_limit(task.env)
    if isinstance(error, MemoryError) and limit_mb is not None:
        # Not packed: the sdk raises OutOfMemoryError, and packing state needs memory too.
        failed = _out_of_memory(error, limit_mb)
        return msgspec.structs.replace(failed, started=started, finished=finished)
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        outcome = remote_call.pack_outcome(value, error)
        result, result_path = _place(outcome.packed, remote_call.header, task)
        size = outcome.packed.nbytes if result_path is not None else 0
    except remote.ResultError as exc:
        failed = _failure(wire.ErrorKind.USER, wire.RESULT_ERROR, f"{name}: {exc}")
        return msgspec.structs.replace(failed, started=started, finished=finished)
    except Exception as exc:  # a full disk, a shared directory gone read-only...
        failed = _failure(
            wire.ErrorKind.USER,
            wire.RESULT_ERROR,
            f"{name}: its outcome could not be written: {type_name(exc)}: {exc}",
            user_traceback(exc),
        )
        return msgspec.structs.replace(failed, started=started, finished=finished)
    if error is None and outcome.problem is not None:
        # The return value cannot travel, but the state it changed does.
        return wire.WorkerOutcome(
            ok=False,
            result=result,
            result_path=result_path,
            result_size=size,
            error_kind=wire.ErrorKind.USER,
            error_type=wire.RESULT_ERROR,
            error_message=f"{name}: {outcome.problem}",
            started=started,
            finished=finished,
        )
    if error is None:
        result_json = result_json_error = None
        if task.arguments is not None:
            result_json, result_json_error = jsoncall.encode(value, task.inline_limit)
        return wire.WorkerOutcome(
            ok=True,
            result=result,
            result_path=result_path,
            result_size=size,
            started=started,
            finished=finished,
            result_json=result_json,
            result_json_error=_no_nul(result_json_error),
        )
    return wire.WorkerOutcome(
        ok=False,
        result=result,
        result_path=result_path,
        result_size=size,
        started=started,
        finished=finished,
        error_kind=wire.ErrorKind.USER,
        error_type=type_name(error),
        error_message=str(error),
        traceback=user_traceback(error),
    )


def _payload(task: wire.WorkerTask) -> bytes | int:
    """The call's envelope: inline bytes, or a descriptor of its file (opened as the call's
    own account; one in the shared directory only as a regular file of its owner's)."""
    if task.payload is not None:
        return task.payload
    if task.payload_file is not None and task.shared_dir is not None:
        uid = os.geteuid() if task.run_as is not None else None
        try:
            return shared.open_fd(task.shared_dir, task.payload_file, uid=uid)
        except ValueError as exc:
            raise envelope.EnvelopeError(str(exc)) from None
    if task.payload_path is not None:
        return os.open(task.payload_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    raise envelope.EnvelopeError("the task carries no payload")


def _place(
    packed: envelope.Packed, header: wire.PickleHeader, task: wire.WorkerTask
) -> tuple[bytes | None, str | None]:
    """Inline when small; else a file in the owner's directory of the shared directory
    (when the caller reads it there), or in the spill directory (which the nodelet uploads)."""
    if packed.nbytes <= task.inline_limit:
        return packed.tobytes(), None
    if header.shared_results and task.shared_dir and task.shared_result:
        # A worker that runs as the owner's account may make the owner's directory; one that
        # runs as the nodelet's (a single-tenant node) writes only into a directory that is
        # already its own account's: it must not take the name of another account's.
        create = task.run_as is not None
        try:
            files = task.shared_dir, task.shared_result, packed.pieces()
            return None, shared.write_file(*files, create=create)
        except FileNotFoundError:
            pass  # no directory of the owner's that this account may use: spilled, quietly
        except OSError as exc:  # not this account's directory, a full or read-only NAS...
            print(
                f"bulletin: the result could not be written to the shared directory ({exc}); "
                "it goes through the gateway instead",
                file=sys.__stderr__,
                flush=True,
            )
    path = os.path.join(task.spill_dir, SPILLED)
    packed.write(path)
    return None, path


#: The name of a result spilled into the task's ``spill_dir`` (the nodelet uploads it).
SPILLED = "result.bin"


def become(account: wire.RunAs, workdir: str) -> None:
    """Switch this worker to ``account`` for good, before anything of the call is loaded (a
    warm worker serves one owner only: it is already that account for later calls), with
    its supplementary groups, its home and a private umask."""
    if os.geteuid() == 0 and account.uid != 0:
        os.setgroups(account.groups)
        os.setgid(account.gid)
        os.setuid(account.uid)  # as root: real, effective and saved ids alike
    if os.getresuid() != (account.uid,) * 3 or os.getresgid() != (account.gid,) * 3:
        # A worker that served another account, or a switch that did not take: never run.
        raise PermissionError(
            f"worker {os.getpid()} runs as uid {os.getuid()}, not as {account.user!r} "
            f"(uid {account.uid}); it cannot run this call"
        )
    os.environ.update(HOME=account.home, USER=account.user, LOGNAME=account.user)
    private(workdir)


def private(workdir: str) -> None:
    """Files the call makes are its account's alone unless it says otherwise (umask 077); it
    starts in its own directory (the nodelet's work directory is not the account's)."""
    os.umask(0o077)
    if workdir:
        os.chdir(workdir)


def _failure(
    kind: wire.ErrorKind, error_type: str, message: str, trace: str | None = None
) -> wire.WorkerOutcome:
    return wire.WorkerOutcome(
        ok=False, error_kind=kind, error_type=error_type, error_message=message, traceback=trace
    )


def _out_of_memory(exc: MemoryError, limit_mb: int) -> wire.WorkerOutcome:
    detail = f"{type_name(exc)}: {exc}" if str(exc) else type_name(exc)
    return _failure(
        wire.ErrorKind.OUT_OF_MEMORY,
        type_name(exc),
        f"the call ran out of memory at its limit of {limit_mb} MiB of address space per "
        f"process (RLIMIT_AS): {detail}",
        user_traceback(exc),
    )


def _bad_payload(exc: Exception) -> wire.WorkerOutcome:
    if isinstance(exc, remote.BadCall):
        message = str(exc)
    elif isinstance(exc, ModuleNotFoundError):
        message = (
            f"the call needs module {exc.name!r}, which is not installed on node "
            f"{socket.gethostname()!r}: install it on the nodes (helper modules that are not "
            f"installed in the notebook's environment either are shipped with the call)"
        )
    else:
        message = f"the call could not be unpickled on the node: {type_name(exc)}: {exc}"
    return wire.WorkerOutcome(
        ok=False,
        error_kind=wire.ErrorKind.BAD_PAYLOAD,
        error_type=type_name(exc),
        error_message=message,
        traceback="".join(traceback.format_exception(exc)),
    )


def user_traceback(exc: BaseException) -> str:
    """The formatted traceback of ``exc`` without the worker's own frames on top."""
    return "".join(traceback.format_exception(type(exc), exc, _trim(exc.__traceback__)))


def _trim(tb: TracebackType | None) -> TracebackType | None:
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def outcome_pipe() -> int:
    """The descriptor outcomes go to (:data:`OUTCOME_ENV`), kept from what calls start."""
    fd = os.environ.pop(OUTCOME_ENV, "")
    if not fd.isdigit():
        raise SystemExit(f"the worker writes its outcomes to the descriptor {OUTCOME_ENV} names")
    os.set_inheritable(int(fd), False)
    return int(fd)


def outcome_frame(task: wire.WorkerTask, outcome: wire.WorkerOutcome) -> bytes:
    """The outcome as the nodelet reads it: a 4-byte big-endian length, then msgpack,
    tagged with the task's invocation id, its texts fit for the gateway."""
    outcome = msgspec.structs.replace(
        outcome,
        invocation_id=task.invocation_id,
        error_type=_no_nul(outcome.error_type),
        error_message=_no_nul(outcome.error_message),
        traceback=_no_nul(outcome.traceback),
    )
    body = _encoder.encode(outcome)
    return len(body).to_bytes(4, "big") + body


def send_outcome(fd: int, task: wire.WorkerTask, outcome: wire.WorkerOutcome) -> None:
    """Write the outcome whole (a big one blocks until the nodelet has read it)."""
    data = memoryview(outcome_frame(task, outcome))
    while data:
        data = data[os.write(fd, data) :]


def _no_nul(text: str | None) -> str | None:
    # PostgreSQL text cannot hold NUL, and the gateway rejects it: escape it visibly. Cut
    # what is huge (a message that embeds a whole tensor) so the outcome always fits a request.
    if text is None:
        return None
    text = text.replace("\x00", "\\x00")
    if len(text) > MAX_ERROR_TEXT:
        half = MAX_ERROR_TEXT // 2
        text = f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"
    return text


def _flush(*streams: IO[str] | None) -> None:
    for stream in streams:
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass  # the user closed or broke it; what was written is already on the pipe


class _Baseline:
    """What a call may change and the next call must not see."""

    def __init__(self) -> None:
        # The worker's own (the lifeline's), and whatever warming torch left.
        self.threads = set(threading.enumerate())
        self.environ = dict(_environ_data())
        self.cwd = os.getcwd()
        self.path = list(sys.path)
        # A call may install its own handler to clean up at its time limit's SIGTERM.
        self.sigterm = signal.getsignal(signal.SIGTERM)

    def restore(self) -> None:
        if signal.getsignal(signal.SIGTERM) is not self.sigterm:
            signal.signal(signal.SIGTERM, self.sigterm)
        _restore_environ(self.environ)
        with contextlib.suppress(OSError):
            os.chdir(self.cwd)
        sys.path[:] = self.path
        release_cuda_cache()

    def stray_threads(self) -> list[threading.Thread]:
        """Threads the last call started that still run, after a short grace to end. Native
        threads that never ran Python (torch's pools, the CUDA driver's) are not counted:
        they are the libraries', and idle between calls."""
        deadline = time.monotonic() + THREAD_GRACE_S
        stray = []
        for thread in threading.enumerate():
            if thread in self.threads or isinstance(thread, threading._DummyThread):
                continue
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                stray.append(thread)
        return stray


def _environ_data() -> dict[bytes, bytes]:
    """The environment as os.environ holds it (encoded; its ``_data``, CPython's)."""
    return os.environ._data  # type: ignore[attr-defined]


def _restore_environ(saved: dict[bytes, bytes]) -> None:
    """Put the environment back as ``saved``, changing only what differs (clearing and
    setting it all again cost a fifth of a short call's time in the worker)."""
    data = _environ_data()
    if data == saved:
        return
    for key in [key for key in data if key not in saved]:
        os.unsetenv(key)
        del data[key]
    for key, value in saved.items():
        if data.get(key) != value:
            os.putenv(key, value)
            data[key] = value


def release_cuda_cache() -> None:
    """Hand the GPU memory torch's caching allocator keeps back to the driver, so what the
    last call freed is not held for the next (the CUDA context itself stays warm)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    with contextlib.suppress(Exception):  # a broken CUDA state is recycled by the nodelet
        if torch.cuda.is_initialized():
            import gc

            gc.collect()  # tensors the call left in reference cycles
            torch.cuda.empty_cache()


#: How long the worker waits for what it killed to die before the next call.
KILL_WAIT_S = 2.0
#: How long threads a call started may take to end after it returned, before they count as
#: left running.
THREAD_GRACE_S = 0.1


def kill_leftovers() -> procs.Identities:
    """SIGKILL every descendant of this worker (what the call spawned: as a subreaper it
    adopted the orphans among them), stopped first so that none forks away, and wait
    (briefly) until they are dead and reaped: the next call must not meet them, nor the GPU
    memory they held. Those still running: processes it may not signal."""
    me = os.getpid()
    if procs.no_children():
        return {}  # the common case: the call started nothing, or waited for all it started
    start = procs.start_time(me)
    if start is None:
        return {}
    procs.stop_and_kill(lambda: procs.tree({me: start}, spare=me))
    deadline = time.monotonic() + KILL_WAIT_S
    procs.reap()
    while (left := procs.tree({me: start}, spare=me)) and time.monotonic() < deadline:
        time.sleep(0.005)
        procs.reap()
    return left


def finish(outcomes: int, task: wire.WorkerTask, outcome: wire.WorkerOutcome) -> None:
    _flush(sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    kill_leftovers()
    # The outcome and the markers back to back: the nodelet, woken by the first, finds the
    # rest there too (each write that wakes it is a context switch on a busy node).
    send_outcome(outcomes, task, outcome)
    for fd in (1, 2):
        os.write(fd, task.end_marker)


def private_task_pipe() -> IO[bytes]:
    """Move the task pipe off fd 0 and give user code an empty stdin: code that reads stdin
    (``input()``, a prompting tool) gets EOF instead of hanging or eating the next task."""
    tasks = os.fdopen(os.dup(0), "rb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return tasks


def cap_gpu_memory(share: float) -> None:
    """A call that asked for part of its GPU: say so (``BULLETIN_GPU_SHARE``, set for such a
    call only, as ``CUDA_VISIBLE_DEVICES`` names its GPU) and cap torch's
    CUDA memory at that part of the GPU's (``torch.cuda.set_per_process_memory_fraction``:
    an allocation past it raises torch's out-of-memory error). A warm worker's next call of
    whole GPUs gets the whole GPU back. The cap holds torch's caching allocator only: memory
    other libraries take, or a process that raises the fraction itself, pass it."""
    if share < 1:
        os.environ["BULLETIN_GPU_SHARE"] = f"{share:g}"
    else:
        os.environ.pop("BULLETIN_GPU_SHARE", None)
        if "torch" not in sys.modules:
            return  # (never capped in this worker: nothing to lift)
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(min(share, 1.0), 0)


def warm_torch() -> None:
    """Import torch and run one throwaway optimizer step, which loads what torch otherwise
    loads lazily on a program's first step (torch._dynamo: about a second); with GPUs given at
    start (CUDA_VISIBLE_DEVICES), also create the CUDA context. The tensors are far below
    torch's parallel grain size, so no OpenMP thread pool starts: user code may still fork
    (DataLoader workers) safely. Silent: nothing may reach the pipes, which carry the next
    call's output. Failures only mean a colder first call."""
    with contextlib.suppress(Exception):
        import torch

        model = torch.nn.Linear(8, 8)
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.ones(2, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if os.environ.get("CUDA_VISIBLE_DEVICES") and torch.cuda.is_available():
            torch.ones(1, device="cuda").add_(1)
            torch.cuda.synchronize()


def main() -> None:
    procs.become_subreaper()
    watch_lifeline()
    outcomes = outcome_pipe()
    tasks = private_task_pipe()
    if os.environ.get("BULLETIN_WARM_TORCH") == "1":
        warm_torch()
    baseline = _Baseline()
    while (task := read_task(tasks)) is not None:
        outcome = run_task(task)
        if not task.end_marker:
            break
        stray = baseline.stray_threads()
        if stray:
            _retire_for(stray)
            break
        finish(outcomes, task, outcome)
        baseline.restore()
    else:
        # stdin closed without a task: the nodelet is discarding this worker.
        os._exit(0)
    send_outcome(outcomes, task, outcome)
    _flush(sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    kill_leftovers()
    # os._exit: threads the user left running must not keep a finished worker alive.
    os._exit(0)


def _retire_for(stray: list[threading.Thread]) -> None:
    names = ", ".join(repr(thread.name) for thread in stray[:5])
    more = f" and {len(stray) - 5} more" if len(stray) > 5 else ""
    with contextlib.suppress(OSError, ValueError):  # the call closed its stderr
        print(
            f"bulletin: the call left {len(stray)} thread(s) running ({names}{more}); they end "
            "with this worker, which is not kept warm for the next call",
            file=sys.__stderr__,
            flush=True,
        )


if __name__ == "__main__":
    main()
