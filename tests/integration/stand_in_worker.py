"""A stand-in for ``nodelet.worker_main`` that speaks its protocol (length-prefixed msgpack
WorkerTasks on stdin, a length-prefixed WorkerOutcome on the outcome pipe, the end marker
on both pipes) but
unpickles nothing, so the nodelet's handling of payloads and results is tested on its own.

A payload is ``b"<command>\\n<data>"``; the result envelope is ``<data>``:
``echo`` returns it inline up to ``inline_limit`` and spills it into ``spill_dir`` above;
``echo-shared`` writes it as the task's result file of the shared directory when the task
names one;
``outside`` leaves it in a file outside both; ``double`` spills ``<data>`` twice. Each task
is recorded (its fields, and the size and SHA-256 of the payload it received) as a JSON line
in ``tasks.jsonl`` in the working directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from typing import IO

import msgspec

from bulletin_core import shared, wire
from nodelet.worker_main import OUTCOME_ENV

CHUNK = 1 << 20


def read_task(stream: IO[bytes]) -> wire.WorkerTask | None:
    prefix = stream.read(4)
    if len(prefix) < 4:
        return None
    return msgspec.msgpack.decode(stream.read(int.from_bytes(prefix, "big")), type=wire.WorkerTask)


def payload_file(task: wire.WorkerTask) -> IO[bytes]:
    if task.payload_file is not None and task.shared_dir is not None:
        return shared.open_file(task.shared_dir, task.payload_file)
    if task.payload_path is not None:
        return open(task.payload_path, "rb")
    spooled = tempfile.TemporaryFile()  # noqa: SIM115 (closed by the caller)
    spooled.write(task.payload or b"")
    spooled.seek(0)
    return spooled


def record(task: wire.WorkerTask, payload: IO[bytes]) -> None:
    digest, size = hashlib.sha256(), 0
    while chunk := payload.read(CHUNK):
        digest.update(chunk)
        size += len(chunk)
    payload.seek(0)
    fields = msgspec.to_builtins(task)
    fields.pop("payload")
    fields.pop("end_marker")
    fields["inline"] = task.payload is not None
    fields["payload_size"], fields["payload_sha256"] = size, digest.hexdigest()
    with open("tasks.jsonl", "a") as log:
        log.write(json.dumps(fields) + "\n")


def run(task: wire.WorkerTask) -> wire.WorkerOutcome:
    with payload_file(task) as payload:
        record(task, payload)
        command = payload.readline().strip().decode()
        start = payload.tell()
        size = payload.seek(0, os.SEEK_END) - start
        payload.seek(start)
        if command == "echo" and size <= task.inline_limit:
            return wire.WorkerOutcome(ok=True, result=payload.read())
        if command == "echo-shared" and task.shared_dir and task.shared_result:
            path = shared.write_file(task.shared_dir, task.shared_result, [payload.read()])
            return wire.WorkerOutcome(ok=True, result_path=path)
        if command == "outside":
            path = os.path.join(tempfile.mkdtemp(), "result.bin")
        else:
            path = os.path.join(task.spill_dir, "result.bin")
        with open(path, "wb") as out:
            shutil.copyfileobj(payload, out, CHUNK)
            if command == "double":
                payload.seek(start)
                shutil.copyfileobj(payload, out, CHUNK)
    print(f"result of {size} bytes in a file", flush=True)
    return wire.WorkerOutcome(ok=True, result_path=path)


def finish(task: wire.WorkerTask, outcome: wire.WorkerOutcome) -> None:
    tagged = msgspec.structs.replace(outcome, invocation_id=task.invocation_id)
    body = msgspec.msgpack.encode(tagged)
    os.write(int(os.environ[OUTCOME_ENV]), len(body).to_bytes(4, "big") + body)
    sys.stdout.flush()
    for fd in (1, 2):
        os.write(fd, task.end_marker)


def main() -> None:
    while (task := read_task(sys.stdin.buffer)) is not None:
        finish(task, run(task))
        if not task.end_marker:
            return


if __name__ == "__main__":
    main()
