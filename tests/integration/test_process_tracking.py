"""Nothing a call starts outlives it (DESIGN.md invariant 9), for each way a node tracks a
call's processes (``--process-tracking``: a cgroup v2, a cgroup v1, the subreaper): a plain
child, a setsid child and a double-forked daemon are all dead once the call returns (its
warm worker kept, and still working), hits its time limit, or is cancelled; and once its
nodelet is SIGKILLed (the workers see their lifeline end) and restarted (the new nodelet
kills what a worker stuck holding the GIL left, before it registers). And a call cannot
steer the root nodelet into killing what is not its own: it cannot move a process into its
cgroup or out of it, nor read or write the nodelet's record.

Real gateway and nodelet (as root, running calls as real accounts: tests/accounts.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle
import httpx
import pytest

import sdk
from tests.accounts import Portable, traversable_dir
from tests.conftest import Cluster, running, wait_until
from tests.integration.conftest import killed_after
from tests.processes import alive, parent, start_escapees

cloudpickle.register_pickle_by_value(sys.modules[__name__])

USER = "bt-alice"


def start_three(record: str, then: str) -> dict[str, Any]:
    """Start a plain child, a setsid child and a double-forked daemon, and write their pids
    (with this worker's pid, its cgroups and the daemon's parent) to the file ``record``;
    then ``then``: "return" the record, "sleep", "exit" (the worker, at once), or "hold-gil"
    (sleep in C holding the GIL, so that no thread of the worker runs)."""
    import ctypes
    import json
    import os
    import time

    pids = start_escapees(1000)
    daemon_parent = parent(pids[2])
    cgroups = []
    for pid in ["self", *pids]:
        with open(f"/proc/{pid}/cgroup") as cgroup:
            cgroups.append(cgroup.read())
    found = {
        "worker": os.getpid(),
        "pids": pids,
        "daemon_parent": daemon_parent,
        "cgroup": cgroups[0],
        "their_cgroups": cgroups[1:],
    }
    with open(f"{record}.tmp", "w") as file:
        json.dump(found, file)
    os.replace(f"{record}.tmp", record)
    if then == "exit":
        os._exit(3)
    if then == "hold-gil":
        ctypes.PyDLL(None).sleep(1000)
    if then != "return":
        time.sleep(1000)
    return found


def own_pid() -> int:
    import os

    return os.getpid()


@dataclass
class Node:
    """A gateway and a nodelet tracking processes by ``mechanism``, running calls as USER."""

    cluster: Cluster
    mechanism: str
    portable: Portable
    #: Where the node token is (root's alone, in a directory every account may traverse).
    secrets: Path
    #: A directory of USER's, for the calls' records.
    records: Path
    fake_gpus: int = 2

    def start(self) -> None:
        """Start (or restart) the nodelet."""
        options = {
            "user-mapping": "same-name",
            "spare-workers": "1",
            "kill-grace-s": "0.5",
            "process-tracking": self.mechanism,
        }
        self.cluster.start_nodelet(
            fake_gpus=self.fake_gpus,
            cpu_slots=3,
            python=self.portable,
            token_dir=self.secrets,
            **options,
        )

    def spawn(self, tag: str, then: str, **decorator: Any) -> sdk.Call[Any]:
        fn = sdk.function(max_retries=0, **decorator)(start_three)
        return fn.spawn(str(self.records / tag), then)

    def recorded(self, tag: str) -> dict[str, Any]:
        path = self.records / tag
        wait_until(path.exists, 30, f"the call {tag} to start its processes")
        found: dict[str, Any] = json.loads(path.read_text())
        return found

    def log(self) -> str:
        return (self.cluster.dir / "node-a.log").read_text()


MECHANISMS = ["cgroup2", "cgroup1", "subreaper"]


@contextlib.contextmanager
def tracked(
    cluster: Cluster,
    mechanism: str,
    portable: Portable,
    accounts: dict[str, int],
    token: str,
    fake_gpus: int = 2,
) -> Iterator[Node]:
    """A nodelet tracking by ``mechanism`` on ``cluster``, the sdk connected with ``token``;
    afterwards every process of the test accounts is killed."""
    with (
        traversable_dir("bulletin-node-") as secrets,
        traversable_dir("bulletin-records-") as parent,
        killed_after(accounts),
    ):
        records = parent / "records"
        records.mkdir(mode=0o700)
        os.chown(records, accounts[USER], pwd.getpwnam(USER).pw_gid)
        client = sdk.connect(cluster.url, token)
        client.use_shared_dir = False  # this process is root: its files are not the users'
        found = Node(cluster, mechanism, portable, secrets, records, fake_gpus)
        found.start()
        yield found


@pytest.fixture(params=MECHANISMS)
def node(
    request: pytest.FixtureRequest,
    gateway: Cluster,
    portable_python: Portable,
    unix_accounts: dict[str, int],
) -> Iterator[Node]:
    token = gateway.add_user(USER)
    with tracked(gateway, request.param, portable_python, unix_accounts, token) as found:
        yield found


def _all_gone(pids: list[int], timeout: float, what: str) -> None:
    wait_until(lambda: not any(map(alive, pids)), timeout, what)


def _assert_tracked(node: Node, found: dict[str, Any]) -> None:
    """The mechanism the nodelet logged holds every process of the call."""
    worker = found["worker"]
    assert found["daemon_parent"] == worker, "the worker, a subreaper, adopts the daemon"
    if node.mechanism == "subreaper":
        assert "bulletin-" not in found["cgroup"]
        return
    line = "0::" if node.mechanism == "cgroup2" else ":freezer:"
    [mine] = [row for row in found["cgroup"].splitlines() if line in row]
    assert re.search(rf"/bulletin-node-node-a-[0-9a-f]+/worker-{worker}$", mine), mine
    for theirs in found["their_cgroups"]:  # setsid or double-forked: in the worker's cgroup
        assert mine in theirs.splitlines()


def test_nothing_a_call_starts_outlives_its_end_time_limit_or_cancellation(node: Node) -> None:
    wait_until(lambda: "process tracking: " in node.log(), 30, "the nodelet to start")
    assert f"process tracking: {node.mechanism} (" in node.log()

    # Returns normally: everything it started is dead before its result is.
    done = node.spawn("returns", "return").result(timeout=60)
    _assert_tracked(node, done)
    assert not any(map(alive, done["pids"])), "a process outlived the call's end"
    # ... and its worker was kept warm, and runs the next call.
    assert sdk.function()(own_pid)() == done["worker"]

    # Hits its time limit.
    timed = node.spawn("times-out", "sleep", timeout=1)
    found = node.recorded("times-out")
    _assert_tracked(node, found)
    with pytest.raises(sdk.CallTimedOut):
        timed.result(timeout=60)
    _all_gone([found["worker"], *found["pids"]], 10, "the timed-out call's processes to die")

    # Cancelled.
    cancelled = node.spawn("cancelled", "sleep")
    found = node.recorded("cancelled")
    cancelled.cancel()
    _all_gone([found["worker"], *found["pids"]], 15, "the cancelled call's processes to die")

    # Its worker dies under it: what it started was re-parented, to init (but it is still in
    # the worker's cgroup, which is removed) or to the nodelet (a subreaper too, which kills
    # what it did not start).
    with pytest.raises(sdk.WorkerDiedError, match="exited with code 3"):
        node.spawn("exits", "exit").result(timeout=60)
    found = node.recorded("exits")
    _all_gone(found["pids"], 10, "the processes of a call whose worker died to die")


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_nothing_a_preempted_call_starts_outlives_its_preemption(
    database_url: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    portable_python: Portable,
    unix_accounts: dict[str, int],
    mechanism: str,
) -> None:
    options = {"scheduler-policy": "fair", "preemption-grace-s": "0.5"}
    with running(Cluster(database_url, tmp_path), request, options=options) as cluster:
        cluster.set_group("vision", 0)
        cluster.set_group("nlp", 1)
        alices = cluster.add_user(USER, group="vision")
        bobs = cluster.add_user("bt-bob", group="nlp")
        with tracked(cluster, mechanism, portable_python, unix_accounts, alices, 1) as node:
            borrowed = node.spawn("borrowed", "sleep", gpus=1)  # the only GPU, borrowed
            found = node.recorded("borrowed")
            (node.records / "borrowed").unlink()  # run again later, it records anew
            sdk.connect(cluster.url, bobs).use_shared_dir = False  # alice's keeps its client
            sdk.function(gpus=1)(own_pid)()  # nlp's guaranteed GPU, taken back by preemption
            # The GPU was handed over only once all of the preempted call was dead.
            assert not any(map(alive, [found["worker"], *found["pids"]]))
            assert borrowed.status().preemptions == 1
            borrowed.cancel()


def test_nothing_a_call_starts_outlives_its_nodelet(node: Node) -> None:
    # One call's worker sees its lifeline end when the nodelet dies; another's cannot (a C
    # function holds the GIL): the nodelet's next start kills it, before registering. With
    # a cgroup, a third's worker is killed (with its lifeline) while its nodelet cannot see
    # it: what it started is left to init, but stays in its cgroup, which the next start
    # sweeps. (Without a cgroup, nothing holds such orphans: docs/limits.md.)
    cgroup = node.mechanism != "subreaper"
    lifeline = node.spawn("lifeline", "sleep")
    stuck = node.spawn("stuck", "hold-gil")
    orphaned = node.spawn("orphaned", "sleep") if cgroup else None
    watched, held = node.recorded("lifeline"), node.recorded("stuck")
    left = node.recorded("orphaned")["pids"] if cgroup else []
    nodelet = node.cluster.nodelets[-1]
    nodelet.send_signal(signal.SIGSTOP)
    if cgroup:
        os.kill(node.recorded("orphaned")["worker"], signal.SIGKILL)
    nodelet.send_signal(signal.SIGKILL)
    nodelet.wait()
    _all_gone([watched["worker"], *watched["pids"]], 10, "the lifeline to kill its call's tree")
    record = json.loads((node.cluster.state_dir() / "processes.json").read_text())
    others = [pid for pid, _ in record["workers"] if pid != held["worker"]]
    _all_gone(others, 10, "every other worker (the spare too) to end at its lifeline's end")
    survivors = [held["worker"], *held["pids"], *left]
    assert all(map(alive, survivors)), "only the nodelet's restart kills these"

    node.start()
    wait_until(lambda: node.log().count("registered as") == 2, 30, "the nodelet to restart")
    # Gone when the node registered: the sweep came first, and waited for them to die.
    assert not any(map(alive, survivors)), "a process outlived its nodelet"
    restarted = node.log().rsplit("registered as", 2)[1]
    killed = f"killed {len(survivors)} processes that an earlier nodelet of this node left"
    assert killed in restarted
    assert all(c is None or c.status() in ("running", "failed") for c in (stuck, orphaned))
    assert lifeline.status() in ("running", "failed")


def attempt_escapes(victim: int, state_dir: str) -> dict[str, str]:
    """From inside a call: try to move a process that is not the call's into the call's
    cgroup (so that the nodelet kills it), to move the call out of it, and to read and
    write the nodelet's record; what each attempt met."""
    import os

    from nodelet.cgroups import own_cgroup_dir

    met: dict[str, str] = {}
    here = ""
    for version, hierarchy in ((2, "unified"), (1, "freezer")):
        try:
            here = own_cgroup_dir(version, os.getpid(), hierarchy)
        except Exception:
            continue
        if "bulletin-node-" in here:
            break
    attempts = {
        "move the victim in": (os.path.join(here, "cgroup.procs"), str(victim)),
        "move itself out": (os.path.join(here, "..", "..", "cgroup.procs"), str(os.getpid())),
        "write the record": (os.path.join(state_dir, "processes.json"), "{}"),
    }
    for what, (path, data) in attempts.items():
        try:
            with open(path, "w") as file:
                file.write(data)
            met[what] = "done"
        except OSError as exc:
            met[what] = type(exc).__name__
    try:
        with open(os.path.join(state_dir, "processes.json")) as file:
            met["read the record"] = file.read()
    except OSError as exc:
        met["read the record"] = type(exc).__name__
    met["cgroup"] = here
    return met


@pytest.mark.parametrize("node", ["cgroup2", "cgroup1"], indirect=True)
def test_a_call_cannot_move_processes_into_or_out_of_its_cgroup(node: Node) -> None:
    import subprocess

    victim = subprocess.Popen(["sleep", "1000"])  # root's, as any other user's process
    try:
        state_dir = str(node.cluster.state_dir())
        met = sdk.function(max_retries=0)(attempt_escapes)(victim.pid, state_dir)
        assert "bulletin-node-" in met.pop("cgroup")
        assert met == dict.fromkeys(
            ["move the victim in", "move itself out", "write the record", "read the record"],
            "PermissionError",
        )
        time.sleep(0.5)  # the call's end, and the nodelet's kill of what it left, are done
        assert victim.poll() is None, "the nodelet killed a process that was not the call's"
        # What the nodelet made is root's alone to change.
        for base in json.loads(Path(state_dir, "processes.json").read_text())["cgroups"]:
            for path in [Path(base), *Path(base).rglob("*")]:
                info = path.stat()
                assert info.st_uid == 0 and not info.st_mode & 0o022, path
    finally:
        victim.kill()
        victim.wait()


def test_a_second_start_kills_a_frozen_predecessor_and_all_it_runs_before_it_registers(
    node: Node,
) -> None:
    # The first nodelet is frozen (SIGSTOP: it never hears it was superseded) with a call
    # running whose worker holds the GIL (its lifeline cannot fire either). The second start
    # of the node, of the same state directory, registers, which frees every GPU of the
    # node: by then the first, its workers and what their calls started must be dead.
    stuck = node.spawn("stuck", "hold-gil")
    held = node.recorded("stuck")
    record = json.loads((node.cluster.state_dir() / "processes.json").read_text())
    workers = [pid for pid, _ in record["workers"]]
    assert held["worker"] in workers and len(workers) == 2  # with the spare
    first = node.cluster.nodelets[-1]
    first.send_signal(signal.SIGSTOP)
    node.start()
    wait_until(lambda: node.log().count("registered as") == 2, 30, "the second start")
    assert not any(map(alive, [first.pid, *workers, *held["pids"]])), "the first outlived it"
    assert first.wait(10) == -signal.SIGKILL
    before = node.log().split("registered as")[1]  # up to the second start's registration
    assert f"an earlier nodelet of this node still runs (pid {first.pid})" in before
    assert f"killed the earlier nodelet (pid {first.pid})" in before
    # The new incarnation runs new work; the call of the old one was taken back.
    assert sdk.function()(own_pid)() not in workers
    assert stuck.status() == "failed"


def leave_a_thread(ticks: str) -> int:
    """Start a thread that appends to the file ``ticks`` forever, and return."""
    import os
    import threading
    import time

    def tick() -> None:
        while True:
            with open(ticks, "a") as file:
                file.write(".")
            time.sleep(0.02)

    threading.Thread(target=tick, name="ticker", daemon=True).start()
    return os.getpid()


def test_a_call_that_leaves_a_thread_running_does_not_keep_its_worker_warm(
    gateway: Cluster, tmp_path: Path
) -> None:
    gateway.start_nodelet(**{"spare-workers": "0"})
    sdk.connect(gateway.url, gateway.token)
    ticks = tmp_path / "ticks"
    leaves = sdk.function()(leave_a_thread)
    worker = leaves(str(ticks))
    # The thread does not run on after the call, in a worker kept warm: the worker is
    # retired, and the next call of the same user gets a fresh one.
    _all_gone([worker], 10, "the worker whose call left a thread running to end")
    size = ticks.stat().st_size
    time.sleep(0.2)
    assert ticks.stat().st_size == size, "the thread outlived its call"
    probe = sdk.function()(own_pid)
    assert probe() != worker
    assert probe.last_call is not None and probe.last_call.timings.warm is False
    assert leaves.last_call is not None
    logs = httpx.get(
        f"{gateway.url}/v1/invocations/{leaves.last_call.id}/logs",
        headers={"Authorization": f"Bearer {gateway.token}"},
        timeout=30,
    ).text
    assert "the call left 1 thread(s) running ('ticker')" in logs
