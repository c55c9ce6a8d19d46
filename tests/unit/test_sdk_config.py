"""Finding the cluster: sdk.connect, BULLETIN_CONFIG, BULLETIN_URL + BULLETIN_TOKEN, and the
messages that say what to set when nothing (or something malformed) is found."""

from __future__ import annotations

from pathlib import Path

import pytest

import sdk
from sdk import _config as config

ENV = ("BULLETIN_CONFIG", "BULLETIN_URL", "BULLETIN_TOKEN")


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(config, "_default", None)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "client.toml"
    path.write_text(text)
    return path


def test_bulletin_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, 'url = "http://127.0.0.1:8400"\ntoken = "bu_abc"\n')
    monkeypatch.setenv("BULLETIN_CONFIG", str(path))
    monkeypatch.setenv("BULLETIN_URL", "http://elsewhere:1")
    monkeypatch.setenv("BULLETIN_TOKEN", "bu_other")
    found = config.resolve()
    assert (found.url, found.token) == ("http://127.0.0.1:8400", "bu_abc")


def test_url_and_token_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BULLETIN_URL", "https://gpu.lab.example/")
    monkeypatch.setenv("BULLETIN_TOKEN", "bu_xyz")
    found = config.resolve()
    assert (found.url, found.token) == ("https://gpu.lab.example/", "bu_xyz")


def test_first_use_resolves_the_environment_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BULLETIN_URL", "http://127.0.0.1:8400/")
    monkeypatch.setenv("BULLETIN_TOKEN", "bu_xyz")
    client = config.default_client()
    assert client.url == "http://127.0.0.1:8400"
    assert config.default_client() is client


def test_nothing_configured_says_what_to_set() -> None:
    with pytest.raises(sdk.ConfigError) as info:
        config.resolve()
    message = str(info.value)
    for needed in ("bulletin up", "<state-dir>/client.toml", "BULLETIN_CONFIG", "BULLETIN_URL",
                   "BULLETIN_TOKEN", "sdk.connect"):  # fmt: skip
        assert needed in message


def test_a_remote_call_without_configuration_raises_config_error() -> None:
    @sdk.function()
    def f() -> int:
        return 1

    with pytest.raises(sdk.ConfigError, match="BULLETIN_CONFIG"):
        f()
    with pytest.raises(sdk.ConfigError, match="BULLETIN_CONFIG"):
        f.map([1, 2])


def test_empty_variables_count_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.setenv(name, "")
    with pytest.raises(sdk.ConfigError, match="No Bulletin cluster configured"):
        config.resolve()


@pytest.mark.parametrize(("present", "missing"), [("URL", "TOKEN"), ("TOKEN", "URL")])
def test_half_of_the_pair(monkeypatch: pytest.MonkeyPatch, present: str, missing: str) -> None:
    monkeypatch.setenv(f"BULLETIN_{present}", "http://x:1")
    with pytest.raises(sdk.ConfigError, match=f"BULLETIN_{present} is set but BULLETIN_{missing}"):
        config.resolve()


def test_config_file_that_does_not_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nope" / "client.toml"
    monkeypatch.setenv("BULLETIN_CONFIG", str(missing))
    with pytest.raises(sdk.ConfigError) as info:
        config.resolve()
    assert str(missing) in str(info.value)
    assert "(from BULLETIN_CONFIG)" in str(info.value)
    assert "bulletin up" in str(info.value)


@pytest.mark.parametrize("key", ["url", "token"])
def test_config_file_missing_a_key(tmp_path: Path, key: str) -> None:
    values = {"url": "http://127.0.0.1:8400", "token": "bu_abc"}
    del values[key]
    path = write(tmp_path, "".join(f'{k} = "{v}"\n' for k, v in values.items()))
    with pytest.raises(sdk.ConfigError) as info:
        sdk.connect(config=path)
    assert str(path) in str(info.value)
    assert f"no `{key}` key" in str(info.value)


def test_config_file_that_is_not_toml(tmp_path: Path) -> None:
    path = write(tmp_path, "url = [\n")
    with pytest.raises(sdk.ConfigError, match="is not valid TOML") as info:
        config.load(path)
    assert str(path) in str(info.value)


def test_config_file_with_a_wrong_type(tmp_path: Path) -> None:
    path = write(tmp_path, 'url = 8400\ntoken = "bu_abc"\n')
    with pytest.raises(sdk.ConfigError, match="is malformed") as info:
        config.load(path)
    assert str(path) in str(info.value)
    assert "url" in str(info.value)


def test_url_needs_a_scheme(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BULLETIN_URL", "127.0.0.1:8400")
    monkeypatch.setenv("BULLETIN_TOKEN", "bu_abc")
    with pytest.raises(sdk.ConfigError, match="must start with http:// or https://"):
        config.resolve()


def test_connect_sets_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BULLETIN_URL", "http://from-env:1")
    monkeypatch.setenv("BULLETIN_TOKEN", "bu_env")
    client = sdk.connect("http://127.0.0.1:9", "bu_explicit")
    assert isinstance(client, sdk.Client)
    assert client.url == "http://127.0.0.1:9"
    assert config.default_client() is client
    assert sdk.connect("http://127.0.0.1:10", "bu_2") is config.default_client()


def test_connect_with_a_config_file_and_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, 'url = "http://127.0.0.1:8400"\ntoken = "bu_abc"\n')
    assert sdk.connect(config=path).url == "http://127.0.0.1:8400"
    found = config.resolve("http://127.0.0.1:9999", config=str(path))
    assert (found.url, found.token) == ("http://127.0.0.1:9999", "bu_abc")


def test_connect_without_arguments_reads_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, 'url = "http://127.0.0.1:8400"\ntoken = "bu_abc"\n')
    monkeypatch.setenv("BULLETIN_CONFIG", str(path))
    assert sdk.connect().url == "http://127.0.0.1:8400"


def test_the_ca_comes_from_the_argument_the_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca, other = tmp_path / "ca.pem", tmp_path / "other.pem"
    ca.write_text("pem")
    other.write_text("pem")
    toml = tmp_path / "client.toml"
    toml.write_text(f'url = "https://head:8420"\ntoken = "bu_x"\nca = "{ca}"\n')
    assert config.resolve(config=toml).ca == str(ca)
    assert config.resolve(config=toml, ca=other).ca == str(other)  # the argument wins
    monkeypatch.setenv("BULLETIN_CA", str(other))
    assert config.resolve("https://head:8420", "bu_x").ca == str(other)
    monkeypatch.setenv("BULLETIN_CA", str(tmp_path / "missing.pem"))
    with pytest.raises(sdk.ConfigError, match="is not a file"):
        config.resolve("https://head:8420", "bu_x")
