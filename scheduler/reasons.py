"""Why a pending call waits, worded for its owner (``call.status()``), and the bookkeeping that
records it only when someone asks (:func:`scheduler.core.explain`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ParamSpec

from scheduler import placement
from scheduler.capacity import Capacity
from scheduler.model import Part, Pending

#: call id -> (position in the policy's order, 1 is next; reason)
Why = dict[str, tuple[int, str]]
P = ParamSpec("P")


def note(
    why: Why | None,
    call: Pending,
    pos: int,
    reason: Callable[P, str],
    *args: P.args,
    **kwargs: P.kwargs,
) -> None:
    """Record why ``call`` is where it is; the reason is only worded when asked for."""
    if why is not None:
        why[call.id] = (pos, reason(*args, **kwargs))


def rest(why: Why | None, order: Sequence[Pending], pos: int, reason: str) -> None:
    """Record ``reason`` (with ``{ahead}`` filled in: "behind 2 earlier calls") for
    ``order[pos - 1:]``."""
    if why is not None:
        for i, call in enumerate(order[pos - 1 :], pos):
            why[call.id] = (i, reason.format(ahead=ahead(i - 1, "earlier calls")))


def shortfall(call: Pending, cap: Capacity) -> str:
    """Why ``call`` does not fit in what ``cap`` has left."""
    if call.gpus == 0:
        return "waiting for a free CPU slot"
    what = gpus(call.gpus, call.gpu_model, call.share)
    if call.min_memory_mib:
        what += f" with at least {call.min_memory_mib} MiB"
    if call.gpus > cap.largest_for(call):
        whole = len(cap.whole_free(call))
        return f"waiting for {what} on whole nodes; {plural(whole, 'whole node')} free"
    most = cap.most_free(call)
    free = "none free" if most == 0 else f"{most} free at most"
    return f"waiting for {what} on one node; {free}"


def plural(n: int, thing: str) -> str:
    return f"{n} {thing}" + ("" if n == 1 else "s")


def gpus(n: int, model: str | None = None, share: float = 1.0) -> str:
    """``1 GPU``, ``4 A100 GPUs``, ``2 A100 or H100 GPUs``, ``0.25 of one A100 GPU``."""
    if share != 1.0:  # (n is 1)
        return f"{share:g} of one {placement.model_words(model) + ' ' if model else ''}GPU"
    return plural(n, f"{placement.model_words(model)} GPU" if model else "GPU")


def ahead(n: int, what: str = "calls") -> str:
    """Where a call stands: ``next``, ``behind 1 call``, ``behind 3 calls``."""
    if n == 0:
        return "next in line"
    return f"behind {n} {what[:-1] if n == 1 else what}"


def starting(parts: tuple[Part, ...], how: str = "") -> str:
    return f"starting now on node {parts[0].node_id}{how}"
