"""The job routes over real HTTP: shapes, status codes, error codes, scopes, tenancy, fencing."""

from __future__ import annotations

import functools
from uuid import UUID

import anyio
import psycopg
import pytest

from umbra.compute import claims
from umbra.compute.accounts import create_api_key, create_organization, create_project
from umbra.compute.jobs import MAX_JSON_DEPTH
from tests.helpers import bearer

from .queue_support import http_claim, http_complete, http_pair

pytestmark = pytest.mark.anyio

JOB_FIELDS = {"id", "organization_id", "kind", "status", "priority", "requires", "payload", "project_id", "lang",
              "attempt", "max_attempts", "not_before", "parent_job_id", "idempotency_key", "lease_owner",
              "lease_expires_at", "result", "error", "placement", "created_at", "started_at", "finished_at"}  # fmt: skip


async def job_count(db_url) -> int:
    async with await psycopg.AsyncConnection.connect(db_url) as c:
        return (await (await c.execute("SELECT (SELECT count(*) FROM jobs) + (SELECT count(*) FROM events WHERE stream LIKE 'job:%%')")).fetchone())[0]


async def test_submit_read_and_idempotency(client, org):
    _, key = org
    await http_pair(client, key)
    created = await client.post("/v1/jobs", json={"kind": "echo", "payload": {"a": 1}, "priority": 0,
                                                  "idempotency_key": "k"}, headers=bearer(key))  # fmt: skip
    assert created.status_code == 201, created.text
    job = created.json()
    assert JOB_FIELDS <= set(job) and (job["status"], job["priority"], job["max_attempts"]) == ("queued", 0, 3)
    assert job["created_at"].endswith("Z") and job["requires"]["vram_min_mb"] == 0
    again = await client.post("/v1/jobs", json={"kind": "different", "idempotency_key": "k"}, headers=bearer(key))
    assert again.status_code == 200 and again.json()["id"] == job["id"] and again.json()["kind"] == "echo"
    read = await client.get(f"/v1/jobs/{job['id']}", headers=bearer(key))
    assert read.status_code == 200 and read.json()["id"] == job["id"]
    as_of = await client.get(f"/v1/jobs/{job['id']}", params={"as_of": 1}, headers=bearer(key))
    assert as_of.status_code == 404 and as_of.json()["error"] == "job_not_found"


async def test_refused_submissions_name_the_problem_and_write_nothing(client, org, db_url, conn):
    org_id, key = org
    other_id, _ = await create_organization(conn, "other")
    theirs = await create_project(conn, other_id, "p")
    before = await job_count(db_url)
    cases = [
        ({"payload": {}}, 422, "invalid_request", "kind"),
        ({"kind": "x", "colour": "red"}, 422, "invalid_request", None),
        ({"kind": "x", "priority": "high"}, 422, "invalid_request", "priority"),
        ({"kind": "x", "requires": {"vram_min_mb": -1}}, 422, "invalid_request", "requires.vram_min_mb"),
        ({"kind": "x", "requires": {"gpus": 2}}, 422, "invalid_request", None),
        ({"kind": "x", "max_attempts": 0}, 422, "invalid_request", "max_attempts"),
        ({"kind": " \t"}, 422, "invalid_request", "kind"),  # a blank name, refused as a model kind of spaces is
        ({"kind": "x", "requires": {"trust_domains": ["lab", "\u3000"]}}, 422, "invalid_request", "requires.trust_domains[1]"),
        ({"kind": "x", "payload": {"text": "nul\u0000"}}, 422, "invalid_request", None),  # PostgreSQL cannot store it
        ({"kind": "x", "project_id": str(theirs)}, 404, "project_not_found", None),
        ({"kind": "x", "project_id": "00000000-0000-4000-8000-000000000000"}, 404, "project_not_found", None),
    ]
    for body, status, code, field in cases:
        response = await client.post("/v1/jobs", json=body, headers=bearer(key))
        assert (response.status_code, response.json()["error"]) == (status, code), (body, response.text)
        assert response.json()["message"] and "regex" not in response.json()["message"]
        if field:
            assert response.json().get("field") == field, response.text
    malformed = await client.post("/v1/jobs", content=b"{not json", headers={**bearer(key), "content-type": "application/json"})
    assert malformed.status_code in (400, 422) and malformed.json()["error"] == "invalid_request"
    assert await job_count(db_url) == before


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH, 970, 5000])  # past the limit, near the recursion limit, past it
async def test_json_nested_too_deeply_is_refused_and_writes_nothing(client, org, db_url, levels):
    """A payload or result nested past MAX_JSON_DEPTH is a 422, never a 500, and nothing is written.

    Just short of the recursion limit msgspec decoded it, and encoding it again
    later failed: after the job or the result was written.
    """
    _, key = org
    _, credential = await http_pair(client, key)
    job = (await client.post("/v1/jobs", json={"kind": "e"}, headers=bearer(key))).json()
    claimed = await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(credential))
    assert claimed.json()["job"]["id"] == job["id"]
    deep = b'{"x":' + b"[" * levels + b"]" * levels + b"}"  # the object and its arrays: levels + 1 deep
    before = await job_count(db_url)
    refusals = [
        ("/v1/jobs", key, b'{"kind":"k","payload":' + deep + b"}"),
        ("/v1/jobs/batch", key, b'{"jobs":[{"kind":"k"},{"kind":"k","payload":' + deep + b"}]}"),
        (f"/v1/agent/jobs/{job['id']}/complete", credential, b'{"attempt":1,"result":' + deep + b"}"),
        (f"/v1/agent/jobs/{job['id']}/complete?claim_next=true", credential, b'{"attempt":1,"result":' + deep + b"}"),
        ("/v1/agent/complete", credential,
         b'{"results":[{"job_id":"' + job["id"].encode() + b'","attempt":1,"result":' + deep + b"}]}"),
        (f"/v1/agent/jobs/{job['id']}/children", credential,
         b'{"attempt":1,"children":[{"kind":"c","payload":' + deep + b"}]}"),
    ]
    fields = ["payload", "jobs[1].payload", "result", "result", "results[0].result", "children[0].payload"]
    for (path, token, body), field in zip(refusals, fields):
        answer = await client.post(path, content=body, headers={**bearer(token), "content-type": "application/json"})
        assert (answer.status_code, answer.json()["error"]) == (422, "invalid_request"), (path, answer.text[:300])
        # The refusal names the field: exactly where the field's own check found it, else the free-form fields.
        named = answer.json().get("field") == field if levels < 970 else field.rsplit(".", 1)[-1] in answer.json()["message"]
        assert named, (path, answer.json())
    assert await job_count(db_url) == before
    held = (await client.get(f"/v1/jobs/{job['id']}", headers=bearer(key))).json()
    assert (held["status"], held["result"]) == ("running", None)


async def test_json_nested_to_the_limit_is_stored_and_read_back(client, org):
    _, key = org
    _, credential = await http_pair(client, key)
    inner = MAX_JSON_DEPTH - 1  # the payload object is one level
    payload = {"x": functools.reduce(lambda value, _: [value], range(inner - 1), [])}
    job = await client.post("/v1/jobs", json={"kind": "k", "payload": payload}, headers=bearer(key))
    assert job.status_code == 201, job.text[:300]
    claimed = await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(credential))
    done = await client.post(f"/v1/agent/jobs/{job.json()['id']}/complete", json={"attempt": 1, "result": payload},
                             headers=bearer(credential))  # fmt: skip
    assert claimed.status_code == 200 and done.status_code == 200, done.text[:300]
    again = (await client.get(f"/v1/jobs/{job.json()['id']}", headers=bearer(key))).json()
    assert again["payload"] == payload and again["result"] == payload and again["status"] == "complete"
    assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 200
    events = await client.get(f"/v1/jobs/{job.json()['id']}/events", headers=bearer(key))
    assert events.status_code == 200 and events.json()["events"][0]["data"]["payload"] == payload


async def test_a_batch_is_all_or_nothing_and_names_the_failing_index(client, org, db_url):
    _, key = org
    await http_pair(client, key)
    jobs = [{"kind": "echo", "payload": {"i": i}} for i in range(3)]
    created = await client.post("/v1/jobs/batch", json={"jobs": jobs}, headers=bearer(key))
    assert created.status_code == 201 and [j["payload"]["i"] for j in created.json()["jobs"]] == [0, 1, 2]
    before = await job_count(db_url)
    bad = jobs + [{"kind": "echo", "priority": "soon"}]
    refused = await client.post("/v1/jobs/batch", json={"jobs": bad}, headers=bearer(key))
    assert refused.status_code == 422 and refused.json()["error"] == "invalid_request" and refused.json()["index"] == 3
    assert "jobs[3]" in refused.json()["message"]
    missing = jobs + [{"kind": "echo", "project_id": "00000000-0000-4000-8000-000000000000"}]
    refused = await client.post("/v1/jobs/batch", json={"jobs": missing}, headers=bearer(key))
    assert (refused.status_code, refused.json()["error"], refused.json()["index"]) == (404, "project_not_found", 3)
    too_many = await client.post("/v1/jobs/batch", json={"jobs": [{"kind": "e"}] * 10_001}, headers=bearer(key))
    assert too_many.status_code in (413, 422)
    assert (await client.post("/v1/jobs/batch", json={"jobs": []}, headers=bearer(key))).status_code == 422
    assert await job_count(db_url) == before


async def test_a_batch_of_known_idempotency_keys_still_answers_201(client, org, db_url):
    """Only the single ``POST /v1/jobs`` answers a known key with 200 (API.md); a batch is always 201."""
    _, key = org
    jobs = [{"kind": "echo", "idempotency_key": f"k{i}"} for i in range(2)]
    first = await client.post("/v1/jobs/batch", json={"jobs": jobs}, headers=bearer(key))
    assert first.status_code == 201, first.text
    ids = [job["id"] for job in first.json()["jobs"]]
    before = await job_count(db_url)
    again = await client.post("/v1/jobs/batch", json={"jobs": jobs}, headers=bearer(key))
    assert again.status_code == 201 and [job["id"] for job in again.json()["jobs"]] == ids, again.text
    assert await job_count(db_url) == before
    single = await client.post("/v1/jobs", json=jobs[0], headers=bearer(key))
    assert single.status_code == 200 and single.json()["id"] == ids[0]


async def test_listing_pages_by_cursor_and_filters_by_status(client, org):
    _, key = org
    await http_pair(client, key)
    await client.post("/v1/jobs/batch", json={"jobs": [{"kind": "e", "payload": {"i": i}} for i in range(5)]}, headers=bearer(key))
    blocked = await client.post("/v1/jobs", json={"kind": "gpu", "requires": {"accelerators": ["cuda"]}}, headers=bearer(key))
    assert blocked.json()["status"] == "blocked" and blocked.json()["blocked_reason"].startswith("no_eligible_device")
    seen, cursor = [], None
    while True:
        params = {"status": "queued", "limit": 2, **({"after": cursor} if cursor else {})}
        page = (await client.get("/v1/jobs", params=params, headers=bearer(key))).json()
        seen += [j["payload"]["i"] for j in page["jobs"]]
        if page["next"] is None:
            break
        cursor = page["next"]
    assert seen == [0, 1, 2, 3, 4]
    both = (await client.get("/v1/jobs", params={"status": "queued,blocked"}, headers=bearer(key))).json()
    assert len(both["jobs"]) == 6 and both["next"] is None
    bad = await client.get("/v1/jobs", params={"status": "done"}, headers=bearer(key))
    assert (bad.status_code, bad.json()["error"]) == (422, "invalid_request")
    assert (await client.get("/v1/jobs", params={"limit": 0}, headers=bearer(key))).status_code == 422


async def test_listing_filters_by_kind_repeated_and_with_status(client, org):
    """``?kind=`` (repeatable) keeps the jobs of those kinds, with ``status`` too, paged as ever; an empty kind
    → 422 naming it."""
    _, key = org
    await http_pair(client, key)  # a node that can run them: queued, not blocked
    jobs = [{"kind": kind, "payload": {"i": i}} for i, kind in enumerate(["render", "encode", "render", "tally", "render"])]
    await client.post("/v1/jobs/batch", json={"jobs": jobs}, headers=bearer(key))

    async def listed(**params) -> list[int]:
        seen, cursor = [], None
        while True:
            query = [*params.items(), ("limit", 2), *([("after", cursor)] if cursor else [])]
            query = [(name, v) for name, value in query for v in (value if isinstance(value, list) else [value])]
            page = (await client.get("/v1/jobs", params=query, headers=bearer(key))).json()
            seen += [j["payload"]["i"] for j in page["jobs"]]
            if page["next"] is None:
                return seen
            cursor = page["next"]

    assert await listed(kind="render") == [0, 2, 4]
    assert await listed(kind=["encode", "tally"]) == [1, 3]
    assert await listed(kind="render", status="queued") == [0, 2, 4]
    assert await listed(kind="render", status="failed") == []
    refused = await client.get("/v1/jobs", params={"kind": ""}, headers=bearer(key))
    assert (refused.status_code, refused.json()["field"]) == (422, "kind")


async def test_a_status_filter_with_an_empty_item_is_refused(client, org):
    """``status=,`` would filter on nothing and answer an empty page; an absent or blank ``status`` is no filter."""
    _, key = org
    await client.post("/v1/jobs", json={"kind": "e"}, headers=bearer(key))
    for raw in (",", " , ", "queued,", "queued,,blocked"):
        refused = await client.get("/v1/jobs", params={"status": raw}, headers=bearer(key))
        assert refused.status_code == 422, (raw, refused.text)
        assert (refused.json()["error"], refused.json().get("field")) == ("invalid_request", "status")
    for params in ({}, {"status": ""}, {"status": " "}):
        listed = await client.get("/v1/jobs", params=params, headers=bearer(key))
        assert listed.status_code == 200 and len(listed.json()["jobs"]) == 1, (params, listed.text)


async def test_cancel_and_tenancy_and_scopes(client, org, conn):
    org_id, key = org
    other_id, other_key = await create_organization(conn, "other")
    reader = await create_api_key(conn, org_id, ["jobs:read"])
    job = (await client.post("/v1/jobs", json={"kind": "e"}, headers=bearer(key))).json()
    for path in (f"/v1/jobs/{job['id']}", "/v1/jobs/not-a-uuid"):
        response = await client.get(path, headers=bearer(other_key))
        assert (response.status_code, response.json()["error"]) == (404, "job_not_found")
    assert (await client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(other_key))).status_code == 404
    assert (await client.post("/v1/jobs", json={"kind": "e"}, headers=bearer(reader))).status_code == 403
    assert (await client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(reader))).status_code == 403
    assert (await client.get("/v1/jobs")).status_code == 401
    cancelled = await client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(key))
    assert (cancelled.status_code, cancelled.json()["status"]) == (200, "cancelled")
    again = await client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(key))
    assert (again.status_code, again.json()["error"]) == (409, "job_terminal")


async def test_the_agent_routes_are_fenced_by_attempt(client, org, db_url):
    org_id, key = org
    node_id, credential = await http_pair(client, key)
    parent = (await client.post("/v1/jobs", json={"kind": "book", "lang": "de"}, headers=bearer(key))).json()
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
        got = await claims.claim(c, node_id=UUID(node_id), organization_id=org_id, lease_seconds=60)
    assert got.job["id"] == parent["id"] and got.attempt == 1
    base = f"/v1/agent/jobs/{parent['id']}"
    nul = await client.post(f"{base}/complete", json={"attempt": 1, "result": {"t": "\u0000"}}, headers=bearer(credential))
    assert (nul.status_code, nul.json()["error"]) == (422, "invalid_request")  # refused, the job still held
    renewed = await client.post(f"{base}/renew", json={"attempt": 1}, headers=bearer(credential))
    assert renewed.status_code == 200 and renewed.json()["lease_expires_at"].endswith("Z")
    stale = await client.post(f"{base}/complete", json={"attempt": 2, "result": {}}, headers=bearer(credential))
    assert (stale.status_code, stale.json()["error"]) == (409, "job_not_claimed_by_this_node")
    assert (await client.post(f"{base}/renew", json={"attempt": 1}, headers=bearer(key))).status_code == 403
    assert (await client.post(f"{base}/renew", json={"attempt": "one"}, headers=bearer(credential))).status_code == 422
    own = await client.get(f"/v1/jobs/{parent['id']}", headers=bearer(credential))
    assert own.status_code == 200 and own.json()["lease_owner"] == node_id
    split = await client.post(f"{base}/children", json={"attempt": 1, "children": [
        {"kind": "chapter", "payload": {"n": 1}}, {"kind": "chapter", "payload": {"n": 2}, "priority": 3}]},
        headers=bearer(credential))  # fmt: skip
    assert split.status_code == 201, split.text
    kids = split.json()["children"]
    assert [(k["parent_job_id"], k["lang"], k["priority"]) for k in kids] == [(parent["id"], "de", 100), (parent["id"], "de", 3)]
    other = (await client.post("/v1/jobs", json={"kind": "e", "priority": 999}, headers=bearer(key))).json()
    assert (await client.get(f"/v1/jobs/{other['id']}", headers=bearer(credential))).status_code == 404
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
        first = await claims.claim(c, node_id=UUID(node_id), organization_id=org_id, lease_seconds=60)
    kid = f"/v1/agent/jobs/{first.job['id']}"
    failed = await client.post(f"{kid}/fail", json={"attempt": 1, "error": "oom", "retry": True}, headers=bearer(credential))
    assert (failed.status_code, failed.json()["status"], failed.json()["error"]) == (200, "queued", "oom")
    assert failed.json()["not_before"] > failed.json()["created_at"]
    assert first.job["id"] == kids[1]["id"]  # priority 3 before the inherited 100
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
        second = await claims.claim(c, node_id=UUID(node_id), organization_id=org_id, lease_seconds=60)
    assert second.job["id"] == kids[0]["id"]  # the retried child waits out its backoff
    await client.post(f"/v1/jobs/{kids[0]['id']}/cancel", headers=bearer(key))
    gone = await client.post(f"/v1/agent/jobs/{kids[0]['id']}/complete", json={"attempt": 1}, headers=bearer(credential))
    assert (gone.status_code, gone.json()["error"]) == (409, "job_cancelled")


async def test_a_completion_can_claim_the_next_job_in_the_same_request(client, org, db_url):
    _, key = org
    node_id, credential = await http_pair(client, key)
    first, second = [(await client.post("/v1/jobs", json={"kind": "e", "payload": {"n": n}}, headers=bearer(key))).json()
                     for n in (1, 2)]  # fmt: skip
    claimed = (await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(credential))).json()
    assert claimed["job"]["id"] == first["id"]
    path = f"/v1/agent/jobs/{first['id']}/complete"
    bad = await client.post(path, params={"claim_next": "soon"}, json={"attempt": 1}, headers=bearer(credential))
    assert (bad.status_code, bad.json()["error"], bad.json()["field"]) == (422, "invalid_request", "claim_next")
    stale = await client.post(path, params={"claim_next": "true"}, json={"attempt": 2}, headers=bearer(credential))
    assert (stale.status_code, stale.json()["error"]) == (409, "job_not_claimed_by_this_node")
    assert (await client.get(f"/v1/jobs/{second['id']}", headers=bearer(key))).json()["status"] == "queued"
    done = await client.post(path, params={"claim_next": "true"}, json={"attempt": 1, "result": {"ok": True}},
                             headers=bearer(credential))  # fmt: skip
    assert done.status_code == 200, done.text
    body = done.json()
    assert JOB_FIELDS <= set(body) and (body["id"], body["status"], body["result"]) == (first["id"], "complete", {"ok": True})
    chained = body["next_claim"]
    assert set(chained) == {"job", "placement", "lease_expires_at"}
    assert (chained["job"]["id"], chained["job"]["attempt"], chained["job"]["lease_owner"]) == (second["id"], 1, node_id)
    assert chained["placement"]["node_id"] == node_id and chained["lease_expires_at"].endswith("Z")
    last = await client.post(f"/v1/agent/jobs/{second['id']}/complete", params={"claim_next": "1"}, json={"attempt": 1},
                             headers=bearer(credential))  # fmt: skip
    assert last.status_code == 200 and last.json()["status"] == "complete" and last.json()["next_claim"] is None
    history = await client.get(f"/v1/jobs/{second['id']}/events", headers=bearer(key))
    assert [e["type"] for e in history.json()["events"]] == ["job.submitted", "job.claimed", "job.completed"]


async def test_an_agent_can_claim_and_report_several_jobs_per_request(client, org):
    _, key = org
    node_id, credential = await http_pair(client, key)
    agent = bearer(credential)
    batch = await client.post("/v1/jobs/batch", json={"jobs": [{"kind": "e", "payload": {"n": n}} for n in range(6)]},
                              headers=bearer(key))  # fmt: skip
    ids = [job["id"] for job in batch.json()["jobs"]]
    for bad in ("0", "101", "many"):
        refused = await client.post("/v1/agent/claim", params={"wait": 0, "max": bad}, headers=agent)
        assert (refused.status_code, refused.json()["field"]) == (422, "max")
    three = (await client.post("/v1/agent/claim", params={"wait": 0, "max": 3}, headers=agent)).json()
    assert [c["job"]["id"] for c in three["claims"]] == ids[:3]
    assert {k: three[k] for k in ("job", "placement", "lease_expires_at")} == three["claims"][0]
    assert all(c["job"]["lease_owner"] == node_id and c["job"]["attempt"] == 1 for c in three["claims"])
    report = [{"job_id": ids[0], "attempt": 1, "result": {"n": 0}}, {"job_id": ids[1], "attempt": 2},  # stale
              {"job_id": ids[3], "attempt": 1}, {"job_id": ids[2], "attempt": 1, "result": {"n": 2}}]  # ids[3]: not held
    twice = await client.post("/v1/agent/complete", json={"results": [report[0], report[0]]}, headers=agent)
    assert (twice.status_code, twice.json()["error"], twice.json()["index"]) == (422, "invalid_request", 1)
    done = await client.post("/v1/agent/complete", params={"claim_next": 2}, json={"results": report}, headers=agent)
    assert done.status_code == 200, done.text
    answers = done.json()["results"]
    assert [(a["job_id"], a["status"]) for a in answers] == [(ids[0], 200), (ids[1], 409), (ids[3], 409), (ids[2], 200)]
    assert answers[0]["job"]["result"] == {"n": 0} and answers[3]["job"]["status"] == "complete"
    assert answers[1]["error"] == answers[2]["error"] == "job_not_claimed_by_this_node"
    assert [c["job"]["id"] for c in done.json()["next_claims"]] == ids[3:5]
    held = (await client.get(f"/v1/jobs/{ids[1]}", headers=bearer(key))).json()
    assert (held["status"], held["attempt"], held["lease_owner"]) == ("running", 1, node_id)  # refused: unchanged
    one = (await client.post("/v1/agent/claim", params={"wait": 0}, headers=agent)).json()
    assert one["job"]["id"] == ids[5] and "claims" not in one  # max=1: the contract's answer exactly
    empty = await client.post("/v1/agent/claim", params={"wait": 0, "max": 5}, headers=agent)
    assert empty.status_code == 204


async def test_a_slowly_sent_body_holds_no_database_connection(db_url, org):
    """Three clients stall halfway through their bodies on a server whose pool has two
    connections; other requests are still served (the request is authenticated on a
    borrowed connection, and the body is read with none held)."""
    import anyio
    import httpx

    from tests.conftest import LiveServer

    _, key = org
    body = b'{"kind": "slow", "payload": {}}'
    with LiveServer(db_url, UMBRA_POOL_SIZE="2") as server:
        stalled = []
        try:
            for _ in range(3):
                stream = await anyio.connect_tcp("127.0.0.1", server.port)
                stalled.append(stream)
                head = (f"POST /v1/jobs HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {key}\r\n"
                        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
                await stream.send(head + body[:10])
            await anyio.sleep(0.5)  # the stalled requests are past authentication, waiting for their bodies
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                listed = await client.get("/v1/jobs", headers=bearer(key))
                assert listed.status_code == 200 and listed.json()["jobs"] == []
                for stream in stalled:  # the rest of each body: each submission then completes
                    await stream.send(body[10:])
                    assert b" 201 " in (await stream.receive())[:20]
                listed = await client.get("/v1/jobs", headers=bearer(key))
                assert [job["kind"] for job in listed.json()["jobs"]] == ["slow"] * 3
        finally:
            for stream in stalled:
                await stream.aclose()


@pytest.mark.parametrize("hidden", ["escaped_nul", "raw_nul", "too_deep"])
async def test_an_item_refused_for_a_nul_or_its_depth_is_named_by_index(client, org, db_url, hidden):
    """A NUL is refused before the body is decoded, and nesting past the decoder's recursion is refused
    by the decoder without a path: the refusal still names the item, and one bad item refuses them all."""
    _, key = org
    _, credential = await http_pair(client, key)
    job = (await client.post("/v1/jobs", json={"kind": "e"}, headers=bearer(key))).json()
    claimed = await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(credential))
    assert claimed.json()["job"]["id"] == job["id"]
    bad = {"escaped_nul": b'"x\\u0000y"', "raw_nul": b'"x\x00y"', "too_deep": b"[" * 5000 + b"]" * 5000}[hidden]
    other = b'"00000000-0000-4000-8000-000000000000"'
    refusals = [
        ("/v1/jobs/batch", key, "jobs", b'{"jobs":[{"kind":"a"},{"kind":"b","payload":{"t":' + bad + b"}}]}"),
        (f"/v1/agent/jobs/{job['id']}/children", credential, "children",
         b'{"attempt":1,"children":[{"kind":"a"},{"kind":"b","payload":{"t":' + bad + b"}},{\"kind\":\"c\"}]}"),
        ("/v1/agent/complete", credential, "results",
         b'{"results":[{"job_id":' + other + b',"attempt":1},{"job_id":"' + job["id"].encode() + b'","attempt":1,'
         b'"result":{"t":' + bad + b"}}]}"),
    ]  # fmt: skip
    before = await job_count(db_url)
    for path, token, items, body in refusals:
        answer = await client.post(path, content=body, headers={**bearer(token), "content-type": "application/json"})
        refusal = answer.json()
        assert (answer.status_code, refusal["error"], refusal.get("index"), refusal.get("field")) == (
            422, "invalid_request", 1, f"{items}[1]"), (path, answer.text[:300])  # fmt: skip
    assert await job_count(db_url) == before
    held = (await client.get(f"/v1/jobs/{job['id']}", headers=bearer(key))).json()
    assert (held["status"], held["result"]) == ("running", None)


async def test_an_oversized_chunked_body_to_cancel_is_refused_and_cancels_nothing(client, org, db_url):
    """The route takes no body, so it never read one: the limit held only for bodies a route read."""
    _, key = org
    await http_pair(client, key)  # a node that could run it: the job is queued, not blocked
    job = (await client.post("/v1/jobs", json={"kind": "e"}, headers=bearer(key))).json()
    assert job["status"] == "queued"
    before = await job_count(db_url)

    async def chunks():  # 2.5 MiB with no Content-Length
        for _ in range(40):
            yield b"x" * (64 * 1024)

    refused = await client.post(f"/v1/jobs/{job['id']}/cancel", content=chunks(), headers=bearer(key))
    assert (refused.status_code, refused.json()["error"]) == (413, "payload_too_large"), refused.text[:300]
    assert await job_count(db_url) == before
    still = await client.get(f"/v1/jobs/{job['id']}", headers=bearer(key))
    assert still.json()["status"] == "queued"
    cancelled = await client.post(f"/v1/jobs/{job['id']}/cancel", content=b"", headers=bearer(key))
    assert (cancelled.status_code, cancelled.json()["status"]) == (200, "cancelled")


async def test_a_node_reads_a_job_it_held_after_it_was_requeued(client, org, conn):
    """The job's lease_owner names only its current holder; a node that held it once may still read it."""
    _, key = org
    node_id, credential = await http_pair(client, key, "box")
    _, bystander = await http_pair(client, key, "other-box")
    _, other_key = await create_organization(conn, "other")
    job = (await client.post("/v1/jobs", json={"kind": "e"}, headers=bearer(key))).json()
    claimed = await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(credential))
    assert claimed.json()["job"]["id"] == job["id"]
    failed = await client.post(f"/v1/agent/jobs/{job['id']}/fail", json={"attempt": 1, "error": "oom", "retry": True},
                               headers=bearer(credential))  # fmt: skip
    assert (failed.json()["status"], failed.json()["lease_owner"]) == ("queued", None)
    mine = await client.get(f"/v1/jobs/{job['id']}", headers=bearer(credential))
    assert mine.status_code == 200, mine.text
    assert (mine.json()["status"], mine.json()["error"]) == ("queued", "oom")
    history = (await client.get(f"/v1/jobs/{job['id']}/events", headers=bearer(key))).json()["events"]
    claimed_at = next(e["position"] for e in history if e["type"] == "job.claimed")
    for position in (claimed_at, claimed_at - 1):  # while it held it, and before: the same job's history
        as_of = await client.get(f"/v1/jobs/{job['id']}", params={"as_of": position}, headers=bearer(credential))
        assert as_of.status_code == 200, (position, as_of.text)
    # A node that never held it, a job it never held, another organization's job: as if missing.
    never = (await client.post("/v1/jobs", json={"kind": "e", "priority": 999}, headers=bearer(key))).json()
    theirs = (await client.post("/v1/jobs", json={"kind": "e"}, headers=bearer(other_key))).json()
    for token, job_id in ((bystander, job["id"]), (credential, never["id"]), (credential, theirs["id"])):
        for params in ({}, {"as_of": claimed_at}):
            answer = await client.get(f"/v1/jobs/{job_id}", params=params, headers=bearer(token))
            assert (answer.status_code, answer.json()["error"]) == (404, "job_not_found"), (job_id, params, answer.text)
    assert node_id == claimed.json()["job"]["lease_owner"]


async def test_priority_then_submission_order_across_interleaved_batches_and_singles(client, org):
    """Lower priority runs first; equal priorities run in submission order, whichever route submitted them,
    down to the 32-bit bounds."""
    _, key = org
    _, credential = await http_pair(client, key)

    async def single(name: str, priority: int) -> None:
        assert (await client.post("/v1/jobs", json={"kind": "k", "payload": {"n": name}, "priority": priority},
                                  headers=bearer(key))).status_code == 201  # fmt: skip

    async def batch(*items: tuple[str, int]) -> None:
        body = {"jobs": [{"kind": "k", "payload": {"n": n}, "priority": p} for n, p in items]}
        assert (await client.post("/v1/jobs/batch", json=body, headers=bearer(key))).status_code == 201

    await single("A", 5)
    await batch(("B", 5), ("C", 1), ("D", 5))
    await single("E", 1)
    await batch(("F", -(2**31)))
    await single("G", 5)
    await batch(("H", 1), ("I", 2**31 - 1))
    order = []
    for _ in range(9):
        job = await http_claim(client, credential)
        order.append(job["payload"]["n"])
        await http_complete(client, credential, job)
    assert order == ["F", "C", "E", "H", "A", "B", "D", "G", "I"]


async def test_max_attempts_one_fails_on_the_first_retryable_failure(client, org):
    """max_attempts=1: a retryable failure of the only attempt fails the job for good (no requeue)."""
    _, key = org
    _, credential = await http_pair(client, key)
    job = (await client.post("/v1/jobs", json={"kind": "k", "max_attempts": 1}, headers=bearer(key))).json()
    held = await http_claim(client, credential)
    assert held["id"] == job["id"]
    failed = await client.post(f"/v1/agent/jobs/{job['id']}/fail", json={"attempt": held["attempt"], "error": "boom", "retry": True},
                               headers=bearer(credential))  # fmt: skip
    assert (failed.status_code, failed.json()["status"], failed.json()["error"]) == (200, "failed", "boom")


async def test_a_node_credential_cannot_list_submit_or_cancel_and_reads_no_child_it_made(client, org):
    """A node reads only jobs it held: not the children of its own decomposition (it never claimed them),
    and it can neither list, submit nor cancel."""
    _, key = org
    _, credential = await http_pair(client, key)
    parent = (await client.post("/v1/jobs", json={"kind": "book"}, headers=bearer(key))).json()
    held = await http_claim(client, credential)
    split = await client.post(f"/v1/agent/jobs/{parent['id']}/children",
                              json={"attempt": held["attempt"], "children": [{"kind": "page"}]}, headers=bearer(credential))  # fmt: skip
    assert split.status_code == 201, split.text
    child = split.json()["children"][0]
    assert (await client.get(f"/v1/jobs/{parent['id']}", headers=bearer(credential))).status_code == 200
    assert (await client.get(f"/v1/jobs/{child['id']}", headers=bearer(credential))).status_code == 404
    assert (await client.get("/v1/jobs", headers=bearer(credential))).status_code == 403
    assert (await client.post("/v1/jobs", json={"kind": "k"}, headers=bearer(credential))).status_code == 403
    assert (await client.post(f"/v1/jobs/{parent['id']}/cancel", headers=bearer(credential))).status_code == 403


async def test_concurrent_cancels_of_one_job_cancel_it_once(client, org):
    """Ten cancels of one running job at once: exactly one 200, the others 409 job_terminal, one
    job.cancelled event."""
    _, key = org
    _, credential = await http_pair(client, key)
    job = (await client.post("/v1/jobs", json={"kind": "k"}, headers=bearer(key))).json()
    await http_claim(client, credential)  # running: the cancel keeps the holder
    answers: list = []

    async def cancel() -> None:
        answers.append(await client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(key)))

    async with anyio.create_task_group() as tg:
        for _ in range(10):
            tg.start_soon(cancel)
    assert sorted(a.status_code for a in answers) == [200] + [409] * 9
    assert all(a.json()["error"] == "job_terminal" for a in answers if a.status_code == 409)
    events = (await client.get(f"/v1/jobs/{job['id']}/events", headers=bearer(key))).json()["events"]
    assert [e["type"] for e in events].count("job.cancelled") == 1


async def test_cancelling_a_finished_job_is_409_job_terminal_and_writes_nothing(client, org, db_url, conn):
    """Cancelling a complete or failed job (with a jobs:write key) is 409 job_terminal; status and log unchanged."""
    org_id, key = org
    writer = await create_api_key(conn, org_id, ["jobs:write", "jobs:read"])
    _, credential = await http_pair(client, key)
    done = (await client.post("/v1/jobs", json={"kind": "k"}, headers=bearer(key))).json()
    await http_complete(client, credential, await http_claim(client, credential))
    failed = (await client.post("/v1/jobs", json={"kind": "k", "max_attempts": 1}, headers=bearer(key))).json()
    held = await http_claim(client, credential)
    await client.post(f"/v1/agent/jobs/{held['id']}/fail", json={"attempt": held["attempt"], "error": "e", "retry": False},
                      headers=bearer(credential))  # fmt: skip
    before = await job_count(db_url)
    for job, status in ((done, "complete"), (failed, "failed")):
        refused = await client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(writer))
        assert (refused.status_code, refused.json()["error"]) == (409, "job_terminal"), refused.text
        assert (await client.get(f"/v1/jobs/{job['id']}", headers=bearer(key))).json()["status"] == status
    assert await job_count(db_url) == before
