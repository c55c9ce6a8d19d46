"""What a finished invocation stands for: its return value, or the exception to raise."""

from __future__ import annotations

import contextlib
from typing import Any

from bulletin import wire
from sdk import serialize
from sdk.client import Client
from sdk.errors import (
    CallCancelled,
    CallTimedOut,
    NodeLostError,
    RemoteError,
    SerializationError,
    WorkerDiedError,
)


def unwrap(invocation: wire.Invocation, client: Client) -> Any:
    """The value a terminal invocation returned; raises the exception it stands for."""
    error = failure(invocation, client)
    if error is not None:
        raise error
    return value(invocation, client)


def failure(invocation: wire.Invocation, client: Client) -> Exception | None:
    """The exception a terminal invocation stands for, or None if it succeeded."""
    state, iid = invocation.state, invocation.id
    if state == wire.State.SUCCEEDED:
        return None
    if state == wire.State.CANCELLED:
        return CallCancelled(f"Call {iid} was cancelled.", invocation_id=iid)
    if state == wire.State.TIMED_OUT:
        detail = f": {invocation.error_message}" if invocation.error_message else ""
        return CallTimedOut(f"Call {iid} ran past its timeout{detail}.", invocation_id=iid)
    if invocation.error_kind == wire.ErrorKind.USER:
        return _user_exception(invocation, client)
    return _infrastructure_failure(invocation)


def value(invocation: wire.Invocation, client: Client) -> Any:
    """Unpickle the return value of a succeeded invocation."""
    data = _result(invocation, client)
    if data is None:
        raise RemoteError(f"Call {invocation.id} succeeded but no result came back.")
    try:
        return serialize.loads(data)
    except Exception as exc:
        raise SerializationError(
            f"The result of call {invocation.id} cannot be unpickled here "
            f"({type(exc).__name__}: {exc}). Install the module it needs in this environment, "
            "or return plain Python data.",
            invocation_id=invocation.id,
        ) from None


def _result(invocation: wire.Invocation, client: Client) -> bytes | bytearray | None:
    if invocation.result is not None:
        return invocation.result
    if invocation.result_blob is not None:
        return client.get_blob(invocation.result_blob)
    return None


def _user_exception(invocation: wire.Invocation, client: Client) -> Exception:
    """The user's own exception, re-created with its type and the remote traceback."""
    data = _result(invocation, client)
    try:
        error = serialize.loads(data) if data is not None else None
    except Exception:
        error = None
    if not isinstance(error, Exception):
        return _remote_error(RemoteError, invocation, "its exception cannot be unpickled here.")
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
    wire.ErrorKind.WORKER_DIED: (
        WorkerDiedError,
        "the worker process exited without a result; it may have been killed for using too "
        "much memory, or crashed in native code.",
    ),
    wire.ErrorKind.BAD_PAYLOAD: (
        RemoteError,
        "the worker could not unpickle the call; install the missing module on the cluster "
        "or define what it needs in the notebook.",
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
