"""How far ahead a node is given the items of a map: the lease of a slot holds at most
about :data:`CHUNK_S` of the map's work, so that a call of anyone else submitted meanwhile
waits no longer than that (and one item) for the slot, while short items run back to back
with the next already on the node as a result is on its way."""

from __future__ import annotations

import math

#: The most work (seconds, by the items' own times) one lease holds ahead.
CHUNK_S = 0.05
#: The most unfinished items one lease holds.
MAX_CHUNK = 32


def chunk_size(gpus: int, seconds_each: float | None, max_retries: int = 1) -> int:
    """How many unfinished items of a map a lease should hold once one of them completed
    in ``seconds_each`` (None: unknown). One for items on GPUs: a GPU is held from when it
    is given, and preemption stops the one attempt of a lease that runs; an item never
    waits on a GPU behind another. One for items that may not be retried
    (``max_retries`` 0): an attempt a lost node held counts, whether it ran or waited, and
    such a loss must cost at most the one that ran."""
    if gpus > 0 or max_retries < 1 or seconds_each is None or not math.isfinite(seconds_each):
        return 1
    return max(1, min(MAX_CHUNK, int(CHUNK_S / max(seconds_each, 1e-6))))
