"""The sdk's public surface is pinned: changing it is a deliberate act."""

import sdk


def test_all_is_pinned() -> None:
    assert sdk.__all__ == [
        "AuthError",
        "BulletinError",
        "Call",
        "CallCancelled",
        "CallTimedOut",
        "Client",
        "ConfigError",
        "Function",
        "GatewayError",
        "GatewayUnreachable",
        "InvalidRequest",
        "NodeLostError",
        "NotFoundError",
        "OutOfMemoryError",
        "RateLimited",
        "RemoteError",
        "ResultTimeout",
        "SerializationError",
        "StateSyncWarning",
        "StateTooLarge",
        "Status",
        "UntrustedResult",
        "VersionSkewError",
        "WorkerDiedError",
        "connect",
        "function",
        "functions",
        "unregister",
    ]
