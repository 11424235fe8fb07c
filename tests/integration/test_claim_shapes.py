"""Claiming by requirement shape: the claim reads only the heads of shapes the node can run.

Whatever path the scan takes (the shape skip scan, or the ordered walk when an
organization has more than ``MAX_SHAPES`` shapes), a node gets the first
eligible, due job in (priority, seq) order, and the group commit takes what the
same claims one after another would have taken.
"""

from __future__ import annotations

import random

import anyio

import msgspec
import pytest

from umbra.compute import blocked, claims, jobs
from umbra.domain.placement import best_placement
from umbra.events.types import Requirements

from .queue_support import CPU8, CPU64, GPU24, add_node, set_clock, spec, submit
from .test_group_commit import group_commit, in_one_batch

pytestmark = pytest.mark.anyio

_decode = msgspec.json.Decoder(Requirements).decode

#: Shapes a CPU8 node can run (the first three) and cannot (the rest); GPU24 runs the GPU ones.
SHAPES = [
    {},
    {"ram_min_mb": 4000},
    {"max_runtime_s": 60},
    {"accelerators": ["cuda"]},
    {"vram_min_mb": 8000, "accelerators": ["cuda"]},
    {"ram_min_mb": 50000},
]


async def claim(conn, org_id, node_id):
    return await claims.claim(conn, node_id=node_id, organization_id=org_id, lease_seconds=600)


async def fill(conn, org_id, count: int, seed: int) -> None:
    """A queue of mixed shapes and priorities, interleaved."""
    rng = random.Random(seed)
    specs = [spec(payload={"i": i}, priority=rng.choice([1, 2, 3]), requires=rng.choice(SHAPES)) for i in range(count)]
    await jobs.submit(conn, org_id, specs, actor="t", batch=True)


async def expected_order(conn, org_id, node_id) -> list:
    """Every queued, due job the node can run, in claim order: judged row by row, in Python."""
    [node] = await blocked.read_nodes(conn, org_id, node_id=node_id)
    models = await blocked.read_models(conn, org_id)
    rows = await (await conn.execute(
        "SELECT id, requires::text FROM jobs WHERE organization_id = %s AND status = 'queued'"
        " AND (not_before IS NULL OR not_before <= umbra_now()) ORDER BY priority, seq", (org_id,),
    )).fetchall()  # fmt: skip
    return [job_id for job_id, requires in rows if best_placement(node, _decode(requires), models) is not None]


async def scanned(conn, org_id, node_id, per_shape: int) -> list:
    """Every row the claim's scan yields for the node, page after page, without locking any."""
    [node] = await blocked.read_nodes(conn, org_id, node_id=node_id)
    models = await blocked.read_models(conn, org_id)
    shapes = [shape for (shape,) in await (await claims.queued_shapes(conn, org_id)).fetchall()]
    scan = claims.ClaimableScan(conn, org_id, shapes, lambda s: best_placement(node, _decode(s), models) is not None,
                                per_shape=per_shape)  # fmt: skip
    return [row[0] async for page in scan.pages() for row in page]


@pytest.mark.parametrize("max_shapes", [claims.MAX_SHAPES, 2], ids=["by-shape", "ordered-fallback"])
async def test_the_scan_yields_every_eligible_due_job_in_claim_order(conn, org, monkeypatch, max_shapes):
    org_id, _ = org
    monkeypatch.setattr(claims, "MAX_SHAPES", max_shapes)
    cpu = await add_node(conn, org_id, "cpu", [CPU8])
    gpu = await add_node(conn, org_id, "gpu", [GPU24])
    await fill(conn, org_id, 400, seed=1)
    for node in (cpu, gpu):
        want = await expected_order(conn, org_id, node)
        got = await scanned(conn, org_id, node, per_shape=3)
        # Pages of at least per_shape rows, at most MAX_SCAN_PAGES of them: a prefix of the whole order.
        assert got == want or (len(got) >= 3 * claims.MAX_SCAN_PAGES and got == want[: len(got)])


@pytest.mark.parametrize("max_shapes", [claims.MAX_SHAPES, 2], ids=["by-shape", "ordered-fallback"])
async def test_a_mixed_queue_is_claimed_in_priority_and_submission_order_across_shapes(conn, org, monkeypatch, max_shapes):
    org_id, _ = org
    monkeypatch.setattr(claims, "MAX_SHAPES", max_shapes)
    cpu = await add_node(conn, org_id, "cpu", [CPU8])
    await add_node(conn, org_id, "gpu", [GPU24])
    await fill(conn, org_id, 120, seed=2)
    want = await expected_order(conn, org_id, cpu)
    got = []
    while (result := await claim(conn, org_id, cpu)) is not None:
        got.append(result.job_id)
    assert got == want and len(got) > 30


async def test_a_delayed_job_at_the_head_of_a_shape_does_not_hide_the_rest(conn, org):
    org_id, _ = org
    cpu = await add_node(conn, org_id, "cpu", [CPU64])
    await add_node(conn, org_id, "gpu", [GPU24])
    await submit(conn, org_id, priority=0, requires={"accelerators": ["cuda"]})  # ahead of everything, not for this node
    head = await submit(conn, org_id, priority=1, requires={"ram_min_mb": 1000})
    got = await claim(conn, org_id, cpu)
    assert got.job_id == head.id
    await claims.fail(conn, organization_id=org_id, node_id=cpu, job_id=head.id, attempt=1, error="flaky", retry=True)
    behind = await submit(conn, org_id, priority=5, requires={"ram_min_mb": 1000})  # same shape, after the delayed head
    other = await submit(conn, org_id, priority=3)  # another shape, between the two
    assert (await claim(conn, org_id, cpu)).job_id == other.id
    assert (await claim(conn, org_id, cpu)).job_id == behind.id
    assert await claim(conn, org_id, cpu) is None
    await set_clock(conn, 6)  # the retry backoff after attempt 1 is 5 s
    again = await claim(conn, org_id, cpu)
    assert (again.job_id, again.attempt) == (head.id, 2)


async def test_more_shapes_than_the_cap_fall_back_to_the_ordered_scan(conn, org):
    org_id, _ = org
    cpu = await add_node(conn, org_id, "cpu", [CPU64])
    await add_node(conn, org_id, "gpu", [GPU24])
    count = claims.MAX_SHAPES + 10
    gpu_work = [spec(priority=1, requires={"accelerators": ["cuda"], "vram_min_mb": i}) for i in range(count)]
    cpu_work = [spec(priority=2 + i % 2, payload={"i": i}, requires={"ram_min_mb": i}) for i in range(count)]
    await jobs.submit(conn, org_id, [*gpu_work, *cpu_work], actor="t", batch=True)
    shapes = await (await claims.queued_shapes(conn, org_id)).fetchall()
    assert len(shapes) == claims.MAX_SHAPES + 1  # the list stops one past the cap
    want = await expected_order(conn, org_id, cpu)
    got = [(await claim(conn, org_id, cpu)).job_id for _ in range(len(want))]
    assert got == want and len(got) == count
    assert await claim(conn, org_id, cpu) is None


@pytest.mark.parametrize("max_shapes", [claims.MAX_SHAPES, 2], ids=["by-shape", "ordered-fallback"])
async def test_the_group_commit_takes_what_the_same_claims_one_by_one_would(db_url, conn, org, monkeypatch, max_shapes):
    org_id, _ = org
    monkeypatch.setattr(claims, "MAX_SHAPES", max_shapes)
    nodes = [await add_node(conn, org_id, f"n{i}", [CPU8 if i % 3 else GPU24]) for i in range(9)]
    await fill(conn, org_id, 60, seed=3)
    # The same claims one after another, rolled back.
    alone = []
    async with conn.transaction(force_rollback=True):
        for node in nodes:
            result = await claim(conn, org_id, node)
            alone.append(result and result.job_id)
    async with group_commit(db_url) as (group, _, tg):
        calls = [lambda n=n: group.claim(node_id=n, organization_id=org_id, lease_seconds=60, stale_seconds=45)
                 for n in nodes]  # fmt: skip
        results = await in_one_batch(group, tg, calls)
    assert group.batches == 1 and group.fallbacks == 0
    assert [r and r.job_id for r in results] == alone
    assert all(alone)


async def test_a_claimer_of_one_shape_skips_rows_other_claimers_hold_and_keeps_claim_order(db_url, conn, org):
    """The one-statement path (the node can run exactly one queued shape): locked rows are passed over, not waited on."""
    import psycopg

    org_id, _ = org
    cpu = await add_node(conn, org_id, "cpu", [CPU64])
    await submit(conn, org_id, priority=0, requires={"accelerators": ["cuda"]})  # another shape, first in line
    first, second, third = [await submit(conn, org_id, priority=p, requires={"ram_min_mb": 1000}) for p in (2, 1, 3)]
    shapes = [shape for (shape,) in await (await claims.queued_shapes(conn, org_id)).fetchall()]
    [node] = await blocked.read_nodes(conn, org_id, node_id=cpu)
    only = claims.ClaimableScan(conn, org_id, shapes, lambda s: best_placement(node, _decode(s), {}) is not None).only_shape()
    assert _decode(only) == _decode('{"ram_min_mb": 1000}')
    async with await psycopg.AsyncConnection.connect(db_url) as holder:  # another claimer, mid-transaction
        await holder.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (second.id,))
        with anyio.fail_after(10):
            assert (await claim(conn, org_id, cpu)).job_id == first.id
            async with group_commit(db_url) as (group, _, tg):
                [got] = await in_one_batch(group, tg, [
                    lambda: group.claim(node_id=cpu, organization_id=org_id, lease_seconds=60, stale_seconds=45)])  # fmt: skip
            assert got.job_id == third.id
        await holder.rollback()
    assert (await claim(conn, org_id, cpu)).job_id == second.id
    assert await claim(conn, org_id, cpu) is None
