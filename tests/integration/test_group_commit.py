"""Group commit: several agents' commands in one transaction, each still its own command.

Commands are queued before the workers start, so they are known to land in
one batch; ``GroupCommit.batches`` and ``fallbacks`` say how they ran.
"""

from __future__ import annotations

import uuid

from contextlib import asynccontextmanager
from typing import Any, Awaitable, Callable

import anyio
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from tests.helpers import eventually, lock_held_for_a_second
from umbra.compute import claims
from umbra.compute.group_commit import OVERLAP_MIN_COMMANDS, GroupCommit, HintNotifier
from umbra.errors import Conflict, InvalidRequest, NotFound, Unauthenticated
from umbra.events import store
from umbra.projections.verify import verify

from .queue_support import CPU64, GPU24, add_node, submit

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def group_commit(db_url: str):
    async with AsyncConnectionPool(db_url, min_size=1, max_size=4, kwargs={"autocommit": True}, open=False) as pool:
        notifier = HintNotifier(pool)
        group = GroupCommit(pool, notifier)
        async with anyio.create_task_group() as tg:
            yield group, notifier, tg
            tg.cancel_scope.cancel()


async def in_one_batch(group: GroupCommit, tg, calls: list[Callable[[], Awaitable[Any]]]) -> list[Any]:
    """Queue every call, then start the workers: they take all of them as one batch."""
    results: list[Any] = [None] * len(calls)
    done = anyio.Event()
    left = len(calls)

    async def run(index: int, call) -> None:
        nonlocal left
        try:
            results[index] = await call()
        except Exception as exc:  # the command's own answer
            results[index] = exc
        left -= 1
        if not left:
            done.set()

    for index, call in enumerate(calls):
        tg.start_soon(run, index, call)
    while group.queued < len(calls):
        await anyio.sleep(0)
    await tg.start(group.run)
    await done.wait()
    return results


async def claim_now(conn, org_id, node_id):
    return await claims.claim(conn, node_id=node_id, organization_id=org_id, lease_seconds=60)


async def two_held_jobs(conn, org_id):
    """Nodes ``a`` and ``b``, each holding one job (attempt 1): ``(a, b, job_a, job_b)``."""
    a = await add_node(conn, org_id, "a", [CPU64])
    b = await add_node(conn, org_id, "b", [CPU64])
    job_a, job_b = (await submit(conn, org_id)).id, (await submit(conn, org_id)).id
    held_a, held_b = await claim_now(conn, org_id, a), await claim_now(conn, org_id, b)
    assert (held_a.job_id, held_b.job_id) == (job_a, job_b)
    return a, b, job_a, job_b


async def test_a_batch_of_claims_never_gives_one_job_twice(db_url, conn, org):
    org_id, _ = org
    nodes = [await add_node(conn, org_id, f"box{i}", [CPU64]) for i in range(6)]
    jobs = [(await submit(conn, org_id)).id for _ in range(4)]
    async with group_commit(db_url) as (group, _, tg):
        calls = [lambda n=n: group.claim(node_id=n, organization_id=org_id, lease_seconds=60, stale_seconds=45) for n in nodes]
        results = await in_one_batch(group, tg, calls)
    claimed = [r for r in results if r is not None]
    assert sorted(str(r.job_id) for r in claimed) == sorted(str(j) for j in jobs)
    # Served in arrival order: the first four claimers got the four jobs, in queue order.
    assert [r.job_id if r else None for r in results] == [*jobs, None, None]
    assert group.batches == 1 and group.fallbacks == 0
    for result, node_id in zip(claimed, nodes):
        assert result.job["lease_owner"] == str(node_id) and result.attempt == 1
        assert result.placement["device_kind"] == "cpu"
    assert await verify(conn) == []


async def test_a_batch_claim_takes_only_jobs_the_node_is_eligible_for(db_url, conn, org):
    org_id, _ = org
    cpu_node = await add_node(conn, org_id, "cpu-box", [CPU64])
    gpu_node = await add_node(conn, org_id, "gpu-box", [GPU24])
    gpu_job = (await submit(conn, org_id, requires={"vram_min_mb": 16000, "accelerators": ["cuda"]})).id
    cpu_job = (await submit(conn, org_id, requires={"ram_min_mb": 32000})).id
    async with group_commit(db_url) as (group, _, tg):
        calls = [lambda n=n: group.claim(node_id=n, organization_id=org_id, lease_seconds=60, stale_seconds=45)
                 for n in (cpu_node, gpu_node)]  # fmt: skip
        first, second = await in_one_batch(group, tg, calls)
    assert (first.job_id, second.job_id) == (cpu_job, gpu_job)
    assert second.placement["device_kind"] == "gpu_discrete"


async def test_a_batch_claim_never_crosses_organizations(db_url, conn, org):
    from umbra.compute.accounts import create_organization

    org_id, _ = org
    other_id, _ = await create_organization(conn, "other")
    ours = await add_node(conn, org_id, "ours", [CPU64])
    theirs = await add_node(conn, other_id, "theirs", [CPU64])
    await submit(conn, org_id)
    async with group_commit(db_url) as (group, _, tg):
        calls = [
            lambda: group.claim(node_id=theirs, organization_id=other_id, lease_seconds=60, stale_seconds=45),
            # A node claiming in an organization it does not belong to gets nothing.
            lambda: group.claim(node_id=theirs, organization_id=org_id, lease_seconds=60, stale_seconds=45),
            lambda: group.claim(node_id=ours, organization_id=org_id, lease_seconds=60, stale_seconds=45),
        ]
        results = await in_one_batch(group, tg, calls)
    assert results[0] is None and results[1] is None
    assert results[2] is not None and results[2].job["organization_id"] == str(org_id)


async def test_a_batch_never_locks_another_organizations_job(db_url, conn, org):
    """A renewal or completion naming another organization's job is refused without its row ever being
    locked: held until the batch commits, the job was skipped by its own organization's claims meanwhile."""
    from umbra.compute import batch_commands
    from umbra.compute.accounts import create_organization
    from umbra.compute.batch_commands import Command

    org_id, _ = org
    other_id, _ = await create_organization(conn, "other")
    ours = await add_node(conn, org_id, "ours", [CPU64])
    theirs = await add_node(conn, other_id, "theirs", [CPU64])
    their_job = (await submit(conn, other_id)).id
    renewal = Command("renew", org_id, ours, their_job, 1)
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as batch:
        staged, _ = await batch_commands.stage(batch, [renewal])
        try:
            # Their node claims while the batch is open: its organization's one job is there to take.
            claimed = await claim_now(conn, other_id, theirs)
        finally:
            await batch_commands.write(batch, staged)
    assert claimed is not None and claimed.job_id == their_job
    # Refused as a job that does not exist: at once, or run alone beside the batches, where it is refused so.
    assert staged == [] and (isinstance(renewal.error, NotFound) or renewal.locked_elsewhere)


async def test_a_fencing_refusal_answers_only_its_own_command(db_url, conn, org):
    org_id, _ = org
    a, b, job_a, job_b = await two_held_jobs(conn, org_id)
    before_b = await store.read_stream(conn, store.job_stream(job_b))
    async with group_commit(db_url) as (group, _, tg):
        results = await in_one_batch(group, tg, [
            lambda: group.complete(organization_id=org_id, node_id=a, job_id=job_a, attempt=1, result={"ok": 1}),
            lambda: group.complete(organization_id=org_id, node_id=b, job_id=job_b, attempt=2, result=None),  # stale
            lambda: group.renew(organization_id=org_id, node_id=a, job_id=job_b, attempt=1, lease_seconds=60),  # not holder
            lambda: group.complete(organization_id=org_id, node_id=b, job_id=a, attempt=1, result=None),  # no such job
        ])  # fmt: skip
    assert results[0].status == "complete" and results[0].result == {"ok": 1}
    assert isinstance(results[1], Conflict) and results[1].code == "job_not_claimed_by_this_node"
    assert isinstance(results[2], Conflict) and results[2].code == "job_not_claimed_by_this_node"
    assert isinstance(results[3], NotFound) and results[3].code == "job_not_found"
    # The renew names the same job as the stale complete, so it waited for a second batch.
    assert group.batches == 2 and group.fallbacks == 0
    assert await store.read_stream(conn, store.job_stream(job_b)) == before_b  # refused: nothing written
    assert await verify(conn) == []


async def test_the_second_command_on_one_job_sees_the_first(db_url, conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "a", [CPU64])
    job = (await submit(conn, org_id)).id
    await claim_now(conn, org_id, node)
    async with group_commit(db_url) as (group, _, tg):
        results = await in_one_batch(group, tg, [
            lambda: group.complete(organization_id=org_id, node_id=node, job_id=job, attempt=1, result=1),
            lambda: group.complete(organization_id=org_id, node_id=node, job_id=job, attempt=1, result=2),
        ])  # fmt: skip
    assert results[0].status == "complete" and results[0].result == 1
    assert results[1].status == "complete" and results[1].result == 1  # the repeat sees the first: it stands
    types = [r.type for r in await store.read_stream(conn, store.job_stream(job))]
    assert types == ["job.submitted", "job.claimed", "job.completed"]


async def test_a_failing_batch_rolls_back_and_runs_its_commands_one_by_one(db_url, conn, org):
    org_id, _ = org
    a, b, job_a, job_b = await two_held_jobs(conn, org_id)
    async with group_commit(db_url) as (group, _, tg):
        results = await in_one_batch(group, tg, [
            lambda: group.complete(organization_id=org_id, node_id=a, job_id=job_a, attempt=1, result={"fine": True}),
            # PostgreSQL cannot store U+0000: the batch statement fails, not a decision.
            lambda: group.complete(organization_id=org_id, node_id=b, job_id=job_b, attempt=1, result={"bad": "\u0000"}),
        ])  # fmt: skip
    assert group.fallbacks == 1
    assert results[0].status == "complete"
    assert isinstance(results[1], InvalidRequest)
    types_b = [r.type for r in await store.read_stream(conn, store.job_stream(job_b))]
    assert types_b == ["job.submitted", "job.claimed"]
    assert await verify(conn) == []


async def test_hints_of_a_batch_are_sent_after_it_commits(db_url, conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "a", [CPU64])
    await submit(conn, org_id)
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as listener:
        await listener.execute(f"LISTEN {store.LOG_CHANNEL}")
        async with group_commit(db_url) as (group, notifier, tg):
            await tg.start(notifier.run)
            [claimed] = await in_one_batch(group, tg, [
                lambda: group.claim(node_id=node, organization_id=org_id, lease_seconds=60, stale_seconds=45)
            ])  # fmt: skip
            hints = []
            async for note in listener.notifies(timeout=10):
                hints.extend(store.parse_hints(note.payload))
                if hints[-1][1] >= claimed.job["position"]:
                    break
    assert hints[-1] == (org_id, claimed.job["position"], 0)


async def test_hints_for_more_organizations_than_one_payload_names_go_out_a_payload_a_tick(db_url):
    """The notifier sends one notification per transaction: the organizations one payload cannot name go in
    the next tick, none lost."""
    hints = [(uuid.UUID(int=n), 1000 + n, 1) for n in range(1, 301)]
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as listener:
        await listener.execute(f"LISTEN {store.LOG_CHANNEL}")
        async with group_commit(db_url) as (_, notifier, tg):
            await tg.start(notifier.run)
            notifier.hint(hints)
            received = []
            async for note in listener.notifies(timeout=5):
                received.append(store.parse_hints(note.payload))
                if sum(map(len, received)) >= len(hints):
                    break
            assert len(received) > 1
            await eventually(lambda: _now(notifier.ticks == len(received)))  # a notification a tick
    assert sorted(hint for payload in received for hint in payload) == hints


async def test_a_claim_says_when_the_organization_has_nothing_queued(db_url, conn, org):
    org_id, _ = org
    cpu_node = await add_node(conn, org_id, "cpu-box", [CPU64])
    await add_node(conn, org_id, "gpu-box", [GPU24])
    empty = object()
    async with group_commit(db_url) as (group, _, tg):
        await tg.start(group.run)
        claim = lambda: group.claim(node_id=cpu_node, organization_id=org_id, lease_seconds=60, stale_seconds=45,  # noqa: E731
                                    empty=empty)  # fmt: skip
        assert await claim() is empty
        await submit(conn, org_id, requires={"vram_min_mb": 16000, "accelerators": ["cuda"]})
        assert await claim() is None  # a job exists, but not one this node can run
        cpu_job = (await submit(conn, org_id)).id
        assert (await claim()).job_id == cpu_job


@pytest.mark.parametrize("gpu_job_queued", [False, True])
async def test_a_claimer_beaten_to_its_job_ends_the_wake_only_when_nothing_queued_is_for_another_node(
        db_url, conn, org, gpu_job_queued):  # fmt: skip
    """Beaten to the only job, the loser says nothing is left: no one else need be woken for it. With a GPU job
    still queued it must not: the long-poll hub passes its wake token on to a waiter that can run that job."""
    org_id, _ = org
    first, second = await add_node(conn, org_id, "a", [CPU64]), await add_node(conn, org_id, "b", [CPU64])
    await add_node(conn, org_id, "gpu", [GPU24])
    job = (await submit(conn, org_id)).id
    if gpu_job_queued:
        await submit(conn, org_id, requires={"accelerators": ["cuda"]})
    empty = object()
    async with group_commit(db_url) as (group, _, tg):
        results = await in_one_batch(group, tg, [
            lambda n=n: group.claim(node_id=n, organization_id=org_id, lease_seconds=60, stale_seconds=45, empty=empty)
            for n in (first, second)
        ])  # fmt: skip
    assert results[0].job_id == job
    assert results[1] is (None if gpu_job_queued else empty)


async def _credential_of(conn, node_id):
    return (await (await conn.execute("SELECT id FROM node_credentials WHERE node_id = %s", (node_id,))).fetchone())[0]


async def test_a_revoked_credential_is_refused_in_the_batch_and_only_its_command(db_url, conn, org):
    org_id, _ = org
    a, b, job_a, job_b = await two_held_jobs(conn, org_id)
    cred_a, cred_b = await _credential_of(conn, a), await _credential_of(conn, b)
    await submit(conn, org_id)  # queued work a revoked claimer must not get
    # Revoked by another server process: this one's token cache still trusts the token.
    await conn.execute("UPDATE node_credentials SET revoked_at = now() WHERE id = %s", (cred_b,))
    before_b = await store.read_stream(conn, store.job_stream(job_b))
    async with group_commit(db_url) as (group, _, tg):
        results = await in_one_batch(group, tg, [
            lambda: group.complete(organization_id=org_id, node_id=a, job_id=job_a, attempt=1, result=1, credential_id=cred_a),
            lambda: group.complete(organization_id=org_id, node_id=b, job_id=job_b, attempt=1, result=1, credential_id=cred_b),
            lambda: group.claim(node_id=b, organization_id=org_id, lease_seconds=60, stale_seconds=45, credential_id=cred_b),
        ])  # fmt: skip
    assert results[0].status == "complete"
    assert all(isinstance(r, Unauthenticated) for r in results[1:]), results
    assert await store.read_stream(conn, store.job_stream(job_b)) == before_b
    queued = await (await conn.execute("SELECT count(*) FROM jobs WHERE status = 'queued'")).fetchone()
    assert queued[0] == 1 and group.fallbacks == 0
    assert await verify(conn) == []


async def test_a_revoked_credential_is_refused_when_its_batch_falls_back(db_url, conn, org):
    org_id, _ = org
    a, b, job_a, job_b = await two_held_jobs(conn, org_id)
    cred_b = await _credential_of(conn, b)
    await conn.execute("UPDATE node_credentials SET revoked_at = now() WHERE id = %s", (cred_b,))
    async with group_commit(db_url) as (group, _, tg):
        results = await in_one_batch(group, tg, [
            lambda: group.complete(organization_id=org_id, node_id=a, job_id=job_a, attempt=1, result={"bad": "\u0000"}),
            lambda: group.complete(organization_id=org_id, node_id=b, job_id=job_b, attempt=1, result=1, credential_id=cred_b),
        ])  # fmt: skip
    assert group.fallbacks == 1
    assert isinstance(results[0], InvalidRequest) and isinstance(results[1], Unauthenticated)
    types_b = [r.type for r in await store.read_stream(conn, store.job_stream(job_b))]
    assert types_b == ["job.submitted", "job.claimed"]


async def test_children_completed_in_one_batch_settle_their_parent_in_it(db_url, conn, org):
    """The write path with parents to settle: rows written, parents settled, then COMMIT (not with the rows)."""
    import msgspec

    org_id, _ = org
    a = await add_node(conn, org_id, "a", [CPU64])
    b = await add_node(conn, org_id, "b", [CPU64])
    parent = (await submit(conn, org_id)).id
    held = await claim_now(conn, org_id, a)
    assert held.job_id == parent
    kids = [msgspec.convert({"kind": "part"}, claims.ChildRequest) for _ in range(2)]
    await claims.add_children(conn, organization_id=org_id, node_id=a, job_id=parent, attempt=1, children=kids)
    first, second = await claim_now(conn, org_id, a), await claim_now(conn, org_id, b)
    async with group_commit(db_url) as (group, _, tg):
        results = await in_one_batch(group, tg, [
            lambda: group.complete(organization_id=org_id, node_id=a, job_id=first.job_id, attempt=1, result={"n": 1}),
            lambda: group.complete(organization_id=org_id, node_id=b, job_id=second.job_id, attempt=1, result={"n": 2}),
        ])  # fmt: skip
    assert [r.status for r in results] == ["complete", "complete"]
    assert group.batches == 1 and group.fallbacks == 0
    types = [r.type for r in await store.read_stream(conn, store.job_stream(parent))]
    assert types[-1] == "job.settled" and types.count("job.settled") == 1
    status = await (await conn.execute("SELECT status FROM jobs WHERE id = %s", (parent,))).fetchone()
    assert status == ("complete",)
    assert await verify(conn) == []


def complete_and_claim(group: GroupCommit, org_id, node_id, job_id, attempt: int = 1, result: Any = None):
    return lambda: group.complete_and_claim(organization_id=org_id, node_id=node_id, job_id=job_id, attempt=attempt,
                                            result=result, lease_seconds=60, stale_seconds=45)  # fmt: skip


async def writers(conn, *job_ids) -> set[int]:
    """The transactions that wrote the jobs' latest events (``xmin``)."""
    rows = await (await conn.execute(
        "SELECT DISTINCT ON (stream) xmin::text::bigint FROM events WHERE stream = ANY(%s) ORDER BY stream, version DESC",
        ([store.job_stream(j) for j in job_ids],),
    )).fetchall()  # fmt: skip
    return {xid for (xid,) in rows}


async def test_a_completion_claims_the_nodes_next_job_in_its_own_transaction(db_url, conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "a", [CPU64])
    first = (await submit(conn, org_id)).id
    await claim_now(conn, org_id, node)
    second = (await submit(conn, org_id)).id
    async with group_commit(db_url) as (group, _, tg):
        [(row, claimed)] = await in_one_batch(group, tg, [complete_and_claim(group, org_id, node, first, result={"n": 1})])
    assert (row.id, row.status, row.result) == (first, "complete", {"n": 1})
    assert claimed.job_id == second and claimed.attempt == 1
    assert claimed.job["lease_owner"] == str(node) and claimed.placement["device_kind"] == "cpu"
    assert group.batches == 1 and group.fallbacks == 0
    assert len(await writers(conn, first, second)) == 1  # one transaction wrote both
    assert await verify(conn) == []


async def test_a_refused_completion_claims_nothing(db_url, conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "a", [CPU64])
    held = (await submit(conn, org_id)).id
    await claim_now(conn, org_id, node)
    waiting = (await submit(conn, org_id)).id
    async with group_commit(db_url) as (group, _, tg):
        [refused] = await in_one_batch(group, tg, [complete_and_claim(group, org_id, node, held, attempt=2)])  # stale
    assert isinstance(refused, Conflict) and refused.code == "job_not_claimed_by_this_node"
    rows = await (await conn.execute("SELECT id, status FROM jobs ORDER BY seq")).fetchall()
    assert rows == [(held, "running"), (waiting, "queued")]


async def test_a_completion_with_nothing_left_to_claim_answers_none(db_url, conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "a", [CPU64])
    held = (await submit(conn, org_id)).id
    await claim_now(conn, org_id, node)
    # Queued, but only for a GPU: nothing this node may take.
    await submit(conn, org_id, requires={"vram_min_mb": 16000, "accelerators": ["cuda"]})
    async with group_commit(db_url) as (group, _, tg):
        [(row, claimed)] = await in_one_batch(group, tg, [complete_and_claim(group, org_id, node, held)])
    assert row.status == "complete" and claimed is None


async def test_a_chained_claim_takes_its_turn_in_arrival_order(db_url, conn, org):
    org_id, _ = org
    a, b, job_a, _job_b = await two_held_jobs(conn, org_id)
    c = await add_node(conn, org_id, "c", [CPU64])
    only = (await submit(conn, org_id)).id
    async with group_commit(db_url) as (group, _, tg):
        waiter, (row, chained) = await in_one_batch(group, tg, [
            lambda: group.claim(node_id=c, organization_id=org_id, lease_seconds=60, stale_seconds=45),
            complete_and_claim(group, org_id, a, job_a),
        ])  # fmt: skip
    assert waiter.job_id == only and row.status == "complete" and chained is None
    assert group.batches == 1


async def test_a_completion_of_a_batch_that_fell_back_lands_and_claims_nothing_next(db_url, conn, org):
    """Run alone, the completion could not carry its claim in its own transaction, and a claim of a
    transaction of its own could not be answered again to the same request sent again: none is made,
    and the agent long-polls for the job, still queued."""
    org_id, _ = org
    a, b, job_a, job_b = await two_held_jobs(conn, org_id)
    queued = (await submit(conn, org_id)).id
    async with group_commit(db_url) as (group, _, tg):
        chained, bad = await in_one_batch(group, tg, [
            complete_and_claim(group, org_id, a, job_a),
            lambda: group.complete(organization_id=org_id, node_id=b, job_id=job_b, attempt=1, result={"bad": "\u0000"}),
        ])  # fmt: skip
    assert group.fallbacks == 1 and isinstance(bad, InvalidRequest)
    row, claimed = chained
    assert row.status == "complete" and claimed is None
    status = (await (await conn.execute("SELECT status FROM jobs WHERE id = %s", (queued,))).fetchone())[0]
    assert status == "queued"
    assert await verify(conn) == []


async def test_a_revoked_credential_completes_nothing_and_claims_nothing(db_url, conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "a", [CPU64])
    held = (await submit(conn, org_id)).id
    await claim_now(conn, org_id, node)
    await submit(conn, org_id)
    credential = await _credential_of(conn, node)
    await conn.execute("UPDATE node_credentials SET revoked_at = now() WHERE id = %s", (credential,))
    async with group_commit(db_url) as (group, _, tg):
        [refused] = await in_one_batch(group, tg, [lambda: group.complete_and_claim(
            organization_id=org_id, node_id=node, job_id=held, attempt=1, result=None, lease_seconds=60,
            stale_seconds=45, credential_id=credential)])  # fmt: skip
    assert isinstance(refused, Unauthenticated)
    statuses = [s for (s,) in await (await conn.execute("SELECT status FROM jobs ORDER BY seq")).fetchall()]
    assert statuses == ["running", "queued"]


def claim_many(group: GroupCommit, org_id, node_id, count: int):
    return lambda: group.claim_many(node_id=node_id, organization_id=org_id, count=count, lease_seconds=60,
                                    stale_seconds=45)  # fmt: skip


@pytest.mark.parametrize("shapes", [1, 2], ids=["one-shape", "two-shapes"])
async def test_claims_of_several_jobs_are_served_in_arrival_order_and_claim_order(db_url, conn, org, shapes):
    """One shape takes the one-statement lock for a single claimer; two shapes go page by page."""
    org_id, _ = org
    first, second = await add_node(conn, org_id, "a", [CPU64]), await add_node(conn, org_id, "b", [CPU64])
    requires = [{}, {"ram_min_mb": 1000}][:shapes]
    jobs = [(await submit(conn, org_id, requires=requires[i % shapes])).id for i in range(5)]
    async with group_commit(db_url) as (group, _, tg):
        [alone] = await in_one_batch(group, tg, [claim_many(group, org_id, first, 2)])
    async with group_commit(db_url) as (group, _, tg):
        a, b = await in_one_batch(group, tg, [claim_many(group, org_id, first, 2), claim_many(group, org_id, second, 5)])
        assert group.batches == 1
    assert [c.job_id for c in alone] == jobs[:2]
    assert [c.job_id for c in a] == jobs[2:4] and [c.job_id for c in b] == jobs[4:]
    assert {c.job["lease_owner"] for c in alone + a} == {str(first)} and b[0].job["lease_owner"] == str(second)
    assert group.fallbacks == 0
    async with group_commit(db_url) as (group, _, tg):
        assert await in_one_batch(group, tg, [claim_many(group, org_id, first, 3)]) == [None]
    assert await verify(conn) == []


async def test_claimers_of_one_shape_read_on_past_rows_others_hold_and_never_share_one(db_url, conn, org):
    """The one-statement lock skips rows held elsewhere; a claimer it leaves short reads on, never retaking the batch's own rows."""
    org_id, _ = org
    first, second = await add_node(conn, org_id, "a", [CPU64]), await add_node(conn, org_id, "b", [CPU64])
    jobs = [(await submit(conn, org_id)).id for _ in range(5)]
    async with await psycopg.AsyncConnection.connect(db_url) as other:  # another claimer holds the first two
        await other.execute("SELECT 1 FROM jobs WHERE id = ANY(%s) FOR UPDATE", (jobs[:2],))
        async with group_commit(db_url) as (group, _, tg):
            a, b = await in_one_batch(group, tg, [claim_many(group, org_id, first, 2), claim_many(group, org_id, second, 2)])
        await other.rollback()
    assert [c.job_id for c in a] == jobs[2:4] and [c.job_id for c in b] == [jobs[4]]
    assert group.batches == 1 and group.fallbacks == 0
    assert await verify(conn) == []


async def test_a_second_batch_starts_while_one_runs_only_for_a_queue_worth_it(db_url, conn, org, monkeypatch):
    """A few commands wait for the running batch; enough of them start a second batch beside it."""
    from umbra.compute import batch_commands

    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    await submit(conn, org_id)
    held = await claim_now(conn, org_id, node)
    for _ in range(OVERLAP_MIN_COMMANDS + 4):
        await submit(conn, org_id)
    claimed: list[Any] = []
    first_may_go = anyio.Event()
    real_stage = batch_commands.stage

    async def stage(conn, commands, **options):
        if any(c.job_id == held.job_id for c in commands):
            await first_may_go.wait()  # the first batch, still running
        return await real_stage(conn, commands, **options)

    monkeypatch.setattr(batch_commands, "stage", stage)

    async def claim_one() -> None:
        claimed.append(await claim_now_grouped(group, org_id, node))

    async with group_commit(db_url) as (group, _, tg):
        await tg.start(group.run)
        try:
            tg.start_soon(lambda: group.complete(organization_id=org_id, node_id=node, job_id=held.job_id,
                                                 attempt=1, result=None))  # fmt: skip
            while group.queued or not group.running:
                await anyio.sleep(0.01)  # the first batch has taken it
            for _ in range(3):
                tg.start_soon(claim_one)
            await anyio.sleep(0.5)
            assert claimed == [] and group.queued == 3  # too few to start a batch beside the running one
            for _ in range(OVERLAP_MIN_COMMANDS - 3):
                tg.start_soon(claim_one)
            with anyio.fail_after(10):
                while len(claimed) < OVERLAP_MIN_COMMANDS:
                    await anyio.sleep(0.01)
            assert all(c is not None for c in claimed) and group.batches == 1  # the first one still waits
        finally:
            first_may_go.set()  # the first batch goes on (a shielded batch cannot be cancelled)
        with anyio.fail_after(10):
            while group.batches < 2:
                await anyio.sleep(0.01)
    assert len({c.job_id for c in claimed}) == OVERLAP_MIN_COMMANDS
    assert await verify(conn) == []


def claim_now_grouped(group: GroupCommit, org_id, node_id):
    return group.claim(node_id=node_id, organization_id=org_id, lease_seconds=60, stale_seconds=45)


async def test_a_fallback_claim_that_fails_part_way_answers_the_jobs_it_claimed(db_url, conn, org, monkeypatch):
    """Each fallback claim commits on its own: an error after the first must not hide the ones committed."""
    org_id, _ = org
    a, b, job_a, job_b = await two_held_jobs(conn, org_id)
    queued = [(await submit(conn, org_id)).id for _ in range(3)]
    real, calls = claims.claim, []

    async def second_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise psycopg.errors.DeadlockDetected("deadlock detected")
        return await real(*args, **kwargs)

    monkeypatch.setattr(claims, "claim", second_fails)
    async with group_commit(db_url) as (group, _, tg):
        taken, bad = await in_one_batch(group, tg, [
            lambda: group.claim_many(node_id=a, organization_id=org_id, count=3, lease_seconds=60, stale_seconds=45),
            lambda: group.complete(organization_id=org_id, node_id=b, job_id=job_b, attempt=1, result={"bad": "\u0000"}),
        ])  # fmt: skip
    assert group.fallbacks == 1 and isinstance(bad, InvalidRequest)
    assert [c.job_id for c in taken] == queued[:1]
    running = await (await conn.execute(
        "SELECT id FROM jobs WHERE status = 'running' AND lease_owner = %s AND id = ANY(%s)", (a, queued))).fetchall()
    assert [r[0] for r in running] == queued[:1]  # every job leased to the node was answered


async def test_a_rollback_on_the_batchs_connection_costs_the_next_batch_no_fallback(db_url, conn, org):
    """psycopg deallocates every prepared statement of a session at a rollback, the batch's with its own."""
    org_id, _ = org
    node = await add_node(conn, org_id, "a", [CPU64])
    first, second = (await submit(conn, org_id)).id, (await submit(conn, org_id)).id
    async with AsyncConnectionPool(db_url, min_size=1, max_size=1, kwargs={"autocommit": True}, open=False) as pool:
        group = GroupCommit(pool, HintNotifier(pool))
        async with anyio.create_task_group() as tg:
            await tg.start(group.run)
            claim = lambda: group.claim(node_id=node, organization_id=org_id, lease_seconds=60, stale_seconds=45)  # noqa: E731
            assert (await claim()).job_id == first
            async with pool.connection() as shared:  # the same session, used by another command meanwhile
                for _ in range(10):
                    await shared.execute("SELECT count(*) FROM jobs WHERE organization_id = %s", (org_id,))
                with pytest.raises(Conflict):
                    async with shared.transaction():
                        raise Conflict("job_terminal", "refused after a read: rolled back")
            assert (await claim()).job_id == second
            tg.cancel_scope.cancel()
    assert group.fallbacks == 0


async def _now(value):
    return value


async def test_a_completion_sent_again_claims_nothing_in_a_batch_or_one_by_one(db_url, conn, org):
    """A completion with its next claim, sent again (the first answer lost), claims no second job, in a
    batch or in the one-by-one run of a batch that rolled back: that would lease a job to an agent that
    never hears of it. With no claim of the first request's to answer (this one completed on the
    single-command path), the next claim is ``None``."""
    org_id, _ = org
    a, b, job_a, job_b = await two_held_jobs(conn, org_id)
    await claims.complete(conn, organization_id=org_id, node_id=a, job_id=job_a, attempt=1, result={})
    queued = (await submit(conn, org_id)).id

    def again():
        return group.complete_and_claim(organization_id=org_id, node_id=a, job_id=job_a, attempt=1, result={},
                                        lease_seconds=60, stale_seconds=45)  # fmt: skip

    async with group_commit(db_url) as (group, _, tg):
        [(row, claimed)] = await in_one_batch(group, tg, [again])
        assert group.fallbacks == 0 and row.status == "complete" and claimed is None
        results = await in_one_batch(group, tg, [
            again,
            # PostgreSQL cannot store U+0000: the batch statement fails, and its commands run one by one.
            lambda: group.complete(organization_id=org_id, node_id=b, job_id=job_b, attempt=1, result={"bad": "\u0000"}),
        ])  # fmt: skip
    assert group.fallbacks == 1 and isinstance(results[1], InvalidRequest)
    row, claimed = results[0]
    assert row.status == "complete" and claimed is None
    status = (await (await conn.execute("SELECT status FROM jobs WHERE id = %s", (queued,))).fetchone())[0]
    assert status == "queued"


def report(group: GroupCommit, org_id, node_id, job_ids, claim_next: int):
    """A report of several results (each at attempt 1) that claims up to ``claim_next`` jobs."""
    return lambda: group.complete_many(organization_id=org_id, node_id=node_id, results=[(j, 1, {}) for j in job_ids],
                                       claim_next=claim_next)  # fmt: skip


async def one_node_holding(conn, org_id, count: int):
    """Node ``a`` holding ``count`` jobs (attempt 1), and one more job queued: ``(a, held, queued)``."""
    node = await add_node(conn, org_id, "a", [CPU64])
    held = [(await submit(conn, org_id)).id for _ in range(count)]
    for _ in held:
        await claim_now(conn, org_id, node)
    return node, held, (await submit(conn, org_id)).id


async def status_of(conn, job_id) -> str:
    return (await (await conn.execute("SELECT status FROM jobs WHERE id = %s", (job_id,))).fetchone())[0]


async def test_a_report_whose_completion_waits_in_the_next_batch_takes_its_claim_there(db_url, conn, org):
    """A renewal of the same job in the batch puts the report's completion off to the next batch; its
    claim goes with it, and that completion's event names what it claimed."""
    org_id, _ = org
    node, [held], queued = await one_node_holding(conn, org_id, 1)
    async with group_commit(db_url) as (group, _, tg):
        renewed, (answers, claimed) = await in_one_batch(group, tg, [
            lambda: group.renew(organization_id=org_id, node_id=node, job_id=held, attempt=1, lease_seconds=60),
            report(group, org_id, node, [held], 1),
        ])  # fmt: skip
    assert renewed.status == "running" and answers[0].status == "complete"
    assert [c.job_id for c in claimed] == [queued] and group.batches == 2
    metadata = (await (await conn.execute("SELECT metadata FROM events WHERE stream = %s AND type = 'job.completed'",
                                          (store.job_stream(held),))).fetchone())[0]  # fmt: skip
    assert metadata["next_claims"] == [str(queued)]


async def test_a_report_sent_twice_in_one_batch_claims_once_and_both_copies_answer_it(db_url, conn, org):
    org_id, _ = org
    node, held, queued = await one_node_holding(conn, org_id, 2)
    more = (await submit(conn, org_id)).id
    async with group_commit(db_url) as (group, _, tg):
        first, second = await in_one_batch(group, tg, [report(group, org_id, node, held, 2), report(group, org_id, node, held, 2)])
    assert [row.status for row in first[0]] == [row.status for row in second[0]] == ["complete", "complete"]
    assert [c.job_id for c in first[1]] == [c.job_id for c in second[1]] == [queued, more]
    running = await (await conn.execute("SELECT count(*) FROM jobs WHERE status = 'running'")).fetchone()
    assert running[0] == 2
    assert await verify(conn) == []


async def test_a_report_with_a_completion_run_alone_beside_the_batches_claims_nothing(db_url, conn, org):
    """A completion of the report whose row another transaction holds runs alone, beside the batches: the
    report's claim, which its events could not name, is not made; the job stays queued for the agent's
    long-poll."""
    org_id, _ = org
    node, held, queued = await one_node_holding(conn, org_id, 2)
    async with lock_held_for_a_second(db_url, "SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (held[1],)):
        async with group_commit(db_url) as (group, _, tg):
            [(answers, claimed)] = await in_one_batch(group, tg, [report(group, org_id, node, held, 1)])
    assert [row.status for row in answers] == ["complete", "complete"] and claimed == []
    assert await status_of(conn, queued) == "queued"
    assert await verify(conn) == []


async def test_a_report_in_a_batch_that_rolled_back_claims_nothing(db_url, conn, org):
    """Run one by one, the report's completion is its own transaction, which could not name a claim."""
    org_id, _ = org
    a, b, job_a, job_b = await two_held_jobs(conn, org_id)
    queued = (await submit(conn, org_id)).id
    async with group_commit(db_url) as (group, _, tg):
        (answers, claimed), bad = await in_one_batch(group, tg, [
            report(group, org_id, a, [job_a], 1),
            lambda: group.complete(organization_id=org_id, node_id=b, job_id=job_b, attempt=1, result={"bad": "\u0000"}),
        ])  # fmt: skip
    assert group.fallbacks == 1 and isinstance(bad, InvalidRequest)
    assert answers[0].status == "complete" and claimed == []
    assert await status_of(conn, queued) == "queued"
    assert await verify(conn) == []
