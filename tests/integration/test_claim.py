"""Claiming: one holder per job, only eligible work of the node's own organization, in order."""

from __future__ import annotations

from datetime import timedelta

import anyio
import psycopg
import pytest

from umbra.compute import claims, jobs
from umbra.compute.accounts import create_organization
from umbra.compute.nodes import drain_node, retire_node
from umbra.events import store
from umbra.events.types import Device
from umbra.projections import jobs as queue

from .queue_support import CPU8, CPU64, GPU24, add_node, set_clock, spec, submit

pytestmark = pytest.mark.anyio


async def claim(conn, org_id, node_id, lease_seconds=60):
    return await claims.claim(conn, node_id=node_id, organization_id=org_id, lease_seconds=lease_seconds)


async def test_two_claimers_never_share_a_job(db_url, conn, org):
    org_id, _ = org
    nodes = [await add_node(conn, org_id, f"n{i}", [GPU24, CPU64]) for i in range(4)]
    await jobs.submit(conn, org_id, [spec(payload={"i": i}) for i in range(1000)], actor="t", batch=True)
    taken: list[tuple[str, int]] = []

    async def claimer(node_id):
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
            while (got := await claim(c, org_id, node_id)) is not None:
                taken.append((got.job["id"], got.attempt))

    async with anyio.create_task_group() as tg:
        for i in range(16):
            tg.start_soon(claimer, nodes[i % 4])
    assert len(taken) == 1000 and len({job_id for job_id, _ in taken}) == 1000
    assert {attempt for _, attempt in taken} == {1}
    counts = await (await conn.execute(
        "SELECT count(*) FILTER (WHERE type = 'job.claimed'), count(DISTINCT stream) FILTER (WHERE type = 'job.claimed') FROM events"
    )).fetchone()
    assert tuple(counts) == (1000, 1000)
    assert (await (await conn.execute("SELECT count(*) FROM jobs WHERE status = 'running'")).fetchone())[0] == 1000


async def test_a_node_is_never_offered_another_organizations_job(conn, org):
    org_id, _ = org
    other_id, _ = await create_organization(conn, "other")
    mine = await add_node(conn, org_id, "mine", [GPU24])
    await add_node(conn, other_id, "theirs", [GPU24])
    await submit(conn, other_id, priority=0)
    assert await claim(conn, org_id, mine) is None
    own = await submit(conn, org_id, priority=500)
    assert (await claim(conn, org_id, mine)).job_id == own.id
    # Naming the other organization does not help: the node is not in it.
    await submit(conn, other_id)
    assert await claim(conn, other_id, mine) is None


async def test_a_node_only_takes_jobs_it_is_eligible_for(conn, org):
    org_id, _ = org
    cpu_node = await add_node(conn, org_id, "cpu-box", [CPU8])
    gpu_node = await add_node(conn, org_id, "gpu-box", [GPU24])
    gpu_job = await submit(conn, org_id, priority=1, requires={"accelerators": ["cuda"]})
    too_big = await submit(conn, org_id, priority=2, requires={"ram_min_mb": 7000})
    cpu_job = await submit(conn, org_id, priority=3, requires={"ram_min_mb": 4000})
    got = await claim(conn, org_id, cpu_node)
    assert got.job_id == cpu_job.id and got.placement["reason"] == "placed:cpu"
    assert await claim(conn, org_id, cpu_node) is None
    assert (await claim(conn, org_id, gpu_node)).job_id == gpu_job.id
    assert (await queue.load(conn, too_big.id, org_id)).status == "queued"  # CPU8 has 6000 MB free, 8192 total


async def test_the_claim_records_the_placement_and_the_slow_path(conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "mac", [Device(kind="gpu_integrated", label="m4", vram_total_mb=4096,
                                                        vram_free_mb=2000, ram_total_mb=32768, ram_free_mb=30000)])  # fmt: skip
    job = await submit(conn, org_id, requires={"vram_min_mb": 12000})
    got = await claim(conn, org_id, node)
    assert got.placement == {"node_id": str(node), "device_id": "m4", "device_kind": "gpu_integrated",
                             "reason": "placed:slow_path:ram_not_vram", "via": "ram", "resident": False,
                             "would_evict": [], "score": 1.0, "estimated_seconds": None}  # fmt: skip
    events = await store.read_stream(conn, store.job_stream(job.id))
    claimed = events[-1]
    assert claimed.type == "job.claimed" and claimed.event.placement.reason == "placed:slow_path:ram_not_vram"
    assert claimed.event.attempt == 1 and claimed.event.node_id == node
    row = await queue.load(conn, job.id, org_id)
    assert row.lease_expires_at == claimed.recorded_at + (row.lease_expires_at - claimed.recorded_at)
    assert (row.lease_expires_at - claimed.recorded_at).total_seconds() == 60
    assert got.job["status"] == "running" and got.lease_expires_at.endswith("Z")


@pytest.mark.parametrize("state", ["provisioning", "offline", "draining", "retired"])
async def test_a_node_that_is_not_online_gets_nothing(conn, org, state):
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [GPU24], online=state != "provisioning")
    await add_node(conn, org_id, "keeper", [GPU24])  # so the job is not blocked when n is draining or retired
    if state == "offline":
        await set_clock(conn, 46)
    elif state == "draining":
        await drain_node(conn, org_id, node)
    elif state == "retired":
        await retire_node(conn, org_id, node)
    await submit(conn, org_id)
    assert await claim(conn, org_id, node) is None


async def test_priority_then_submission_order(conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    late_urgent = [await submit(conn, org_id, priority=p, payload={"n": n}) for n, p in enumerate([100, 5, 100, 0, 5])]
    order = [(await claim(conn, org_id, node)).job["payload"]["n"] for _ in late_urgent]
    assert order == [3, 1, 4, 0, 2]


async def test_a_deep_queue_of_work_the_node_cannot_run_does_not_hide_work_it_can(conn, org):
    org_id, _ = org
    await add_node(conn, org_id, "gpu", [GPU24])
    cpu = await add_node(conn, org_id, "cpu", [CPU8])
    shapes = [spec(priority=1, requires={"accelerators": ["cuda"], "vram_min_mb": i % 3}) for i in range(3000)]
    await jobs.submit(conn, org_id, shapes, actor="t", batch=True)
    reachable = await submit(conn, org_id, priority=2)
    assert (await claim(conn, org_id, cpu)).job_id == reachable.id


async def test_a_delayed_job_is_not_claimable_before_its_not_before(conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    job = await submit(conn, org_id)
    got = await claim(conn, org_id, node)
    requeued = await claims.fail(conn, organization_id=org_id, node_id=node, job_id=job.id, attempt=got.attempt,
                                 error="flaky", retry=True)  # fmt: skip
    assert requeued.status == "queued"
    assert await claim(conn, org_id, node) is None
    await set_clock(conn, 4)
    assert await claim(conn, org_id, node) is None
    await set_clock(conn, 6)  # backoff after attempt 1 is 5 s
    assert (await claim(conn, org_id, node)).attempt == 2


async def test_a_released_claim_is_not_charged_against_max_attempts(conn, org):
    """A claim given back unheard never ran: a dropped long-poll does not cost the job a retry."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    job = await submit(conn, org_id, max_attempts=2)
    for _ in range(2):  # two claims released: the attempt (fencing token) grows, the runs do not
        assert await claims.release(conn, job.id, node, (await claim(conn, org_id, node)).attempt)

    async def run_and_fail(expected_attempt: int):
        got = await claim(conn, org_id, node)
        assert got.attempt == expected_attempt
        return await claims.fail(conn, organization_id=org_id, node_id=node, job_id=job.id, attempt=got.attempt,
                                 error="flaky", retry=True)  # fmt: skip

    requeued = await run_and_fail(3)  # the first run
    assert requeued.status == "queued"

    [*_, event] = await store.read_stream(conn, store.job_stream(job.id))
    assert event.type == "job.requeued" and event.event.not_before == event.recorded_at + timedelta(seconds=20)
    await set_clock(conn, 21)  # the backoff after attempt 3
    failed = await run_and_fail(4)  # the second run: the last of two
    assert failed.status == "failed"
    [*_, event] = await store.read_stream(conn, store.job_stream(job.id))
    assert (event.type, event.event.reason) == ("job.failed", "attempts_exhausted")
    from umbra.compute.explain import explain

    said = (await explain(conn, org_id, job.id)).summary
    assert said.startswith("Failed after attempt 4 (run 2 of 2; 2 earlier claims not charged)"), said


async def test_release_returns_a_claim_to_the_queue_and_keeps_the_attempt_counted(conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    job = await submit(conn, org_id)
    got = await claim(conn, org_id, node)
    assert await claims.release(conn, job.id, node, got.attempt - 1) is False  # a stale token releases nothing
    assert await claims.release(conn, job.id, node, got.attempt) is True
    row = await queue.load(conn, job.id, org_id)
    assert (row.status, row.attempt, row.lease_owner) == ("queued", 1, None)
    assert await claims.release(conn, job.id, node, got.attempt) is False
    assert (await claim(conn, org_id, node)).attempt == 2
