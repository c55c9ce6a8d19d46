"""The ``bulletin`` command, the top layer: it may import every package below it.

Each subcommand lives with what it runs: ``bulletin gateway`` in :mod:`gateway.command`,
``bulletin nodelet`` in :mod:`nodelet.command`, ``bulletin up`` in :mod:`bulletin.up`, the
administration commands in :mod:`bulletin.commands`. This module names them only, and
imports a subcommand's module when that subcommand runs, so ``bulletin nodelet`` loads
neither the gateway nor the scheduler. The base layer everything imports is
:mod:`bulletin_core`. Every option also reads a ``BULLETIN_<NAME>`` environment
variable (for example ``BULLETIN_DATABASE_URL``), so secrets need not appear on command
lines.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import click

from bulletin_core.settings import log_level_option

#: Each subcommand: the module and the name of its click command.
SUBCOMMANDS = {
    "up": ("bulletin.up", "command"),
    "gateway": ("gateway.command", "command"),
    "nodelet": ("nodelet.command", "command"),
    "migrate": ("bulletin.commands", "migrate"),
    "apply": ("bulletin.apply", "command"),
    "db": ("bulletin.commands", "db_group"),
    "user": ("bulletin.commands", "user"),
    "token": ("bulletin.commands", "token"),
    "group": ("bulletin.commands", "group"),
    "usage": ("bulletin.commands", "usage"),
    "node": ("bulletin.commands", "node"),
    "replay": ("bulletin.commands", "replay"),
    "doctor": ("bulletin.doctor", "command"),
}


class LazyGroup(click.Group):
    """A group whose subcommands are imported when looked up (click's documented pattern
    for lazily loaded subcommands)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *SUBCOMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in SUBCOMMANDS:
            return super().get_command(ctx, cmd_name)
        module, name = SUBCOMMANDS[cmd_name]
        command = getattr(importlib.import_module(module), name)
        if not isinstance(command, click.Command):
            raise TypeError(f"{module}.{name} is not a click command")
        return command


@click.group(cls=LazyGroup)
@log_level_option()
def cli() -> None:
    """Bulletin: run notebook functions on the lab's GPUs."""


def main(argv: Sequence[str] | None = None) -> None:
    """The ``bulletin`` command (also ``python -m bulletin``)."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="bulletin")
