"""Every exception the sdk raises on purpose, and the warning it issues.

The tree::

    BulletinError                       base of everything below
    ├── ConfigError                     no cluster configured, or a malformed client.toml
    ├── SerializationError              the call (or its result) cannot be (un)pickled
    │   ├── UntrustedResult             the result was made by another user's code: not
    │   │                               unpickled unless trusted (Call.result(trust=...))
    │   └── StateTooLarge               the call (or what it sends back) is over the
    │                                   cluster's max_state_bytes; names its biggest parts
    ├── ResultTimeout                   Call.result(timeout=...) ran out; the call keeps running
    │                                   (also a builtin TimeoutError)
    ├── GatewayError                    the gateway answered with an error   .status, .detail
    │   ├── AuthError                   401/403: wrong or expired token
    │   ├── NotFoundError               404: no such invocation or blob (or not yours)
    │   ├── InvalidRequest              400/413/415/422: the gateway refused the request
    │   ├── RateLimited                 429 until the retry deadline: over the per-user rate
    │   │                               limit (.retry_after)
    │   └── GatewayUnreachable          transport errors or 502/503/504 after retrying
    ├── RemoteError                     the remote call failed   .error_type, .remote_traceback
    │   ├── NodeLostError               its node died and no retries were left
    │   ├── WorkerDiedError             the worker process crashed mid-call (a fatal signal,
    │   │                               or the process exited) without leaving a result
    │   ├── OutOfMemoryError            the call went over its node's memory limit per call
    │   └── VersionSkewError            notebook and node cannot exchange pickles
    ├── CallCancelled                   the call was cancelled
    └── CallTimedOut                    the call ran past its ``timeout``

    StateSyncWarning                    a warning (a UserWarning, issued, not raised): a
                                        global the call changed could not be brought back,
                                        or the notebook changed it too meanwhile

Errors about one invocation carry ``.invocation_id``. An exception raised by the user's own
function is re-raised with its original type, not wrapped; it gets ``.remote_traceback`` and a
note with the remote traceback. Only when it cannot be unpickled here does it become a
``RemoteError``.
"""

from __future__ import annotations


class BulletinError(Exception):
    """Base class of every error the sdk raises."""


class ConfigError(BulletinError):
    """No cluster is configured, or the configuration is malformed."""


class SerializationError(BulletinError):
    """A call could not be pickled here, or its result could not be unpickled here."""

    def __init__(self, message: str, *, invocation_id: str | None = None) -> None:
        super().__init__(message)
        self.invocation_id = invocation_id


class UntrustedResult(SerializationError):
    """The result was made by another user's code (their registered function, or their own
    call read by an administrator). Unpickling it would run code they chose in this process,
    so it is loaded only with ``Call.result(trust=<their user name>)``. ``code_owner`` is
    that user."""

    def __init__(self, message: str, *, invocation_id: str, code_owner: str) -> None:
        super().__init__(message, invocation_id=invocation_id)
        self.code_owner = code_owner


class StateTooLarge(SerializationError):
    """A call (or what it sends back) is over the cluster's size limit (``max_state_bytes``);
    the message names its biggest parts."""


class StateSyncWarning(UserWarning):
    """A global the call changed could not be brought back, or the notebook changed it too
    while the call ran (the notebook's value was kept)."""


class ResultTimeout(BulletinError, TimeoutError):
    """``Call.result(timeout=...)`` gave up waiting. The remote call keeps running."""

    def __init__(self, message: str, *, invocation_id: str | None = None) -> None:
        super().__init__(message)
        self.invocation_id = invocation_id


class GatewayError(BulletinError):
    """The gateway answered with an error status."""

    def __init__(self, message: str, *, status: int | None = None, detail: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail


class AuthError(GatewayError):
    """The gateway rejected the token (401/403)."""


class NotFoundError(GatewayError):
    """The object does not exist, or belongs to another user (404)."""


class InvalidRequest(GatewayError):
    """The gateway refused the request as malformed or too large (400/413/415/422)."""


class RateLimited(GatewayError):
    """The gateway kept answering 429 (this user is over its rate limit) until the retry
    deadline. ``retry_after``: the seconds its last answer asked to wait."""

    def __init__(
        self, message: str, *, status: int | None = 429, detail: str = "", retry_after: float = 0
    ) -> None:
        super().__init__(message, status=status, detail=detail)
        self.retry_after = retry_after


class GatewayUnreachable(GatewayError):
    """The gateway could not be reached, or stayed unavailable, until the retry deadline."""


class RemoteError(BulletinError):
    """A remote call failed and its exception cannot be re-raised as itself."""

    def __init__(
        self,
        message: str,
        *,
        invocation_id: str | None = None,
        error_type: str | None = None,
        remote_traceback: str | None = None,
    ) -> None:
        super().__init__(message)
        self.invocation_id = invocation_id
        self.error_type = error_type
        self.remote_traceback = remote_traceback


class NodeLostError(RemoteError):
    """The node running the call was lost and no retries were left."""


class WorkerDiedError(RemoteError):
    """The worker process exited mid-call without leaving a result: killed by a signal
    (a segfault in native code, say) or exited (``os._exit``). The node replaces the worker."""


class OutOfMemoryError(RemoteError):
    """The call went over its node's memory limit per call (the nodelet's
    ``memory_limit_mb``) and was killed, or raised ``MemoryError`` under it. The message
    names the limit and how the node enforces it."""


class VersionSkewError(RemoteError):
    """The notebook and the worker run Python, cloudpickle or torch versions that cannot
    exchange pickles; detected before anything is unpickled. The message says what to align."""


class CallCancelled(BulletinError):
    """The call was cancelled before it finished."""

    def __init__(self, message: str, *, invocation_id: str | None = None) -> None:
        super().__init__(message)
        self.invocation_id = invocation_id


class CallTimedOut(BulletinError):
    """The call ran longer than the ``timeout`` it was submitted with."""

    def __init__(self, message: str, *, invocation_id: str | None = None) -> None:
        super().__init__(message)
        self.invocation_id = invocation_id
