"""Caller liveness: the calls this process waits for stay alive only while it does.

A blocking call (``f(x)``) and the items of ``f.map(...)`` carry the client's session id
(``CallSpec.caller_session``). While any of them is awaited, a daemon thread keeps the
session alive (``POST /v1/sessions/{id}/keepalive``) as often as the gateway asks
(``SubmitResponse.keepalive_s``). When this process dies (``kill -9``, an out-of-memory
kill, a kernel restart), the keepalives stop and the gateway cancels those calls after its
``caller_timeout_s``, freeing their GPUs. ``spawn`` calls carry no session: they run whether
anyone waits for them or not, and can be re-attached by id.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

_log = logging.getLogger("sdk")

#: How often to keep alive before the gateway has said (its default caller_timeout_s / 6).
DEFAULT_INTERVAL_S = 10.0


class Liveness:
    """Keeps one session alive while anything holds it (:meth:`held`). Thread-safe."""

    def __init__(self, send: Callable[[], None]) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._holders = 0
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self.interval_s = DEFAULT_INTERVAL_S

    def set_interval(self, seconds: float | None) -> None:
        """The gateway's ``keepalive_s`` (None: it cancels nothing, so nothing is sent)."""
        interval = DEFAULT_INTERVAL_S if seconds is None else max(0.05, seconds)
        if interval == self.interval_s:
            return  # the same on every submission: nothing to wake the thread for
        with self._lock:
            self.interval_s = interval
            self._wake.notify_all()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Keep the session alive for as long as this is held (by anyone)."""
        with self._lock:
            self._holders += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="bulletin-keepalive", daemon=True
                )
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                self._wake.notify_all()

    def _run(self) -> None:
        last = time.monotonic()
        while True:
            with self._lock:
                # The interval is read under the lock each round: one set before this thread
                # first waited (its notification then woke no one) counts all the same.
                self._wake.wait(max(0.0, last + self.interval_s - time.monotonic()))
                if self._holders == 0:
                    self._thread = None
                    return
                if time.monotonic() < last + self.interval_s:
                    continue  # woken early: a holder left, or a new interval
            last = time.monotonic()
            try:
                self._send()
            except Exception as exc:  # the next one may get through; the waits report errors
                _log.debug("keepalive failed: %s", exc)
