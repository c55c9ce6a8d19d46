"""``bulletin gateway`` (also ``python -m gateway``): run a gateway replica."""

from __future__ import annotations

from typing import Any

import click

from bulletin_core.settings import (
    build,
    log_level_option,
    options,
    run_alone,
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
    """``python -m gateway``: the same command, as a program of its own."""
    run_alone(command, "python -m gateway")
