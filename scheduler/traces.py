"""Job traces and quota files for the replay simulator.

Trace formats, told apart by the CSV header:

- plain: ``submit_time,duration,num_gpus`` (seconds, seconds, GPUs) plus optional ``user``,
  ``group``, ``gpu_type`` (a GPU model constraint), ``job_id`` and ``status`` columns;
  ``status`` is how the job ended: ``completed`` (the default; also ``pass``, ``passed``,
  ``succeeded``), ``failed`` (``fail``) or ``cancelled`` (``canceled``, ``killed``), its
  ``duration`` being how long it ran before that; ``num_gpus`` may be a fraction below 1
  (``0.25``: a quarter of one GPU, which it shares with other such jobs);
- Philly (``philly_jobs_pollux_osdi21.csv``): ``timestamp`` (``YYYY-MM-DD HH:MM:SS``),
  ``duration``, ``num_gpus``, ``gpu_time``, ``cluster``; the virtual cluster is the group and
  submit times count from the earliest timestamp;
- Tiresias (``tiresias_60_job.csv``): ``job_id,num_gpu,submit_time,iterations,model_name,
  duration,interval``; one group.

Quota files are JSON, one object per group; ``borrow_limit`` null or absent means the group may
borrow every idle GPU::

    {"vc1": {"guaranteed": 64, "borrow_limit": 128}, "vc2": {"guaranteed": 32}}

A group may also have quotas per GPU model (:attr:`~scheduler.model.Quota.models`), in the
same form::

    {"vc1": {"guaranteed": 64, "models": {"V100M32": {"guaranteed": 16, "borrow_limit": 0}}}}

Without a quota file, :func:`derive_quotas` guarantees each group GPUs in proportion to its
share of the trace's GPU-time (largest remainders, so they add up to the cluster) and no
borrowing limit.

Nodes files (``--nodes-file``) describe a cluster of mixed nodes, one CSV row per kind::

    gpus,model,count
    8,V100M32,40
    4,V100M16,16
    8,A100,2

``gpus`` per node (1 or more), ``model`` (optional: empty means the model does not matter),
``count`` nodes of that kind (optional, default 1). Nodes are numbered in file order.

Node failures files (``--node-failures``), one row per outage, times in trace seconds::

    node,down,up
    3,86400,90000
    7,100000,

``node`` is the node's number (0 for the first), ``up`` empty when it never comes back.
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TypeVar

from scheduler.model import Quota, SchedulerError


class TraceError(SchedulerError):
    """A trace or quota file that cannot be read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Job:
    id: str
    submit: float
    duration: float
    #: Whole GPUs, or a fraction below 1: that share of one GPU.
    gpus: float
    user: str = ""
    group: str = ""
    gpu_type: str | None = None
    #: How it ended (``STATUSES``' values): it holds its GPUs for ``duration`` either way.
    status: str = "completed"


#: A trace's ``status`` values (lower-cased) and what they mean.
STATUSES = {
    "": "completed",
    "completed": "completed",
    "complete": "completed",
    "pass": "completed",
    "passed": "completed",
    "success": "completed",
    "succeeded": "completed",
    "failed": "failed",
    "fail": "failed",
    "cancelled": "cancelled",
    "canceled": "cancelled",
    "killed": "cancelled",
}


def _status(value: str | None) -> str:
    try:
        return STATUSES[(value or "").strip().lower()]
    except KeyError:
        raise ValueError(
            f"status {value!r} is not one of completed, failed, cancelled (or pass, killed)"
        ) from None


def read(path: str | Path) -> list[Job]:
    """The trace's jobs in submit order (file order among equal submit times)."""
    path = Path(path)
    try:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
            header = set(rows[0]) if rows else set()
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from exc
    if {"timestamp", "duration", "num_gpus", "cluster"} <= header:
        parse = _philly
    elif {"job_id", "num_gpu", "submit_time", "duration"} <= header:
        parse = _tiresias
    elif {"submit_time", "duration", "num_gpus"} <= header:
        parse = _plain
    else:
        raise TraceError(
            f"{path}: unknown trace format (header {sorted(header)}); a plain trace needs "
            "submit_time,duration,num_gpus"
        )
    try:
        jobs = parse(rows)
    except (KeyError, ValueError) as exc:
        raise TraceError(f"{path}: bad row: {exc}") from exc
    return sorted(jobs, key=lambda j: j.submit)


def _plain(rows: list[dict[str, str]]) -> list[Job]:
    return [
        Job(
            id=r.get("job_id") or str(i),
            submit=float(r["submit_time"]),
            duration=float(r["duration"]),
            gpus=_gpus(r["num_gpus"]),
            user=r.get("user") or "",
            group=r.get("group") or "",
            gpu_type=r.get("gpu_type") or None,
            status=_status(r.get("status")),
        )
        for i, r in enumerate(rows)
    ]


def _gpus(value: str) -> float:
    """``num_gpus``: whole GPUs, or a share of one below 1."""
    n = float(value)
    if n.is_integer():
        return int(n)
    if not 0 < n < 1:
        raise ValueError(
            f"num_gpus {value!r}: a job asks for whole GPUs or for part of one (below 1)"
        )
    return n


def _philly(rows: list[dict[str, str]]) -> list[Job]:
    stamps = [datetime.fromisoformat(r["timestamp"]).timestamp() for r in rows]
    first = min(stamps, default=0.0)
    return [
        Job(str(i), t - first, float(r["duration"]), int(r["num_gpus"]), group=r["cluster"])
        for i, (t, r) in enumerate(zip(stamps, rows, strict=True))
    ]


def _tiresias(rows: list[dict[str, str]]) -> list[Job]:
    return [
        Job(r["job_id"], float(r["submit_time"]), float(r["duration"]), int(r["num_gpu"]))
        for r in rows
    ]


def read_nodes(path: str | Path) -> list[tuple[int, str]]:
    """A nodes file's nodes, each ``(gpus, model)``, in file order."""

    def nodes(row: dict[str, str]) -> list[tuple[int, str]]:
        gpus, count = int(row["gpus"]), int(row.get("count") or 1)
        if gpus < 1 or count < 0:
            raise ValueError("gpus must be at least 1 and count at least 0")
        return [(gpus, (row.get("model") or "").strip())] * count

    path, out = _parse(path, "nodes file", nodes, "gpus,model,count (model and count optional), "
                       "e.g. 8,A100,4")  # fmt: skip
    if not out:
        raise TraceError(f"{path}: no nodes; expected rows such as 8,A100,4 under gpus,model,count")
    return out


def read_failures(path: str | Path, nodes: int) -> list[tuple[int, float, float | None]]:
    """A node failures file's outages, ``(node, down, up or None)``, for ``nodes`` nodes."""

    def outage(row: dict[str, str]) -> list[tuple[int, float, float | None]]:
        node, down = int(row["node"]), float(row["down"])
        up = float(row["up"]) if (row.get("up") or "").strip() else None
        if not 0 <= node < nodes:
            raise ValueError(f"node {node} is not one of the cluster's 0..{nodes - 1}")
        if down < 0 or (up is not None and up <= down):
            raise ValueError("down must be at least 0 and up after down")
        return [(node, down, up)]

    return _parse(path, "node failures file", outage, "node,down,up (up empty: never back), "
                  "e.g. 3,86400,90000")[1]  # fmt: skip


R = TypeVar("R")


def _parse(
    path: str | Path, what: str, parse: Callable[[dict[str, str]], list[R]], columns: str
) -> tuple[Path, list[R]]:
    """A CSV file's rows, each made into what ``parse`` returns; a TraceError naming the file
    and line (or ``what`` it is, when it cannot be read) and the ``columns`` expected."""
    path = Path(path)
    try:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise TraceError(f"cannot read {what} {path}: {exc}") from exc
    out: list[R] = []
    for line, row in enumerate(rows, 2):
        try:
            out += parse(row)
        except (KeyError, TypeError, ValueError) as exc:
            message = f"{path}, line {line}: {exc!s}; expected the columns {columns}"
            raise TraceError(message) from exc
    return path, out


def read_quotas(path: str | Path) -> dict[str, Quota]:
    """Quotas from a JSON file (see the module docstring)."""
    try:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError("expected one object of groups")
        return {str(group): _quota(q, per_model=True) for group, q in data.items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TraceError(
            f'cannot read quota file {path}: {exc}; expected {{"group": {{"guaranteed": 8, '
            '"borrow_limit": 64, "models": {"A100": {"guaranteed": 4, "borrow_limit": 0}}}}'
        ) from exc


def _quota(q: object, per_model: bool) -> Quota:
    if not isinstance(q, dict):
        raise TypeError(f"a quota is an object, not {q!r}")
    models = q.get("models") or {}
    if not isinstance(models, dict) or (models and not per_model):
        raise TypeError(f'"models" maps a GPU model to its quota; got {models!r}')
    pairs = tuple((str(m), _quota(mq, per_model=False)) for m, mq in sorted(models.items()))
    return Quota(int(q["guaranteed"]), _limit(q.get("borrow_limit")), pairs)


def _limit(value: object) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int | float | str):
        raise TypeError(f"borrow_limit must be a number or null, not {value!r}")
    return int(value)


def derive_quotas(jobs: Iterable[Job], capacity: int) -> dict[str, Quota]:
    """Guarantees proportional to each group's GPU-time in the trace, summing to
    ``capacity``; no borrowing limit."""
    work: dict[str, float] = defaultdict(float)
    for job in jobs:
        work[job.group] += job.gpus * job.duration
    total = sum(work.values())
    if total <= 0:
        return {}
    exact = {g: capacity * w / total for g, w in work.items()}
    share = {g: math.floor(x) for g, x in exact.items()}
    left = capacity - sum(share.values())
    for g in sorted(exact, key=lambda g: share[g] - exact[g])[:left]:
        share[g] += 1
    return {g: Quota(share[g]) for g in sorted(share)}


def weights(quotas: Mapping[str, Quota], groups: Iterable[str]) -> dict[str, float]:
    """Each group's weight for fairness metrics: its guarantee (plus one, so a group without a
    guarantee still counts a little); equal weights when there are no quotas."""
    return {g: quotas[g].guaranteed + 1.0 if g in quotas else 1.0 for g in groups}
