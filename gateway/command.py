"""``bulletin gateway`` (also ``python -m gateway``): run a gateway replica."""

from __future__ import annotations

import os
from typing import Any

import click

from bulletin_core.settings import (
    build,
    env_log_level,
    log_level_option,
    options,
    setup_logging,
)
from gateway.config import GatewayConfig


@click.command("gateway")
@log_level_option(default=None, from_env=False)
@options(GatewayConfig)
def command(**values: Any) -> None:
    """Run a gateway replica (HTTP API and scheduler host) against PostgreSQL."""
    from gateway.server import serve

    serve(build(GatewayConfig, values, "gateway"))


def main() -> None:
    """``python -m gateway``: the same command, logging at ``BULLETIN_LOG_LEVEL`` (default
    info) unless ``--log-level`` says otherwise."""
    try:
        setup_logging(env_log_level(os.environ))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    command.main(prog_name="python -m gateway")
