"""Every message that crosses a process boundary, and nothing else.

This module is the single definition of Bulletin's wire format: the sdk, the gateway, the
nodelet and the worker process all import it, none redefines a message. It imports nothing
else of ours. Messages evolve by appending fields with defaults; the nodelet sends
``PROTOCOL_VERSION`` and the gateway accepts ``MIN_PROTOCOL_VERSION`` and newer.

Bytes fields (payloads, results, log data) are opaque: the gateway and nodelet never unpickle
them. In JSON they travel base64-encoded (msgspec's default for ``bytes``).
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal

import msgspec

PROTOCOL_VERSION = 1
MIN_PROTOCOL_VERSION = 1

#: Media type of the raw bodies of blob uploads and downloads.
OCTET_STREAM = "application/octet-stream"


# Constrained types for what clients send: values PostgreSQL can store (int4, text without
# NUL bytes, uuid), rejected with a 422 at decoding rather than failing deep in the database.
Int32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]
Text = Annotated[str, msgspec.Meta(pattern="^[^\\x00]*$")]
Name = Annotated[str, msgspec.Meta(pattern="^[^\\x00]*$", max_length=200)]
Id = Annotated[
    str,
    msgspec.Meta(
        pattern="^[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}$"
    ),
]


class State(enum.StrEnum):
    """Invocation states. The last four are terminal and absorbing."""

    QUEUED = "queued"
    ASSIGNED = "assigned"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({State.SUCCEEDED, State.FAILED, State.TIMED_OUT, State.CANCELLED})


class ErrorKind(enum.StrEnum):
    """Why an invocation failed."""

    USER = "user_error"  # the user's function raised
    NODE_LOST = "node_lost"  # lease expired and no retries were left
    WORKER_DIED = "worker_died"  # the worker process exited without a result
    BAD_PAYLOAD = "bad_payload"  # the worker could not unpickle the call


class Stream(enum.IntEnum):
    STDOUT = 1
    STDERR = 2


class _Msg(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    pass


# ---------------------------------------------------------------- user side (sdk <-> gateway)


class CallSpec(_Msg, frozen=True, kw_only=True):
    """One call to submit. ``payload`` xor ``payload_blob`` carries the pickled call."""

    idempotency_key: Name = ""
    function_name: Name = ""
    gpus: Int32 = 0
    max_retries: Int32 = 2
    timeout_s: float | None = None
    payload: bytes | None = None
    payload_blob: Id | None = None


class SubmitRequest(_Msg, frozen=True, kw_only=True):
    calls: list[CallSpec]


class SubmitResponse(_Msg, frozen=True, kw_only=True):
    ids: list[str]


class Timeline(_Msg, frozen=True, kw_only=True):
    """When each step of an invocation happened (seconds since the epoch, DB clock)."""

    submitted: float | None = None
    scheduled: float | None = None
    delivered: float | None = None
    started: float | None = None
    finished: float | None = None


class Invocation(_Msg, frozen=True, kw_only=True):
    """What a user may know of one invocation."""

    id: str
    state: State
    function_name: str = ""
    gpus: int = 0
    attempts: int = 0
    max_retries: int = 0
    node: str | None = None
    error_kind: ErrorKind | None = None
    error_type: str | None = None
    error_message: str | None = None
    traceback: str | None = None
    # Present only on terminal invocations; result_blob when the result was too big to inline.
    result: bytes | None = None
    result_blob: str | None = None
    log_count: int = 0
    timeline: Timeline = msgspec.field(default_factory=Timeline)


class WatchItem(_Msg, frozen=True, kw_only=True):
    id: Id
    log_after: Int32 = 0  # number of log chunks the caller has already seen


class WatchRequest(_Msg, frozen=True, kw_only=True):
    """Long-poll for news on up to ``MAX_WATCH`` invocations.

    Returns at once when any item has new log chunks or is terminal, else waits up to
    ``timeout_s`` (capped by the gateway) and returns whatever there is then.
    """

    items: list[WatchItem]
    timeout_s: float = 10.0


class LogChunk(_Msg, frozen=True, kw_only=True):
    invocation_id: str
    n: int  # 1-based position in the invocation's log
    stream: Stream
    data: bytes


class WatchResponse(_Msg, frozen=True, kw_only=True):
    # Invocations that changed: terminal ones carry their result.
    invocations: list[Invocation]
    logs: list[LogChunk]


class CancelRequest(_Msg, frozen=True, kw_only=True):
    """Cancel up to ``MAX_WATCH`` invocations at once (e.g. the rest of an interrupted map)."""

    ids: list[Id]


class CancelResponse(_Msg, frozen=True, kw_only=True):
    # The ids this request cancelled; finished, unknown and others' ids are left out.
    cancelled: list[str]


class BlobRef(_Msg, frozen=True, kw_only=True):
    id: str
    size: int


class Problem(_Msg, frozen=True, kw_only=True):
    """RFC 9457 problem details, the one error shape of every 4xx/5xx answer."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str = ""
    code: str = ""


# ---------------------------------------------------------------- node side (nodelet <-> gateway)


class GpuInfo(_Msg, frozen=True, kw_only=True):
    index: Int32
    uuid: Name
    name: Name
    memory_mb: int
    fake: bool = False


class RegisterRequest(_Msg, frozen=True, kw_only=True):
    name: Name
    gpus: list[GpuInfo]
    cpu_slots: Int32
    protocol_version: Int32 = PROTOCOL_VERSION


class RegisterResponse(_Msg, frozen=True, kw_only=True):
    node_id: int
    lease_s: float
    heartbeat_s: float
    long_poll_s: float
    inline_limit: int


class Attempt(_Msg, frozen=True, kw_only=True):
    """An invocation attempt the node holds: fenced by ``epoch``."""

    invocation_id: Id
    epoch: Int32


class Assignment(_Msg, frozen=True, kw_only=True):
    """Work leased to a node. The payload is inline or fetched from the payload route."""

    invocation_id: str
    epoch: int
    gpu_indices: list[int]
    timeout_s: float | None = None
    payload: bytes | None = None
    payload_size: int = 0
    function_name: str = ""
    # Whose call this is: warm workers are reused only for the same owner and GPU set.
    owner: str = ""


class HeartbeatRequest(_Msg, frozen=True, kw_only=True):
    """Renews the node's liveness and the leases of the attempts it still runs."""

    running: list[Attempt]


class HeartbeatResponse(_Msg, frozen=True, kw_only=True):
    # Attempts the node must stop: cancelled, reassigned or no longer leased to it.
    revoked: list[Attempt]
    lease_s: float


class PollRequest(_Msg, frozen=True, kw_only=True):
    running: list[Attempt]
    timeout_s: float = 20.0


class PollResponse(_Msg, frozen=True, kw_only=True):
    assignments: list[Assignment]
    revoked: list[Attempt]


class StartRequest(_Msg, frozen=True, kw_only=True):
    epoch: Int32


class ReleaseRequest(_Msg, frozen=True, kw_only=True):
    """Hand an attempt back unrun-to-the-end (the nodelet is stopping): the call is queued
    again at once and the attempt does not count against its retries."""

    epoch: Int32


class NodeLogChunk(_Msg, frozen=True, kw_only=True):
    stream: Stream
    data: bytes


class LogsRequest(_Msg, frozen=True, kw_only=True):
    """Log chunks of one attempt. ``first_seq`` numbers the first chunk of this batch within
    the attempt (from 0), so a retried request never appends a chunk twice."""

    epoch: Int32
    first_seq: Int32
    chunks: list[NodeLogChunk]


class CompleteRequest(_Msg, frozen=True, kw_only=True):
    epoch: Int32
    state: Literal["succeeded", "failed", "timed_out", "cancelled"]
    error_kind: ErrorKind | None = None
    error_type: Text | None = None
    error_message: Text | None = None
    traceback: Text | None = None
    result: bytes | None = None
    result_blob: Id | None = None


# ------------------------------------------------------------- worker process (nodelet <-> worker)


class WorkerTask(_Msg, frozen=True, kw_only=True):
    """What the nodelet hands a worker process on its stdin (msgpack, length-prefixed)."""

    invocation_id: str
    payload: bytes
    result_path: str
    gpu_indices: list[int] = msgspec.field(default_factory=list)
    env: dict[str, str] = msgspec.field(default_factory=dict)
    # Written to stdout and stderr after the call, so the nodelet knows where its output ends
    # and may hand the worker another call. Empty: run this one call and exit.
    end_marker: bytes = b""


class WorkerOutcome(_Msg, frozen=True, kw_only=True):
    """What the worker leaves at ``result_path`` (msgpack). ``result`` is the pickled return
    value on success and the pickled exception on failure (None when it could not be pickled)."""

    ok: bool
    result: bytes | None = None
    error_kind: ErrorKind | None = None
    error_type: str | None = None
    error_message: str | None = None
    traceback: str | None = None


class ClientConfig(_Msg, frozen=True, kw_only=True):
    """The client config file (``client.toml``) that ``bulletin up`` writes."""

    url: str
    token: str


MAX_WATCH = 1000
MAX_SUBMIT = 1000
