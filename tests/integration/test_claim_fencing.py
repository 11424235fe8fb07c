"""Holding a job: fencing by attempt, renew, complete, fail with backoff, cancel, decomposition."""

from __future__ import annotations

from datetime import timedelta

import anyio
import psycopg
import pytest

from umbra.compute import claims, jobs
from umbra.compute.accounts import create_organization, create_project
from umbra.compute.claims import ChildRequest
from umbra.compute.sweeper import sweep_once
from umbra.errors import Conflict, InvalidRequest, NotFound
from umbra.events import store
from umbra.projections import jobs as queue
from umbra.settings import load_settings

from .queue_support import CPU64, add_node, set_clock, spec, submit

pytestmark = pytest.mark.anyio

SETTINGS = load_settings({})


async def claim(conn, org_id, node_id, lease_seconds=60):
    return await claims.claim(conn, node_id=node_id, organization_id=org_id, lease_seconds=lease_seconds)


async def stream(conn, job_id) -> list[store.RecordedEvent]:
    return await store.read_stream(conn, store.job_stream(job_id))


def child(kind="part", **fields) -> ChildRequest:
    import msgspec

    return msgspec.convert({"kind": kind, **fields}, ChildRequest)


async def refused(code: str, call) -> None:
    with pytest.raises(Conflict) as caught:
        await call
    assert caught.value.code == code


@pytest.fixture
async def two_nodes(conn, org):
    org_id, _ = org
    return org_id, await add_node(conn, org_id, "a", [CPU64]), await add_node(conn, org_id, "b", [CPU64])


def holder_calls(org_id, node, job_id, attempt, conn):
    common = {"organization_id": org_id, "node_id": node, "job_id": job_id, "attempt": attempt}
    return [
        claims.renew(conn, lease_seconds=60, **common),
        claims.complete(conn, result={"late": True}, **common),
        claims.fail(conn, error="late", retry=True, **common),
        claims.add_children(conn, children=[child()], **common),
    ]


async def test_a_stale_holder_is_refused_and_changes_nothing(conn, two_nodes):
    org_id, a, b = two_nodes
    job = await submit(conn, org_id)
    first = await claim(conn, org_id, a, lease_seconds=5)
    await set_clock(conn, 6)
    report = await sweep_once(conn, SETTINGS)
    assert report.leases_requeued == 1
    await set_clock(conn, 6 + SETTINGS.lease_expired_delay_seconds)
    second = await claim(conn, org_id, b)
    assert (second.job_id, second.attempt) == (job.id, 2)
    head, row = await store.head_position(conn), await queue.load(conn, job.id, org_id)
    for call in holder_calls(org_id, a, job.id, first.attempt, conn):  # the old holder, its old attempt
        await refused("job_not_claimed_by_this_node", call)
    for call in holder_calls(org_id, a, job.id, second.attempt, conn):  # the old holder guessing the new attempt
        await refused("job_not_claimed_by_this_node", call)
    for call in holder_calls(org_id, b, job.id, first.attempt, conn):  # the new holder naming a stale attempt
        await refused("job_not_claimed_by_this_node", call)
    assert await store.head_position(conn) == head and await queue.load(conn, job.id, org_id) == row
    done = await claims.complete(conn, organization_id=org_id, node_id=b, job_id=job.id, attempt=2, result={"ok": 1})
    assert (done.status, done.result) == ("complete", {"ok": 1})
    head = await store.head_position(conn)
    again = await claims.complete(conn, organization_id=org_id, node_id=b, job_id=job.id, attempt=2, result=None)
    assert again == done and await store.head_position(conn) == head  # a repeat: the first result stands
    for call in holder_calls(org_id, a, job.id, 2, conn):  # the finished job is still nobody else's
        await refused("job_not_claimed_by_this_node", call)


async def test_another_organizations_job_is_not_found(conn, two_nodes):
    org_id, a, _ = two_nodes
    other_id, _ = await create_organization(conn, "other")
    theirs = await submit(conn, other_id)
    with pytest.raises(NotFound):
        await claims.renew(conn, organization_id=org_id, node_id=a, job_id=theirs.id, attempt=1, lease_seconds=60)
    with pytest.raises(NotFound):
        await jobs.cancel(conn, org_id, theirs.id, actor="t")


async def test_renew_extends_the_lease_from_the_database_clock(conn, two_nodes):
    org_id, a, _ = two_nodes
    job = await submit(conn, org_id)
    got = await claim(conn, org_id, a, lease_seconds=10)
    await set_clock(conn, 8)
    renewed = await claims.renew(conn, organization_id=org_id, node_id=a, job_id=job.id, attempt=got.attempt, lease_seconds=10)
    last = (await stream(conn, job.id))[-1]
    assert last.type == "job.lease_renewed" and renewed.lease_expires_at == last.recorded_at + timedelta(seconds=10)
    await set_clock(conn, 15)  # past the first lease, inside the renewed one
    assert (await sweep_once(conn, SETTINGS)).leases_requeued == 0


async def test_retryable_failures_back_off_then_fail_when_attempts_are_spent(conn, two_nodes):
    org_id, a, _ = two_nodes
    job = await submit(conn, org_id, max_attempts=2)
    got = await claim(conn, org_id, a)
    requeued = await claims.fail(conn, organization_id=org_id, node_id=a, job_id=job.id, attempt=got.attempt, error="oom", retry=True)
    last = (await stream(conn, job.id))[-1]
    assert (requeued.status, requeued.error, last.type) == ("queued", "oom", "job.requeued")
    assert requeued.not_before == last.recorded_at + timedelta(seconds=5)
    await set_clock(conn, 5)
    got = await claim(conn, org_id, a)
    failed = await claims.fail(conn, organization_id=org_id, node_id=a, job_id=job.id, attempt=got.attempt, error="oom", retry=True)
    assert (failed.status, failed.attempt, failed.error) == ("failed", 2, "oom")
    assert (await stream(conn, job.id))[-1].event.reason == "attempts_exhausted"


async def test_a_non_retryable_failure_fails_at_once(conn, two_nodes):
    org_id, a, _ = two_nodes
    job = await submit(conn, org_id)
    got = await claim(conn, org_id, a)
    failed = await claims.fail(conn, organization_id=org_id, node_id=a, job_id=job.id, attempt=got.attempt, error="bad", retry=False)
    assert (failed.status, failed.attempt) == ("failed", 1)


async def test_cancel_queued_running_blocked_and_terminal(conn, two_nodes):
    org_id, a, _ = two_nodes
    queued = await submit(conn, org_id)
    assert (await jobs.cancel(conn, org_id, queued.id, actor="key:x")).status == "cancelled"
    blocked = await submit(conn, org_id, requires={"accelerators": ["cuda"]})
    assert blocked.status == "blocked"
    assert (await jobs.cancel(conn, org_id, blocked.id, actor="key:x")).status == "cancelled"
    running = await submit(conn, org_id)
    got = await claim(conn, org_id, a)
    assert (await jobs.cancel(conn, org_id, running.id, actor="key:x")).status == "cancelled"
    head = await store.head_position(conn)
    for call in holder_calls(org_id, a, running.id, got.attempt, conn):
        await refused("job_cancelled", call)
    await refused("job_terminal", jobs.cancel(conn, org_id, running.id, actor="key:x"))
    assert await store.head_position(conn) == head


async def test_children_inherit_and_the_parent_becomes_an_unclaimable_container(conn, two_nodes):
    org_id, a, b = two_nodes
    project = await create_project(conn, org_id, "book")
    parent = await submit(conn, org_id, priority=7, project_id=str(project), lang="fr")
    got = await claim(conn, org_id, a)
    kids = await claims.add_children(conn, organization_id=org_id, node_id=a, job_id=parent.id, attempt=got.attempt,
                                     children=[child(payload={"n": 1}), child(priority=0, payload={"n": 2})])  # fmt: skip
    assert [(k.parent_job_id, k.project_id, k.lang, k.priority, k.status) for k in kids] == [
        (parent.id, project, "fr", 7, "queued"), (parent.id, project, "fr", 0, "queued")]
    container = await queue.load(conn, parent.id, org_id)
    assert (container.status, container.lease_owner, container.lease_expires_at, container.children_total) == ("running", None, None, 2)
    claimed = {(await claim(conn, org_id, b)).job_id for _ in range(2)}
    assert claimed == {k.id for k in kids} and await claim(conn, org_id, b) is None
    await set_clock(conn, 3600)
    assert (await sweep_once(conn, SETTINGS)).leases_requeued == 2  # the children's leases; the container has none
    assert (await queue.load(conn, parent.id, org_id)).status == "running"


async def settle_children(conn, org_id, node, parent_id, outcomes):
    got = await claim(conn, org_id, node)
    assert got.job_id == parent_id
    kids = await claims.add_children(conn, organization_id=org_id, node_id=node, job_id=parent_id, attempt=got.attempt,
                                     children=[child(payload={"n": i}) for i in range(len(outcomes))])  # fmt: skip
    for outcome in outcomes:
        c = await claim(conn, org_id, node)
        common = {"organization_id": org_id, "node_id": node, "job_id": c.job_id, "attempt": c.attempt}
        if outcome == "complete":
            await claims.complete(conn, result={"n": c.job["payload"]["n"]}, **common)
        else:
            await claims.fail(conn, error="boom", retry=False, **common)
    return kids


async def test_the_parent_settles_complete_in_the_transaction_of_the_last_child(conn, two_nodes):
    org_id, a, _ = two_nodes
    parent = await submit(conn, org_id)
    kids = await settle_children(conn, org_id, a, parent.id, ["complete", "complete"])
    row = await queue.load(conn, parent.id, org_id)
    assert (row.status, row.error, row.result["detail"]) == ("complete", None, "all 2 children complete")
    settled = (await stream(conn, parent.id))[-1]
    last_child = max([(await stream(conn, k.id))[-1] for k in kids], key=lambda r: r.position)
    assert settled.type == "job.settled" and last_child.type == "job.completed"
    # recorded_at is the transaction's timestamp: the same value means the same transaction.
    assert settled.position == last_child.position + 1 and settled.recorded_at == last_child.recorded_at
    # Its metadata names the cause: the child whose end settled it, with that child's actor.
    assert settled.metadata["causation"] == last_child.stream and settled.metadata["actor"] == last_child.metadata["actor"]


async def test_a_failed_child_makes_the_parent_partial_with_a_count(conn, two_nodes):
    org_id, a, _ = two_nodes
    parent = await submit(conn, org_id)
    await settle_children(conn, org_id, a, parent.id, ["complete", "failed", "complete"])
    row = await queue.load(conn, parent.id, org_id)
    assert (row.status, row.error) == ("partial", "1 of 3 children failed")


async def test_a_blocked_child_fails_on_its_timeout_so_the_parent_settles(conn, two_nodes):
    org_id, a, _ = two_nodes
    parent = await submit(conn, org_id)
    got = await claim(conn, org_id, a)
    done, stuck = await claims.add_children(conn, organization_id=org_id, node_id=a, job_id=parent.id, attempt=got.attempt,
                                            children=[child(), child(requires={"accelerators": ["cuda"]})])  # fmt: skip
    assert (done.status, stuck.status) == ("queued", "blocked")
    c = await claim(conn, org_id, a)
    await claims.complete(conn, organization_id=org_id, node_id=a, job_id=c.job_id, attempt=c.attempt, result=None)
    assert (await queue.load(conn, parent.id, org_id)).status == "running"  # held open by the blocked child
    await set_clock(conn, SETTINGS.blocked_timeout_seconds + 1)
    report = await sweep_once(conn, SETTINGS)
    assert report.blocked_failed == 1
    stuck = await queue.load(conn, stuck.id, org_id)
    assert (stuck.status, stuck.error) == ("failed", "no_eligible_device: needs accelerator cuda, which no eligible device supports")
    assert (await stream(conn, stuck.id))[-1].event.reason == "blocked_timeout"
    assert (await queue.load(conn, parent.id, org_id)).status == "partial"


async def test_cancelling_a_container_cancels_its_open_children(conn, two_nodes):
    org_id, a, b = two_nodes
    parent = await submit(conn, org_id)
    got = await claim(conn, org_id, a)
    kids = await claims.add_children(conn, organization_id=org_id, node_id=a, job_id=parent.id, attempt=got.attempt,
                                     children=[child(), child(), child()])  # fmt: skip
    running = await claim(conn, org_id, b)
    finished = await claim(conn, org_id, b)
    await claims.complete(conn, organization_id=org_id, node_id=b, job_id=finished.job_id, attempt=1, result=None)
    cancelled = await jobs.cancel(conn, org_id, parent.id, actor="key:x")
    assert cancelled.status == "cancelled"
    statuses = {k.id: (await queue.load(conn, k.id, org_id)).status for k in kids}
    assert sorted(statuses.values()) == ["cancelled", "cancelled", "complete"]
    await refused("job_cancelled", claims.renew(conn, organization_id=org_id, node_id=b, job_id=running.job_id,
                                                attempt=1, lease_seconds=60))  # fmt: skip


async def test_children_refusals_write_nothing(conn, two_nodes):
    org_id, a, b = two_nodes
    await submit(conn, org_id, idempotency_key="taken")
    parent = await submit(conn, org_id, priority=0)
    got = await claim(conn, org_id, a)
    assert got.job_id == parent.id
    head = await store.head_position(conn)
    with pytest.raises(InvalidRequest) as caught:
        await claims.add_children(conn, organization_id=org_id, node_id=a, job_id=parent.id, attempt=got.attempt,
                                  children=[child(), child(idempotency_key="taken")])  # fmt: skip
    assert caught.value.extra["index"] == 1
    with pytest.raises(InvalidRequest):
        await claims.add_children(conn, organization_id=org_id, node_id=a, job_id=parent.id, attempt=got.attempt, children=[])
    await refused("job_not_claimed_by_this_node", claims.add_children(
        conn, organization_id=org_id, node_id=b, job_id=parent.id, attempt=got.attempt, children=[child()]))
    assert await store.head_position(conn) == head


async def test_children_completing_concurrently_settle_the_parent_exactly_once(db_url, conn, two_nodes):
    import anyio
    import psycopg

    org_id, a, b = two_nodes
    parent = await submit(conn, org_id)
    got = await claim(conn, org_id, a)
    await claims.add_children(conn, organization_id=org_id, node_id=a, job_id=parent.id, attempt=got.attempt,
                              children=[child(payload={"n": i}) for i in range(8)])  # fmt: skip
    held = [await claim(conn, org_id, b) for _ in range(8)]

    async def finish(c_claim):
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
            await claims.complete(c, organization_id=org_id, node_id=b, job_id=c_claim.job_id, attempt=1, result=None)

    async with anyio.create_task_group() as tg:
        for h in held:
            tg.start_soon(finish, h)
    assert [r.type for r in await stream(conn, parent.id)].count("job.settled") == 1
    assert (await queue.load(conn, parent.id, org_id)).status == "complete"


async def test_a_childs_idempotency_key_taken_by_a_submission_committing_meanwhile_is_refused(db_url, conn, two_nodes):
    """The submission holds the key until it commits; the decomposition then finds it taken: 422, not a crash."""
    org_id, a, _ = two_nodes
    parent = await submit(conn, org_id)
    got = await claim(conn, org_id, a)
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as other:
        async with anyio.create_task_group() as tg:
            async with other.transaction():
                [racer], _ = await jobs.submit(other, org_id, [spec(idempotency_key="K")], actor="t", batch=False)
                outcome: list[BaseException] = []

                async def decompose() -> None:
                    try:
                        await claims.add_children(conn, organization_id=org_id, node_id=a, job_id=parent.id,
                                                  attempt=got.attempt, children=[child(idempotency_key="K")])  # fmt: skip
                    except Exception as exc:
                        outcome.append(exc)

                tg.start_soon(decompose)
                await anyio.sleep(0.3)  # the decomposition is under way while the submission is uncommitted
    [refused] = outcome
    assert isinstance(refused, InvalidRequest) and "already used in this organization" in refused.message
    assert str(racer.id) not in refused.message  # a node may not read the job that holds the key
    assert (await queue.load(conn, parent.id, org_id)).status == "running"
    assert [e.type for e in await store.read_stream(conn, store.job_stream(parent.id))] == ["job.submitted", "job.claimed"]
