"""A group-commit batch whose connection broke as it committed: the agents hear 503, and what they
send again is answered as the repeat it is; a claim that committed is released."""

from __future__ import annotations

import psycopg
import pytest

from tests.helpers import bearer
from umbra.compute import batch_commands, claims
from umbra.compute.pairing import issue_pairing_code, redeem_pairing_code
from umbra.events import store

from .queue_support import CPU64, beat, submit

pytestmark = pytest.mark.anyio


async def paired(conn, org_id, name="box"):
    """A node, online, and its credential."""
    issued = await issue_pairing_code(conn, org_id, name)
    redeemed = await redeem_pairing_code(conn, code=issued.code, name=name, source=f"test:{name}", devices=[CPU64])
    await beat(conn, org_id, redeemed.node_id, [CPU64])
    return redeemed.node_id, redeemed.credential


def break_after_commit(monkeypatch, db_url, kinds=("claim",)):
    """The next group-commit batch staging one of ``kinds`` commits; then its connection dies before the
    server hears the COMMIT's answer (the network, a failover): what ``_database_away`` is for."""
    original = batch_commands.write
    fired: list[bool] = []

    async def write(conn, staged):
        hints = await original(conn, staged)  # committed
        if not fired and any(s.command.kind in kinds for s in staged):
            fired.append(True)
            with psycopg.connect(db_url, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (conn.pgconn.backend_pid,))
            await conn.execute("SELECT 1")  # OperationalError; the connection is broken
        return hints

    monkeypatch.setattr(batch_commands, "write", write)
    return fired


async def claimed_job(client, conn, org):
    """A node's credential, and a job it has claimed over HTTP at that attempt."""
    _, credential = await paired(conn, org[0])
    job = await submit(conn, org[0])
    claimed = await client.post("/v1/agent/claim?wait=0", headers=bearer(credential))
    assert claimed.status_code == 200
    return credential, job, claimed.json()["job"]["attempt"]


async def job_row(conn, job_id):
    return await (await conn.execute("SELECT status, lease_owner, attempt, error FROM jobs WHERE id = %s", (job_id,))).fetchone()


async def test_a_claim_whose_commit_landed_as_its_connection_broke_is_released_not_left_leased(client, conn, org, monkeypatch, db_url):
    """The batch committed the claim, then its connection broke: the agent hears 503, and the claim it
    never heard of is released (job.released), so its next claim gets the job at once instead of the
    job waiting out a lease nobody holds."""
    org_id, _ = org
    node_id, credential = await paired(conn, org_id)
    job = await submit(conn, org_id, max_attempts=1)
    fired = break_after_commit(monkeypatch, db_url)
    response = await client.post("/v1/agent/claim?wait=0", headers=bearer(credential))
    assert fired and response.status_code == 503 and response.json()["error"] == "database_unavailable"
    assert (await job_row(conn, job.id))[0] == "queued"
    types = [e.type for e in await store.read_stream(conn, store.job_stream(job.id))]
    assert types == ["job.submitted", "job.claimed", "job.released"]
    again = await client.post("/v1/agent/claim?wait=0", headers=bearer(credential))  # the agent tries again
    assert again.status_code == 200 and again.json()["job"]["id"] == str(job.id) and again.json()["job"]["attempt"] == 2


async def test_a_completion_whose_commit_landed_as_its_connection_broke_can_be_sent_again(client, conn, org, monkeypatch, db_url):
    """The batch committed the completion, then its connection broke: the agent hears 503 and sends it
    again, and is answered 200 with the job as the first completion left it (not 409, which the agent
    takes for a lost job); nothing more is recorded."""
    credential, job, attempt = await claimed_job(client, conn, org)
    fired = break_after_commit(monkeypatch, db_url, kinds=("complete",))
    body = {"attempt": attempt, "result": {"answer": 42}}
    first = await client.post(f"/v1/agent/jobs/{job.id}/complete", headers=bearer(credential), json=body)
    assert fired and first.status_code >= 500, first.text
    second = await client.post(f"/v1/agent/jobs/{job.id}/complete", headers=bearer(credential), json=body)
    status = (await job_row(conn, job.id))[0]
    assert second.status_code == 200, (
        f"first answer {first.status_code} {first.text[:80]}; the job is {status}; sent again: {second.status_code} {second.text[:120]}"
    )
    assert second.json()["result"] == {"answer": 42}
    types = [e.type for e in await store.read_stream(conn, store.job_stream(job.id))]
    assert types == ["job.submitted", "job.claimed", "job.completed"]


async def test_a_completion_sent_twice_is_answered_twice_and_recorded_once(client, conn, org):
    """The answer to a completion can be lost on the way (a dropped connection): the holder sending it
    again gets the job, and the first result stands. Another node, or another attempt, is still refused."""
    org_id, _ = org
    _, credential = await paired(conn, org_id)
    _, other = await paired(conn, org_id, name="other")
    job = await submit(conn, org_id)
    attempt = (await client.post("/v1/agent/claim?wait=0", headers=bearer(credential))).json()["job"]["attempt"]
    path = f"/v1/agent/jobs/{job.id}/complete"
    first = await client.post(path, headers=bearer(credential), json={"attempt": attempt, "result": {"n": 1}})
    second = await client.post(path, headers=bearer(credential), json={"attempt": attempt, "result": {"n": 2}})
    assert first.status_code == second.status_code == 200 and second.json()["result"] == {"n": 1}
    batch = await client.post("/v1/agent/complete", headers=bearer(credential),
                              json={"results": [{"job_id": str(job.id), "attempt": attempt, "result": {"n": 3}}]})  # fmt: skip
    assert batch.json()["results"][0]["status"] == 200 and batch.json()["results"][0]["job"]["result"] == {"n": 1}
    for credential_, attempt_ in ((other, attempt), (credential, attempt + 1)):
        refused = await client.post(path, headers=bearer(credential_), json={"attempt": attempt_, "result": {}})
        assert refused.status_code == 409 and refused.json()["error"] == "job_not_claimed_by_this_node"
    assert [e.type for e in await store.read_stream(conn, store.job_stream(job.id))][-1] == "job.completed"
    assert len(await store.read_stream(conn, store.job_stream(job.id))) == 3


async def test_the_release_after_a_broken_batch_leaves_a_claim_made_elsewhere_at_the_same_attempt(client, conn, org, monkeypatch, db_url):
    """A batch whose connection broke before its COMMIT landed: meanwhile the same node took the job at
    the same attempt elsewhere (another process, another slot) and was answered. The broken batch's clean-up
    knows its own claims by their time, and leaves that one alone."""
    org_id, _ = org
    node_id, credential = await paired(conn, org_id)
    job = await submit(conn, org_id)

    original_write = batch_commands.write
    broke: list[bool] = []

    async def write(c, staged):
        if not broke and any(s.command.kind == "claim" for s in staged):
            broke.append(True)  # the connection dies before the COMMIT: nothing of this batch lands
            with psycopg.connect(db_url, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (c.pgconn.backend_pid,))
        return await original_write(c, staged)

    monkeypatch.setattr(batch_commands, "write", write)

    original_release = claims.release
    heard: list = []

    async def release(c, job_id, node, attempt, **kwargs):
        if not heard:  # meanwhile, the same node's other claim (another process) takes the job, and is answered
            async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as other:
                heard.append(await original_claim(other, node_id=node_id, organization_id=org_id, lease_seconds=60))
        return await original_release(c, job_id, node, attempt, **kwargs)

    original_claim = claims.claim
    monkeypatch.setattr(claims, "release", release)

    response = await client.post("/v1/agent/claim?wait=0", headers=bearer(credential))
    assert broke and response.status_code == 503, response.text
    assert heard and heard[0] is not None and heard[0].job_id == job.id
    answered_attempt = heard[0].attempt
    status, owner, attempt, _ = await job_row(conn, job.id)
    assert (status, owner, attempt) == ("running", node_id, answered_attempt), (
        f"the claim answered to the node (attempt {answered_attempt}) was released: "
        f"the job is {status} (owner {owner}, attempt {attempt})"
    )


async def test_a_batch_report_whose_connection_broke_answers_503_as_a_whole(client, conn, org, monkeypatch, db_url):
    """``POST /v1/agent/complete`` answers each result 200, 404, 409 or 422; the database away is the
    whole request's 503 (with Retry-After), so the agent sends the whole report again."""
    credential, job, attempt = await claimed_job(client, conn, org)
    fired = break_after_commit(monkeypatch, db_url, kinds=("complete",))
    response = await client.post("/v1/agent/complete", headers=bearer(credential),
                                 json={"results": [{"job_id": str(job.id), "attempt": attempt, "result": {"x": 1}}]})
    assert fired
    assert response.status_code == 503 and response.headers.get("retry-after") == "1", (
        f"{response.status_code} {response.text[:300]}"
    )
