"""An operator's retry of a failed job (``POST /v1/jobs/{id}/retry``): the same job back in its place in the
queue, with more runs, its history going on in its own stream; refused, writing nothing, for any job that did
not fail or belongs to a tree."""

from __future__ import annotations

import json

import anyio
import httpx
import pytest

from tests.conftest import LiveServer
from tests.helpers import bearer, run_umbra
from umbra.compute import claims, retries
from umbra.compute.accounts import create_api_key, create_organization
from umbra.compute.sweeper import sweep_once
from umbra.errors import Conflict
from umbra.projections.verify import verify
from umbra.settings import load_settings

from .queue_support import CPU64, add_node, beat, http_claim, http_complete, http_pair, set_clock, submit, written

SETTINGS = load_settings({})

pytestmark = pytest.mark.anyio


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
    # The order docs/API.md gives: the id's form, then the body, then the job it names.
    bad = {"max_attempts": 0}
    for other, answer in (("/v1/jobs/not-a-uuid/retry", 404), ("/v1/jobs/00000000-0000-0000-0000-000000000000/retry", 422)):
        assert (await client.post(other, json=bad, headers=bearer(key))).status_code == answer, other
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


async def test_a_retry_wakes_a_parked_long_poll(db_url, org):
    """A node long-polling when the job is retried takes it at once, woken by the retry's hint: the server's
    safety poll is 30 s away."""
    _, key = org
    with LiveServer(db_url, UMBRA_POLL_FALLBACK_SECONDS="30") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
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
            assert anyio.current_time() - started < 5


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


# -- the run budget across ends that are not charged ------------------------------------------------------


async def test_a_revocation_charged_before_a_retry_stays_charged_after_it(client, org, conn):
    """A job allowed one run is revoked out from under two nodes: the first revocation is free, the second is
    charged and fails it. Retried with one run, that run's retryable failure fails it for good: the retry's
    larger ``max_attempts`` does not make the charged revocation free again (which bought a second run), and
    explain counts it as the run it was."""
    org_id, key = org
    nodes = [await http_pair(client, key, name=f"box{i}") for i in range(3)]
    job = (await client.post("/v1/jobs", json={"kind": "render", "max_attempts": 1}, headers=bearer(key))).json()
    for node_id, credential in nodes[:2]:
        assert (await http_claim(client, credential))["id"] == job["id"]
        assert (await client.post(f"/v1/nodes/{node_id}/revoke", headers=bearer(key))).status_code == 200
    assert (await client.get(f"/v1/jobs/{job['id']}", headers=bearer(key))).json()["status"] == "failed"
    retried = await client.post(f"/v1/jobs/{job['id']}/retry", json={"max_attempts": 1}, headers=bearer(key))
    assert (retried.status_code, retried.json()["max_attempts"]) == (200, 2), retried.text
    held = await http_claim(client, nodes[2][1])
    told = (await client.get(f"/v1/jobs/{job['id']}/explain", headers=bearer(key))).json()["summary"]
    assert "run 2 of 2" in told and "1 earlier claim not charged" in told, told
    failed = await client.post(f"/v1/agent/jobs/{job['id']}/fail", json={"attempt": held["attempt"], "error": "again",
                                                                         "retry": True}, headers=bearer(nodes[2][1]))  # fmt: skip
    assert failed.json()["status"] == "failed", failed.json()
    assert await verify(conn, org_id) == []


async def test_after_a_retry_interruptions_are_free_only_as_many_times_as_the_runs_it_granted(client, org):
    """A one-run job given back twice by a stopping agent (the second charged: it failed) and retried with the
    default grant (one run) starts its count afresh, as if submitted with one run: the next give-back is free
    (queued again), the one after is charged and fails it."""
    _, key = org
    _, credential = await http_pair(client, key)
    job = (await client.post("/v1/jobs", json={"kind": "render", "max_attempts": 1}, headers=bearer(key))).json()

    async def give_back() -> str:
        held = await http_claim(client, credential)
        back = await client.post(f"/v1/agent/jobs/{job['id']}/release", json={"attempt": held["attempt"]},
                                 headers=bearer(credential))  # fmt: skip
        assert back.status_code == 200, back.text
        return back.json()["status"]

    assert [await give_back(), await give_back()] == ["queued", "failed"]
    retried = await client.post(f"/v1/jobs/{job['id']}/retry", headers=bearer(key))
    assert (retried.status_code, retried.json()["max_attempts"]) == (200, 2), retried.text
    assert [await give_back(), await give_back()] == ["queued", "failed"]


# -- fencing, races, the sweeper, reads ---------------------------------------------------------------------


async def test_the_old_holders_reports_after_a_retry_are_refused_and_change_nothing(client, org, db_url):
    """The node whose run failed, reporting on that attempt after the retry (a completion, a renewal, a failure,
    a give-back, children), is refused 409 and writes nothing, while the job waits and once it runs again.
    (Its own failure sent again is refused too: the job no longer stands as that failure left it.)"""
    _, key = org
    _, credential = await http_pair(client, key)
    job = await failed_job(client, key, credential)
    assert (await client.post(f"/v1/jobs/{job['id']}/retry", headers=bearer(key))).status_code == 200
    path = f"/v1/agent/jobs/{job['id']}"
    stale = (("complete", {"attempt": 1, "result": {}}), ("renew", {"attempt": 1}),
             ("fail", {"attempt": 1, "error": "driver crashed", "retry": False}), ("release", {"attempt": 1}),
             ("children", {"attempt": 1, "children": [{"kind": "x"}]}))  # fmt: skip
    for claimed_again in (False, True):
        if claimed_again:
            again = await http_claim(client, credential)
            assert again["attempt"] == 2
        before = await written(db_url)
        for verb, body in stale:
            answer = await client.post(f"{path}/{verb}", json=body, headers=bearer(credential))
            assert (answer.status_code, answer.json()["error"]) == (409, "job_not_claimed_by_this_node"), (verb, answer.text)
        assert await written(db_url) == before
    assert (await http_complete(client, credential, again))["status"] == "complete"


async def test_retries_at_once_retry_the_job_once(client, org):
    """Four retries of one failed job sent at once: one is answered 200, the others 409 (it is queued by then),
    and one ``job.retried`` is recorded."""
    _, key = org
    _, credential = await http_pair(client, key)
    job = await failed_job(client, key, credential)
    answers = []

    async def send() -> None:
        answers.append(await client.post(f"/v1/jobs/{job['id']}/retry", headers=bearer(key)))

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(send)
    assert sorted(a.status_code for a in answers) == [200, 409, 409, 409], [a.text for a in answers]
    assert [e["type"] for e in await events_of(client, key, job["id"])].count("job.retried") == 1


async def test_jobs_failed_by_the_sweeper_are_retried_and_keep_their_fencing(conn, org):
    """A job failed because its lease ran out is retried at its attempt; its late holder is refused, the next
    claim is attempt 2. A job failed by the blocked timeout (never claimed) comes back blocked, its deadline
    running from the retry."""
    org_id, _ = org
    node = await add_node(conn, org_id, "w", [CPU64])
    lapsed = await submit(conn, org_id, max_attempts=1)
    assert (await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=30)).job_id == lapsed.id
    stuck = await submit(conn, org_id, requires={"accelerators": ["cuda"]})
    assert stuck.status == "blocked"
    await set_clock(conn, SETTINGS.blocked_timeout_seconds + 1)
    swept = await sweep_once(conn, SETTINGS)
    assert (swept.leases_failed, swept.blocked_failed) == (1, 1)
    row = await retries.retry(conn, org_id, lapsed.id, actor="key:test")
    assert (row.status, row.attempt, row.max_attempts) == ("queued", 1, 2)
    with pytest.raises(Conflict):
        await claims.complete(conn, organization_id=org_id, node_id=node, job_id=lapsed.id, attempt=1, result={})
    await beat(conn, org_id, node, [CPU64])
    again = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=30)
    assert (again.job_id, again.attempt) == (lapsed.id, 2)
    row = await retries.retry(conn, org_id, stuck.id, actor="key:test")
    assert (row.status, row.attempt, row.max_attempts) == ("blocked", 0, 3)
    assert (await sweep_once(conn, SETTINGS)).blocked_failed == 0  # its deadline runs from the retry
    assert await verify(conn, org_id) == []


async def test_as_of_reads_the_job_as_it_stood_on_each_side_of_the_retry(client, org):
    _, key = org
    _, credential = await http_pair(client, key)
    job = await failed_job(client, key, credential)
    retried = (await client.post(f"/v1/jobs/{job['id']}/retry", json={"max_attempts": 5}, headers=bearer(key))).json()
    history = await events_of(client, key, job["id"])
    at = {e["type"]: e["position"] for e in history}
    then = (await client.get(f"/v1/jobs/{job['id']}", params={"as_of": at["job.failed"]}, headers=bearer(key))).json()
    after = (await client.get(f"/v1/jobs/{job['id']}", params={"as_of": at["job.retried"]}, headers=bearer(key))).json()
    assert (then, after) == (job, retried)
    assert (after["status"], after["max_attempts"]) == ("queued", 6)


async def test_the_cli_retries_every_failed_job_of_a_kind(client, org, live_server):
    """``umbra jobs retry-failed --kind render``: every failed render job is queued again, in submission order;
    a failed job of another kind and a failed child are left as they are, the child listed as not retried."""
    _, key = org
    _, credential = await http_pair(client, key)
    renders = [await failed_job(client, key, credential) for _ in range(3)]
    other = await failed_job(client, key, credential, kind="encode")
    parent = (await client.post("/v1/jobs", json={"kind": "render"}, headers=bearer(key))).json()
    held = await http_claim(client, credential)
    split = await client.post(f"/v1/agent/jobs/{parent['id']}/children", headers=bearer(credential),
                              json={"attempt": held["attempt"], "children": [{"kind": "render", "max_attempts": 1}]})
    child = split.json()["children"][0]
    page = await http_claim(client, credential)
    await client.post(f"/v1/agent/jobs/{child['id']}/fail", json={"attempt": page["attempt"], "error": "torn", "retry": False},
                      headers=bearer(credential))  # fmt: skip
    done = await anyio.to_thread.run_sync(lambda: run_umbra("jobs", "retry-failed", "--kind", "render", "--json", "--server",
                                                            live_server.url, env={"UMBRA_API_KEY": key}))  # fmt: skip
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["retried"] == [job["id"] for job in renders], answer
    assert [(r["id"], r["error"]) for r in answer["refused"]] == [(child["id"], "job_not_retryable")], answer
    statuses = {job_id: (await client.get(f"/v1/jobs/{job_id}", headers=bearer(key))).json()["status"]
                for job_id in [*answer["retried"], other["id"], child["id"]]}  # fmt: skip
    assert [statuses[job["id"]] for job in renders] == ["queued"] * 3
    assert (statuses[other["id"]], statuses[child["id"]]) == ("failed", "failed")
