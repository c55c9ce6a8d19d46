"""A call's code attacks the nodelet (root) through what it leaves for it: a symbolic link
flipped under the result it uploads, a FIFO where its result goes, outcomes of its own
making on its worker's outcome pipe (one of gigabytes, one cut short with the pipe held
open, one naming a file that is not its own). Each must fail the attacker's call alone: no
byte of what root can read leaks, and other users' calls on the node finish.

Through a real cluster whose nodelet runs as root with a user mapping (tests/accounts.py).
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from typing import Any

import pytest

import sdk
from bulletin_core import wire
from tests.integration.conftest import Tenants, wait_until_running
from tests.integration.test_gateway_api import status
from tests.processes import forge_outcome, outcome_descriptor

# -------------------------------------------------------- run by the worker, as the attacker


def own_outcome(result_path: str) -> None:
    """Write an outcome of our own, naming ``result_path`` as the result, on the worker's
    outcome pipe (the caller ends the worker at once, so it never writes its own)."""
    forge_outcome(result_path=result_path)


def named_result(rendezvous: str) -> None:
    """Name result.bin as the result, tell another call of ours (:func:`flip`) where it is
    in the file ``rendezvous``, and end the worker at once, once that call flips it (so the
    worker never writes its own outcome)."""
    import os
    import time

    here = os.getcwd()
    own_outcome(os.path.join(here, "result.bin"))
    with open(f"{rendezvous}.tmp", "w") as file:
        file.write(here)
    os.replace(f"{rendezvous}.tmp", rendezvous)
    deadline = time.time() + 30
    while not os.path.lexists(os.path.join(here, "result.bin")) and time.time() < deadline:
        time.sleep(0.001)
    os._exit(0)


def flip(rendezvous: str, target: str, seconds: float) -> None:
    """Once the file ``rendezvous`` names the directory of a call that named result.bin as
    its result (:func:`named_result`), keep swapping result.bin there between a harmless
    file and a symbolic link to ``target`` for ``seconds``, while the nodelet reads it. From
    another call of the same account: whatever the attacked call starts is killed before the
    nodelet reads its outcome, a thread it leaves running ends its worker, but another call
    runs on. Until the attempt's directory is removed."""
    import os
    import time

    deadline = time.time() + 60
    while not os.path.exists(rendezvous):
        if time.time() > deadline:
            raise TimeoutError("the attacked call never said where it is")
        time.sleep(0.001)
    with open(rendezvous) as file:
        here = file.read()
    end = time.time() + seconds
    while time.time() < end:
        try:
            with open(os.path.join(here, "r.tmp"), "wb") as file:
                file.write(b"harmless")
            os.replace(os.path.join(here, "r.tmp"), os.path.join(here, "result.bin"))
            os.symlink(target, os.path.join(here, "l.tmp"))
            os.replace(os.path.join(here, "l.tmp"), os.path.join(here, "result.bin"))
        except FileNotFoundError:
            return  # the attempt is over: the nodelet removed its directory


def fifo() -> None:
    """Put a FIFO where the result is, and name it as our result."""
    import os

    os.mkfifo("result.bin")
    own_outcome(os.path.join(os.getcwd(), "result.bin"))
    os._exit(0)


def cut_outcome() -> None:
    """Start an outcome that never ends, its pipe held open by a child that sleeps."""
    import os
    import time

    fd = outcome_descriptor()
    os.write(fd, (1000).to_bytes(4, "big") + b"x" * 10)
    if os.fork() == 0:
        time.sleep(600)
    os._exit(0)


def huge_outcome() -> None:
    """An outcome that says it is 4 GiB long (what follows costs the attacker nothing)."""
    import os

    os.write(outcome_descriptor(), (0xFFFFFFF0).to_bytes(4, "big"))
    os._exit(0)


def name_as_result(path: str) -> None:
    """Name any file as our result (the node token, another user's result file)."""
    import os

    own_outcome(path)
    os._exit(0)


def deep_tree(depth: int) -> str:
    """Leave a tree deeper than a recursive removal (or one descriptor a level) can take."""
    import os

    here = os.getcwd()
    for _ in range(depth):
        os.mkdir("d")
        os.chdir("d")
    os.chdir(here)
    return here


def plant_links(targets: list[str], files: int) -> str:
    """Leave symbolic links to ``targets`` where the nodelet cleans up after the call, and
    ``files`` plain files beside them."""
    import os

    for n, target in enumerate(targets):
        os.symlink(target, f"link-{n}")
    for n in range(files):
        with open(f"file-{n}", "w") as file:
            file.write("x")
    return os.getcwd()


def leave_big_file(mib: int) -> str:
    """Leave a file of ``mib`` MiB (really allocated) where the nodelet cleans up."""
    import os

    with open("big", "wb") as file:
        file.write(os.urandom(1 << 20) * mib)
    return os.getcwd()


def where_am_i(leave: str) -> tuple[str, list[str]]:
    """The call's directory, what was in it when the call began, and a file left there."""
    import os

    found = sorted(os.listdir("."))
    with open(leave, "w") as file:
        file.write("left")
    return os.getcwd(), found


def unacceptable_outcome(ran: str) -> None:
    """Write an outcome the gateway refuses (a NUL in its text: the worker escapes those,
    but the call writes this one itself), and count how often this code ran."""
    import os

    from bulletin_core import wire

    with open(ran, "a") as runs:
        runs.write("ran\n")
    forge_outcome(ok=False, error_kind=wire.ErrorKind.USER, error_message="a\x00b")
    os._exit(0)


def hold(seconds: float) -> str:
    import time

    time.sleep(seconds)
    return "alice's result"


def attack(t: Tenants, fn: Any, *args: Any) -> wire.Invocation:
    """Run Bob's attacking call to its end; the invocation as Bob sees it."""
    t.be("bt-bob")
    call = sdk.function(max_retries=0)(fn).spawn(*args)
    with contextlib.suppress(sdk.BulletinError):
        call.result(timeout=60)
    return status(t.http("bt-bob"), call.id)


def leaked(t: Tenants, invocation: wire.Invocation, secret: bytes) -> bool:
    """Whether ``secret`` is anywhere Bob can read of his invocation."""
    http = t.http("bt-bob")
    seen = http.get(f"/v1/invocations/{invocation.id}").content
    seen += http.get(f"/v1/invocations/{invocation.id}/result").content
    seen += http.get(f"/v1/invocations/{invocation.id}/logs").content
    return secret in seen


def test_a_symlink_flipped_under_the_result_never_makes_root_read_the_target(
    tenants: Tenants,
) -> None:
    token = tenants.node_token.read_bytes().strip()
    for _ in range(4):
        rendezvous = f"/tmp/bulletin-flip-{uuid.uuid4().hex}"
        tenants.be("bt-bob")
        flipper = sdk.function(max_retries=0)(flip).spawn(rendezvous, str(tenants.node_token), 3.0)
        try:
            done = attack(tenants, named_result, rendezvous)
            flipper.result(timeout=60)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(rendezvous)
        assert not leaked(tenants, done, token)
        # Refused as a link, or uploaded while it was the harmless file: never the token.
        refused = done.state == wire.State.FAILED and "symbolic link" in (done.error_message or "")
        assert refused or done.result_blob is not None, done


def test_a_fifo_for_the_result_or_an_outcome_cut_short_does_not_wedge_the_node(
    tenants: Tenants,
) -> None:
    tenants.be("bt-alice")
    alices = sdk.function()(hold).spawn(6.0)
    wait_until_running(alices)
    started = time.monotonic()
    done = attack(tenants, fifo)
    assert (done.state, done.error_kind) == (wire.State.FAILED, wire.ErrorKind.WORKER_DIED)
    assert "not a regular file" in (done.error_message or ""), done.error_message
    done = attack(tenants, cut_outcome)
    assert (done.state, done.error_kind) == (wire.State.FAILED, wire.ErrorKind.WORKER_CRASHED)
    assert "without leaving a result" in (done.error_message or ""), done.error_message
    assert time.monotonic() - started < 20
    # The node kept heartbeating: Alice's call was never requeued and finished.
    assert alices.result(timeout=60) == "alice's result"
    assert status(tenants.http("bt-alice"), alices.id).attempts == 1


def test_an_outcome_of_gigabytes_is_refused_unread(tenants: Tenants) -> None:
    started = time.monotonic()
    done = attack(tenants, huge_outcome)
    assert (done.state, done.error_kind) == (wire.State.FAILED, wire.ErrorKind.WORKER_DIED)
    assert "over the limit" in (done.error_message or "")
    assert time.monotonic() - started < 20


def test_an_outcome_naming_a_file_that_is_not_the_attempts_own_is_refused(
    tenants: Tenants,
) -> None:
    token = tenants.node_token.read_bytes().strip()
    for path in (str(tenants.node_token), "/etc/shadow", "/home/bt-alice/.profile"):
        done = attack(tenants, name_as_result, path)
        assert (done.state, done.error_kind) == (wire.State.FAILED, wire.ErrorKind.WORKER_DIED)
        assert "refused" in (done.error_message or "")
        assert not leaked(tenants, done, token)


def test_a_tree_too_deep_to_remove_recursively_costs_the_node_nothing(tenants: Tenants) -> None:
    from pathlib import Path

    from tests.conftest import wait_until

    tenants.be("bt-bob")
    out = Path(sdk.function()(deep_tree)(5000))
    # Removed as Bob's own account, out of the nodelet's process: nothing is left behind.
    wait_until(lambda: not out.parent.exists(), 30, f"{out.parent} to be removed")
    tenants.be("bt-alice")
    assert sdk.function()(hold)(0.0) == "alice's result"
    log = (tenants.cluster.dir / "node-a.log").read_text()
    assert "crashed" not in log and "Traceback" not in log


@pytest.mark.parametrize("files", [0, 20], ids=["unlinked-by-the-node", "removed-as-the-account"])
def test_links_left_for_the_clean_up_are_removed_as_links_never_what_they_name(
    tenants: Tenants, files: int
) -> None:
    from pathlib import Path

    from tests.conftest import wait_until

    token = tenants.node_token.read_bytes()
    node_dir = tenants.node_token.parent
    before = sorted(p.name for p in node_dir.iterdir())
    targets = [str(tenants.node_token), str(node_dir), "/etc/passwd"]
    tenants.be("bt-bob")
    out = Path(sdk.function()(plant_links)(targets, files))
    # Removed, or (a few plain entries, unlinked by the node) kept empty for Bob's next call.
    wait_until(lambda: not out.exists() or not any(out.iterdir()), 30, f"{out} to be emptied")
    assert tenants.node_token.read_bytes() == token
    assert sorted(p.name for p in node_dir.iterdir()) == before
    assert Path("/etc/passwd").stat().st_size > 0
    log = (tenants.cluster.dir / "node-a.log").read_text()
    assert "left in place" not in log and "Traceback" not in log


def test_a_big_file_left_behind_is_removed_as_the_account_and_its_directory_not_kept(
    tenants: Tenants,
) -> None:
    """Freeing a big file's blocks takes a while: never on the nodelet's event loop."""
    from pathlib import Path

    from tests.conftest import wait_until

    tenants.be("bt-bob")
    out = Path(sdk.function()(leave_big_file)(8))
    wait_until(lambda: not out.parent.exists(), 30, f"{out.parent} to be removed")


def test_a_directory_kept_for_the_next_call_is_empty_and_only_ever_its_owners(
    tenants: Tenants,
) -> None:
    seen: dict[str, set[str]] = {"bt-alice": set(), "bt-bob": set()}
    for n in range(6):
        user = ("bt-alice", "bt-bob")[n % 2]
        tenants.be(user)
        here, found = sdk.function()(where_am_i)(f"{user}-{n}")
        assert found == [], f"{user}'s call began among {found}"
        seen[user].add(here)
    assert not seen["bt-alice"] & seen["bt-bob"], seen
    # Kept, not remade each time: a user's calls one after the other reuse their directory.
    assert len(seen["bt-alice"]) < 3 and len(seen["bt-bob"]) < 3, seen


def test_an_outcome_the_gateway_refuses_fails_the_call_once_and_never_reruns_it(
    tenants: Tenants,
) -> None:
    # Abandoned, such a call would be requeued when its lease lapsed and its code run again
    # (at-most-once on the user's failure): it is failed at once instead.
    import os
    import pwd
    from pathlib import Path

    from tests.accounts import traversable_dir

    with traversable_dir("bulletin-runs-") as where:
        ran = where / "ran"
        ran.touch()
        os.chown(ran, pwd.getpwnam("bt-bob").pw_uid, -1)
        tenants.be("bt-bob")
        call = sdk.function(max_retries=2)(unacceptable_outcome).spawn(str(ran))
        with contextlib.suppress(sdk.BulletinError):
            call.result(timeout=60)
        done = status(tenants.http("bt-bob"), call.id)
        assert (done.state, done.error_kind) == (wire.State.FAILED, wire.ErrorKind.WORKER_DIED)
        assert "refused by the gateway" in (done.error_message or "")
        time.sleep(4)  # past a lease (3 s here): it would have run again by now
        again = status(tenants.http("bt-bob"), call.id)
        assert again.attempts == 1 and Path(ran).read_text() == "ran\n"
