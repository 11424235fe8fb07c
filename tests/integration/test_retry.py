"""An operator's retry of a failed job (``POST /v1/jobs/{id}/retry``): the same job back in its place in the
queue, with more runs, its history going on in its own stream; refused, writing nothing, for any job that did
not fail or belongs to a tree."""

from __future__ import annotations

import anyio
import psycopg
import pytest

from tests.helpers import bearer, run_umbra
from umbra.compute.accounts import create_api_key, create_organization

from .queue_support import http_claim, http_complete, http_pair

pytestmark = pytest.mark.anyio


async def written(db_url) -> tuple[int, int]:
    """Rows of ``jobs`` and events in the log: what a refusal must leave as it found them."""
    async with await psycopg.AsyncConnection.connect(db_url) as c:
        return (await (await c.execute("SELECT (SELECT count(*) FROM jobs), (SELECT count(*) FROM events)")).fetchone())


async def failed_job(client, key: str, credential: str, **fields) -> dict:
    """A job submitted with ``fields``, claimed by the node and failed by it for good (``retry: false``)."""
    job = (await client.post("/v1/jobs", json={"kind": "render", **fields}, headers=bearer(key))).json()
    held = await http_claim(client, credential)
    assert held["id"] == job["id"]
    failed = await client.post(f"/v1/agent/jobs/{job['id']}/fail", json={"attempt": held["attempt"], "error": "driver crashed",
                                                                         "retry": False}, headers=bearer(credential))  # fmt: skip
    assert (failed.status_code, failed.json()["status"]) == (200, "failed"), failed.text
    return failed.json()


async def events_of(client, key: str, job_id: str) -> list[dict]:
    answer = await client.get(f"/v1/jobs/{job_id}/events", headers=bearer(key))
    assert answer.status_code == 200, answer.text
    return answer.json()["events"]


async def test_a_failed_job_retried_runs_again_as_the_same_job_and_its_history_says_so(client, org):
    """Retried, a failed job is queued again with its id, its place and its last error, ``max_attempts`` its
    charged run plus the three it was submitted with; the next claim takes it at the next attempt, and it
    completes. Its stream tells the whole story: the failure, ``job.retried`` naming who retried it, the run after."""
    _, key = org
    _, credential = await http_pair(client, key)
    job = await failed_job(client, key, credential)
    retried = await client.post(f"/v1/jobs/{job['id']}/retry", headers=bearer(key))
    assert retried.status_code == 200, retried.text
    body = retried.json()
    assert (body["id"], body["status"], body["attempt"], body["max_attempts"]) == (job["id"], "queued", 1, 4)
    assert (body["error"], body["finished_at"], body["lease_owner"], body["result"]) == ("driver crashed", None, None, None)
    again = await http_claim(client, credential)
    assert (again["id"], again["attempt"]) == (job["id"], 2)
    done = await http_complete(client, credential, again)
    assert (done["status"], done["attempt"], done["error"]) == ("complete", 2, None)
    history = await events_of(client, key, job["id"])
    assert [e["type"] for e in history] == ["job.submitted", "job.claimed", "job.failed", "job.retried", "job.claimed",
                                            "job.completed"]  # fmt: skip
    retry_event = history[3]
    assert retry_event["data"]["attempt"] == 1 and retry_event["data"]["max_attempts"] == 4
    assert retry_event["data"]["by"], retry_event  # the API key that retried it
    verified = await client.post("/v1/projections/verify", headers=bearer(key))
    assert verified.json() == {"ok": True, "differences": []}, verified.text


async def test_a_retry_grants_the_runs_it_names_and_they_are_spent_as_any_others(client, org):
    """``{"max_attempts": 1}`` grants one run whatever the job was submitted with (three): the retried job's
    next retryable failure fails it for good (``attempts_exhausted``). Granted two, the same failure requeues it."""
    _, key = org
    _, credential = await http_pair(client, key)
    for grant, after_failure in ((1, "failed"), (2, "queued")):
        job = await failed_job(client, key, credential)
        retried = await client.post(f"/v1/jobs/{job['id']}/retry", json={"max_attempts": grant}, headers=bearer(key))
        assert (retried.status_code, retried.json()["max_attempts"]) == (200, 1 + grant), retried.text
        held = await http_claim(client, credential)
        assert (held["id"], held["attempt"]) == (job["id"], 2)
        failed = await client.post(f"/v1/agent/jobs/{job['id']}/fail", json={"attempt": 2, "error": "again", "retry": True},
                                   headers=bearer(credential))  # fmt: skip
        assert failed.json()["status"] == after_failure, (grant, failed.text)
        if after_failure == "queued":
            await client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(key))  # out of the next round's way


@pytest.mark.parametrize("status", ["queued", "running", "complete", "cancelled"])
async def test_only_a_failed_job_is_retried_and_a_refusal_writes_nothing(client, org, db_url, status):
    """A job queued, running, complete or cancelled → 409 ``job_not_retryable`` naming its status; nothing is
    written."""
    _, key = org
    _, credential = await http_pair(client, key)
    job = (await client.post("/v1/jobs", json={"kind": "render"}, headers=bearer(key))).json()
    if status in ("running", "complete"):
        held = await http_claim(client, credential)
        if status == "complete":
            await http_complete(client, credential, held)
    if status == "cancelled":
        await client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(key))
    before = await written(db_url)
    refused = await client.post(f"/v1/jobs/{job['id']}/retry", headers=bearer(key))
    assert (refused.status_code, refused.json()["error"], refused.json()["status"]) == (409, "job_not_retryable", status)
    assert await written(db_url) == before


async def test_a_job_of_a_tree_is_not_retried(client, org, db_url):
    """A child that failed is refused (its parent's settlement already counts its failure), and so is the
    parent it settled."""
    _, key = org
    _, credential = await http_pair(client, key)
    parent = (await client.post("/v1/jobs", json={"kind": "book"}, headers=bearer(key))).json()
    held = await http_claim(client, credential)
    split = await client.post(f"/v1/agent/jobs/{parent['id']}/children",
                              json={"attempt": held["attempt"], "children": [{"kind": "page", "max_attempts": 1}]},
                              headers=bearer(credential))  # fmt: skip
    child = split.json()["children"][0]
    page = await http_claim(client, credential)
    assert page["id"] == child["id"]
    await client.post(f"/v1/agent/jobs/{child['id']}/fail", json={"attempt": page["attempt"], "error": "torn",
                                                                   "retry": False}, headers=bearer(credential))  # fmt: skip
    settled = (await client.get(f"/v1/jobs/{parent['id']}", headers=bearer(key))).json()
    assert settled["status"] in ("failed", "partial"), settled
    before = await written(db_url)
    for job_id in (child["id"], parent["id"]):
        refused = await client.post(f"/v1/jobs/{job_id}/retry", headers=bearer(key))
        assert (refused.status_code, refused.json()["error"]) == (409, "job_not_retryable"), refused.text
    assert await written(db_url) == before


async def test_who_may_retry_and_what_a_bad_request_gets(client, org, conn, db_url):
    """No credential → 401; a key without ``jobs:write`` → 403; a node → 403; another organization's job or no
    such job → 404 ``job_not_found``; a body that is not the contract's → 422 naming the field. None writes."""
    org_id, key = org
    _, credential = await http_pair(client, key)
    job = await failed_job(client, key, credential)
    _, other_key = await create_organization(conn, "other")
    reader = await create_api_key(conn, org_id, ["jobs:read"])
    path = f"/v1/jobs/{job['id']}/retry"
    before = await written(db_url)
    assert (await client.post(path)).status_code == 401
    assert (await client.post(path, headers=bearer(reader))).status_code == 403
    assert (await client.post(path, headers=bearer(credential))).status_code == 403
    for other in (path, "/v1/jobs/00000000-0000-0000-0000-000000000000/retry", "/v1/jobs/not-a-uuid/retry"):
        gone = await client.post(other, headers=bearer(other_key if other == path else key))
        assert (gone.status_code, gone.json()["error"]) == (404, "job_not_found"), other
    for bad, field in (({"max_attempts": 0}, "max_attempts"), ({"max_attempts": 101}, "max_attempts"),
                       ({"max_attempts": "3"}, "max_attempts"), ({"tries": 2}, None)):  # fmt: skip
        refused = await client.post(path, json=bad, headers=bearer(key))
        assert (refused.status_code, refused.json()["error"]) == (422, "invalid_request"), bad
        assert refused.json().get("field") == field, refused.json()
    assert await written(db_url) == before
    assert (await client.get(f"/v1/jobs/{job['id']}", headers=bearer(key))).json()["status"] == "failed"


async def test_a_retried_job_nothing_could_run_now_is_blocked_at_once(client, org):
    """A job no device of the fleet could run (the node that failed it was retired since) comes back blocked,
    with its reason, as a submission would: not queued looking alive."""
    _, key = org
    node_id, credential = await http_pair(client, key)
    job = await failed_job(client, key, credential)
    retired = await client.post(f"/v1/nodes/{node_id}/retire", headers=bearer(key))
    assert retired.status_code == 200, retired.text
    retried = await client.post(f"/v1/jobs/{job['id']}/retry", headers=bearer(key))
    assert (retried.status_code, retried.json()["status"]) == (200, "blocked"), retried.text
    history = [e["type"] for e in await events_of(client, key, job["id"])]
    assert history[-2:] == ["job.retried", "job.blocked"]


async def test_a_retry_wakes_a_parked_long_poll(client, org):
    """A node long-polling when the job is retried takes it at once, woken by the retry's hint rather than by
    the safety poll."""
    _, key = org
    _, credential = await http_pair(client, key)
    job = await failed_job(client, key, credential)
    answers = []
    async with anyio.create_task_group() as tg:

        async def poll() -> None:
            answers.append(await client.post("/v1/agent/claim", params={"wait": 20}, headers=bearer(credential)))

        tg.start_soon(poll)
        await anyio.sleep(0.5)
        started = anyio.current_time()
        assert (await client.post(f"/v1/jobs/{job['id']}/retry", headers=bearer(key))).status_code == 200
    (claimed,) = answers
    assert claimed.status_code == 200 and claimed.json()["job"]["id"] == job["id"], claimed.text
    assert anyio.current_time() - started < 5  # the safety poll comes far later


async def test_the_cli_retries_a_failed_job(client, org, live_server):
    """``umbra jobs retry ID`` retries through the API with an API key and prints the job it now is."""
    _, key = org
    _, credential = await http_pair(client, key)
    job = await failed_job(client, key, credential)
    done = await anyio.to_thread.run_sync(lambda: run_umbra("jobs", "retry", job["id"], "--max-attempts", "2", "--json",
                                                            "--server", live_server.url, env={"UMBRA_API_KEY": key}))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert '"status": "queued"' in done.stdout and '"max_attempts": 3' in done.stdout, done.stdout
    refused = await anyio.to_thread.run_sync(lambda: run_umbra("jobs", "retry", job["id"], "--server", live_server.url,
                                                               env={"UMBRA_API_KEY": key}))  # fmt: skip
    assert refused.returncode != 0 and "job_not_retryable" in refused.stderr, (refused.stdout, refused.stderr)
