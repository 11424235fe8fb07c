"""Delayed submissions (``"not_before"``): a job submitted to run later waits, ``blocked``, for its time, and
the sweeper releases it then, judged as a new submission is. A refusal writes nothing; the views still agree
with the log."""

from __future__ import annotations

import dataclasses
import json
import time
from datetime import datetime, timedelta, timezone

import anyio
import pytest

from tests.helpers import bearer, eventually, run_umbra
from umbra.compute import claims
from umbra.compute.sweeper import sweep_once
from umbra.domain.jobs import DUE
from umbra.events import store
from umbra.projections.verify import verify
from umbra.settings import load_settings

from .queue_support import CPU64, GPU24, add_node, http_pair, set_clock, submit, written
from .test_dependencies import history, row

pytestmark = pytest.mark.anyio

SETTINGS = load_settings({})


async def now_of(conn) -> datetime:
    return (await (await conn.execute("SELECT umbra_now()")).fetchone())[0]


def text(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


async def test_a_delayed_job_waits_blocked_for_its_time_then_is_released_and_claimed(conn, org):
    """Submitted to run in 10 s: blocked ("not due until ..."), its not_before on the job, no claim takes it and
    no tick releases it early; once the clock passes it, a tick releases it (``job.unblocked``, ``due``) and a
    claim takes it."""
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    at = await now_of(conn) + timedelta(seconds=10)
    job = await submit(conn, org_id, "later", not_before=text(at))
    assert (job.status, job.blocked_reason, job.not_before, job.waiting_until) == (
        "blocked", f"not due until {text(at)}", at, at)
    assert await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60) is None
    report = await sweep_once(conn, SETTINGS)
    assert (report.delayed_released, report.jobs_unblocked, report.blocked_failed) == (0, 0, 0)
    assert (await row(conn, org_id, job.id)).status == "blocked"
    await set_clock(conn, 11)
    assert (await sweep_once(conn, SETTINGS)).delayed_released == 1
    released = await row(conn, org_id, job.id)
    assert (released.status, released.blocked_reason, released.waiting_until, released.not_before) == ("queued", None, None, at)
    claimed = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60)
    assert claimed is not None and claimed.row.id == job.id
    types = [(t, d.get("not_before"), d.get("until"), d.get("reason")) for t, d in await history(conn, job.id)]
    assert types[:3] == [("job.submitted", text(at), None, None), ("job.blocked", None, text(at), f"not due until {text(at)}"),
                         ("job.unblocked", None, None, DUE)]  # fmt: skip
    assert await verify(conn) == []


async def test_a_not_before_already_past_is_recorded_and_the_job_queued_at_once(conn, org):
    org_id, _ = org
    await add_node(conn, org_id, "box", [CPU64])
    at = await now_of(conn) - timedelta(seconds=5)
    job = await submit(conn, org_id, "now", not_before=text(at))
    assert (job.status, job.not_before, job.waiting_until) == ("queued", at, None)
    assert [t for t, _ in await history(conn, job.id)] == ["job.submitted"]


async def test_a_delayed_job_neither_times_out_as_blocked_nor_is_released_by_the_fleet(conn, org):
    """Two days ahead, with no device that could run it: a day later (past the 24 h blocked timeout) a tick with
    the fleet's re-examination leaves it waiting; at its time it is released, judged against the fleet and
    blocked for what it lacks, and its blocked timeout counts from then."""
    org_id, _ = org
    await add_node(conn, org_id, "box", [CPU64])
    at = await now_of(conn) + timedelta(days=2)
    job = await submit(conn, org_id, "big", not_before=text(at), requires={"accelerators": ["cuda"]})
    await set_clock(conn, 25 * 3600)
    report = await sweep_once(conn, SETTINGS, reexamine=True)
    assert (report.blocked_failed, report.jobs_unblocked, report.delayed_released) == (0, 0, 0)
    assert (await row(conn, org_id, job.id)).waiting_until == at
    await set_clock(conn, 2 * 86400 + 1)
    assert (await sweep_once(conn, SETTINGS)).delayed_released == 1
    blocked = await row(conn, org_id, job.id)
    assert blocked.status == "blocked" and blocked.waiting_until is None and "cuda" in blocked.blocked_reason
    await set_clock(conn, 2 * 86400 + 3600)
    assert (await sweep_once(conn, SETTINGS)).blocked_failed == 0  # an hour after its release, not 49 h after submission
    await set_clock(conn, 3 * 86400 + 2)
    assert (await sweep_once(conn, SETTINGS)).blocked_failed == 1
    assert await verify(conn) == []


async def test_a_job_whose_dependencies_complete_before_its_time_waits_on_for_it(conn, org):
    """B depends on A and is not to run for 10 s: A completes at once; the dependencies' look moves B from waiting
    for A to waiting for its time, and the tick after its time releases it."""
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    a = await submit(conn, org_id, "a")
    at = await now_of(conn) + timedelta(seconds=10)
    b = await submit(conn, org_id, "b", depends_on=[str(a.id)], not_before=text(at))
    assert (b.status, b.awaiting_dependencies, b.waiting_until) == ("blocked", True, None)
    claimed = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60)
    assert claimed is not None and claimed.row.id == a.id
    await claims.complete(conn, organization_id=org_id, node_id=node, job_id=a.id, attempt=claimed.row.attempt, result={})
    report = await sweep_once(conn, SETTINGS)
    assert (report.dependencies_released, report.delayed_released) == (1, 0)
    waiting = await row(conn, org_id, b.id)
    assert (waiting.status, waiting.awaiting_dependencies, waiting.waiting_until, waiting.blocked_reason) == (
        "blocked", False, at, f"not due until {text(at)}")
    assert await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60) is None
    await set_clock(conn, 11)
    assert (await sweep_once(conn, SETTINGS)).delayed_released == 1
    assert (await row(conn, org_id, b.id)).status == "queued"
    assert await verify(conn) == []


async def test_a_cancelled_delayed_job_stays_cancelled_past_its_time(conn, org):
    org_id, _ = org
    at = await now_of(conn) + timedelta(seconds=30)
    job = await submit(conn, org_id, "later", not_before=text(at))
    from umbra.compute import jobs

    cancelled = await jobs.cancel(conn, org_id, job.id, actor="test")
    assert cancelled.status == "cancelled"
    await set_clock(conn, 31)
    assert (await sweep_once(conn, SETTINGS)).delayed_released == 0
    assert (await row(conn, org_id, job.id)).status == "cancelled"
    assert await verify(conn) == []


async def test_many_delayed_jobs_are_released_page_by_page_in_the_order_they_fall_due(conn, org, monkeypatch):
    from umbra.compute import delayed

    monkeypatch.setattr(delayed, "PAGE", 3)
    org_id, _ = org
    await add_node(conn, org_id, "box", [CPU64])
    base = await now_of(conn)
    # Ten seconds apart: the clock is moved from the real time, which goes on while the jobs are submitted.
    jobs_ = [await submit(conn, org_id, "later", not_before=text(base + timedelta(seconds=10 + 10 * i))) for i in range(7)]
    await set_clock(conn, 45)  # the first four fell due
    assert (await sweep_once(conn, SETTINGS)).delayed_released == 4
    assert [(await row(conn, org_id, j.id)).status for j in jobs_] == ["queued"] * 4 + ["blocked"] * 3
    await set_clock(conn, 200)
    assert (await sweep_once(conn, SETTINGS)).delayed_released == 3
    assert await verify(conn) == []



async def test_a_large_batch_of_delayed_jobs_goes_by_copy_and_each_waits(conn, org):
    """A batch large enough to be written by COPY: every row carries its waiting_until, as its events fold."""
    from umbra.compute import jobs as submission

    from .queue_support import spec

    org_id, _ = org
    await add_node(conn, org_id, "box", [CPU64])
    at = await now_of(conn) + timedelta(seconds=10)
    count = store.COPY_MIN_EVENTS
    rows, created = await submission.submit(conn, org_id, [spec("later", not_before=text(at))] * count, actor="test", batch=True)
    assert created == count and {(r.status, r.waiting_until) for r in rows} == {("blocked", at)}
    assert await verify(conn) == []
    await set_clock(conn, 11)
    assert (await sweep_once(conn, SETTINGS)).delayed_released == count
    assert await verify(conn) == []


async def test_a_delayed_dependent_retried_keeps_the_time_it_was_submitted_for(conn, org):
    """B depends on A and is not to run for an hour; A fails for good, so B fails. Retried after A (which then
    completes), and retried after A completed: either way B waits for its time, not queued at once; the retry
    event says which time it keeps."""
    from umbra.compute import retries

    from .test_dependencies import run

    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    at = await now_of(conn) + timedelta(hours=1)
    for order in ("B retried, then A completes", "A completes, then B retried"):
        a = await submit(conn, org_id, "a")
        b = await submit(conn, org_id, "b", depends_on=[str(a.id)], not_before=text(at))
        await run(conn, org_id, node, a.id, fail="flaky")
        await sweep_once(conn, SETTINGS)
        await retries.retry(conn, org_id, a.id, actor="ops")
        if order.startswith("B"):
            assert (await retries.retry(conn, org_id, b.id, actor="ops")).awaiting_dependencies
            await run(conn, org_id, node, a.id)
            await sweep_once(conn, SETTINGS)
        else:
            await run(conn, org_id, node, a.id)
            await retries.retry(conn, org_id, b.id, actor="ops")
        waiting = await row(conn, org_id, b.id)
        assert (waiting.status, waiting.waiting_until, waiting.not_before) == ("blocked", at, at), order
        retried = [d for t, d in await history(conn, b.id) if t == "job.retried"]
        assert [d["not_before"] for d in retried] == [text(at)], order
    assert await verify(conn) == []


async def test_explain_of_a_delayed_job_waiting_for_its_dependencies_says_it_then_waits_for_its_time(conn, org):
    from umbra.compute.explain import explain

    from .test_dependencies import run

    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    a = await submit(conn, org_id, "a")
    at = (await now_of(conn)).replace(microsecond=0) + timedelta(hours=2)
    b = await submit(conn, org_id, "b", depends_on=[str(a.id)], not_before=text(at))
    found = await explain(conn, org_id, b.id)
    assert found.not_before == at and f"It then waits until {text(at)}, when it was submitted to run" in found.summary
    await run(conn, org_id, node, a.id)  # the sweeper has not looked yet
    found = await explain(conn, org_id, b.id)
    assert found.not_before == at and "next tick" not in found.summary, found.summary
    assert found.summary.startswith("The jobs it depends on have all completed: at the sweeper's next look it goes on "
                                    f"waiting, until {text(at)}")  # fmt: skip


async def test_a_not_before_more_than_366_days_past_is_refused_too(client, org, db_url):
    """Year 1 with a positive offset is a moment PostgreSQL stores (as 1 BC) but cannot read back: refused, as
    anything more than 366 days from now either way is, with nothing written."""
    _, key = org
    before = await written(db_url)
    for moment in ("0001-01-01T00:00:00+05:00", "2000-01-01T00:00:00Z"):
        answer = await client.post("/v1/jobs", json={"kind": "k", "not_before": moment}, headers=bearer(key))
        assert answer.status_code == 422 and answer.json()["field"] == "not_before", (moment, answer.text)
    assert await written(db_url) == before
    assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 200

# -- through the routes ---------------------------------------------------------------------------------------


async def test_refusals_of_not_before_name_the_field_and_write_nothing(client, org, db_url):
    """No offset, not a time, or more than 366 days ahead (in a batch: with the item's index) → 422, field
    ``not_before``; nothing written."""
    _, key = org
    before = await written(db_url)
    far = text(datetime.now(timezone.utc) + timedelta(days=367))
    for body in ({"kind": "k", "not_before": "2026-12-24T18:00:00"}, {"kind": "k", "not_before": "tomorrow"},
                 {"kind": "k", "not_before": far}):  # fmt: skip
        answer = await client.post("/v1/jobs", json=body, headers=bearer(key))
        assert answer.status_code == 422 and answer.json()["error"] == "invalid_request", (body, answer.text)
        assert "not_before" in answer.json().get("field", "") + answer.json()["message"], answer.text
    answer = await client.post("/v1/jobs/batch", json={"jobs": [{"kind": "k"}, {"kind": "k", "not_before": far}]},
                               headers=bearer(key))  # fmt: skip
    assert answer.status_code == 422 and answer.json()["field"] == "not_before" and answer.json()["index"] == 1, answer.text
    assert await written(db_url) == before


async def test_a_batch_mixes_delayed_and_immediate_jobs_and_explain_says_when_one_runs(client, org, conn):
    org_id, key = org
    await add_node(conn, org_id, "box", [CPU64])
    at = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(hours=1)
    answer = await client.post("/v1/jobs/batch", headers=bearer(key), json={"jobs": [
        {"kind": "now"}, {"kind": "later", "not_before": text(at)}]})  # fmt: skip
    assert answer.status_code == 201, answer.text
    now_job, later = answer.json()["jobs"]
    assert (now_job["status"], now_job["not_before"]) == ("queued", None)
    assert (later["status"], later["not_before"], later["blocked_reason"]) == ("blocked", text(at), f"not due until {text(at)}")
    body = (await client.get(f"/v1/jobs/{later['id']}/explain", headers=bearer(key))).json()
    assert body["not_before"] == text(at) and len(body["eligible"]) == 1
    assert body["summary"].startswith(f"Submitted to run later: it is not due until {text(at)} (")
    assert body["summary"].endswith("Then it is judged and queued as a new job (1 device could run it now).")
    metrics = (await client.get("/metrics")).text
    assert "umbra_jobs_delayed 1.0" in metrics and 'umbra_queue_depth{status="blocked"} 1.0' in metrics


async def test_a_parked_claim_gets_a_delayed_job_when_it_falls_due_not_before(client, org, live_server):
    """A job due in 1.5 s and an agent long-polling for work on a live server (whose sweeper ticks every
    second): the claim answers with it after its time, within a few seconds, not at once."""
    import httpx

    _, key = org
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as agent_client:
        _, credential = await http_pair(agent_client, key)
        at = datetime.now(timezone.utc) + timedelta(seconds=1.5)
        submitted = await agent_client.post("/v1/jobs", json={"kind": "later", "not_before": text(at)}, headers=bearer(key))
        assert submitted.status_code == 201, submitted.text
        started = time.monotonic()
        with anyio.fail_after(20):
            claimed = await agent_client.post("/v1/agent/claim", params={"wait": 15}, headers=bearer(credential))
        waited = time.monotonic() - started
        assert claimed.status_code == 200 and claimed.json()["job"]["id"] == submitted.json()["id"], claimed.text
        assert datetime.now(timezone.utc) >= at and waited < 10


async def test_between_ticks_the_leader_wakes_when_a_delayed_job_falls_due(db_url, org):
    """A live server whose sweeper ticks every 30 s: jobs submitted to run 1.5 s and 3 s from now are released
    at their times, not at the next tick. The submission's hint makes the leader read when the first waiting
    job falls due; after releasing it, it reads the next one's time."""
    import httpx

    from tests.conftest import LiveServer

    _, key = org
    with LiveServer(db_url, UMBRA_SWEEP_INTERVAL_SECONDS="30") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            await http_pair(client, key)
            await anyio.sleep(0.5)  # the leader's first tick is behind it
            now = datetime.now(timezone.utc)
            times = [now + timedelta(seconds=1.5), now + timedelta(seconds=3)]
            ids = []
            for at in times:
                made = await client.post("/v1/jobs", json={"kind": "later", "not_before": text(at)}, headers=bearer(key))
                assert made.status_code == 201 and made.json()["status"] == "blocked", made.text
                ids.append(made.json()["id"])
            started = time.monotonic()

            async def released(job_id: str) -> dict | None:
                events = (await client.get(f"/v1/jobs/{job_id}/events", headers=bearer(key))).json()["events"]
                return next((e for e in events if e["type"] == "job.unblocked"), None)

            for job_id, at in zip(ids, times):
                event = await eventually(lambda: released(job_id), timeout=15)
                assert event["data"]["reason"] == DUE
                assert datetime.fromisoformat(event["recorded_at"].replace("Z", "+00:00")) >= at
            assert time.monotonic() - started < 12  # the next tick was 30 s away


async def test_the_cli_submits_a_job_to_run_later(live_server, org):
    """``umbra jobs submit K --delay 3600``: the job waits for its time, an hour from now by this machine's
    clock; ``--not-before`` takes an ISO 8601 time; a bad one is refused as a flag (exit 2)."""
    _, key = org
    env = {"UMBRA_API_KEY": key}
    umbra = anyio.to_thread.run_sync
    shown = await umbra(lambda: run_umbra("jobs", "submit", "later", "--delay", "3600", "--json", "--server", live_server.url, env=env))
    assert shown.returncode == 0, shown.stderr
    job = json.loads(shown.stdout)
    due = datetime.fromisoformat(job["not_before"].replace("Z", "+00:00"))
    assert job["status"] == "blocked" and abs((due - datetime.now(timezone.utc)).total_seconds() - 3600) < 60
    at = "2030-01-01T00:00:00Z"
    later = await umbra(lambda: run_umbra("jobs", "submit", "later", "--not-before", at, "--json", "--server", live_server.url, env=env))
    assert later.returncode == 1 and "366 days" in later.stderr, (later.stdout, later.stderr)
    refused = await umbra(lambda: run_umbra("jobs", "submit", "later", "--not-before", "soon", "--server", live_server.url, env=env))
    assert refused.returncode == 2 and "not an ISO 8601 time" in refused.stderr


async def test_the_rows_of_delayed_jobs_are_what_the_log_folds_to(conn, org):
    """The rows of delayed jobs, waiting, released, and released into a block: each what its events fold to."""
    org_id, _ = org
    await add_node(conn, org_id, "gpu", [GPU24])
    base = await now_of(conn)
    await submit(conn, org_id, "waits", not_before=text(base + timedelta(hours=1)))
    await submit(conn, org_id, "released", not_before=text(base + timedelta(seconds=5)))
    await submit(conn, org_id, "blocked-after", not_before=text(base + timedelta(seconds=5)), requires={"vram_min_mb": 90000})
    await set_clock(conn, 6)
    assert (await sweep_once(conn, dataclasses.replace(SETTINGS))).delayed_released == 2
    assert [(await row(conn, org_id, j)).status for j in await _ids(conn, org_id)] == ["blocked", "queued", "blocked"]
    assert await verify(conn) == []


async def _ids(conn, org_id):
    return [r[0] for r in await (await conn.execute("SELECT id FROM jobs WHERE organization_id = %s ORDER BY seq", (org_id,))).fetchall()]
