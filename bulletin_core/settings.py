"""Settings: one definition per setting, read alike by decoding, validation and ``--help``.

A component's settings are a frozen msgspec Struct (``gateway.config.GatewayConfig``,
``nodelet.config.NodeletConfig``). Each field carries its rule and its description in
``msgspec.Meta``::

    lease_s: Annotated[float, POSITIVE, doc("How long a lease lasts without renewal.")] = 30.0

msgspec enforces the rule when settings are converted (the command line, the environment);
:func:`check`, called from the Struct's ``__post_init__``, enforces the same rules on a
Struct built in Python and rejects floats that are not finite, so both ways fail alike,
naming the setting. Rules between settings stay in ``__post_init__``, after :func:`check`.
:func:`options` turns the same fields into command-line options (click is imported only
there): ``--lease-s``, also read from ``BULLETIN_LEASE_S``, with the description and the rule
as its help.
"""

from __future__ import annotations

import logging
import math
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import msgspec

from bulletin_core import meta

F = TypeVar("F", bound=Callable[..., Any])

#: Rules shared by many settings.
POSITIVE = msgspec.Meta(gt=0)
AT_LEAST_0 = msgspec.Meta(ge=0)
AT_LEAST_1 = msgspec.Meta(ge=1)

ENV_PREFIX = "BULLETIN_"
LOG_LEVELS = ("debug", "info", "warning", "error")


def doc(text: str) -> msgspec.Meta:
    """A setting's description: shown by ``--help`` and published in JSON Schema."""
    return msgspec.Meta(description=" ".join(text.split()))


def option_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def _fields(struct: type) -> Iterator[msgspec.inspect.Field]:
    info = msgspec.inspect.type_info(struct)
    assert isinstance(info, msgspec.inspect.StructType)
    yield from info.fields


def _breaks(kind: msgspec.inspect.Type, value: Any) -> bool:
    kind = meta.bare(kind)
    if value is None:
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return True
    checks = (
        ("gt", lambda bound: value > bound),
        ("ge", lambda bound: value >= bound),
        ("lt", lambda bound: value < bound),
        ("le", lambda bound: value <= bound),
        ("min_length", lambda bound: len(value) >= bound),
    )
    for attribute, holds in checks:
        bound = getattr(kind, attribute, None)
        if bound is not None and not holds(bound):
            return True
    return False


class SettingError(ValueError):
    """A setting breaks its rule; ``setting`` names it."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting


def problems(settings: msgspec.Struct) -> list[tuple[str, str]]:
    """(field, what is wrong) for every field of ``settings`` that breaks its rule."""
    found = []
    for field in _fields(type(settings)):
        value = getattr(settings, field.name)
        if _breaks(field.type, value):
            words = meta.rule(field.type)
            if isinstance(value, float) and not math.isfinite(value):
                words = f"a finite number {words}".strip()
            found.append((field.name, f"{field.name} must be {words}, got {value!r}"))
    return found


def check(settings: msgspec.Struct, what: str, more: Sequence[str] = ()) -> None:
    """Raise :class:`SettingError` listing every field of ``settings`` that breaks its rule,
    and the ``more`` problems found by rules between fields (``what``: whose settings)."""
    found = problems(settings)
    if found or more:
        text = "; ".join([*(message for _, message in found), *more])
        raise SettingError(found[0][0] if found else "", f"invalid {what} config: {text}")


def from_values(struct: type[msgspec.Struct], values: Mapping[str, Any], what: str) -> Any:
    """``struct`` from ``values`` (None: left out), raising :class:`SettingError` (a
    ``ValueError``) that names the setting, whichever rule it breaks."""
    given = {name: value for name, value in values.items() if value is not None}
    try:
        return msgspec.convert(given, struct)
    except msgspec.ValidationError as exc:
        text = str(exc)
        name = text.rsplit("`$.", 1)[1].rstrip("`") if "`$." in text else ""
        kinds = {field.name: field.type for field in _fields(struct)}
        if name in kinds and meta.rule(kinds[name]):
            message = f"{name} must be {meta.rule(kinds[name])}, got {given[name]!r}"
            raise SettingError(name, f"invalid {what} config: {message}") from None
        raise SettingError(name, text) from None


def _click_type(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        return _click_type(annotation)
    return {int: int, float: float, str: str, bool: bool}.get(annotation, str)


def options(struct: type, skip: Sequence[str] = ()) -> Callable[[F], F]:
    """A decorator adding one click option per field of ``struct`` (``--name-of-it``, also
    read from ``BULLETIN_NAME_OF_IT``), its help the field's description, rule and default.
    Values left out are None: the Struct's defaults then apply (:func:`from_values`)."""
    import click

    hints = typing.get_type_hints(struct, include_extras=True)

    def decorate(fn: F) -> F:
        for field in reversed(list(_fields(struct))):
            if field.name in skip:
                continue
            default = None if field.required else field.default
            help_parts = [meta.description(field.type)]
            if meta.rule(field.type):
                help_parts.append(f"Must be {meta.rule(field.type)}.")
            if default not in (None, "", msgspec.NODEFAULT):
                help_parts.append(f"[default: {default}]")
            fn = click.option(
                option_name(field.name),
                field.name,
                type=_click_type(hints[field.name]),
                envvar=env_name(field.name),
                required=field.required,
                default=None,
                help=" ".join(part for part in help_parts if part),
                show_envvar=True,
            )(fn)
        return fn

    return decorate


def build(struct: type[msgspec.Struct], values: Mapping[str, Any], what: str) -> Any:
    """:func:`from_values` for a command: a bad setting is a usage error naming its option."""
    import click

    try:
        return from_values(struct, values, what)
    except SettingError as exc:
        hint = f"{option_name(exc.setting)} / {env_name(exc.setting)}" if exc.setting else None
        raise click.BadParameter(str(exc), param_hint=hint) from None


def setup_logging(level: str) -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    root.setLevel(level.upper())
    # Per-request lines from the HTTP stack drown out ours, even at debug.
    for noisy in ("httpx", "httpcore", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))


def log_level_option(default: str | None = "info", *, from_env: bool = True) -> Callable[[F], F]:
    """``--log-level``, applied as soon as it is parsed; read from ``BULLETIN_LOG_LEVEL`` when
    ``from_env``. A subcommand's has ``default`` None and ``from_env`` False: it applies only
    when given, so the group's (its flag, else the variable) stands otherwise."""
    import click

    def apply(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
        if value is not None:
            setup_logging(value)
        return value

    return click.option(
        "--log-level",
        envvar="BULLETIN_LOG_LEVEL" if from_env else None,
        default=default,
        show_envvar=from_env,
        is_eager=True,
        expose_value=False,
        callback=apply,
        type=click.Choice(LOG_LEVELS, case_sensitive=False),
        help="How much to log." if from_env else "How much to log [default: the group's].",
    )


def env_log_level(environ: Mapping[str, str]) -> str:
    """``BULLETIN_LOG_LEVEL`` from ``environ`` (default info), for a command run on its own
    (``python -m gateway``); ValueError, naming the variable, if it is not a level."""
    level = environ.get("BULLETIN_LOG_LEVEL", "info").lower()
    if level not in LOG_LEVELS:
        choices = ", ".join(LOG_LEVELS)
        raise ValueError(f"BULLETIN_LOG_LEVEL must be one of {choices}, got {level!r}")
    return level


def run_alone(command: Any, prog_name: str) -> None:
    """Run a component's click ``command`` as its own program (``python -m gateway``):
    logging at ``BULLETIN_LOG_LEVEL`` (default info) unless its ``--log-level`` says
    otherwise, as under the ``bulletin`` group."""
    import os

    try:
        setup_logging(env_log_level(os.environ))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    command.main(prog_name=prog_name)
