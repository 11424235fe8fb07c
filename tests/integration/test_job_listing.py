"""Listing jobs over HTTP: cursor paging in submission order, status filters, bounds, paging during writes."""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta, timezone

import anyio
import pytest

from umbra.compute import claims, jobs
from umbra.compute.accounts import create_organization
from umbra.events.types import JOB_STATUSES, TERMINAL_JOB_STATUSES
from tests.helpers import bearer, generic_plans, index_names

from .queue_support import CPU64, add_node, http_claim, http_complete, http_pair, submit
from .test_claim_fencing import child, claim

pytestmark = pytest.mark.anyio


async def list_all(client, key: str, *, limit: int, status: str | None = None) -> list[dict]:
    """Every job ``GET /v1/jobs`` lists, page by page of ``limit``, of ``status`` if given."""
    seen, cursor = [], None
    while True:
        params = {"limit": limit, **({"after": cursor} if cursor else {}), **({"status": status} if status else {})}
        page = await client.get("/v1/jobs", params=params, headers=bearer(key))
        assert page.status_code == 200, page.text
        seen += page.json()["jobs"]
        cursor = page.json()["next"]
        if cursor is None:
            return seen


async def test_paging_while_jobs_are_submitted_claimed_and_cancelled_skips_and_repeats_nothing(client, org):
    """A job that existed throughout the paging is listed exactly once; no job is listed twice; the pages
    come in submission order, and jobs submitted during the paging that are listed follow that order too."""
    _, key = org
    _, credential = await http_pair(client, key)
    created = (await client.post("/v1/jobs/batch", json={"jobs": [{"kind": "k", "payload": {"i": i}} for i in range(80)]},
                                 headers=bearer(key))).json()["jobs"]  # fmt: skip
    existing = [j["id"] for j in created]
    paging_done = anyio.Event()

    async def churn() -> None:
        i = 0
        while not paging_done.is_set():
            i += 1
            await client.post("/v1/jobs", json={"kind": "k", "payload": {"late": i}}, headers=bearer(key))
            held = await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(credential))
            if held.status_code == 200:
                job = held.json()["job"]
                if i % 2:
                    await http_complete(client, credential, job)
                else:
                    await client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(key))
            await client.post(f"/v1/jobs/{existing[(i * 7) % len(existing)]}/cancel", headers=bearer(key))

    seen: list[dict] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(churn)
        cursor = None
        while True:
            params = {"limit": 7, **({"after": cursor} if cursor else {})}
            page = (await client.get("/v1/jobs", params=params, headers=bearer(key))).json()
            seen += page["jobs"]
            cursor = page["next"]
            await anyio.sleep(0.02)  # room for the churn between pages
            if cursor is None:
                break
        paging_done.set()
    ids = [j["id"] for j in seen]
    assert len(ids) == len(set(ids)), "a job was listed twice"
    assert set(existing) <= set(ids)
    final = [j["id"] for j in await list_all(client, key, limit=1000)]
    assert ids == [i for i in final if i in set(ids)], "the pages are not in one stable order"
    assert ids[: len(existing)] == existing


async def test_a_reader_tailing_the_job_list_during_concurrent_submissions_misses_none(client, org):
    """Several clients submit (singles and batches) while a reader pages ``GET /v1/jobs`` from its last full
    page's cursor: every job is seen, in the listing's final order, none behind a cursor already passed
    (the cursor is the job.submitted position, which the log's ordering lock makes commit-ordered)."""
    _, key = org
    writers_done = anyio.Event()

    async def singles(w: int) -> None:
        for i in range(30):
            assert (await client.post("/v1/jobs", json={"kind": "k", "payload": {"w": w, "i": i}}, headers=bearer(key))).status_code == 201

    async def batches(w: int) -> None:
        for i in range(5):
            body = {"jobs": [{"kind": "k", "payload": {"b": w, "i": i, "j": j}} for j in range(10)]}
            assert (await client.post("/v1/jobs/batch", json=body, headers=bearer(key))).status_code == 201

    first_seen: list[str] = []
    seen: set[str] = set()

    async def read_from(cursor: str | None) -> str | None:
        """One page; returns the cursor to read from next (this page's next, or the same when it was the end)."""
        params = {"limit": 5, **({"after": cursor} if cursor else {})}
        page = (await client.get("/v1/jobs", params=params, headers=bearer(key))).json()
        for job in page["jobs"]:
            if job["id"] not in seen:
                seen.add(job["id"])
                first_seen.append(job["id"])
        return page["next"] or cursor

    async def writers() -> None:
        async with anyio.create_task_group() as tg:
            for w in range(4):
                tg.start_soon(singles, w)
            for w in range(2):
                tg.start_soon(batches, w)
        writers_done.set()

    cursor = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(writers)
        while not writers_done.is_set():
            cursor = await read_from(cursor)
    for _ in range(100):
        before = len(first_seen)
        cursor = await read_from(cursor)
        if len(first_seen) == before:
            break
    final = [j["id"] for j in await list_all(client, key, limit=1000)]
    assert len(final) == 4 * 30 + 2 * 5 * 10
    assert first_seen == final


async def test_a_status_filter_pages_only_jobs_of_those_statuses(client, org):
    """Paging with ?status= (limit 1) lists exactly the jobs of those statuses, a spaced list included."""
    _, key = org
    _, credential = await http_pair(client, key)
    await client.post("/v1/jobs/batch", json={"jobs": [{"kind": "k", "payload": {"i": i}} for i in range(6)]}, headers=bearer(key))
    await http_complete(client, credential, await http_claim(client, credential))
    await http_claim(client, credential)  # running
    third = (await client.get("/v1/jobs", params={"status": "queued"}, headers=bearer(key))).json()["jobs"][0]
    await client.post(f"/v1/jobs/{third['id']}/cancel", headers=bearer(key))
    counts = {s: len(await list_all(client, key, limit=1, status=s)) for s in ("queued", "running", "complete", "cancelled")}
    assert counts == {"queued": 3, "running": 1, "complete": 1, "cancelled": 1}
    both = await list_all(client, key, limit=2, status="complete, cancelled")
    assert sorted(j["status"] for j in both) == ["cancelled", "complete"]


async def test_listing_cursor_and_limit_bounds(client, org, conn):
    """Garbage cursors and limits are refused naming the parameter; another organization's cursor is only a
    position and shows nothing of theirs; a page ending exactly at the end gives a cursor to an empty page."""
    _, key = org
    _, other_key = await create_organization(conn, "other")
    await client.post("/v1/jobs/batch", json={"jobs": [{"kind": "k"}] * 4}, headers=bearer(key))
    await client.post("/v1/jobs/batch", json={"jobs": [{"kind": "theirs"}] * 3}, headers=bearer(other_key))
    for params, field in (({"after": "abc"}, "after"), ({"after": "-1"}, "after"), ({"after": "1.5"}, "after"),
                          ({"after": str(2**63)}, "after"), ({"after": "1e3"}, "after"), ({"limit": "0"}, "limit"),
                          ({"limit": "1001"}, "limit"), ({"limit": "-5"}, "limit"), ({"limit": "ten"}, "limit")):  # fmt: skip
        refused = await client.get("/v1/jobs", params=params, headers=bearer(key))
        assert (refused.status_code, refused.json()["error"], refused.json().get("field")) == (422, "invalid_request", field), params
    assert len((await client.get("/v1/jobs", params={"limit": 1000}, headers=bearer(key))).json()["jobs"]) == 4
    exact = (await client.get("/v1/jobs", params={"limit": 4}, headers=bearer(key))).json()
    assert len(exact["jobs"]) == 4 and exact["next"] is not None
    tail = (await client.get("/v1/jobs", params={"limit": 4, "after": exact["next"]}, headers=bearer(key))).json()
    assert tail == {"jobs": [], "next": None}
    theirs_first = (await client.get("/v1/jobs", params={"limit": 1}, headers=bearer(other_key))).json()
    with_their_cursor = (await client.get("/v1/jobs", params={"after": theirs_first["next"]}, headers=bearer(key))).json()
    assert all(j["kind"] == "k" for j in with_their_cursor["jobs"])
    assert (await client.get("/v1/jobs", params={"after": str(2**63 - 1)}, headers=bearer(key))).json() == {"jobs": [], "next": None}


async def _jobs_of_every_status(conn, org_id) -> None:
    """Jobs of two kinds in every status, submitted interleaved: queued, running, blocked (no device fits, and
    waiting for a dependency), complete, failed, cancelled, and a container settled ``partial``."""
    node = await add_node(conn, org_id, "n", [CPU64])
    for i in range(3):
        kind = "a" if i % 2 else "b"
        done = await submit(conn, org_id, kind, priority=0)
        got = await claim(conn, org_id, node)
        assert got.job_id == done.id
        await claims.complete(conn, organization_id=org_id, node_id=node, job_id=done.id, attempt=got.attempt, result={})
        await submit(conn, org_id, kind, requires={"vram_min_mb": 10**6})  # blocked: nothing fits
        await submit(conn, org_id, kind)  # queued
        broken = await submit(conn, org_id, kind, priority=0)
        got = await claim(conn, org_id, node)
        assert got.job_id == broken.id
        await claims.fail(conn, organization_id=org_id, node_id=node, job_id=broken.id, attempt=got.attempt, error="x",
                          retry=False)  # fmt: skip
        await submit(conn, org_id, kind, not_before=(datetime.now(timezone.utc) + timedelta(days=30)).isoformat())  # blocked: delayed
        dropped = await submit(conn, org_id, kind)
        await jobs.cancel(conn, org_id, dropped.id, actor="test")
        await submit(conn, org_id, kind, depends_on=[str((await submit(conn, org_id, kind)).id)])  # waits for a queued one
        held = await submit(conn, org_id, kind, priority=0)
        got = await claim(conn, org_id, node)
        assert got.job_id == held.id  # running
    parent = await submit(conn, org_id, "p", priority=0)
    got = await claim(conn, org_id, node)
    assert got.job_id == parent.id
    (made,) = await claims.add_children(conn, organization_id=org_id, node_id=node, job_id=parent.id, attempt=got.attempt,
                                        children=[child(max_attempts=1, priority=0)])  # fmt: skip
    got = await claim(conn, org_id, node)
    assert got.job_id == made.id
    await claims.fail(conn, organization_id=org_id, node_id=node, job_id=made.id, attempt=got.attempt, error="x", retry=False)


async def test_every_status_and_kind_filter_pages_as_the_organization_s_jobs_in_submission_order(conn, org):
    """For every set of statuses (with and without a kind filter) and page sizes, the pages and their cursors are
    exactly the organization's jobs of those statuses and kinds in ``seq`` order, cut into pages, the cursor the
    last ``seq`` of a full page: whichever index the listing reads, open jobs' or every job's."""
    org_id, _ = org
    other_id, _ = await create_organization(conn, "other")
    await _jobs_of_every_status(conn, org_id)
    await _jobs_of_every_status(conn, other_id)
    everything = await (await conn.execute("SELECT id, status, kind, seq FROM jobs WHERE organization_id = %s ORDER BY seq",
                                           (org_id,))).fetchall()  # fmt: skip
    assert {status for _, status, _, _ in everything} == set(JOB_STATUSES)
    for size in range(len(JOB_STATUSES) + 1):
        for statuses in itertools.combinations(JOB_STATUSES, size):
            for kinds in (None, ["a"], ["a", "p"]):
                for limit in (2, 1000):
                    wanted = [(job_id, seq) for job_id, status, kind, seq in everything
                              if status in statuses and (kinds is None or kind in kinds)]  # fmt: skip
                    expected = [wanted[i : i + limit] for i in range(0, len(wanted), limit)] or [[]]
                    if len(expected[-1]) == limit:
                        expected.append([])
                    pages, after = [], 0
                    while True:
                        rows, cursor = await jobs.list_jobs(conn, org_id, statuses=list(statuses), kinds=kinds, limit=limit,
                                                            after=after)  # fmt: skip
                        pages.append([(row.id, row.seq) for row in rows])
                        assert cursor == (rows[-1].seq if len(rows) == limit else None)
                        if cursor is None:
                            break
                        after = cursor
                    assert pages == expected, (statuses, kinds, limit)


async def _listing_plans(conn, org_id, statuses: list[str] | None, kinds: list[str] | None = None) -> list[str]:
    return await generic_plans(conn, lambda: jobs.list_jobs(conn, org_id, statuses=statuses, kinds=kinds, limit=100, after=0),
                               table="jobs")  # fmt: skip


async def test_a_filter_of_open_statuses_reads_the_open_jobs_not_the_organization_s_history(conn, org):
    """``?status=queued`` (or running, blocked) of an organization with millions of terminal jobs read them all
    through ``jobs_org_seq``, filtering by status: a generic plan (a pooled connection's, once the statement is
    prepared) cannot see that the statuses asked for are open ones. The listing names the open statuses whole,
    so every plan of it reads ``jobs_open_by_seq``; a filter with a terminal status still reads every job's."""
    org_id, _ = org
    await _jobs_of_every_status(conn, org_id)
    open_statuses = [s for s in JOB_STATUSES if s not in TERMINAL_JOB_STATUSES]
    for size in range(1, len(open_statuses) + 1):
        for statuses in itertools.combinations(open_statuses, size):
            for kinds in (None, ["a"]):
                for plan in await _listing_plans(conn, org_id, list(statuses), kinds):
                    assert index_names(plan) == {"jobs_open_by_seq"}, (statuses, kinds, plan)
    for statuses in (None, ["complete"], ["queued", "failed"]):
        for plan in await _listing_plans(conn, org_id, statuses):
            assert index_names(plan) == {"jobs_org_seq"}, (statuses, plan)
