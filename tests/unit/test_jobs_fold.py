"""The queue fold: each event's effect on a job row, timestamps from recorded_at only."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import get_args
from uuid import uuid4

import msgspec
import pytest

from umbra.events.store import RecordedEvent
from umbra.events.types import (
    JobBlocked, JobCancelled, JobClaimed, JobCompleted, JobDecomposed, JobFailed, JobLeaseExpired, JobLeaseRenewed,
    JobEvent, JobReleased, JobReprioritized, JobRequeued, JobRetried, JobSettled, JobSubmitted, JobUnblocked, NodeDraining, Placement, Progress, Requirements,
)  # fmt: skip
from umbra.projections.jobs import COLUMNS, TRANSITION_COLUMNS, fold, to_json

JOB, ORG, NODE = uuid4(), uuid4(), uuid4()
T0 = datetime(2026, 5, 1, 12, 0, tzinfo=timezone.utc)
PLACEMENT = Placement(node_id=NODE, device_id="gpu0", device_kind="gpu_discrete", reason="placed:gpu_discrete")


class Log:
    """Folds events one by one as the store would record them, a second apart."""

    def __init__(self) -> None:
        self.row = None
        self.version = 0

    def at(self, version: int) -> datetime:
        return T0 + timedelta(seconds=version)

    def __call__(self, event):
        self.version += 1
        recorded = RecordedEvent(position=100 + self.version, stream=f"job:{JOB}", version=self.version,
                                 organization_id=ORG, event=event, metadata={}, recorded_at=self.at(self.version))  # fmt: skip
        self.row = fold(self.row, recorded)
        return self.row


def submitted(**overrides):
    fields = {"kind": "echo", "priority": 0, "max_attempts": 2, "requires": Requirements(vram_min_mb=5)}
    return JobSubmitted(**{**fields, **overrides})


def claimed(attempt: int, log: Log):
    return JobClaimed(attempt=attempt, node_id=NODE, placement=PLACEMENT, lease_expires_at=log.at(log.version) + timedelta(seconds=60))


def test_a_submitted_job_is_queued_in_submission_order_and_priority_zero_stays_zero():
    row = Log()(submitted())
    assert (row.id, row.organization_id, row.status, row.priority, row.attempt) == (JOB, ORG, "queued", 0, 0)
    assert (row.seq, row.position, row.version, row.created_at) == (101, 101, 1, T0 + timedelta(seconds=1))


def test_claim_renew_complete():
    log = Log()
    log(submitted())
    row = log(claimed(1, log))
    assert (row.status, row.attempt, row.lease_owner, row.placement, row.started_at) == ("running", 1, NODE, PLACEMENT, log.at(2))
    row = log(JobLeaseRenewed(attempt=1, lease_expires_at=log.at(99)))
    assert row.lease_expires_at == log.at(99)
    row = log(JobCompleted(attempt=1, result={"ok": True}))
    assert (row.status, row.result, row.lease_expires_at, row.finished_at, row.version) == ("complete", {"ok": True}, None, log.at(4), 4)


def test_progress_is_what_the_holder_last_said_and_a_new_run_starts_without_it():
    log = Log()
    log(submitted())
    assert log(claimed(1, log)).progress is None
    said = Progress(fraction=0.25, message="epoch 1 of 4")
    assert log(JobLeaseRenewed(attempt=1, lease_expires_at=log.at(90), progress=said)).progress == said
    assert log(JobLeaseRenewed(attempt=1, lease_expires_at=log.at(95))).progress == said  # said nothing: it stands
    log(JobRequeued(attempt=1, error="oom", not_before=log.at(50)))
    assert log(claimed(2, log)).progress is None
    later = Progress(message="loading")
    row = log(JobLeaseRenewed(attempt=2, lease_expires_at=log.at(99), progress=later))
    assert log(JobCompleted(attempt=2, result=1)).progress == later  # the finished run's last word is kept
    assert to_json(row)["progress"] == {"message": "loading"}


def test_requeue_release_and_expiry_return_the_job_to_the_queue_released():
    log = Log()
    log(submitted())
    log(claimed(1, log))
    row = log(JobRequeued(attempt=1, error="oom", not_before=log.at(50)))
    assert (row.status, row.error, row.not_before, row.lease_owner, row.placement) == ("queued", "oom", log.at(50), None, None)
    first_start = row.started_at
    log(claimed(2, log))
    row = log(JobReleased(attempt=2))
    assert (row.status, row.attempt, row.started_at) == ("queued", 2, first_start)  # the attempt is never given back
    log(claimed(3, log))
    row = log(JobLeaseExpired(attempt=3, node_id=NODE, requeued=False))
    assert (row.status, row.finished_at, row.lease_owner) == ("failed", log.at(7), None)
    assert row.error.startswith("lease expired")


def test_blocked_keeps_its_first_time_when_the_reason_changes_and_unblocks_to_queued():
    log = Log()
    log(submitted())
    row = log(JobBlocked(reason="no_eligible_device: a"))
    assert (row.status, row.blocked_reason, row.blocked_at) == ("blocked", "no_eligible_device: a", log.at(2))
    row = log(JobBlocked(reason="no_eligible_device: b"))
    assert (row.blocked_reason, row.blocked_at) == ("no_eligible_device: b", log.at(2))
    row = log(JobUnblocked())
    assert (row.status, row.blocked_reason, row.blocked_at) == ("queued", None, None)
    log(JobBlocked(reason="again"))
    row = log(JobFailed(attempt=0, error="again", reason="blocked_timeout"))
    assert (row.status, row.error) == ("failed", "again")


def test_a_job_waiting_for_its_dependencies_keeps_them_and_stops_waiting_however_the_wait_ends():
    """``depends_on`` is the submission's, for good; ``awaiting_dependencies`` is set by a ``job.blocked`` that
    waits on some of them and cleared by whatever ends the wait (released, failed, cancelled, retried), or by
    a block for the fleet's sake; a ``job.blocked`` of before (no ``waiting_on``) waits for nothing."""
    first, second = uuid4(), uuid4()
    for ending, status in ((JobUnblocked(reason="dependencies_complete"), "queued"),
                           (JobFailed(attempt=0, error="x", reason="dependency_failed"), "failed"),
                           (JobCancelled(by="ops"), "cancelled"), (JobBlocked(reason="no_eligible_device"), "blocked")):  # fmt: skip
        log = Log()
        row = log(submitted(depends_on=(first, second)))
        assert (row.depends_on, row.awaiting_dependencies) == ((first, second), False)
        row = log(JobBlocked(reason="waiting for 1 job it depends on to complete", waiting_on=(second,)))
        assert (row.status, row.awaiting_dependencies) == ("blocked", True)
        row = log(ending)
        assert (row.status, row.awaiting_dependencies, row.depends_on) == (status, False, (first, second))
    assert Log()(submitted()).depends_on is None
    old = msgspec.json.decode(b'{"type": "job.blocked", "reason": "no_eligible_device"}', type=JobBlocked)
    assert old.waiting_on == () and msgspec.json.encode(old) == b'{"type":"job.blocked","reason":"no_eligible_device"}'


def test_decomposition_makes_a_released_running_container_that_settles():
    log = Log()
    log(submitted())
    log(claimed(1, log))
    children = (uuid4(), uuid4())
    row = log(JobDecomposed(attempt=1, children=children))
    assert (row.status, row.lease_owner, row.lease_expires_at, row.children_total) == ("running", None, None, 2)
    row = log(JobSettled(outcome="partial", detail="1 of 2 children failed", children_total=2, children_failed=1))
    assert (row.status, row.error, row.finished_at) == ("partial", "1 of 2 children failed", log.at(4))
    assert row.result == {"detail": "1 of 2 children failed", "children_total": 2, "children_failed": 1}


def test_cancelling_a_running_job_keeps_the_holder_so_it_can_be_told():
    log = Log()
    log(submitted())
    log(claimed(1, log))
    row = log(JobCancelled(by="key:x"))
    assert (row.status, row.lease_owner, row.attempt, row.lease_expires_at) == ("cancelled", NODE, 1, None)


def test_a_retried_job_is_queued_again_released_with_its_new_budget_and_its_last_error():
    log = Log()
    log(submitted())
    log(claimed(1, log))
    log(JobFailed(attempt=1, error="driver crashed"))
    row = log(JobRetried(attempt=1, max_attempts=3, by="key:x"))
    assert (row.status, row.attempt, row.max_attempts, row.error) == ("queued", 1, 3, "driver crashed")
    assert (row.lease_owner, row.placement, row.finished_at, row.result, row.not_before) == (None, None, None, None, None)
    assert row.started_at == log.at(2)  # when it first ran
    row = log(JobBlocked(reason="no_eligible_device"))
    assert (row.status, row.blocked_at) == ("blocked", log.at(5))  # blocked from the retry on, not before


def test_a_stream_must_start_with_submission_and_hold_only_job_events():
    with pytest.raises(ValueError):
        Log()(JobCancelled())
    log = Log()
    log(submitted())
    with pytest.raises(ValueError):
        log(NodeDraining())


def test_the_job_object_has_every_api_field_with_rfc3339_utc_timestamps():
    log = Log()
    log(submitted(idempotency_key="k"))
    body = to_json(log(claimed(1, log)))
    assert {"id", "organization_id", "kind", "status", "priority", "requires", "payload", "project_id", "lang",
            "attempt", "max_attempts", "not_before", "parent_job_id", "idempotency_key", "lease_owner",
            "lease_expires_at", "result", "error", "placement", "created_at", "started_at", "finished_at"} <= set(body)  # fmt: skip
    assert body["created_at"] == "2026-05-01T12:00:01Z" and body["lease_expires_at"] == "2026-05-01T12:01:01Z"
    assert body["requires"]["vram_min_mb"] == 5 and body["requires"]["models"] == []
    assert body["placement"]["device_id"] == "gpu0" and body["priority"] == 0


def test_the_job_object_encodes_the_same_as_its_plain_json_with_utc_timestamps():
    """Responses encode :class:`JobOut` directly; :func:`to_json` is the same object as plain values."""
    import dataclasses

    import msgspec

    from umbra.projections.jobs import job_out

    log = Log()
    log(submitted(requires=Requirements(vram_min_mb=5, models=("m",), prefer_node=NODE), payload={"a": [1, "x"]}))
    row = log(claimed(1, log))
    # A row read on a connection in another time zone: the API still says UTC, with "Z".
    plus_two = timezone(timedelta(hours=2))
    row = dataclasses.replace(row, created_at=row.created_at.astimezone(plus_two),
                              lease_expires_at=row.lease_expires_at.replace(microsecond=250).astimezone(plus_two))  # fmt: skip
    plain = to_json(row)
    assert msgspec.json.decode(msgspec.json.encode(job_out(row))) == plain
    assert plain["created_at"] == "2026-05-01T12:00:01Z"
    assert plain["lease_expires_at"] == "2026-05-01T12:01:01.000250Z"
    assert plain["id"] == str(JOB) and plain["lease_owner"] == str(NODE)
    assert plain["requires"] == {"vram_min_mb": 5, "ram_min_mb": 0, "models": ["m"], "trust_domains": [],
                                 "accelerators": [], "max_runtime_s": None, "prefer_node": str(NODE)}  # fmt: skip
    assert plain["placement"]["node_id"] == str(NODE) and plain["payload"] == {"a": [1, "x"]}
    assert list(plain)[:3] == ["id", "organization_id", "kind"] and list(plain)[-3:] == ["position", "progress", "depends_on"]


AFTER_SUBMISSION = [
    JobClaimed(attempt=1, node_id=NODE, placement=PLACEMENT, lease_expires_at=T0 + timedelta(minutes=5)),
    JobLeaseRenewed(attempt=1, lease_expires_at=T0 + timedelta(minutes=9)),
    JobCompleted(attempt=1, result={"ok": True}),
    JobFailed(attempt=1, error="boom"),
    JobFailed(attempt=1, error="The job exceeded its max_runtime_s", reason="runtime_exceeded"),
    JobLeaseRenewed(attempt=1, lease_expires_at=T0 + timedelta(minutes=9), progress=Progress(fraction=0.5)),
    JobRequeued(attempt=1, error="flaky", not_before=T0 + timedelta(seconds=30)),
    JobLeaseExpired(attempt=1, node_id=NODE, requeued=True, not_before=T0 + timedelta(seconds=30)),
    JobLeaseExpired(attempt=1, node_id=NODE, requeued=False),
    JobReleased(attempt=1),
    JobBlocked(reason="no_eligible_device"),
    JobBlocked(reason="waiting for 1 job it depends on to complete", waiting_on=(uuid4(),)),
    JobUnblocked(),
    JobFailed(attempt=0, error="Job x, which this job depends on, ended failed.", reason="dependency_failed"),
    JobDecomposed(attempt=1, children=(uuid4(), uuid4())),
    JobSettled(outcome="partial", detail="1 of 2 failed", children_total=2, children_failed=1),
    JobCancelled(by="user:x", reason="not needed"),
    JobRetried(attempt=1, max_attempts=4, by="key:x"),
    JobReprioritized(priority=5, previous=100, by="key:x"),
]


def test_every_job_event_type_after_submission_is_checked():
    assert {type(e) for e in AFTER_SUBMISSION} == set(get_args(JobEvent)) - {JobSubmitted}


@pytest.mark.parametrize("event", AFTER_SUBMISSION, ids=lambda e: e.__struct_config__.tag)
def test_an_event_after_submission_changes_only_the_columns_a_transition_writes(event):
    """The group commit writes only ``TRANSITION_COLUMNS`` of an existing row: the fold must change nothing else."""
    log = Log()
    log(submitted(payload={"data": "x" * 100}, project_id=uuid4(), lang="en", parent_job_id=uuid4(),
                  idempotency_key="k", requested_by="user:x"))  # fmt: skip
    before = log(claimed(1, log)) if not isinstance(event, (JobBlocked, JobUnblocked)) else log.row
    after = log(event)
    moved = {c for c in COLUMNS if getattr(after, c) != getattr(before, c)}
    assert moved <= set(TRANSITION_COLUMNS) and {"version", "position", "updated_at"} <= moved
