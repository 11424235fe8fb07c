"""A holder's report sent again (it did not hear the answer) is recognised only where it truly is one.

The rule of each report in :mod:`umbra.domain.jobs`: the same node, for the same attempt (the
fencing token), and the job still as that report left it.
"""

from __future__ import annotations

from uuid import uuid4

from umbra.domain.jobs import (
    decomposition_repeat_needs_log,
    failure_repeat_needs_log,
    repeats_decomposition,
    repeats_failure,
)

NODE, OTHER = uuid4(), uuid4()


def failure(*, status, lease_owner=None, attempt=2, node_id=NODE, claimed_attempt=2, requeued_by=None) -> bool:
    return repeats_failure(status=status, lease_owner=lease_owner, attempt=attempt, node_id=node_id,
                           claimed_attempt=claimed_attempt, requeued_by=requeued_by)  # fmt: skip


def test_a_failure_that_failed_the_job_is_told_by_the_row_alone():
    """``job.failed`` keeps the holder on the row: the failing node at the failed attempt is a repeat."""
    assert failure(status="failed", lease_owner=NODE)
    assert not failure(status="failed", lease_owner=NODE, node_id=OTHER)  # another node
    assert not failure(status="failed", lease_owner=NODE, claimed_attempt=1)  # another attempt
    # An expired lease that failed the job (or a blocked job that timed out) leaves no holder:
    # the node was not the one that failed it.
    assert not failure(status="failed", lease_owner=None)
    assert not failure(status="failed", lease_owner=None, requeued_by=NODE)
    assert not failure_repeat_needs_log(status="failed", attempt=2, claimed_attempt=2)


def test_a_failure_that_requeued_the_job_needs_the_log_to_say_who_failed_it():
    """``job.requeued`` clears the holder: the row cannot tell the node's own failure from an
    expired lease or a release at that attempt; the log says whose claim ended in ``job.requeued``."""
    for status in ("queued", "blocked"):  # blocked since: a second look found nothing could run it now
        assert failure_repeat_needs_log(status=status, attempt=2, claimed_attempt=2)
        assert failure(status=status, requeued_by=NODE)
        assert not failure(status=status, requeued_by=None)  # the attempt ended otherwise (lease expired, released)
        assert not failure(status=status, requeued_by=OTHER)  # another node failed that attempt
        assert not failure(status=status, requeued_by=NODE, claimed_attempt=1)  # claimed again since
        assert not failure_repeat_needs_log(status=status, attempt=2, claimed_attempt=1)


def test_a_failure_is_no_repeat_of_a_running_cancelled_or_completed_job():
    for status in ("running", "cancelled", "complete", "partial"):
        assert not failure_repeat_needs_log(status=status, attempt=2, claimed_attempt=2)
        assert not failure(status=status, lease_owner=NODE, requeued_by=NODE)


def decomposition(*, status="running", attempt=2, children_total=3, node_id=NODE, claimed_attempt=2, decomposed_by=NODE):
    return repeats_decomposition(status=status, attempt=attempt, children_total=children_total, node_id=node_id,
                                 claimed_attempt=claimed_attempt, decomposed_by=decomposed_by)  # fmt: skip


def test_a_decomposition_sent_again_by_the_node_that_split_the_job_at_that_attempt():
    """The container keeps the attempt that split it (it is never claimed again), with its children
    open or settled; the log says which node's claim split it."""
    for status in ("running", "complete", "partial"):
        assert decomposition_repeat_needs_log(status=status, attempt=2, children_total=3, claimed_attempt=2)
        assert decomposition(status=status)
    assert not decomposition(decomposed_by=OTHER)  # another node split it
    assert not decomposition(decomposed_by=None)
    assert not decomposition(node_id=OTHER)
    assert not decomposition(claimed_attempt=1)
    assert not decomposition_repeat_needs_log(status="running", attempt=2, children_total=3, claimed_attempt=1)


def test_a_decomposition_is_no_repeat_of_a_job_never_split_or_cancelled():
    assert not decomposition(children_total=0)  # running and held: not split (yet)
    assert not decomposition_repeat_needs_log(status="running", attempt=2, children_total=0, claimed_attempt=2)
    for status in ("cancelled", "failed", "queued"):
        assert not decomposition(status=status)
        assert not decomposition_repeat_needs_log(status=status, attempt=2, children_total=3, claimed_attempt=2)
