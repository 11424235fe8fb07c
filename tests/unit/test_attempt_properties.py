"""Properties of the pure attempt rules (``umbra.domain.backoff``, ``umbra.domain.jobs``) over any history.

The examples in ``test_backoff.py`` pin the schedule and each rule; these check that, whatever order a
job's claims end in, the rules together keep the budget SPEC and API.md state: every retryable end
charged to the job is a run, a job allowed ``max_attempts`` runs has exactly that many before it fails
(``max_attempts=1`` is one run), runs cut short from outside are free only ``max_attempts`` times, claims
given back unheard are never charged, and a retry grants exactly the runs it names.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from hypothesis import given, settings
from hypothesis import strategies as st

from umbra.domain.backoff import BACKOFF_BASE_SECONDS, BACKOFF_CEILING_SECONDS, backoff_seconds
from umbra.domain.jobs import UnchargedEnds, decide_failure, decide_give_back, decide_lease_expiry, decide_retry
from umbra.events.types import JobFailed, JobLeaseExpired, JobReleased, JobRequeued

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
#: How a claim ends: given back unheard, the holder's retryable failure, its lease run out, its node
#: revoked, its agent stopping.
ENDS = st.sampled_from(["unheard", "fail", "expire", "revoked", "give_back"])


@given(st.integers(min_value=-(2**70), max_value=2**70), st.integers(min_value=0, max_value=2**70))
def test_the_backoff_never_shrinks_as_attempts_grow_and_stays_within_five_seconds_and_ten_minutes(attempt, more):
    delay = backoff_seconds(attempt)
    assert BACKOFF_BASE_SECONDS <= delay <= BACKOFF_CEILING_SECONDS
    assert backoff_seconds(attempt + more) >= delay
    if 1 <= attempt <= 64:
        assert delay == min(BACKOFF_BASE_SECONDS * 2 ** (attempt - 1), BACKOFF_CEILING_SECONDS)


@given(st.integers(min_value=1, max_value=2**62), st.integers(min_value=1, max_value=100))
def test_a_requeue_is_due_its_backoff_from_now_whatever_the_attempt(attempt, max_attempts):
    event = decide_failure(attempt=attempt, max_attempts=max_attempts, error="e", retry=True, now=NOW,
                           ends=UnchargedEnds(unheard=attempt - 1))  # fmt: skip
    assert isinstance(event, JobRequeued) == (max_attempts > 1)
    if isinstance(event, JobRequeued):
        assert event.not_before - NOW == timedelta(seconds=backoff_seconds(attempt))


@settings(max_examples=400, deadline=None)
@given(st.integers(min_value=1, max_value=5), st.lists(ENDS, max_size=60), st.lists(st.integers(1, 4), max_size=3))
def test_a_job_runs_exactly_its_charged_budget_whatever_order_its_claims_end_in(max_attempts, ends, grants):
    """A small model of the log: ``uncharged_claims``' counts, and an oracle of what each end costs."""
    attempt, budget = 0, max_attempts
    unheard = interrupted = 0  # the log's counts since the last retry
    retried_at = uncharged_before = 0
    charged = free = 0  # the oracle, since the last retry: runs charged, interruptions not charged
    history = iter(ends)
    while True:
        end = next(history, "fail")  # the history ran out: the job fails until its runs are spent
        attempt += 1  # a claim
        counted = UnchargedEnds(unheard=unheard, interrupted=interrupted, retried_at=retried_at,
                                uncharged_before=uncharged_before)  # fmt: skip
        if end == "unheard":
            unheard += 1  # job.released, never charged, never failing the job
            continue
        if end == "fail":
            event = decide_failure(attempt=attempt, max_attempts=budget, error="e", retry=True, now=NOW, ends=counted)
        elif end in ("expire", "revoked"):
            event = decide_lease_expiry(attempt=attempt, max_attempts=budget, node_id=None, now=NOW, delay_seconds=2,
                                        ends=counted, cause="node_revoked" if end == "revoked" else "expired")  # fmt: skip
        else:
            event = decide_give_back(attempt=attempt, max_attempts=budget, now=NOW, ends=counted)
        cut_short = end in ("revoked", "give_back")
        is_free = cut_short and free < max_attempts
        if end == "revoked" or isinstance(event, JobReleased):
            interrupted += 1  # what the log counts: every revocation's end, a give-back only when released
        if is_free:
            free += 1
            assert isinstance(event, JobReleased) or (isinstance(event, JobLeaseExpired) and event.requeued), (end, event)
            continue
        charged += 1
        ended = isinstance(event, JobFailed) or (isinstance(event, JobLeaseExpired) and not event.requeued)
        assert ended == (charged == max_attempts), (end, charged, max_attempts, event)
        assert charged <= max_attempts
        if not ended:
            continue
        if not grants:
            return
        # An operator's retry: exactly ``grant`` more runs, and as many free interruptions, from here.
        grant = grants.pop(0)
        retry = decide_retry(status="failed", attempt=attempt, max_attempts=budget, parent_job_id=None, children_total=0,
                             grant=grant, by="t", ends=UnchargedEnds(unheard=unheard, interrupted=interrupted,
                                                                     retried_at=retried_at, uncharged_before=uncharged_before))  # fmt: skip
        budget, retried_at, uncharged_before = retry.max_attempts, retry.attempt, retry.uncharged
        unheard = interrupted = 0
        max_attempts, charged, free = grant, 0, 0
