"""Projection snapshots and verification over HTTP."""

from __future__ import annotations

import uuid

import httpx
import pytest

from umbra.compute.accounts import create_api_key, create_organization
from umbra.compute.pairing import issue_pairing_code, redeem_pairing_code
from umbra.events import store
from umbra.events.types import JOB_STATUSES, Device, JobCancelled, JobSubmitted
from umbra.projections import jobs

pytestmark = pytest.mark.anyio

CPU = Device(kind="cpu", label="cpu", ram_total_mb=65536, ram_free_mb=30000)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def submit(conn, org_id: uuid.UUID, priority: int = 100) -> uuid.UUID:
    """A job submitted through the queue projection's own append-fold-write path."""
    job_id = uuid.uuid4()
    async with conn.transaction():
        rows = await jobs.record(
            conn, [jobs.Change(job_id, org_id, None, [JobSubmitted(kind="echo", priority=priority, max_attempts=3)])]
        )
        await store.publish(conn, [(org_id, rows[0].position, 1)])
    return job_id


async def cancel(conn, org_id: uuid.UUID, job_id: uuid.UUID) -> None:
    async with conn.transaction():
        state = await jobs.load(conn, job_id, org_id, lock=True)
        rows = await jobs.record(conn, [jobs.Change(job_id, org_id, state, [JobCancelled(by="test")])])
        await store.publish(conn, [(org_id, rows[0].position, 0)])


async def pair(conn, org_id: uuid.UUID, name: str) -> uuid.UUID:
    issued = await issue_pairing_code(conn, org_id, name)
    return (await redeem_pairing_code(conn, code=issued.code, name=name, source="10.0.0.9", devices=[CPU])).node_id


async def test_queue_snapshot_counts_every_status_and_lists_open_jobs(conn, org, live_server):
    org_id, key = org
    # A node that could run them: with none, the server's sweeper, looking at waiting jobs, may block them.
    await pair(conn, org_id, "box")
    other, _ = await create_organization(conn, "other")
    low, high = await submit(conn, org_id, 200), await submit(conn, org_id, 10)
    done = await submit(conn, org_id)
    await cancel(conn, org_id, done)
    await submit(conn, other)
    async with httpx.AsyncClient(base_url=live_server.url, headers=_auth(key)) as client:
        view = (await client.get("/v1/projections/queue")).json()
        limited = (await client.get("/v1/projections/queue", params={"limit": 1})).json()
    assert set(view["counts"]) == set(JOB_STATUSES)
    assert view["counts"]["queued"] == 2 and view["counts"]["cancelled"] == 1
    assert sum(view["counts"].values()) == 3
    assert [j["id"] for j in view["jobs"]] == [str(high), str(low)]  # lower priority value first
    assert view["position"] == await store.head_position(conn, org_id)
    assert view["truncated"] is False
    assert limited["truncated"] is True and len(limited["jobs"]) == 1


async def test_nodes_snapshot_shows_effective_status_at_a_position(conn, org, live_server):
    org_id, key = org
    node_id = await pair(conn, org_id, "box-1")
    async with httpx.AsyncClient(base_url=live_server.url, headers=_auth(key)) as client:
        view = (await client.get("/v1/projections/nodes")).json()
    assert view["position"] == await store.head_position(conn, org_id)
    [node] = view["nodes"]
    assert node["id"] == str(node_id) and node["status"] == "provisioning" and node["schedulable"] is False


async def test_verify_agrees_then_names_a_tampered_row_of_this_organization_only(conn, org, live_server):
    org_id, key = org
    other, other_key = await create_organization(conn, "other")
    job_id = await submit(conn, org_id)
    node_id = await pair(conn, org_id, "box-1")
    other_job = await submit(conn, other)
    async with httpx.AsyncClient(base_url=live_server.url) as client:
        clean = (await client.post("/v1/projections/verify", headers=_auth(key))).json()
        assert clean == {"ok": True, "differences": []}
        await conn.execute("UPDATE jobs SET priority = 1 WHERE id = %s", (job_id,))
        await conn.execute("UPDATE nodes SET locality = 'moved' WHERE id = %s", (node_id,))
        await conn.execute("UPDATE jobs SET kind = 'tampered' WHERE id = %s", (other_job,))
        dirty = (await client.post("/v1/projections/verify", headers=_auth(key))).json()
        theirs = (await client.post("/v1/projections/verify", headers=_auth(other_key))).json()
    assert dirty["ok"] is False
    found = {(d["view"], d["id"], d["field"]) for d in dirty["differences"]}
    assert found == {("queue", str(job_id), "priority"), ("nodes", str(node_id), "locality")}
    assert {(d["id"], d["field"]) for d in theirs["differences"]} == {(str(other_job), "kind")}


async def test_snapshot_and_verify_scopes(conn, org, live_server):
    org_id, _ = org
    reader = await create_api_key(conn, org_id, ["jobs:read"])
    writer = await create_api_key(conn, org_id, ["jobs:write"])
    async with httpx.AsyncClient(base_url=live_server.url) as client:
        assert (await client.get("/v1/projections/queue", headers=_auth(reader))).status_code == 200
        assert (await client.get("/v1/projections/queue", headers=_auth(writer))).status_code == 403
        assert (await client.get("/v1/projections/nodes", headers=_auth(writer))).status_code == 403
        refused = await client.post("/v1/projections/verify", headers=_auth(reader))
        assert (await client.get("/v1/projections/queue")).status_code == 401
    assert refused.status_code == 403 and refused.json()["error"] == "forbidden"
