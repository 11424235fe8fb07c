"""The controller's side of ``requires.max_runtime_s``: a job still running one lease past it, counted from
its current claim, is failed by the sweeper (``job.failed``, ``runtime_exceeded``), whatever its holder does.
Its holder's reports are refused after; its handler may run on until its agent hears, so its memory stays
counted on its node until the node next reports; a tree settles; no limit, however large, stops the pass."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest

from tests.helpers import bearer
from umbra.compute import claims, jobs, retries, sweeper
from umbra.compute.accounts import create_organization
from umbra.compute.claims import ChildRequest
from umbra.compute.sweeper import sweep_once
from umbra.errors import Conflict
from umbra.projections import jobs as queue
from umbra.projections.verify import verify
from umbra.settings import load_settings

from .queue_support import CPU64, GPU24, add_node, beat, http_claim, http_pair, set_clock, submit

pytestmark = pytest.mark.anyio

SETTINGS = load_settings({})
GRACE = SETTINGS.lease_seconds
#: For jobs claimed through the live server, whose leases run on real time: a grace shorter than the lease.
SHORT = dataclasses.replace(SETTINGS, lease_seconds=1)


async def claim(conn, org_id, node_id, lease_seconds=3600):
    return await claims.claim(conn, node_id=node_id, organization_id=org_id, lease_seconds=lease_seconds)


async def test_the_holders_every_report_after_is_refused_as_no_longer_its(client, conn, org):
    """Renew (through the group commit), complete, a report of several, children, fail and give-back: 409
    ``job_not_claimed_by_this_node``, none recording anything. A failure report is no repeat of its own."""
    org_id, key = org
    _, credential = await http_pair(client, key)
    made = await client.post("/v1/jobs", json={"kind": "render", "requires": {"max_runtime_s": 1}}, headers=bearer(key))
    job = await http_claim(client, credential)
    assert job["id"] == made.json()["id"]
    await set_clock(conn, 5)
    assert (await sweep_once(conn, SHORT)).runtime_failed == 1
    attempt, path = job["attempt"], f"/v1/agent/jobs/{job['id']}"
    answers = {
        "renew": await client.post(f"{path}/renew", json={"attempt": attempt}, headers=bearer(credential)),
        "complete": await client.post(f"{path}/complete", json={"attempt": attempt, "result": {}}, headers=bearer(credential)),
        "fail": await client.post(f"{path}/fail", json={"attempt": attempt, "error": "mine", "retry": False},
                                  headers=bearer(credential)),
        "release": await client.post(f"{path}/release", json={"attempt": attempt}, headers=bearer(credential)),
        "children": await client.post(f"{path}/children", json={"attempt": attempt, "children": [{"kind": "x"}]},
                                      headers=bearer(credential)),
    }  # fmt: skip
    for name, answer in answers.items():
        assert (name, answer.status_code, answer.json().get("error")) == (name, 409, "job_not_claimed_by_this_node"), answer.text
    many = await client.post("/v1/agent/complete", json={"results": [{"job_id": job["id"], "attempt": attempt, "result": 1}]},
                             headers=bearer(credential))  # fmt: skip
    assert (many.json()["results"][0]["status"], many.json()["results"][0]["error"]) == (409, "job_not_claimed_by_this_node")
    history = (await client.get(f"/v1/jobs/{job['id']}/events", headers=bearer(key))).json()["events"]
    assert [e["type"] for e in history][-1] == "job.failed" and history[-1]["data"]["reason"] == "runtime_exceeded"
    assert await verify(conn, org_id) == []


@pytest.mark.parametrize("ended_by", ["cancel", "runtime"])
async def test_a_job_ended_under_its_holder_keeps_its_memory_until_the_node_next_reports(conn, org, ended_by):
    """Cancelled while it ran, or failed past its limit: its handler runs on until its agent hears, and fills the
    card till then. The next 16,000 MB job waits for the node's report that the card is free again."""
    org_id, _ = org
    node = await add_node(conn, org_id, "one-card", [GPU24])
    first = await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000, "max_runtime_s": 1})
    assert (await claim(conn, org_id, node)).job_id == first.id
    waiting = await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    assert await claim(conn, org_id, node) is None  # the card is promised to the first
    if ended_by == "cancel":
        await jobs.cancel(conn, org_id, first.id, actor="test")
    else:
        await set_clock(conn, 5)
        assert (await sweep_once(conn, SHORT, reexamine=False)).runtime_failed == 1
    assert await claim(conn, org_id, node) is None, "a 16,000 MB job went on a card the ended job still fills"
    if ended_by == "runtime":  # a retry now would give up that count: refused until the node reports
        with pytest.raises(Conflict) as refused:
            await retries.retry(conn, org_id, first.id, actor="ops")
        assert refused.value.code == "job_not_retryable" and "next reports" in refused.value.message
    await beat(conn, org_id, node, [msgspec.structs.replace(GPU24, vram_free_mb=24000)])  # it stopped
    assert (await claim(conn, org_id, node)).job_id == waiting.id
    if ended_by == "runtime":
        assert (await retries.retry(conn, org_id, first.id, actor="ops")).status == "queued"
    assert await verify(conn, org_id) == []


async def test_no_limit_however_large_stops_the_pass_for_anyone(client, conn, org):
    """A submission takes any ``max_runtime_s`` of 1 or more: one of 2**62 seconds running in one organization
    must not stop another organization's overrun from being failed (the pass once overflowed a timestamp)."""
    org_id, key = org
    made = await client.post("/v1/jobs", json={"kind": "render", "requires": {"max_runtime_s": 2**62}}, headers=bearer(key))
    assert made.status_code == 201, made.text
    await claim(conn, org_id, await add_node(conn, org_id, "n", [CPU64]))
    other, _ = await create_organization(conn, "other")
    small = await submit(conn, other, requires={"max_runtime_s": 10})
    await claim(conn, other, await add_node(conn, other, "b", [CPU64]))
    await set_clock(conn, 10 + GRACE + 1)
    assert (await sweep_once(conn, SETTINGS)).runtime_failed == 1
    assert (await queue.load(conn, small.id, other)).status == "failed"
    assert (await queue.load(conn, made.json()["id"], org_id)).status == "running"


async def test_a_child_past_its_limit_settles_its_parent_and_the_container_itself_is_never_failed(conn, org):
    """The container (running, released: it runs nothing) has a limit too and outlives it; its child fails
    past its own, and the parent settles ``partial`` once its other child completes."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    parent = await submit(conn, org_id, "p", requires={"max_runtime_s": 10})
    held = await claim(conn, org_id, node)
    limited, plain = await claims.add_children(
        conn, organization_id=org_id, node_id=node, job_id=parent.id, attempt=held.attempt,
        children=[msgspec.convert({"kind": "part", "requires": {"max_runtime_s": 50}}, ChildRequest), ChildRequest(kind="part")],
    )  # fmt: skip
    claimed = {c.job_id: c for c in [await claim(conn, org_id, node), await claim(conn, org_id, node)]}
    await set_clock(conn, 50 + GRACE + 1)
    assert (await sweep_once(conn, SETTINGS)).runtime_failed == 1
    assert [(await queue.load(conn, j, org_id)).status for j in (limited.id, parent.id)] == ["failed", "running"]
    await claims.complete(conn, organization_id=org_id, node_id=node, job_id=plain.id, attempt=claimed[plain.id].attempt,
                          result=1)  # fmt: skip
    settled = await queue.load(conn, parent.id, org_id)
    assert (settled.status, settled.result["children_failed"]) == ("partial", 1)
    assert await verify(conn, org_id) == []


async def test_the_migration_that_added_the_mark_backfills_it_as_the_fold_has_it(conn, org):
    """Migration 0040 gave every row ``ended_under_holder = false`` and then set it as the log says: a job
    cancelled while it ran, and one the controller failed past its limit (the last event says so). A database
    upgraded with such jobs then agrees with its log (``verify``), and their memory is counted."""
    org_id, _ = org
    node = await add_node(conn, org_id, "card", [GPU24])
    over = await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 1000, "max_runtime_s": 1})
    await claim(conn, org_id, node)
    cancelled = await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 1000})
    await claim(conn, org_id, node)
    await jobs.cancel(conn, org_id, cancelled.id, actor="test")
    retried_then_failed = await submit(conn, org_id, kind="infer", requires={"max_runtime_s": 1})
    first = await claim(conn, org_id, node)
    await set_clock(conn, 5)
    assert (await sweep_once(conn, SHORT, reexamine=False)).runtime_failed == 2
    await beat(conn, org_id, node, [GPU24])  # the node reports: the failed runs hold nothing, a retry may go
    await retries.retry(conn, org_id, retried_then_failed.id, actor="ops")
    again = await claim(conn, org_id, node)
    assert again.job_id == retried_then_failed.id and again.attempt == first.attempt + 1
    await claims.fail(conn, organization_id=org_id, node_id=node, job_id=again.job_id, attempt=again.attempt, error="x",
                      retry=False)  # fmt: skip
    marked = {job_id: (await queue.load(conn, job_id, org_id)).ended_under_holder
              for job_id in (over.id, cancelled.id, retried_then_failed.id)}  # fmt: skip
    assert marked == {over.id: True, cancelled.id: True, retried_then_failed.id: False}
    migration = (Path(__file__).parents[2] / "migrations" / "0040_jobs_ended_under_their_holder.sql").read_text()
    statements = [s.strip() for s in "\n".join(line for line in migration.splitlines() if not line.startswith("--")).split(";")]
    await conn.execute("UPDATE jobs SET ended_under_holder = false")  # as the column came in
    for statement in statements:
        if statement.startswith("UPDATE jobs"):
            await conn.execute(statement)
    assert {job_id: (await queue.load(conn, job_id, org_id)).ended_under_holder for job_id in marked} == marked
    assert await verify(conn, org_id) == []


async def test_a_pass_pages_through_every_overrun_and_fails_each_once(conn, org, monkeypatch):
    """Pages of two (``SWEEP_BATCH``): five jobs past their limit, two within it; one tick fails the five."""
    monkeypatch.setattr(sweeper, "SWEEP_BATCH", 2)
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    over = [await submit(conn, org_id, requires={"max_runtime_s": 10}) for _ in range(5)]
    within = [await submit(conn, org_id, requires={"max_runtime_s": 1000}) for _ in range(2)]
    for _ in range(7):
        await claim(conn, org_id, node)
    await set_clock(conn, 10 + GRACE + 1)
    assert (await sweep_once(conn, SETTINGS, reexamine=False)).runtime_failed == 5
    assert [(await queue.load(conn, j.id, org_id)).status for j in over + within] == ["failed"] * 5 + ["running"] * 2
    assert (await sweep_once(conn, SETTINGS, reexamine=False)).runtime_failed == 0


async def test_a_job_whose_node_went_silent_is_retried_without_waiting_for_a_report(conn, org):
    """The node stopped beating (the machine is gone): nothing runs there for the claims to count, and a retry of
    the job the controller failed under it is not held back for a report that will never come."""
    org_id, _ = org
    job = await _failed_by_the_controller_at_5_s(conn, org_id, "gone")
    await set_clock(conn, 5 + SETTINGS.heartbeat_stale_seconds + 1)
    assert (await retries.retry(conn, org_id, job.id, actor="ops")).status in ("queued", "blocked")


async def test_the_claims_memory_read_reaches_both_kinds_of_job_by_their_partial_indexes(conn, org):
    """The node read that judges claims (``RUNNING_TAKING_MEMORY``) repeats each partial index's predicate whole,
    or the planner cannot use it and reads every job: with sequential scans priced out, its plan takes both
    ``jobs_held_taking_memory`` (running jobs) and ``jobs_ended_under_holder_taking_memory``."""
    from umbra.compute.blocked import RUNNING_TAKING_MEMORY

    org_id, _ = org
    node = await add_node(conn, org_id, "card", [GPU24])
    await conn.execute("SET enable_seqscan = off")
    cursor = await conn.execute(f"EXPLAIN (FORMAT JSON) SELECT {RUNNING_TAKING_MEMORY} FROM nodes n WHERE n.id = %s", (node,))
    [[plan]] = await cursor.fetchall()
    text = str(plan)
    assert "jobs_held_taking_memory" in text and "jobs_ended_under_holder_taking_memory" in text, text


async def test_a_retry_judges_the_holder_s_silence_by_the_configured_stale_threshold(conn, org):
    """With the heartbeat stale threshold raised to 300 s (as the claims judge nodes), a node silent for a
    minute is still alive: the retry of the job the controller failed under it waits for its report; past
    300 s it goes."""
    org_id, _ = org
    job = await _failed_by_the_controller_at_5_s(conn, org_id, "slow-beats")
    await set_clock(conn, 5 + 60)
    with pytest.raises(Conflict):
        await retries.retry(conn, org_id, job.id, actor="ops", stale_seconds=300)
    await set_clock(conn, 5 + 301)
    assert (await retries.retry(conn, org_id, job.id, actor="ops", stale_seconds=300)).status in ("queued", "blocked")


async def _failed_by_the_controller_at_5_s(conn, org_id, node_name: str):
    """A job with a 1 s limit, claimed on a new GPU node, failed by the sweeper 5 s later (the clock moved)."""
    node = await add_node(conn, org_id, node_name, [GPU24])
    job = await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 1000, "max_runtime_s": 1})
    await claim(conn, org_id, node)
    await set_clock(conn, 5)
    assert (await sweep_once(conn, SHORT, reexamine=False)).runtime_failed == 1
    return job
