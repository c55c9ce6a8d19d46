"""The gateway over HTTPS: the sdk and the nodelet verify its certificate against the lab's
own CA; a certificate nobody vouched for fails at once, saying what to set. Certificates
come from a test CA (trustme); the traffic stays on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trustme

import sdk
from bulletin import admin
from tests.conftest import Cluster, running, wait_until


@dataclass(frozen=True)
class Pki:
    ca: str
    cert: str
    key: str


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    authority = trustme.CA()
    issued = authority.issue_cert("127.0.0.1", "localhost")
    ca, cert, key = tmp_path / "ca.pem", tmp_path / "gateway.pem", tmp_path / "gateway.key"
    authority.cert_pem.write_to_path(str(ca))
    issued.private_key_pem.write_to_path(str(key))
    key.chmod(0o600)
    cert.write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
    return Pki(str(ca), str(cert), str(key))


@pytest.fixture
def https_gateway(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest, pki: Pki
) -> Iterator[Cluster]:
    cluster = Cluster(database_url, tmp_path)
    cluster.ca = pki.ca
    options = {"tls-cert-file": pki.cert, "tls-key-file": pki.key}
    with running(cluster, request, options=options) as started:
        yield started


def test_a_call_runs_over_https_with_the_labs_ca(https_gateway: Cluster, pki: Pki) -> None:
    cluster = https_gateway
    assert cluster.url.startswith("https://127.0.0.1:")
    # The nodelet verifies the gateway too: it registers, polls and reports over HTTPS.
    cluster.start_nodelet(**{"ca-file": pki.ca})
    sdk.connect(cluster.url, cluster.token, ca=pki.ca)
    assert sdk.function()(lambda: 41 + 1).spawn().result(timeout=60) == 42
    # Nothing is served in the clear on that port.
    with pytest.raises(httpx.TransportError):
        httpx.get(cluster.url.replace("https://", "http://") + "/healthz", timeout=5)


def test_an_untrusted_certificate_fails_at_once_saying_what_to_set(
    https_gateway: Cluster,
) -> None:
    client = sdk.Client(https_gateway.url, https_gateway.token)  # the system's CAs only
    start = time.monotonic()
    with pytest.raises(sdk.ConfigError, match="does not trust") as info:
        client.cluster()
    # Not retried until the 30 s deadline: no retry mends a certificate.
    assert time.monotonic() - start < 10
    assert "BULLETIN_CA" in str(info.value) and "ca =" in str(info.value)


def test_a_client_toml_names_the_ca(https_gateway: Cluster, pki: Pki, tmp_path: Path) -> None:
    config = tmp_path / "client.toml"
    url, token = https_gateway.url, https_gateway.token
    config.write_text(f'url = "{url}"\ntoken = "{token}"\nca = "{pki.ca}"\n')
    assert sdk.connect(config=config).cluster().user == "alice"


def test_a_nodelet_trusts_no_gateway_its_ca_did_not_sign(https_gateway: Cluster) -> None:
    # Without --ca-file the lab's certificate is one nobody vouched for, as a machine in the
    # middle's would be: the nodelet sends it nothing (its token included) and says what to
    # give.
    cluster = https_gateway
    cluster.start_nodelet("node-x")
    log = cluster.dir / "node-x.log"
    said = lambda: "give its certificate with --ca-file" in log.read_text()  # noqa: E731
    wait_until(said, 30, "the nodelet to refuse the gateway's certificate")
    [node] = [n for n in asyncio.run(admin.nodes(cluster.database_url)) if n.name == "node-x"]
    assert node.last_heartbeat is None  # it never registered
