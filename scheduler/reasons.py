"""Why a pending call waits, worded for its owner (``call.status()``), and the bookkeeping that
records it only when someone asks (:func:`scheduler.core.explain`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ParamSpec

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
    """Record ``reason`` (with ``{ahead}`` filled in) for ``order[pos - 1:]``."""
    if why is not None:
        for i, call in enumerate(order[pos - 1 :], pos):
            why[call.id] = (i, reason.format(ahead=i - 1))


def shortfall(call: Pending, cap: Capacity) -> str:
    """Why ``call`` does not fit in what ``cap`` has left."""
    if call.gpus == 0:
        return "waiting for a free CPU slot"
    what = f"{call.gpu_model} GPUs" if call.gpu_model else "GPUs"
    if call.min_memory_mib:
        what += f" with at least {call.min_memory_mib} MiB"
    if call.gpus > cap.largest_for(call):
        whole = cap.whole_free(call)
        return f"waiting for {call.gpus} {what} on whole nodes; {len(whole)} whole nodes free"
    return f"waiting for {call.gpus} {what} on one node; {cap.most_free(call)} free at most"


def starting(parts: tuple[Part, ...], how: str = "") -> str:
    return f"starting now on node {parts[0].node_id}{how}"
