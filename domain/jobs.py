"""Pure decisions about one job: fencing, repeated reports, failure, lease expiry, overrun, cancellation, retry,
priority, dependencies.

Each function takes the facts it needs as plain values and either returns the
event to append or raises the refusal; the command modules load and lock the
row, call these, and append what they return. None of them reads a clock: the
caller passes the database's ``now``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Literal, Mapping, Sequence
from uuid import UUID

from umbra.errors import Conflict
from umbra.events.types import (
    TERMINAL_JOB_STATUSES,
    JobBlocked,
    JobCancelled,
    JobFailed,
    JobLeaseExpired,
    JobReleased,
    JobReprioritized,
    JobRequeued,
    JobRetried,
    JobUnblocked,
)

from .backoff import backoff_seconds, should_retry
from .settlement import UNSUCCESSFUL


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
    def __init__(self, status: str, change: str = "nothing to cancel") -> None:
        super().__init__("job_terminal", f"The job already ended ({status}); there is {change}.", status=status)


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


#: A job requeued by its holder's failure: ``queued``, or ``blocked`` since (a second look found that
#: nothing could run it now), until it is claimed again at a later attempt or cancelled.
_REQUEUED = frozenset({"queued", "blocked"})
#: A decomposed job: a container, its children open or settled. It keeps the attempt that split it,
#: for it is never claimed again; cancelled, it is no repeat.
_DECOMPOSED = frozenset({"running", "complete", "partial"})


def failure_repeat_needs_log(*, status: str, attempt: int, claimed_attempt: int) -> bool:
    """Whether only the log can tell if a failure is one the job has already recorded.

    ``job.requeued`` clears the holder from the row, and so do an expired lease
    that requeued the job and a release: a queued row at the node's attempt
    looks the same after each. The caller then reads who failed that attempt
    (:func:`repeats_failure`'s ``requeued_by``); for any other row it reads
    nothing, so a failure from the holder costs no more than before.
    """
    return attempt == claimed_attempt and status in _REQUEUED


def repeats_failure(
    *, status: str, lease_owner: UUID | None, attempt: int, node_id: UUID, claimed_attempt: int, requeued_by: UUID | None = None,
    ended_under_holder: bool = False,
) -> bool:
    """Whether a failure is one the job has already recorded, sent again by the node that reported it.

    As with :func:`repeats_completion`: the node did not hear the first answer
    and sends the failure again. It is answered with the job as it stands and
    records nothing: the first outcome stands, whatever error text or retry
    flag the repeat carries. Without this it was refused 409, and the agent
    took its report for lost. Only the failing node, for the failed attempt
    (the fencing token: once the job is claimed again it names an older one):

    * ``failed``: ``job.failed`` keeps the holder on the row, so the row
      alone tells. An expired lease that failed the job clears the holder,
      and a blocked job that timed out had none: neither was this node's.
      The controller's failure past ``max_runtime_s`` keeps the holder (its
      handler may run on, and hold memory, until it hears) and says so
      (``ended_under_holder``): the holder's own failure then is no repeat.
    * ``queued`` (or ``blocked`` since): ``requeued_by`` is the node whose
      claim at ``claimed_attempt`` ended in its own retryable failure
      (``job.requeued``), read from the log when
      :func:`failure_repeat_needs_log` says so; ``None`` when that attempt
      ended otherwise (its lease expired, it was released).

    A cancelled or completed job is no repeat of a failure.
    """
    if attempt != claimed_attempt:
        return False
    if status == "failed":
        return lease_owner == node_id and not ended_under_holder
    return status in _REQUEUED and requeued_by == node_id


def decomposition_repeat_needs_log(*, status: str, attempt: int, children_total: int, claimed_attempt: int) -> bool:
    """Whether the job was split at the attempt a decomposition names, so the log must say by whom.

    ``job.decomposed`` clears the holder from the row; the row still says the
    job was split (its children count) and at which attempt.
    """
    return attempt == claimed_attempt and children_total > 0 and status in _DECOMPOSED


def repeats_decomposition(
    *, status: str, attempt: int, children_total: int, node_id: UUID, claimed_attempt: int, decomposed_by: UUID | None = None
) -> bool:
    """Whether a decomposition is one the job has already recorded, sent again by the node that split it.

    It is answered as the first was (the children as they stand, in the same
    order) and makes nothing: the first children stand, whatever the repeat
    lists. A repeat that made its children again would double the work and
    find its own idempotency keys taken. ``decomposed_by`` is the node whose
    claim at ``claimed_attempt`` split the job (``job.decomposed``), read from
    the log when :func:`decomposition_repeat_needs_log` says so. A cancelled
    job is no repeat.
    """
    return (
        decomposition_repeat_needs_log(status=status, attempt=attempt, children_total=children_total,
                                       claimed_attempt=claimed_attempt)
        and decomposed_by == node_id
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class UnchargedEnds:
    """A job's earlier claims that ended through no doing of its own, as its log counts them.

    * ``unheard``: given back before their agent heard of them (``job.released``
      for a client gone or a lost answer): they never ran, and are never charged.
      Without this a dropped long-poll cost the job one of its retries.
    * ``interrupted``: runs cut short from outside, by the revocation of the
      node that held them (``job.lease_expired``, ``cause: node_revoked``) or by
      their agent stopping past its grace and giving the job back
      (``job.released``, ``reason: agent_stopping``). The job did nothing to
      lose them, so they are not charged, but only up to ``max_attempts`` of
      them: a job that takes down every node it runs on would otherwise never
      run out of attempts while operators revoke or restart each dead node.
    """

    unheard: int = 0
    interrupted: int = 0
    #: At the job's last retry (``job.retried``), if it had one: its attempt then, and how many of its claims up
    #: to then were not charged. The ends before the retry count there, frozen: ``unheard`` and
    #: ``interrupted`` count only those since. Counted again under the retry's larger ``max_attempts``, an
    #: interruption charged when the job failed would be free again, and the retry would grant more runs than it said.
    retried_at: int = 0
    uncharged_before: int = 0

    def interruption_cap(self, max_attempts: int) -> int:
        """How many interruptions since the last retry (or ever) are free: as many as the runs granted since."""
        return max_attempts - (self.retried_at - self.uncharged_before)

    def count(self, max_attempts: int, *, interrupting: bool = False) -> int:
        """The claims not charged against ``max_attempts``; ``interrupting``: the run ending now is
        itself an interruption, counted with the earlier ones."""
        return self.uncharged_before + self.unheard + min(self.interrupted + interrupting, self.interruption_cap(max_attempts))


def decide_failure(
    *, attempt: int, max_attempts: int, error: str, retry: bool, now: datetime, ends: UnchargedEnds = UnchargedEnds()
) -> JobRequeued | JobFailed:
    """A retryable failure requeues after the backoff while attempts remain; otherwise the job fails.

    ``attempt`` (the fencing token, which never goes back) counts every claim;
    the budget counts runs, the claims ``ends`` does not exempt
    (:class:`UnchargedEnds`). The backoff still follows ``attempt`` (SPEC:
    5 s × 2^(attempt−1)).
    """
    runs = attempt - ends.count(max_attempts)
    if should_retry(retry_requested=retry, attempt=runs, max_attempts=max_attempts):
        return JobRequeued(attempt=attempt, error=error, not_before=now + timedelta(seconds=backoff_seconds(attempt)))
    return JobFailed(attempt=attempt, error=error, reason="attempts_exhausted" if retry else "not_retryable")


def decide_lease_expiry(
    *, attempt: int, max_attempts: int, node_id: UUID | None, now: datetime, delay_seconds: int,
    ends: UnchargedEnds = UnchargedEnds(), cause: Literal["expired", "node_revoked"] = "expired",
) -> JobLeaseExpired:
    """An ended lease requeues (only the holder is known to be gone) unless attempts are spent.

    ``attempt`` was incremented at claim time, so a job that kills every node
    that takes it still ends. A lease ended because an administrator revoked
    its node (``cause="node_revoked"``) is an interruption: not charged while
    the job has had fewer than ``max_attempts`` of them
    (:class:`UnchargedEnds`), so a job allowed one attempt does not fail for
    good for its node's revocation.
    """
    runs = attempt - ends.count(max_attempts, interrupting=cause == "node_revoked")
    if runs < max_attempts:
        return JobLeaseExpired(attempt=attempt, node_id=node_id, requeued=True,
                               not_before=now + timedelta(seconds=delay_seconds), cause=cause)  # fmt: skip
    return JobLeaseExpired(attempt=attempt, node_id=node_id, requeued=False, cause=cause)


def decide_overrun(
    *, attempt: int, max_runtime_s: int | None, claimed_at: datetime, now: datetime, grace_seconds: int
) -> JobFailed | None:
    """A job still running ``grace_seconds`` past its ``max_runtime_s``, counted from its current claim, fails.

    The agent stops a job at its ``max_runtime_s`` and fails it itself; the
    controller does it too, one grace later, so that an agent that does not
    (a bug, a handler deaf to cancellation, another client of the protocol)
    cannot hold a GPU for ever by renewing. The grace covers the claim's way
    to the agent and the failure's way back. Counted from the claim being run,
    not the first: a job requeued after a lost node has its whole time again.
    For good (``runtime_exceeded``), as the agent fails it: a job that ran out
    its time once would run it out again. None while it may still run.
    """
    if max_runtime_s is None:
        return None
    ran = (now - claimed_at).total_seconds()
    if ran < max_runtime_s + grace_seconds:
        return None
    return JobFailed(attempt=attempt, reason="runtime_exceeded",
                     error=f"The job exceeded its max_runtime_s ({max_runtime_s} s): still running {ran:.0f} s after its claim.")  # fmt: skip


#: ``job.unblocked``'s reason when the jobs a job depends on have all completed.
DEPENDENCIES_COMPLETE = "dependencies_complete"


@dataclass(frozen=True, slots=True)
class Dependencies:
    """Where the jobs a job depends on stand: the first that ended other than complete (with how it
    ended), and those not complete yet (that one among them), in the job's order."""

    ended_otherwise: tuple[UUID, str] | None
    open: tuple[UUID, ...]


def dependencies_of(depends_on: Sequence[UUID], statuses: Mapping[UUID, str]) -> Dependencies:
    """The one reading of dependencies' statuses that a submission, a retry, the sweeper's release and
    ``explain`` share: failed, cancelled or ``partial`` ends the wait for good; ``complete`` is met; any other
    status, or none (never the case: jobs are not deleted), is still open."""
    ended = next(((job_id, statuses[job_id]) for job_id in depends_on if statuses.get(job_id) in UNSUCCESSFUL), None)
    return Dependencies(ended, tuple(job_id for job_id in depends_on if statuses.get(job_id) != "complete"))


def decide_dependencies(
    *, status: str, attempt: int, depends_on: Sequence[UUID], statuses: Mapping[UUID, str],
    not_before: datetime | None = None, now: datetime | None = None,
) -> JobUnblocked | JobBlocked | JobFailed | None:
    """A job waiting for the jobs it depends on: released once every one completed, failed as soon as one
    ended otherwise (failed, cancelled, or a container that settled ``partial``), else left waiting (None).
    Released before the ``not_before`` it was submitted with (``now`` earlier than it), it goes on waiting,
    for its time (:func:`wait_for_time`).

    Failed for good (``dependency_failed``), charging no run: its input will not come, and running it without
    would waste the device; the failure names the first such dependency. A dependency with no status (never
    the case: jobs are not deleted) counts as not yet complete. An operator retries the dependency, then this
    job, which waits again.

    Only a ``blocked`` job (``status``) waits: a row marked waiting in another state (a server of the previous
    release, during a rolling upgrade, cancelled or released it without knowing the mark) is left alone, so a
    cancelled or running job is never sent back to the queue.
    """
    if status != "blocked":
        return None
    state = dependencies_of(depends_on, statuses)
    if state.ended_otherwise is not None:
        job_id, ended = state.ended_otherwise
        return JobFailed(attempt=attempt, reason="dependency_failed",
                         error=f"Job {job_id}, which this job depends on, ended {ended}.")  # fmt: skip
    if state.open:
        return None
    if not_before is not None and now is not None and not_before > now:
        return wait_for_time(not_before)
    return JobUnblocked(reason=DEPENDENCIES_COMPLETE)


#: ``job.unblocked``'s reason when a delayed job's ``not_before`` has come.
DUE = "due"
#: How far from now a submission's ``not_before`` may be, ahead or past.
MAX_DELAY = timedelta(days=366)


def wait_for_time(not_before: datetime) -> JobBlocked:
    """A job submitted to run no sooner than ``not_before`` (a delayed submission), that moment still to come:
    set aside, ``blocked`` until then, when the sweeper releases it (``job.unblocked``, :data:`DUE`) and it is
    judged against the fleet as a new submission is.

    Blocked rather than queued with a later ``not_before`` (as a retry's back-off is): a claim walks the
    queue in order, and thousands of jobs scheduled for tomorrow ahead of today's work would be walked over
    by every claim. A blocked job is in no index a claim reads; and ``explain`` and the job's
    ``blocked_reason`` say when it runs.
    """
    return JobBlocked(reason=not_due_reason(not_before), until=not_before)


def not_due_reason(not_before: datetime) -> str:
    """The ``blocked_reason`` of a job waiting for its ``not_before``."""
    return f"not due until {not_before.astimezone(timezone.utc).isoformat().replace('+00:00', 'Z')}"


def decide_due(*, status: str, waiting_until: datetime | None, now: datetime) -> JobUnblocked | None:
    """A job set aside until its time (:func:`wait_for_time`): released once ``now`` reached it. Only a
    ``blocked`` job waiting for a moment is released: a row in any other state is left alone."""
    if status != "blocked" or waiting_until is None or waiting_until > now:
        return None
    return JobUnblocked(reason=DUE)


#: ``job.released``'s reason when a stopping agent gives back a job it had started.
AGENT_STOPPING = "agent_stopping"
STOPPED_ERROR = "The agent stopped before the job finished."


def decide_give_back(
    *, attempt: int, max_attempts: int, now: datetime, ends: UnchargedEnds = UnchargedEnds()
) -> JobReleased | JobRequeued | JobFailed:
    """A stopping agent gives back a job it could not finish within its grace.

    An interruption (:class:`UnchargedEnds`): back to the queue at once, in
    its place, not charged (``job.released``, ``reason: agent_stopping``), as Sidekiq
    pushes back the jobs of a worker shutting down. Past
    ``max_attempts`` interruptions it is charged as the retryable failure the
    agent reported before it could give jobs back.
    """
    if ends.interrupted < ends.interruption_cap(max_attempts):
        return JobReleased(attempt=attempt, reason=AGENT_STOPPING)
    return decide_failure(attempt=attempt, max_attempts=max_attempts, error=STOPPED_ERROR, retry=True, now=now, ends=ends)


class JobIsRunning(Conflict):
    def __init__(self) -> None:
        super().__init__("job_running", "The job is running; it was to be cancelled only while it waited.",
                         status="running")  # fmt: skip


def decide_cancel(*, status: str, by: str | None, reason: str | None = None, if_waiting: bool = False) -> JobCancelled:
    """Cancel a job that has not ended. ``if_waiting``: only if it waits (queued or blocked), so that a bulk
    withdrawal listed before a claim never stops a run the claim started (409 ``job_running``)."""
    if status in TERMINAL_JOB_STATUSES:
        raise JobIsTerminal(status)
    if if_waiting and status == "running":
        raise JobIsRunning()
    return JobCancelled(by=by, reason=reason)


class JobNotRetryable(Conflict):
    def __init__(self, message: str, status: str) -> None:
        super().__init__("job_not_retryable", message, status=status)


def decide_retry(
    *, status: str, attempt: int, max_attempts: int, parent_job_id: UUID | None, children_total: int, grant: int,
    by: str | None, ends: UnchargedEnds = UnchargedEnds(), last_run_may_run_on: bool = False,
    dependencies: Dependencies | None = None, not_before: datetime | None = None,
) -> JobRetried:
    """An operator sends a failed job back to the queue with ``grant`` more runs.

    Only a job that failed: one still queued, running or blocked has its runs
    ahead of it, and a completed or cancelled one ended as someone meant it
    to. Only a job of no tree: a child's failure has already counted in its
    parent's settlement (or will, when its siblings end), and a container's
    outcome is its children's, so retrying either would leave a parent that
    says what its children no longer do; a tree is retried by submitting it
    again.

    The budget counts charged runs (:class:`UnchargedEnds`), so the new
    ``max_attempts`` is the runs charged so far plus ``grant``: exactly
    ``grant`` more, however the earlier ones ended. The claims not charged up
    to now are recorded with it (``uncharged``), frozen: the ends after the
    retry are counted against the runs it granted.

    A job that depends on others (``dependencies``: where they stand) is retried
    only once none of them has ended other than complete: it would only fail
    again. Retry those first; the retried job waits for them. ``not_before`` is
    the one it was submitted with: the retried job keeps it (and waits for it,
    if it is still to come).
    """
    if status != "failed":
        raise JobNotRetryable(f"Only a failed job can be retried; this one is {status}.", status)
    if parent_job_id is not None:
        raise JobNotRetryable("A child job is not retried on its own: its parent's outcome already counts its "
                              "failure. Submit the tree again.", status)  # fmt: skip
    if children_total:
        raise JobNotRetryable("A job that made children is not retried: its outcome is its children's. Submit it "
                              "again.", status)  # fmt: skip
    if last_run_may_run_on:
        # Failed under its holder (past its max_runtime_s): until the node reports, its memory is counted as
        # taken; a retry now would give it up, and the next job placed there meet the run still holding it.
        raise JobNotRetryable("Its last run may still hold its device until its node next reports (within a "
                              "heartbeat); retry it then.", status)  # fmt: skip
    if dependencies is not None and dependencies.ended_otherwise is not None:
        job_id, ended = dependencies.ended_otherwise
        raise JobNotRetryable(f"It depends on job {job_id}, which ended {ended}: retry that one first.", status)
    uncharged = min(attempt, ends.count(max_attempts))
    return JobRetried(attempt=attempt, max_attempts=attempt - uncharged + grant, uncharged=uncharged, by=by,
                      not_before=not_before)  # fmt: skip


class JobNotReprioritizable(Conflict):
    def __init__(self, message: str, status: str) -> None:
        super().__init__("job_not_reprioritizable", message, status=status)


def decide_reprioritize(*, status: str, priority: int, new: int, children_total: int, by: str | None) -> JobReprioritized | None:
    """Someone moves a waiting job to priority ``new`` (lower runs first); None when it is there already.

    A queued or blocked job takes its place among the jobs of its new priority,
    by submission. Refused for a job that ended (409 ``job_terminal``: there
    is no queue left to move in), for a job that made children (it runs
    nothing itself: its children, each with its own priority, are what wait)
    and for a running job (409 ``job_not_reprioritizable``): it has its
    device already, and its claim must stand untouched until its agent
    acts on it, or a claim whose answer was lost could no longer be told
    apart and given back.
    """
    if status in TERMINAL_JOB_STATUSES:
        raise JobIsTerminal(status, "no queue to move it in")
    if children_total:
        raise JobNotReprioritizable("A job that made children runs nothing itself: change its children's "
                                    "priority.", status)  # fmt: skip
    if status == "running":
        raise JobNotReprioritizable("A running job has its device already; only a waiting (queued or blocked) "
                                    "job moves.", status)  # fmt: skip
    if new == priority:
        return None
    return JobReprioritized(priority=new, previous=priority, by=by)


LEASE_EXPIRED_ERROR = "lease expired: the holding node stopped renewing"
NODE_REVOKED_ERROR = "lease ended: the holding node's credentials were revoked"


def lease_ended_error(event: JobLeaseExpired) -> str:
    """The job's error once its lease ended without a report."""
    return NODE_REVOKED_ERROR if event.cause == "node_revoked" else LEASE_EXPIRED_ERROR
