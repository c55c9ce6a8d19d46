"""The history check of the fault suite (tests/integration/test_faults.py).

Every call of the suite runs :func:`work`: it appends a fresh nonce to its own file under
the history's directory when it starts (one line per execution) and returns the nonce. After
the fault, :meth:`History.check` holds the suite's invariants for each call: it ended in
exactly one terminal state, it ran at most ``max_retries + 1`` times and never more often
than it was counted (an attempt, or a preemption handed back), and the result the caller got
is the one of its last execution (the committed result comes from the final epoch). While a
fault plays out, :meth:`History.gpus_never_shared` watches that no GPU of a node is held by
two live executions at once.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle

import sdk
from bulletin_core import wire
from tests.processes import alive

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def work(directory: str, key: str, seconds: float) -> str:
    """One execution: note (on GPUs) this process and its GPUs in ``directory/gpus``, then a
    nonce in ``directory/key``; run ``seconds``, return the nonce."""
    import os
    import secrets
    import time

    devices = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if devices:
        # The worker's parent is its nodelet, started with --name NODE: GPU i of a node is
        # (NODE, i), whichever incarnation of it runs. Noted before the nonce, so a test that
        # saw the execution start (and then kills the nodelet) finds its GPUs noted too.
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as cmdline:
            args = cmdline.read().decode().split("\0")
        node = args[args.index("--name") + 1]
        with open(os.path.join(directory, "gpus"), "a") as file:
            file.write(f"{os.getpid()} {node} {devices}\n")
    nonce = secrets.token_hex(6)
    with open(os.path.join(directory, key), "a") as file:
        file.write(nonce + "\n")
    time.sleep(seconds)
    return nonce


def hold(directory: str, key: str) -> str:
    """Note this process's pid in ``directory/key.pid``, then run for ever (until killed)."""
    import os
    import time

    with open(os.path.join(directory, key + ".pid"), "w") as file:
        file.write(str(os.getpid()))
    time.sleep(3600)
    return "never"


@dataclass
class History:
    directory: Path
    calls: dict[str, tuple[sdk.Call[Any], int]] = field(default_factory=dict)
    #: GPUs seen in two live executions at once: (gpu, pid, pid).
    shared_gpus: list[tuple[tuple[str, str], int, int]] = field(default_factory=list)
    _watching: threading.Event = field(default_factory=threading.Event)

    @contextlib.contextmanager
    def gpus_never_shared(self, every_s: float = 0.02) -> Iterator[None]:
        """Check, every ``every_s`` while the block runs, that no GPU of a node is held by
        two live executions at once (a killed attempt counts until its process is gone)."""
        self._watching.set()
        watcher = threading.Thread(target=self._watch, args=(every_s,), daemon=True)
        watcher.start()
        try:
            yield
        finally:
            self._watching.clear()
            watcher.join(5)
        assert not self.shared_gpus, f"a GPU held by two live attempts: {self.shared_gpus[:3]}"

    def gpu_executions(self) -> int:
        """How many executions ran on GPUs."""
        path = self.directory / "gpus"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def _watch(self, every_s: float) -> None:
        path = self.directory / "gpus"
        while self._watching.is_set():
            holders: dict[tuple[str, str], int] = {}
            lines = path.read_text().splitlines() if path.exists() else []
            for line in lines:
                pid, node, devices = line.split()
                if not alive(int(pid)):
                    continue
                for gpu in devices.split(","):
                    other = holders.setdefault((node, gpu), int(pid))
                    if other != int(pid):
                        self.shared_gpus.append(((node, gpu), other, int(pid)))
            time.sleep(every_s)

    def spawn(
        self, key: str, seconds: float, *, max_retries: int = 2, gpus: int = 0
    ) -> sdk.Call[Any]:
        fn = sdk.function(gpus=gpus, max_retries=max_retries)(work)
        call = fn.spawn(str(self.directory), key, seconds)
        self.calls[key] = (call, max_retries)
        return call

    def executions(self, key: str) -> list[str]:
        path = self.directory / key
        return path.read_text().split() if path.exists() else []

    def started(self, key: str) -> bool:
        return bool(self.executions(key))

    def wait_started(self, *keys: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.started(k) for k in keys):
            assert time.monotonic() < deadline, f"not all of {keys} started"
            time.sleep(0.02)

    def check(self, key: str, *, timeout: float = 60) -> wire.Invocation:
        """The call ended once, within its retries, with its last execution's result."""
        call, max_retries = self.calls[key]
        try:
            value = call.result(timeout=timeout)
        except (sdk.RemoteError, sdk.CallCancelled, sdk.CallTimedOut):
            value = None
        info = call.info()
        assert wire.State(info.state).terminal, f"{key}: {info.state}"
        runs = self.executions(key)
        assert len(runs) <= max_retries + 1, f"{key} ran {len(runs)} times: {runs}"
        # Each execution was counted: an attempt, or a preemption handed back.
        assert len(runs) <= info.attempts + info.preemptions, (
            f"{key} ran {len(runs)} times for {info.attempts} attempts"
        )
        if info.state == wire.State.SUCCEEDED:
            assert runs and value == runs[-1], f"{key}: result {value!r} is not the last run's"
        return info

