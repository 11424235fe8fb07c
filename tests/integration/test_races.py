"""Races: many claimers with the sweeper running, and the sweeper against a late completion.

Invariants pinned here:

* **no double claim** — a job is never claimed while a claim of it is held;
  attempts grow by one per claim (the fencing token);
* **exactly-once completion per fenced attempt** — a job completes at most once,
  and only by the attempt that held it;
* **the fenced answer wins** — a completion arriving after the lease ran out
  either lands (and the sweep then finds nothing) or is refused with 409
  ``job_not_claimed_by_this_node`` (the sweep requeued it); never both, and a
  completed job is never requeued.

The listener's reconnection is covered where its subscribers live
(``test_longpoll.py``: waiters woken after ``pg_terminate_backend``;
``test_sse.py``: streams survive it) and under load in ``test_chaos.py``.
"""

from __future__ import annotations

import anyio
import msgspec
import psycopg
import pytest

from bench.double_claims import Mix, audit_log, audit_streams, run
from umbra.compute import claims, jobs
from umbra.compute.claims import ChildRequest
from umbra.compute.pairing import issue_pairing_code, redeem_pairing_code
from umbra.compute.sweeper import sweep_once
from umbra.errors import Conflict
from umbra.events import store
from umbra.projections import jobs as queue
from umbra.settings import load_settings

from tests.helpers import bearer, until_done_or_waiting

from .queue_support import CPU64, add_node, beat, set_clock, spec, submit

pytestmark = pytest.mark.anyio

SETTINGS = load_settings({"UMBRA_LEASE_EXPIRED_DELAY_SECONDS": "0"})


def test_the_audit_catches_double_claims_second_completions_and_stale_attempts():
    ok = [("job:1", "job.submitted", None, None, None), ("job:1", "job.claimed", 1, None, None),
          ("job:1", "job.lease_expired", 1, None, True), ("job:1", "job.claimed", 2, None, None),
          ("job:1", "job.completed", 2, None, None)]  # fmt: skip
    assert audit_streams(ok).ok and audit_streams(ok).completions == 1
    double = ok[:2] + [("job:1", "job.claimed", 2, None, None)]
    assert "double claim" in audit_streams(double).violations[0]
    twice = ok + [("job:1", "job.completed", 2, None, None)]
    assert any("completed 2 times" in v for v in audit_streams(twice).violations)
    stale = ok[:4] + [("job:1", "job.completed", 1, None, None)]
    assert "names attempt 1 but 2 was held" in audit_streams(stale).violations[0]
    skipped = ok[:1] + [("job:1", "job.claimed", 2, None, None)]
    assert "does not follow" in audit_streams(skipped).violations[0]
    after_end = ok + [("job:1", "job.claimed", 3, None, None)]
    assert "after it ended" in audit_streams(after_end).violations[0]


@pytest.mark.slow
async def test_sixteen_agents_with_the_sweeper_racing_never_double_claim(db_url):
    audit, tally, _ = await run(db_url, claims_wanted=600, agents=16, nodes=8,
                                mix=Mix(fail=0.02, abandon=0.05, late=0.05), time_limit=90)  # fmt: skip
    assert audit.violations == []
    assert audit.claims >= 570 and audit.claims == tally.claims
    assert audit.claims > audit.jobs, "abandoned and retried jobs were claimed again"
    assert set(audit.statuses) <= {"complete", "failed"}


async def _claim_all(conn, org_id, node, count: int) -> list[claims.ClaimResult]:
    held = []
    while len(held) < count:
        got = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=1)
        assert got is not None
        held.append(got)
    return held


async def _complete(conn, org_id, node, held: claims.ClaimResult) -> str:
    try:
        await claims.complete(conn, organization_id=org_id, node_id=node, job_id=held.job_id, attempt=held.attempt,
                              result={"late": True})  # fmt: skip
        return "completed"
    except Conflict as exc:
        return exc.code


async def _after_claim(conn, job_id) -> list[str]:
    history = await store.read_stream(conn, store.job_stream(job_id))
    return [e.type for e in history if e.type not in ("job.submitted", "job.claimed")]


async def test_a_late_completion_after_the_sweep_is_refused_and_before_it_lands(conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "late", [CPU64])
    await jobs.submit(conn, org_id, [spec(), spec()], actor="t", batch=True)
    swept_first, completed_first = await _claim_all(conn, org_id, node, 2)
    await set_clock(conn, 5)
    # Completed first (a lapsed lease is still the holder's until swept): the sweep finds nothing.
    assert await _complete(conn, org_id, node, completed_first) == "completed"
    report = await sweep_once(conn, SETTINGS)
    assert report.leases_requeued == 1  # only the other one
    assert await _after_claim(conn, completed_first.job_id) == ["job.completed"]
    # Swept first: the late completion is refused and changes nothing.
    assert await _complete(conn, org_id, node, swept_first) == "job_not_claimed_by_this_node"
    assert await _after_claim(conn, swept_first.job_id) == ["job.lease_expired"]


async def test_the_sweeper_racing_late_completions_leaves_exactly_one_answer_per_job(db_url, conn, org, monkeypatch):
    from umbra.compute import sweeper as sweeper_module

    monkeypatch.setattr(sweeper_module, "SWEEP_BATCH", 2)  # small sweeps interleave with the completions
    org_id, _ = org
    node = await add_node(conn, org_id, "racer", [CPU64])
    count = 60
    await jobs.submit(conn, org_id, [spec(payload={"i": i}) for i in range(count)], actor="t", batch=True)
    held = await _claim_all(conn, org_id, node, count)
    answers: dict = {}

    async def completer(part: list[claims.ClaimResult]) -> None:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
            await set_clock(c, 5)
            for h in part:
                answers[h.job_id] = await _complete(c, org_id, node, h)

    async def sweeper() -> None:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
            await set_clock(c, 5)
            while len(answers) < count:
                await sweep_once(c, SETTINGS)
                await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(completer, held[i::4])
        tg.start_soon(sweeper)
    outcomes = {"completed": 0, "job_not_claimed_by_this_node": 0}
    for h in held:
        answer = answers[h.job_id]
        outcomes[answer] += 1
        after = await _after_claim(conn, h.job_id)
        if answer == "completed":
            assert after == ["job.completed"], f"a completed job was requeued: {after}"
        else:
            assert after == ["job.lease_expired"], after
    assert sum(outcomes.values()) == count
    audit = await audit_log(conn)
    assert audit.violations == [] and audit.completions == outcomes["completed"]


async def test_a_cancel_that_waited_for_a_decomposition_ends_the_children_it_made(db_url, conn, org):
    """The cancel read the tree before the children existed; once the parent's lock is granted it sees them."""
    from umbra.compute.claims import ChildRequest

    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    parent = (await jobs.submit(conn, org_id, [spec()], actor="t", batch=False))[0][0].id
    held = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60)
    assert held is not None and held.job_id == parent
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as agent, \
            await psycopg.AsyncConnection.connect(db_url, autocommit=True) as admin:  # fmt: skip
        cancelled: list = []

        async def run_cancel() -> None:
            cancelled.append(await jobs.cancel(admin, org_id, parent, actor="admin"))

        async with anyio.create_task_group() as tg:
            async with agent.transaction():  # the decomposition, not committed yet
                children = await claims.add_children(agent, organization_id=org_id, node_id=node, job_id=parent,
                                                     attempt=held.attempt, children=[ChildRequest(kind="c")] * 2)  # fmt: skip
                tg.start_soon(run_cancel)
                await until_done_or_waiting(conn, lambda: bool(cancelled))
    assert cancelled[0].status == "cancelled" and cancelled[0].children_total == 2
    assert {(await jobs.get_job(conn, org_id, c.id)).status for c in children} == {"cancelled"}
    assert await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60) is None


async def _paired(conn, org_id, name):
    issued = await issue_pairing_code(conn, org_id, name)
    redeemed = await redeem_pairing_code(conn, code=issued.code, name=name, source=f"test:{name}", devices=[CPU64])
    await beat(conn, org_id, redeemed.node_id, [CPU64])
    return redeemed.node_id, redeemed.credential


def _child(kind="part", **fields) -> ChildRequest:
    return msgspec.convert({"kind": kind, **fields}, ChildRequest)


async def _claim_every(conn, org_id, node) -> list:
    got = []
    while (c := await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=600)) is not None:
        got.append(c)
    return got


_WAITERS = """
SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
WHERE NOT l.granted AND a.datname = current_database()
"""


async def _lock_waiters(conn) -> int:
    return (await (await conn.execute(_WAITERS)).fetchone())[0]


async def _started_behind_a_lock(tg, conn, call) -> None:
    """Start ``call`` and return once a session waits for a lock (the one ``call`` now waits for)."""
    tg.start_soon(call)
    with anyio.fail_after(10):
        while await _lock_waiters(conn) < 1:
            await anyio.sleep(0.01)


async def _tree(conn, org_id, node):
    """A running root with a container child and leaves, the container with running grandchildren:
    ``(root, leaves, grandchildren)``, every job claimed by ``node``."""
    root = await submit(conn, org_id, priority=0)
    [got] = await _claim_every(conn, org_id, node)
    level1 = await claims.add_children(conn, organization_id=org_id, node_id=node, job_id=root.id, attempt=got.attempt,
                                       children=[_child(priority=1) for _ in range(11)])
    container, leaves = level1[0], level1[1:]
    await _claim_every(conn, org_id, node)
    level2 = await claims.add_children(conn, organization_id=org_id, node_id=node, job_id=container.id, attempt=1,
                                       children=[_child(priority=2) for _ in range(10)])
    await _claim_every(conn, org_id, node)
    return root, leaves, level2


async def test_cancelling_a_parent_while_its_children_complete_is_not_a_server_error(client, conn, org, db_url):
    """A batch completes a child and a grandchild of a tree, and a job outside it whose row another session
    holds, while the tree is cancelled. The batch skips the held row (it runs alone, beside the batches)
    and waits on none of the tree's rows in an order of its own: the cancel is answered 200, every result
    is answered, and the held job's completion lands once its row is let go."""
    org_id, api_key = org
    node, credential = await _paired(conn, org_id, "a")
    root, leaves, grandchildren = await _tree(conn, org_id, node)
    shallow, deep = min(leaf.id for leaf in leaves), max(g.id for g in grandchildren)
    outside = (await submit(conn, org_id, priority=3)).id
    await _claim_every(conn, org_id, node)

    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as t3:
        answers: dict = {}

        async def complete() -> None:
            answers["complete"] = await client.post("/v1/agent/complete", headers=bearer(credential), json={
                "results": [{"job_id": str(j), "attempt": 1, "result": {}} for j in (shallow, outside, deep)]})

        async def cancel() -> None:
            answers["cancel"] = await client.post(f"/v1/jobs/{root.id}/cancel", headers=bearer(api_key))

        async with anyio.create_task_group() as tg:
            async with t3.transaction():
                await t3.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (outside,))
                await _started_behind_a_lock(tg, conn, complete)  # the held job's completion, alone, waits for its row
                tg.start_soon(cancel)
                with anyio.fail_after(10):
                    while "cancel" not in answers:
                        await anyio.sleep(0.01)
    cancelled = answers["cancel"]
    assert cancelled.status_code == 200, f"{cancelled.status_code} {cancelled.text[:300]}"
    assert cancelled.json()["status"] == "cancelled"
    results = {r["job_id"]: r for r in answers["complete"].json()["results"]}
    assert results[str(outside)]["status"] == 200 and results[str(outside)]["job"]["status"] == "complete"
    for job_id in (shallow, deep):  # completed before the cancel locked them, or refused as cancelled: no 500
        assert results[str(job_id)]["status"] in (200, 409), results[str(job_id)]
    assert (await queue.load(conn, root.id, org_id)).status == "cancelled"


async def test_a_cancel_that_deadlocks_with_another_transaction_starts_over(client, conn, org, db_url):
    """The cancel locks a tree deepest first. Another transaction holding a child and then asking for a
    grandchild the cancel holds makes a deadlock; PostgreSQL ends the cancel (it waited longest), which
    gives its locks back and starts over, rather than answer 500 for an ordinary cancel."""
    org_id, api_key = org
    node, _ = await _paired(conn, org_id, "a")
    root, leaves, grandchildren = await _tree(conn, org_id, node)
    shallow, deep = min(leaf.id for leaf in leaves), max(g.id for g in grandchildren)
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as t3:
        answers: dict = {}

        async def cancel() -> None:
            answers["cancel"] = await client.post(f"/v1/jobs/{root.id}/cancel", headers=bearer(api_key))

        async with anyio.create_task_group() as tg:
            async with t3.transaction():
                await t3.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (shallow,))
                await _started_behind_a_lock(tg, conn, cancel)  # the cancel holds the grandchildren, waits for `shallow`
                await t3.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (deep,))  # granted once the cancel gives up
            # t3 lets go: the cancel, started over, goes through.
    cancelled = answers["cancel"]
    assert cancelled.status_code == 200, f"{cancelled.status_code} {cancelled.text[:300]}"
    assert cancelled.json()["status"] == "cancelled"
    assert (await queue.load(conn, root.id, org_id)).status == "cancelled"
