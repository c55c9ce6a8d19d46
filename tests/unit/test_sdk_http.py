"""The sdk's two HTTP paths: small exchanges take the lean client (bulletin_core/http1.py),
unless the environment names a proxy, which httpx then honours for every request."""

from __future__ import annotations

import socket
import threading

import pytest

from sdk._client import Client
from sdk._errors import GatewayError


def test_small_exchanges_take_the_lean_client_unless_a_proxy_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a proxy in the environment, every request goes through httpx, which honours
    it: the request reaches the proxy (in proxy form), never the gateway directly."""
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    direct = Client("http://127.0.0.1:9", "token")
    assert direct._fast is not None
    direct.close()
    with socket.create_server(("127.0.0.1", 0)) as proxy:
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.getsockname()[1]}")
        client = Client("http://127.0.0.1:9", "token")
        assert client._fast is None
        client.retry_deadline_s = 0.0
        seen: list[bytes] = []

        def serve() -> None:
            conn, _ = proxy.accept()
            with conn:
                seen.append(conn.recv(1 << 16))

        thread = threading.Thread(target=serve)
        thread.start()
        with pytest.raises(GatewayError):
            client.get("0" * 32)
        thread.join(5)
        client.close()
    assert seen and seen[0].startswith(b"GET http://127.0.0.1:9/v1/invocations/")
