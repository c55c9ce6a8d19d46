"""All of Bulletin's SQL, one typed function per statement, one module per table family.

Nothing else in the project writes SQL (``tests/unit/test_sql_in_db_package.py``), and each
statement is a triple-quoted string that pastes into ``psql`` as it is. Row locks
(``FOR UPDATE SKIP LOCKED``) claim work; LISTEN/NOTIFY (channel ``bulletin_events``) only
wakes waiters, who re-read the tables. Notification payloads: ``q`` (the queue or capacity
changed: the scheduler should plan), ``n:<node_id>`` (a node has new work or revocations),
``i:<invocation_id>`` (news of an invocation: logs, a state change). Every fenced write from
a nodelet checks ``(id, node_id, epoch)`` in the statement that applies it, so a stale
attempt changes nothing. Times come from the database clock only.

Callers write ``from gateway import db`` and ``db.insert_calls(...)``; the modules, lower ones
first (a module imports only those above it):

- ``_common``: the connection type, notifications, Bulletin's own log lines, stored lists
- ``schema``: migrations (``migrations/``, building ``schema.sql``), creating a database
- ``roles``: the gateway's own role and database, set up by a superuser
- ``accounts``: users, node records, tokens
- ``blobs``: chunked blobs and what a user stores
- ``idempotency``: Idempotency-Keys
- ``sessions``: caller sessions (cancelling the calls of a caller gone)
- ``invocations``: submitting, reading and cancelling calls
- ``quotas``: groups, quotas, usage accounting and fair-share usage
- ``nodes``: the node protocol (register, deliver, heartbeat, leave, drain, take back),
  removal
- ``attempts``: a nodelet's fenced writes of one attempt (start, logs, release, complete)
- ``scheduling``: the leader lock, the planning snapshot, placements, lease expiry
- ``slots``: completing items of maps and giving their node the next ones in the same slot
- ``functions``: registered functions and their JSON invocations
- ``retention``: purging what ended long ago
"""

from gateway.db._common import (
    CHANNEL,
    NOTE_PREFIX,
    PREEMPTING_PROTOCOL,
    SAFE_PROTOCOL,
    TOKENS_CHANGED,
    Conn,
)
from gateway.db.accounts import (
    Principal,
    TokenRow,
    UserRow,
    add_token,
    create_node,
    create_user,
    find_user,
    find_users,
    lookup_token,
    revoke_node_tokens,
    revoke_token,
    set_user_admin,
    tokens,
)
from gateway.db.attempts import (
    Owner,
    PayloadSource,
    append_logs,
    append_logs_in,
    attempt_owner,
    complete,
    payload_source,
    release,
    start,
)
from gateway.db.blobs import (
    append_blob_chunk,
    blob_chunk,
    blob_size,
    blob_usage,
    create_blob,
    delete_blob,
    finish_blob,
    owned_blobs,
    storage_usage,
)
from gateway.db.functions import (
    FunctionGone,
    FunctionRow,
    delete_function,
    find_function,
    invoke,
    list_functions,
    register_function,
)
from gateway.db.idempotency import HttpKey, KeyHeld, KeyTaken, answer_key, find_key
from gateway.db.invocations import (
    NoRoom,
    NotOwned,
    Submitted,
    cancel,
    changed,
    changed_fetched,
    get_invocations,
    insert_calls,
    list_invocations,
    live_payload_files,
    logs_after,
    make_durable,
    mark_fetched,
    to_invocation,
)
from gateway.db.nodes import (
    Drain,
    NodeRow,
    NodeStatus,
    StopOrders,
    heartbeat,
    held_attempts,
    leave,
    lock_node,
    node_statuses,
    poll,
    register_node,
    registered_nodes,
    remove_node,
    set_draining,
)
from gateway.db.quotas import (
    GroupRow,
    ModelQuotaRow,
    UsageRow,
    accrue_usage,
    group_exists,
    groups,
    lock_group,
    set_group,
    set_user_group,
    usage,
)
from gateway.db.retention import Purged, purge
from gateway.db.roles import adopt_schema, is_superuser, own_database, set_login_role
from gateway.db.scheduling import (
    LEADER_LOCK,
    Handed,
    Holdings,
    assign,
    expire_leases,
    explain_waits,
    extend_leases,
    holdings,
    leases,
    live_nodes,
    notify_nodes,
    preempt,
    queued,
    silence,
    try_lead,
    wake_scheduler,
)
from gateway.db.schema import applied_migrations, ensure_database, migrate, migration_files
from gateway.db.sessions import (
    ABANDONED,
    CALLER_LATE,
    abandon_callers,
    keep_alive,
)
from gateway.db.slots import Completed, complete_in, lock_node_for_work, top_up, wake_if_freed

__all__ = [
    "ABANDONED",
    "CALLER_LATE",
    "CHANNEL",
    "LEADER_LOCK",
    "NOTE_PREFIX",
    "PREEMPTING_PROTOCOL",
    "SAFE_PROTOCOL",
    "TOKENS_CHANGED",
    "Completed",
    "Conn",
    "Drain",
    "FunctionGone",
    "FunctionRow",
    "GroupRow",
    "Handed",
    "Holdings",
    "HttpKey",
    "KeyHeld",
    "KeyTaken",
    "ModelQuotaRow",
    "NoRoom",
    "NodeRow",
    "NodeStatus",
    "NotOwned",
    "Owner",
    "PayloadSource",
    "Principal",
    "Purged",
    "StopOrders",
    "Submitted",
    "TokenRow",
    "UsageRow",
    "UserRow",
    "abandon_callers",
    "accrue_usage",
    "add_token",
    "adopt_schema",
    "answer_key",
    "append_blob_chunk",
    "append_logs",
    "append_logs_in",
    "applied_migrations",
    "assign",
    "attempt_owner",
    "blob_chunk",
    "blob_size",
    "blob_usage",
    "cancel",
    "changed",
    "changed_fetched",
    "complete",
    "complete_in",
    "create_blob",
    "create_node",
    "create_user",
    "delete_blob",
    "delete_function",
    "ensure_database",
    "expire_leases",
    "explain_waits",
    "extend_leases",
    "find_function",
    "find_key",
    "find_user",
    "find_users",
    "finish_blob",
    "get_invocations",
    "group_exists",
    "groups",
    "heartbeat",
    "held_attempts",
    "holdings",
    "insert_calls",
    "invoke",
    "is_superuser",
    "keep_alive",
    "leases",
    "leave",
    "list_functions",
    "list_invocations",
    "live_nodes",
    "live_payload_files",
    "lock_group",
    "lock_node",
    "lock_node_for_work",
    "logs_after",
    "lookup_token",
    "make_durable",
    "mark_fetched",
    "migrate",
    "migration_files",
    "node_statuses",
    "notify_nodes",
    "own_database",
    "owned_blobs",
    "payload_source",
    "poll",
    "preempt",
    "purge",
    "queued",
    "register_function",
    "register_node",
    "registered_nodes",
    "release",
    "remove_node",
    "revoke_node_tokens",
    "revoke_token",
    "set_draining",
    "set_group",
    "set_login_role",
    "set_user_admin",
    "set_user_group",
    "silence",
    "start",
    "storage_usage",
    "to_invocation",
    "tokens",
    "top_up",
    "try_lead",
    "usage",
    "wake_if_freed",
    "wake_scheduler",
]
