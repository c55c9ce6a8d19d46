"""``bulletin doctor node`` and ``bulletin doctor head``: is this host fit to serve?

Each check prints one line, ``OK    check: detail``, ``WARN  check: what is weaker than it
could be — what to do`` or ``FAIL  check: what is wrong — what to do``, and the command
ends with a summary line; its exit status is 1 when a check failed, else 0 (an Ansible
playbook runs it last on every host). See docs/doctor.md.

The settings are read as the component reads them: its own click command parses them
from its ``BULLETIN_*`` variables, with each ``--env-file`` (systemd ``EnvironmentFile``
syntax) taking the place of variables of the same names. Every check is the component's own
code (the nodelet's GPU discovery, limit detection, accounts; the gateway's migrations);
this module only calls it and words the answer. Nothing it prints holds a secret: the node
token, a database password and every value of them are masked in every line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import logging.handlers
import os
import re
import ssl
import stat
import tempfile
import threading
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import click

if TYPE_CHECKING:
    import asyncpg

    from bulletin_core import wire
    from nodelet.config import NodeletConfig
    from nodelet.gpus import GpuProvider

    #: What the gateway answered the node token (:func:`ask_cluster`): what it tells the
    #: node of the cluster, or why it told nothing (what went wrong, and what to do).
    Asked: TypeAlias = wire.ClusterInfo | tuple[str, str]

_T = TypeVar("_T")
#: What to do about a limit: the doctor sees what its own cgroup allows, which may not be
#: what the nodelet's service gets (systemd Delegate=yes).
_LIMITS_DOC = (
    "see docs/limits.md; run the doctor as the nodelet runs (as root, in a cgroup of its own: "
    "systemd-run --scope -p Delegate=yes bulletin doctor node ...)"
)
#: How long the gateway's answers may take when the settings do not say.
HTTP_TIMEOUT_S = 10.0
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: Variables a component reads besides its options' (the group's --log-level).
_ALSO_READ = frozenset({"BULLETIN_LOG_LEVEL"})


class Report:
    """The lines of one run: printed as they come, with every secret masked."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._secrets: set[str] = set()

    def secret(self, *values: str | None) -> None:
        """Values never to print (a token, a password), also as they look URL-quoted."""
        for value in values:
            if value:
                self._secrets |= {value, urllib.parse.quote(value, safe="")}

    def ok(self, check: str, detail: str) -> None:
        self._line("OK", check, detail)

    def warn(self, check: str, what: str, todo: str) -> None:
        self._line("WARN", check, f"{what} — {todo}")

    def fail(self, check: str, what: str, todo: str) -> None:
        self._line("FAIL", check, f"{what} — {todo}")

    def _line(self, status: str, check: str, text: str) -> None:
        self.counts[status] += 1
        click.echo(self.masked(f"{status:<6}{check}: {' '.join(text.split())}"))

    def masked(self, text: str) -> str:
        for value in sorted(self._secrets, key=len, reverse=True):
            text = text.replace(value, "***")
        return text

    def finish(self, host: str) -> int:
        """Print the summary line; the exit status."""
        ok, warned, failed = (self.counts[s] for s in ("OK", "WARN", "FAIL"))
        verdict = f"this {host} is not fit to serve" if failed else f"this {host} is fit to serve"
        click.echo(f"summary: {ok} OK, {warned} WARN, {failed} FAIL: {verdict}")
        return 1 if failed else 0


# --------------------------------------------------------------------------- settings


def read_env_file(path: Path) -> tuple[dict[str, str], list[str]]:
    """The ``KEY=VALUE`` assignments of a systemd ``EnvironmentFile`` (``#`` and ``;``
    comment lines, a value in single or double quotes, a trailing backslash continuing
    the line), and the lines systemd would ignore, as "FILE line N"."""
    values: dict[str, str] = {}
    ignored: list[str] = []
    pending, first = "", 0
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if pending or not raw.lstrip().startswith(("#", ";")):
            if raw.endswith("\\"):
                pending, first = pending + raw[:-1], first or number
                continue
            line, start = pending + raw, first or number
            pending, first = "", 0
            if line.strip() and not _assign(values, line):
                ignored.append(f"{path} line {start}")
    return values, ignored


def _assign(values: dict[str, str], line: str) -> bool:
    key, equals, value = line.partition("=")
    key, value = key.strip(), value.strip()
    if not equals or not _KEY.fullmatch(key):
        return False
    if len(value) >= 2 and value[0] == value[-1] == "'":
        value = value[1:-1]
    elif len(value) >= 2 and value[0] == value[-1] == '"':
        value = re.sub(r"\\(.)", r"\1", value[1:-1])
    values[key] = value
    return True


def _env_files(report: Report, files: Sequence[Path]) -> dict[str, str]:
    values: dict[str, str] = {}
    for path in files:
        try:
            found, ignored = read_env_file(path)
        except (OSError, UnicodeDecodeError) as exc:
            report.fail("env file", f"cannot read {path}: {exc}", "give a readable text file")
            continue
        values.update(found)
        for where in ignored:
            report.warn("env file", f"{where} is not KEY=VALUE", "systemd ignores it: fix it")
    return values


def parsed(
    report: Report, command: click.Command, files: Mapping[str, str]
) -> dict[str, Any] | None:
    """What ``command`` parses from this process's environment, with ``files``' values in
    place of the variables they name; None (reported) when it refuses them."""
    args: list[str] = []
    known = set(_ALSO_READ)
    for param in command.params:
        if isinstance(param, click.Option) and isinstance(param.envvar, str):
            known.add(param.envvar)
            if param.envvar in files:
                args.append(f"{param.opts[0]}={files[param.envvar]}")
    for name in sorted(set(files) - known):
        if name.startswith("BULLETIN_"):
            report.warn(
                "settings",
                f"{name} is no setting of 'bulletin {command.name}': it is ignored",
                f"check its spelling ('bulletin {command.name} --help' lists them)",
            )
    try:
        with command.make_context(command.name, args) as ctx:
            return dict(ctx.params)
    except click.ClickException as exc:
        report.fail("settings", exc.format_message(), "fix it in the env file or the environment")
        return None


def _built(report: Report, struct: type, values: Mapping[str, Any], what: str) -> Any:
    """``struct`` from ``values`` as the component's command builds it; None (reported) if
    its rules refuse them."""
    from bulletin_core.settings import build

    try:
        return build(struct, values, what)
    except click.BadParameter as exc:
        report.fail("settings", exc.format_message(), "fix it in the env file or the environment")
        return None


# --------------------------------------------------------------------------- shared helpers


@contextlib.contextmanager
def _logs_of(name: str) -> Iterator[list[logging.LogRecord]]:
    """The records logger ``name`` (and below) emits meanwhile, kept out of the log: the
    doctor says in its own lines what they say."""
    logger = logging.getLogger(name)
    handler = logging.handlers.BufferingHandler(capacity=1 << 20)
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield handler.buffer
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def _in_time(seconds: float, work: Callable[[], _T]) -> _T | None:
    """``work()`` (which must not raise), or None if it takes longer than ``seconds`` (a hung
    NFS mount): in a daemon thread, which cannot hold up the exit."""
    box: list[_T] = []
    thread = threading.Thread(target=lambda: box.append(work()), daemon=True, name="doctor")
    thread.start()
    thread.join(seconds)
    return box[0] if box else None


def _mode(path: str | Path) -> str:
    return f"{stat.S_IMODE(os.stat(path).st_mode):04o}"


def check_gateway_url(report: Report, url: str, ca_file: str, timeout_s: float) -> bool:
    """Whether the gateway at ``url`` answers its health route, verified as the nodelet and
    the sdk verify it (:mod:`bulletin_core.tls`); reported."""
    import httpx

    from bulletin_core import tls
    from gateway.config import is_loopback

    host = urllib.parse.urlsplit(url).hostname or ""
    if url.startswith("http://") and not is_loopback(host):
        report.fail(
            "gateway",
            f"{url} is plain HTTP to another host: tokens and calls would cross the network "
            "in the clear",
            "serve the gateway over HTTPS (its tls_cert_file and tls_key_file) and use an "
            "https:// URL",
        )
        return False  # nor is the node token sent there to be checked
    try:
        verify = tls.verify(ca_file)
        answer = httpx.get(f"{url.rstrip('/')}/healthz", timeout=timeout_s, verify=verify)
    except (OSError, ssl.SSLError) as exc:  # a ca_file that is no CA certificate
        report.fail("gateway", f"cannot use ca_file {ca_file}: {exc}", "give the CA's PEM file")
        return False
    except httpx.HTTPError as exc:
        if why := tls.untrusted(exc):
            report.fail(
                "gateway",
                f"{url}: its TLS certificate is not trusted ({why})",
                "give the certificate of the CA that signed it with --ca-file / "
                "BULLETIN_CA_FILE",
            )
        else:
            report.fail(
                "gateway",
                f"{url} cannot be reached ({type(exc).__name__}: {exc})",
                "check the URL, that the gateway runs, and that no firewall is in the way",
            )
        return False
    if answer.status_code != 200:
        report.fail(
            "gateway",
            f"{url}/healthz answered {answer.status_code}",
            "check that the URL is the gateway's (not a proxy's error page)",
        )
        return False
    https = url.startswith("https://")
    trust = f" (TLS verified with {ca_file or 'the system CAs'})" if https else ""
    report.ok("gateway", f"{url} answers /healthz{trust}")
    return True


# --------------------------------------------------------------------------- node


def check_node(report: Report, env_files: Sequence[Path]) -> None:
    """Every check of a GPU node, reported."""
    from nodelet import command as nodelet_command

    values = parsed(report, nodelet_command.command, _env_files(report, env_files))
    if values is None:
        return
    gateway_url: str = values.pop("gateway_url")
    token_file: Path = values.pop("token_file")
    try:
        config = nodelet_command.config_from(gateway_url, token_file, values)  # as it reads them
    except (OSError, UnicodeDecodeError) as exc:
        report.fail("settings", f"cannot read the token file {token_file}: {exc}", "fix it")
        return
    except click.BadParameter as exc:
        report.fail("settings", exc.format_message(), "fix it in the env file or the environment")
        return
    report.secret(config.token)
    report.ok("settings", f"the nodelet's settings are valid (node {config.name!r})")
    with _logs_of("nodelet"):
        gpus = check_gpus(report, config)
        check_limits(report, config, gpus)
        check_accounts(report, config)
        reachable = check_gateway_url(
            report, config.gateway_url, config.ca_file, config.http_timeout_s
        )
        # Asked once, read only (GET /v1/node/cluster): what the gateway answers the token.
        asked = asyncio.run(ask_cluster(config)) if reachable else None
        check_token(report, config, token_file, asked)
        check_shared_dir(report, asked)


def check_gpus(report: Report, config: NodeletConfig) -> GpuProvider:
    """The GPUs the nodelet would offer (``choose_provider``): real ones, or fakes asked for;
    a FAIL where it would fall back to fakes nobody asked for. Returns the provider."""
    from nodelet import gpus
    from nodelet.gpus import FakeGpuProvider, choose_provider, describe

    provider = choose_provider(
        config.fake_gpus,
        node=config.name,
        fault_file=config.fake_gpu_faults or None,
        device_dir=config.fake_gpu_device_dir or None,
    )
    if isinstance(provider, FakeGpuProvider) and config.fake_gpus is None:
        report.fail(
            "gpus",
            f"no NVIDIA GPU usable: {_nvml_problem()}; the nodelet would offer "
            f"{provider.count} fake GPUs instead",
            "install the NVIDIA driver, or set fake_gpus (BULLETIN_FAKE_GPUS) for a test node",
        )
        return provider
    if isinstance(provider, FakeGpuProvider):
        count = f"{provider.count} fake GPU{'' if provider.count == 1 else 's'}"
        report.ok("gpus", f"{count} configured (fake_gpus; not real GPUs)")
    try:
        if not isinstance(provider, FakeGpuProvider):
            found = provider.discover()
            listed = "; ".join(f"GPU {g.index}: {g.name}, {g.memory_mb} MiB" for g in found)
            report.ok("gpus", f"NVIDIA driver {_driver_version()}, {len(found)} GPUs: {listed}")
        sample = provider.health()
    except (gpus.pynvml.NVMLError, OSError) as exc:
        report.fail("gpus", f"NVML failed: {exc}", "check the NVIDIA driver (nvidia-smi)")
        return provider
    finally:
        provider.close()
    for health in sample:
        if health.critical is not None:
            report.fail("gpu health", describe(health), "reset or replace the GPU; drain the node")
    return provider


def _nvml_problem() -> str:
    """Why NVML offers no GPU here, in NVML's words."""
    from nodelet import gpus

    try:
        found = gpus.NvmlProvider().discover()
    except (gpus.pynvml.NVMLError, OSError) as exc:
        return f"NVML: {exc}"
    return "NVML found no GPUs" if not found else "NVML lists GPUs now (try again)"


def _driver_version() -> str:
    from nodelet.gpus import pynvml  # the nodelet's: tests give it a stand-in

    pynvml.nvmlInit()
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
    finally:
        pynvml.nvmlShutdown()
    return version.decode() if isinstance(version, bytes) else str(version)


def check_limits(report: Report, config: NodeletConfig, gpus: GpuProvider) -> None:
    """How the nodelet would track a call's processes and enforce each limit, in its own
    words (what it logs at start): its worker pool is made as the nodelet makes it, then
    closed before it starts a worker. Then its state directory."""
    import msgspec

    from nodelet.agent import worker_pool
    from nodelet.leftovers import open_state

    with tempfile.TemporaryDirectory(prefix="bulletin-doctor-") as scratch:
        # A state directory of its own: the pool's cgroups are named for it, so they are
        # never those of a nodelet that runs here now (making them sweeps what is there).
        probe = msgspec.structs.replace(config, state_dir=scratch)
        with _logs_of("nodelet.limits") as records:
            try:
                pool = worker_pool(probe, scratch, gpus)
            except ValueError as exc:
                report.fail("limits", str(exc), f"choose another process_tracking; {_LIMITS_DOC}")
                return
        isolated = any(pool.limiter.gpu_devices.values())
        asyncio.run(pool.close())
    for record in records:
        if record.levelno >= logging.WARNING:
            report.warn("limits", record.getMessage(), _LIMITS_DOC)
        else:
            report.ok("limits", record.getMessage())
    if config.cpu_limit == 0:
        report.ok("limits", "no CPU cap per call (cpu_limit = 0)")
    if not isolated:
        report.ok("limits", "GPU isolation: CUDA_VISIBLE_DEVICES (no GPU device files here)")
    try:
        state = open_state(config)  # made if missing, as the nodelet makes it
    except (ValueError, OSError) as exc:
        report.fail("state dir", str(exc), "fix it, or set state_dir (BULLETIN_STATE_DIR)")
    else:
        state.close()
        report.ok("state dir", f"{state.path} is this node's own")


def check_accounts(report: Report, config: NodeletConfig) -> None:
    """Whose calls the node runs and as which account (``Accounts``), and what a mapping
    needs: root, an interpreter others can run, each mapped account."""
    from nodelet.accounts import AccountError, Accounts, unreachable

    try:
        accounts = Accounts.from_setting(config.user_mapping, config.trusted_users)
    except ValueError as exc:
        report.fail("user mapping", str(exc), "see docs/security.md")
        return
    if accounts.single_tenant:
        report.warn(
            "user mapping",
            f"{accounts.describe()}: every call runs as that account and can read the node "
            "token and the other calls' work",
            "for users who do not all trust each other, run the nodelet as root with "
            "user_mapping same-name (BULLETIN_USER_MAPPING)",
        )
        return
    problems = 0
    try:
        accounts.check_interpreter()
    except ValueError as exc:
        problems += 1
        report.fail("user mapping", str(exc), "see docs/security.md")
    for user in sorted(accounts.mapping or {}):
        try:
            accounts.run_as(user)
        except AccountError as exc:
            problems += 1
            report.fail("user mapping", str(exc), f"fix {config.user_mapping} or the accounts")
    blocked = unreachable([config.work_dir]) if config.work_dir else None
    if blocked is not None:
        problems += 1
        report.fail(
            "user mapping",
            f"work_dir {config.work_dir}: the calls' accounts cannot reach it through {blocked}",
            "choose a work directory every account may traverse (e.g. /var/lib/bulletin-nodelet)",
        )
    if not problems:
        report.ok("user mapping", f"multi-tenant: {accounts.describe()}")


def check_token(report: Report, config: NodeletConfig, path: Path, asked: Asked | None) -> None:
    """The token file is a root-only regular file; the gateway accepts the token as a node
    token made for this node's name (``asked``: its answer, None where it cannot be reached)."""
    from bulletin.secretfiles import SecretFileError, read_secret

    try:
        info = os.lstat(path)
    except OSError as exc:
        report.fail("token", f"cannot read {path}: {exc}", "give the node token's file")
        return
    problem: tuple[str, str] | None = None
    if stat.S_ISREG(info.st_mode) and os.geteuid() == 0 and info.st_uid != 0:
        problem = f"{path} belongs to uid {info.st_uid}, not root", f"chown 0 {path}"
    elif stat.S_ISREG(info.st_mode) and info.st_mode & 0o077:
        problem = (
            f"{path} (mode {_mode(path)}) may be read by its group or others",
            f"chmod 600 {path}",
        )
    else:
        try:
            read_secret(path)  # refuses a link, or anything but a regular file
        except (OSError, SecretFileError) as exc:
            problem = f"{path}: {exc}", "keep the node token in a regular file, mode 0600"
    if problem is not None:
        report.fail("token", *problem)
    what = f"{path} is a regular file of mode 0600"
    if asked is None:
        if problem is None:
            report.ok("token", f"{what} (not shown to the gateway: it cannot be reached)")
        return
    if isinstance(asked, tuple):
        report.fail("token", *asked)
    elif asked.node != config.name:
        report.fail(
            "token",
            f"the token is node {asked.node}'s, not this node's ({config.name})",
            f"make one with 'bulletin node add {config.name}' on the head and put it there "
            f"(or, if this node is {asked.node}, set name, BULLETIN_NAME, to that)",
        )
    elif problem is None:
        report.ok("token", f"{what}; the gateway accepts it as the node token of {config.name}")


async def ask_cluster(config: NodeletConfig) -> Asked:
    """What the gateway tells this node of the cluster (``GET /v1/node/cluster``: read only,
    and it names no incarnation, so it neither disturbs nor is refused for a nodelet that
    runs here), its name for the token included; else what went wrong, and what to do."""
    from nodelet.client import GatewayClient
    from nodelet.errors import AuthRejected, GatewayRejected, NodeletError

    client = GatewayClient(
        config.gateway_url, config.token, timeout_s=config.http_timeout_s, ca_file=config.ca_file
    )
    renew = f"make a new one on the head (bulletin node add {config.name}) and put it there"
    try:
        return await client.cluster()
    except AuthRejected as exc:
        kind = "refused the token" if exc.status == 401 else "took it for a user's token"
        return f"the gateway {kind} ({exc.detail})", renew
    except GatewayRejected as exc:
        if exc.status == 404:
            return (
                f"the gateway does not know GET /v1/node/cluster ({exc.detail})",
                "upgrade the gateway to this version of Bulletin",
            )
        return f"the gateway answered {exc.status}: {exc.detail}", "see the gateway's log"
    except NodeletError as exc:
        return f"could not ask the gateway: {exc}", "try again"
    finally:
        await client.aclose()


def check_shared_dir(report: Report, asked: Asked | None) -> None:
    """The cluster's shared directory, if the gateway has one (as it told the node token:
    ``asked``), is mounted here at the same path, holds the same cluster id, and its
    ``bulletin/users`` is 1733."""
    if asked is None or isinstance(asked, tuple):
        why, todo = (
            ("the gateway cannot be reached", "see the gateway check")
            if asked is None
            else ("the gateway did not answer the node token", "see the token check")
        )
        report.warn("shared dir", f"not checked: {why}", todo)
        return
    if asked.shared_dir is None:
        report.ok("shared dir", "none configured (big state goes through the gateway)")
        return
    from nodelet.agent import SHARED_CHECK_S

    root, cluster_id = asked.shared_dir, asked.shared_dir_id or ""
    problem = _in_time(SHARED_CHECK_S, lambda: _shared_problem(root, cluster_id))
    if problem is None:
        problem = (f"{root} did not answer within {SHARED_CHECK_S:.0f} s", "check the NFS mount")
    if problem[0]:
        report.fail("shared dir", *problem)
    else:
        report.ok("shared dir", f"{root} is mounted here, with this cluster's id; users/ is 1733")


def _shared_problem(root: str, cluster_id: str) -> tuple[str, str]:
    """What is wrong with the shared directory here, and what to do; ("", "") if nothing."""
    from bulletin_core import shared

    mount = "mount the cluster's shared directory at the same path on every node"
    marker, users = os.path.join(root, shared.MARKER), os.path.join(root, shared.USERS)
    try:
        if not os.path.isdir(root):
            return f"{root}, the cluster's shared directory, is not here", mount
        if not shared.sees(root, cluster_id):
            found = "holds another cluster's id" if os.path.exists(marker) else "is missing"
            return f"{marker} {found}: {root} here is not the gateway's directory", mount
        info = os.lstat(users)
        if not stat.S_ISDIR(info.st_mode) or stat.S_IMODE(info.st_mode) != 0o1733:
            return f"{users} has mode {stat.S_IMODE(info.st_mode):04o}, not 1733", (
                f"chmod 1733 {users} (the gateway makes it so when it starts)"
            )
    except OSError as exc:
        return f"cannot look at {root}: {exc}", mount
    return "", ""


# --------------------------------------------------------------------------- head


def masked_url(url: str) -> str:
    """A database URL without its password (in the user part or a ``password=`` query)."""
    netloc = urllib.parse.urlsplit(url).netloc
    user, at, host = netloc.rpartition("@")
    if at and ":" in user:
        url = url.replace(f"//{netloc}", f"//{user.split(':', 1)[0]}:***@{host}", 1)
    return re.sub(r"([?&]password=)[^&#]*", r"\1***", url)


def _passwords(url: str) -> list[str]:
    """The password of a database URL, in every spelling it may be printed in."""
    parts = urllib.parse.urlsplit(url)
    found = [parts.password or "", *urllib.parse.parse_qs(parts.query).get("password", [])]
    return [spelling for p in found if p for spelling in (p, urllib.parse.unquote(p))]


def check_head(
    report: Report, env_files: Sequence[Path], gateway_url: str | None, ca_file: str
) -> None:
    """Every check of a gateway host, reported."""
    from gateway import command as gateway_command
    from gateway.config import GatewayConfig

    values = parsed(report, gateway_command.command, _env_files(report, env_files))
    if values is None:
        return
    url = values["database_url"]
    report.secret(url, *_passwords(url))
    if _built(report, GatewayConfig, values, "gateway") is not None:
        report.ok("settings", "the gateway's settings are valid")
    asyncio.run(check_database(report, url))
    check_tls_files(report, values.get("tls_cert_file") or "", values.get("tls_key_file") or "")
    if gateway_url:
        check_gateway_url(report, gateway_url, ca_file, HTTP_TIMEOUT_S)


async def check_database(report: Report, url: str) -> None:
    """The database answers, as a plain role, with every migration applied."""
    import asyncpg

    from gateway import db

    shown = masked_url(url)
    refused = (OSError, TimeoutError, ValueError, asyncpg.PostgresError, asyncpg.InterfaceError)
    try:
        conn = await asyncpg.connect(url, timeout=5)
    except refused as exc:
        report.fail(
            "database",
            f"cannot connect to {shown}: {type(exc).__name__}: {exc}",
            "check BULLETIN_DATABASE_URL and that PostgreSQL runs",
        )
        report.fail("migrations", "not checked: no database", "connect first")
        return
    try:
        version = conn.get_server_version()
        report.ok("database", f"{shown}: PostgreSQL {version.major}.{version.minor}")
        if await db.is_superuser(conn):
            report.warn(
                "database",
                "the gateway connects as a superuser",
                "connect as a plain role that owns the database (bulletin db setup)",
            )
        await check_migrations(report, conn)
    finally:
        await conn.close()


async def check_migrations(report: Report, conn: asyncpg.Connection) -> None:
    """The migrations applied to the database against those this Bulletin has."""
    from gateway import db

    applied = await db.applied_migrations(conn)
    files = db.migration_files()
    missing = [name for version, name, _ in files if version not in applied]
    unknown = sorted(applied - {version for version, _, _ in files})
    if unknown:
        report.fail(
            "migrations",
            f"the database has migrations this Bulletin does not know ({unknown}): a newer "
            "Bulletin migrated it",
            "install that version here",
        )
    elif missing:
        report.fail(
            "migrations",
            f"{len(missing)} of {len(files)} migrations are not applied ({', '.join(missing)})",
            "run `bulletin migrate` (with the gateway's BULLETIN_DATABASE_URL), or start the "
            "gateway, which applies them",
        )
    else:
        report.ok("migrations", f"all {len(files)} applied (the last: {files[-1][1]})")


def check_tls_files(report: Report, cert: str, key: str) -> None:
    """The gateway's certificate and key load together; the key is not readable by others."""
    if not cert and not key:
        report.ok("tls", "not configured: the gateway serves plain HTTP, on loopback only")
        return
    try:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        mode = os.stat(key).st_mode
    except (OSError, ssl.SSLError) as exc:
        report.fail(
            "tls", f"{cert} and {key} do not load as a certificate and its key: {exc}",
            "give the PEM certificate (with its chain) and its private key",
        )
        return
    if mode & 0o007:
        report.fail("tls", f"{key} (mode {_mode(key)}) may be read by others", f"chmod 600 {key}")
    else:
        report.ok("tls", f"{cert} and its key {key} (mode {_mode(key)}) load")


# --------------------------------------------------------------------------- commands

env_file_option = click.option(
    "--env-file",
    "env_files",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A systemd EnvironmentFile (KEY=VALUE lines) whose values count as if they were in "
    "the environment, over it; may be given again.",
)


@click.group("doctor")
def command() -> None:
    """Check that this host is fit to serve: one line per check, exit status 1 on a FAIL."""


@command.command("node")
@env_file_option
def node(env_files: tuple[Path, ...]) -> None:
    """Check a GPU node with the nodelet's settings (its BULLETIN_* variables)."""
    report = Report()
    check_node(report, env_files)
    raise SystemExit(report.finish("node"))


@command.command("head")
@env_file_option
@click.option("--gateway", "gateway_url", help="Also check this gateway URL's health route.")
@click.option(
    "--ca-file",
    default="",
    help="The CA certificate (PEM) of an https:// --gateway the system does not trust.",
)
def head(env_files: tuple[Path, ...], gateway_url: str | None, ca_file: str) -> None:
    """Check a gateway host with the gateway's settings (BULLETIN_DATABASE_URL, ...)."""
    report = Report()
    check_head(report, env_files, gateway_url, ca_file)
    raise SystemExit(report.finish("head"))
