"""Claims past ``MAX_SHAPES`` queued shapes: the walk in claim order for ``WALK_PAGES`` pages, then the
shapes listed again and read by their heads from where the walk stopped.

With the constants shrunk (pages of five rows, three shapes listed first), random queues of mixed
shapes, priorities, kinds and delayed jobs give exactly a prefix of the claim order (nothing yielded
twice, nothing skipped at the switch); ``nothing_due`` says only that nothing is due; rows held by
another transaction are passed over to the first free one, by the single claim and by a batch
claimer alike (which tried only its first rows of a page, then the next page); and when work the node
can run is near the front, no second shape listing is made.
"""

from __future__ import annotations

import random

import psycopg
import pytest

from umbra.compute import blocked, claims, jobs
from umbra.domain.placement import best_placement

from .queue_support import CPU8, GPU24, add_node, spec
from .test_group_commit import group_commit, in_one_batch

pytestmark = pytest.mark.anyio

SHAPES = [{"ram_min_mb": i * 100} for i in range(8)] + [{"accelerators": ["cuda"], "vram_min_mb": i} for i in range(8)]


@pytest.fixture
def small_pages(monkeypatch):
    monkeypatch.setattr(claims, "MAX_SHAPES", 3)
    monkeypatch.setattr(claims, "SCAN_PAGE", 5)
    monkeypatch.setattr(claims, "MANY_SHAPES_PAGE", 6)


async def _fill(conn, org_id, count, seed):
    rng = random.Random(seed)
    specs = [spec(rng.choice(["echo", "render"]), payload={"i": i}, priority=rng.choice([1, 2, 2, 3]),
                  requires=rng.choice(SHAPES)) for i in range(count)]  # fmt: skip
    await jobs.submit(conn, org_id, specs, actor="t", batch=True)
    # Some delayed (a retry's backoff) anywhere in the order.
    await conn.execute("UPDATE jobs SET not_before = umbra_now() + interval '1 hour' WHERE organization_id = %s"
                       " AND (payload->>'i')::int %% 7 = 3", (org_id,))  # fmt: skip


async def _judge(conn, org_id, node_id, kinds):
    [node] = await blocked.read_nodes(conn, org_id, node_id=node_id)
    models = await blocked.read_models(conn, org_id)

    def runnable(shape):
        kind, requires = claims.decode_shape(shape)
        return (kinds is None or kind in kinds) and best_placement(node, requires, models) is not None

    return runnable


async def _want(conn, org_id, runnable):
    rows = await (await conn.execute(
        "SELECT id, jsonb_build_array(kind, requires)::text FROM jobs WHERE organization_id = %s AND status = 'queued'"
        " AND (not_before IS NULL OR not_before <= umbra_now()) ORDER BY priority, seq", (org_id,))).fetchall()  # fmt: skip
    return [job_id for job_id, shape in rows if runnable(shape)]


@pytest.mark.parametrize("kinds", [None, frozenset({"echo"}), frozenset({"render"})], ids=["any", "echo", "render"])
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_walk_then_listing_yields_the_claim_order_exactly(conn, org, small_pages, kinds, seed):
    org_id, _ = org
    cpu = await add_node(conn, org_id, "cpu", [CPU8])
    gpu = await add_node(conn, org_id, "gpu", [GPU24])
    await _fill(conn, org_id, 300, seed)
    for node in (cpu, gpu):
        runnable = await _judge(conn, org_id, node, kinds)
        want = await _want(conn, org_id, runnable)
        shapes = [s for (s,) in await (await claims.queued_shapes(conn, org_id)).fetchall()]
        assert len(shapes) > claims.MAX_SHAPES
        scan = claims.ClaimableScan(conn, org_id, shapes, runnable, kinds=kinds)
        got = [row[0] async for page in scan.pages() for row in page]
        assert len(got) == len(set(got)), "a row yielded twice"
        assert got == want[: len(got)], "claim order broken"
        assert len(got) >= min(len(want), 30)
        assert not scan.nothing_due


async def test_nothing_due_only_when_nothing_is_due(conn, org, small_pages):
    org_id, _ = org
    cpu = await add_node(conn, org_id, "cpu", [CPU8])
    await add_node(conn, org_id, "gpu", [GPU24])
    await _fill(conn, org_id, 60, 5)
    runnable = await _judge(conn, org_id, cpu, None)
    shapes = [s for (s,) in await (await claims.queued_shapes(conn, org_id)).fetchall()]
    # Everything delayed: nothing due.
    await conn.execute("UPDATE jobs SET not_before = umbra_now() + interval '1 hour' WHERE organization_id = %s", (org_id,))
    scan = claims.ClaimableScan(conn, org_id, shapes, runnable)
    assert [p async for p in scan.pages()] == [] and scan.nothing_due
    # One due job far behind, of a shape the node cannot run: something is due (not for it).
    [(last_gpu,)] = await (await conn.execute(
        "SELECT id FROM jobs WHERE organization_id = %s AND status = 'queued' AND requires::text LIKE '%%cuda%%'"
        " ORDER BY priority DESC, seq DESC LIMIT 1", (org_id,))).fetchall()  # fmt: skip
    await conn.execute("UPDATE jobs SET not_before = NULL WHERE id = %s", (last_gpu,))
    assert await _want(conn, org_id, lambda s: True) == [last_gpu]
    scan = claims.ClaimableScan(conn, org_id, shapes, runnable)
    assert [p async for p in scan.pages()] == [] and not scan.nothing_due


async def test_claims_skip_rows_held_elsewhere_across_the_switch(db_url, conn, org, small_pages):
    """Rows of the walk's pages held by another transaction: the claim goes on past the switch to the first free one."""
    org_id, _ = org
    cpu = await add_node(conn, org_id, "cpu", [CPU8])
    await add_node(conn, org_id, "gpu", [GPU24])
    await _fill(conn, org_id, 200, 7)
    runnable = await _judge(conn, org_id, cpu, None)
    want = await _want(conn, org_id, runnable)
    async with await psycopg.AsyncConnection.connect(db_url) as holder:
        await holder.execute("SELECT 1 FROM jobs WHERE id = ANY(%s) FOR UPDATE", (want[:15],))  # past two pages of 5
        got = await claims.claim(conn, node_id=cpu, organization_id=org_id, lease_seconds=60)
        assert got is not None and got.job_id == want[15]
        await holder.rollback()


@pytest.mark.parametrize("many", [False, True], ids=["by-shape", "walk-then-listed"])
async def test_a_batch_claimer_passes_over_free_rows_behind_a_held_one(db_url, conn, org, monkeypatch, many):
    """The group commit tries only the first ``want`` eligible rows of each page: when they are held by
    another transaction (the other batch in flight), the rest of the page is never tried and the next page
    starts after it. The single claim (lock_queued over the whole page) takes want[15]; the batch takes a
    later job (claim order broken) or none at all while free jobs it can run are queued."""
    if many:
        monkeypatch.setattr(claims, "MAX_SHAPES", 3)
        monkeypatch.setattr(claims, "SCAN_PAGE", 5)
        monkeypatch.setattr(claims, "MANY_SHAPES_PAGE", 6)
    org_id, _ = org
    cpu = await add_node(conn, org_id, "cpu", [CPU8])
    await add_node(conn, org_id, "gpu", [GPU24])
    await _fill(conn, org_id, 200, 7)
    want = await _want(conn, org_id, await _judge(conn, org_id, cpu, None))
    async with await psycopg.AsyncConnection.connect(db_url) as holder:
        await holder.execute("SELECT 1 FROM jobs WHERE id = ANY(%s) FOR UPDATE", (want[:15],))
        async with group_commit(db_url) as (group, _, tg):
            [got] = await in_one_batch(group, tg, [
                lambda: group.claim(node_id=cpu, organization_id=org_id, lease_seconds=60, stale_seconds=45)])
        await holder.rollback()
    assert got is not None, f"nothing claimed though {len(want) - 15} free jobs it can run are queued"
    assert got.job_id == want[15], f"took the job at position {want.index(got.job_id)} of its claim order, not 15"


async def test_no_listing_when_the_first_page_answers(conn, org, monkeypatch):
    """Many shapes, runnable work in front: one shape listing (the claim's first), no second."""
    org_id, _ = org
    cpu = await add_node(conn, org_id, "cpu", [CPU8])
    await add_node(conn, org_id, "gpu", [GPU24])
    specs = [spec(requires={"accelerators": ["cuda"], "vram_min_mb": i}) for i in range(100)]
    specs[3:3] = [spec()]
    await jobs.submit(conn, org_id, [*specs, *[spec(requires={"ram_min_mb": 100 + i}) for i in range(300)]], actor="t", batch=True)
    listings = []
    real = psycopg.AsyncConnection.execute

    async def counting(self, query, params=None, **kw):
        if query == claims.QUEUED_SHAPES:
            listings.append(params.get("limit") if params else None)
        return await real(self, query, params, **kw)

    monkeypatch.setattr(psycopg.AsyncConnection, "execute", counting)
    got = await claims.claim(conn, node_id=cpu, organization_id=org_id, lease_seconds=60)
    assert got is not None
    assert listings == [claims.MAX_SHAPES + 1]
