"""A small ASGI app served by a real uvicorn on a free loopback port, in a thread (for
tests of HTTP clients against answers a test scripts)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn


@contextlib.contextmanager
def serving(app: Any, **config: Any) -> Iterator[str]:
    """Serve ``app`` (uvicorn settings ``config``) until the block ends; yields its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    settings = {"log_level": "warning", "loop": "asyncio", "http": "h11", **config}
    served = uvicorn.Server(uvicorn.Config(app, **settings))
    thread = threading.Thread(target=served.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not served.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        served.should_exit = True
        thread.join(10)
