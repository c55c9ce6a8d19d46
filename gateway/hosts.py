"""Allowed hosts: with ``allowed_hosts`` set, a request whose ``Host`` header names another
host gets 400 problem+json (code ``host_not_allowed``) before any route sees it. It keeps
a gateway that is reached through a DNS name from answering requests meant for another
name (DNS rebinding, a misrouted proxy). Empty, the default, allows any host, so loopback
and IP-address set-ups work unconfigured.

``GET /healthz`` is exempt: load balancers and orchestrators probe it by IP address, and it
says nothing but "ok".
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import problem

EXEMPT = frozenset({"/healthz"})


def host_name(header: str) -> str:
    """The host of a ``Host`` header, lower case, without its port or IPv6 brackets."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


def allows(patterns: Sequence[str], host: str) -> bool:
    """Whether ``host`` (as ``host_name`` gives it) is one of ``patterns``: a name, an
    address, ``*.example.org`` (its subdomains) or ``*`` (any)."""
    for pattern in patterns:
        pattern = host_name(pattern)
        if pattern == "*" or pattern == host:
            return True
        if pattern.startswith("*.") and host.endswith(pattern[1:]):
            return True
    return False


class AllowedHosts:
    """ASGI middleware that refuses requests for hosts other than ``hosts`` (none: any)."""

    def __init__(self, app: ASGIApp, hosts: Sequence[str]) -> None:
        self.app = app
        self.hosts = list(hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.hosts or scope["path"] in EXEMPT:
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"host"), b"")
        host = host_name(header.decode("latin-1"))
        if allows(self.hosts, host):
            await self.app(scope, receive, send)
            return
        detail = (
            f"this gateway answers only to the hosts {', '.join(self.hosts)} (its setting "
            f"allowed_hosts), not to Host {host or '(none)'!r}: use one of those names in "
            "the gateway's URL"
        )
        response = problem(400, "Bad Request", detail, "host_not_allowed")
        await response(scope, receive, send)
