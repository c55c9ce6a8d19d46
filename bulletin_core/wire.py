"""Every message that crosses a process boundary, and nothing else.

This module is the single definition of Bulletin's wire format: the sdk, the gateway, the
nodelet and the worker process all import it, none redefines a message. It imports nothing
else of ours. Messages evolve by appending fields with defaults; the nodelet sends
``PROTOCOL_VERSION`` and the gateway accepts ``MIN_PROTOCOL_VERSION`` and newer. Requests
refuse fields they do not have, answers ignore them (``_Request`` and ``_Msg``, below).

Bytes fields (payloads, results, log data) are opaque: the gateway and nodelet never unpickle
them. In JSON they travel base64-encoded (msgspec's default for ``bytes``).
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

import msgspec

# 2: the nodelet acts on Preemption orders; 3: JSON arguments; 4: calls run as their owner
# (single-tenant nodes refuse untrusted users) and shared files live in per-user directories,
# bound to their invocation. Older nodelets are refused: they ran every mapped call as root.
# 5: node incarnations: every start of a nodelet registers anew and names its incarnation in
# every later request (INCARNATION_HEADER); an earlier incarnation's requests are refused.
# 6: calls asking for part of a GPU (Assignment.gpu_share) run beside each other on it, their
# CUDA memory capped; a nodelet before 6 runs them one after another on their GPU, uncapped.
PROTOCOL_VERSION = 6
MIN_PROTOCOL_VERSION = 5

#: The header in which a nodelet names its incarnation (RegisterResponse.incarnation) on
#: every node route after registering.
INCARNATION_HEADER = "Bulletin-Incarnation"

#: Media type of the raw bodies of blob uploads and downloads.
OCTET_STREAM = "application/octet-stream"


# Constrained types for what clients send: values PostgreSQL can store (int4, text without
# NUL bytes, uuid), rejected with a 422 at decoding rather than failing deep in the database.
# The constraints and descriptions (msgspec.Meta) of the Structs' fields are the one statement
# of each rule: decoding enforces them, openapi.yaml publishes them (scripts/openapi.py
# generates its schemas), and the gateway's 422 quotes a field's description, so a
# description says the rule in words. Rules across fields (exactly one of the payloads) and
# rules that depend on the cluster or the caller (the inline limit, an administrator's
# priority) are checked by the gateway's routes.
Int32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]
#: A count or a position: 0 or more, and an int4.
Count = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
#: A size in bytes, small enough that the database can add many of them up.
ByteSize = Annotated[int, msgspec.Meta(ge=0, le=2**62, description="A size in bytes: 0 or more.")]
#: A time as seconds since the epoch that PostgreSQL can store (no NaN, no infinity).
Epoch = Annotated[
    float,
    msgspec.Meta(ge=0, le=1e11, description="A time in seconds since the epoch (0 to 1e11)."),
]
Text = Annotated[str, msgspec.Meta(pattern="^[^\\x00]*$")]
Name = Annotated[str, msgspec.Meta(pattern="^[^\\x00]*$", max_length=200)]
Id = Annotated[
    str,
    msgspec.Meta(
        pattern="^[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}$",
        description="A UUID (32 hex digits; the hyphens are optional).",
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
    VERSION_SKEW = "version_skew"  # caller and worker run incompatible Python/cloudpickle/torch
    OUT_OF_MEMORY = "out_of_memory"  # killed at the call's memory limit
    WORKER_CRASHED = "worker_crashed"  # the worker died by a signal or os._exit mid-call
    NOT_PERMITTED = "not_permitted"  # the node may not run the owner's calls (no account)


#: WorkerOutcome.error_type of a call that failed without raising: what it returned (or its
#: outcome) could not be sent back. The sdk then has no exception object to re-raise.
RESULT_ERROR = "ResultError"


class Stream(enum.IntEnum):
    STDOUT = 1
    STDERR = 2


# Requests are strict, answers tolerant.
#
# A _Request is a message a process decodes from a client that asks it to act: the gateway
# from the sdk, curl and nodelets; a worker from its nodelet; the nodelet from a worker,
# which ran user code and may have written its outcome itself. A field the message does not
# have is refused (by the gateway with a 422 `unknown_field` that names it), never ignored:
# a misspelt option (`gpuz`) or a newer client's field that a gateway dropped would run the
# call without what was asked, and nobody would know. Versions are agreed, not guessed:
# nodelets name their PROTOCOL_VERSION, and a field added to a user request must be known to
# the gateways before any sdk sends it (the sdk sends every field, defaults included:
# upgrade the gateways first).
#
# Everything else is a _Msg, decoded tolerantly: answers above all. The sdk and the nodelet
# ignore fields of an answer they do not know, so a gateway may add fields to its answers
# without breaking the sdks installed in notebooks, which name no version. A Struct that a
# request and an answer both carry is therefore declared twice: FunctionResources (strict,
# in FunctionRegistration) is a FunctionResourcesInfo (tolerant, in FunctionInfo). One is
# not: Attempt, the fencing token a nodelet sends and gets back (HeartbeatResponse.revoked),
# is strict both ways, so a field added to it is a new protocol version, sent only to
# nodelets of that version. PickleHeader heads envelopes both ways (a call from the sdk, its
# result back to it) and is tolerant like an answer: a newer worker's result must load in
# an older sdk. ClientConfig is a file, read tolerantly so that a newer `bulletin up`'s
# client.toml still loads. (The gateway stores GpuInfo, GpuHealthReport and WarmWorker as
# JSON and reads them back with these strict Structs: a gateway older than the one that
# wrote them refuses a field it does not know, so replicas upgrade together.)
class _Msg(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """An answer (or a record): fields it does not know are ignored."""


class _Request(_Msg, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A request: refused when it has a field it does not know (see above)."""


# ---------------------------------------------------------------- user side (sdk <-> gateway)

#: The most calls one SubmitRequest may carry, and invocations one watch or cancel may name.
MAX_SUBMIT = 1000
MAX_WATCH = 1000
#: The most outcomes one CompleteManyRequest may carry.
MAX_COMPLETE = 256
MAX_RETRIES = 10

#: A name that is also a path segment (users, groups, registered functions).
SLUG = "[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
#: Slug's rule, in words for error messages.
SLUG_RULE = "use letters, digits, '.', '_' and '-' (at most 64, starting with a letter or digit)"
Slug = Annotated[str, msgspec.Meta(pattern=f"^{SLUG}$", description=f"A name: {SLUG_RULE}.")]
#: A group's name: also a path segment of the admin API.
GroupName = Slug
#: A registered function's name: also a path segment.
FunctionName = Slug
#: Paths inside the cluster's shared directory (the NAS) that calls may name, relative to
#: its root: payload files written by the owner's sdk and result files written by the
#: owner's worker, each in its owner's directory (bulletin_core/shared.py).
_STEM = "[A-Za-z0-9_-]{1,100}"
SHARED_FILE = rf"^bulletin/users/(?P<user>{SLUG})/(?P<kind>payload|result)-(?P<stem>{_STEM})\.bin$"
SharedPayload = Annotated[
    str, msgspec.Meta(pattern=rf"^bulletin/users/{SLUG}/payload-{_STEM}\.bin$")
]
SharedResult = Annotated[str, msgspec.Meta(pattern=rf"^bulletin/users/{SLUG}/result-{_STEM}\.bin$")]

# What a call asks for, as the gateway takes it: CallSpec, and FunctionResources for every
# invocation of a registered function.
GpuCount = Annotated[
    int,
    msgspec.Meta(
        ge=0,
        le=2**31 - 1,
        description="The number of GPUs the call needs: 0 (CPU only) or more.",
    ),
]
#: The least part of a GPU a call may ask for: at most 20 calls share one GPU (each is a
#: process on the node; a flood of tiny parts must not fill a node with processes).
MIN_GPU_SHARE = 0.05
GpuShare = Annotated[
    float,
    msgspec.Meta(
        ge=MIN_GPU_SHARE, lt=1, description="Part of one GPU: 0.05 or more, below 1 (0.25)."
    ),
]
GpuAmount = Annotated[
    GpuCount | GpuShare,
    msgspec.Meta(
        description=(
            "The GPUs the call needs: a whole number (0: CPU only), or part of one GPU, a "
            "number from 0.05 to below 1 (0.25: a quarter of one), which the call shares with "
            "other such calls of its user (of any user where the cluster allows it), its "
            "CUDA memory capped at that part (`docs/scheduling.md`)."
        )
    ),
]


def split_gpus(amount: float) -> tuple[int, float]:
    """``(gpus, share)`` for a ``GpuAmount``: whole GPUs with share 1, or part of one GPU."""
    if isinstance(amount, int) or amount >= 1:
        return int(amount), 1.0
    return 1, float(amount)


def gpu_amount(gpus: int, share: float) -> int | float:
    """The ``GpuAmount`` of ``gpus`` GPUs, ``share`` of each (``split_gpus``'s inverse)."""
    return gpus if share >= 1 else share
Retries = Annotated[
    int,
    msgspec.Meta(
        ge=0,
        le=MAX_RETRIES,
        description=(
            "How often the call may run again when its infrastructure failed (its node was "
            f"lost, its worker died): 0 to {MAX_RETRIES}. An exception the call raised is "
            "never retried."
        ),
    ),
]
#: A positive number of seconds.
Seconds = Annotated[float, msgspec.Meta(gt=0, le=1e9)]
TimeLimit = Annotated[
    Seconds | None,
    msgspec.Meta(
        description=(
            "The call's time limit in seconds, more than 0 and at most 1e9 (a call still "
            "running then ends `timed_out`); null: no limit."
        )
    ),
]
ExpectedSeconds = Annotated[
    Seconds | None,
    msgspec.Meta(
        description=(
            "How long the call is expected to run, in seconds (more than 0, at most 1e9): "
            "lets FIFO backfill past it. Null: its time limit (`timeout_s`) is used."
        )
    ),
]
Priority = Annotated[
    int,
    msgspec.Meta(
        ge=-1000,
        le=1000,
        description=(
            "Higher goes first, before fair share: -1000 to 1000. Users may only lower it "
            "(below 0, to let others go first, like SLURM's nice); administrators may raise it."
        ),
    ),
]
#: One GPU model to match: part of a GPU model name.
ONE_GPU_MODEL = "[A-Za-z0-9 _.-]{1,64}"
#: Most models one call may accept.
MAX_GPU_MODELS = 8
#: What a GpuModel is: one model, or up to MAX_GPU_MODELS separated by '|' (any of them).
GPU_MODEL = f"^{ONE_GPU_MODEL}(\\|{ONE_GPU_MODEL}){{0,{MAX_GPU_MODELS - 1}}}$"
#: A GPU model name to match, as NVML reports it ("NVIDIA A100-SXM4-80GB" matches "A100").
GpuModel = Annotated[
    Annotated[str, msgspec.Meta(pattern=GPU_MODEL)] | None,
    msgspec.Meta(
        description=(
            "Only GPUs whose model name contains this (case-insensitive), e.g. `A100`: 1 to 64 "
            "letters, digits, spaces, '.', '_' and '-'. Several models separated by '|' "
            "(`A100|H100`, at most 8) accept any of them: each of the call's GPUs is one of "
            "them. Null: any model."
        )
    ),
]
GpuMemory = Annotated[
    Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)] | None,
    msgspec.Meta(
        description="Only GPUs with at least this much memory, in MiB (0 or more). Null: any."
    ),
]


class CallSpec(_Request, frozen=True, kw_only=True):
    """One call to submit. Exactly one of ``payload`` (inline), ``payload_blob`` (uploaded
    first) and ``payload_file`` (written to the shared directory, relative to its root)
    carries the pickled call (an envelope: ``bulletin_core/pickling/envelope.py``)."""

    idempotency_key: Annotated[
        Name,
        msgspec.Meta(
            description=(
                "Submission is exactly-once per key per user: a call whose key this user "
                "already submitted is not queued again, and answers that invocation's id. At "
                "most 200 characters, distinct within one request; empty: the gateway makes "
                "one up (so a retry cannot be recognised)."
            )
        ),
    ] = ""
    function_name: Annotated[
        Name,
        msgspec.Meta(
            description=(
                "The function the call runs, as listings show it (the sdk sends its qualified "
                "name; warm workers are kept per function): at most 200 characters."
            )
        ),
    ] = ""
    gpus: GpuAmount = 0
    max_retries: Retries = 2
    timeout_s: TimeLimit = None
    payload: Annotated[
        bytes | None,
        msgspec.Meta(
            description=(
                "The pickled call, inline: at most the cluster's inline limit "
                "(`ClusterInfo.inline_limit`); upload a bigger one as a blob."
            )
        ),
    ] = None
    payload_blob: Annotated[
        Id | None,
        msgspec.Meta(
            description=(
                "The id of a complete blob of the caller's (`PUT /v1/blobs`) that holds the "
                "pickled call."
            )
        ),
    ] = None
    payload_file: Annotated[
        SharedPayload | None,
        msgspec.Meta(
            description=(
                "A file in the caller's own directory of the cluster's shared directory that "
                "holds the pickled call, relative to its root: "
                "`bulletin/users/<user>/payload-<name>.bin`, `<user>` being `ClusterInfo.user` "
                "and `<name>` 1 to 100 letters, digits, '_' and '-'."
            )
        ),
    ] = None
    priority: Priority = 0
    gpu_model: GpuModel = None
    gpu_memory_mb: GpuMemory = None
    expected_s: ExpectedSeconds = None
    payload_size: Annotated[
        ByteSize,
        msgspec.Meta(
            description=(
                "With `payload_file`: its size in bytes (0 or more), which counts towards the "
                "owner's storage limit while the call may run (the gateway cannot read the "
                "owner's directory)."
            )
        ),
    ] = 0
    caller_session: Annotated[
        Id | None,
        msgspec.Meta(
            description=(
                "The caller session waiting for this call (an sdk's blocking call or `map` "
                "item): it keeps it alive (`POST /v1/sessions/{id}/keepalive`), and when it has "
                "not for the gateway's `caller_timeout_s` the call is cancelled, freeing its "
                "GPU. Null: detached (`spawn`, plain HTTP): the call runs whether anyone waits "
                "for it or not."
            )
        ),
    ] = None


class SubmitRequest(_Request, frozen=True, kw_only=True):
    calls: Annotated[
        list[CallSpec],
        msgspec.Meta(
            min_length=1,
            max_length=MAX_SUBMIT,
            description=f"The calls to queue: 1 to {MAX_SUBMIT} per request.",
        ),
    ]
    map_id: Annotated[
        Id | None,
        msgspec.Meta(
            description=(
                "The calls are items of one map (the sdk's `Function.map` sends one random id "
                "with every batch of a map): they must ask for the same resources and "
                "priority. While nothing else waits, a node that finishes an item of a map is "
                "given its next items at once, in the answer to that completion, instead of "
                "waiting for the scheduler; each item stays an invocation of its own."
            )
        ),
    ] = None


class SubmitResponse(_Msg, frozen=True, kw_only=True):
    ids: Annotated[
        list[str], msgspec.Meta(description="The invocation ids, one per call, in input order.")
    ]
    keepalive_s: Annotated[
        float | None,
        msgspec.Meta(
            description=(
                "How often a caller session must keep its calls alive (seconds); null when "
                "the gateway cancels no call for want of its caller."
            )
        ),
    ] = None
    invocations: Annotated[
        list[Invocation],
        msgspec.Meta(
            description=(
                "With `?wait=`: the calls that finished (with their results) or logged while "
                "the request waited, as a watch answers; empty without."
            )
        ),
    ] = msgspec.field(default_factory=list)
    logs: Annotated[
        list[LogChunk],
        msgspec.Meta(description="With `?wait=`: their log chunks so far, in order."),
    ] = msgspec.field(default_factory=list)


#: A time in seconds since the epoch that an answer reports, None where not reached.
_When = float | None


class Timeline(_Msg, frozen=True, kw_only=True):
    """When each step of an invocation's last attempt happened, in seconds since the epoch;
    None where not reached. ``worker_acquired``, ``started`` and ``finished`` are the node's
    clock, the rest the database's."""

    submitted: _When = None
    scheduled: _When = None
    delivered: Annotated[_When, msgspec.Meta(description="The node took the assignment.")] = None
    worker_acquired: Annotated[
        _When, msgspec.Meta(description="The node had a worker process for it.")
    ] = None
    started: Annotated[_When, msgspec.Meta(description="The user's code started.")] = None
    finished: Annotated[
        _When, msgspec.Meta(description="The user's code returned or raised.")
    ] = None
    stored: Annotated[
        _When,
        msgspec.Meta(description="The outcome was committed (the call became terminal)."),
    ] = None
    fetched: Annotated[
        _When, msgspec.Meta(description="The caller first fetched the terminal invocation.")
    ] = None
    warm: Annotated[
        bool | None,
        msgspec.Meta(
            description=(
                "Whether the worker was already running when the call arrived (a spare or a "
                "worker kept warm from an earlier call); false: a process was started for it."
            )
        ),
    ] = None


class Invocation(_Msg, frozen=True, kw_only=True):
    """What a user may know of one invocation."""

    id: str
    state: State
    function_name: str = ""
    gpus: Annotated[
        int | float, msgspec.Meta(description="Whole GPUs, or part of one GPU (below 1).")
    ] = 0
    attempts: Annotated[
        int, msgspec.Meta(description="Attempts counted against its retries (node assignments).")
    ] = 0
    max_retries: int = 0
    node: Annotated[
        str | None, msgspec.Meta(description="The node of its last attempt.")
    ] = None
    error_kind: ErrorKind | None = None
    error_type: str | None = None
    error_message: str | None = None
    traceback: str | None = None
    result: Annotated[
        bytes | None,
        msgspec.Meta(
            description=(
                "Terminal invocations: the pickled result, inline (else in `result_blob` or "
                "`result_file`)."
            )
        ),
    ] = None
    result_blob: Annotated[
        str | None,
        msgspec.Meta(description="The blob holding a result too big to inline."),
    ] = None
    result_file: Annotated[
        str | None,
        msgspec.Meta(
            description=(
                "The file of the shared directory (relative to its root) holding a result too "
                "big to inline."
            )
        ),
    ] = None
    log_count: Annotated[int, msgspec.Meta(description="How many log chunks it has.")] = 0
    timeline: Timeline = msgspec.field(default_factory=Timeline)
    priority: int = 0
    preemptions: Annotated[
        int,
        msgspec.Meta(
            description=(
                "How often the call was preempted (stopped and queued again for a group's "
                "guarantee)."
            )
        ),
    ] = 0
    preempt_reason: Annotated[
        str | None, msgspec.Meta(description="Why it was preempted the last time.")
    ] = None
    queue_position: Annotated[
        int | None,
        msgspec.Meta(
            description=(
                "While queued: its place in the scheduler's order (1 is next), as of the last "
                "scheduling round that looked at it; null before one has."
            )
        ),
    ] = None
    wait_reason: Annotated[
        str | None,
        msgspec.Meta(
            description=(
                "While queued: why it waits, as of the last scheduling round that looked at "
                "it; null before one has."
            )
        ),
    ] = None
    function_version: Annotated[
        str | None, msgspec.Meta(description="Registered functions: the version that ran.")
    ] = None
    result_json: Annotated[
        Any,
        msgspec.Meta(
            description=(
                "JSON invocations (`POST /v1/functions/{name}/invoke`) once they succeeded: "
                "the value the function returned, as JSON. When it is not JSON-serialisable, "
                "`result_json_error` says why, and the pickled result is still in `result` / "
                "`result_blob` (also at `GET /v1/invocations/{id}/result`)."
            )
        ),
    ] = None
    result_json_error: str | None = None
    code_owner: Annotated[
        str | None,
        msgspec.Meta(
            description=(
                "Whose code made the result: the owner of the registered function that ran "
                "(null when not known), else the invocation's owner. Unpickling a result runs "
                "code its maker chose, so the sdk loads one made by another user's code only "
                "when told to trust them."
            )
        ),
    ] = None


_GpuLimit = Annotated[int, msgspec.Meta(ge=0, le=1_000_000)]


#: The most GPU models one group may have quotas for.
MAX_QUOTA_MODELS = 32
#: A GPU model a group's quota names: one model, as a call's ``gpu_model`` names one.
QuotaModel = Annotated[
    str,
    msgspec.Meta(
        pattern=f"^{ONE_GPU_MODEL}$",
        description="A GPU model: 1 to 64 letters, digits, spaces, '.', '_' and '-'.",
    ),
]


class ModelQuota(_Request, frozen=True, kw_only=True):
    """A group's quota for its GPUs of one model: how many it can always get back, and how
    many more it may borrow while they are idle (None: no limit)."""

    guaranteed_gpus: Annotated[
        _GpuLimit,
        msgspec.Meta(
            description=(
                "GPUs of the model the group can always get back, preempting other groups' "
                "borrowed work: 0 to 1000000."
            )
        ),
    ] = 0
    borrow_limit_gpus: Annotated[
        _GpuLimit | None,
        msgspec.Meta(
            description=(
                "How many more of them it may borrow while others leave them idle: 0 to "
                "1000000; null: no limit."
            )
        ),
    ] = None


class GroupQuota(_Request, frozen=True, kw_only=True):
    """A group's quota: GPUs it can always get back (preempting other groups' borrowed
    work), and how many more it may borrow while they are idle (None: no limit)."""

    guaranteed_gpus: Annotated[
        _GpuLimit,
        msgspec.Meta(
            description=(
                "GPUs the group can always get back, preempting other groups' borrowed work: "
                "0 to 1000000."
            )
        ),
    ] = 0
    borrow_limit_gpus: Annotated[
        _GpuLimit | None,
        msgspec.Meta(
            description=(
                "How many more GPUs it may borrow while others leave them idle: 0 to 1000000; "
                "null: no limit."
            )
        ),
    ] = None
    models: Annotated[
        Annotated[dict[QuotaModel, ModelQuota], msgspec.Meta(max_length=MAX_QUOTA_MODELS)]
        | None,
        msgspec.Meta(
            description=(
                "Quotas for the group's GPUs of some models, by model (at most 32): a GPU "
                "counts against the longest one that is part of its model name "
                "(case-insensitive, as `gpu_model` matches), as well as against the group's "
                "quota. The group holds at most guarantee + borrowing limit of that model's "
                "GPUs; those above the guarantee are borrowed, and another group may reclaim "
                "them. Given, it replaces the group's quotas per model ({} removes them all); "
                "left out or null, they stay as they are."
            ),
        ),
    ] = None


class Group(_Msg, frozen=True, kw_only=True):
    name: str
    guaranteed_gpus: int
    borrow_limit_gpus: int | None
    users: Annotated[int, msgspec.Meta(description="How many users are in the group.")]
    models: Annotated[
        dict[str, ModelQuota],
        msgspec.Meta(description="Its quotas per GPU model, by model ({}: none)."),
    ] = msgspec.field(default_factory=dict)


class UserGroup(_Request, frozen=True, kw_only=True):
    group: Annotated[
        GroupName,
        msgspec.Meta(description=f"The group to put the user in (it must exist): {SLUG_RULE}."),
    ]


class UsageEntry(_Msg, frozen=True, kw_only=True):
    """GPU-seconds one user used in one group over the period asked for, and the calls of
    theirs that ended in it."""

    user: str
    group: str
    gpu_seconds: float
    calls: int


#: A registered function's version: the first 16 hex digits of a SHA-256 of its content.
FunctionVersion = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{16}$")]
#: Who may see and invoke a registered function besides its owner.
Visibility = Literal["private", "group", "cluster"]


class FunctionResourcesInfo(_Msg, frozen=True, kw_only=True):
    """What every invocation of a registered function asks for (as ``CallSpec``), as the
    gateway reports it (``FunctionInfo``)."""

    gpus: GpuAmount = 0
    gpu_model: GpuModel = None
    gpu_memory_mb: GpuMemory = None
    timeout_s: TimeLimit = None
    max_retries: Retries = 2
    expected_s: ExpectedSeconds = None


class FunctionResources(
    FunctionResourcesInfo, frozen=True, kw_only=True, forbid_unknown_fields=True
):
    """What every invocation of a registered function asks for (as ``CallSpec``), as its
    registration sends it: the fields of ``FunctionResourcesInfo``, in a request (so a field
    it does not have is refused)."""


class FunctionRegistration(_Request, frozen=True, kw_only=True):
    """Register a function by value: its pickled envelope (``(function, (), {})``, inline or
    uploaded first as a blob) and what its invocations ask for."""

    payload: Annotated[
        bytes | None,
        msgspec.Meta(
            description=(
                "The pickled envelope, inline: at most the cluster's inline limit. Exactly one "
                "of `payload` and `payload_blob`."
            )
        ),
    ] = None
    payload_blob: Annotated[
        Id | None,
        msgspec.Meta(description="The id of a complete blob of the caller's holding it."),
    ] = None
    resources: FunctionResources = msgspec.field(default_factory=FunctionResources)
    visibility: Annotated[
        Visibility,
        msgspec.Meta(
            description=(
                "Who may see and invoke it besides its owner: `private` (nobody), `group` "
                "(the owner's group) or `cluster` (every user)."
            )
        ),
    ] = "private"
    description: Annotated[
        str,
        msgspec.Meta(
            pattern="^[^\\x00]*$",
            max_length=2000,
            description="What the function does, for those who list it: at most 2000 characters.",
        ),
    ] = ""


class FunctionInfo(_Msg, frozen=True, kw_only=True):
    """One version of a registered function."""

    name: str
    version: Annotated[
        str,
        msgspec.Meta(
            description="16 hex digits of the SHA-256 of its envelope and resources."
        ),
    ]
    owner: str
    visibility: Visibility
    description: str
    resources: FunctionResourcesInfo
    payload_size: int
    created: Annotated[
        float,
        msgspec.Meta(
            description="When this version was first registered (seconds since the epoch)."
        ),
    ]
    registered: Annotated[
        float,
        msgspec.Meta(
            description=(
                "When this version was last registered (seconds since the epoch): the latest "
                "version is the one registered last."
            )
        ),
    ]
    latest: Annotated[
        bool,
        msgspec.Meta(
            description="Whether this is the version an invocation without `?version=` runs."
        ),
    ]


class InvokeRequest(_Request, frozen=True, kw_only=True):
    """Plain JSON arguments of an invocation: ``function(*args, **kwargs)``."""

    args: list[Any] = msgspec.field(default_factory=list)
    kwargs: dict[str, Any] = msgspec.field(default_factory=dict)


class WatchItem(_Request, frozen=True, kw_only=True):
    id: Annotated[Id, msgspec.Meta(description="An invocation of the caller's (a UUID).")]
    log_after: Annotated[
        Count,
        msgspec.Meta(
            description=(
                "How many of its log chunks the caller has already seen (0 or more): only "
                "later ones are sent."
            )
        ),
    ] = 0


class WatchRequest(_Request, frozen=True, kw_only=True):
    """Long-poll for news on up to ``MAX_WATCH`` invocations.

    Returns at once when any item has new log chunks or is terminal, else waits up to
    ``timeout_s`` (capped by the gateway) and returns whatever there is then.
    """

    items: Annotated[
        list[WatchItem],
        msgspec.Meta(
            min_length=1,
            max_length=MAX_WATCH,
            description=f"The invocations to watch: 1 to {MAX_WATCH}.",
        ),
    ]
    timeout_s: Annotated[
        float,
        msgspec.Meta(
            description=(
                "How long to wait for news, in seconds: capped by the gateway's `long_poll_s`; "
                "0 or less answers at once."
            )
        ),
    ] = 10.0


class LogChunk(_Msg, frozen=True, kw_only=True):
    invocation_id: str
    n: Annotated[int, msgspec.Meta(description="Its 1-based position in the invocation's log.")]
    stream: Stream
    data: bytes


class WatchResponse(_Msg, frozen=True, kw_only=True):
    invocations: Annotated[
        list[Invocation],
        msgspec.Meta(description="Invocations that changed: terminal ones carry their result."),
    ]
    logs: list[LogChunk]


class LogEvent(_Msg, frozen=True, kw_only=True):
    """The data of one Server-Sent Event of ``GET /v1/invocations/{id}/logs``: a log chunk
    (``n`` is also the event's id), its text decoded as UTF-8."""

    n: int
    stream: Literal["stdout", "stderr"]
    text: str


class LogEnd(_Msg, frozen=True, kw_only=True):
    """The data of the last event (``end``) of a log stream: the invocation is terminal and
    every chunk was sent."""

    state: State
    log_count: int


class CancelRequest(_Request, frozen=True, kw_only=True):
    """Cancel up to ``MAX_WATCH`` invocations at once (e.g. the rest of an interrupted map)."""

    ids: Annotated[
        list[Id],
        msgspec.Meta(
            min_length=1,
            max_length=MAX_WATCH,
            description=f"The invocations to cancel: 1 to {MAX_WATCH}.",
        ),
    ]


class CancelResponse(_Msg, frozen=True, kw_only=True):
    cancelled: Annotated[
        list[str],
        msgspec.Meta(
            description=(
                "The ids this request cancelled; finished, unknown and others' ids are left out."
            )
        ),
    ]


class BlobRef(_Msg, frozen=True, kw_only=True):
    id: str
    size: int


class Problem(_Msg, frozen=True, kw_only=True):
    """RFC 9457 problem details, the one error shape of every 4xx/5xx answer."""

    type: str = "about:blank"
    title: str
    status: int
    detail: Annotated[str, msgspec.Meta(description="What went wrong, and what to do.")] = ""
    code: Annotated[
        str,
        msgspec.Meta(
            description="A machine-readable code a client may branch on (docs/http-api.md)."
        ),
    ] = ""


# ---------------------------------------------------------------- node side (nodelet <-> gateway)


class ClusterInfo(_Msg, frozen=True, kw_only=True):
    """What a client needs to know of the cluster before it sends calls."""

    inline_limit: Annotated[
        int,
        msgspec.Meta(description="Payloads and results up to this size travel inline in JSON."),
    ]
    max_state_bytes: Annotated[
        int,
        msgspec.Meta(
            description=(
                "Largest payload or result (pickled call or returned state) accepted, in bytes."
            )
        ),
    ]
    shared_dir: Annotated[
        str | None,
        msgspec.Meta(
            description=(
                "The shared directory (NAS) every node mounts at this path, if the cluster "
                "has one."
            )
        ),
    ] = None
    shared_dir_id: Annotated[
        str | None,
        msgspec.Meta(
            description=(
                "Content of `<shared_dir>/bulletin/cluster-id`: a client that reads the same "
                "there sees the same directory, and may pass payloads and take results "
                "through it."
            )
        ),
    ] = None
    user: Annotated[
        str | None,
        msgspec.Meta(
            description=(
                "The caller's user name: their files of the shared directory go in its "
                "directory `bulletin/users/<user>/`, which only their account may write."
            )
        ),
    ] = None
    node: Annotated[
        str | None,
        msgspec.Meta(description="The calling node's name (GET /v1/node/cluster only)."),
    ] = None
    shared_ttl_s: Annotated[
        float | None,
        msgspec.Meta(
            description="Files left in the shared directory longer than this (seconds) are deleted."
        ),
    ] = None
    keepalive_s: Annotated[
        float | None,
        msgspec.Meta(
            description=(
                "How often a caller session must keep its calls alive (seconds), as "
                "SubmitResponse.keepalive_s says; null when the gateway cancels no call for "
                "want of its caller."
            )
        ),
    ] = None


class GpuInfo(_Request, frozen=True, kw_only=True):
    index: Int32
    uuid: Name
    name: Annotated[Name, msgspec.Meta(description="The model name, as NVML reports it.")]
    memory_mb: Annotated[int, msgspec.Meta(description="Its memory, in MiB.")]
    fake: Annotated[
        bool, msgspec.Meta(description="A fake GPU (a nodelet on a machine without NVIDIA).")
    ] = False
    nvlink_group: Annotated[
        int | None,
        msgspec.Meta(
            description=(
                "GPUs of a node sharing this number are connected by NVLink (directly or "
                "through NVSwitches); null: no NVLink, or unknown."
            )
        ),
    ] = None


class RegisterRequest(_Request, frozen=True, kw_only=True):
    name: Annotated[Name, msgspec.Meta(description="The node's name, as its token has it.")]
    gpus: list[GpuInfo]
    cpu_slots: Annotated[
        Count,
        msgspec.Meta(description="How many CPU-only calls (gpus 0) it runs at once: 0 or more."),
    ]
    # Not a minimum here: an older nodelet is refused with a problem that says to upgrade it.
    protocol_version: Annotated[
        Int32,
        msgspec.Meta(
            description=(
                f"The nodelet's PROTOCOL_VERSION: the gateway takes {MIN_PROTOCOL_VERSION} to "
                f"{PROTOCOL_VERSION}."
            )
        ),
    ] = PROTOCOL_VERSION


class RegisterResponse(_Msg, frozen=True, kw_only=True):
    node_id: int
    incarnation: Annotated[
        int,
        msgspec.Meta(
            description=(
                f"This start of the nodelet: send it as `{INCARNATION_HEADER}` on every later "
                "request. Attempts an earlier incarnation held were taken back when it "
                "registered."
            )
        ),
    ]
    lease_s: float
    heartbeat_s: float
    long_poll_s: float
    inline_limit: int
    # The cluster's shared directory and its id (see ClusterInfo), if it has one.
    shared_dir: str | None = None
    shared_dir_id: str | None = None


class Attempt(_Request, frozen=True, kw_only=True):
    """An invocation attempt the node holds: fenced by ``epoch``."""

    invocation_id: Id
    epoch: Int32


class Assignment(_Msg, frozen=True, kw_only=True):
    """Work leased to a node. The payload is inline or fetched from the payload route."""

    invocation_id: str
    epoch: int
    gpu_indices: list[int]
    gpu_share: Annotated[
        float,
        msgspec.Meta(
            description=(
                "The part of its one GPU the call asked for (1: whole GPUs): other calls may "
                "run on that GPU at the same time, and the worker caps its CUDA memory at "
                "this part of the GPU's (protocol 6)."
            )
        ),
    ] = 1.0
    timeout_s: float | None = None
    payload: bytes | None = None
    payload_size: int = 0
    payload_file: Annotated[
        str | None,
        msgspec.Meta(
            description=(
                "Set when the payload is a file in the shared directory (relative to its root)."
            )
        ),
    ] = None
    function_name: str = ""
    owner: Annotated[
        str,
        msgspec.Meta(
            description=(
                "Whose call this is: warm workers are reused only for the same owner and GPU set."
            )
        ),
    ] = ""
    owner_name: Annotated[
        str,
        msgspec.Meta(
            description=(
                "The owner's user name (nodes may run calls as the Unix account of that name)."
            )
        ),
    ] = ""
    owner_admin: Annotated[
        bool,
        msgspec.Meta(
            description=(
                "Whether the owner is an administrator: a single-tenant node runs only calls of "
                "administrators and of the users it is told to trust (protocol 4)."
            )
        ),
    ] = False
    function_owner: Annotated[
        str,
        msgspec.Meta(
            description=(
                "A registered function of another user than the owner: whose code runs (a "
                "worker that ran it never runs the owner's own calls, which that code could "
                "have tampered with)."
            )
        ),
    ] = ""
    arguments: Annotated[
        bytes | None,
        msgspec.Meta(
            description=(
                'JSON invocations: `{"args": [...], "kwargs": {...}}` to call the payload\'s '
                "function with (protocol 3; the payload then holds `(function, (), {})`)."
            )
        ),
    ] = None
    lease: Annotated[
        str | None,
        msgspec.Meta(
            description=(
                "Items of a map: the slot lease the attempt runs in. A node runs the attempts "
                "of one lease one after another, in the order it got them, on the GPUs (or "
                "CPU slot) of the lease; they count for that capacity once."
            )
        ),
    ] = None


class GpuHealthReport(_Request, frozen=True, kw_only=True):
    """One GPU's health at a heartbeat (None where the GPU cannot say)."""

    index: Int32
    utilization_pct: Int32 | None = None
    memory_used_mb: Int32 | None = None
    temperature_c: Int32 | None = None
    ecc_double_bit: Int32 | None = None
    xid_errors: list[Int32] = msgspec.field(default_factory=list)
    critical: Annotated[
        Name | None,
        msgspec.Meta(
            description=(
                "Why the GPU must leave service (a critical XID, uncorrectable ECC errors, lost)."
            )
        ),
    ] = None


class HeartbeatRequest(_Request, frozen=True, kw_only=True):
    """Renews the node's liveness and the leases of the attempts it still runs, and
    reports its GPUs' health."""

    running: list[Attempt]
    gpu_health: list[GpuHealthReport] = msgspec.field(default_factory=list)
    warm: Annotated[
        list[WarmWorker],
        msgspec.Meta(
            description=(
                "The warm workers the node keeps, as (owner's user name, function name): the "
                "scheduler prefers this node for those calls, among equally good nodes."
            )
        ),
    ] = msgspec.field(default_factory=list)


class WarmWorker(_Request, frozen=True, kw_only=True):
    owner: Name
    function: Name


class Preemption(_Msg, frozen=True, kw_only=True):
    """Stop an attempt so its GPUs go to another group: SIGTERM to the call's processes,
    SIGKILL ``grace_s`` later, then hand it back (``ReleaseRequest``): it is queued again. A
    call that finishes within the grace completes normally."""

    invocation_id: Id
    epoch: Int32
    grace_s: float
    reason: str = ""


class HeartbeatResponse(_Msg, frozen=True, kw_only=True):
    revoked: Annotated[
        list[Attempt],
        msgspec.Meta(
            description=(
                "Attempts the node must stop: cancelled, reassigned or no longer leased to it."
            )
        ),
    ]
    lease_s: float
    draining: Annotated[
        bool,
        msgspec.Meta(
            description="Whether the node gets no new work (an admin drained it, or a GPU failed)."
        ),
    ] = False
    drain_reason: str | None = None
    preempt: Annotated[
        list[Preemption],
        msgspec.Meta(
            description=(
                "Attempts to preempt (repeated until they are handed back; acting on one is "
                "idempotent)."
            )
        ),
    ] = msgspec.field(default_factory=list)


class PollRequest(_Request, frozen=True, kw_only=True):
    running: list[Attempt]
    timeout_s: Annotated[
        float,
        msgspec.Meta(
            description=(
                "How long to wait for work, in seconds: capped by the gateway's `long_poll_s`; "
                "0 or less answers at once."
            )
        ),
    ] = 20.0
    preempting: Annotated[
        list[Attempt],
        msgspec.Meta(
            description=(
                "Attempts of `running` already being preempted: not news, so not answered again."
            )
        ),
    ] = msgspec.field(default_factory=list)


class PollResponse(_Msg, frozen=True, kw_only=True):
    assignments: list[Assignment]
    revoked: list[Attempt]
    preempt: list[Preemption] = msgspec.field(default_factory=list)


class StartRequest(_Request, frozen=True, kw_only=True):
    epoch: Int32


class ReleaseRequest(_Request, frozen=True, kw_only=True):
    """Hand an attempt back unrun-to-the-end (the nodelet is stopping): the call is queued
    again at once and the attempt does not count against its retries."""

    epoch: Int32


class NodeLogChunk(_Request, frozen=True, kw_only=True):
    stream: Stream
    data: bytes


class LogsRequest(_Request, frozen=True, kw_only=True):
    """Log chunks of one attempt. ``first_seq`` numbers the first chunk of this batch within
    the attempt (from 0), so a retried request never appends a chunk twice."""

    epoch: Int32
    first_seq: Int32
    chunks: list[NodeLogChunk]


class CompleteRequest(_Request, frozen=True, kw_only=True):
    epoch: Int32
    state: Literal["succeeded", "failed", "timed_out", "cancelled"]
    error_kind: ErrorKind | None = None
    error_type: Text | None = None
    error_message: Text | None = None
    traceback: Text | None = None
    result: bytes | None = None
    result_blob: Id | None = None
    result_file: SharedResult | None = None
    result_size: Annotated[
        ByteSize,
        msgspec.Meta(
            description=(
                "With `result_file`: its size in bytes (it counts towards the owner's storage "
                "limit)."
            )
        ),
    ] = 0
    # The node's clock: when it had a worker, when the user's code started and finished.
    worker_acquired: Epoch | None = None
    started: Epoch | None = None
    finished: Epoch | None = None
    warm: bool | None = None
    result_json: Annotated[
        bytes | None,
        msgspec.Meta(description="JSON invocations: the returned value as JSON."),
    ] = None
    result_json_error: Annotated[
        Text | None,
        msgspec.Meta(description="JSON invocations: why the returned value is not JSON."),
    ] = None
    logs: Annotated[
        list[NodeLogChunk],
        msgspec.Meta(
            description=(
                "The call's last log chunks, not sent yet: appended before the outcome, in the "
                "same transaction, as a LogsRequest with `logs_first_seq` would be."
            )
        ),
    ] = msgspec.field(default_factory=list)
    logs_first_seq: Annotated[
        Int32, msgspec.Meta(description="The attempt's number of the first of `logs` (from 0).")
    ] = 0


class Completion(CompleteRequest, frozen=True, kw_only=True):
    """One attempt's outcome in a :class:`CompleteManyRequest`."""

    invocation_id: Id


class CompleteManyRequest(_Request, frozen=True, kw_only=True):
    completions: Annotated[
        list[Completion],
        msgspec.Meta(
            min_length=1,
            max_length=MAX_COMPLETE,
            description=(
                f"1 to {MAX_COMPLETE} outcomes, each committed as the single-attempt route "
                "would (fenced by its epoch, exactly once, its logs first)."
            ),
        ),
    ]
    take_more: Annotated[
        bool,
        msgspec.Meta(
            description=(
                "Whether the node takes the next items of the maps whose items it completes "
                "here (see `Assignment.lease`); false while it is stopping."
            )
        ),
    ] = True


class CompleteManyResponse(_Msg, frozen=True, kw_only=True):
    done: Annotated[list[str], msgspec.Meta(description="The outcomes committed.")]
    stale: Annotated[
        list[str],
        msgspec.Meta(
            description=(
                "Attempts no longer this node's at their epoch: their outcomes were discarded."
            )
        ),
    ]
    assignments: Annotated[
        list[Assignment],
        msgspec.Meta(
            description=(
                "The next items of the maps, leased to this node in the same transaction: "
                "each to run after the attempts of its `lease` the node already holds."
            )
        ),
    ] = msgspec.field(default_factory=list)


# ------------------------------------------------------------- worker process (nodelet <-> worker)


class WorkerTask(_Request, frozen=True, kw_only=True):
    """What the nodelet hands a worker process on its stdin (msgpack, length-prefixed)."""

    invocation_id: str
    # The call's envelope: inline, in a file the nodelet downloaded (``payload_path``), or
    # in the owner's directory of the shared directory (``payload_file``, relative to it).
    payload: bytes | None = None
    payload_path: str | None = None
    payload_file: str | None = None
    # JSON invocations: the arguments (Assignment.arguments) to call the function with.
    arguments: bytes | None = None
    gpu_indices: list[int] = msgspec.field(default_factory=list)
    # The part of its GPU the call asked for (Assignment.gpu_share): its CUDA memory cap.
    gpu_share: float = 1.0
    env: dict[str, str] = msgspec.field(default_factory=dict)
    # The torch device tensors and modules are moved to before the call ("cuda:0", "cpu").
    device: str = "cpu"
    # Results up to this size go inline in the outcome; bigger ones into a file: in
    # ``shared_dir`` as ``shared_result`` (the one name the gateway accepts for this attempt)
    # when the caller reads it there (PickleHeader.shared_results), else into ``spill_dir``
    # as ``result.bin``.
    inline_limit: int = 1 << 20
    shared_dir: str | None = None
    shared_result: str | None = None
    spill_dir: str = ""
    # Run the call as this account (a nodelet running as root with a user mapping).
    run_as: RunAs | None = None
    # Written to stdout and stderr after the call, so the nodelet knows where its output ends
    # and may hand the worker another call. Empty: run this one call and exit.
    end_marker: bytes = b""


class RunAs(_Request, frozen=True, kw_only=True):
    """The Unix account a worker switches to before it loads a call (it cannot switch back:
    such a worker serves that account only)."""

    user: str
    uid: int
    gid: int
    groups: list[int] = msgspec.field(default_factory=list)
    home: str = "/"


class WorkerOutcome(_Request, frozen=True, kw_only=True):
    """What the worker writes on its outcome pipe after each call (msgpack, length-prefixed:
    ``nodelet.worker_main.send_outcome``). ``result`` is the pickled return value on success
    and the pickled exception on failure (None when it could not be pickled)."""

    # The task's: the nodelet skips an outcome of any other call (one the call's code wrote).
    invocation_id: str = ""
    ok: bool
    result: bytes | None = None
    # Absolute path of a file holding the result envelope when it was too big to inline:
    # the task's shared result or ``spill_dir/result.bin``; the nodelet accepts no other.
    result_path: str | None = None
    # Its size in bytes.
    result_size: int = 0
    # When the user's code started and finished (time.time() on the node).
    started: float | None = None
    finished: float | None = None
    error_kind: ErrorKind | None = None
    error_type: str | None = None
    error_message: str | None = None
    traceback: str | None = None
    # JSON invocations: the returned value as JSON, or why it could not be.
    result_json: bytes | None = None
    result_json_error: str | None = None


class PickleHeader(_Msg, frozen=True, kw_only=True):
    """Leads every envelope (a pickled call or result, ``bulletin_core/pickling/envelope.py``): read
    and checked before anything is unpickled."""

    python: str  # "3.11": pickled code objects only load on the same minor version
    cloudpickle: str
    torch: str | None = None  # set when the pickle holds torch objects
    pickle_size: int
    buffers: list[int] = msgspec.field(default_factory=list)  # out-of-band buffer sizes
    # Call envelopes only: send back the globals the call changed; results may go through
    # the shared directory; results over max_result_bytes (0: no limit) are refused.
    sync: bool = False
    move_to_device: bool = True
    shared_results: bool = False
    max_result_bytes: int = 0


class ClientConfig(_Msg, frozen=True, kw_only=True):
    """The client config file (``client.toml``) that ``bulletin up`` writes."""

    url: str
    token: str
    #: The CA certificate (PEM) that signed an https:// gateway's certificate, when the
    #: system does not trust it (a lab's own CA). Empty: the system's CAs.
    ca: str = ""

