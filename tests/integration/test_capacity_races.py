"""Judging what could run against changes of the fleet: neither acts on a read made before the other committed.

A submission judges from one read of the nodes and the registry whether its
job could ever run; a pairing, a heartbeat that changes devices or a registry
update re-examines the waiting jobs from a read of its own (see
:func:`umbra.compute.blocked.hold_capacity`). Each test holds the first reader
just after its read, lets the other transaction start, and checks the job as
both left it.
"""

from __future__ import annotations

import anyio
import psycopg
import pytest

from umbra.compute import blocked
from umbra.compute.models import upsert_model
from umbra.domain.models import RegisteredModel
from umbra.projections import jobs as queue

from tests.helpers import until_done_or_waiting

from .queue_support import CPU64, GPU24, add_node, beat, register_model, submit

pytestmark = pytest.mark.anyio


class HeldJudge:
    """Makes the ``which``-th judgement of the fleet (``BlockingJudge.load``) wait, after its read, until released."""

    def __init__(self, monkeypatch, which: int = 1) -> None:
        self.read, self.release = anyio.Event(), anyio.Event()
        self._which, self._count = which, 0
        original = blocked.BlockingJudge.load.__func__

        async def load(cls, conn, organization_id):
            judge = await original(cls, conn, organization_id)
            self._count += 1
            if self._count == self._which:
                self.read.set()
                await self.release.wait()
            return judge

        monkeypatch.setattr(blocked.BlockingJudge, "load", classmethod(load))


async def _both(conn, first, second, held: HeldJudge) -> None:
    """Run ``first`` until its judgement is read, then ``second`` to its end or to a lock the first holds, then both."""
    finished = []

    async def run_second() -> None:
        await second()
        finished.append(True)

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        with anyio.fail_after(10):
            await held.read.wait()
        tg.start_soon(run_second)
        await until_done_or_waiting(conn, lambda: bool(finished))
        held.release.set()


async def test_a_submission_racing_a_pairing_is_not_left_blocked(db_url, conn, org, monkeypatch):
    org_id, _ = org
    held = HeldJudge(monkeypatch)
    made = {}
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as submitter, \
            await psycopg.AsyncConnection.connect(db_url, autocommit=True) as admin:  # fmt: skip

        async def submit_job() -> None:
            made["job"] = await submit(submitter, org_id)  # judged against a fleet of no node: blocked

        async def pair() -> None:
            await add_node(admin, org_id, "a", [CPU64])

        await _both(conn, submit_job, pair, held)
    row = await queue.load(conn, made["job"].id, org_id)
    assert (row.status, row.blocked_reason) == ("queued", None)


async def test_a_submission_racing_the_registration_of_its_model_is_not_left_blocked(db_url, conn, org, monkeypatch):
    org_id, _ = org
    await add_node(conn, org_id, "a", [GPU24])
    held = HeldJudge(monkeypatch)
    made = {}
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as submitter, \
            await psycopg.AsyncConnection.connect(db_url, autocommit=True) as admin:  # fmt: skip

        async def submit_job() -> None:
            made["job"] = await submit(submitter, org_id, requires={"models": ["m"]})  # m is not registered yet

        async def register() -> None:
            await register_model(admin, org_id, "m", vram_min_mb=8000)

        await _both(conn, submit_job, register, held)
    row = await queue.load(conn, made["job"].id, org_id)
    assert (row.status, row.blocked_reason) == ("queued", None)


async def test_a_registry_update_racing_a_heartbeat_that_adds_a_gpu_leaves_the_job_runnable(db_url, conn, org, monkeypatch):
    org_id, _ = org
    node = await add_node(conn, org_id, "a", [CPU64])
    job = (await submit(conn, org_id, requires={"models": ["m"]})).id
    assert (await queue.load(conn, job, org_id)).status == "blocked"  # model_not_registered: m
    held = HeldJudge(monkeypatch)  # the heartbeat's re-examination, made before m is registered
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as agent, \
            await psycopg.AsyncConnection.connect(db_url, autocommit=True) as admin:  # fmt: skip

        async def gpu_arrives() -> None:
            await beat(agent, org_id, node, [CPU64, GPU24])

        async def register() -> None:  # m needs cuda: only the new GPU can run it
            await upsert_model(admin, org_id, RegisteredModel(slug="m", vram_min_mb=8000, requires_accelerators=("cuda",)))

        await _both(conn, gpu_arrives, register, held)
    row = await queue.load(conn, job, org_id)
    assert (row.status, row.blocked_reason) == ("queued", None)


async def test_a_decomposition_waiting_for_a_change_of_the_fleet_holds_no_row_a_batch_needs(db_url, conn, org):
    """It waits for the capacity lock before it locks its parent: the holder's renewal goes through meanwhile."""
    from umbra.compute import batch_commands, claims
    from umbra.compute.batch_commands import Command
    from umbra.compute.claims import ChildRequest

    org_id, _ = org
    node = await add_node(conn, org_id, "a", [CPU64])
    parent = (await submit(conn, org_id)).id
    held = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60)
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as admin, \
            await psycopg.AsyncConnection.connect(db_url, autocommit=True) as agent, \
            await psycopg.AsyncConnection.connect(db_url, autocommit=True) as batch:  # fmt: skip
        async with anyio.create_task_group() as tg:
            async with admin.transaction():
                await blocked.hold_capacity(admin, org_id, exclusive=True)  # a change of the fleet in flight
                tg.start_soon(lambda: claims.add_children(agent, organization_id=org_id, node_id=node, job_id=parent,
                                                          attempt=held.attempt, children=[ChildRequest(kind="c")]))  # fmt: skip
                await until_done_or_waiting(conn, lambda: False)
                await batch.execute("SET lock_timeout = '2s'")
                staged, _ = await batch_commands.stage(batch, [Command("renew", org_id, node, parent, held.attempt)])
                await batch_commands.write(batch, staged)
                assert [type(s.event).__name__ for s in staged] == ["JobLeaseRenewed"]
