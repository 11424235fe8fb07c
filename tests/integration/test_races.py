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
import psycopg
import pytest

from bench.double_claims import Mix, audit_log, audit_streams, run
from umbra.compute import claims, jobs
from umbra.compute.sweeper import sweep_once
from umbra.errors import Conflict
from umbra.events import store
from umbra.settings import load_settings

from tests.helpers import until_done_or_waiting

from .queue_support import CPU64, add_node, set_clock, spec

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

