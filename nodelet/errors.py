"""The nodelet's exceptions. httpx errors never leave :mod:`nodelet.client`.

NodeletError
├── StaleAttempt        409: the attempt was revoked, requeued or cancelled; drop its result
├── GatewayUnavailable  transport error, 429 or 5xx: retry with backoff
├── AuthRejected        401/403: the node token is wrong; fatal
├── GatewayRejected     any other 4xx: the request itself was refused
└── UntrustedFile       a file a call's account left is not what it must be (a link, a FIFO,
                        another's, too big): refused, never read through
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


class GatewayUnavailable(NodeletError):
    """The gateway could not be reached or failed (5xx); the call may be retried."""


class AuthRejected(NodeletError):
    """The gateway refused the node token (401/403)."""


class GatewayRejected(NodeletError):
    """The gateway refused the request (a 4xx other than 401, 403 and 409)."""


class UntrustedFile(NodeletError):
    """A file the call's account left is not what it must be (the message says why)."""
