"""Bulletin's user library: run notebook functions on the lab's GPU cluster.

Quick example::

    import socket
    import sdk  # finds the cluster through BULLETIN_CONFIG (the client.toml that
                # `bulletin up` writes), or BULLETIN_URL + BULLETIN_TOKEN, or sdk.connect()

    @sdk.function(gpus=1)
    def train_step(x):
        print("hello from", socket.gethostname())  # shows up live here
        return x * 2

    train_step(21)                       # runs on a GPU node, returns 42; globals that
                                         # train_step changed are updated here too
    call = train_step.spawn(21)          # returns at once; call.result() waits
    list(train_step.map(range(10)))      # one call per item, results in order
    sdk.Call.from_id(call.id).result()   # re-attach, e.g. after a kernel restart
    call.status()                        # 'queued', and while it waits: where and why
    train_step.register("double")        # invocable by name with JSON over HTTP
    sdk.functions()                      # what you registered

Errors are described in ``sdk.errors``; an exception raised by the remote function is
re-raised here with its own type and the remote traceback.
"""

from sdk.call import Call, Status
from sdk.client import Client
from sdk.config import connect
from sdk.errors import (
    AuthError,
    BulletinError,
    CallCancelled,
    CallTimedOut,
    ConfigError,
    GatewayError,
    GatewayUnreachable,
    InvalidRequest,
    NodeLostError,
    NotFoundError,
    OutOfMemoryError,
    RateLimited,
    RemoteError,
    ResultTimeout,
    SerializationError,
    StateSyncWarning,
    StateTooLarge,
    UntrustedResult,
    VersionSkewError,
    WorkerDiedError,
)
from sdk.function import Function, function, functions, unregister

__all__ = [
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
