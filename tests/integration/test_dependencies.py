"""Jobs that run after others (``depends_on``): a job waits, blocked, until every job it depends on completes,
then is queued as a new job is; it fails when one of them ends otherwise, and its own dependents after it. A
refusal writes nothing; the views still agree with the log."""

from __future__ import annotations

import dataclasses
import uuid

import anyio
import psycopg
import pytest

from tests.helpers import bearer, eventually
from umbra import metrics
from umbra.api.app import all_routes
from umbra.api.openapi import build_document
from umbra.compute import claims, dependencies, jobs, retries
from umbra.compute.accounts import create_organization
from umbra.compute.blocked import reexamine_waiting_jobs
from umbra.compute.dependencies import MAX_ROUNDS, PAGE
from umbra.compute.sweeper import sweep_once
from umbra.errors import Conflict, InvalidRequest
from umbra.events import store
from umbra.events.types import JobUnblocked
from umbra.projections import jobs as queue
from umbra.projections.verify import verify
from umbra.settings import load_settings

from .queue_support import CPU8, CPU64, add_node, http_claim, http_complete, http_pair, set_clock, spec, submit, written
from .test_claim_fencing import child

pytestmark = pytest.mark.anyio

SETTINGS = load_settings({})


async def row(conn, org_id, job_id) -> queue.JobRow:
    found = await queue.load(conn, job_id, org_id)
    assert found is not None
    return found


async def history(conn, job_id) -> list[tuple[str, dict]]:
    cursor = await conn.execute("SELECT type, data FROM events WHERE stream = %s ORDER BY version", (store.job_stream(job_id),))
    return [(t, d) for t, d in await cursor.fetchall()]


async def sweep_while_held(db_url, conn, job_id):
    """A sweeper tick while another transaction holds ``job_id``'s row (it must not wait for it)."""
    async with await psycopg.AsyncConnection.connect(db_url) as other:
        await other.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (job_id,))
        with anyio.fail_after(10):
            return await sweep_once(conn, SETTINGS)


async def released(conn, org_id, job_id) -> None:
    """A sweep, then ``job_id`` queued: by that sweep, or by a live server's own sweeper, which may hold the
    row (the sweep then passes it over) until its release commits."""
    await sweep_once(conn, SETTINGS)
    assert await eventually(lambda: _queued(conn, org_id, job_id))


async def _queued(conn, org_id, job_id) -> bool:
    return (await row(conn, org_id, job_id)).status == "queued"


async def run(conn, org_id, node, job_id, *, fail: str | None = None) -> None:
    """Claim ``job_id`` on ``node`` (it must be the one claimed) and complete it, or fail it for good."""
    claimed = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60)
    assert claimed is not None and claimed.row.id == job_id, claimed
    if fail is None:
        await claims.complete(conn, organization_id=org_id, node_id=node, job_id=job_id, attempt=claimed.row.attempt, result={})
    else:
        await claims.fail(conn, organization_id=org_id, node_id=node, job_id=job_id, attempt=claimed.row.attempt,
                          error=fail, retry=False)  # fmt: skip


async def test_a_job_waits_for_every_job_it_depends_on_then_is_claimed(conn, org):
    """C depends on A and B: blocked, waiting for both, not claimed while they run; the sweeper leaves it after
    A alone completes and releases it once B does too. Its history says what it waited for and why it ran."""
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    a, b = await submit(conn, org_id, "a"), await submit(conn, org_id, "b")
    c = await submit(conn, org_id, "c", depends_on=[str(a.id), str(b.id)])
    assert (c.status, c.awaiting_dependencies, c.depends_on) == ("blocked", True, (a.id, b.id))
    assert c.blocked_reason == "waiting for 2 jobs it depends on to complete"
    await run(conn, org_id, node, a.id)
    assert (await sweep_once(conn, SETTINGS)).dependencies_released == 0
    assert (await row(conn, org_id, c.id)).status == "blocked"
    await run(conn, org_id, node, b.id)
    assert (await sweep_once(conn, SETTINGS)).dependencies_released == 1
    released = await row(conn, org_id, c.id)
    assert (released.status, released.awaiting_dependencies, released.blocked_reason) == ("queued", False, None)
    await run(conn, org_id, node, c.id)
    events = await history(conn, c.id)
    assert [t for t, _ in events] == ["job.submitted", "job.blocked", "job.unblocked", "job.claimed", "job.completed"]
    assert events[0][1]["depends_on"] == [str(a.id), str(b.id)]
    assert events[1][1]["waiting_on"] == [str(a.id), str(b.id)]
    assert events[2][1]["reason"] == "dependencies_complete"
    assert await verify(conn) == []


async def test_a_job_whose_dependencies_completed_already_is_queued_at_once_and_says_what_it_depends_on(conn, org):
    """Only the dependencies not yet complete are waited for; none left: queued, no ``job.blocked``; the Job
    object lists ``depends_on`` all the same. A repeated id counts once."""
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    a, b = await submit(conn, org_id, "a"), await submit(conn, org_id, "b")
    await run(conn, org_id, node, a.id)
    c = await submit(conn, org_id, "c", depends_on=[str(a.id), str(a.id)])
    assert (c.status, c.depends_on, c.awaiting_dependencies) == ("queued", (a.id,), False)
    assert queue.to_json(c)["depends_on"] == [str(a.id)]
    d = await submit(conn, org_id, "d", depends_on=[str(a.id), str(b.id)])
    assert d.blocked_reason == "waiting for 1 job it depends on to complete"
    assert (await history(conn, d.id))[1][1]["waiting_on"] == [str(b.id)]
    assert [t for t, _ in await history(conn, c.id)] == ["job.submitted"]


async def test_a_failed_dependency_fails_the_whole_chain_after_it_in_one_tick(conn, org):
    """B depends on A, C on B, D on C and on an unrelated E: A fails for good; one tick fails B, C and D
    (``dependency_failed``, each naming its own dependency), charging no run; E is untouched."""
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    a, e = await submit(conn, org_id, "a"), await submit(conn, org_id, "e")
    b = await submit(conn, org_id, "b", depends_on=[str(a.id)])
    c = await submit(conn, org_id, "c", depends_on=[str(b.id)])
    d = await submit(conn, org_id, "d", depends_on=[str(e.id), str(c.id)])
    await run(conn, org_id, node, a.id, fail="out of disk")
    report = await sweep_once(conn, SETTINGS)
    assert (report.dependencies_failed, report.dependencies_released) == (3, 0)
    for job, cause in ((b, a), (c, b), (d, c)):
        failed = await row(conn, org_id, job.id)
        assert (failed.status, failed.attempt, failed.awaiting_dependencies) == ("failed", 0, False)
        assert failed.error == f"Job {cause.id}, which this job depends on, ended failed."
        assert (await history(conn, job.id))[-1][1]["reason"] == "dependency_failed"
    assert (await row(conn, org_id, e.id)).status == "queued"
    assert await verify(conn) == []


async def test_a_cancelled_dependency_fails_its_dependents(conn, org):
    org_id, _ = org
    a = await submit(conn, org_id, "a")
    b = await submit(conn, org_id, "b", depends_on=[str(a.id)])
    await jobs.cancel(conn, org_id, a.id, actor="ops")
    assert (await sweep_once(conn, SETTINGS)).dependencies_failed == 1
    assert (await row(conn, org_id, b.id)).error == f"Job {a.id}, which this job depends on, ended cancelled."


async def test_a_waiting_job_is_neither_timed_out_nor_released_by_the_fleet(conn, org):
    """Two days waiting (past the blocked timeout) behind a running job: still waiting. A re-examination of
    the fleet (which unblocks blocked jobs a device could now run) leaves it waiting too."""
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    a = await submit(conn, org_id, "a")
    b = await submit(conn, org_id, "b", depends_on=[str(a.id)])
    await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=10**6)
    await set_clock(conn, 2 * 86400)
    report = await sweep_once(conn, SETTINGS)
    assert (report.blocked_failed, report.dependencies_failed, report.dependencies_released) == (0, 0, 0)
    await reexamine_waiting_jobs(conn, org_id)
    waiting = await row(conn, org_id, b.id)
    assert (waiting.status, waiting.awaiting_dependencies) == ("blocked", True)


async def test_a_released_job_nothing_could_run_is_blocked_for_that_and_times_out_as_any(conn, org):
    """Released, C needs more memory than the fleet has: blocked with the shortfall (no longer waiting), and
    the blocked timeout then applies to it as to any blocked job."""
    org_id, _ = org
    node = await add_node(conn, org_id, "small", [CPU8])
    a = await submit(conn, org_id, "a")
    c = await submit(conn, org_id, "c", depends_on=[str(a.id)], requires={"ram_min_mb": 32000})
    await run(conn, org_id, node, a.id)
    assert (await sweep_once(conn, SETTINGS)).dependencies_released == 1
    blocked = await row(conn, org_id, c.id)
    assert (blocked.status, blocked.awaiting_dependencies) == ("blocked", False)
    assert "32000" in blocked.blocked_reason
    assert [t for t, _ in await history(conn, c.id)][-2:] == ["job.unblocked", "job.blocked"]
    await set_clock(conn, 2 * 86400)
    assert (await sweep_once(conn, SETTINGS)).blocked_failed == 1


async def test_a_dependent_retried_after_its_dependency_waits_for_it_again(conn, org):
    """A fails, so B fails. B cannot be retried while A stays failed (it would only fail again); A retried,
    B retried waits for A, and runs once A completes."""
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    a = await submit(conn, org_id, "a")
    b = await submit(conn, org_id, "b", depends_on=[str(a.id)])
    await run(conn, org_id, node, a.id, fail="flaky")
    await sweep_once(conn, SETTINGS)
    with pytest.raises(Conflict) as refused:
        await retries.retry(conn, org_id, b.id, actor="ops")
    assert refused.value.code == "job_not_retryable" and str(a.id) in refused.value.message
    await retries.retry(conn, org_id, a.id, actor="ops")
    again = await retries.retry(conn, org_id, b.id, actor="ops")
    assert (again.status, again.awaiting_dependencies) == ("blocked", True)
    await run(conn, org_id, node, a.id)
    assert (await sweep_once(conn, SETTINGS)).dependencies_released == 1
    await run(conn, org_id, node, b.id)
    assert [t for t, _ in await history(conn, b.id)] == [
        "job.submitted", "job.blocked", "job.failed", "job.retried", "job.blocked", "job.unblocked", "job.claimed",
        "job.completed",
    ]  # fmt: skip
    assert await verify(conn) == []


async def test_a_large_batch_of_dependents_is_written_and_released_page_by_page(conn, org):
    """More dependents than the COPY path's threshold and than a page of the sweeper's: every row carries its
    dependency (COPY writes the array), and one tick releases them all; a rebuild agrees."""
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    a = await submit(conn, org_id, "a")
    count = 2 * PAGE + 7
    rows, created = await jobs.submit(conn, org_id, [spec("d", depends_on=[str(a.id)]) for _ in range(count)],
                                      actor="test", batch=True)  # fmt: skip
    assert created == count and all(r.depends_on == (a.id,) and r.awaiting_dependencies for r in rows)
    stored = await (await conn.execute("SELECT count(*) FROM jobs WHERE depends_on = %s AND awaiting_dependencies",
                                       ([a.id],))).fetchone()  # fmt: skip
    assert stored == (count,)
    await run(conn, org_id, node, a.id)
    assert (await sweep_once(conn, SETTINGS)).dependencies_released == count
    assert (await (await conn.execute("SELECT count(*) FROM jobs WHERE status = 'queued'")).fetchone()) == (count,)
    assert await verify(conn) == []


async def test_a_waiting_job_held_by_another_transaction_is_left_for_the_next_tick(db_url, conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    a = await submit(conn, org_id, "a")
    b = await submit(conn, org_id, "b", depends_on=[str(a.id)])
    await run(conn, org_id, node, a.id)
    assert (await sweep_while_held(db_url, conn, b.id)).dependencies_released == 0
    assert (await sweep_once(conn, SETTINGS)).dependencies_released == 1



async def test_a_leader_with_prompt_looks_catches_what_they_passed_over_at_its_second_look(db_url, conn, org, monkeypatch):
    """A leader hearing the log move (``LogMoved``, as the server's listener feeds it): D (on C) is released by
    a prompt look. B's row is held while A, its dependency, completes: the prompt look passes it over, and
    nothing moves B's stream after. The ticks in between leave it (the whole look runs with the second look,
    every ``REEXAMINE_SECONDS``, not every tick); the next second look releases it."""
    import functools

    from umbra.compute import sweeper

    monkeypatch.setattr(sweeper, "REEXAMINE_SECONDS", 4.0)
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    c = await submit(conn, org_id, "c")
    d = await submit(conn, org_id, "d", depends_on=[str(c.id)])
    a = await submit(conn, org_id, "a")
    b = await submit(conn, org_id, "b", depends_on=[str(a.id)])
    moved = sweeper.LogMoved()
    settings = dataclasses.replace(SETTINGS, sweep_interval_seconds=0.05)
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(sweeper.run, settings, db_url, retry_seconds=0.1, log_moved=moved))
        await run(conn, org_id, node, c.id)
        moved.on_hint(org_id, 0, 0)
        assert await eventually(lambda: _queued(conn, org_id, d.id))  # the leader leads, and looks promptly
        await run(conn, org_id, node, d.id)
        async with await psycopg.AsyncConnection.connect(db_url) as other:
            await other.execute("BEGIN")
            await other.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (b.id,))
            await run(conn, org_id, node, a.id)
            moved.on_hint(org_id, 0, 0)
            await anyio.sleep(0.5)  # a prompt look (within 0.1 s) passes B over
            await other.execute("ROLLBACK")
        await anyio.sleep(0.5)  # ten ticks
        assert (await row(conn, org_id, b.id)).status == "blocked"
        assert await eventually(lambda: _queued(conn, org_id, b.id), timeout=10)
        tg.cancel_scope.cancel()
    assert await verify(conn) == []


async def _leading(conn, org_id, node, moved) -> None:
    """A first pipeline step through the prompt look: the leader leads, and its first tick is behind it."""
    c = await submit(conn, org_id, "c")
    d = await submit(conn, org_id, "d", depends_on=[str(c.id)])
    await anyio.sleep(0.3)
    await run(conn, org_id, node, c.id)
    moved.on_hint(org_id, 0, 0)
    assert await eventually(lambda: _queued(conn, org_id, d.id))
    await run(conn, org_id, node, d.id)  # out of the way of the next claim


async def test_a_leader_looks_from_its_last_position_each_tick_so_a_lost_hint_or_a_failed_look_costs_a_tick(
    db_url, conn, org, monkeypatch
):
    """No hint at all after A's completion (a NOTIFY that failed): the next tick's look from the last position
    releases B. Then a look that raises, with no hint after it: the position stays, and the next tick releases
    D. Neither waits for the whole look (``REEXAMINE_SECONDS``, ten minutes here)."""
    import functools

    from umbra.compute import sweeper

    monkeypatch.setattr(sweeper, "REEXAMINE_SECONDS", 600.0)
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    moved = sweeper.LogMoved()
    real, failing = dependencies.release_moved, []

    async def failing_once(conn_, after, **kw):
        if failing:
            failing.clear()
            raise RuntimeError("a look that fails")
        return await real(conn_, after, **kw)

    monkeypatch.setattr(dependencies, "release_moved", failing_once)
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(sweeper.run, dataclasses.replace(SETTINGS, sweep_interval_seconds=0.1), db_url,
                                        retry_seconds=0.1, log_moved=moved))  # fmt: skip
        await _leading(conn, org_id, node, moved)
        for step in ("no hint", "a failed look"):
            a = await submit(conn, org_id, "a")
            b = await submit(conn, org_id, "b", depends_on=[str(a.id)])
            failing[:] = [True] if step == "a failed look" else []
            await run(conn, org_id, node, a.id)
            assert await eventually(lambda: _queued(conn, org_id, b.id), timeout=3), step
            assert not failing  # the failing look ran, and a later one released B
            await run(conn, org_id, node, b.id)
        tg.cancel_scope.cancel()


async def test_a_dependent_submitted_while_no_job_waited_is_released_as_its_dependency_ends_not_a_pause_later(
    db_url, conn, org, monkeypatch
):
    """While no job waits, the leader looks at waiting jobs at most every ``IDLE_LOOK_SECONDS`` (a minute here;
    its ticks an hour apart). B's submission says that a job began waiting (``WAITING_CHANNEL``, through the
    listener, as the server wires it): the leader looks at once, finds B waiting, and so looks again when A's
    completion moves the log. B is queued within seconds of A's completion, not up to a minute later. Only
    the submission that set a job aside says so."""
    import functools

    from umbra.compute import sweeper
    from umbra.events.listener import LogListener

    monkeypatch.setattr(sweeper, "IDLE_LOOK_SECONDS", 60.0)
    monkeypatch.setattr(sweeper, "REEXAMINE_SECONDS", 3600.0)
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    moved, heard = sweeper.LogMoved(), []
    listener = LogListener(db_url)
    listener.on_hint(moved.on_hint)
    listener.on_waiting(moved.on_waiting)
    listener.on_waiting(heard.append)
    async with anyio.create_task_group() as tg:
        await tg.start(listener.run)
        tg.start_soon(functools.partial(sweeper.run, dataclasses.replace(SETTINGS, sweep_interval_seconds=3600), db_url,
                                        retry_seconds=0.1, log_moved=moved))  # fmt: skip
        first = await submit(conn, org_id, "first")
        await anyio.sleep(0.5)  # the leader leads, and has taken its first tick
        await run(conn, org_id, node, first.id)
        await anyio.sleep(0.5)  # the move's look found no job waiting: the leader pauses
        a = await submit(conn, org_id, "a")
        b = await submit(conn, org_id, "b", depends_on=[str(a.id)])
        assert await eventually(lambda: _listed(heard))
        await run(conn, org_id, node, a.id)
        assert await eventually(lambda: _queued(conn, org_id, b.id), timeout=10)
        tg.cancel_scope.cancel()
    assert heard == [org_id]


async def _listed(items: list) -> bool:
    return bool(items)


async def test_a_dependent_passed_over_for_a_fleet_change_is_released_at_the_next_tick(db_url, conn, org, monkeypatch):
    """A fleet change holds the organization's capacity lock while A completes: the prompt look passes B over
    (its release must be judged against the fleet) and says so; the tick after it takes the whole look, which
    releases B once the change has ended, not at the next second look (ten minutes here)."""
    import functools

    from umbra.compute import sweeper
    from umbra.compute.blocked import hold_capacity

    monkeypatch.setattr(sweeper, "REEXAMINE_SECONDS", 600.0)
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    moved = sweeper.LogMoved()
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(sweeper.run, dataclasses.replace(SETTINGS, sweep_interval_seconds=0.2), db_url,
                                        retry_seconds=0.1, log_moved=moved))  # fmt: skip
        await _leading(conn, org_id, node, moved)
        a = await submit(conn, org_id, "a")
        b = await submit(conn, org_id, "b", depends_on=[str(a.id)])
        async with await psycopg.AsyncConnection.connect(db_url) as other:
            async with other.transaction():
                await hold_capacity(other, org_id, exclusive=True)
                await run(conn, org_id, node, a.id)
                moved.on_hint(org_id, 0, 0)
                await anyio.sleep(0.5)
                assert (await row(conn, org_id, b.id)).status == "blocked"
        assert await eventually(lambda: _queued(conn, org_id, b.id), timeout=3)
        tg.cancel_scope.cancel()

# -- through the routes ---------------------------------------------------------------------------------------


async def test_refusals_name_the_dependency_and_write_nothing(client, org, db_url, conn):
    """An id of no job, another organization's job, a job that failed or was cancelled, more than 100: each
    refused (404 ``job_not_found``, 409 ``dependency_failed``, 422), a batch naming the item; nothing written."""
    org_id, key = org
    other_org, _ = await create_organization(conn, "other")
    theirs = await submit(conn, other_org, "theirs")
    cancelled = await submit(conn, org_id, "x")
    await jobs.cancel(conn, org_id, cancelled.id, actor="ops")
    ours = await submit(conn, org_id, "ours")
    before = await written(db_url)
    for depends_on, status, code in (([str(uuid.uuid4())], 404, "job_not_found"), ([str(theirs.id)], 404, "job_not_found"),
                                     ([str(ours.id), str(cancelled.id)], 409, "dependency_failed"),
                                     ([str(uuid.uuid4()) for _ in range(101)], 422, "invalid_request"),
                                     (["not-a-uuid"], 422, "invalid_request")):  # fmt: skip
        one = await client.post("/v1/jobs", json={"kind": "k", "depends_on": depends_on}, headers=bearer(key))
        assert (one.status_code, one.json()["error"]) == (status, code), one.text
        batch = await client.post("/v1/jobs/batch", json={"jobs": [{"kind": "k"}, {"kind": "k", "depends_on": depends_on}]},
                                  headers=bearer(key))  # fmt: skip
        assert (batch.status_code, batch.json()["error"]) == (status, code), batch.text
        assert batch.json().get("index") == 1, batch.text
    refused = await client.post("/v1/jobs", json={"kind": "k", "depends_on": [str(cancelled.id)]}, headers=bearer(key))
    assert refused.json()["dependency"] == str(cancelled.id) and refused.json()["status"] == "cancelled"
    assert str(theirs.id) not in (await client.get("/v1/jobs", headers=bearer(key))).text
    assert await written(db_url) == before


async def test_an_idempotent_repeat_answers_the_first_job_even_after_its_dependency_failed(client, org, conn):
    org_id, key = org
    a = await submit(conn, org_id, "a")
    body = {"kind": "k", "depends_on": [str(a.id)], "idempotency_key": "step-2"}
    first = await client.post("/v1/jobs", json=body, headers=bearer(key))
    assert (first.status_code, first.json()["status"], first.json()["depends_on"]) == (201, "blocked", [str(a.id)])
    await jobs.cancel(conn, org_id, a.id, actor="ops")
    again = await client.post("/v1/jobs", json=body, headers=bearer(key))
    assert (again.status_code, again.json()["id"]) == (200, first.json()["id"])


async def test_the_server_releases_a_dependent_and_explain_says_what_it_waits_for(client, org):
    """Through the routes and the server's own sweeper: explain lists each dependency with its status while
    C waits; once the agent completes A and B, C is queued by the next tick and claimed."""
    _, key = org
    _, credential = await http_pair(client, key)
    ids = []
    for kind in ("a", "b"):
        answer = await client.post("/v1/jobs", json={"kind": kind}, headers=bearer(key))
        ids.append(answer.json()["id"])
    c = (await client.post("/v1/jobs", json={"kind": "c", "depends_on": ids}, headers=bearer(key))).json()
    assert (c["status"], c["depends_on"]) == ("blocked", ids)
    explained = (await client.get(f"/v1/jobs/{c['id']}/explain", headers=bearer(key))).json()
    assert explained["dependencies"] == [{"job_id": ids[0], "status": "queued"}, {"job_id": ids[1], "status": "queued"}]
    assert explained["summary"].startswith("Waiting for 2 of the 2 jobs it depends on to complete")
    for _ in ids:
        await http_complete(client, credential, await http_claim(client, credential))
    with anyio.fail_after(15):
        while (await client.get(f"/v1/jobs/{c['id']}", headers=bearer(key))).json()["status"] != "queued":
            await anyio.sleep(0.05)
    assert (await http_claim(client, credential))["id"] == c["id"]


async def test_each_organization_sees_only_its_own_dependents_released(conn, org):
    """Two organizations' dependents of their own jobs: each released by its own job's completion, the
    other's left waiting."""
    org_id, _ = org
    other_org, _ = await create_organization(conn, "other")
    node = await add_node(conn, org_id, "box", [CPU64])
    a = await submit(conn, org_id, "a")
    b = await submit(conn, org_id, "b", depends_on=[str(a.id)])
    theirs = await submit(conn, other_org, "a")
    their_b = await submit(conn, other_org, "b", depends_on=[str(theirs.id)])
    await run(conn, org_id, node, a.id)
    assert (await sweep_once(conn, dataclasses.replace(SETTINGS))).dependencies_released == 1
    assert (await row(conn, org_id, b.id)).status == "queued"
    assert (await row(conn, other_org, their_b.id)).status == "blocked"


async def test_a_batch_submits_a_pipeline_whose_steps_name_earlier_items_by_number(client, org, conn, db_url):
    """``prepare``, ``train`` after item 0, ``evaluate`` after item 1 and a job submitted before, in one batch:
    each waits for its own; they run in order as each completes. A number outside a batch, or naming the
    item itself or a later one, is refused (422, the item's index), nothing written."""
    org_id, key = org
    node = await add_node(conn, org_id, "box", [CPU64])
    earlier = await submit(conn, org_id, "fetch")
    answer = await client.post("/v1/jobs/batch", headers=bearer(key), json={"jobs": [
        {"kind": "prepare"}, {"kind": "train", "depends_on": [0]},
        {"kind": "evaluate", "depends_on": [1, str(earlier.id), 1]}]})  # fmt: skip
    assert answer.status_code == 201, answer.text
    prepare, train, evaluate = answer.json()["jobs"]
    assert (prepare["status"], train["status"], evaluate["status"]) == ("queued", "blocked", "blocked")
    assert (train["depends_on"], evaluate["depends_on"]) == ([prepare["id"]], [train["id"], str(earlier.id)])
    before = await written(db_url)
    for body, path, index in (({"kind": "k", "depends_on": [0]}, "/v1/jobs", None),
                              ({"jobs": [{"kind": "k"}, {"kind": "k", "depends_on": [1]}]}, "/v1/jobs/batch", 1),
                              ({"jobs": [{"kind": "k", "depends_on": [5]}]}, "/v1/jobs/batch", 0),
                              ({"jobs": [{"kind": "k", "depends_on": [-1]}]}, "/v1/jobs/batch", 0)):  # fmt: skip
        refused = await client.post(path, json=body, headers=bearer(key))
        assert (refused.status_code, refused.json()["error"]) == (422, "invalid_request"), refused.text
        assert refused.json().get("index") == index, refused.text
    assert await written(db_url) == before
    for step in (earlier.id, uuid.UUID(prepare["id"])):
        await run(conn, org_id, node, step)
    await released(conn, org_id, uuid.UUID(train["id"]))
    assert (await row(conn, org_id, uuid.UUID(evaluate["id"]))).status == "blocked"
    await run(conn, org_id, node, uuid.UUID(train["id"]))
    await released(conn, org_id, uuid.UUID(evaluate["id"]))
    await run(conn, org_id, node, uuid.UUID(evaluate["id"]))
    assert await verify(conn) == []


async def test_a_batch_item_may_depend_on_an_earlier_item_an_idempotency_key_answered(client, org, conn):
    """The earlier item is a job submitted before under the same key: its id and its status count (cancelled:
    the batch is refused 409 ``dependency_failed``, naming the later item)."""
    org_id, key = org
    first = (await client.post("/v1/jobs", json={"kind": "prepare", "idempotency_key": "prep"}, headers=bearer(key))).json()
    body = {"jobs": [{"kind": "prepare", "idempotency_key": "prep"}, {"kind": "train", "depends_on": [0]}]}
    answer = await client.post("/v1/jobs/batch", json=body, headers=bearer(key))
    assert answer.json()["jobs"][0]["id"] == first["id"] and answer.json()["jobs"][1]["depends_on"] == [first["id"]]
    await jobs.cancel(conn, org_id, uuid.UUID(first["id"]), actor="ops")
    refused = await client.post("/v1/jobs/batch", json=body, headers=bearer(key))
    assert (refused.status_code, refused.json()["error"], refused.json()["index"]) == (409, "dependency_failed", 1)


async def test_a_container_is_a_dependency_as_any_job_its_settlement_releasing_or_failing_its_dependent(conn, org):
    """D depends on a job that then splits into children: D waits while they run; the container settling
    ``complete`` releases it, ``partial`` fails it (and a retry of D is refused while that stands)."""
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    for outcomes, status in ((("complete", "complete"), "queued"), (("complete", "failed"), "failed")):
        parent = await submit(conn, org_id, "p")
        dependent = await submit(conn, org_id, "d", depends_on=[str(parent.id)])
        got = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=600)
        made = await claims.add_children(conn, organization_id=org_id, node_id=node, job_id=parent.id,
                                         attempt=got.row.attempt, children=[child("c0"), child("c1")])  # fmt: skip
        assert (await sweep_once(conn, SETTINGS)).dependencies_released == 0
        for kid, outcome in zip(made, outcomes):
            await run(conn, org_id, node, kid.id, fail=None if outcome == "complete" else "broken")
        await sweep_once(conn, SETTINGS)
        assert (await row(conn, org_id, dependent.id)).status == status
        if status == "queued":
            await run(conn, org_id, node, dependent.id)
    assert (await row(conn, org_id, dependent.id)).error == f"Job {parent.id}, which this job depends on, ended partial."
    with pytest.raises(Conflict):
        await retries.retry(conn, org_id, dependent.id, actor="ops")
    assert await verify(conn) == []


async def test_a_dependent_cancelled_while_waiting_stays_cancelled_however_its_dependency_ends(conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    for fail in (None, "no"):
        a = await submit(conn, org_id, "a")
        b = await submit(conn, org_id, "b", depends_on=[str(a.id)])
        cancelled = await jobs.cancel(conn, org_id, b.id, actor="ops", if_waiting=True)
        assert (cancelled.status, cancelled.awaiting_dependencies) == ("cancelled", False)
        await run(conn, org_id, node, a.id, fail=fail)
        report = await sweep_once(conn, SETTINGS)
        assert (report.dependencies_released, report.dependencies_failed) == (0, 0)
        assert [t for t, _ in await history(conn, b.id)] == ["job.submitted", "job.blocked", "job.cancelled"]


async def test_a_dependency_retried_or_requeued_before_the_sweeper_looked_keeps_its_dependent_waiting(conn, org):
    """A failed, then retried, before any tick; C's dependency fails retryably (requeued): neither dependent
    fails; each is released once its dependency completes."""
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    a = await submit(conn, org_id, "a")
    b = await submit(conn, org_id, "b", depends_on=[str(a.id)])
    await run(conn, org_id, node, a.id, fail="flaky")
    await retries.retry(conn, org_id, a.id, actor="ops")
    c_dep = await submit(conn, org_id, "c-dep", max_attempts=3)
    c = await submit(conn, org_id, "c", depends_on=[str(c_dep.id)])
    await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=600)  # a
    got = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=600)
    assert got.row.id == c_dep.id
    await claims.fail(conn, organization_id=org_id, node_id=node, job_id=c_dep.id, attempt=got.row.attempt, error="x",
                      retry=True)  # fmt: skip
    report = await sweep_once(conn, SETTINGS)
    assert (report.dependencies_failed, report.dependencies_released) == (0, 0)
    assert [(await row(conn, org_id, j.id)).awaiting_dependencies for j in (b, c)] == [True, True]


async def submitted_while_completing(db_url, conn, org_id) -> tuple[queue.JobRow, queue.JobRow]:
    """``(a, b)``: B submitted depending on A while A's completion is in flight (uncommitted): the submission
    reads A running and writes B waiting; A's completion commits first (B's append waits for its lock)."""
    node = await add_node(conn, org_id, "box", [CPU64])
    a = await submit(conn, org_id, "a")
    got = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=600)
    async with await psycopg.AsyncConnection.connect(db_url) as other:  # an open transaction
        await other.execute("SELECT 1")
        await claims.complete(other, organization_id=org_id, node_id=node, job_id=a.id, attempt=got.row.attempt, result={})
        submitted: list[queue.JobRow] = []

        async def submit_b() -> None:
            submitted.append(await submit(conn, org_id, "b", depends_on=[str(a.id)]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(submit_b)  # reads a as running, then waits for the log's lock the completion holds
            await anyio.sleep(0.5)
            await other.commit()
    (b,) = submitted
    assert (b.status, b.awaiting_dependencies) == ("blocked", True)
    return a, b


async def test_a_dependent_submitted_while_its_dependency_completes_is_released_by_the_next_tick(db_url, conn, org):
    """Once the completion commits, the next tick releases the dependent (the look reads afresh)."""
    await submitted_while_completing(db_url, conn, org[0])
    assert (await sweep_once(conn, SETTINGS)).dependencies_released == 1


async def test_a_dependent_submitted_while_its_dependency_completes_is_released_by_the_prompt_look(db_url, conn, org):
    """A prompt look from just after A's completion (its dependency's end behind it) still releases B: it looks
    at the waiting jobs whose own streams moved, not only at the dependents of those that did."""
    a, b = await submitted_while_completing(db_url, conn, org[0])
    [(completed_at,)] = await (await conn.execute("SELECT max(position) FROM events WHERE stream = %s",
                                                  (store.job_stream(a.id),))).fetchall()  # fmt: skip
    released, _ = await dependencies.release_moved(conn, completed_at, metadata={})
    assert (released.released, released.failed) == (1, 0)
    assert (await row(conn, org[0], b.id)).status == "queued"


async def test_the_prompt_look_reads_only_the_dependents_of_what_moved_after_its_position(conn, org):
    """From a position: B, waiting on A, which completed after it, is released; D, waiting on C, which completed
    before it, is left for the tick's whole look. It returns where the next look starts, which finds nothing
    left; with no job waiting it only moves to the log's end."""
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    c = await submit(conn, org_id, "c")
    d = await submit(conn, org_id, "d", depends_on=[str(c.id)])
    await run(conn, org_id, node, c.id)
    start = await dependencies.log_head(conn)
    a = await submit(conn, org_id, "a")
    b = await submit(conn, org_id, "b", depends_on=[str(a.id)])
    await run(conn, org_id, node, a.id)
    released, after = await dependencies.release_moved(conn, start, metadata={})
    assert (released.released, released.failed) == (1, 0) and after > start
    assert [(await row(conn, org_id, j.id)).status for j in (b, d)] == ["queued", "blocked"]
    again, after = await dependencies.release_moved(conn, after, metadata={})
    assert (again.released, again.failed) == (0, 0)
    assert (await row(conn, org_id, d.id)).awaiting_dependencies
    assert (await sweep_once(conn, SETTINGS)).dependencies_released == 1
    await submit(conn, org_id, "e")
    nothing, end = await dependencies.release_moved(conn, after, metadata={})
    assert (nothing.released, nothing.failed, end) == (0, 0, await dependencies.log_head(conn))
    assert await verify(conn) == []


async def test_the_prompt_look_fails_a_chain_after_a_failed_dependency_in_one_call(conn, org):
    """A fails for good: one prompt look fails B (on A) and C (on B), round after round, each naming its own."""
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    a = await submit(conn, org_id, "a")
    b = await submit(conn, org_id, "b", depends_on=[str(a.id)])
    c = await submit(conn, org_id, "c", depends_on=[str(b.id)])
    start = await dependencies.log_head(conn)
    await run(conn, org_id, node, a.id, fail="out of disk")
    failed, _ = await dependencies.release_moved(conn, start, metadata={})
    assert (failed.released, failed.failed) == (0, 2)
    for job, dependency in ((b, a), (c, b)):
        ended = await row(conn, org_id, job.id)
        assert ended.status == "failed" and str(dependency.id) in ended.error
    assert await verify(conn) == []


async def test_the_server_releases_each_step_of_a_pipeline_as_the_one_before_ends_not_at_its_next_tick(db_url, org):
    """A server whose sweeper ticks once a minute: B (on A) is queued within seconds of A's completion, C (on B)
    within seconds of B's, and E (on D) fails within seconds of D failing for good: the sweeper's leader looks
    at what the log's moves concern between its ticks."""
    import httpx

    from tests.conftest import LiveServer

    _, key = org
    with LiveServer(db_url, UMBRA_SWEEP_INTERVAL_SECONDS="60") as live:
        async with httpx.AsyncClient(base_url=live.url, headers=bearer(key), timeout=30) as client:
            _, credential = await http_pair(client, key)
            steps = (await client.post("/v1/jobs/batch", json={"jobs": [
                {"kind": "a"}, {"kind": "b", "depends_on": [0]}, {"kind": "c", "depends_on": [1]},
                {"kind": "d"}, {"kind": "e", "depends_on": [3]}]})).json()["jobs"]  # fmt: skip
            assert [step["status"] for step in steps] == ["queued", "blocked", "blocked", "queued", "blocked"]

            async def reaches(job: dict, status: str) -> None:
                with anyio.fail_after(10):
                    while (await client.get(f"/v1/jobs/{job['id']}")).json()["status"] != status:
                        await anyio.sleep(0.02)

            for step, after in ((steps[0], steps[1]), (steps[1], steps[2])):
                claimed = await http_claim(client, credential)
                assert claimed["id"] == step["id"]
                await http_complete(client, credential, claimed)
                await reaches(after, "queued")
            c = await http_claim(client, credential)  # ahead of D, submitted after it, in submission order
            assert c["id"] == steps[2]["id"]
            await http_complete(client, credential, c)
            d = await http_claim(client, credential)
            assert d["id"] == steps[3]["id"]
            answer = await client.post(f"/v1/agent/jobs/{d['id']}/fail", json={"attempt": d["attempt"], "error": "no",
                                       "retry": False}, headers=bearer(credential))  # fmt: skip
            assert answer.status_code == 200, answer.text
            await reaches(steps[4], "failed")


async def test_a_long_pipeline_in_one_batch_goes_by_copy_and_fails_whole_after_its_head_fails(conn, org):
    """300 items, each after the one before (COPY): the head fails; the sweeper fails the rest, MAX_ROUNDS links
    a tick; the metric counts them; a rebuild agrees."""
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    rows, _ = await jobs.submit(conn, org_id, [spec("s")] + [spec("s", depends_on=[i - 1]) for i in range(1, 300)],
                                actor="test", batch=True)  # fmt: skip
    assert all((r.depends_on, r.awaiting_dependencies) == ((p.id,), True) for p, r in zip(rows, rows[1:]))
    failed_before = metrics.SWEEPER_ACTIONS.labels(action="dependency_failed")._value.get()
    await run(conn, org_id, node, rows[0].id, fail="x")
    ticks = 0
    while (await row(conn, org_id, rows[-1].id)).status != "failed":
        await sweep_once(conn, SETTINGS)
        ticks += 1
        assert ticks <= -(-299 // MAX_ROUNDS)
    assert metrics.SWEEPER_ACTIONS.labels(action="dependency_failed")._value.get() - failed_before == 299
    assert await verify(conn) == []


async def test_a_row_marked_waiting_that_is_not_blocked_is_never_released_nor_failed(conn, org):
    """A server of the previous release (during a rolling upgrade) does not know the mark: its re-examination
    may release a waiting job, its cancel end one, leaving ``awaiting_dependencies`` set on a row that is
    queued, running or cancelled (reproduced here by setting the mark again after each). The sweeper then
    must not send a running or cancelled job back to the queue, nor fail it."""
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    a, a2 = await submit(conn, org_id, "a"), await submit(conn, org_id, "a2")
    got_a = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=600)
    b = await submit(conn, org_id, "b", depends_on=[str(a.id)])
    cancelled = await submit(conn, org_id, "c", depends_on=[str(a2.id)])
    await queue.record(conn, [queue.Change(b.id, org_id, b, [JobUnblocked()])])
    await jobs.cancel(conn, org_id, cancelled.id, actor="ops")
    await conn.execute("UPDATE jobs SET awaiting_dependencies = true WHERE id = ANY(%s)", ([b.id, cancelled.id],))
    got_b = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=600)
    assert got_b.row.id == a2.id
    got_b = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=600)
    assert got_b.row.id == b.id
    await claims.complete(conn, organization_id=org_id, node_id=node, job_id=a.id, attempt=got_a.row.attempt, result={})
    await claims.fail(conn, organization_id=org_id, node_id=node, job_id=a2.id, attempt=1, error="x", retry=False)
    report = await sweep_once(conn, SETTINGS)
    assert (report.dependencies_released, report.dependencies_failed) == (0, 0)
    assert [(await row(conn, org_id, j.id)).status for j in (b, cancelled)] == ["running", "cancelled"]


def test_the_openapi_document_describes_depends_on_and_its_refusals():
    doc = build_document(all_routes())
    schemas = doc["components"]["schemas"]
    assert schemas["JobRequest"]["properties"]["depends_on"]["maxItems"] == 100
    assert "depends_on" in schemas["JobOut"]["properties"] and "dependencies" in schemas["Explanation"]["properties"]
    for path in ("/v1/jobs", "/v1/jobs/batch"):
        responses = doc["paths"][path]["post"]["responses"]
        assert "dependency_failed" in responses["409"]["description"]
        assert "job_not_found" in responses["404"]["description"]
    assert "depends on" in doc["paths"]["/v1/jobs/{id}/retry"]["post"]["responses"]["409"]["description"]


async def _split(conn, org_id, node, *children):
    """A job claimed on ``node`` and split into ``children`` (ChildRequests): the parent, and the children's rows."""
    parent = await submit(conn, org_id, "p")
    got = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=600)
    assert got.row.id == parent.id
    made = await claims.add_children(conn, organization_id=org_id, node_id=node, job_id=parent.id, attempt=got.row.attempt,
                                     children=list(children))  # fmt: skip
    return parent, made


async def test_a_decomposition_s_merge_step_waits_for_its_shards_and_the_container_settles_after_it(conn, org):
    """Two shards and a merge after both (``depends_on`` [0, 1], earlier children): the merge waits while the
    shards run, is released when they complete, and the container settles ``complete`` once it does."""
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    parent, (first, second, merge) = await _split(conn, org_id, node, child("shard"), child("shard"),
                                                  child("merge", depends_on=[0, 1, 0]))  # fmt: skip
    assert (merge.status, merge.depends_on, merge.awaiting_dependencies) == ("blocked", (first.id, second.id), True)
    await run(conn, org_id, node, first.id)
    assert (await sweep_once(conn, SETTINGS)).dependencies_released == 0
    await run(conn, org_id, node, second.id)
    assert (await sweep_once(conn, SETTINGS)).dependencies_released == 1
    assert (await row(conn, org_id, parent.id)).status == "running"
    await run(conn, org_id, node, merge.id)
    assert (await row(conn, org_id, parent.id)).status == "complete"
    assert await verify(conn) == []


async def test_children_set_aside_after_their_siblings_say_so_and_jobs_that_run_at_once_do_not(db_url, conn, org):
    """The word the sweeper's leader waits for (``WAITING_CHANNEL``) comes from a node's children as from a
    submission: once for a merge after its shard, never for a batch with no dependent."""
    from umbra.events.listener import LogListener

    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    heard: list = []
    listener = LogListener(db_url)
    listener.on_waiting(heard.append)
    async with anyio.create_task_group() as tg:
        await tg.start(listener.run)
        await _split(conn, org_id, node, child("shard"), child("merge", depends_on=[0]))
        await jobs.submit(conn, org_id, [spec("one"), spec("two")], actor="t", batch=True)
        assert await eventually(lambda: _listed(heard))
        await anyio.sleep(0.3)  # the batch's word, had it said one, has come by then
        tg.cancel_scope.cancel()
    assert heard == [org_id]


async def test_a_failed_shard_fails_the_merge_and_the_container_settles_partial(conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    parent, (shard, merge) = await _split(conn, org_id, node, child("shard"), child("merge", depends_on=[0]))
    await run(conn, org_id, node, shard.id, fail="corrupt input")
    assert (await sweep_once(conn, SETTINGS)).dependencies_failed == 1
    settled = await row(conn, org_id, parent.id)
    assert (settled.status, settled.result["children_failed"]) == ("partial", 2)
    assert await verify(conn) == []


async def test_a_child_naming_itself_or_a_later_sibling_is_refused_and_nothing_is_written(conn, org, db_url):
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    parent = await submit(conn, org_id, "p")
    got = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=600)
    before = await written(db_url)
    for depends_on in ([1], [2]):
        with pytest.raises(InvalidRequest) as refused:
            await claims.add_children(conn, organization_id=org_id, node_id=node, job_id=parent.id, attempt=got.row.attempt,
                                      children=[child("a"), child("b", depends_on=depends_on)])  # fmt: skip
        assert (refused.value.extra["field"], refused.value.extra["index"]) == ("children[1].depends_on", 1)
    assert await written(db_url) == before


async def test_a_child_whose_container_another_transaction_holds_is_failed_at_a_later_tick(db_url, conn, org):
    """Failing the merge would settle its container, which an operator's open transaction holds: the tick
    leaves it (waiting for no one's row) and the next one, once the hold is let go, fails it."""
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    parent, (shard, merge) = await _split(conn, org_id, node, child("shard"), child("merge", depends_on=[0]))
    await run(conn, org_id, node, shard.id, fail="x")
    assert (await sweep_while_held(db_url, conn, parent.id)).dependencies_failed == 0
    assert (await sweep_once(conn, SETTINGS)).dependencies_failed == 1
    assert (await row(conn, org_id, parent.id)).status == "partial"


async def test_a_merge_is_released_though_another_transaction_holds_its_container(db_url, conn, org):
    """A release settles nothing, so it waits for no container: only a failure would settle one. (Every shard's
    completion holds its container for a moment; a release that gave way to any holder could be put off tick
    after tick.)"""
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    parent, (shard, merge) = await _split(conn, org_id, node, child("shard"), child("merge", depends_on=[0]))
    await run(conn, org_id, node, shard.id)
    assert (await sweep_while_held(db_url, conn, parent.id)).dependencies_released == 1


def test_an_agent_handler_decomposes_into_shards_and_a_merge_after_them():
    """``umbra agent``'s handler API says what the children route takes: a merge after its shards."""
    from umbra.agent.handlers import Child

    assert Child(kind="merge", depends_on=[0, 1]).to_json()["depends_on"] == [0, 1]
    assert "depends_on" not in Child(kind="shard").to_json()


async def test_metrics_tell_jobs_waiting_for_dependencies_from_jobs_no_device_could_run(conn, org, live_server):
    """``umbra_jobs_waiting_for_dependencies`` counts the blocked jobs that wait: an alert on jobs nothing could
    run subtracts it from ``umbra_queue_depth{status="blocked"}``."""
    import httpx

    from tests.integration.test_outages import samples

    org_id, _ = org
    await add_node(conn, org_id, "box", [CPU64])
    a = await submit(conn, org_id, "a")
    for _ in range(2):
        await submit(conn, org_id, "b", depends_on=[str(a.id)])
    await submit(conn, org_id, "huge", requires={"ram_min_mb": 10**6})  # no device could run it
    async with httpx.AsyncClient(base_url=live_server.url) as client:
        scraped = samples((await client.get("/metrics")).text)
    assert scraped[("umbra_queue_depth", (("status", "blocked"),))] == 3
    assert scraped[("umbra_jobs_waiting_for_dependencies", ())] == 2
