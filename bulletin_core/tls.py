"""How the sdk, the nodelet and the local harness trust an https:// gateway."""

from __future__ import annotations

import os
import ssl


def verify(ca: str | os.PathLike[str] | None) -> ssl.SSLContext | bool:
    """What httpx's ``verify`` takes: the system's CAs (True), or only ``ca``, the PEM of
    the CA that signed the gateway's certificate (a lab's own)."""
    return ssl.create_default_context(cafile=os.fspath(ca)) if ca else True


def context(ca: str | os.PathLike[str] | None) -> ssl.SSLContext:
    """The same as an ``ssl.SSLContext``: the system's CAs, or only ``ca``."""
    return ssl.create_default_context(cafile=os.fspath(ca) if ca else None)


def untrusted(exc: BaseException) -> str | None:
    """Why the gateway's certificate was refused, if ``exc`` comes from that: a failure no
    retry mends, unlike a gateway that is down."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen.verify_message or str(seen)
        seen = seen.__cause__ or seen.__context__
    return None
