"""Finding the cluster: ``sdk.connect`` and the process-wide default client.

Without an explicit ``sdk.connect(...)``, the first remote call looks, in this order, at
``BULLETIN_CONFIG`` (the path of a ``client.toml`` with ``url`` and ``token``, as ``bulletin up``
writes it, and ``ca`` for a gateway whose certificate the system does not trust) and at
``BULLETIN_URL`` plus ``BULLETIN_TOKEN`` (and ``BULLETIN_CA``).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import msgspec

from bulletin_core import wire
from sdk._client import Client
from sdk._errors import ConfigError

NOT_CONFIGURED = (
    "No Bulletin cluster configured. `bulletin up` writes <state-dir>/client.toml: point "
    "BULLETIN_CONFIG at it (export BULLETIN_CONFIG=<state-dir>/client.toml), or set "
    "BULLETIN_URL and BULLETIN_TOKEN, or call sdk.connect(url, token) or "
    "sdk.connect(config=path) before the first remote call."
)
_KEYS = ("url", "token")

_lock = threading.Lock()
_default: Client | None = None


def connect(
    url: str | None = None,
    token: str | None = None,
    *,
    ca: str | os.PathLike[str] | None = None,
    config: str | os.PathLike[str] | None = None,
) -> Client:
    """Connect to a cluster and make it the default of every remote call in this process.

    With ``config``, read that ``client.toml``; ``url`` and ``token``, when given, override
    what was found. Without any argument, resolve the environment as the first remote call
    would (``BULLETIN_CONFIG``, else ``BULLETIN_URL`` and ``BULLETIN_TOKEN``). ``ca``: the
    CA certificate (PEM) of an https:// gateway the system does not trust (else ``ca`` in
    the config file, else ``BULLETIN_CA``).
    Raises ``ConfigError`` saying what to set when nothing is found.
    """
    global _default
    found = resolve(url, token, config=config, ca=ca)
    client = Client(found.url, found.token, ca=found.ca or None)
    with _lock:
        _default = client
    return client


def default_client() -> Client:
    """The process-wide client, connecting from the environment on first use."""
    global _default
    with _lock:
        if _default is None:
            found = resolve()
            _default = Client(found.url, found.token, ca=found.ca or None)
        return _default


def resolve(
    url: str | None = None,
    token: str | None = None,
    *,
    config: str | os.PathLike[str] | None = None,
    ca: str | os.PathLike[str] | None = None,
) -> wire.ClientConfig:
    """Where the cluster is: explicit arguments over ``config`` over the environment."""
    if config is not None:
        base = load(config)
    elif url and token:
        base = wire.ClientConfig(url=url, token=token, ca=os.environ.get("BULLETIN_CA", ""))
    else:
        base = from_env()
    return _checked(url or base.url, token or base.token, str(ca) if ca else base.ca)


def from_env() -> wire.ClientConfig:
    """The config named by ``BULLETIN_CONFIG``, else ``BULLETIN_URL`` and ``BULLETIN_TOKEN``."""
    path = os.environ.get("BULLETIN_CONFIG")
    if path:
        return load(path, via="BULLETIN_CONFIG")
    url = os.environ.get("BULLETIN_URL")
    token = os.environ.get("BULLETIN_TOKEN")
    if url and token:
        return wire.ClientConfig(url=url, token=token, ca=os.environ.get("BULLETIN_CA", ""))
    if url or token:
        have, lack = "BULLETIN_URL", "BULLETIN_TOKEN"
        if token:
            have, lack = lack, have
        raise ConfigError(f"{have} is set but {lack} is not: set both. {NOT_CONFIGURED}")
    raise ConfigError(NOT_CONFIGURED)


def load(path: str | os.PathLike[str], *, via: str = "") -> wire.ClientConfig:
    """Read a ``client.toml``. Raises ``ConfigError`` naming the file and what is wrong."""
    file = Path(path).expanduser()
    where = f"{file} (from {via})" if via else str(file)
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"Cannot read the Bulletin client config {where}: {exc.strerror or exc}. "
            "`bulletin up` writes <state-dir>/client.toml; point BULLETIN_CONFIG at that file."
        ) from None
    return _parse(data, where)


def _parse(data: bytes, where: str) -> wire.ClientConfig:
    try:
        table = msgspec.toml.decode(data, type=dict)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"The Bulletin client config {where} is not valid TOML: {exc}") from None
    for key in _KEYS:
        if key not in table:
            raise ConfigError(
                f"The Bulletin client config {where} has no `{key}` key; it needs `url` and "
                "`token`, as `bulletin up` writes them."
            )
    try:
        return msgspec.convert(table, wire.ClientConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"The Bulletin client config {where} is malformed: {exc}") from None


def _checked(url: str, token: str, ca: str = "") -> wire.ClientConfig:
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"The gateway url must start with http:// or https://, got {url!r}")
    if not token.strip():
        raise ConfigError("The token is empty: check BULLETIN_TOKEN or `token` in client.toml.")
    if ca and not Path(ca).expanduser().is_file():
        raise ConfigError(
            f"The CA certificate {ca!r} (`ca` in client.toml, BULLETIN_CA or sdk.connect(ca=...)) "
            "is not a file: give the PEM file of the CA that signed the gateway's certificate."
        )
    return wire.ClientConfig(url=url, token=token, ca=str(Path(ca).expanduser()) if ca else "")
