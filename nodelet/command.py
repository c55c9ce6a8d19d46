"""``bulletin nodelet`` (also ``python -m nodelet``): run the node agent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from bulletin_core.settings import (
    build,
    log_level_option,
    options,
    run_alone,
)
from nodelet.config import NodeletConfig


@click.command("nodelet")
@log_level_option(default=None, from_env=False)
@click.option(
    "--gateway",
    "gateway_url",
    envvar="BULLETIN_GATEWAY",
    required=True,
    show_envvar=True,
    help="The gateway's URL, e.g. http://head:8420",
)
@click.option(
    "--token-file",
    envvar="BULLETIN_TOKEN_FILE",
    required=True,
    show_envvar=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="File holding this node's token (see 'bulletin node add').",
)
@options(NodeletConfig, skip=("gateway_url", "token"))
def command(gateway_url: str, token_file: Path, **values: Any) -> None:
    """Run the node agent: offer this machine's GPUs and run the work leased to it."""
    from nodelet.agent import run

    run(config_from(gateway_url, token_file, values))


def config_from(gateway_url: str, token_file: Path, values: dict[str, Any]) -> NodeletConfig:
    """The settings the command line gave (a usage error naming the option if one is bad)."""
    token = token_file.read_text().strip()
    return build(NodeletConfig, {**values, "gateway_url": gateway_url, "token": token}, "nodelet")


def main() -> None:
    """``python -m nodelet``: the same command, as a program of its own."""
    run_alone(command, "python -m nodelet")
