"""The history check of the fault suite (tests/integration/test_faults.py).

Every call of the suite runs :func:`work`: it appends a fresh nonce to its own file under
the history's directory when it starts (one line per execution) and returns the nonce. After
the fault, :meth:`History.check` holds the suite's invariants for each call: it ended in
exactly one terminal state, it ran at most ``max_retries + 1`` times and never more often
than it was counted (an attempt, or a preemption handed back), and the result the caller got
is the one of its last execution (the committed result comes from the final epoch).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle

import sdk
from bulletin import wire

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def work(directory: str, key: str, seconds: float) -> str:
    """One execution: note a nonce in ``directory/key``, run ``seconds``, return it."""
    import os
    import secrets
    import time

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
