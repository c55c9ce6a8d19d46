"""What a finished invocation stands for: its return value, or the exception to raise; and
the globals it changed, applied to the notebook's namespace on the way."""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any

from bulletin_core import shared, wire
from bulletin_core.pickling import caller, envelope
from sdk._client import Client
from sdk._errors import (
    BulletinError,
    CallCancelled,
    CallTimedOut,
    NodeLostError,
    OutOfMemoryError,
    RemoteError,
    SerializationError,
    StateSyncWarning,
    UntrustedResult,
    VersionSkewError,
    WorkerDiedError,
)


@dataclass
class Resolved:
    """A terminal invocation, loaded: its value or the exception it stands for, and what it
    sent back for each global it changed."""

    value: Any = None
    error: Exception | None = None
    remote_globals: dict[str, Any] = field(default_factory=dict)
    #: Its result was not unpickled: another user's code made it and was not trusted.
    untrusted: bool = False

    def unwrap(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


def unwrap(invocation: wire.Invocation, client: Client) -> Any:
    """The value a terminal invocation returned; raises the exception it stands for."""
    return resolve(invocation, client).unwrap()


def resolve(
    invocation: wire.Invocation,
    client: Client,
    sync: caller.Sync | None = None,
    *,
    trust: bool | str = False,
) -> Resolved:
    """Load a terminal invocation's outcome. With ``sync`` (kept when the call was sent), the
    state it changed is applied in place and its changed globals are bound in the namespace,
    on success and on failure alike, as if the function had run here. A result made by
    another user's code is unpickled only when ``trust`` is True or names that user."""
    state, iid = invocation.state, invocation.id
    if state == wire.State.CANCELLED:
        # The gateway says why when it was not its owner who cancelled it.
        detail = f" ({invocation.error_message})" if invocation.error_message else ""
        return Resolved(
            error=CallCancelled(f"Call {iid} was cancelled{detail}.", invocation_id=iid)
        )
    if state == wire.State.TIMED_OUT:
        detail = f": {invocation.error_message}" if invocation.error_message else ""
        error = CallTimedOut(f"Call {iid} ran past its timeout{detail}.", invocation_id=iid)
        return Resolved(error=error)
    if state == wire.State.FAILED and invocation.error_kind != wire.ErrorKind.USER:
        return Resolved(error=_infrastructure_failure(invocation))
    untrusted = False
    try:
        _check_trust(invocation, client, trust)
        returned = _load(invocation, client, sync)
    except BulletinError as exc:
        # Kept on the Call: its traceback would keep _load's frame (and the memo) alive.
        exc = exc.with_traceback(None)
        untrusted = isinstance(exc, UntrustedResult)
        if state == wire.State.SUCCEEDED or isinstance(exc, VersionSkewError):
            return Resolved(error=exc, untrusted=untrusted)
        returned = None  # the failure is still described by the invocation's text
    if state == wire.State.SUCCEEDED:
        if returned is None:
            missing = RemoteError(f"Call {iid} succeeded but no result came back.")
            return Resolved(error=missing)
        return Resolved(value=returned.value, remote_globals=returned.changed)
    changed = returned.changed if returned is not None else {}
    error_object = returned.error if returned is not None else None
    raised = _user_exception(invocation, error_object, sent=returned is not None)
    return Resolved(error=raised, remote_globals=changed, untrusted=untrusted)


def _check_trust(invocation: wire.Invocation, client: Client, trust: bool | str) -> None:
    """Refuse to unpickle a result made by another user's code unless trusted: unpickling
    runs whatever code that pickle names, here, with this notebook's rights."""
    maker = invocation.code_owner
    if maker is None and invocation.function_version is None:
        return  # a gateway that does not say (older than this sdk): the caller's own call
    if trust is True or (maker is not None and (trust == maker or maker == client.cluster().user)):
        return
    who = repr(maker) if maker is not None else "an unknown user (a function since unregistered)"
    how = f"trust={maker!r}" if maker is not None else "trust=True"
    raise UntrustedResult(
        f"The result of call {invocation.id} was made by code of user {who} (their "
        f"function {invocation.function_name!r}), not yours: unpickling it would run "
        "whatever that code put in it, in this process. Load it only if you trust them: "
        f"sdk.Call.from_id({invocation.id!r}).result({how}). A JSON result needs no "
        "unpickling: GET /v1/invocations/{id} (result_json).",
        invocation_id=invocation.id,
        code_owner=maker or "",
    )


def _load(
    invocation: wire.Invocation, client: Client, sync: caller.Sync | None
) -> caller.Returned | None:
    try:
        opened, path = _open(invocation, client)
    except envelope.EnvelopeError as exc:
        raise SerializationError(
            f"The result of call {invocation.id} cannot be unpickled here: {exc}",
            invocation_id=invocation.id,
        ) from None
    except OSError as exc:
        raise SerializationError(
            f"The result of call {invocation.id} in the shared directory cannot be read "
            f"({exc.strerror or exc}): a result file is deleted once a caller has loaded it, "
            "and swept after the gateway's shared_ttl_s.",
            invocation_id=invocation.id,
        ) from None
    if opened is None:
        return None
    node = f"node {invocation.node!r}" if invocation.node else "the worker"
    problem = envelope.skew(opened.header, they=node, we="this notebook")
    if problem is not None:
        raise VersionSkewError(
            f"The result of call {invocation.id} cannot be loaded here: {problem}",
            invocation_id=invocation.id,
        )
    try:
        returned = caller.load_outcome(opened, sync)
    except Exception as exc:
        raise SerializationError(
            f"The result of call {invocation.id} cannot be unpickled here "
            f"({type(exc).__name__}: {exc}). Install the module it needs in this "
            "environment, or return plain Python data.",
            invocation_id=invocation.id,
        ) from None
    if path is not None:  # a result file in the shared directory, loaded: ours to delete
        shared.remove_later(path)
    for note in returned.notes:
        warnings.warn(f"call {invocation.id}: {note}", StateSyncWarning, stacklevel=4)
    return returned


def _open(invocation: wire.Invocation, client: Client) -> tuple[envelope.Opened | None, str | None]:
    if invocation.result is not None:
        return envelope.open_bytes(invocation.result), None
    if invocation.result_blob is not None:
        return envelope.open_bytes(client.get_blob(invocation.result_blob)), None
    if invocation.result_file is not None:
        root = client.shared_dir()
        if root is None:  # this machine does not see it: the gateway may read it for us
            return envelope.open_bytes(client.get_result(invocation.id)), None
        try:
            fd = shared.open_fd(root, invocation.result_file)
        except (PermissionError, ValueError):  # another account's; a name of an old layout
            return envelope.open_bytes(client.get_result(invocation.id)), None
        opened = envelope.open_fd(fd, invocation.result_file)
        return opened, shared.path(root, invocation.result_file)
    return None, None


def _user_exception(
    invocation: wire.Invocation, error: BaseException | None, *, sent: bool
) -> Exception:
    """The user's own exception, re-created with its type and the remote traceback; when
    it could not travel, or the call failed otherwise (its return value could not be
    sent), an ``sdk.RemoteError`` with the text."""
    if not isinstance(error, Exception):
        raised = sent and invocation.error_type != wire.RESULT_ERROR
        why = "its exception could not be brought here (it does not pickle or unpickle)."
        return _remote_error(RemoteError, invocation, why if raised else "")
    traceback = invocation.traceback or ""
    # A type with __slots__ refuses the attribute; the note still shows the traceback.
    with contextlib.suppress(AttributeError):
        error.remote_traceback = traceback  # type: ignore[attr-defined]
    if traceback:
        error.add_note(f"Remote traceback of call {invocation.id}{_on(invocation)}:\n{traceback}")
    return error


_KIND_TEXT = {
    wire.ErrorKind.NODE_LOST: (
        NodeLostError,
        "its node was lost and no retries were left (attempts: {attempts}).",
    ),
    wire.ErrorKind.WORKER_CRASHED: (
        WorkerDiedError,
        "the worker process crashed mid-call, in native code (a C extension, CUDA) or by "
        "exiting the process; the node replaced it. Look at the call's last output and the "
        "native libraries it uses; a retry runs in a fresh worker.",
    ),
    # What nodelets recorded for crashes and memory kills before worker_crashed and
    # out_of_memory; still what a nodelet records for a result file it refuses.
    wire.ErrorKind.WORKER_DIED: (
        WorkerDiedError,
        "the worker process exited without a result; it may have been killed for using too "
        "much memory, or crashed in native code.",
    ),
    wire.ErrorKind.OUT_OF_MEMORY: (
        OutOfMemoryError,
        "it ran out of memory at its node's limit per call. Use less memory (smaller "
        "batches, fewer copies, free what you no longer need), or ask the cluster's admin to "
        "raise the limit (the nodelet's --memory-limit-mb).",
    ),
    wire.ErrorKind.BAD_PAYLOAD: (
        RemoteError,
        "the worker could not unpickle the call; install the missing module on the cluster "
        "or define what it needs in the notebook.",
    ),
    wire.ErrorKind.VERSION_SKEW: (
        VersionSkewError,
        "the notebook and the node run versions that cannot exchange pickles.",
    ),
}


def _infrastructure_failure(invocation: wire.Invocation) -> RemoteError:
    found = _KIND_TEXT.get(invocation.error_kind) if invocation.error_kind else None
    kind, text = found or (RemoteError, "")
    return _remote_error(kind, invocation, text.format(attempts=invocation.attempts))


def _remote_error(kind: type[RemoteError], invocation: wire.Invocation, why: str) -> RemoteError:
    lines = [f"Call {invocation.id} failed{_on(invocation)}" + (f": {why}" if why else ".")]
    if invocation.error_type or invocation.error_message:
        lines.append(f"{invocation.error_type or 'Error'}: {invocation.error_message or ''}")
    if invocation.traceback:
        lines.append(f"Remote traceback:\n{invocation.traceback}")
    return kind(
        "\n".join(lines),
        invocation_id=invocation.id,
        error_type=invocation.error_type,
        remote_traceback=invocation.traceback,
    )


def _on(invocation: wire.Invocation) -> str:
    return f" on {invocation.node}" if invocation.node else ""
