"""A failure, a decomposition or a completion with its next claim, sent again by its holder (it did not hear
the answer), is answered as the first one was, and recorded once; anything that is not such a repeat is still
refused, changing nothing."""

from __future__ import annotations

import anyio
import httpx
import pytest

from tests.helpers import bearer
from umbra.compute import claims
from umbra.compute.pairing import issue_pairing_code, redeem_pairing_code
from umbra.compute.sweeper import sweep_once
from umbra.settings import load_settings

from .queue_support import CPU64, beat, set_clock, submit

pytestmark = pytest.mark.anyio

SETTINGS = load_settings({})


async def paired(conn, org_id, name):
    """A node, online, and its credential."""
    issued = await issue_pairing_code(conn, org_id, name)
    redeemed = await redeem_pairing_code(conn, code=issued.code, name=name, source=f"test:{name}", devices=[CPU64])
    await beat(conn, org_id, redeemed.node_id, [CPU64])
    return redeemed.node_id, redeemed.credential


async def claim(client, credential, job_id) -> int:
    claimed = await client.post("/v1/agent/claim?wait=0", headers=bearer(credential))
    assert claimed.status_code == 200 and claimed.json()["job"]["id"] == str(job_id), claimed.text
    return claimed.json()["job"]["attempt"]


async def events(client, api_key, job_id) -> list[dict]:
    response = await client.get(f"/v1/jobs/{job_id}/events", headers=bearer(api_key))
    assert response.status_code == 200, response.text
    return response.json()["events"]


async def refused(response, code="job_not_claimed_by_this_node") -> None:
    assert response.status_code == 409 and response.json()["error"] == code, f"{response.status_code} {response.text[:200]}"


def fail_body(attempt, error="oom", retry=True):
    return {"attempt": attempt, "error": error, "retry": retry}


async def test_a_failure_sent_again_is_answered_with_the_requeued_job_and_recorded_once(client, conn, org):
    """The holder failed the job (retryable: requeued with a backoff), did not hear the answer and sends
    it again: 200 with the job as it stands, the first failure standing (another error text or retry flag
    changes nothing), and nothing recorded. Another node, or another attempt, is still refused."""
    org_id, api_key = org
    _, credential = await paired(conn, org_id, "a")
    _, other = await paired(conn, org_id, "b")
    job = await submit(conn, org_id)
    attempt = await claim(client, credential, job.id)
    path = f"/v1/agent/jobs/{job.id}/fail"
    first = await client.post(path, headers=bearer(credential), json=fail_body(attempt))
    assert first.status_code == 200 and first.json()["status"] == "queued" and first.json()["not_before"], first.text
    recorded = await events(client, api_key, job.id)
    assert [e["type"] for e in recorded] == ["job.submitted", "job.claimed", "job.requeued"]
    for body in (fail_body(attempt), fail_body(attempt, error="another text", retry=False)):
        again = await client.post(path, headers=bearer(credential), json=body)
        assert again.status_code == 200, f"sent again: {again.status_code} {again.text[:200]}"
        assert again.json() == first.json()  # the job as the first failure left it
    for credential_, attempt_ in ((other, attempt), (credential, attempt + 1)):
        await refused(await client.post(path, headers=bearer(credential_), json=fail_body(attempt_)))
    assert await events(client, api_key, job.id) == recorded


async def test_a_failure_sent_again_after_it_failed_the_job_is_answered_with_the_failed_job(client, conn, org):
    """A non-retryable failure (or the last attempt's) fails the job; sent again it is answered 200 with
    the failed job. A job that was completed, not failed, still refuses a failure from its holder."""
    org_id, api_key = org
    _, credential = await paired(conn, org_id, "a")
    _, other = await paired(conn, org_id, "b")
    job = await submit(conn, org_id)
    attempt = await claim(client, credential, job.id)
    path = f"/v1/agent/jobs/{job.id}/fail"
    first = await client.post(path, headers=bearer(credential), json=fail_body(attempt, error="bad input", retry=False))
    assert first.status_code == 200 and first.json()["status"] == "failed", first.text
    recorded = await events(client, api_key, job.id)
    again = await client.post(path, headers=bearer(credential), json=fail_body(attempt, error="other", retry=True))
    assert again.status_code == 200, f"sent again: {again.status_code} {again.text[:200]}"
    assert (again.json()["status"], again.json()["error"]) == ("failed", "bad input") and again.json() == first.json()
    await refused(await client.post(path, headers=bearer(other), json=fail_body(attempt)))
    await refused(await client.post(f"/v1/agent/jobs/{job.id}/children", headers=bearer(credential),
                                    json={"attempt": attempt, "children": [{"kind": "part"}]}))  # fmt: skip
    assert await events(client, api_key, job.id) == recorded

    done = await submit(conn, org_id)
    attempt = await claim(client, credential, done.id)
    completed = await client.post(f"/v1/agent/jobs/{done.id}/complete", headers=bearer(credential), json={"attempt": attempt})
    assert completed.status_code == 200
    recorded = await events(client, api_key, done.id)
    await refused(await client.post(f"/v1/agent/jobs/{done.id}/fail", headers=bearer(credential), json=fail_body(attempt)))
    assert await events(client, api_key, done.id) == recorded


async def test_a_failure_is_no_repeat_once_the_job_was_claimed_again_cancelled_or_its_lease_ended_it(client, conn, org):
    """The attempt is the fencing token: a failure of attempt 1 sent once the job is claimed again (by the
    same node) is stale; an attempt that ended by an expired lease, or a release, was not failed by the
    node, though the queued row looks the same as after its own failure; a cancelled job is no repeat."""
    org_id, api_key = org
    node_id, credential = await paired(conn, org_id, "a")
    job = await submit(conn, org_id, max_attempts=5)
    path = f"/v1/agent/jobs/{job.id}/fail"
    first = await claim(client, credential, job.id)
    assert (await client.post(path, headers=bearer(credential), json=fail_body(first))).status_code == 200
    again = await client.post(path, headers=bearer(credential), json=fail_body(first))
    assert again.status_code == 200, f"sent again: {again.status_code} {again.text[:200]}"

    await set_clock(conn, 6)  # past the backoff; the same node claims it again, with a short lease
    second = await claims.claim(conn, node_id=node_id, organization_id=org_id, lease_seconds=5)
    assert (second.job_id, second.attempt) == (job.id, first + 1)
    recorded = await events(client, api_key, job.id)
    await refused(await client.post(path, headers=bearer(credential), json=fail_body(first)))  # claimed again since

    await set_clock(conn, 12)
    assert (await sweep_once(conn, SETTINGS, reexamine=False)).leases_requeued == 1
    recorded = await events(client, api_key, job.id)
    assert recorded[-1]["type"] == "job.lease_expired"
    # Queued at the node's attempt with no holder, as after its own failure: but the lease ended it.
    await refused(await client.post(path, headers=bearer(credential), json=fail_body(second.attempt)))

    await set_clock(conn, 12 + SETTINGS.lease_expired_delay_seconds + 1)
    third = await claims.claim(conn, node_id=node_id, organization_id=org_id, lease_seconds=60)
    assert third.attempt == second.attempt + 1
    assert await claims.release(conn, job.id, node_id, third.attempt)  # given back unheard (client gone)
    await refused(await client.post(path, headers=bearer(credential), json=fail_body(third.attempt)))
    assert [e["type"] for e in await events(client, api_key, job.id)][len(recorded):] == ["job.claimed", "job.released"]

    cancelled = await client.post(f"/v1/jobs/{job.id}/cancel", headers=bearer(api_key))
    assert cancelled.status_code == 200
    recorded = await events(client, api_key, job.id)
    for attempt in (first, second.attempt, third.attempt):
        await refused(await client.post(path, headers=bearer(credential), json=fail_body(attempt)))
    assert await events(client, api_key, job.id) == recorded


async def test_a_failure_by_an_expired_lease_is_no_repeat(client, conn, org):
    """The last attempt's lease expired: the job failed with no holder, not by the node. Its late failure
    is refused; the node's own failure of an earlier attempt was a repeat until then."""
    org_id, api_key = org
    node_id, credential = await paired(conn, org_id, "a")
    job = await submit(conn, org_id, max_attempts=2)
    path = f"/v1/agent/jobs/{job.id}/fail"
    first = await claim(client, credential, job.id)
    assert (await client.post(path, headers=bearer(credential), json=fail_body(first))).status_code == 200
    again = await client.post(path, headers=bearer(credential), json=fail_body(first))
    assert again.status_code == 200, f"sent again: {again.status_code} {again.text[:200]}"
    await set_clock(conn, 6)
    second = await claims.claim(conn, node_id=node_id, organization_id=org_id, lease_seconds=5)
    await set_clock(conn, 12)
    assert (await sweep_once(conn, SETTINGS, reexamine=False)).leases_failed == 1
    recorded = await events(client, api_key, job.id)
    assert recorded[-1]["type"] == "job.lease_expired"
    for attempt in (first, second.attempt):
        await refused(await client.post(path, headers=bearer(credential), json=fail_body(attempt)))
    assert await events(client, api_key, job.id) == recorded


async def children_of(conn, parent_id) -> int:
    return (await (await conn.execute("SELECT count(*) FROM jobs WHERE parent_job_id = %s", (parent_id,))).fetchone())[0]


async def test_children_sent_again_are_answered_with_the_same_children_and_made_once(client, conn, org):
    """The holder split the job, did not hear the answer and sends the children again: 201 with the
    children as they stand (the same ids, in the same order), and nothing made or recorded. Another node,
    or another attempt, is still refused."""
    org_id, api_key = org
    _, credential = await paired(conn, org_id, "a")
    _, other = await paired(conn, org_id, "b")
    parent = await submit(conn, org_id, kind="split")
    attempt = await claim(client, credential, parent.id)
    path = f"/v1/agent/jobs/{parent.id}/children"
    body = {"attempt": attempt, "children": [{"kind": "part", "payload": {"i": i}} for i in range(3)]}
    first = await client.post(path, headers=bearer(credential), json=body)
    assert first.status_code == 201, first.text
    ids = [c["id"] for c in first.json()["children"]]
    recorded = await events(client, api_key, parent.id)
    for body_ in (body, {"attempt": attempt, "children": [{"kind": "other"}]}):
        again = await client.post(path, headers=bearer(credential), json=body_)
        assert again.status_code == 201, f"sent again: {again.status_code} {again.text[:200]}"
        assert [c["id"] for c in again.json()["children"]] == ids
        assert [c["payload"] for c in again.json()["children"]] == [{"i": i} for i in range(3)]
    assert await children_of(conn, parent.id) == 3
    for credential_, attempt_ in ((other, attempt), (credential, attempt + 1)):
        await refused(await client.post(path, headers=bearer(credential_), json={**body, "attempt": attempt_}))
    await refused(await client.post(f"/v1/agent/jobs/{parent.id}/fail", headers=bearer(credential), json=fail_body(attempt)))
    assert await events(client, api_key, parent.id) == recorded and await children_of(conn, parent.id) == 3

    # The children run and the parent settles: a repeat still gets them, as they stand now.
    for _ in ids:
        claimed = (await client.post("/v1/agent/claim?wait=0", headers=bearer(credential))).json()["job"]
        done = await client.post(f"/v1/agent/jobs/{claimed['id']}/complete", headers=bearer(credential),
                                 json={"attempt": claimed["attempt"], "result": {"ok": True}})  # fmt: skip
        assert done.status_code == 200
    assert (await client.get(f"/v1/jobs/{parent.id}", headers=bearer(api_key))).json()["status"] == "complete"
    recorded = await events(client, api_key, parent.id)
    again = await client.post(path, headers=bearer(credential), json=body)
    assert again.status_code == 201, f"sent again: {again.status_code} {again.text[:200]}"
    assert [(c["id"], c["status"]) for c in again.json()["children"]] == [(i, "complete") for i in ids]
    assert await events(client, api_key, parent.id) == recorded and await children_of(conn, parent.id) == 3


async def test_children_with_idempotency_keys_sent_again_are_made_once_and_a_cancelled_parent_refuses(client, conn, org):
    """Children named by idempotency keys, sent again: the same children (the keys are theirs, not taken
    by another), made once. Once the parent is cancelled, the same request is refused as before."""
    org_id, api_key = org
    _, credential = await paired(conn, org_id, "a")
    parent = await submit(conn, org_id, kind="split")
    attempt = await claim(client, credential, parent.id)
    path = f"/v1/agent/jobs/{parent.id}/children"
    body = {"attempt": attempt, "children": [{"kind": "part", "idempotency_key": f"part-{i}"} for i in range(2)]}
    first = await client.post(path, headers=bearer(credential), json=body)
    assert first.status_code == 201, first.text
    recorded = await events(client, api_key, parent.id)
    again = await client.post(path, headers=bearer(credential), json=body)
    assert again.status_code == 201, f"sent again: {again.status_code} {again.text[:200]}"
    assert again.json() == first.json()  # nothing happened to the children in between
    assert await children_of(conn, parent.id) == 2 and await events(client, api_key, parent.id) == recorded

    assert (await client.post(f"/v1/jobs/{parent.id}/cancel", headers=bearer(api_key))).status_code == 200
    recorded = await events(client, api_key, parent.id)
    await refused(await client.post(path, headers=bearer(credential), json=body))
    assert await children_of(conn, parent.id) == 2 and await events(client, api_key, parent.id) == recorded


# -- a completion that claimed the node's next job, sent again ------------------------------------------------


async def running_on(conn, node_id) -> list[str]:
    rows = await (await conn.execute("SELECT id::text FROM jobs WHERE status = 'running' AND lease_owner = %s ORDER BY id",
                                     (node_id,))).fetchall()  # fmt: skip
    return [r[0] for r in rows]


async def log_length(conn) -> int:
    return (await (await conn.execute("SELECT count(*) FROM events")).fetchone())[0]


async def test_a_completion_with_its_next_claim_sent_again_is_answered_with_that_claim_and_records_nothing(client, conn, org):
    """``complete?claim_next=true`` completed A and claimed B; the answer was lost and the agent sends the
    request again. It is answered with A and with B again, recording nothing: a second claim (C) would
    leave B leased to a node that never heard of it, an attempt spent when its lease ran out (with one
    attempt, B failed without having run). The completion's event names the job its request claimed."""
    org_id, api_key = org
    node, credential = await paired(conn, org_id, "a")
    a = await submit(conn, org_id)
    b = await submit(conn, org_id, max_attempts=1)
    await submit(conn, org_id)
    attempt = await claim(client, credential, a.id)
    path = f"/v1/agent/jobs/{a.id}/complete?claim_next=true"
    first = await client.post(path, headers=bearer(credential), json={"attempt": attempt, "result": {"ok": 1}})
    assert first.status_code == 200 and first.json()["next_claim"]["job"]["id"] == str(b.id), first.text
    recorded = await log_length(conn)
    again = await client.post(path, headers=bearer(credential), json={"attempt": attempt, "result": {"ok": 2}})
    assert again.status_code == 200, again.text
    assert again.json() == first.json()  # the first result stands, and the first claim is answered again
    assert await log_length(conn) == recorded
    assert await running_on(conn, node) == [str(b.id)]
    completed = [e for e in await events(client, api_key, a.id) if e["type"] == "job.completed"]
    assert completed[0]["metadata"]["next_claim"] == str(b.id)


async def test_a_completion_sent_again_once_its_claim_ended_or_when_it_claimed_nothing_claims_nothing(client, conn, org):
    """The claim the first request made is answered again only while it stands untouched. Once its lease
    ran out (requeued by the sweeper), or when the first request found nothing to claim, the repeat
    answers ``next_claim: null`` and records nothing: the agent long-polls as usual."""
    org_id, _ = org
    node, credential = await paired(conn, org_id, "a")
    a, b = await submit(conn, org_id), await submit(conn, org_id)
    attempt = await claim(client, credential, a.id)
    path = f"/v1/agent/jobs/{a.id}/complete?claim_next=true"
    first = await client.post(path, headers=bearer(credential), json={"attempt": attempt, "result": {}})
    assert first.json()["next_claim"]["job"]["id"] == str(b.id), first.text
    await set_clock(conn, SETTINGS.lease_seconds + 5)
    await sweep_once(conn, SETTINGS, reexamine=False)  # B's lease ran out: requeued
    await beat(conn, org_id, node, [CPU64])
    recorded = await log_length(conn)
    again = await client.post(path, headers=bearer(credential), json={"attempt": attempt, "result": {}})
    assert again.status_code == 200 and again.json()["next_claim"] is None, again.text
    assert await log_length(conn) == recorded and await running_on(conn, node) == []

    lone = await submit(conn, org_id, kind="other")
    attempt = (await client.post("/v1/agent/claim?wait=0&kind=other", headers=bearer(credential))).json()["job"]["attempt"]
    path = f"/v1/agent/jobs/{lone.id}/complete?claim_next=true&kind=other"
    first = await client.post(path, headers=bearer(credential), json={"attempt": attempt, "result": {}})
    assert first.status_code == 200 and first.json()["next_claim"] is None, first.text
    await submit(conn, org_id, kind="other")
    recorded = await log_length(conn)
    again = await client.post(path, headers=bearer(credential), json={"attempt": attempt, "result": {}})
    assert again.status_code == 200 and again.json()["next_claim"] is None, again.text
    assert await log_length(conn) == recorded


async def test_a_completion_with_its_next_claim_sent_twice_at_once_leases_one_job(live_server, conn, org):
    """A client that timed out sends the request again while the first is still in flight: one
    completion, one job claimed, and both answers name it."""
    org_id, _ = org
    node, credential = await paired(conn, org_id, "a")
    a = await submit(conn, org_id)
    for _ in range(3):
        await submit(conn, org_id)
    answers: list[httpx.Response] = []
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as http:
        attempt = await claim(http, credential, a.id)

        async def send() -> None:
            answers.append(await http.post(f"/v1/agent/jobs/{a.id}/complete?claim_next=true", headers=bearer(credential),
                                           json={"attempt": attempt, "result": {}}))  # fmt: skip

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            tg.start_soon(send)
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    held = await running_on(conn, node)
    assert len(held) == 1, f"one completion sent twice left {len(held)} jobs leased to the node"
    assert [r.json()["next_claim"]["job"]["id"] for r in answers] == held * 2


# -- a report of several results that claimed the node's next jobs, sent again -----------------------------


async def report(client, credential, held: dict, claim_next: int):
    """``POST /v1/agent/complete?claim_next=N`` reporting every job of ``held`` (job id → attempt)."""
    body = {"results": [{"job_id": str(job_id), "attempt": attempt, "result": {}} for job_id, attempt in held.items()]}
    return await client.post(f"/v1/agent/complete?claim_next={claim_next}", headers=bearer(credential), json=body)


async def claim_several(client, credential, count: int) -> dict:
    claimed = await client.post(f"/v1/agent/claim?wait=0&max={count}", headers=bearer(credential))
    assert claimed.status_code == 200, claimed.text
    return {c["job"]["id"]: c["job"]["attempt"] for c in claimed.json()["claims"]}


def next_claims(response) -> list[str]:
    assert response.status_code == 200, response.text
    return [c["job"]["id"] for c in response.json()["next_claims"]]


async def test_a_report_with_its_next_claims_sent_again_is_answered_with_those_claims_and_records_nothing(client, conn, org):
    """A report of two results claimed C and D (``claim_next=2``); the answer was lost and the agent sends
    it again. It is answered as the first was, C and D included, and records nothing: two more claims
    would leave C and D leased to a node that never heard of them, each losing an attempt (D, with one,
    failing without having run). The first completion's event names the jobs its report claimed."""
    org_id, api_key = org
    node, credential = await paired(conn, org_id, "a")
    a, b = await submit(conn, org_id), await submit(conn, org_id)
    c, d = await submit(conn, org_id), await submit(conn, org_id, max_attempts=1)
    await submit(conn, org_id)
    held = await claim_several(client, credential, 2)
    assert set(held) == {str(a.id), str(b.id)}
    first = await report(client, credential, held, 2)
    assert next_claims(first) == [str(c.id), str(d.id)]
    recorded = await log_length(conn)
    again = await report(client, credential, held, 2)
    assert again.json() == first.json()
    assert await log_length(conn) == recorded
    assert await running_on(conn, node) == sorted([str(c.id), str(d.id)])
    completed = [e for e in await events(client, api_key, a.id) if e["type"] == "job.completed"]
    assert completed[0]["metadata"]["next_claims"] == [str(c.id), str(d.id)]


async def test_a_report_sent_again_answers_only_the_claims_still_untouched_and_claims_nothing_new(client, conn, org):
    """Only the claims the first report made that stand untouched are answered again: a job the node
    renewed since (so its agent heard of it) or completed is not. A report that repeats one recorded
    completion among new ones lands the new ones and claims nothing new either: its first answer was
    lost, so the claims it made are the ones the agent has not heard of."""
    org_id, _ = org
    node, credential = await paired(conn, org_id, "a")
    a, b, c, d = [await submit(conn, org_id) for _ in range(4)]
    left = await submit(conn, org_id)
    held = await claim_several(client, credential, 2)
    first = await report(client, credential, held, 2)
    claimed = {job["job"]["id"]: job["job"]["attempt"] for job in first.json()["next_claims"]}
    assert list(claimed) == [str(c.id), str(d.id)]
    renewed = await client.post(f"/v1/agent/jobs/{c.id}/renew", headers=bearer(credential), json={"attempt": claimed[str(c.id)]})
    assert renewed.status_code == 200, renewed.text
    assert next_claims(await report(client, credential, held, 2)) == [str(d.id)]

    mixed = await report(client, credential, {str(a.id): held[str(a.id)], str(d.id): claimed[str(d.id)]}, 2)
    assert [r["status"] for r in mixed.json()["results"]] == [200, 200] and next_claims(mixed) == []
    assert await running_on(conn, node) == [str(c.id)]
    status = (await (await conn.execute("SELECT status FROM jobs WHERE id = %s", (left.id,))).fetchone())[0]
    assert status == "queued"


async def test_a_report_with_its_next_claims_sent_twice_at_once_leases_only_its_claims(live_server, conn, org):
    """Two copies of one report in flight at once (in one batch, or in two overlapping): one completion
    each, two jobs claimed in all, and both answers name them."""
    org_id, _ = org
    node, credential = await paired(conn, org_id, "a")
    for _ in range(6):
        await submit(conn, org_id)
    answers: list[httpx.Response] = []
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as http:
        held = await claim_several(http, credential, 2)

        async def send() -> None:
            answers.append(await report(http, credential, held, 2))

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            tg.start_soon(send)
    claimed = await running_on(conn, node)
    assert len(claimed) == 2, f"one report sent twice left {len(claimed)} jobs leased to the node"
    assert [sorted(next_claims(r)) for r in answers] == [claimed, claimed]
