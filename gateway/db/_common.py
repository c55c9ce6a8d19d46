"""What the table families share: the connection type, the notification channel, Bulletin's
own lines in a call's log, and lists stored as JSON that another version may have written."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeAlias, TypeVar

import asyncpg
import msgspec

from bulletin_core import wire

CHANNEL = "bulletin_events"
#: The first nodelet protocol that acts on preemption orders.
PREEMPTING_PROTOCOL = 2
#: Nodelets older than this are never given work, even if they registered with an older
#: gateway and still poll (wire.MIN_PROTOCOL_VERSION): before protocol 4 they ran a mapped
#: node's calls as root, before 5 they had no incarnation (their node requests are refused).
SAFE_PROTOCOL = wire.MIN_PROTOCOL_VERSION
#: Bulletin's own lines in a call's log (stderr) start with this.
NOTE_PREFIX = "[bulletin] "

Conn: TypeAlias = asyncpg.Connection | asyncpg.Pool
_S = TypeVar("_S", bound=msgspec.Struct)


def _f(value: Any) -> float | None:
    return None if value is None else float(value)


# ------------------------------------------------------------------------------ notifications

_NOTIFY = """
SELECT pg_notify($1, $2)
"""

_NOTIFY_MANY = """
SELECT pg_notify($1, p)
FROM unnest($2::text[]) WITH ORDINALITY AS n(p, o)
ORDER BY o
"""


#: The notification that tokens, users or nodes changed in a way that changes what a token
#: grants (a revocation, a node removed or started again, a user's group or admin flag):
#: every gateway drops the lookups it keeps (``gateway/auth.py``).
TOKENS_CHANGED = "t"


async def _notify(conn: Conn, *payloads: str) -> None:
    """Send the notifications (in order) in one round trip; they go out when the
    transaction commits."""
    if len(payloads) == 1:
        await conn.execute(_NOTIFY, CHANNEL, payloads[0])
    elif payloads:
        await conn.execute(_NOTIFY_MANY, CHANNEL, list(payloads))


# ------------------------------------------------------------------ Bulletin's own log lines

_NOTE = """
WITH c AS (
  UPDATE invocations i SET log_count = i.log_count + 1
  FROM unnest($1::uuid[], $2::text[]) AS n(id, text)
  WHERE i.id = n.id
  RETURNING i.id, i.log_count, n.text
)
INSERT INTO invocation_logs (invocation_id, n, stream, data)
SELECT id, log_count, $3, convert_to($4 || text || chr(10), 'UTF8') FROM c
"""


async def _note(conn: asyncpg.Connection, notes: Sequence[tuple[str, str]]) -> None:
    """Append a line of Bulletin's own to each call's log (``(invocation_id, text)``), after
    whatever its attempts wrote. The caller holds the calls' rows locked (updated in its
    transaction), as log appends do."""
    await conn.execute(
        _NOTE,
        [uuid.UUID(i) for i, _ in notes],
        [text for _, text in notes],
        int(wire.Stream.STDERR),
        NOTE_PREFIX,
    )


def _preempted_note(reason: str | None) -> str:
    why = f" ({reason})" if reason else ""
    return f"preempted{why}: stopped and queued again; this run does not count as an attempt"


# ------------------------------------------------------------------------ stored JSON lists


class _Stored(Generic[_S]):
    """Reads a list of ``kind`` that this gateway or another stored as JSON, ignoring the
    fields this version does not know: the wire types refuse unknown fields in requests,
    but a newer replica or nodelet may have stored more (a rolling upgrade), and one such
    row must not stop scheduling. Every planning round reads every live node's lists, which
    seldom change: what was read is kept by its text (the items are frozen; each read gets
    a list of its own), at most ``KEEP`` texts."""

    KEEP = 4096
    #: Longer texts are decoded every time (kept, a few would be most of the memory).
    KEEP_CHARS = 16384

    def __init__(self, kind: type[_S]) -> None:
        self._kind = kind
        self._fields = frozenset(f.encode_name for f in msgspec.structs.fields(kind))
        self._strict = msgspec.json.Decoder(list[kind])  # type: ignore[valid-type]
        self._rows = msgspec.json.Decoder(list[dict[str, Any]])
        self._read: dict[str, tuple[_S, ...]] = {}

    def decode(self, text: str) -> list[_S]:
        return list(self.kept(text))

    def kept(self, text: str) -> tuple[_S, ...]:
        """What :meth:`decode` reads, as the one tuple kept for ``text`` (the same object
        while it is kept, so that its readers may keep what they make of it by identity)."""
        found = self._read.get(text)
        if found is None:
            found = tuple(self._decode(text))
            if len(text) <= self.KEEP_CHARS:
                if len(self._read) >= self.KEEP:
                    self._read.clear()  # a bound whatever happens; the live ones come back
                self._read[text] = found
        return found

    def _decode(self, text: str) -> list[_S]:
        try:  # what this version stored
            return self._strict.decode(text)
        except msgspec.ValidationError:
            return [
                msgspec.convert({k: v for k, v in row.items() if k in self._fields}, self._kind)
                for row in self._rows.decode(text)
            ]


_GPU_LIST = _Stored(wire.GpuInfo)
_WARM_LIST = _Stored(wire.WarmWorker)


@dataclass(frozen=True, slots=True)
class NodeRow:
    """A registered node as the scheduler's reads return it."""

    id: int
    name: str
    gpus: tuple[wire.GpuInfo, ...]
    cpu_slots: int
    warm: tuple[wire.WarmWorker, ...] = ()


def _node_row(r: asyncpg.Record, id_column: str = "id") -> NodeRow:
    """A NodeRow from the columns ``id, name, gpus::text, cpu_slots, warm::text`` (the id
    in ``id_column``)."""
    return NodeRow(
        r[id_column],
        r["name"],
        _GPU_LIST.kept(r["gpus"]),
        r["cpu_slots"],
        _WARM_LIST.kept(r["warm"]),
    )
_HEALTH_LIST = _Stored(wire.GpuHealthReport)


def attained(until: str = "clock_timestamp()") -> str:
    """SQL: the GPU-seconds of service the run a statement ends gave its call (``i``), from
    when it got its GPUs (``scheduled_at``, as the scheduler's ``start_time``) to ``until``,
    a share counted as its part of one GPU."""
    return f"""i.gpus * i.gpu_share * greatest(0, extract(epoch FROM
    {until} - coalesce(i.scheduled_at, {until})))"""


ATTAINED = attained()
