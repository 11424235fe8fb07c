"""A batch whose connection broke as it committed gives back the claims it made, whatever the clock its
events were recorded at."""

from __future__ import annotations

import pytest

from umbra.compute import claims
from umbra.errors import DatabaseUnavailable
from umbra.events import store

from .queue_support import CPU64, add_node, set_clock, submit
from .test_broken_commit import break_after_commit
from .test_group_commit import group_commit, in_one_batch, status_of

pytestmark = pytest.mark.anyio


async def test_a_broken_batch_releases_its_claim_when_a_row_it_read_was_changed_later_than_its_clock(
        db_url, conn, org, monkeypatch):  # fmt: skip
    """A renewal in the batch reads a row last changed by a transaction that began after the batch's (its
    clock later than the batch's): the batch records its events at that later time, the claim's among them
    (``batch_commands.write``). Its connection then breaks after COMMIT: the claimer hears 503, and the
    claim, which did commit, must be found and released, not left leased to an agent that never heard of it."""
    org_id, _ = org
    holder = await add_node(conn, org_id, "holder", [CPU64])
    claimer = await add_node(conn, org_id, "claimer", [CPU64])
    held = (await submit(conn, org_id)).id
    await set_clock(conn, 5)  # the holder's claim: a transaction whose clock is later than the batch's
    assert (await claims.claim(conn, node_id=holder, organization_id=org_id, lease_seconds=60)).job_id == held
    await set_clock(conn, 0)
    queued = (await submit(conn, org_id)).id
    fired = break_after_commit(monkeypatch, db_url)
    async with group_commit(db_url) as (group, _, tg):
        renewed, claimed = await in_one_batch(group, tg, [
            lambda: group.renew(organization_id=org_id, node_id=holder, job_id=held, attempt=1, lease_seconds=60),
            lambda: group.claim(node_id=claimer, organization_id=org_id, lease_seconds=60, stale_seconds=45),
        ])  # fmt: skip
    assert fired and isinstance(claimed, DatabaseUnavailable)
    types = [e.type for e in await store.read_stream(conn, store.job_stream(queued))]
    assert types == ["job.submitted", "job.claimed", "job.released"]
    assert await status_of(conn, queued) == "queued"
