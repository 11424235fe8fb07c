"""Retry backoff: min(5 s × 2^(attempt−1), 600 s), and when a failure is retried at all."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from uuid import uuid4

import pytest

from umbra.domain.backoff import backoff_seconds, should_retry
from umbra.domain.jobs import (
    AGENT_STOPPING, JobNotRetryable, JobWasCancelled, NotHolder, UnchargedEnds, check_holder, decide_failure,
    Dependencies, decide_dependencies, decide_give_back, decide_lease_expiry, decide_overrun, decide_retry, dependencies_of,
    DUE, decide_due, wait_for_time,
)  # fmt: skip
from umbra.events.types import JobBlocked, JobFailed, JobReleased, JobRequeued, JobUnblocked

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def test_the_backoff_schedule_doubles_from_five_seconds_and_caps_at_ten_minutes():
    assert [backoff_seconds(a) for a in range(1, 10)] == [5, 10, 20, 40, 80, 160, 320, 600, 600]
    assert backoff_seconds(1000) == 600
    assert backoff_seconds(0) == 5


def test_the_backoff_is_the_formula_for_every_attempt_and_never_overflows():
    """``min(5 s × 2^(attempt−1), 600 s)`` for attempts 1..100 and far beyond; no huge ints, no error."""
    for attempt in range(1, 101):
        assert backoff_seconds(attempt) == min(5 * 2 ** (attempt - 1), 600)
    for attempt in (10**6, 2**63, 10**100):
        assert backoff_seconds(attempt) == 600
    assert backoff_seconds(0) == backoff_seconds(-5) == 5


def test_retry_only_while_attempts_remain_and_only_when_asked():
    assert should_retry(retry_requested=True, attempt=2, max_attempts=3)
    assert not should_retry(retry_requested=True, attempt=3, max_attempts=3)
    assert not should_retry(retry_requested=False, attempt=1, max_attempts=3)


def test_a_retryable_failure_requeues_after_the_backoff_else_fails_with_why():
    event = decide_failure(attempt=2, max_attempts=3, error="oom", retry=True, now=NOW)
    assert event == JobRequeued(attempt=2, error="oom", not_before=NOW + timedelta(seconds=10))
    assert decide_failure(attempt=3, max_attempts=3, error="oom", retry=True, now=NOW) == JobFailed(
        attempt=3, error="oom", reason="attempts_exhausted"
    )
    assert decide_failure(attempt=1, max_attempts=3, error="bad input", retry=False, now=NOW).reason == "not_retryable"


def test_an_expired_lease_requeues_with_the_delay_until_attempts_are_spent():
    node = uuid4()
    requeued = decide_lease_expiry(attempt=1, max_attempts=2, node_id=node, now=NOW, delay_seconds=2)
    assert (requeued.requeued, requeued.not_before) == (True, NOW + timedelta(seconds=2))
    assert decide_lease_expiry(attempt=2, max_attempts=2, node_id=node, now=NOW, delay_seconds=2).requeued is False


def test_released_claims_are_not_charged_as_runs():
    """Attempt 4 after two releases is the second run: the budget counts runs; the backoff follows the attempt."""
    unheard = UnchargedEnds(unheard=2)
    event = decide_failure(attempt=4, max_attempts=3, error="oom", retry=True, now=NOW, ends=unheard)
    assert event == JobRequeued(attempt=4, error="oom", not_before=NOW + timedelta(seconds=40))
    assert decide_failure(attempt=5, max_attempts=3, error="oom", retry=True, now=NOW, ends=unheard).reason == "attempts_exhausted"
    one = UnchargedEnds(unheard=1)
    assert decide_lease_expiry(attempt=2, max_attempts=2, node_id=None, now=NOW, delay_seconds=2, ends=one).requeued
    assert not decide_lease_expiry(attempt=3, max_attempts=2, node_id=None, now=NOW, delay_seconds=2, ends=one).requeued


def test_unheard_claims_are_never_charged_however_many():
    """A claim given back before its agent heard of it never ran: a hundred of them still leave every run."""
    ends = UnchargedEnds(unheard=100)
    assert ends.count(1) == 100
    assert decide_failure(attempt=101, max_attempts=1, error="x", retry=True, now=NOW, ends=ends).reason == "attempts_exhausted"
    assert decide_lease_expiry(attempt=101, max_attempts=2, node_id=None, now=NOW, delay_seconds=0, ends=ends).requeued


def test_a_lease_ended_by_its_nodes_revocation_requeues_while_interruptions_are_free():
    """The job did nothing to lose that run: even on its last attempt it goes back, claimable now."""
    for attempt, ends in ((1, UnchargedEnds()), (3, UnchargedEnds(unheard=2)), (7, UnchargedEnds(unheard=6))):
        event = decide_lease_expiry(attempt=attempt, max_attempts=1, node_id=None, now=NOW, delay_seconds=0,
                                    ends=ends, cause="node_revoked")  # fmt: skip
        assert (event.requeued, event.not_before, event.cause) == (True, NOW, "node_revoked")
    assert decide_lease_expiry(attempt=1, max_attempts=1, node_id=None, now=NOW, delay_seconds=0).requeued is False


def test_interruptions_past_max_attempts_are_charged_so_a_node_killing_job_still_ends():
    """A job allowed two attempts whose every run ends in a revocation: two are free, then they count.

    Runs 1 and 2 revoked: free. Run 3 revoked: interruptions now exceed the cap, so one of them is
    charged (run 1 of 2), and the job requeues. Run 4 revoked: two charged, the job fails for good.
    """
    decided = []
    for attempt in range(1, 5):
        ends = UnchargedEnds(interrupted=attempt - 1)
        decided.append(decide_lease_expiry(attempt=attempt, max_attempts=2, node_id=None, now=NOW, delay_seconds=0,
                                           ends=ends, cause="node_revoked").requeued)  # fmt: skip
    assert decided == [True, True, True, False]
    # An expiry or a failure after free interruptions counts only the runs charged.
    two_free = UnchargedEnds(interrupted=2)
    assert decide_lease_expiry(attempt=3, max_attempts=2, node_id=None, now=NOW, delay_seconds=0, ends=two_free).requeued
    assert decide_failure(attempt=3, max_attempts=2, error="x", retry=True, now=NOW, ends=two_free).attempt == 3
    assert isinstance(decide_failure(attempt=4, max_attempts=2, error="x", retry=True, now=NOW, ends=two_free), JobFailed)
    # Past the cap the extra interruptions are charged: five of them free only two.
    assert UnchargedEnds(unheard=1, interrupted=5).count(2) == 3


def test_a_stopping_agent_gives_back_uncharged_until_interruptions_reach_max_attempts():
    """Given back: ``job.released`` (``agent_stopping``), queued at once. Past the cap: the charged retryable
    failure it used to be, with its backoff, and on the last charged run the job fails."""
    assert decide_give_back(attempt=1, max_attempts=1, now=NOW) == JobReleased(attempt=1, reason=AGENT_STOPPING)
    assert decide_give_back(attempt=5, max_attempts=3, now=NOW, ends=UnchargedEnds(unheard=2, interrupted=2)) == (
        JobReleased(attempt=5, reason=AGENT_STOPPING))
    charged = decide_give_back(attempt=4, max_attempts=3, now=NOW, ends=UnchargedEnds(interrupted=3))
    assert isinstance(charged, JobRequeued) and charged.not_before == NOW + timedelta(seconds=40)
    exhausted = decide_give_back(attempt=2, max_attempts=1, now=NOW, ends=UnchargedEnds(interrupted=1))
    assert isinstance(exhausted, JobFailed) and exhausted.reason == "attempts_exhausted"


def test_fencing_refuses_everyone_but_the_holder_at_its_attempt():
    node, other = uuid4(), uuid4()
    check_holder(status="running", lease_owner=node, attempt=2, node_id=node, claimed_attempt=2)
    for who, attempt in ((other, 2), (node, 1)):
        with pytest.raises(NotHolder):
            check_holder(status="running", lease_owner=node, attempt=2, node_id=who, claimed_attempt=attempt)
    with pytest.raises(NotHolder):
        check_holder(status="queued", lease_owner=None, attempt=2, node_id=node, claimed_attempt=2)
    with pytest.raises(JobWasCancelled):
        check_holder(status="cancelled", lease_owner=node, attempt=2, node_id=node, claimed_attempt=2)
    with pytest.raises(NotHolder):  # cancelled, but this caller never held that attempt
        check_holder(status="cancelled", lease_owner=node, attempt=2, node_id=node, claimed_attempt=1)


def test_a_retry_grants_exactly_the_runs_it_names_past_the_charged_ones():
    """The new budget is the runs charged so far plus the grant: a job failed at its third claim, one of which
    was given back unheard and one cut short by a revocation, has one charged run, so a grant of two makes
    ``max_attempts`` three, and its next two charged failures are what the grant allows."""
    ends = UnchargedEnds(unheard=1, interrupted=1)
    retried = decide_retry(status="failed", attempt=3, max_attempts=3, parent_job_id=None, children_total=0, grant=2,
                           by="key:x", ends=ends)  # fmt: skip
    assert (retried.attempt, retried.max_attempts, retried.uncharged, retried.by) == (3, 3, 2, "key:x")
    since = UnchargedEnds(retried_at=3, uncharged_before=2)  # as the log reads after the retry: nothing ended since
    first = decide_failure(attempt=4, max_attempts=retried.max_attempts, error="e", retry=True, now=NOW, ends=since)
    second = decide_failure(attempt=5, max_attempts=retried.max_attempts, error="e", retry=True, now=NOW, ends=since)
    assert (type(first), type(second)) == (JobRequeued, JobFailed)


def test_an_interruption_charged_before_a_retry_stays_charged_after_it():
    """A job allowed one run, revoked twice (the first free, the second charged: it failed), retried with one
    run: that run's retryable failure fails it, and a third revocation after the retry is free only as one of
    the runs the retry granted, once."""
    before = UnchargedEnds(interrupted=2)
    failed = decide_lease_expiry(attempt=2, max_attempts=1, node_id=uuid4(), now=NOW, delay_seconds=0,
                                 ends=UnchargedEnds(interrupted=1), cause="node_revoked")  # fmt: skip
    assert not failed.requeued
    retried = decide_retry(status="failed", attempt=2, max_attempts=1, parent_job_id=None, children_total=0, grant=1,
                           by=None, ends=before)  # fmt: skip
    assert (retried.max_attempts, retried.uncharged) == (2, 1)
    since = UnchargedEnds(retried_at=2, uncharged_before=1)
    assert type(decide_failure(attempt=3, max_attempts=2, error="e", retry=True, now=NOW, ends=since)) is JobFailed
    revoked = decide_lease_expiry(attempt=3, max_attempts=2, node_id=uuid4(), now=NOW, delay_seconds=0, ends=since,
                                  cause="node_revoked")  # fmt: skip
    assert revoked.requeued  # the first interruption since the retry: free
    again = UnchargedEnds(interrupted=1, retried_at=2, uncharged_before=1)
    assert not decide_lease_expiry(attempt=4, max_attempts=2, node_id=uuid4(), now=NOW, delay_seconds=0, ends=again,
                                   cause="node_revoked").requeued  # fmt: skip
    assert type(decide_give_back(attempt=4, max_attempts=2, now=NOW, ends=again)) is not JobReleased


@pytest.mark.parametrize("status", ["queued", "running", "blocked", "complete", "cancelled", "partial"])
def test_only_a_failed_job_is_retried(status):
    with pytest.raises(JobNotRetryable) as refused:
        decide_retry(status=status, attempt=1, max_attempts=3, parent_job_id=None, children_total=0, grant=3, by=None)
    assert (refused.value.code, refused.value.extra["status"]) == ("job_not_retryable", status)


def test_a_job_of_a_tree_is_not_retried_on_its_own():
    for tree in ({"parent_job_id": uuid4(), "children_total": 0}, {"parent_job_id": None, "children_total": 2}):
        with pytest.raises(JobNotRetryable):
            decide_retry(status="failed", attempt=1, max_attempts=3, grant=3, by=None, **tree)


def test_a_job_fails_for_good_one_grace_past_its_runtime_counted_from_its_current_claim():
    claimed = NOW - timedelta(seconds=150)
    decide = lambda **kw: decide_overrun(**{"attempt": 2, "max_runtime_s": 100, "claimed_at": claimed, "now": NOW,  # noqa: E731
                                            "grace_seconds": 60, **kw})  # fmt: skip
    assert decide() is None  # 150 s < 100 s + 60 s: the agent may still be reporting its own failure
    assert decide(grace_seconds=50) == JobFailed(
        attempt=2, reason="runtime_exceeded",
        error="The job exceeded its max_runtime_s (100 s): still running 150 s after its claim.")  # fmt: skip
    assert decide(now=claimed + timedelta(seconds=160)).reason == "runtime_exceeded"  # exactly at the limit
    assert decide(now=claimed + timedelta(seconds=159.9)) is None
    assert decide(max_runtime_s=None, now=NOW + timedelta(days=30)) is None  # no limit, none enforced


def test_a_waiting_job_is_released_when_every_dependency_completed_and_fails_on_the_first_that_did_not():
    a, b, c = uuid4(), uuid4(), uuid4()
    decide = lambda statuses, status="blocked": decide_dependencies(status=status, attempt=0, depends_on=(a, b, c),  # noqa: E731
                                                                    statuses=statuses)  # fmt: skip
    assert decide({a: "complete", b: "complete", c: "complete"}) == JobUnblocked(reason="dependencies_complete")
    assert decide({a: "complete", b: "running", c: "queued"}) is None
    assert decide({a: "complete", b: "blocked", c: "complete"}) is None
    assert decide({a: "complete", b: "complete"}) is None  # one not read: not complete
    for ended in ("failed", "cancelled", "partial"):
        assert decide({a: "running", b: "complete", c: ended}) == JobFailed(
            attempt=0, reason="dependency_failed", error=f"Job {c}, which this job depends on, ended {ended}.")  # fmt: skip
    assert decide({a: "cancelled", b: "failed", c: "complete"}).error.startswith(f"Job {a},")  # the first, in its order
    for not_waiting in ("queued", "running", "cancelled", "complete"):  # a mark a previous release left behind
        assert decide({a: "complete", b: "complete", c: "complete"}, not_waiting) is None
        assert decide({a: "failed"}, not_waiting) is None



def test_a_job_released_by_its_dependencies_before_its_not_before_waits_on_for_its_time():
    a = uuid4()
    later = NOW + timedelta(hours=1)
    decide = lambda not_before, now=NOW: decide_dependencies(status="blocked", attempt=0, depends_on=(a,),  # noqa: E731
                                                             statuses={a: "complete"}, not_before=not_before, now=now)  # fmt: skip
    assert decide(later) == JobBlocked(reason="not due until 2026-01-01T01:00:00Z", until=later) == wait_for_time(later)
    assert decide(later, now=later) == decide(NOW - timedelta(seconds=1)) == decide(None) == JobUnblocked(reason="dependencies_complete")
    failed = decide_dependencies(status="blocked", attempt=0, depends_on=(a,), statuses={a: "failed"}, not_before=later, now=NOW)
    assert isinstance(failed, JobFailed)  # a failed dependency fails it at once, its time or not


def test_a_job_waiting_for_its_time_is_released_once_the_clock_reaches_it_and_only_if_blocked():
    at = NOW + timedelta(minutes=5)
    assert decide_due(status="blocked", waiting_until=at, now=at - timedelta(microseconds=1)) is None
    assert decide_due(status="blocked", waiting_until=at, now=at) == JobUnblocked(reason=DUE)
    assert decide_due(status="blocked", waiting_until=None, now=at) is None  # blocked for another reason
    for other in ("queued", "running", "cancelled", "complete", "failed"):
        assert decide_due(status=other, waiting_until=at, now=at + timedelta(days=1)) is None
    assert wait_for_time(datetime(2026, 1, 1, 13, 0, tzinfo=timezone(timedelta(hours=1)))).reason == "not due until 2026-01-01T12:00:00Z"

def test_a_job_whose_dependency_ended_otherwise_is_not_retried_until_that_one_is():
    a, b = uuid4(), uuid4()
    retry = lambda statuses: decide_retry(status="failed", attempt=0, max_attempts=3, parent_job_id=None,  # noqa: E731
                                          children_total=0, grant=3, by="ops",
                                          dependencies=dependencies_of(tuple(statuses), statuses))  # fmt: skip
    with pytest.raises(JobNotRetryable, match=f"depends on job {b}, which ended failed"):
        retry({a: "complete", b: "failed"})
    assert retry({a: "complete", b: "queued"}).max_attempts == 3  # it waits for b again
    assert retry({}).max_attempts == 3


def test_dependencies_read_one_way_the_first_that_ended_otherwise_and_those_still_open():
    a, b, c = uuid4(), uuid4(), uuid4()
    read = dependencies_of((a, b, c), {a: "complete", b: "running", c: "cancelled"})
    assert (read.ended_otherwise, read.open) == ((c, "cancelled"), (b, c))
    assert dependencies_of((a, b), {a: "complete", b: "complete"}) == Dependencies(None, ())
    assert dependencies_of((a,), {}).open == (a,)  # not read: not complete
