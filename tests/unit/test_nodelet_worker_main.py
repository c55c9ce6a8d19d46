"""The worker process, run for real: one framed WorkerTask in, one WorkerOutcome out."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import cloudpickle
import msgspec
import pytest

from bulletin_core import wire
from bulletin_core.pickling import caller, envelope, pickler
from nodelet.limits import RLIMIT_ENV
from nodelet.worker_main import LIFELINE_ENV, OUTCOME_ENV, frame
from tests.processes import alive, run_worker_process, state

# The worker cannot import this test module, so functions defined here travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

_outcome_decoder = msgspec.msgpack.Decoder(wire.WorkerOutcome)


class Finished(msgspec.Struct):
    outcome: wire.WorkerOutcome | None
    stdout: bytes
    stderr: bytes
    returncode: int


def run_worker(
    tmp_path: Path,
    payload: bytes | None,
    *,
    gpu_indices: list[int] | None = None,
    env: dict[str, str] | None = None,
    **fields: object,
) -> Finished:
    """Start ``python -m nodelet.worker_main`` as the nodelet does and hand it one task."""
    task = wire.WorkerTask(
        invocation_id="inv-1",
        payload=payload,
        gpu_indices=gpu_indices or [],
        env=env or {},
        **fields,  # type: ignore[arg-type]
    )
    worker_env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    worker_env["PYTHONUNBUFFERED"] = "1"
    prefix, body = frame(task)
    done, outcomes = run_worker_process(prefix + body, env=worker_env, cwd=tmp_path, timeout=60)
    outcome = outcomes.get("inv-1")
    return Finished(
        outcome=outcome, stdout=done.stdout, stderr=done.stderr, returncode=done.returncode
    )


def call(fn: object, *args: object, **kwargs: object) -> bytes:
    """The envelope the sdk sends for ``fn(*args, **kwargs)``."""
    return caller.pack_call(fn, args, kwargs, sync=False).packed.tobytes()  # type: ignore[arg-type]


def loads(result: bytes | None) -> object:
    """The return value (or exception) in an outcome's result envelope."""
    assert result is not None
    returned = caller.load_outcome(envelope.open_bytes(result), None)
    return returned.error if returned.error is not None else returned.value


def add(a: int, b: int, *, scale: int = 1) -> dict[str, int]:
    return {"sum": (a + b) * scale}


class TrainingDiverged(Exception):
    pass


def train_step(loss: float) -> None:
    raise TrainingDiverged(f"loss is {loss}")


def test_success_round_trips_the_value(tmp_path: Path) -> None:
    done = run_worker(tmp_path, call(add, 2, 3, scale=10))
    assert done.returncode == 0, done.stderr
    assert done.outcome is not None
    assert done.outcome.ok is True
    assert done.outcome.error_kind is None
    assert done.outcome.result is not None
    assert loads(done.outcome.result) == {"sum": 50}
    assert not list(tmp_path.glob("*.tmp")), "the temporary outcome file was left behind"


def test_user_exception_is_pickled_with_its_traceback(tmp_path: Path) -> None:
    done = run_worker(tmp_path, call(train_step, 3.5))
    assert done.returncode == 0, done.stderr
    outcome = done.outcome
    assert outcome is not None
    assert outcome.ok is False
    assert outcome.error_kind == wire.ErrorKind.USER
    assert outcome.error_type == f"{__name__}.TrainingDiverged"
    assert outcome.error_message == "loss is 3.5"
    assert outcome.traceback is not None
    assert "train_step" in outcome.traceback
    assert "TrainingDiverged: loss is 3.5" in outcome.traceback
    assert "nodelet/worker_main.py" not in outcome.traceback  # the worker's own frames are trimmed
    assert outcome.result is not None
    error = loads(outcome.result)
    assert type(error).__name__ == "TrainingDiverged"
    assert str(error) == "loss is 3.5"


def test_builtin_exception_type_has_no_module_prefix(tmp_path: Path) -> None:
    done = run_worker(tmp_path, call(int, "not a number"))
    assert done.outcome is not None
    assert done.outcome.error_type == "ValueError"
    assert done.outcome.error_message == "invalid literal for int() with base 10: 'not a number'"


def make_lock() -> object:
    import threading

    return threading.Lock()


def test_unpicklable_return_value_is_a_user_error(tmp_path: Path) -> None:
    done = run_worker(tmp_path, call(make_lock))
    outcome = done.outcome
    assert outcome is not None
    assert outcome.ok is False
    assert outcome.error_kind == wire.ErrorKind.USER
    assert outcome.error_message is not None
    assert outcome.error_message.startswith("make_lock: the return value")
    assert "could not be pickled" in outcome.error_message
    assert "lock" in outcome.error_message


def test_missing_module_is_a_bad_payload_naming_it(tmp_path: Path) -> None:
    module_dir = tmp_path / "only_on_the_notebook_side"
    module_dir.mkdir()
    (module_dir / "bulletin_test_helpers_xyz.py").write_text(
        "class Batch:\n    def __init__(self, n):\n        self.n = n\n"
    )
    sys.path.insert(0, str(module_dir))
    try:
        import bulletin_test_helpers_xyz  # type: ignore[import-not-found]

        # Packed without shipping local modules (the sdk would ship this one by value), as
        # for a module installed on the notebook's machine but not on the node.
        packed, _ = pickler.pack((len, ([bulletin_test_helpers_xyz.Batch(3)],), {}))
        payload = packed.tobytes()
    finally:
        sys.path.remove(str(module_dir))
        sys.modules.pop("bulletin_test_helpers_xyz", None)

    done = run_worker(tmp_path, payload)
    assert done.returncode == 0, done.stderr
    outcome = done.outcome
    assert outcome is not None
    assert outcome.ok is False
    assert outcome.error_kind == wire.ErrorKind.BAD_PAYLOAD
    assert outcome.error_type == "ModuleNotFoundError"
    assert outcome.error_message is not None
    assert "'bulletin_test_helpers_xyz'" in outcome.error_message
    assert "install it on the nodes" in outcome.error_message
    assert outcome.traceback is not None
    assert "No module named 'bulletin_test_helpers_xyz'" in outcome.traceback
    assert outcome.result is None


def test_payload_that_is_not_a_call_is_a_bad_payload(tmp_path: Path) -> None:
    packed, _ = pickler.pack({"not": "a call"})
    done = run_worker(tmp_path, packed.tobytes())
    outcome = done.outcome
    assert outcome is not None
    assert outcome.error_kind == wire.ErrorKind.BAD_PAYLOAD
    assert outcome.error_message == "the payload is a pickled dict, not a call"


def test_raw_pickle_instead_of_an_envelope_is_a_bad_payload(tmp_path: Path) -> None:
    done = run_worker(tmp_path, cloudpickle.dumps((len, ([1],), {})))
    outcome = done.outcome
    assert outcome is not None
    assert outcome.error_kind == wire.ErrorKind.BAD_PAYLOAD
    assert "not a Bulletin envelope" in (outcome.error_message or "")


def chatty() -> str:
    import sys

    print("epoch 1 done")
    for step in (1, 2, 3):
        sys.stderr.write(f"\rtraining {step}/3")
    sys.stderr.write("\n")
    print("epoch 2 done", flush=True)
    return "trained"


def test_output_goes_to_the_worker_pipes_with_carriage_returns(tmp_path: Path) -> None:
    done = run_worker(tmp_path, call(chatty))
    assert done.outcome is not None
    assert done.outcome.ok is True
    assert done.stdout == b"epoch 1 done\nepoch 2 done\n"
    assert done.stderr == b"\rtraining 1/3\rtraining 2/3\rtraining 3/3\n"


def visible_devices() -> str:
    import os

    return os.environ["CUDA_VISIBLE_DEVICES"]


def read_env(name: str) -> str | None:
    import os

    return os.environ.get(name)


@pytest.mark.parametrize(("gpu_indices", "expected"), [([1, 3], "1,3"), ([], "")])
def test_cuda_visible_devices_comes_from_gpu_indices(
    tmp_path: Path, gpu_indices: list[int], expected: str
) -> None:
    done = run_worker(tmp_path, call(visible_devices), gpu_indices=gpu_indices)
    assert done.outcome is not None
    assert done.outcome.result is not None
    assert loads(done.outcome.result) == expected


def test_task_env_is_applied(tmp_path: Path) -> None:
    done = run_worker(
        tmp_path, call(read_env, "BULLETIN_TEST_VAR"), env={"BULLETIN_TEST_VAR": "42"}
    )
    assert done.outcome is not None
    assert done.outcome.result is not None
    assert loads(done.outcome.result) == "42"


def test_closed_stdin_without_a_task_exits_quietly(tmp_path: Path) -> None:
    done, outcomes = run_worker_process(b"", cwd=tmp_path, timeout=60)
    assert done.returncode == 0
    assert done.stderr == b"" and outcomes == {}


def test_a_worker_without_an_outcome_pipe_refuses_to_start(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "nodelet.worker_main"],
        input=b"".join(frame(wire.WorkerTask(invocation_id="inv-1", payload=call(add, 1, 2)))),
        capture_output=True,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0 and OUTCOME_ENV.encode() in done.stderr


def test_an_outcome_bigger_than_a_pipe_holds_comes_whole(tmp_path: Path) -> None:
    done = run_worker(tmp_path, call(bytes, 700_000))
    assert done.outcome is not None and done.outcome.ok, done.stderr
    assert loads(done.outcome.result) == bytes(700_000)


def sleep_with_a_setsid_child(seconds: float) -> None:
    import subprocess
    import time

    child = subprocess.Popen(["setsid", "sleep", "600"])
    print(child.pid, flush=True)
    time.sleep(seconds)


def test_worker_dies_with_its_parent_and_takes_what_its_call_started(tmp_path: Path) -> None:
    # A stand-in nodelet starts a worker as the pool does (with the read end of its lifeline),
    # hands it a long call that starts a setsid child, prints both pids and dies.
    task = wire.WorkerTask(
        invocation_id="inv-1",
        payload=call(sleep_with_a_setsid_child, 60),
    )
    (tmp_path / "task.bin").write_bytes(b"".join(frame(task)))
    parent = textwrap.dedent(
        f"""
        import os, subprocess, sys
        read, write = os.pipe()
        outcomes, _ = os.pipe()
        worker = subprocess.Popen(
            [sys.executable, "-m", "nodelet.worker_main"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env={{**os.environ, {LIFELINE_ENV!r}: str(read), {OUTCOME_ENV!r}: str(outcomes)}},
            pass_fds=(read, outcomes), start_new_session=True,
        )
        worker.stdin.write(open({str(tmp_path / "task.bin")!r}, "rb").read())
        worker.stdin.close()
        child = worker.stdout.readline().decode().strip()  # the call is running
        print(worker.pid, child, flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", parent], capture_output=True, timeout=60, check=True
    )
    pids = [int(pid) for pid in done.stdout.split()]
    deadline = time.monotonic() + 10
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(alive, pids)), "the worker or its call's setsid child outlived it"


def _child_state(pid: int) -> str:
    return state(pid) or "gone"


def leave_traces(n: int, pidfile: str) -> tuple[int, str | None, str, str]:
    cwd_at_start = os.getcwd()
    seen = os.environ.get("LEFT_BEHIND")
    os.environ["LEFT_BEHIND"] = str(n)
    os.chdir("/")
    if n == 0:
        child = subprocess.Popen(["sleep", "60"])
        Path(pidfile).write_text(str(child.pid))
        child_state = "spawned"
    else:
        child_state = _child_state(int(Path(pidfile).read_text()))
    print(f"call {n}", end="")
    return os.getpid(), seen, cwd_at_start, child_state


def test_a_warm_worker_runs_calls_back_to_back_and_resets_between_them(tmp_path: Path) -> None:
    markers = [b"\x00\x00end-a\x00", b"\x00\x00end-b\x00"]
    tasks = [
        wire.WorkerTask(
            invocation_id=f"inv-{i}",
            payload=call(leave_traces, i, str(tmp_path / "child.pid")),
            end_marker=markers[i],
        )
        for i in range(2)
    ]
    stdin = b"".join(b"".join(frame(t)) for t in tasks)
    # As the nodelet starts it: the worker leads its group.
    done, outcomes = run_worker_process(
        stdin, cwd=tmp_path, timeout=60, start_new_session=True
    )
    assert done.returncode == 0, done.stderr
    # Each call's output ends with its marker on both pipes, so the nodelet can split them.
    assert done.stdout == b"call 0" + markers[0] + b"call 1" + markers[1]
    assert done.stderr == markers[0] + markers[1]
    first, second = (loads(outcomes[f"inv-{i}"].result) for i in range(2))
    assert first[0] == second[0], "the same process ran both calls"
    assert second[1] is None, "an environment variable leaked from the previous call"
    assert second[2] == str(tmp_path), "the working directory leaked from the previous call"
    assert second[3] in {"gone", "Z"}, "a process the previous call spawned survived it"


def read_stdin() -> str:
    try:
        return input()
    except EOFError:
        return "EOF"


def test_user_code_reading_stdin_gets_eof_instead_of_hanging(tmp_path: Path) -> None:
    finished = run_worker(tmp_path, call(read_stdin))
    assert finished.outcome is not None and finished.outcome.ok
    assert loads(finished.outcome.result) == "EOF"


def shout(size: int) -> None:
    raise ValueError("x" * size)


def test_a_huge_error_message_is_cut_in_the_middle(tmp_path: Path) -> None:
    finished = run_worker(tmp_path, call(shout, 10_000_000))
    outcome = finished.outcome
    assert outcome is not None and outcome.error_message is not None
    assert len(outcome.error_message) < 70_000 and "characters cut" in outcome.error_message
    assert len(outcome.traceback or "") < 70_000


def test_version_skew_is_reported_as_such_before_unpickling(tmp_path: Path) -> None:
    sent = caller.pack_call(add, (1, 2), {}, sync=False).packed
    header = msgspec.structs.replace(sent.header, python="3.99")
    done = run_worker(tmp_path, envelope.Packed(header, sent.pickle, sent.buffers).tobytes())
    outcome = done.outcome
    assert outcome is not None and outcome.ok is False
    assert outcome.error_kind == wire.ErrorKind.VERSION_SKEW
    assert outcome.error_message is not None
    assert "the notebook runs Python 3.99 but node" in outcome.error_message


def test_payload_file_in_and_big_result_spilled_to_a_file(tmp_path: Path) -> None:
    payload = tmp_path / "payload.bin"
    caller.pack_call(bytes, (3 << 20,), {}, sync=False).packed.write(str(payload))
    spill = tmp_path / "spill"
    spill.mkdir()
    done = run_worker(
        tmp_path, None, payload_path=str(payload), inline_limit=1 << 20, spill_dir=str(spill)
    )
    outcome = done.outcome
    assert outcome is not None and outcome.ok, done.stderr
    assert outcome.result is None and outcome.result_path == str(spill / "result.bin")
    returned = caller.load_outcome(envelope.open_file(outcome.result_path), None)
    assert returned.value == bytes(3 << 20)


def big_shared_result(tmp_path: Path, root: Path, name: str) -> Finished:
    """Run a call returning 3 MiB for a caller that reads results in the shared directory
    ``root``, where the nodelet named ``name`` as its result file."""
    sent = caller.pack_call(bytes, (3 << 20,), {}, sync=False, shared_results=True).packed
    return run_worker(
        tmp_path,
        sent.tobytes(),
        inline_limit=1 << 20,
        shared_dir=str(root),
        shared_result=name,
        spill_dir=str(tmp_path),
    )


def test_big_result_goes_to_the_shared_directory_when_the_caller_reads_it(
    tmp_path: Path,
) -> None:
    from bulletin_core import shared

    root = tmp_path / "nas"
    root.mkdir()
    shared.prepare(str(root))
    name = shared.result_name("alice", "inv-1", 3)
    user_dir = root / shared.user_dir("alice")
    # A single-tenant worker (no run_as) never makes a user's directory: another account's
    # name would be taken for good. Without one of its own account's, it spills.
    done = big_shared_result(tmp_path, root, name)
    assert done.outcome is not None and done.outcome.ok, done.stderr
    assert done.outcome.result_path == str(tmp_path / "result.bin") and not user_dir.exists()
    assert b"gateway instead" not in done.stderr  # nothing went wrong: nothing to say
    user_dir.mkdir(mode=0o700)  # as the owner's sdk makes it (here: the same account)
    done = big_shared_result(tmp_path, root, name)
    outcome = done.outcome
    assert outcome is not None and outcome.ok, done.stderr
    # Exactly the name the nodelet gave, in the owner's own private directory.
    assert outcome.result_path == str(root / name)
    assert user_dir.stat().st_uid == os.geteuid() and user_dir.stat().st_mode & 0o777 == 0o700
    assert (root / name).stat().st_mode & 0o777 == 0o600
    assert not list(user_dir.glob("*.part")), "the temporary file was left behind"


def test_a_big_result_avoids_a_user_directory_that_is_not_the_owners(tmp_path: Path) -> None:
    """Someone else made the owner's directory of the shared directory before the owner did:
    the result is not written where they could read or replace it, but spilled (the nodelet
    uploads it), and the call's output says why."""
    from bulletin_core import shared

    root = tmp_path / "nas"
    root.mkdir()
    shared.prepare(str(root))
    squatted = root / shared.user_dir("alice")
    squatted.mkdir(mode=0o777)
    squatted.chmod(0o777)  # writable by anyone: as good as another's
    done = big_shared_result(tmp_path, root, shared.result_name("alice", "inv-1", 0))
    outcome = done.outcome
    assert outcome is not None and outcome.ok, done.stderr
    assert outcome.result_path == str(tmp_path / "result.bin")
    assert not list(squatted.iterdir())
    assert b"goes through the gateway instead" in done.stdout + done.stderr


def allocate(mib: int) -> tuple[int, int]:
    import resource

    block = b"x" * (mib << 20)
    return len(block) >> 20, resource.getrlimit(resource.RLIMIT_AS)[0] >> 20


def test_an_address_space_limit_is_set_before_the_call_runs(tmp_path: Path) -> None:
    done = run_worker(tmp_path, call(allocate, 16), env={RLIMIT_ENV: "300"})
    assert done.outcome is not None and done.outcome.ok, done.stderr
    assert loads(done.outcome.result) == (16, 300)


def test_memory_error_under_the_address_space_limit_is_out_of_memory(tmp_path: Path) -> None:
    done = run_worker(tmp_path, call(allocate, 1024), env={RLIMIT_ENV: "300"})
    assert done.returncode == 0, done.stderr
    outcome = done.outcome
    assert outcome is not None and not outcome.ok
    assert (outcome.error_kind, outcome.error_type) == (wire.ErrorKind.OUT_OF_MEMORY, "MemoryError")
    assert outcome.error_message == (
        "the call ran out of memory at its limit of 300 MiB of address space per process "
        "(RLIMIT_AS): MemoryError"
    )
    assert "in allocate" in (outcome.traceback or "")
    assert outcome.started is not None and outcome.finished is not None


def raise_memory_error() -> None:
    raise MemoryError("the user's own")


def test_memory_error_without_a_limit_stays_the_users_error(tmp_path: Path) -> None:
    done = run_worker(tmp_path, call(raise_memory_error))
    assert done.outcome is not None
    assert (done.outcome.error_kind, done.outcome.error_type) == (
        wire.ErrorKind.USER,
        "MemoryError",
    )


def handle_sigterm() -> bool:
    import signal

    fresh = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    signal.signal(signal.SIGTERM, lambda *_: None)
    return fresh


def test_a_sigterm_handler_a_call_installs_is_gone_for_the_next_call(tmp_path: Path) -> None:
    tasks = [
        wire.WorkerTask(
            invocation_id=f"inv-{i}",
            payload=call(handle_sigterm),
            end_marker=b"\x00end\x00",
        )
        for i in range(2)
    ]
    done, outcomes = run_worker_process(
        b"".join(b"".join(frame(t)) for t in tasks), cwd=tmp_path, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert [loads(outcomes[f"inv-{i}"].result) for i in range(2)] == [True, True]


def start_threads(leave: bool) -> int:
    """Start a thread that ends by itself at once and, if ``leave``, one left running."""
    import threading
    import time

    threading.Thread(target=time.sleep, args=(0.01,), name="ends-soon").start()
    if leave:
        threading.Thread(target=time.sleep, args=(600,), name="left-running", daemon=True).start()
    return os.getpid()


def test_a_call_that_leaves_a_thread_running_is_its_workers_last(tmp_path: Path) -> None:
    marker = b"\x00end\x00"
    tasks = [
        wire.WorkerTask(
            invocation_id=f"inv-{i}",
            payload=call(start_threads, leave),
            end_marker=marker,
        )
        for i, leave in enumerate([False, True, False])
    ]
    done, outcomes = run_worker_process(
        b"".join(b"".join(frame(t)) for t in tasks),
        cwd=tmp_path,
        timeout=60,
        start_new_session=True,
    )
    # A thread that ended by itself keeps the worker warm; one left running ends it: its
    # call's outcome is written, without an end marker, and no other call runs in it.
    assert done.returncode == 0, done.stderr
    assert done.stdout == marker
    assert done.stderr.startswith(marker)
    assert b"bulletin: the call left 1 thread(s) running ('left-running')" in done.stderr
    assert loads(outcomes["inv-0"].result) == loads(outcomes["inv-1"].result)
    assert "inv-2" not in outcomes


def meddle_with_env() -> tuple[str | None, str | None, str | None]:
    seen = (os.environ.get("KEPT"), os.environ.get("DROPPED"), os.environ.get("ADDED"))
    os.environ["KEPT"] = "changed"
    del os.environ["DROPPED"]
    os.environ["ADDED"] = "new"
    return seen


def test_the_environment_a_call_changed_is_put_back_for_the_next(tmp_path: Path) -> None:
    payload = call(meddle_with_env)
    tasks = [
        wire.WorkerTask(invocation_id=f"inv-{i}", payload=payload, end_marker=b"\0e\0")
        for i in range(2)
    ]
    env = {**os.environ, "KEPT": "as started", "DROPPED": "here"}
    done, outcomes = run_worker_process(
        b"".join(b"".join(frame(t)) for t in tasks), env=env, cwd=tmp_path, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert [loads(outcomes[f"inv-{i}"].result) for i in range(2)] == [
        ("as started", "here", None),
        ("as started", "here", None),
    ]


def test_a_share_caps_torch_s_cuda_memory_and_a_whole_gpu_call_lifts_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker's side of the cap, with the GPU faked (a torch whose CUDA is available
    and records the fraction asked): the CUDA acceptance test checks torch enforces it."""
    import types

    from nodelet.worker_main import cap_gpu_memory

    fractions: list[tuple[float, int]] = []
    cuda = types.SimpleNamespace(
        is_available=lambda: True,
        set_per_process_memory_fraction=lambda f, d: fractions.append((f, d)),
    )
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.delenv("BULLETIN_GPU_SHARE", raising=False)
    cap_gpu_memory(0.25)
    assert os.environ["BULLETIN_GPU_SHARE"] == "0.25" and fractions == [(0.25, 0)]
    cap_gpu_memory(1.0)  # the warm worker's next call has whole GPUs
    assert "BULLETIN_GPU_SHARE" not in os.environ and fractions[-1] == (1.0, 0)
