"""The nodelet's exceptions. httpx errors never leave :mod:`nodelet.client`.

NodeletError
├── StaleAttempt        409: the attempt was revoked, requeued or cancelled; drop its result
│   └── Superseded      409: a later start of this node registered; this one must stop
├── GatewayUnavailable  transport error, 429 or 5xx: retry with backoff
├── AuthRejected        401/403: the node token is wrong; fatal
├── GatewayRejected     any other 4xx: the request itself was refused
├── UntrustedFile       a file a call's account left is not what it must be (a link, a FIFO,
│                       another's, too big): refused, never read through
└── UntrustedOutcome    what a worker's outcome pipe carried is no outcome (too big, not
                        msgpack): refused unread, the worker not used again
"""

from __future__ import annotations


class NodeletError(Exception):
    """Base of every nodelet error. ``status`` is the HTTP status, 0 for transport errors."""

    def __init__(self, message: str, *, status: int = 0, detail: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail


class StaleAttempt(NodeletError):
    """The gateway fenced the attempt off (409): it was revoked, requeued or cancelled."""


class Superseded(StaleAttempt):
    """The node registered again since this nodelet did (409 ``superseded``): another start of
    it replaced this one, whose attempts were taken back. Fatal: this nodelet must stop."""


class GatewayUnavailable(NodeletError):
    """The gateway could not be reached or failed (5xx); the call may be retried.
    ``code`` is the problem's code when the gateway answered (``db_unavailable``: the
    gateway is up but its database is not)."""

    def __init__(self, message: str, *, status: int = 0, detail: str = "", code: str = "") -> None:
        super().__init__(message, status=status, detail=detail)
        self.code = code

    @property
    def database_down(self) -> bool:
        """The gateway said its database is unavailable: no one can expire a lease now."""
        return self.code == "db_unavailable"


class AuthRejected(NodeletError):
    """The gateway refused the node token (401/403)."""


class GatewayRejected(NodeletError):
    """The gateway refused the request (a 4xx other than 401, 403 and 409)."""


class UntrustedFile(NodeletError):
    """A file the call's account left is not what it must be (the message says why)."""


class UntrustedOutcome(NodeletError):
    """What came on a worker's outcome pipe is not an outcome it may send (the message says
    why): the worker must not run another call."""
