"""The event log over HTTP: paging, per-job history, tenancy and refusals."""

from __future__ import annotations

import uuid

import httpx
import pytest

from umbra.compute.accounts import create_api_key, create_organization
from umbra.events import store
from umbra.events.types import JobCancelled, JobSubmitted, NodeDraining

pytestmark = pytest.mark.anyio


def _submitted(i: int) -> JobSubmitted:
    return JobSubmitted(kind="echo", priority=100, max_attempts=3, payload={"i": i})


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _interleaved_history(conn, mine: uuid.UUID, theirs: uuid.UUID, n: int) -> list[int]:
    """Append ``n`` events for ``mine`` interleaved with others'; return mine's positions."""
    positions = []
    for i in range(n):
        recorded = await store.append(conn, store.job_stream(uuid.uuid4()), 0, [_submitted(i)], organization_id=mine)
        positions.append(recorded[0].position)
        await store.append(conn, store.node_stream(uuid.uuid4()), 0, [NodeDraining()], organization_id=theirs)
    return positions


async def test_paging_from_zero_yields_every_event_once_in_commit_order(conn, org, live_server):
    org_id, key = org
    other, _ = await create_organization(conn, "other")
    positions = await _interleaved_history(conn, org_id, other, 25)
    seen: list[int] = []
    after = 0
    async with httpx.AsyncClient(base_url=live_server.url, headers=_auth(key)) as client:
        while True:
            page = (await client.get("/v1/events", params={"after": after, "limit": 10})).json()
            if not page["events"]:
                assert page["next"] == after
                break
            assert all(e["organization_id"] == str(org_id) for e in page["events"])
            seen += [e["position"] for e in page["events"]]
            after = page["next"]
            assert after == page["events"][-1]["position"]
        again = (await client.get("/v1/events", params={"limit": 1000})).json()
    assert seen == positions
    assert [e["position"] for e in again["events"]] == positions
    first = again["events"][0]
    assert first["type"] == "job.submitted" and first["version"] == 1
    assert first["stream"].startswith("job:") and first["data"]["payload"] == {"i": 0}
    assert first["recorded_at"].endswith("Z")


async def test_job_history_in_stream_order_and_invisible_to_other_tenants(conn, org, live_server):
    org_id, key = org
    other, other_key = await create_organization(conn, "other")
    job = uuid.uuid4()
    stream = store.job_stream(job)
    await store.append(conn, stream, 0, [_submitted(1)], organization_id=org_id)
    await store.append(conn, store.node_stream(uuid.uuid4()), 0, [NodeDraining()], organization_id=org_id)
    await store.append(conn, stream, 1, [JobCancelled(by="me")], organization_id=org_id)
    async with httpx.AsyncClient(base_url=live_server.url) as client:
        mine = await client.get(f"/v1/jobs/{job}/events", headers=_auth(key))
        theirs = await client.get(f"/v1/jobs/{job}/events", headers=_auth(other_key))
        missing = await client.get(f"/v1/jobs/{uuid.uuid4()}/events", headers=_auth(key))
        garbage = await client.get("/v1/jobs/not-a-uuid/events", headers=_auth(key))
    assert mine.status_code == 200
    assert [(e["version"], e["type"]) for e in mine.json()["events"]] == [(1, "job.submitted"), (2, "job.cancelled")]
    for response in (theirs, missing, garbage):
        assert response.status_code == 404
        assert response.json()["error"] == "job_not_found"


async def test_refusals_name_the_problem(conn, org, live_server):
    org_id, _ = org
    no_events_scope = await create_api_key(conn, org_id, ["jobs:read"])
    _, key = org
    async with httpx.AsyncClient(base_url=live_server.url) as client:
        anonymous = await client.get("/v1/events")
        wrong = await client.get("/v1/events", headers=_auth("uk_nothing_here"))
        forbidden = await client.get("/v1/events", headers=_auth(no_events_scope))
        forbidden_stream = await client.get("/v1/events/stream", headers=_auth(no_events_scope))
        negative = await client.get("/v1/events", params={"after": -1}, headers=_auth(key))
        too_big = await client.get("/v1/events", params={"limit": 5000}, headers=_auth(key))
        words = await client.get("/v1/events", params={"limit": "ten"}, headers=_auth(key))
    assert anonymous.status_code == 401 and anonymous.json()["error"] == "unauthenticated"
    assert wrong.status_code == 401
    assert forbidden.status_code == 403 and forbidden.json()["error"] == "forbidden"
    assert forbidden_stream.status_code == 403
    for response, field in ((negative, "after"), (too_big, "limit"), (words, "limit")):
        assert response.status_code == 422
        assert response.json()["error"] == "invalid_request"
        assert response.json()["field"] == field
        assert field in response.json()["message"]


async def test_a_newer_writers_event_type_and_value_are_read_as_stored_and_skipped_by_the_folds(conn, org, live_server):
    """A rolling upgrade: events this server cannot decode must not stop the log, the stream or verify."""
    import json

    from tests.integration.queue_support import CPU64, add_node, submit

    org_id, key = org
    await add_node(conn, org_id, "box", [CPU64])
    job = await submit(conn, org_id)
    newer = [
        ("job.preempted", {"type": "job.preempted", "by": "scheduler-2"}),  # a type this server does not know
        ("job.failed", {"type": "job.failed", "attempt": 0, "error": "x", "reason": "preempted"}),  # a value
    ]
    for version, (kind, data) in enumerate(newer, start=2):
        await conn.execute(
            "INSERT INTO events (stream, version, type, organization_id, data) VALUES (%s, %s, %s, %s, %s::jsonb)",
            (store.job_stream(job.id), version, kind, org_id, json.dumps(data)))  # fmt: skip
    async with httpx.AsyncClient(base_url=live_server.url, headers=_auth(key), timeout=10) as client:
        page = (await client.get("/v1/events", params={"after": 0, "limit": 1000})).json()
        history = (await client.get(f"/v1/jobs/{job.id}/events")).json()["events"]
        as_of = await client.get(f"/v1/jobs/{job.id}", params={"as_of": page["next"]})
        async with client.stream("GET", "/v1/events/stream", params={"after": 0}) as stream:
            ids = []
            async for line in stream.aiter_lines():
                if line.startswith("id:"):
                    ids.append(int(line.split(":", 1)[1]))
                if len(ids) == len(page["events"]):
                    break
        verified = await client.post("/v1/projections/verify")
    assert [(e["type"], e["data"]) for e in history[-2:]] == newer
    assert [e["position"] for e in page["events"]] == ids
    assert as_of.status_code == 200 and as_of.json()["status"] == "queued"  # the folds skipped what they cannot read
    # verify runs, and shows where this server's view lacks what the newer events meant
    assert verified.status_code == 200
    assert {(d["id"], d["field"]) for d in verified.json()["differences"]} <= {
        (str(job.id), field) for field in ("version", "position", "updated_at")}


async def test_every_event_a_request_causes_records_its_request_id(conn, org, client):
    """Submission, claim, renewal, completion with a next claim, failure, decomposition, cancel: each names its request."""
    from tests.helpers import bearer

    from .queue_support import CPU64, add_node

    org_id, key = org
    node = await add_node(conn, org_id, "box", [CPU64])
    credential = await _node_credential(conn, node)
    said = {}

    async def call(name: str, method: str, path: str, token: str, **kwargs):
        said[name] = f"req-{name}"
        response = await client.request(method, path, headers={**bearer(token), "X-Request-ID": said[name]}, **kwargs)
        assert response.status_code < 300, response.text
        return response.json()

    first = await call("submit", "POST", "/v1/jobs", key, json={"kind": "a"})
    await call("batch", "POST", "/v1/jobs/batch", key, json={"jobs": [{"kind": "b"}, {"kind": "c"}]})
    claimed = await call("claim", "POST", "/v1/agent/claim?wait=0", credential)
    await call("renew", "POST", f"/v1/agent/jobs/{first['id']}/renew", credential, json={"attempt": 1})
    after = await call("complete", "POST", f"/v1/agent/jobs/{first['id']}/complete?claim_next=true", credential,
                       json={"attempt": 1, "result": {}})  # fmt: skip
    second = after["next_claim"]["job"]
    await call("fail", "POST", f"/v1/agent/jobs/{second['id']}/fail", credential,
               json={"attempt": 1, "error": "oom", "retry": False})  # fmt: skip
    third = (await call("claim_c", "POST", "/v1/agent/claim?wait=0", credential))["job"]
    await call("children", "POST", f"/v1/agent/jobs/{third['id']}/children", credential,
               json={"attempt": 1, "children": [{"kind": "part"}]})  # fmt: skip
    await call("cancel", "POST", f"/v1/jobs/{third['id']}/cancel", key)
    assert claimed["job"]["id"] == first["id"]
    recorded = {(e.stream, e.type): e.metadata.get("request_id") for e in await store.read_log(conn, limit=1000)}
    def job(job_id: str) -> str:
        return store.job_stream(uuid.UUID(job_id))

    assert recorded[job(first["id"]), "job.submitted"] == said["submit"]
    assert recorded[job(second["id"]), "job.submitted"] == said["batch"]
    assert recorded[job(first["id"]), "job.claimed"] == said["claim"]
    assert recorded[job(first["id"]), "job.lease_renewed"] == said["renew"]
    assert recorded[job(first["id"]), "job.completed"] == said["complete"]
    assert recorded[job(second["id"]), "job.claimed"] == said["complete"]  # the claim made with the completion
    assert recorded[job(second["id"]), "job.failed"] == said["fail"]
    assert recorded[job(third["id"]), "job.decomposed"] == said["children"]
    assert recorded[job(third["id"]), "job.cancelled"] == said["cancel"]


async def _node_credential(conn, node_id) -> str:
    """A fresh credential for ``node_id`` (the pairing's own was shown once and not kept)."""
    from umbra.compute.credentials import mint_node_credential, store_node_credential

    credential = await mint_node_credential()
    await store_node_credential(conn, credential, node_id=node_id, organization_id=(await (await conn.execute(
        "SELECT organization_id FROM nodes WHERE id = %s", (node_id,))).fetchone())[0])
    return credential.token
