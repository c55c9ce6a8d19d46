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

Every error the sdk raises derives from ``sdk.BulletinError`` (the tree is drawn in
``sdk/_errors.py``); an exception raised by the remote function is re-raised here with its
own type and the remote traceback.

The modules under ``sdk`` are private (``sdk._client``...): everything public is here, in
``__all__``, and names itself ``sdk.<name>`` (its ``__module__``), so reprs, ``help()`` and
pickles by reference do not depend on which private module defines it.
"""

from sdk._call import Call, Status
from sdk._client import Client
from sdk._config import connect
from sdk._errors import (
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
from sdk._function import Function, function, functions, unregister

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


def _claim_exports() -> None:
    # Only what the sdk defines: a name re-exported from elsewhere keeps its own module.
    namespace = globals()
    for name in __all__:
        if namespace[name].__module__.startswith(__name__ + "._"):
            namespace[name].__module__ = __name__


_claim_exports()
del _claim_exports
