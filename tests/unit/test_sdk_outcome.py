"""What a finished invocation turns into: its value, the user's own exception re-raised with
the remote traceback, or the sdk exception for an infrastructure failure."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import cloudpickle
import msgspec
import pytest

import sdk
from bulletin_core import wire
from bulletin_core.pickling import pickler
from sdk import _outcome as outcome

TRACEBACK = "Traceback (most recent call last):\n  File \"<cell>\", line 3\nKeyError: 'lr'\n"


@pytest.fixture
def client() -> Iterator[sdk.Client]:
    # Never contacted: every result below is inline.
    with sdk.Client("http://unused.invalid", "bu_x") as client:
        yield client


def envelope(value: Any = None, error: BaseException | None = None) -> bytes:
    """A worker's outcome envelope: (value, pickled error, changed, deleted, notes, touched)."""
    pickled = None if error is None else cloudpickle.dumps(error)
    packed, _ = pickler.pack((value, pickled, {}, [], [], []))
    return packed.tobytes()


def failure(invocation: wire.Invocation, client: sdk.Client) -> Exception | None:
    return outcome.resolve(invocation, client).error


def finished(state: str, **fields: Any) -> wire.Invocation:
    return wire.Invocation(id="i-7", state=wire.State(state), node="gpu-3", **fields)


def test_success_is_the_value(client: sdk.Client) -> None:
    invocation = finished("succeeded", result=envelope({"loss": 0.25}))
    assert outcome.unwrap(invocation, client) == {"loss": 0.25}


def test_user_exception_is_reraised_with_its_type_and_traceback(client: sdk.Client) -> None:
    invocation = finished(
        "failed",
        error_kind=wire.ErrorKind.USER,
        error_type="KeyError",
        error_message="'lr'",
        traceback=TRACEBACK,
        result=envelope(error=KeyError("lr")),
    )
    with pytest.raises(KeyError) as info:
        outcome.unwrap(invocation, client)
    assert info.value.args == ("lr",)
    assert info.value.remote_traceback == TRACEBACK  # type: ignore[attr-defined]
    assert len(info.value.__notes__) == 1
    assert "i-7 on gpu-3" in info.value.__notes__[0]
    assert TRACEBACK in info.value.__notes__[0]


@pytest.mark.parametrize("result", [None, b"not an envelope", envelope()])
def test_user_exception_that_cannot_be_unpickled(client: sdk.Client, result: bytes | None) -> None:
    invocation = finished(
        "failed",
        error_kind=wire.ErrorKind.USER,
        error_type="torch.OutOfMemoryError",
        error_message="CUDA out of memory",
        traceback=TRACEBACK,
        result=result,
    )
    with pytest.raises(sdk.RemoteError) as info:
        outcome.unwrap(invocation, client)
    error = info.value
    assert type(error) is sdk.RemoteError
    assert (error.invocation_id, error.error_type) == ("i-7", "torch.OutOfMemoryError")
    assert error.remote_traceback == TRACEBACK
    for part in ("torch.OutOfMemoryError: CUDA out of memory", TRACEBACK, "i-7"):
        assert part in str(error)


@pytest.mark.parametrize(
    ("kind", "exception", "says"),
    [
        (wire.ErrorKind.NODE_LOST, sdk.NodeLostError, "node was lost"),
        (wire.ErrorKind.WORKER_DIED, sdk.WorkerDiedError, "worker process exited"),
        (wire.ErrorKind.WORKER_CRASHED, sdk.WorkerDiedError, "crashed mid-call, in native code"),
        (wire.ErrorKind.OUT_OF_MEMORY, sdk.OutOfMemoryError, "raise the limit (the nodelet's"),
        (wire.ErrorKind.BAD_PAYLOAD, sdk.RemoteError, "No module named 'helpers'"),
    ],
)
def test_infrastructure_failures(
    client: sdk.Client, kind: wire.ErrorKind, exception: type[sdk.RemoteError], says: str
) -> None:
    invocation = finished(
        "failed",
        error_kind=kind,
        error_type="ModuleNotFoundError" if kind == wire.ErrorKind.BAD_PAYLOAD else None,
        error_message="No module named 'helpers'" if kind == wire.ErrorKind.BAD_PAYLOAD else None,
        attempts=3,
    )
    error = failure(invocation, client)
    assert type(error) is exception
    assert error.invocation_id == "i-7"
    assert says in str(error)


def test_timed_out_and_cancelled(client: sdk.Client) -> None:
    timed_out = failure(finished("timed_out"), client)
    cancelled = failure(finished("cancelled"), client)
    assert isinstance(timed_out, sdk.CallTimedOut)
    assert isinstance(cancelled, sdk.CallCancelled)
    assert timed_out.invocation_id == cancelled.invocation_id == "i-7"


def test_a_result_that_cannot_be_unpickled_here(client: sdk.Client) -> None:
    with pytest.raises(sdk.SerializationError, match="result of call i-7 cannot be unpickled"):
        outcome.unwrap(finished("succeeded", result=b"\x80\x05garbage"), client)
    with pytest.raises(sdk.SerializationError, match="result of call i-7 cannot be unpickled"):
        garbled = envelope(1)[:-1] + b"\x00"  # the pickle's STOP opcode gone
        outcome.unwrap(finished("succeeded", result=garbled), client)


def test_a_result_from_a_worker_with_another_python_is_refused_before_unpickling(
    client: sdk.Client,
) -> None:
    packed, _ = pickler.pack((1, None, {}, [], [], []))
    header = msgspec.structs.replace(packed.header, python="3.99")
    skewed = type(packed)(header, packed.pickle, packed.buffers).tobytes()
    with pytest.raises(sdk.VersionSkewError, match=r"node 'gpu-3' runs Python 3\.99"):
        outcome.unwrap(finished("succeeded", result=skewed), client)


def test_every_error_is_a_bulletin_error() -> None:
    names = [n for n in sdk.__all__ if n.endswith(("Error", "Unreachable", "Timeout"))]
    names += ["CallCancelled", "CallTimedOut", "InvalidRequest"]
    for name in names:
        assert issubclass(getattr(sdk, name), sdk.BulletinError), name
    assert issubclass(sdk.ResultTimeout, TimeoutError)
    assert issubclass(sdk.NodeLostError, sdk.RemoteError)
    assert issubclass(sdk.WorkerDiedError, sdk.RemoteError)


def test_out_of_memory_names_the_limit_and_keeps_the_remote_traceback(
    client: sdk.Client,
) -> None:
    invocation = finished(
        "failed",
        error_kind=wire.ErrorKind.OUT_OF_MEMORY,
        error_type="MemoryError",
        error_message="the call ran out of memory at its limit of 300 MiB of address space "
        "per process (RLIMIT_AS): MemoryError",
        traceback=TRACEBACK,
    )
    error = failure(invocation, client)
    assert type(error) is sdk.OutOfMemoryError and isinstance(error, sdk.RemoteError)
    assert "out of memory at its node's limit per call" in str(error)
    assert "300 MiB of address space per process (RLIMIT_AS)" in str(error)
    assert error.remote_traceback == TRACEBACK


def test_a_crash_names_the_signal(client: sdk.Client) -> None:
    invocation = finished(
        "failed",
        error_kind=wire.ErrorKind.WORKER_CRASHED,
        error_message="worker process was killed by signal 11 (SIGSEGV)",
    )
    error = failure(invocation, client)
    assert type(error) is sdk.WorkerDiedError
    assert "signal 11 (SIGSEGV)" in str(error)
