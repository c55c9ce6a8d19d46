"""Gateway settings, read once at start. Every timeout is configurable (design invariant 7)."""

from __future__ import annotations

import ipaddress
import os
from typing import Annotated

import msgspec

from bulletin_core.settings import AT_LEAST_0, AT_LEAST_1, POSITIVE, check, doc
from scheduler import POLICIES, Policy, policies
from scheduler.fair import DEFAULT_LAS_THRESHOLDS, DEFAULT_STARVE_AFTER_S


class GatewayConfig(msgspec.Struct, frozen=True, kw_only=True):
    database_url: Annotated[str, doc("""
        PostgreSQL to use, e.g. postgresql://bulletin:secret@db-host/bulletin
    """)]
    host: Annotated[str, doc("""
        Address to listen on; 127.0.0.1 unless the cluster's nodes are elsewhere.
    """)] = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535), doc("Port to listen on.")] = 8420
    lease_s: Annotated[float, POSITIVE, doc("""
        How long a lease lasts without renewal (database clock).
    """)] = 30.0
    heartbeat_s: Annotated[float, POSITIVE, doc("""
        How often nodelets heartbeat; they are told this at registration.
    """)] = 5.0
    node_timeout_s: Annotated[float, POSITIVE, doc("""
        A node that has not heartbeaten for this long gets no new work.
    """)] = 30.0
    long_poll_s: Annotated[float, POSITIVE, doc("""
        Longest hold of a node poll and of a client watch.
    """)] = 20.0
    recheck_s: Annotated[float, POSITIVE, doc("""
        Waiters re-read the tables at least this often, in case a notification was lost.
    """)] = 1.0
    schedule_interval_s: Annotated[float, POSITIVE, doc("""
        The scheduler plans at least this often even without a notification.
    """)] = 1.0
    silent_fraction: Annotated[float, msgspec.Meta(gt=0, le=1), doc("""
        When at least this share of the nodes that hold calls stop renewing their leases at once
        (and at least silent_min_nodes of them), the fault is taken to be the network's or the
        control plane's, not every node's: no lease is expired for silent_hold_s.
    """)] = 0.5
    silent_min_nodes: Annotated[int, AT_LEAST_1, doc("""
        The fewest silent nodes that count as "most nodes went silent at once".
    """)] = 2
    silent_hold_s: Annotated[float, POSITIVE, doc("""
        How long such a silence holds expiry back before it resumes at the capped rate.
    """)] = 300.0
    max_expiries_per_round: Annotated[int, AT_LEAST_1, doc("""
        The most expired leases taken back in one scheduling round (requeued, or failed
        node_lost): a burst of expiries is spread over rounds instead of requeued at once.
    """)] = 20
    caller_timeout_s: Annotated[float, AT_LEAST_0, doc("""
        A call an sdk waits for (a blocking call, a map item) whose caller has not kept it alive
        for this long (the process ended, or lost the gateway) is cancelled, freeing its GPU;
        one whose caller is half that late is not started meanwhile. Detached calls (spawn,
        plain HTTP) are never. 0: never cancel a call for want of its caller.
    """)] = 60.0
    inline_limit: Annotated[int, msgspec.Meta(ge=1024), doc("""
        Payloads and results up to this size travel inline; larger ones as streamed blobs.
    """)] = 1 << 20
    max_json_body: Annotated[int, AT_LEAST_1, doc("Largest JSON request body accepted.")] = 64 << 20
    plan_batch: Annotated[int, AT_LEAST_1, doc("""
        Most queued calls one planning round looks at.
    """)] = 5000
    token_cache_s: Annotated[float, AT_LEAST_0, doc("""
        How long a gateway keeps a valid token's lookup instead of reading it again; any change
        to tokens, users or nodes drops every gateway's at once (a notification), so this only
        bounds how stale one can be if that notification is lost. 0: read every request's.
    """)] = 1.0
    place_at_submit: Annotated[bool, doc("""
        Place a submitted call at once, in its submission's transaction, when nothing else is
        queued (the policy decides, on the same snapshot a round reads); off: every call waits
        for the scheduling leader's next round.
    """)] = True
    pool_size: Annotated[int, AT_LEAST_1, doc("""
        Most PostgreSQL connections one gateway opens per pool.
    """)] = 10
    shared_dir: Annotated[str, doc("""
        The cluster's shared directory (NAS), mounted at this same path on every node and
        writable by every user; big payloads and results then go through it as files. Empty: the
        cluster has none, and they go through the gateway as blobs.
    """)] = ""
    max_state_bytes: Annotated[int, AT_LEAST_1, doc("""
        Largest payload or result blob accepted, in bytes (a pickled call or returned state).
    """)] = 16 << 30
    shared_ttl_s: Annotated[float, POSITIVE, doc("""
        Payload and result files left in the shared directory longer than this (seconds) are
        deleted.
    """)] = 86400.0
    scheduler_policy: Annotated[str, doc("""
        How the scheduler shares GPUs: "fair" (group quotas with borrowing, fair share by
        decayed usage, preemption to give guarantees back) or "fifo" (first come, first served,
        with backfill). See docs/scheduling.md.
    """)] = "fair"
    fair_share_half_life_s: Annotated[float, POSITIVE, doc("""
        Fair share: a GPU-second used this many seconds ago counts half. One day (HTCondor's
        default) did better than SLURM's 7 days on the Philly trace (docs/benchmarks.md).
    """)] = 86400.0
    preemption_grace_s: Annotated[float, AT_LEAST_0, doc("""
        Seconds a preempted call has between SIGTERM (its notice) and SIGKILL; it is then queued
        again.
    """)] = 30.0
    fair_starve_after_s: Annotated[float, AT_LEAST_0, doc("""
        fair: each group's longest-waiting whole-node call (as many GPUs as the largest node
        that may take it, or more) that has waited this many seconds gets a reservation, and
        a whole-node call that waited this long is not reclaimed or swapped out once it
        starts, so it cannot wait for ever behind smaller calls that take every GPU that frees
        up; starved whole-node calls hold about the share of the cluster their GPUs make of
        all GPUs asked for or held by calls that waited this long, so they cannot starve the
        others either (docs/scheduling.md); 0: never.
    """)] = DEFAULT_STARVE_AFTER_S
    fair_least_attained: Annotated[bool, doc("""
        fair: inside each group's share and among borrowers, calls that received less GPU
        service go first (Tiresias's 2D-LAS: under 1 GPU-hour, under 10, the rest), and a
        waiting call may take the place of running calls of a higher class: its own group's,
        or other groups' borrowed ones while those hold more than their guarantee
        (docs/scheduling.md). Off: fair-share order only.
    """)] = True
    fair_min_run_s: Annotated[float, AT_LEAST_0, doc("""
        fair: a call runs at least this many seconds before least attained service may
        preempt it.
    """)] = 0.0
    fair_shelter_whole_nodes: Annotated[bool, doc("""
        fair: a call on whole nodes gives way to smaller calls under least attained service
        once at most; sent back to the queue, only calls as big as its nodes may take its place
        (docs/scheduling.md). Off: as often as smaller calls with less service ask.
    """)] = True
    fair_share_preemption: Annotated[bool, doc("""
        fair: fair share among borrowers (Kueue's fair sharing): a waiting call of a group
        that borrows less for its weight (GPUs past its guarantee, per guaranteed GPU plus
        one) may take the place of another group's borrowed calls while that group, once
        they are gone, still borrows fair_share_margin more for its weight
        (docs/scheduling.md). Off: a group that started big calls on an idle cluster keeps
        them while others wait.
    """)] = True
    fair_share_margin: Annotated[float, POSITIVE, doc("""
        fair: how much more a group must borrow for its weight than the asking call's group
        for fair share among borrowers to take its calls (8: on the Philly trace, fairness
        across groups 0.54 -> 0.96 with the same queueing; small margins churn).
    """)] = 8.0
    fair_shortest_first: Annotated[bool, doc("""
        fair: inside each user's calls of one class of service, those expected to end sooner
        (expected_duration, else timeout) go first; it orders a user's own calls only.
        Off: a user's calls of one class in queue order.
    """)] = True
    share_gpus_across_users: Annotated[bool, doc("""
        Calls asking for part of a GPU (gpus=0.25) may share one with other users' calls. Off:
        a GPU is shared only among one user's calls, since its sharers are not isolated from
        each other (no compute isolation, a soft memory cap: docs/scheduling.md).
    """)] = False
    rate_limit_per_s: Annotated[float, AT_LEAST_0, doc("""
        Requests a second each user may make, on average, with a user token (a token bucket per
        user, in this replica's memory: N replicas allow up to N times as much); over it the
        gateway answers 429 with Retry-After. 0: no limit. A sequential loop of blocking calls
        takes one request per call, some 200 a second on a small machine: the default stays
        above it.
    """)] = 500.0
    rate_limit_burst: Annotated[int, AT_LEAST_1, doc("""
        Requests a user may make at once above rate_limit_per_s (the bucket's size).
    """)] = 1000
    auth_failure_rate_per_s: Annotated[float, AT_LEAST_0, doc("""
        Requests a second, on average, that may fail authentication (a missing, malformed,
        unknown, expired or revoked token) from one client address (the TCP peer; an IPv6 /64):
        a token bucket per address, in this replica's memory. Past it, the address's requests
        get 429 with Retry-After without a database lookup, except those with a token that
        worked here recently. 0: no limit.
    """)] = 1.0
    auth_failure_burst: Annotated[int, AT_LEAST_1, doc("""
        Failed authentications one address may make at once above auth_failure_rate_per_s.
    """)] = 30
    auth_negative_cache_s: Annotated[float, AT_LEAST_0, doc("""
        Seconds a token the database did not know is remembered as unknown, so that sending it
        again costs no lookup. 0: not remembered.
    """)] = 5.0
    auth_failure_delay_s: Annotated[float, msgspec.Meta(ge=0, le=60), doc("""
        Seconds a request refused for its address's failed authentications is held before its
        429, so that a flood's connections wait idle instead of keeping the gateway busy (at
        most 1000 requests are held at once; more are answered at once). 0: not held.
    """)] = 1.0
    header_timeout_s: Annotated[float, POSITIVE, doc("""
        Seconds a connection has to send a complete request head (line and headers), from its
        opening or the first byte of its next request; then it is closed. Bodies, long-polls and
        streamed answers are not bounded by it.
    """)] = 10.0
    idle_timeout_s: Annotated[float, POSITIVE, doc("""
        Seconds a kept-alive connection may stay idle between requests before it is closed.
    """)] = 5.0
    allowed_hosts: Annotated[str, doc("""
        Host names (comma-separated; `*.example.org` for its subdomains) the gateway answers to;
        a request with another Host header gets 400. Empty: any (GET /healthz always).
    """)] = ""
    user_storage_mb: Annotated[int, AT_LEAST_0, doc("""
        Most MiB of blobs one user may own: uploads (PUT /v1/blobs) that would pass it get 507;
        results stored by nodes count but are never refused. 0: no limit.
    """)] = 65536
    max_wait_s: Annotated[float, POSITIVE, doc("""
        The longest a `?wait=` on invoke may hold the request, in seconds.
    """)] = 60.0
    retention_s: Annotated[float, POSITIVE, doc("""
        Terminal invocations, their logs, results, blobs and shared-directory files are purged
        this many seconds after they ended (default 7 days).
    """)] = 604800.0
    purge_interval_s: Annotated[float, POSITIVE, doc("""
        How often the purge of what is past retention_s runs, in seconds.
    """)] = 60.0

    tls_cert_file: Annotated[str, doc("""
        The gateway's TLS certificate (PEM, with its chain): it serves HTTPS. Give it with
        tls_key_file. Empty: plain HTTP, which the gateway serves only on a loopback address.
    """)] = ""
    tls_key_file: Annotated[str, doc("""
        The private key of tls_cert_file (PEM; keep it readable by the gateway's account only).
    """)] = ""

    def __post_init__(self) -> None:
        check(self, "gateway", _problems(self))

    def policy(self) -> Policy:
        """A fresh instance of the configured scheduling policy, with its settings."""
        if self.scheduler_policy == "fair":
            return policies.get(
                "fair",
                starve_after_s=self.fair_starve_after_s or None,
                las_thresholds=DEFAULT_LAS_THRESHOLDS if self.fair_least_attained else (),
                min_run_s=self.fair_min_run_s,
                shelter_whole_nodes=self.fair_shelter_whole_nodes,
                share_preemption=self.fair_share_preemption,
                share_margin=self.fair_share_margin,
                shortest_first=self.fair_shortest_first,
            )
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


def _problems(config: GatewayConfig) -> list[str]:
    """What breaks a rule between settings, or one msgspec.Meta cannot say."""
    checks = [
        (
            all(config.hosts) or not config.allowed_hosts.strip(),
            f"allowed_hosts {config.allowed_hosts!r} has an empty name: list host names "
            "separated by commas, or leave it empty to allow any",
        ),
        (
            config.scheduler_policy in POLICIES,
            f"scheduler_policy {config.scheduler_policy!r} is not one of {sorted(POLICIES)}",
        ),
        (
            config.heartbeat_s <= config.lease_s / 2,
            "heartbeat_s must be at most half of lease_s: a node must be able to miss a "
            "heartbeat without losing its leases (and without looking silent)",
        ),
        (
            config.node_timeout_s <= config.lease_s,
            "node_timeout_s must be at most lease_s: a node whose leases lapsed must not be "
            "given new work before it heartbeats again",
        ),
        (
            config.max_state_bytes >= config.inline_limit,
            "max_state_bytes must be at least inline_limit",
        ),
        (
            bool(config.tls_cert_file) == bool(config.tls_key_file),
            "tls_cert_file and tls_key_file go together: give both (HTTPS) or neither",
        ),
        *(
            (os.path.isfile(path), f"{name} {path!r} is not a file")
            for name, path in (
                ("tls_cert_file", config.tls_cert_file),
                ("tls_key_file", config.tls_key_file),
            )
            if path
        ),
        (
            bool(config.tls_cert_file) or is_loopback(config.host),
            f"the gateway serves plain HTTP only on a loopback address, not on {config.host!r}: "
            "give tls_cert_file and tls_key_file to serve HTTPS there, or listen on 127.0.0.1",
        ),
        (
            not config.shared_dir or os.path.isabs(config.shared_dir),
            "shared_dir must be an absolute path (the same on every node), "
            f"not {config.shared_dir!r}",
        ),
    ]
    return [message for ok, message in checks if not ok]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) names this machine's loopback only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
