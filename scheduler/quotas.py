"""GPUs each group holds against its quota, as a round goes on (Kueue / Run:ai semantics).

A group's guarantee is the GPUs it gets back whenever it has work for them; above it, a group
borrows idle GPUs up to its ceiling (guarantee + borrowing limit), and borrowed GPUs may be
reclaimed. A call is *nominal* if its group, holding it, stays within its guarantee; otherwise
it borrows. Groups without a configured quota get ``DEFAULT_QUOTA``: nothing guaranteed, may
borrow every idle GPU. Calls already told to stop do not count: their GPUs are on the way back.

**Quotas per model** (:attr:`~scheduler.model.Quota.models`, Kueue's resource flavours): a
group's GPUs of a listed model count against that model's quota as well as the group's. The
group holds at most the model's ceiling of them (a call is kept to the models it may still
take, :meth:`Book.restrict`), and those above the model's guarantee are borrowed, so another
group may reclaim them. A GPU belongs to the longest listed model that is part of its model
name (case-insensitive); GPUs of unlisted models, and of nodes whose inventory is unknown,
count against the group's quota only.

A call that holds a share of one GPU (``share``) counts as that share of a GPU, here and in
its model's quota.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, MutableMapping, Sequence

from scheduler import placement
from scheduler.model import DEFAULT_QUOTA, EPSILON, NodeCapacity, Part, Pending, Quota, Running

#: What reclaim has taken back so far from groups (by name) and from groups' models (by
#: (group, model)): see :meth:`Book.count_release`.
Released = MutableMapping[str | tuple[str, str], float]


def model_of(models: tuple[tuple[str, Quota], ...], name: str) -> str | None:
    """The listed model a GPU named ``name`` counts against: the longest one that is part of
    its name, case-insensitive (ties: the first listed); None if none is."""
    folded = name.casefold()
    best = None
    for model, _ in models:
        if model and model.casefold() in folded and (best is None or len(model) > len(best)):
            best = model
    return best


def case_clash(models: Iterable[str]) -> str | None:
    """Why a group's listed models clash: two that differ only in case (a GPU would count
    against either); None if none do."""
    seen: dict[str, str] = {}
    for model in models:
        other = seen.setdefault(model.casefold(), model)
        if other != model:
            return (
                f"the quota names the models {other!r} and {model!r}, which differ only in "
                "case (models match case-insensitively): name each model once"
            )
    return None


#: :meth:`Book.restrict` kept nothing from the call.
_ALL = "\0all"


class Book:
    """GPUs held per group (and per group and listed model) during one round. ``nodes``: the
    round's nodes, whose inventories say which model each GPU is (only read when some quota
    lists models)."""

    def __init__(
        self,
        running: Sequence[Running],
        quotas: Mapping[str, Quota],
        default: Quota = DEFAULT_QUOTA,
        nodes: Sequence[NodeCapacity] = (),
        held: Mapping[str, float] | None = None,
    ) -> None:
        """``held``: the GPUs per group of ``running``'s calls not being preempted
        (:attr:`Snapshot.held`: whole GPUs plus ``math.fsum`` of the shares, as counted here),
        when the caller keeps that count; it then spares a pass over them (unless some quota
        lists models, which needs them one by one)."""
        self.quotas = quotas
        self.default = default
        self.used: dict[str, float] = defaultdict(int)
        #: GPUs held per (group, listed model), for groups with quotas per model.
        self.model_used: dict[tuple[str, str], float] = defaultdict(int)
        self.per_model = bool(default.models) or any(q.models for q in quotas.values())
        self._names: dict[int, dict[int, str]] = {}
        self._listed: dict[str, dict[str, Quota]] = {}  # group -> its models' quotas
        self._model_memo: dict[tuple[str, str], str | None] = {}  # (group, name) -> model
        #: Per running call: its GPUs per listed model (fixed for a round; read-only).
        self._run_memo: dict[str, dict[str, float]] = {}
        #: restrict's answers, by group, the listed models without room, and the call's kind.
        self._kept: dict[tuple[str, tuple[str, ...], float, str | None, bool], str | None] = {}
        #: Per (group, models a call may use): the group's listed models among them.
        self._limits: dict[tuple[str, str | None], tuple[tuple[str, Quota], ...]] = {}
        #: The GPU model names of the nodes (casefolded), the alternatives a call is kept to.
        self.names: tuple[str, ...] = ()
        #: Per node whose GPUs all have one model name: that name and the GPUs' indices (a
        #: part's GPUs there are counted at once, not one by one).
        self._alike: dict[int, tuple[str, frozenset[int]]] = {}
        #: No model name has a "|" in it (it would read as alternatives: see _kept_models).
        self._plain = True
        if self.per_model:
            every: set[str] = set()
            for node in nodes:
                names = self._names[node.node_id] = {g.index: g.model for g in node.gpus}
                models = set(names.values())
                every |= models
                if len(models) == 1:
                    self._alike[node.node_id] = (models.pop(), frozenset(names))
            self.names = tuple(sorted({name.casefold() for name in every}))
            self._plain = not any("|" in name for name in self.names)
        used, model_used = self.used, self.model_used
        if held is not None and not self.per_model:
            used.update(held)
            return
        if not self.per_model:
            parts: dict[str, list[float]] = {}
            for run in running:
                if run.preempting:
                    continue
                if run.share == 1.0:  # (run.amount inlined: this runs per running call)
                    used[run.group] += run.gpus
                else:
                    parts.setdefault(run.group, []).append(run.share)
            for group, shares in parts.items():  # (summed exactly: in any order, the same)
                used[group] += math.fsum(shares)
            return
        # (the common case, one node of one model, with _alike_name, quota and _model
        # inlined and without add_run's memo: this runs per running call each round)
        alike_of, quota_of, default = self._alike.get, quotas.get, self.default
        memo = self._model_memo
        for run in running:
            if run.preempting:
                continue
            indices = run.gpu_indices
            alike = None if run.more or run.gpu_models or not indices else alike_of(run.node_id)
            if alike is None or not alike[1].issuperset(indices):
                self.add_run(run)
                continue
            group = run.group
            used[group] += len(indices) if run.share == 1.0 else run.share
            if quota_of(group, default).models:
                key = (group, alike[0])
                model = memo[key] if key in memo else self._model(group, alike[0])
                if model is not None:
                    model_used[(group, model)] += run.share * len(indices)

    def quota(self, group: str) -> Quota:
        return self.quotas.get(group, self.default)

    def nominal(self, call: Pending) -> bool:
        """Whether the call fits inside its group's guarantee (its models' guarantees are
        :meth:`restrict`'s to keep)."""
        return self.used[call.group] + call.amount <= self.quota(call.group).guaranteed + EPSILON

    def within_ceiling(self, call: Pending) -> bool:
        """Whether the call's request fits under its group's ceiling (a gang on whole nodes
        may take more than it asks for: place it within :meth:`room`)."""
        return self.used[call.group] + call.amount <= self.quota(call.group).ceiling + EPSILON

    def room(self, group: str) -> float:
        """The most GPUs the group may still take (inf: no ceiling; shares are summed in
        floating point, so the room is given a hair more, as the comparisons here are)."""
        return self.quota(group).ceiling - self.used[group] + EPSILON

    def lent(self, group: str, extra: float = 0.0) -> float:
        """How much the group borrows for its weight: GPUs held past its guarantee (with
        ``extra`` more), over the guarantee plus one (a group without one still counts)."""
        quota = self.quota(group)
        return (self.used[group] + extra - quota.guaranteed) / (quota.guaranteed + 1)

    def borrowing(self, group: str) -> bool:
        """Whether the group holds more than its guarantee (so some of it is reclaimable)."""
        return self.used[group] > self.quota(group).guaranteed + EPSILON

    def any_borrowing(self) -> bool:
        if any(self.borrowing(g) for g in list(self.used)):
            return True
        return any(
            used > self._model_quota(group, model).guaranteed + EPSILON
            for (group, model), used in list(self.model_used.items())
        )

    def add(self, group: str, parts: Sequence[Part], sign: int = 1, share: float = 1.0) -> None:
        """Charge the group the GPUs of ``parts`` (``sign`` -1: give them back), ``share`` of
        each."""
        self.used[group] += sign * share * sum(len(p.gpu_indices) for p in parts)
        for model, n in self._counts(group, parts, share).items():
            self.model_used[(group, model)] += sign * n

    def _model(self, group: str, name: str) -> str | None:
        """The group's listed model a GPU named ``name`` counts against (:func:`model_of`)."""
        key = (group, name)
        if key not in self._model_memo:
            self._model_memo[key] = model_of(self.quota(group).models, name)
        return self._model_memo[key]

    def add_run(self, run: Running, sign: int = 1) -> None:
        """Charge (``sign`` -1: give back) a running call's GPUs to its group."""
        self.used[run.group] += sign * run.amount
        for model, n in self._run_counts(run).items():
            self.model_used[(run.group, model)] += sign * n

    def _run_counts(self, run: Running) -> dict[str, float]:
        """A running call's GPUs per listed model of its group (from its own ``gpu_models``
        when it has them, else from the nodes' inventories)."""
        if not self.per_model or not self.quota(run.group).models:
            return {}
        counts = self._run_memo.get(run.id)
        if counts is not None:
            return counts
        if not run.gpu_models:  # (one part, without building it: this runs per running call)
            parts = (run,) if not run.more else run.parts
            counts = self._counts(run.group, parts, run.share)
        else:
            counts = defaultdict(int)
            for name in run.gpu_models:
                model = self._model(run.group, name)
                if model is not None:
                    counts[model] += run.share
        self._run_memo[run.id] = counts
        return counts

    def _model_quota(self, group: str, model: str) -> Quota:
        listed = self._listed.get(group)
        if listed is None:
            listed = self._listed[group] = dict(self.quota(group).models)
        return listed[model]

    def _alike_name(self, part: Part | Running) -> str | None:
        """The model name of all of a part's GPUs when its node has only one, and the part
        only GPUs of that node's inventory (then they are counted at once); else None."""
        alike = self._alike.get(part.node_id)
        if alike is None or not alike[1].issuperset(part.gpu_indices):
            return None
        return alike[0]

    def _counts(
        self, group: str, parts: Sequence[Part | Running], share: float = 1.0
    ) -> dict[str, float]:
        """The GPUs of ``parts`` (``share`` of each) per listed model of the group."""
        if not self.per_model or not self.quota(group).models:
            return {}
        if len(parts) == 1:  # (the common case, one node of one model: this runs per call)
            name = self._alike_name(parts[0])
            if name is not None:
                model = self._model(group, name)
                gpus = len(parts[0].gpu_indices)
                return {model: share * gpus} if model is not None and gpus else {}
        counts: dict[str, float] = defaultdict(int)
        for part in parts:
            name = self._alike_name(part)
            if name is not None:
                model = self._model(group, name)
                if model is not None and part.gpu_indices:
                    counts[model] += share * len(part.gpu_indices)
                continue
            names = self._names.get(part.node_id, {})
            for index in part.gpu_indices:
                model = self._model(group, names.get(index, ""))
                if model is not None:
                    counts[model] += share
        return counts

    def take(self, group: str, parts: Sequence[Part], share: float = 1.0) -> bool:
        """Charge the group the GPUs of ``parts`` (``share`` of each), as :meth:`add` does;
        whether it then holds more than its guarantee, or more than a listed model's
        guarantee of that model's GPUs (the call borrows)."""
        taken = share * sum(len(p.gpu_indices) for p in parts)
        used = self.used[group] = self.used[group] + taken
        borrowed = bool(taken) and used > self.quota(group).guaranteed + EPSILON
        for model, n in self._counts(group, parts, share).items():
            held = self.model_used[(group, model)] = self.model_used[(group, model)] + n
            borrowed = borrowed or held > self._model_quota(group, model).guaranteed + EPSILON
        return borrowed

    def restrict(self, call: Pending, nominal: bool = False) -> Pending | None:
        """The call, kept to the GPU models its group may still take all of its GPUs of: the
        models within their ceilings (with ``nominal``: within their guarantees) and the
        unlisted ones. The call itself when nothing is kept from it; None when every model it
        may use is."""
        models = self.quota(call.group).models
        if not call.gpus or not models:
            return call
        group, amount = call.group, call.amount
        # (what is kept from the call depends only on which listed models lack room for it;
        # _model_left inlined: this runs per call)
        used = self.model_used
        barred: tuple[str, ...] = ()
        for model, quota in models:
            left = (quota.guaranteed if nominal else quota.ceiling) - used[(group, model)]
            if left + EPSILON < amount:
                barred += (model,)
        if self._plain and not barred:
            return call  # (room on every listed model: the common case, asked per call)
        key = (group, barred, amount, call.gpu_model, nominal)
        if key not in self._kept:
            self._kept[key] = self._kept_models(call, nominal)
        kept = self._kept[key]
        if kept == _ALL:
            return call
        return None if kept is None else dataclasses.replace(call, gpu_model=kept)

    def _kept_models(self, call: Pending, nominal: bool) -> str | None:
        """:meth:`restrict`'s ``gpu_model`` for the call: ``_ALL`` (nothing kept from it),
        the models it may use, or None (none)."""
        allowed: list[str] = []
        barred: list[str] = []
        for name in self.names:
            if not name or not placement.model_ok(name, call.gpu_model):
                continue
            model = self._model(call.group, name)
            # (a name with "|" in it would read as alternatives: never one to keep a call to)
            ok = "|" not in name and (
                model is None
                or self._model_left(call.group, model, nominal) >= call.amount
            )
            (allowed if ok else barred).append(name)
        if not barred:
            return _ALL
        # (a name inside a barred one would let the call onto the barred model too)
        allowed = [a for a in allowed if not any(a in b for b in barred)]
        return "|".join(allowed) if allowed else None

    def _model_left(self, group: str, model: str, nominal: bool) -> float:
        quota = self._model_quota(group, model)
        left = (quota.guaranteed if nominal else quota.ceiling) - self.model_used[(group, model)]
        return left + EPSILON

    def limit(self, call: Pending, kept: Pending) -> float:
        """The most GPUs ``kept`` (``call`` as :meth:`restrict` left it) may take: the group's
        room, and, for a gang on whole nodes that may take more than it asks, the room left on
        each listed model it may use."""
        room = self.room(call.group)
        if not self.quota(call.group).models:
            return room
        group = call.group
        used = self.model_used
        for model, quota in self._listed_for(group, kept.gpu_model):  # (_model_left inlined)
            room = min(room, quota.ceiling - used[(group, model)] + EPSILON)
        return room

    def _listed_for(self, group: str, gpu_model: str | None) -> tuple[tuple[str, Quota], ...]:
        """The group's listed models (with their quotas) that a call of ``gpu_model`` may
        use: fixed for the round."""
        key = (group, gpu_model)
        listed = self._limits.get(key)
        if listed is None:
            found = {self._model(group, name) for name in self.names
                     if placement.model_ok(name, gpu_model)}  # fmt: skip
            listed = self._limits[key] = tuple(
                (m, self._model_quota(group, m)) for m in sorted(m for m in found if m is not None)
            )
        return listed

    def model_lent(self, call: Pending, extra: float = 0.0) -> float:
        """How much the call's group borrows for its weight of the listed models the call may
        use (:meth:`lent` for one model: its GPUs of it past the model's guarantee, with
        ``extra`` more, over that guarantee plus one), the most of them; -inf if it may use
        none."""
        group, used = call.group, self.model_used
        return max(
            ((used[(group, model)] + extra - quota.guaranteed) / (quota.guaranteed + 1)
             for model, quota in self._listed_for(group, call.gpu_model)),
            default=-math.inf,
        )  # fmt: skip

    def reclaimable(
        self, run: Running, released: Mapping[str | tuple[str, str], float], keep: bool = False
    ) -> bool:
        """Whether reclaim may take ``run`` back, ``released`` being taken already. A run on
        GPUs of listed models: if its group still holds more than its guarantee of each of
        them (its guarantee in all aside: those GPUs are borrowed); any other run: if its
        group still holds more than its guarantee. ``keep``: only if the group still holds
        at least its guarantee in all and of each model once ``run`` is taken too."""
        group = run.group
        if keep:
            left = self.used[group] - released.get(group, 0) - run.amount
            if left < self.quota(group).guaranteed - EPSILON:
                return False
        counts = self._run_counts(run)
        if counts:
            return all(
                self.model_used[(group, model)] - released.get((group, model), 0)
                - (n if keep else 0)
                > self._model_quota(group, model).guaranteed + (-EPSILON if keep else EPSILON)
                for model, n in counts.items()
            )
        if keep:
            return True
        return self.used[group] - released.get(group, 0) > self.quota(group).guaranteed + EPSILON

    def count_release(self, released: Released, run: Running) -> None:
        """Add ``run``'s GPUs to what reclaim has taken back (see :meth:`reclaimable`)."""
        released[run.group] = released.get(run.group, 0) + run.amount
        for model, n in self._run_counts(run).items():
            released[(run.group, model)] = released.get((run.group, model), 0) + n

    def ceiling_reason(self, call: Pending, taking: int | None = None) -> str:
        """Why the call would pass its group's ceiling; ``taking``: the GPUs its whole nodes
        would take, when more than it asks for."""
        quota = self.quota(call.group)
        nodes = "" if taking is None else f"; the whole nodes free for it would take {taking}"
        return (
            f"group {call.group or '(none)'} is at its quota ceiling: it holds "
            f"{self.used[call.group]:g} of at most {quota.ceiling:g} GPUs "
            f"(guarantee {quota.guaranteed} + borrowing limit {quota.borrow_limit}){nodes}"
        )

    def model_ceiling_reason(self, call: Pending) -> str:
        """Why no model the call may use is left to it: each listed one is at its ceiling."""
        quota = self.quota(call.group)
        held = []
        for model, limit in quota.models:
            if any(self._model(call.group, n) == model for n in self.names
                   if placement.model_ok(n, call.gpu_model)):  # fmt: skip
                used = self.model_used[(call.group, model)]
                held.append(f"{used:g} of at most {limit.ceiling:g} {model}")
        return (
            f"group {call.group or '(none)'} is at its quota for the GPU models the call may "
            f"use: it holds {', '.join(held) or 'them all'}; it needs {call.amount:g} more"
        )
