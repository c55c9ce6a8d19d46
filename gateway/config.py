"""Gateway settings, read once at start. Every timeout is configurable (design invariant 7)."""

from __future__ import annotations

import math
import os

import msgspec

from scheduler import POLICIES, Policy, policies


class GatewayConfig(msgspec.Struct, frozen=True, kw_only=True):
    #: PostgreSQL to use, e.g. postgresql://bulletin:secret@db-host/bulletin
    database_url: str
    #: Address to listen on; 127.0.0.1 unless the cluster's nodes are elsewhere.
    host: str = "127.0.0.1"
    #: Port to listen on.
    port: int = 8420
    #: How long a lease lasts without renewal (database clock).
    lease_s: float = 30.0
    #: How often nodelets heartbeat; they are told this at registration.
    heartbeat_s: float = 5.0
    #: A node that has not heartbeaten for this long gets no new work.
    node_timeout_s: float = 30.0
    #: Longest hold of a node poll and of a client watch.
    long_poll_s: float = 20.0
    #: Waiters re-read the tables at least this often, in case a notification was lost.
    recheck_s: float = 1.0
    #: The scheduler plans at least this often even without a notification.
    schedule_interval_s: float = 1.0
    #: When at least this share of the nodes that hold calls stop renewing their leases at
    #: once (and at least silent_min_nodes of them), the fault is taken to be the network's
    #: or the control plane's, not every node's: no lease is expired for silent_hold_s.
    silent_fraction: float = 0.5
    #: The fewest silent nodes that count as "most nodes went silent at once".
    silent_min_nodes: int = 2
    #: How long such a silence holds expiry back before it resumes at the capped rate.
    silent_hold_s: float = 300.0
    #: The most expired leases taken back in one scheduling round (requeued, or failed
    #: node_lost): a burst of expiries is spread over rounds instead of requeued at once.
    max_expiries_per_round: int = 20
    #: A call an sdk waits for (a blocking call, a map item) whose caller has not kept it
    #: alive for this long (the process ended, or lost the gateway) is cancelled, freeing its
    #: GPU; one whose caller is half that late is not started meanwhile. Detached calls
    #: (spawn, plain HTTP) are never. 0: never cancel a call for want of its caller.
    caller_timeout_s: float = 60.0
    #: Payloads and results up to this size travel inline; larger ones as streamed blobs.
    inline_limit: int = 1 << 20
    #: Largest JSON request body accepted.
    max_json_body: int = 64 << 20
    #: Most queued calls one planning round looks at.
    plan_batch: int = 5000
    #: Most PostgreSQL connections one gateway opens per pool.
    pool_size: int = 10
    #: The cluster's shared directory (NAS), mounted at this same path on every node and
    #: writable by every user; big payloads and results then go through it as files.
    #: Empty: the cluster has none, and they go through the gateway as blobs.
    shared_dir: str = ""
    #: Largest payload or result blob accepted, in bytes (a pickled call or returned state).
    max_state_bytes: int = 16 << 30
    #: Payload and result files left in the shared directory longer than this (seconds) are
    #: deleted.
    shared_ttl_s: float = 86400.0
    #: How the scheduler shares GPUs: "fair" (group quotas with borrowing, fair share by
    #: decayed usage, preemption to give guarantees back) or "fifo" (first come, first served,
    #: with backfill). See docs/scheduling.md.
    scheduler_policy: str = "fair"
    #: Fair share: a GPU-second used this many seconds ago counts half. One day (HTCondor's
    #: default) did better than SLURM's 7 days on the Philly trace (docs/benchmarks.md).
    fair_share_half_life_s: float = 86400.0
    #: Seconds a preempted call has between SIGTERM (its notice) and SIGKILL; it is then
    #: queued again.
    preemption_grace_s: float = 30.0
    #: fair: a borrower (a call above its group's guarantee) that has waited this many
    #: seconds gets a reservation, so a big call cannot wait for ever behind smaller ones; 0:
    #: never (the default: holding room idle costs the others, see docs/scheduling.md).
    fair_starve_after_s: float = 0.0
    #: Requests a second each user may make, on average, with a user token (a token bucket
    #: per user, in this replica's memory: N replicas allow up to N times as much); over it
    #: the gateway answers 429 with Retry-After. 0: no limit.
    rate_limit_per_s: float = 100.0
    #: Requests a user may make at once above rate_limit_per_s (the bucket's size).
    rate_limit_burst: int = 400
    #: Requests a second, on average, that may fail authentication (a missing, malformed,
    #: unknown, expired or revoked token) from one client address (the TCP peer; an IPv6
    #: /64): a token bucket per address, in this replica's memory. Past it, the address's
    #: requests get 429 with Retry-After without a database lookup, except those with a
    #: token that worked here recently. 0: no limit.
    auth_failure_rate_per_s: float = 1.0
    #: Failed authentications one address may make at once above auth_failure_rate_per_s.
    auth_failure_burst: int = 30
    #: Seconds a token the database did not know is remembered as unknown, so that sending
    #: it again costs no lookup. 0: not remembered.
    auth_negative_cache_s: float = 5.0
    #: Seconds a request refused for its address's failed authentications is held before
    #: its 429, so that a flood's connections wait idle instead of keeping the gateway busy
    #: (at most 1000 requests are held at once; more are answered at once). 0: not held.
    auth_failure_delay_s: float = 1.0
    #: Seconds a connection has to send a complete request head (line and headers), from
    #: its opening or the first byte of its next request; then it is closed. Bodies,
    #: long-polls and streamed answers are not bounded by it.
    header_timeout_s: float = 10.0
    #: Seconds a kept-alive connection may stay idle between requests before it is closed.
    idle_timeout_s: float = 5.0
    #: Host names (comma-separated; `*.example.org` for its subdomains) the gateway answers
    #: to; a request with another Host header gets 400. Empty: any (GET /healthz always).
    allowed_hosts: str = ""
    #: Most MiB of blobs one user may own: uploads (PUT /v1/blobs) that would pass it get
    #: 507; results stored by nodes count but are never refused. 0: no limit.
    user_storage_mb: int = 65536
    #: The longest a `?wait=` on invoke may hold the request, in seconds.
    max_wait_s: float = 60.0
    #: Terminal invocations, their logs, results, blobs and shared-directory files are purged
    #: this many seconds after they ended (default 7 days).
    retention_s: float = 604800.0
    #: How often the purge of what is past retention_s runs, in seconds.
    purge_interval_s: float = 60.0

    def __post_init__(self) -> None:
        for name in (
            "lease_s",
            "heartbeat_s",
            "node_timeout_s",
            "long_poll_s",
            "recheck_s",
            "schedule_interval_s",
            "silent_hold_s",
            "shared_ttl_s",
            "fair_share_half_life_s",
            "max_wait_s",
            "retention_s",
            "purge_interval_s",
            "header_timeout_s",
            "idle_timeout_s",
        ):
            if not getattr(self, name) > 0:  # NaN too
                raise ValueError(f"gateway setting {name} must be a positive number of seconds")
        if not 0 < self.silent_fraction <= 1:
            raise ValueError("silent_fraction must be above 0 and at most 1 (a share of nodes)")
        if self.silent_min_nodes < 1:
            raise ValueError("silent_min_nodes must be at least 1 node")
        if not 0 <= self.caller_timeout_s < math.inf:
            raise ValueError("caller_timeout_s must be 0 (never) or more seconds")
        if self.max_expiries_per_round < 1:
            raise ValueError("max_expiries_per_round must be at least 1")
        if self.preemption_grace_s < 0:
            raise ValueError("preemption_grace_s must be 0 or more seconds")
        if self.fair_starve_after_s < 0:
            raise ValueError("fair_starve_after_s must be 0 (never) or more seconds")
        if not 0 <= self.rate_limit_per_s < math.inf:
            raise ValueError("rate_limit_per_s must be 0 (no limit) or more requests a second")
        if self.rate_limit_burst < 1:
            raise ValueError("rate_limit_burst must be at least 1 request")
        if not 0 <= self.auth_failure_rate_per_s < math.inf:
            raise ValueError(
                "auth_failure_rate_per_s must be 0 (no limit) or more failures a second"
            )
        if self.auth_failure_burst < 1:
            raise ValueError("auth_failure_burst must be at least 1 failure")
        if not 0 <= self.auth_negative_cache_s < math.inf:
            raise ValueError("auth_negative_cache_s must be 0 (off) or more seconds")
        if not 0 <= self.auth_failure_delay_s <= 60:
            raise ValueError("auth_failure_delay_s must be 0 (none) to 60 seconds")
        if self.user_storage_mb < 0:
            raise ValueError("user_storage_mb must be 0 (no limit) or more MiB")
        if any(not host for host in self.hosts):
            raise ValueError(
                f"allowed_hosts {self.allowed_hosts!r} has an empty name: list host names "
                "separated by commas, or leave it empty to allow any"
            )
        if self.scheduler_policy not in POLICIES:
            raise ValueError(
                f"scheduler_policy {self.scheduler_policy!r} is not one of {sorted(POLICIES)}"
            )
        if self.heartbeat_s > self.lease_s / 2:
            raise ValueError(
                "heartbeat_s must be at most half of lease_s: a node must be able to miss a "
                "heartbeat without losing its leases (and without looking silent)"
            )
        if self.node_timeout_s > self.lease_s:
            raise ValueError(
                "node_timeout_s must be at most lease_s: a node whose leases lapsed must not "
                "be given new work before it heartbeats again"
            )
        if self.inline_limit < 1024:
            raise ValueError("inline_limit must be at least 1024 bytes")
        if self.max_state_bytes < self.inline_limit:
            raise ValueError("max_state_bytes must be at least inline_limit")
        if self.shared_dir and not os.path.isabs(self.shared_dir):
            raise ValueError(
                f"shared_dir must be an absolute path (the same on every node), "
                f"not {self.shared_dir!r}"
            )

    def policy(self) -> Policy:
        """A fresh instance of the configured scheduling policy, with its settings."""
        if self.scheduler_policy == "fair" and self.fair_starve_after_s > 0:
            return policies.get("fair", starve_after_s=self.fair_starve_after_s)
        return policies.get(self.scheduler_policy)

    @property
    def caller_keepalive_s(self) -> float | None:
        """How often a caller session keeps its calls alive; None: it need not."""
        return self.caller_timeout_s / 6 if self.caller_timeout_s else None

    @property
    def caller_late_s(self) -> float:
        """A caller session this late gets its queued calls held back (not started)."""
        return self.caller_timeout_s / 2 if self.caller_timeout_s else 1e9

    @property
    def hosts(self) -> list[str]:
        """allowed_hosts as a list, lower case; empty: any host."""
        if not self.allowed_hosts.strip():
            return []
        return [host.strip().lower() for host in self.allowed_hosts.split(",")]

    @property
    def user_storage_bytes(self) -> int | None:
        """user_storage_mb in bytes; None: no limit."""
        return self.user_storage_mb << 20 or None

    @property
    def sweep_interval_s(self) -> float:
        """How often old files are swept from the shared directory: a quarter of their time
        to live, at most hourly."""
        return min(3600.0, self.shared_ttl_s / 4)
