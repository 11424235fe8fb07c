"""A report's completions and its claim go in one batch, however full the queue: the batch size must not
cut a report in two, or its claim is made where its completions' events cannot name it."""

from __future__ import annotations

from contextlib import asynccontextmanager

import anyio
import pytest
from psycopg_pool import AsyncConnectionPool

from umbra.compute.group_commit import GroupCommit, HintNotifier
from umbra.events import store
from umbra.projections.verify import verify

from .test_group_commit import in_one_batch, one_node_holding, report, status_of

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def small_batches(db_url: str, max_batch: int):
    async with AsyncConnectionPool(db_url, min_size=1, max_size=4, kwargs={"autocommit": True}, open=False) as pool:
        group = GroupCommit(pool, HintNotifier(pool), max_batch=max_batch)
        async with anyio.create_task_group() as tg:
            yield group, tg
            tg.cancel_scope.cancel()


async def test_a_report_longer_than_the_batch_keeps_its_claim_answerable_when_sent_again(db_url, conn, org):
    """Two results and a claim, with batches of two: the claim must land with the completions, so that
    the first completion names it (``next_claims``) and the report sent again (its answer lost) is
    answered with that job, rather than leaving it leased to an agent that never hears of it."""
    org_id, _ = org
    node, held, queued = await one_node_holding(conn, org_id, 2)
    async with small_batches(db_url, max_batch=2) as (group, tg):
        [(answers, claimed)] = await in_one_batch(group, tg, [report(group, org_id, node, held, 1)])
        assert [row.status for row in answers] == ["complete", "complete"]
        assert [c.job_id for c in claimed] == [queued]
        # The answer was lost: the agent sends the same report again.
        answers, again = await report(group, org_id, node, held, 1)()
    assert [row.status for row in answers] == ["complete", "complete"]
    assert [c.job_id for c in again] == [queued]  # answered with the job its first request took
    metadata = (await (await conn.execute("SELECT metadata FROM events WHERE stream = %s AND type = 'job.completed'",
                                          (store.job_stream(held[0]),))).fetchone())[0]  # fmt: skip
    assert metadata.get("next_claims") == [str(queued)]
    assert await status_of(conn, queued) == "running"
    assert await verify(conn) == []
