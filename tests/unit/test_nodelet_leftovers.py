"""The state directory and the startup sweep (nodelet/leftovers.py): a directory nobody else
can plant or replace, a record nobody else can write, and a sweep that kills what an earlier
nodelet left, and nothing else: not a process that reuses a recorded pid, not one of another
boot, not a directory that is not a nodelet's cgroup. Real processes and real cgroups."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import msgspec
import pytest

from nodelet import procs
from nodelet.cgroups import own_cgroup_dir
from nodelet.config import NodeletConfig
from nodelet.leftovers import (
    STATE_FILE,
    NodeState,
    _Record,
    base_name,
    default_state_dir,
    kill_recorded,
    open_private_dir,
    sweep,
    temporary_work_dir,
)

# Waits for a line, then starts a child, prints its pid, waits.
PARENT = (
    "import subprocess, sys, time; sys.stdin.readline(); "
    "c = subprocess.Popen(['sleep', '600']); print(c.pid, flush=True); time.sleep(600)"
)


def _family(
    started: list[subprocess.Popen[bytes]], cgroup: Path | None = None
) -> tuple[int, int, int]:
    """A process with a child, both in ``cgroup`` if given: (its pid, its start time, the
    child's pid)."""
    process = subprocess.Popen(
        [sys.executable, "-c", PARENT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    started.append(process)
    assert process.stdin is not None and process.stdout is not None
    if cgroup is not None:
        (cgroup / "cgroup.procs").write_text(str(process.pid))
    process.stdin.write(b"\n")
    process.stdin.flush()
    child = int(process.stdout.readline())
    start = procs.start_time(process.pid)
    assert start is not None
    return process.pid, start, child


def _alive(pid: int) -> bool:
    stat = procs.read_stat(pid)
    return stat is not None and stat.alive


def test_the_state_directory_is_made_private_without_following_links(tmp_path: Path) -> None:
    fd = open_private_dir(str(tmp_path / "a" / "b"))
    try:
        info = os.fstat(fd)
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
    finally:
        os.close(fd)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "planted").symlink_to(tmp_path / "elsewhere")
    for planted in (tmp_path / "planted", tmp_path / "planted" / "below"):
        with pytest.raises(ValueError, match="symbolic link"):
            open_private_dir(str(planted))
    assert not (tmp_path / "elsewhere" / "below").exists()


def test_a_state_directory_another_account_could_change_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 54321, 54321)
    with pytest.raises(ValueError, match="must be this account's"):
        open_private_dir(str(theirs))
    with pytest.raises(ValueError, match="can be changed by another account"):
        open_private_dir(str(theirs / "state"))
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone may replace what is in it
    with pytest.raises(ValueError, match="can be changed by another account"):
        open_private_dir(str(shared / "state"))
    shared.chmod(0o1777)  # sticky, as /tmp: nobody may replace what is ours
    os.close(open_private_dir(str(shared / "state")))
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o770)
    with pytest.raises(ValueError, match="writable by it alone"):
        open_private_dir(str(loose))
    with pytest.raises(ValueError, match="absolute path below /"):
        open_private_dir("/")


def test_the_record_is_read_back_and_only_if_it_is_ours(tmp_path: Path) -> None:
    state = NodeState.open(str(tmp_path / "state"))
    try:
        assert state.read() is None
        state.record(["/sys/fs/cgroup/freezer/bulletin-node-x"], {12: 34})
        record = state.read()
        assert record is not None
        assert record.cgroups == ["/sys/fs/cgroup/freezer/bulletin-node-x"]
        assert record.workers == [(12, 34)]
        path = tmp_path / "state" / STATE_FILE
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        os.chown(path, 54321, -1)
        assert state.read() is None  # not written by this account
        path.unlink()
        path.symlink_to(tmp_path / "elsewhere")
        assert state.read() is None
        path.unlink()
        path.write_text("[1, 2")
        assert state.read() is None
    finally:
        state.close()


def test_names_are_stable_per_node_and_state_directory() -> None:
    assert base_name("node-a", "/s/1") == base_name("node-a", "/s/1/")
    assert base_name("node-a", "/s/1") != base_name("node-a", "/s/2")
    assert base_name("../x y", "/s").startswith("bulletin-node-_x_y-")
    assert default_state_dir("a/../b").endswith("/a_.._b")


def test_the_sweep_kills_a_recorded_worker_and_its_tree(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    worker, start, child = _family(started)
    config = NodeletConfig(gateway_url="http://h", token="t", state_dir=str(tmp_path / "s"))
    state = NodeState.open(config.state_dir)
    state.record([], {worker: start})
    state.close()
    sweep(config)
    assert not _alive(worker) and not _alive(child)
    again = NodeState.open(config.state_dir)
    try:
        record = again.read()
        assert record is not None and (record.workers, record.cgroups) == ([], [])
        assert record.nodelet == (os.getpid(), procs.start_time(os.getpid()))
    finally:
        again.close()


def test_the_sweep_spares_a_reused_pid_and_another_boots_record(
    started: list[subprocess.Popen[bytes]],
) -> None:
    worker, start, child = _family(started)
    reused = _Record(boot_id=procs.boot_id(), workers=[(worker, start + 1)])
    other_boot = _Record(boot_id="another-boot", workers=[(worker, start)])
    assert kill_recorded(reused) == 0
    assert kill_recorded(other_boot) == 0
    assert _alive(worker) and _alive(child)


def test_the_sweep_touches_only_nodelet_cgroups(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    here = own_cgroup_dir(1, os.getpid(), "freezer")
    base = Path(here, f"bulletin-node-test-{uuid.uuid4().hex[:8]}")
    (base / "worker-1").mkdir(parents=True)
    worker, _, child = _family(started, base / "worker-1")
    decoy = tmp_path / "bulletin-node-decoy"
    decoy.mkdir()
    (decoy / "worker-1").mkdir()
    unnormalized = f"{base}/"  # refused as given
    record = _Record(boot_id=procs.boot_id(), cgroups=[str(decoy), unnormalized, str(base)])
    assert kill_recorded(record) == 2
    assert not _alive(worker) and not _alive(child)
    assert not base.exists() and (decoy / "worker-1").is_dir()


# Stands in for a nodelet: takes the state directory's lock, starts a child, prints its pid,
# waits (it is then stopped while it holds the lock).
HOLDER = (
    "import fcntl, os, subprocess, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
    "fcntl.flock(fd, fcntl.LOCK_EX); c = subprocess.Popen(['sleep', '600']); "
    "print(c.pid, flush=True); time.sleep(600)"
)


def _stand_in(started: list[subprocess.Popen[bytes]], state_dir: Path) -> tuple[int, int, int]:
    """A process standing in for an earlier nodelet of ``state_dir``, holding its lock: (its
    pid, its start time, its child's pid)."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(state_dir)],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    started.append(process)
    assert process.stdout is not None
    child = int(process.stdout.readline())
    start = procs.start_time(process.pid)
    assert start is not None
    return process.pid, start, child


def test_an_earlier_nodelet_that_still_runs_is_killed_with_all_it_runs(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    # Another start of this node (a process standing in for it) wrote the record, still
    # runs, and was stopped (SIGSTOP) while it held the state directory's lock: this start's
    # sweep kills it (it would never notice it was superseded), what it started, and the
    # workers it recorded, and owns the record.
    state = NodeState.open(str(tmp_path / "state"))
    try:
        nodelet, start, its_child = _stand_in(started, tmp_path / "state")
        worker, worker_start, child = _family(started)
        theirs = _Record(
            boot_id=procs.boot_id(), nodelet=(nodelet, start), workers=[(worker, worker_start)]
        )
        state._write(theirs)
        os.kill(nodelet, signal.SIGSTOP)
        assert state.other_writer(theirs) == (nodelet, start)
        state.sweep()
        assert not any(map(_alive, [nodelet, its_child, worker, child]))
        record = state.read()
        assert record is not None and record.nodelet == (os.getpid(), procs.start_time(os.getpid()))
    finally:
        state.close()


def test_an_earlier_nodelet_of_another_account_is_not_killed(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    other = subprocess.Popen(["sleep", "600"], user=65534, start_new_session=True)
    started.append(other)
    start = procs.start_time(other.pid)
    state = NodeState.open(str(tmp_path / "state"))
    try:
        state._write(_Record(boot_id=procs.boot_id(), nodelet=(other.pid, start or 0)))
        with pytest.raises(ValueError, match="runs as uid 65534"):
            state.sweep()
        assert _alive(other.pid)
    finally:
        state.close()


def test_an_earlier_nodelet_never_writes_over_a_later_ones_record(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    # A later start of this node (a process standing in for it, younger than this one)
    # wrote the record and still runs: this one, the older, cannot write over it.
    nodelet, start, _ = _family(started)
    state = NodeState.open(str(tmp_path / "state"))
    try:
        theirs = _Record(boot_id=procs.boot_id(), nodelet=(nodelet, start))
        state._write(theirs)
        state.record([], {})
        assert state.read() == theirs
        os.killpg(nodelet, signal.SIGKILL)  # once it is gone, the record is this one's
        assert procs.wait_gone({nodelet: start}, 10) == {}
        state.record([], {})
        record = state.read()
        assert record is not None and record.nodelet == (os.getpid(), procs.start_time(os.getpid()))
    finally:
        state.close()


def test_a_record_is_a_private_format() -> None:
    # Written by one nodelet, read by the next of the same version or a later one.
    record = _Record(boot_id="b", nodelet=(3, 4), cgroups=["/x"], workers=[(1, 2)])
    assert msgspec.json.decode(msgspec.json.encode(record)) == {
        "boot_id": "b",
        "nodelet": [3, 4],
        "cgroups": ["/x"],
        "workers": [[1, 2]],
    }


def gone_pid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """Temporary directories made in ``tmp_path``; the pid of a process that has exited."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid


def test_a_dead_nodelet_s_temporary_work_dir_is_removed_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without a work_dir each nodelet works in a temporary directory named for it; one that is
    # killed cannot remove its own, so the next start removes it: only that.
    pid = gone_pid(tmp_path, monkeypatch)
    dead = f"bulletin-nodelet-{pid}-{12345}-abc"  # its pid, not its start time: gone
    me = os.getpid()
    alive = f"bulletin-nodelet-{me}-{procs.start_time(me)}-xyz"  # a nodelet still running
    others = f"bulletin-nodelet-{pid}-1-other"  # another account's
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("not the nodelet's")
    for name in (dead, alive, others):
        (tmp_path / name).mkdir()
        (tmp_path / name / "attempt").mkdir()
        (tmp_path / name / "attempt" / "out").write_text("x")
    (tmp_path / dead / "link").symlink_to(victim)  # a call's link to elsewhere: not followed
    os.chown(tmp_path / others, 65534, 65534)
    (tmp_path / f"bulletin-nodelet-{pid}-1-link").symlink_to(victim)  # a planted link
    made = temporary_work_dir()
    assert not (tmp_path / dead).exists()
    assert (tmp_path / alive / "attempt" / "out").exists()
    assert (tmp_path / others / "attempt" / "out").exists()
    assert (victim / "keep").read_text() == "not the nodelet's"
    assert (tmp_path / f"bulletin-nodelet-{pid}-1-link").is_symlink()
    assert Path(made).parent == tmp_path and Path(made).is_dir()
    assert Path(made).name.startswith(f"bulletin-nodelet-{me}-{procs.start_time(me)}-")
    # Made by this process: the next start, from another, keeps it while this one runs.
    assert temporary_work_dir() != made and Path(made).is_dir()


def test_a_dead_nodelet_s_tree_too_deep_to_remove_does_not_stop_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A nodelet killed while a call's work dir held a tree deeper than a recursive removal
    # can take: the next start (under systemd, every restart) must still come up.
    dead = tmp_path / f"bulletin-nodelet-{gone_pid(tmp_path, monkeypatch)}-12345-abc"
    dead.mkdir()
    here = os.getcwd()
    try:
        os.chdir(dead)
        for _ in range(sys.getrecursionlimit() + 500):
            os.mkdir("d")
            os.chdir("d")
    finally:
        os.chdir(here)
    try:
        made = temporary_work_dir()
        assert Path(made).is_dir() and Path(made).parent == tmp_path
    finally:
        subprocess.run(["find", str(dead), "-depth", "-delete"], check=True)


def test_no_temporary_dir_is_removed_where_others_could_rename_ours_into_the_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A directory every account may write to, without the sticky bit: another account could
    # rename one of this account's directories to a dead nodelet's name. Nothing is removed.
    dead = tmp_path / f"bulletin-nodelet-{gone_pid(tmp_path, monkeypatch)}-12345-abc"
    dead.mkdir()
    tmp_path.chmod(0o777)
    temporary_work_dir()
    assert dead.is_dir()
    tmp_path.chmod(0o1777)  # sticky, as /tmp: only owners may rename their entries
    temporary_work_dir()
    assert not dead.exists()
