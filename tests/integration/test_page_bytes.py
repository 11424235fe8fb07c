"""Pages bounded by their bytes (``umbra.paging.PAGE_BYTES``): a page of jobs or events whose documents are large
stops early with a cursor to go on from, and reading on to the end still gives every item once, in order.

Without the bound, ``GET /v1/jobs?limit=1000`` of jobs whose payloads and results are near the 1 MiB body
limit gathered near 1 GB in the server per request. The budget is made small here, with items of known size."""

from __future__ import annotations

import pytest

from umbra import paging
from umbra.events import store
from tests.helpers import bearer

pytestmark = pytest.mark.anyio

#: Bytes of each job's payload: a page of many holds many times the budget below.
BLOB = 10_000
#: The budget the tests set: four such jobs fit, the fifth would pass it.
BUDGET = 4 * BLOB
JOBS = 25


@pytest.fixture
def budget(monkeypatch):
    monkeypatch.setattr(paging, "PAGE_BYTES", BUDGET)


async def submit_large(client, key: str, n: int = JOBS) -> list[str]:
    jobs = [{"kind": "k", "payload": {"blob": "x" * BLOB, "i": i}} for i in range(n)]
    answer = await client.post("/v1/jobs/batch", json={"jobs": jobs}, headers=bearer(key))
    assert answer.status_code == 201, answer.text
    return [job["id"] for job in answer.json()["jobs"]]


@pytest.mark.parametrize("status", [None, "queued,blocked", "blocked,complete"], ids=["any", "open", "any-status"])
async def test_a_page_of_large_jobs_stops_at_the_byte_budget_and_next_reads_every_job_once_in_order(
    client, org, budget, status
):
    """``limit=1000`` of jobs of 10 KB each, under a 40 KB budget: each page lists four, the answer stays within
    the budget and one job, ``next`` is given while jobs remain; followed to the end, every job once, in order.
    ``status=queued,blocked`` reads by the open jobs' index, the others by every job's."""
    _, key = org
    submitted = await submit_large(client, key)
    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": 1000, **({"after": cursor} if cursor else {}), **({"status": status} if status else {})}
        answer = await client.get("/v1/jobs", params=params, headers=bearer(key))
        assert answer.status_code == 200, answer.text
        page = answer.json()
        assert 1 <= len(page["jobs"]) <= BUDGET // BLOB, len(page["jobs"])
        assert len(answer.content) < BUDGET + 2 * BLOB, len(answer.content)
        seen += [job["id"] for job in page["jobs"]]
        cursor = page["next"]
        if cursor is None:
            break
    assert seen == submitted


async def test_a_job_larger_than_the_budget_is_listed_alone_and_the_cursor_moves(client, org, monkeypatch):
    """A budget smaller than any job: a page of one each, and ``null`` after the last (nothing left out)."""
    _, key = org
    submitted = await submit_large(client, key, 3)
    monkeypatch.setattr(paging, "PAGE_BYTES", 1)
    pages = []
    cursor = 0
    while cursor is not None:
        page = (await client.get("/v1/jobs", params={"limit": 1000, "after": cursor}, headers=bearer(key))).json()
        pages.append([job["id"] for job in page["jobs"]])
        cursor = page["next"]
    assert pages == [[job_id] for job_id in submitted]


async def test_a_page_of_large_events_stops_at_the_byte_budget_and_next_reads_every_event_once_in_order(
    client, conn, org, budget
):
    """The jobs' ``job.submitted`` events carry their payloads: a page of ``limit=1000`` stops at the budget,
    and paging from 0 to the end gives every event of the log once, in position order."""
    org_id, key = org
    await submit_large(client, key)
    logged = [e.position for e in await store.read_log(conn, organization_id=org_id)]
    seen: list[int] = []
    after = 0
    while True:
        answer = await client.get("/v1/events", params={"after": after, "limit": 1000}, headers=bearer(key))
        assert answer.status_code == 200, answer.text
        page = answer.json()
        if not page["events"]:
            assert page["next"] == after
            break
        assert len(answer.content) < BUDGET + 2 * BLOB, len(answer.content)
        assert sum(event["type"] == "job.submitted" for event in page["events"]) <= BUDGET // BLOB
        seen += [event["position"] for event in page["events"]]
        after = page["next"]
    assert seen == logged and len(logged) >= JOBS


async def test_a_read_of_the_log_cut_short_says_more_follows(conn, client, org, monkeypatch):
    """The event stream reads on at once after a page cut short by its bytes (it waited for the next hint or
    poll when only a full page said so): the read says whether more follows, exactly."""
    org_id, key = org
    await submit_large(client, key, 2)
    monkeypatch.setattr(paging, "PAGE_BYTES", 1)
    logged = [e.position for e in await store.read_log(conn, organization_id=org_id)]
    after, reads = 0, []
    while True:
        events, more = await store.read_log_as_stored(conn, after=after, limit=1000, organization_id=org_id)
        reads.append(([e.position for e in events], more))
        if not more:
            break
        after = events[-1].position
    assert reads == [([p], i < len(logged) - 1) for i, p in enumerate(logged)]


async def test_the_queue_view_lists_open_jobs_up_to_the_byte_budget_and_says_it_is_truncated(client, org, budget):
    """``limit=1000`` open jobs of 10 KB each under a 40 KB budget: four listed, ``truncated``, within the
    budget and one job."""
    _, key = org
    submitted = await submit_large(client, key)
    answer = await client.get("/v1/projections/queue", params={"limit": 1000}, headers=bearer(key))
    assert answer.status_code == 200, answer.text
    view = answer.json()
    assert [job["id"] for job in view["jobs"]] == submitted[: BUDGET // BLOB]
    assert view["truncated"] is True
    assert len(answer.content) < BUDGET + 2 * BLOB


@pytest.mark.parametrize("open_jobs", [1, 2])
async def test_the_queue_views_truncated_is_exact_when_the_budget_cuts_it(client, org, monkeypatch, open_jobs):
    """A budget smaller than one job: the first is listed; ``truncated`` only when another is open."""
    _, key = org
    submitted = await submit_large(client, key, open_jobs)
    monkeypatch.setattr(paging, "PAGE_BYTES", 1)
    view = (await client.get("/v1/projections/queue", params={"limit": 1000}, headers=bearer(key))).json()
    assert [job["id"] for job in view["jobs"]] == submitted[:1]
    assert view["truncated"] is (open_jobs > 1)
