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
#: How long the keepalive thread outlives its last holder (a loop's next call reuses it).
LINGER_S = 0.05


class Liveness:
    """Keeps one session alive while anything holds it (:meth:`held`). Thread-safe."""

    def __init__(self, send: Callable[[], None]) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._holders = 0
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._idle_since = 0.0
        #: The thread waits for its next keepalive (not lingering): a holder leaving must
        #: wake it. While it lingers, holders come and go without waking it (a loop's
        #: calls wake it once per LINGER_S, not once per call).
        self._parked = False
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
                if self._holders == 0:
                    self._idle_since = time.monotonic()
                    if self._parked:
                        self._wake.notify_all()

    def _run(self) -> None:
        """Send a keepalive every interval while anything is held. Once nothing is, linger
        ``LINGER_S`` before ending: a loop of blocking calls keeps one thread instead of
        starting (and waiting for) one per call, and a call that used the sdk on a worker
        leaves no thread behind past the worker's grace for them. A holder leaving wakes it
        only while it waits for its next keepalive: waking it for every call of a loop cost
        the caller a thread switch per call."""
        last = time.monotonic()
        while True:
            with self._lock:
                # The interval is read under the lock each round: one set before this thread
                # first waited (its notification then woke no one) counts all the same.
                now = time.monotonic()
                if self._holders == 0:
                    if now >= self._idle_since + LINGER_S:
                        self._thread = None
                        return
                    self._wake.wait(self._idle_since + LINGER_S - now)
                    continue
                if now < last + self.interval_s:
                    self._parked = True
                    self._wake.wait(last + self.interval_s - now)
                    self._parked = False
                    continue
            last = time.monotonic()
            try:
                self._send()
            except Exception as exc:  # the next one may get through; the waits report errors
                _log.debug("keepalive failed: %s", exc)
