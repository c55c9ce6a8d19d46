"""Processes as the tests see them: alive or gone, and what a call starts to outlive it.

A process is alive while its ``/proc/PID/stat`` (read by :mod:`nodelet.procs`, the one
reader of ``/proc``) says it runs; a zombie waiting to be reaped is dead.
:func:`start_escapees` runs inside calls (it is pickled by value), so it imports what it
uses itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

import cloudpickle
import msgspec

from bulletin_core import wire
from nodelet import procs
from nodelet.worker_main import OUTCOME_ENV

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def state(pid: int) -> str | None:
    """The process's state letter (``R``, ``S``, ``Z``...), None when there is none."""
    stat = procs.read_stat(pid)
    return None if stat is None else stat.state


def alive(pid: int) -> bool:
    """Running: not gone, not a zombie."""
    return state(pid) not in (None, "Z", "X")


def parent(pid: int) -> int:
    """The process's parent pid."""
    stat = procs.read_stat(pid)
    assert stat is not None, f"process {pid} is gone"
    return stat.ppid


def start_escapees(seconds: float) -> list[int]:
    """Start what tries to outlive its call, each sleeping ``seconds``: a plain child, a
    ``setsid`` child and a double-forked daemon (its parent exited; it leads its own
    session). Returns their pids."""
    import os
    import subprocess

    plain = subprocess.Popen(["sleep", str(seconds)])
    setsid = subprocess.Popen(["setsid", "sleep", str(seconds)])
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.setsid()
        daemon = os.fork()
        if daemon == 0:
            os.execvp("sleep", ["sleep", str(seconds)])
        os.write(write, str(daemon).encode())
        os._exit(0)
    os.close(write)
    daemon = int(os.read(read, 32))
    os.close(read)
    os.waitpid(middle, 0)
    return [plain.pid, setsid.pid, daemon]


def run_worker_process(
    stdin: bytes, *, env: dict[str, str] | None = None, **popen: Any
) -> tuple[subprocess.CompletedProcess[bytes], dict[str, wire.WorkerOutcome]]:
    """Run ``python -m nodelet.worker_main`` with ``stdin`` (framed tasks) and an outcome
    pipe, as the nodelet does; its run and the outcomes it wrote, by invocation id (read
    while it runs: a big one does not fit the pipe's buffer)."""
    read, write = os.pipe()
    written = bytearray()

    def drain() -> None:
        while chunk := os.read(read, 1 << 16):
            written.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "nodelet.worker_main"],
            input=stdin,
            capture_output=True,
            env={**(os.environ if env is None else env), OUTCOME_ENV: str(write)},
            pass_fds=(write,),
            check=False,
            **popen,
        )
    finally:
        os.close(write)
        reader.join(30)
        os.close(read)
    return done, outcome_frames(bytes(written))


def outcome_frames(data: bytes) -> dict[str, wire.WorkerOutcome]:
    """The outcomes in what a worker wrote on its outcome pipe, by invocation id."""
    found = {}
    while data:
        size = int.from_bytes(data[:4], "big")
        outcome = msgspec.msgpack.decode(data[4 : 4 + size], type=wire.WorkerOutcome)
        found[outcome.invocation_id] = outcome
        data = data[4 + size :]
    return found


def forge_outcome(**fields: Any) -> None:
    """Run inside a call: write an outcome of the call's own making on its worker's outcome
    pipe, as any code of a call can (found as an attacker would: the call's task on the
    worker's stack, the one write-only pipe past stderr among its descriptors)."""
    import os
    import sys

    import msgspec

    from bulletin_core import wire

    frame = sys._getframe()
    while not isinstance(frame.f_locals.get("task"), wire.WorkerTask):
        assert frame.f_back is not None, "not run by a worker"
        frame = frame.f_back
    task = frame.f_locals["task"]
    fields.setdefault("ok", True)
    body = msgspec.msgpack.encode(wire.WorkerOutcome(invocation_id=task.invocation_id, **fields))
    os.write(outcome_descriptor(), len(body).to_bytes(4, "big") + body)


def outcome_descriptor() -> int:
    """Run inside a call: the worker's outcome pipe (the one write-only pipe past stderr)."""
    import os

    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if fd <= 2 or not os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:"):
                continue
            with open(f"/proc/self/fdinfo/{fd}") as info:
                flags = next(int(line.split()[1], 8) for line in info if line.startswith("flags"))
        except OSError:
            continue
        if flags & os.O_ACCMODE == os.O_WRONLY:
            return fd
    raise LookupError("no outcome pipe")
