"""Pure decisions about one job: fencing, failure, lease expiry, cancellation.

Each function takes the facts it needs as plain values and either returns the
event to append or raises the refusal; the command modules load and lock the
row, call these, and append what they return. None of them reads a clock: the
caller passes the database's ``now``.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from uuid import UUID

from umbra.errors import Conflict
from umbra.events.types import (
    TERMINAL_JOB_STATUSES,
    JobCancelled,
    JobFailed,
    JobLeaseExpired,
    JobRequeued,
)

from .backoff import backoff_seconds, should_retry


class NotHolder(Conflict):
    def __init__(self) -> None:
        super().__init__(
            "job_not_claimed_by_this_node",
            "This node does not hold the job at that attempt (its lease may have expired and the job been "
            "claimed again); stop working on it.",
        )


class JobWasCancelled(Conflict):
    def __init__(self) -> None:
        super().__init__("job_cancelled", "The job was cancelled; stop working on it and discard the result.")


class JobIsTerminal(Conflict):
    def __init__(self, status: str) -> None:
        super().__init__("job_terminal", f"The job already ended ({status}); there is nothing to cancel.", status=status)


def check_holder(*, status: str, lease_owner: UUID | None, attempt: int, node_id: UUID, claimed_attempt: int) -> None:
    """Fencing: only the node holding the job at ``claimed_attempt`` may act on it.

    ``attempt`` is the fencing token: it grows at every claim, so a holder whose
    lease expired and whose job was claimed again names an old attempt and is
    refused, changing nothing. A job cancelled while this node held it answers
    ``job_cancelled`` so the holder knows to stop. A lease past its expiry that
    the sweeper has not yet reclaimed is still the holder's: nobody else has it.
    """
    holds = lease_owner == node_id and attempt == claimed_attempt
    if status == "cancelled" and holds:
        raise JobWasCancelled()
    if status != "running" or not holds:
        raise NotHolder()


def repeats_completion(*, status: str, lease_owner: UUID | None, attempt: int, node_id: UUID, claimed_attempt: int) -> bool:
    """Whether a completion is one the job has already recorded, sent again by its holder.

    The holder did not hear the first answer (a dropped connection, a 503 for a
    batch whose commit landed as its connection broke) and sends the same
    completion again. It is answered with the job as it stands and records
    nothing: the first result stands. Without this it was refused 409, and the
    agent took its finished job for lost. Only the completing node, for the
    completed attempt: the attempt is the fencing token, so no other claim can
    match.
    """
    return status == "complete" and lease_owner == node_id and attempt == claimed_attempt


def decide_failure(
    *, attempt: int, max_attempts: int, error: str, retry: bool, now: datetime, released: int = 0
) -> JobRequeued | JobFailed:
    """A retryable failure requeues after the backoff while attempts remain; otherwise the job fails.

    ``released`` counts the job's claims given back before their agent heard
    of them (``job.released``): they never ran, so they are not charged
    against ``max_attempts``, though ``attempt`` (the fencing token, which
    never goes back) counts them. Without this a dropped long-poll cost the job
    one of its retries. The backoff still follows ``attempt`` (SPEC: 5 s × 2^(attempt−1)).
    """
    runs = attempt - released
    if should_retry(retry_requested=retry, attempt=runs, max_attempts=max_attempts):
        return JobRequeued(attempt=attempt, error=error, not_before=now + timedelta(seconds=backoff_seconds(attempt)))
    return JobFailed(attempt=attempt, error=error, reason="attempts_exhausted" if retry else "not_retryable")


def decide_lease_expiry(
    *, attempt: int, max_attempts: int, node_id: UUID | None, now: datetime, delay_seconds: int, released: int = 0
) -> JobLeaseExpired:
    """An expired lease requeues (only the holder is known to be gone) unless attempts are spent.

    ``attempt`` was incremented at claim time, so a job that kills every node
    that takes it still ends. Released claims are not charged, as in
    :func:`decide_failure`.
    """
    if attempt - released < max_attempts:
        return JobLeaseExpired(
            attempt=attempt, node_id=node_id, requeued=True, not_before=now + timedelta(seconds=delay_seconds)
        )
    return JobLeaseExpired(attempt=attempt, node_id=node_id, requeued=False)


def decide_cancel(*, status: str, by: str | None, reason: str | None = None) -> JobCancelled:
    if status in TERMINAL_JOB_STATUSES:
        raise JobIsTerminal(status)
    return JobCancelled(by=by, reason=reason)


LEASE_EXPIRED_ERROR = "lease expired: the holding node stopped renewing"
