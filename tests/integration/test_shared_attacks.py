"""The cluster's shared directory between users who do not trust each other: each user's
files live in a directory only their account can enter, under names derived from their
invocations; another user can neither read them, take their names, pass them off as their
own, nor break the owner's calls by making the owner's directory first.

The notebooks are real sdk processes running as the Unix accounts ``bt-alice`` and
``bt-bob`` (tests/accounts.py); the nodelet runs as root with a user mapping.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bulletin_core import shared, wire
from tests.accounts import Portable, traversable_dir
from tests.conftest import Cluster, running
from tests.integration.conftest import killed_after
from tests.integration.test_gateway_api import Http, status

MiB = 1 << 20


@dataclass
class Lab:
    cluster: Cluster
    nas: Path
    tokens: dict[str, str]
    python: Portable
    uids: dict[str, int]

    def notebook(self, user: str, code: str, timeout: float = 120) -> Any:
        """Run ``code`` in an sdk process as ``user``'s account; what it printed last, as JSON
        (its warnings go to stderr, returned under "stderr")."""
        env = {"BULLETIN_URL": self.cluster.url, "BULLETIN_TOKEN": self.tokens[user]}
        prelude = "import json, os, sys, time, warnings\nimport sdk\n"
        done = self.python.run_as(
            user, ["-c", prelude + textwrap.dedent(code)], env=env, timeout=timeout
        )
        assert done.returncode == 0, f"{user}'s notebook failed:\n{done.stdout}\n{done.stderr}"
        found = json.loads(done.stdout.strip().splitlines()[-1])
        if isinstance(found, dict):
            found["stderr"] = done.stderr
        return found

    def user_dir(self, user: str) -> Path:
        return self.nas / shared.user_dir(user)


@pytest.fixture
def lab(
    database_url: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    portable_python: Portable,
    unix_accounts: dict[str, int],
) -> Iterator[Lab]:
    with (
        traversable_dir("bulletin-nas-") as nas,
        killed_after(unix_accounts),
        running(Cluster(database_url, tmp_path), request, shared_dir=nas) as cluster,
    ):
        tokens = {name: cluster.add_user(name) for name in unix_accounts}
        cluster.start_nodelet(python=portable_python, **{"user-mapping": "same-name"})
        yield Lab(cluster, nas, tokens, portable_python, unix_accounts)


# A call whose argument and result are both over the inline limit (1 MiB): both go as files.
BIG_CALL = """
@sdk.function()
def grow(data):
    return data * 2
"""


def test_big_state_travels_through_the_owners_own_directory(lab: Lab) -> None:
    seen = lab.notebook(
        "bt-alice",
        BIG_CALL
        + """
call = grow.spawn(b"a" * (2 << 20))
assert call.result(timeout=60) == b"a" * (4 << 20)
print(json.dumps({"id": call.id}))
""",
    )
    done = status(Http(lab.cluster.url, lab.tokens["bt-alice"]), seen["id"])
    assert done.result_file == shared.result_name("bt-alice", seen["id"], 1)
    mine = lab.user_dir("bt-alice").stat()
    assert (mine.st_uid, mine.st_mode & 0o777) == (lab.uids["bt-alice"], 0o700)
    # What the notebook consumed it deleted (its payload at the end, its result once loaded).
    assert not (lab.nas / done.result_file).exists()


def test_another_user_can_neither_read_nor_take_the_names_of_an_owners_files(lab: Lab) -> None:
    # Alice's calls leave files in her directory: a payload, results not loaded yet.
    alice = lab.notebook(
        "bt-alice",
        BIG_CALL
        + """
calls = [grow.spawn(b"x" * (2 << 20)) for _ in range(3)]
while any(c.status() not in ("succeeded", "failed") for c in calls):
    time.sleep(0.05)
print(json.dumps({"ids": [c.id for c in calls]}))
""",
    )
    files = [shared.result_name("bt-alice", i, 1) for i in alice["ids"]]
    assert all((lab.nas / f).is_file() for f in files)
    # Bob, on a machine that mounts the shared directory, tries everything.
    tried = lab.notebook(
        "bt-bob",
        f"""
root, mine, files = {str(lab.nas)!r}, {str(lab.user_dir("bt-alice"))!r}, {files!r}
tried = {{}}
for name, attempt in {{
    "list": lambda: os.listdir(mine),
    "read": lambda: open(os.path.join(root, files[0]), "rb").read(1),
    "replace": lambda: os.replace("/etc/hostname", os.path.join(root, files[1])),
    "create": lambda: open(os.path.join(mine, "." + files[2].rsplit("/", 1)[1] + ".part"), "wb"),
    "delete": lambda: os.unlink(os.path.join(root, files[2])),
    "take-over": lambda: os.rename(mine, mine + "-gone"),
}}.items():
    try:
        attempt()
        tried[name] = "done"
    except OSError as exc:
        tried[name] = type(exc).__name__
print(json.dumps(tried))
""",
    )
    tried.pop("stderr")
    assert set(tried.values()) == {"PermissionError"}, tried
    # And Alice's results are hers, whole, however often she asks.
    loaded = lab.notebook(
        "bt-alice",
        f"""
sizes = [len(sdk.Call.from_id(i).result(timeout=60)) for i in {alice["ids"]!r}]
print(json.dumps(sizes))
""",
    )
    assert loaded == [4 * MiB] * 3


def test_a_directory_made_by_another_user_first_is_not_used_and_the_call_still_runs(
    lab: Lab,
) -> None:
    # Bob makes Alice's directory before she ever used the shared directory, open to all.
    lab.notebook(
        "bt-bob",
        f"""
os.mkdir({str(lab.user_dir("bt-alice"))!r})
os.chmod({str(lab.user_dir("bt-alice"))!r}, 0o777)
print(json.dumps("made"))
""",
    )
    seen = lab.notebook(
        "bt-alice",
        BIG_CALL
        + """
assert grow(b"s" * (2 << 20)) == b"s" * (4 << 20)
print(json.dumps({"ok": True}))
""",
    )
    # Her state went through the gateway, she was told why, and nothing of hers is in Bob's.
    assert "big call state goes through the gateway instead" in seen["stderr"]
    assert "belongs to uid" in seen["stderr"]
    assert not list(lab.user_dir("bt-alice").iterdir())


def test_a_call_cannot_pass_off_another_users_result_file_as_its_own(lab: Lab) -> None:
    alice = lab.notebook(
        "bt-alice",
        BIG_CALL
        + """
call = grow.spawn(b"p" * (2 << 20))
while call.status() != "succeeded":
    time.sleep(0.05)
print(json.dumps({"id": call.id}))
""",
    )
    alices_file = lab.nas / shared.result_name("bt-alice", alice["id"], 1)
    assert alices_file.is_file()
    # Bob's call names her file as its result (it writes its own outcome, as any code can).
    bob = lab.notebook(
        "bt-bob",
        f"""
def steal(path):
    # An outcome of its own making on the worker's outcome pipe (the one write-only pipe
    # past stderr), tagged with the call's id (its task is on the worker's stack).
    import msgspec
    from bulletin_core import wire
    frame = sys._getframe()
    while not isinstance(frame.f_locals.get("task"), wire.WorkerTask):
        frame = frame.f_back
    task = frame.f_locals["task"]
    outcome = wire.WorkerOutcome(invocation_id=task.invocation_id, ok=True, result_path=path)
    body = msgspec.msgpack.encode(outcome)
    for fd in [int(name) for name in os.listdir("/proc/self/fd") if int(name) > 2]:
        try:
            if not os.readlink(f"/proc/self/fd/{{fd}}").startswith("pipe:"):
                continue
            flags = open(f"/proc/self/fdinfo/{{fd}}").read().split("flags:")[1].split()[0]
        except OSError:  # the descriptor listdir itself used
            continue
        if int(flags, 8) & os.O_ACCMODE == os.O_WRONLY:
            os.write(fd, len(body).to_bytes(4, "big") + body)
    os._exit(0)

call = sdk.function(max_retries=0)(steal).spawn({str(alices_file)!r})
try:
    call.result(timeout=60)
    print(json.dumps({{"id": call.id, "stole": True}}))
except sdk.BulletinError as exc:
    print(json.dumps({{"id": call.id, "error": str(exc)}}))
""",
    )
    assert "stole" not in bob, bob
    bobs = status(Http(lab.cluster.url, lab.tokens["bt-bob"]), bob["id"])
    assert (bobs.state, bobs.error_kind) == (wire.State.FAILED, wire.ErrorKind.WORKER_DIED)
    assert bobs.result_file is None and bobs.result_blob is None
    # The gateway has nothing of Alice's to give Bob, and still all of it for Alice.
    bob_http = Http(lab.cluster.url, lab.tokens["bt-bob"])
    assert bob_http.get(f"/v1/invocations/{bob['id']}/result").status_code == 404
    assert bob_http.get(f"/v1/invocations/{alice['id']}/result").status_code == 404
    alice_http = Http(lab.cluster.url, lab.tokens["bt-alice"])
    served = alice_http.get(f"/v1/invocations/{alice['id']}/result")
    assert served.status_code == 200 and len(served.content) > 4 * MiB
