"""Claiming by requirement shape: the claim reads only the heads of shapes the node can run.

Whatever path the scan takes (the shape skip scan; the shapes listed again
when an organization has more than ``MAX_SHAPES``; the ordered walk past
``MANY_SHAPES``), a node gets the first eligible, due job in (priority, seq)
order, and the group commit takes what the same claims one after another would
have taken.
"""

from __future__ import annotations

import random
from uuid import uuid4

import anyio

import msgspec
import psycopg
import pytest

from umbra.compute import batch_commands, blocked, claims, jobs, statistics
from umbra.db import PreparedStatement
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
    scan = claims.ClaimableScan(conn, org_id, shapes, lambda s: best_placement(node, claims.decode_shape(s)[1], models) is not None,
                                per_shape=per_shape)  # fmt: skip
    return [row[0] async for page in scan.pages() for row in page]


@pytest.mark.parametrize("max_shapes", [(claims.MAX_SHAPES, claims.MANY_SHAPES), (2, claims.MANY_SHAPES), (2, 2)],
                         ids=["by-shape", "listed-again", "ordered-fallback"])
async def test_the_scan_yields_every_eligible_due_job_in_claim_order(conn, org, monkeypatch, max_shapes):
    org_id, _ = org
    monkeypatch.setattr(claims, "MAX_SHAPES", max_shapes[0])
    monkeypatch.setattr(claims, "MANY_SHAPES", max_shapes[1])
    cpu = await add_node(conn, org_id, "cpu", [CPU8])
    gpu = await add_node(conn, org_id, "gpu", [GPU24])
    await fill(conn, org_id, 400, seed=1)
    for node in (cpu, gpu):
        want = await expected_order(conn, org_id, node)
        got = await scanned(conn, org_id, node, per_shape=3)
        # Pages of at least per_shape rows, at most MAX_SCAN_PAGES of them: a prefix of the whole order.
        assert got == want or (len(got) >= 3 * claims.MAX_SCAN_PAGES and got == want[: len(got)])


@pytest.mark.parametrize("max_shapes", [(claims.MAX_SHAPES, claims.MANY_SHAPES), (2, claims.MANY_SHAPES), (2, 2)],
                         ids=["by-shape", "listed-again", "ordered-fallback"])
async def test_a_mixed_queue_is_claimed_in_priority_and_submission_order_across_shapes(conn, org, monkeypatch, max_shapes):
    org_id, _ = org
    monkeypatch.setattr(claims, "MAX_SHAPES", max_shapes[0])
    monkeypatch.setattr(claims, "MANY_SHAPES", max_shapes[1])
    cpu = await add_node(conn, org_id, "cpu", [CPU8])
    await add_node(conn, org_id, "gpu", [GPU24])
    await fill(conn, org_id, 120, seed=2)
    want = await expected_order(conn, org_id, cpu)
    got = []
    while (result := await claim(conn, org_id, cpu)) is not None:
        got.append(result.job_id)
        # Done before the next claim: a running job takes memory the report does not show yet.
        await claims.complete(conn, organization_id=org_id, node_id=cpu, job_id=result.job_id, attempt=result.attempt, result={})
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


@pytest.mark.parametrize("many_shapes", [claims.MANY_SHAPES, claims.MAX_SHAPES + 1], ids=["listed-again", "ordered-fallback"])
async def test_more_shapes_than_the_first_read_lists_are_claimed_in_order(conn, org, monkeypatch, many_shapes):
    monkeypatch.setattr(claims, "MANY_SHAPES", many_shapes)
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


@pytest.mark.parametrize("max_shapes", [(claims.MAX_SHAPES, claims.MANY_SHAPES), (2, claims.MANY_SHAPES), (2, 2)],
                         ids=["by-shape", "listed-again", "ordered-fallback"])
async def test_the_group_commit_takes_what_the_same_claims_one_by_one_would(db_url, conn, org, monkeypatch, max_shapes):
    org_id, _ = org
    monkeypatch.setattr(claims, "MAX_SHAPES", max_shapes[0])
    monkeypatch.setattr(claims, "MANY_SHAPES", max_shapes[1])
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
    only = claims.ClaimableScan(conn, org_id, shapes, lambda s: best_placement(node, claims.decode_shape(s)[1], {}) is not None).only_shape()
    assert claims.decode_shape(only) == ("echo", _decode('{"ram_min_mb": 1000}'))
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




async def pages_touched(conn, statement: PreparedStatement, params: dict) -> int:
    """Buffer accesses of one run of a prepared statement by its cached plan (functions' reads included)."""
    cursor = psycopg.AsyncClientCursor(conn)
    await cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {statement.execute}", params)
    [[[plan]]] = await cursor.fetchall()
    return plan["Plan"]["Shared Hit Blocks"] + plan["Plan"]["Shared Read Blocks"]


async def jobs_pages_read(conn) -> int:
    """Pages of ``jobs`` and its indexes this database has read so far (this session's reads flushed first)."""
    await conn.execute("SELECT pg_stat_force_next_flush()")
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    [(pages,)] = await (await conn.execute(
        "SELECT heap_blks_hit + heap_blks_read + idx_blks_hit + idx_blks_read FROM pg_statio_user_tables"
        " WHERE relname = 'jobs'")).fetchall()  # fmt: skip
    return pages


async def test_a_queue_that_grew_since_its_plans_were_made_is_still_read_by_index(conn, org):
    """Plans made while the queue was empty must not read a deep queue whole on each claim.

    A server's connections plan their statements once (generic plans, as the
    group commit's batches use) when the queue may be empty, and keep those
    plans until the next ANALYZE of ``jobs``. The planner then believes the
    organization's queue holds about one row; so does a plan made on a queue
    that was never analysed. The shape list and the lock of the candidates
    must reach their rows by index all the same: a few pages, not 30,000 jobs.
    """
    org_id, _ = org
    await conn.execute("ALTER TABLE jobs SET (autovacuum_enabled = false)")  # nothing analyses it during the test
    await conn.execute("SET plan_cache_mode = force_generic_plan")
    await add_node(conn, org_id, "cpu", [CPU8])
    shapes = PreparedStatement("test_shapes", claims.QUEUED_SHAPES)
    shapes_args = {"org": org_id, "limit": claims.MAX_SHAPES + 1}
    await conn.execute(shapes.prepare)
    await pages_touched(conn, shapes, shapes_args)  # planned on the empty queue
    for _ in range(6):  # and the lock too, were it a cached plan
        await claims.lock_queued(conn, org_id, [uuid4()])
    await jobs.submit(conn, org_id, [spec(payload={"i": i}) for i in range(30_000)], actor="t", batch=True)
    assert await pages_touched(conn, shapes, shapes_args) < 30
    planned_now = PreparedStatement("test_shapes_now", claims.QUEUED_SHAPES)  # planned on the full, never analysed queue
    await conn.execute(planned_now.prepare)
    assert await pages_touched(conn, planned_now, shapes_args) < 30
    ids = [r[0] for r in await (await conn.execute("SELECT id FROM jobs ORDER BY seq DESC LIMIT 20")).fetchall()]
    before = await jobs_pages_read(conn)
    async with conn.transaction(force_rollback=True):
        locked = await claims.lock_queued(conn, org_id, ids)
    assert len(locked) == 20 and await jobs_pages_read(conn) - before < 150


async def test_a_queue_that_outgrew_its_statistics_is_analysed_and_claims_seek_their_shape(conn, org):
    """A burst of GPU work in front of CPU work, on a table never analysed: the sweeper's check analyses it.

    Before, a claim's lock of the CPU shape's first rows walks the queue in
    claim order through the GPU work; after, every connection replans and
    seeks the shape. The service role may do it (through ``umbra_analyze_jobs``).
    """
    org_id, _ = org
    await conn.execute("ALTER TABLE jobs SET (autovacuum_enabled = false)")  # nothing else analyses it
    await add_node(conn, org_id, "cpu", [CPU8])
    await add_node(conn, org_id, "gpu", [GPU24])
    burst = [spec(requires={"accelerators": ["cuda"]}) for _ in range(15_000)] + [spec() for _ in range(15_000)]
    await jobs.submit(conn, org_id, burst, actor="t", batch=True)
    cpu_shape = next(s for (s,) in await (await claims.queued_shapes(conn, org_id)).fetchall() if "cuda" not in s)

    async def pages_to_lock_five() -> int:  # reading the shape's first 16 rows
        before = await jobs_pages_read(conn)
        async with conn.transaction(force_rollback=True):
            assert len(await claims.lock_first_of_shape(conn, org_id, cpu_shape, count=5)) == 5
        return await jobs_pages_read(conn) - before

    assert await pages_to_lock_five() > 400  # the premise: planned without statistics
    await conn.execute("SET ROLE umbra_service")
    try:
        assert await statistics.refresh_if_outgrown(conn)
        assert not await statistics.refresh_if_outgrown(conn)  # no longer outgrown
    finally:
        await conn.execute("RESET ROLE")
    assert await pages_to_lock_five() < 100



async def test_a_batch_reaches_its_rows_by_key_whatever_the_table_holds(conn, org):
    """A batch claiming a hundred jobs, and one completing them, scan no table on an analysed queue of 6,000.

    The batch's plans are generic. On an analysed table of a few thousand jobs the
    planner believed a sequential scan and a hash join cheaper than a hundred
    probes of the primary key, for the lock of the shape's first rows and for the
    transitions' write alike: every batch read and filtered the whole table twice
    (1.4 and 0.7 ms a batch at 6,000 jobs, growing with the table, until the
    table is large enough for the planner to change its mind). Counted by
    PostgreSQL's statistics of the scans it started.
    """
    org_id, _ = org
    node = await add_node(conn, org_id, "cpu", [CPU8])
    await jobs.submit(conn, org_id, [spec(payload={"i": i}) for i in range(6_000)], actor="t", batch=True)
    await conn.execute("ANALYZE")

    async def scans_of_tables() -> int:
        await conn.execute("SELECT pg_stat_force_next_flush()")
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        [(scans,)] = await (await conn.execute("SELECT sum(seq_scan) FROM pg_stat_user_tables")).fetchall()
        return scans

    async def run_batch(commands: list[batch_commands.Command]) -> None:
        staged, deferred = await batch_commands.stage(conn, commands)
        await batch_commands.write(conn, staged)
        batch_commands.answer(staged)
        assert not deferred and all(c.error is None for c in commands)

    before = await scans_of_tables()
    claim = batch_commands.Command("claim", org_id, node, count=100)
    await run_batch([claim])
    assert len(claim.claims) == 100
    await run_batch([batch_commands.Command("complete", org_id, node, c.job_id, c.attempt) for c in claim.claims])
    assert await scans_of_tables() == before


async def test_a_node_behind_thousands_of_shapes_it_cannot_run_is_answered_the_job_it_can(conn, org):
    """2,100 GPU jobs, each of its own shape, queued in front of one job a CPU node can run. The walk in
    claim order that a claim used past ``MAX_SHAPES`` stepped over 2,000 rows at most and then said there
    was nothing: the CPU node was never answered that job (and took tens of seconds to be told so). The
    shapes are now listed whole and only the heads of those the node can run are read; the GPU node still
    takes the GPU jobs in claim order."""
    org_id, _ = org
    cpu = await add_node(conn, org_id, "cpu", [CPU64])
    gpu = await add_node(conn, org_id, "gpu", [GPU24])
    gpu_work = [spec("render", priority=1, requires={"accelerators": ["cuda"], "vram_min_mb": 1000 + i}) for i in range(2100)]
    await jobs.submit(conn, org_id, gpu_work, actor="t", batch=True)
    echo = await submit(conn, org_id, priority=2)
    with anyio.fail_after(30):
        got = await claim(conn, org_id, cpu)
        assert got is not None and got.job_id == echo.id
        assert await claim(conn, org_id, cpu) is None
        first = await claim(conn, org_id, gpu)
    assert first.job.get("requires", {}).get("vram_min_mb") == 1000


async def test_a_batch_of_claimers_behind_thousands_of_shapes_takes_what_each_can_run(db_url, conn, org):
    """The group commit reads the same way: the CPU claimer gets its job behind 2,100 GPU shapes, the GPU
    claimer the first GPU job."""
    org_id, _ = org
    cpu = await add_node(conn, org_id, "cpu", [CPU64])
    gpu = await add_node(conn, org_id, "gpu", [GPU24])
    gpu_work = [spec("render", priority=1, requires={"accelerators": ["cuda"], "vram_min_mb": 1000 + i}) for i in range(2100)]
    rows, _ = await jobs.submit(conn, org_id, gpu_work, actor="t", batch=True)
    echo = await submit(conn, org_id, priority=2)
    async with group_commit(db_url) as (group, _, tg):
        calls = [lambda n=n: group.claim(node_id=n, organization_id=org_id, lease_seconds=60, stale_seconds=45) for n in (cpu, gpu)]
        with anyio.fail_after(30):
            got_cpu, got_gpu = await in_one_batch(group, tg, calls)
    assert got_cpu is not None and got_cpu.job_id == echo.id
    assert got_gpu is not None and got_gpu.job_id == rows[0].id
