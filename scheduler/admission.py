"""Submit-time rejection: calls that can never run on this cluster, with the reason.

Looks at every node, draining ones included (draining is temporary), and at the group's quota
ceiling: a call bigger than any node runs on whole nodes and holds all their GPUs, so it can
never run if the fewest whole nodes that hold it have more GPUs than its group may hold. With
quotas per model, a call that fits one node only on models its group may not hold that many
of can never run either.
A cluster with no nodes rejects nothing: nodes may still register.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from scheduler import placement
from scheduler.model import DEFAULT_QUOTA, EPSILON, MIN_SHARE, NodeCapacity, Pending, Quota
from scheduler.quotas import Book


def never_fits(
    call: Pending,
    nodes: Sequence[NodeCapacity],
    quotas: Mapping[str, Quota] | None = None,
    default: Quota = DEFAULT_QUOTA,
) -> str | None:
    """Why ``call`` can never be placed, or None if it can."""
    if call.gpus < 0:
        return f"a call cannot ask for {call.gpus} GPUs"
    if call.share != 1.0 and (not MIN_SHARE <= call.share < 1 or call.gpus != 1):
        return (
            f"a call may ask for part of one GPU (a share from {MIN_SHARE:g} to below 1), not "
            f"{call.share:g} of {call.gpus} GPUs; ask for whole GPUs, or for part of one"
        )
    quota = (quotas or {}).get(call.group, default)
    if call.amount > quota.ceiling + EPSILON:
        return (
            f"needs {call.amount:g} GPUs but group {call.group or '(none)'} may hold at most "
            f"{quota.ceiling:g} (guarantee {quota.guaranteed} + borrowing limit "
            f"{quota.borrow_limit}); ask an admin to raise the quota or ask for fewer GPUs"
        )
    if call.gpus == 0 or not nodes:
        return None
    largest = max(placement.qualifying(n, call) for n in nodes)  # draining is temporary
    if largest == 0:
        return f"no node has {_what(call)}; models here: {_models(nodes)}"
    if quota.models:  # the models its group may hold as many of as it asks for
        kept = Book((), {call.group: quota}, default, nodes).restrict(call)
        mine = 0 if kept is None else max(placement.qualifying(n, kept) for n in nodes)
        if mine < min(call.gpus, largest):
            limits = ", ".join(f"{q.ceiling:g} {m}" for m, q in quota.models)
            return (
                f"needs {call.gpus} {_what(call)} on one node, and the nodes of the models "
                f"group {call.group or '(none)'} may hold that many of have at most {mine}: "
                f"its quota per model lets it hold at most {limits}; ask an admin to raise "
                "it, or ask for fewer GPUs"
            )
    if call.gpus <= largest:
        return None
    sizes = sorted((len(n.gpus) for n in nodes if placement.whole_node_ok(n, call)), reverse=True)
    whole = sum(sizes)
    if call.gpus > whole:
        return (
            f"needs {call.gpus} {_what(call)} but the largest node has {largest} and whole "
            f"nodes add up to {whole}; ask for at most {max(largest, whole)}"
        )
    picked = placement.fewest_whole(sizes, call.gpus) or []
    taking = sum(sizes[i] for i in picked)
    if taking > quota.ceiling:  # a gang holds every GPU of its whole nodes
        return (
            f"needs {call.gpus} {_what(call)}, more than any node has, so it runs on whole "
            f"nodes, and the fewest whole nodes that hold it have {taking} GPUs; group "
            f"{call.group or '(none)'} may hold at most {quota.ceiling:g} (guarantee "
            f"{quota.guaranteed} + borrowing limit {quota.borrow_limit}); ask for at most "
            f"{largest} (one node), or ask an admin to raise the quota"
        )
    return None


def _what(call: Pending) -> str:
    what = f"{placement.model_words(call.gpu_model)} GPUs" if call.gpu_model else "GPUs"
    return what + (f" with at least {call.min_memory_mib} MiB" if call.min_memory_mib else "")


def _models(nodes: Sequence[NodeCapacity]) -> str:
    kinds = sorted({f"{g.model or '?'} ({g.memory_mib} MiB)" for n in nodes for g in n.gpus})
    return ", ".join(kinds) or "unknown"
