"""Process-wide Prometheus instruments: the one place every layer counts in.

The instruments are created unregistered and belong to the process, because a
counter is a fact about the process (how many claims *this* server made), not
about one Starlette application object. Each application builds its own
:class:`prometheus_client.CollectorRegistry` with :func:`registry_with` and adds
collectors bound to its own pool (queue depth by status, read from the jobs
table on scrape, so it is right even for jobs another process changed).

``compute/`` and ``projections/`` import this module (never ``umbra.api``) to
count what they do: :func:`count_events_appended`, :func:`count_sweeper_action`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.registry import Collector

#: Buckets in seconds for "how long until something happened" in the
#: millisecond-to-minute range that long-polls span.
_WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
#: Buckets for hint-to-claim latency: a notification round trip is sub-millisecond
#: to a few milliseconds; anything past 1 s was found by the safety poll.
_WAKE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

CLAIMS = Counter(
    "umbra_claims",
    "Jobs claimed (one per job.claimed event, a claim given back because its agent left counted too), by how "
    "the claim was found (completion: with the previous job's report; same_claim: after the first of a claim of several).",
    ["trigger"],
    registry=None,
)
CLAIM_ATTEMPTS = Counter(
    "umbra_claim_attempts",
    "Claim transactions run by long-polls (successful or not).",
    registry=None,
)
CLAIM_WAIT = Histogram(
    "umbra_claim_wait_seconds",
    "Time from a long-poll's arrival to its answer (claimed job or 204).",
    ["outcome"],
    buckets=_WAIT_BUCKETS,
    registry=None,
)
WAKE_LATENCY = Histogram(
    "umbra_wake_latency_seconds",
    "Time from a log hint reaching this process to the claim it caused committing.",
    buckets=_WAKE_BUCKETS,
    registry=None,
)
ATTEMPTS_PER_WAKE = Histogram(
    "umbra_claim_attempts_per_wake",
    "Claim attempts one wake-up cost before it was used or given up (1 is ideal).",
    buckets=(1, 2, 3, 5, 10, 25, 100, 1000),
    registry=None,
)
LONG_POLLS_WAITING = Gauge(
    "umbra_long_polls_waiting",
    "Long-poll claims currently parked in this process (holding no database connection).",
    registry=None,
)
JOB_READS_WAITING = Gauge(
    "umbra_job_reads_waiting",
    "Reads of a job parked in this process until it ends (GET /v1/jobs/{id}?wait=; no database connection each).",
    registry=None,
)
SSE_STREAMS = Gauge(
    "umbra_sse_streams",
    "Server-Sent-Events streams currently open in this process.",
    ["stream"],
    registry=None,
)
LISTENER_RECONNECTS = Counter(
    "umbra_listener_reconnects",
    "Times this process's LISTEN connection was re-established.",
    registry=None,
)
EVENTS_APPENDED = Counter(
    "umbra_events_appended",
    "Events this process appended to the log.",
    registry=None,
)
SWEEPER_ACTIONS = Counter(
    "umbra_sweeper_actions",
    "Changes the sweeper made (expired leases, stale nodes, blocked timeouts, unblocked jobs, pruned pairing rows and abandoned claim requests), by action.",
    ["action"],
    registry=None,
)
CLAIMS_GIVEN_BACK = Counter(
    "umbra_claims_given_back",
    "Claims that went back to the queue without a report from their agent, by reason: client_gone, "
    "not_asked_again, answer_unread (never run, never charged), agent_stopping (given back unfinished by a "
    "stopping agent), node_revoked (a lease its node's revocation ended). An expired lease is the sweeper's.",
    ["reason"],
    registry=None,
)
HTTP_REQUESTS = Counter(
    "umbra_http_requests",
    "HTTP requests answered, by method, route template and status.",
    ["method", "route", "status"],
    registry=None,
)
GROUP_COMMIT_BATCH_COMMANDS = Histogram(
    "umbra_group_commit_batch_commands",
    "Agent commands (claims, renewals, completions) committed per group-commit transaction.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    registry=None,
)
GROUP_COMMIT_BATCH_SECONDS = Histogram(
    "umbra_group_commit_batch_seconds",
    "Wall time of one group-commit transaction, from taking the connection to the commit.",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1),
    registry=None,
)
GROUP_COMMIT_FALLBACKS = Counter(
    "umbra_group_commit_fallbacks",
    "Group-commit transactions that failed and re-ran their commands one by one.",
    registry=None,
)
CLAIMS_LEFT_TO_HOLDERS = Counter(
    "umbra_claims_left_to_holders",
    "Claims that took nothing because the jobs they could run were left, for now, to nodes that hold the "
    "jobs' models (model affinity across nodes, UMBRA_MODEL_AFFINITY_SECONDS).",
    registry=None,
)

#: The label values of the labelled counters and histograms, each given its series at start, so a
#: fresh server shows them at 0: a dashboard or an alert on ``rate(umbra_claims_total[5m])`` reads 0,
#: not "no data". (``umbra_http_requests`` and ``umbra_sse_streams`` name routes as they are met.)
CLAIM_TRIGGERS = ("immediate", "hint", "poll", "recheck", "completion", "same_claim")
CLAIM_OUTCOMES = ("claimed", "timeout", "client_gone")
GIVE_BACK_REASONS = ("client_gone", "not_asked_again", "answer_unread", "agent_stopping", "node_revoked")
SWEEPER_ACTIONS_COUNTED = ("lease_requeued", "lease_failed", "node_went_offline", "blocked_timeout",
                           "runtime_exceeded", "job_unblocked", "job_blocked", "pairing_pruned", "jobs_analysed",
                           "dependencies_released", "dependency_failed", "delayed_released",
                           "abandoned_claims_pruned")  # fmt: skip
for _trigger in CLAIM_TRIGGERS:
    CLAIMS.labels(trigger=_trigger)
for _outcome in CLAIM_OUTCOMES:
    CLAIM_WAIT.labels(outcome=_outcome)
for _action in SWEEPER_ACTIONS_COUNTED:
    SWEEPER_ACTIONS.labels(action=_action)
for _reason in GIVE_BACK_REASONS:
    CLAIMS_GIVEN_BACK.labels(reason=_reason)

PROCESS_COLLECTORS: tuple[Collector, ...] = (
    CLAIMS,
    CLAIM_ATTEMPTS,
    CLAIM_WAIT,
    WAKE_LATENCY,
    ATTEMPTS_PER_WAKE,
    LONG_POLLS_WAITING,
    JOB_READS_WAITING,
    SSE_STREAMS,
    LISTENER_RECONNECTS,
    EVENTS_APPENDED,
    SWEEPER_ACTIONS,
    CLAIMS_GIVEN_BACK,
    HTTP_REQUESTS,
    GROUP_COMMIT_BATCH_COMMANDS,
    GROUP_COMMIT_BATCH_SECONDS,
    GROUP_COMMIT_FALLBACKS,
    CLAIMS_LEFT_TO_HOLDERS,
)


def registry_with(*extra: Collector) -> CollectorRegistry:
    """A fresh registry holding the process instruments plus ``extra`` collectors."""
    registry = CollectorRegistry(auto_describe=True)
    for collector in (*PROCESS_COLLECTORS, *extra):
        registry.register(collector)
    return registry


def count_events_appended(n: int = 1) -> None:
    """Called by the event store when an append statement wrote ``n`` events.

    Counted at append time: an append whose transaction later rolls back is
    still counted, so this is an upper bound on committed events (the log's
    head position gauge is exact).
    """
    if n > 0:
        EVENTS_APPENDED.inc(n)


def count_given_back(reason: str, n: int = 1) -> None:
    """``reason`` is one of :data:`GIVE_BACK_REASONS`; counted once the change is made (its commit may follow)."""
    assert reason in GIVE_BACK_REASONS, reason  # its series exists from the start
    if n > 0:
        CLAIMS_GIVEN_BACK.labels(reason=reason).inc(n)


def count_sweeper_action(action: str, n: int = 1) -> None:
    """``action`` is one of :data:`SWEEPER_ACTIONS_COUNTED`, such as ``lease_requeued`` or ``node_went_offline``."""
    assert action in SWEEPER_ACTIONS_COUNTED, action  # its series exists from the start
    if n > 0:
        SWEEPER_ACTIONS.labels(action=action).inc(n)
