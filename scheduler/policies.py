"""The policy registry: ``fifo`` (:mod:`scheduler.fifo`) and ``fair`` (:mod:`scheduler.fair`).

A policy's ``plan(snapshot, why)`` returns a :class:`~scheduler.model.Plan` and, when ``why``
is given, fills it with ``call id -> (position, reason)`` for every pending call
(see :func:`scheduler.core.explain`). Policies are selected by name; :func:`register` adds one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from scheduler.fair import Fair
from scheduler.fifo import Fifo
from scheduler.model import Plan, Snapshot, UnknownPolicyError
from scheduler.reasons import Why


class Policy(Protocol):
    name: str
    #: Whether the policy enforces group quotas (so submit-time checks should too).
    uses_quotas: bool
    #: Whether its plans may preempt: a policy that never does places nothing while no GPU
    #: is free, so a replay need not ask it then (one that does not say is asked).
    preempts: ClassVar[bool]

    def plan(self, snapshot: Snapshot, why: Why | None = None) -> Plan: ...


POLICIES: dict[str, Callable[..., Policy]] = {"fifo": Fifo, "fair": Fair}


def register(name: str, factory: Callable[..., Policy]) -> None:
    """Make a policy available by ``name`` (``factory()`` builds one with default settings)."""
    POLICIES[name] = factory


def get(name: str, **settings: Any) -> Policy:
    """A fresh policy; ``settings`` override its defaults (e.g. ``starve_after_s`` of fair)."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise UnknownPolicyError(name, POLICIES) from None
    return factory(**settings)
