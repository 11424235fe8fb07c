"""Job trees: decomposition into children, settlement of parents, cancellation of containers, and how a
container reads (explain, placement, memory)."""

from __future__ import annotations

import time
from typing import Awaitable

import anyio
import httpx
import msgspec
import psycopg
import pytest

from umbra.compute import claims, jobs
from umbra.compute.sweeper import sweep_once
from umbra.events import store
from umbra.projections import jobs as queue
from tests.helpers import bearer

from .queue_support import CPU64, add_node, set_clock, submit
from .test_claim_fencing import SETTINGS, child, claim
from .queue_support import http_pair

pytestmark = pytest.mark.anyio


async def claim_http(client, credential: str, *kinds: str) -> dict | None:
    """The node's claim (of ``kinds`` if given), not waiting: the answer, or None when nothing was claimed."""
    params = [("wait", "0"), *(("kind", k) for k in kinds)]
    got = await client.post("/v1/agent/claim", params=params, headers=bearer(credential))
    assert got.status_code in (200, 204), got.text
    return got.json() if got.status_code == 200 else None


async def job(client, key: str, job_id: str) -> dict:
    got = await client.get(f"/v1/jobs/{job_id}", headers=bearer(key))
    assert got.status_code == 200, got.text
    return got.json()


async def head(db_url) -> int:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
        return await store.head_position(c)


async def verify_ok(client, key: str) -> None:
    verified = await client.post("/v1/projections/verify", headers=bearer(key))
    assert verified.status_code == 200 and verified.json()["ok"], verified.text


async def split(client, credential: str, job_id: str, attempt: int, children: list[dict]) -> list[dict]:
    """Decompose the node's job into ``children``; the children made."""
    made = await client.post(f"/v1/agent/jobs/{job_id}/children", json={"attempt": attempt, "children": children},
                             headers=bearer(credential))  # fmt: skip
    assert made.status_code == 201, made.text
    return made.json()["children"]


async def split_claimed(conn, org_id, node_id, children: list, **parent_fields):
    """Submit a job (``parent_fields``), have the node claim it and split it into ``children``: (the container,
    the children made)."""
    parent = await submit(conn, org_id, "p", **parent_fields)
    got = await claim(conn, org_id, node_id)
    assert got.job_id == parent.id
    made = await claims.add_children(conn, organization_id=org_id, node_id=node_id, job_id=parent.id,
                                     attempt=got.attempt, children=children)  # fmt: skip
    return parent, made


async def container_with_a_running_child(client, key: str, credential: str, tag: object) -> tuple[dict, dict, dict]:
    """A job of kind ``p{tag}`` the node claimed and split into one child of kind ``k{tag}``, which the node
    then claimed: (the container, the child, the child's claim)."""
    parent = (await client.post("/v1/jobs", json={"kind": f"p{tag}"}, headers=bearer(key))).json()
    got = await claim_http(client, credential, f"p{tag}")
    (k,) = await split(client, credential, parent["id"], got["job"]["attempt"], [{"kind": f"k{tag}"}])
    return parent, k, await claim_http(client, credential, f"k{tag}")


async def at_once(*requests: Awaitable[httpx.Response]) -> list[httpx.Response]:
    """The answers to ``requests``, in order, all sent at the same moment."""
    answers: dict[int, httpx.Response] = {}

    async def send(index: int, request: Awaitable[httpx.Response]) -> None:
        answers[index] = await request

    async with anyio.create_task_group() as tg:
        for index, request in enumerate(requests):
            tg.start_soon(send, index, request)
    return [answers[index] for index in range(len(requests))]


# -- cancelling a container -------------------------------------------------------------------------


async def test_cancelling_a_parent_fences_every_agent_of_its_children_and_changes_nothing(client, org, db_url):
    """Cancelling a container cancels its running, queued and blocked children with it; every agent route
    of a running child (renew, complete, complete?claim_next, the several-results report, fail with retry) then
    answers 409 job_cancelled and records nothing, and the report's chained claim takes no job of the tree."""
    _, key = org
    _, a = await http_pair(client, key, "a")
    _, b = await http_pair(client, key, "b")
    parent = (await client.post("/v1/jobs", json={"kind": "book"}, headers=bearer(key))).json()
    spare = (await client.post("/v1/jobs", json={"kind": "spare"}, headers=bearer(key))).json()
    got = await claim_http(client, a, "book")
    kids = await split(client, a, parent["id"], got["job"]["attempt"], [
        {"kind": "run1"}, {"kind": "run2"}, {"kind": "wait"}, {"kind": "gpu", "requires": {"accelerators": ["cuda"]}}])
    assert [k["status"] for k in kids] == ["queued", "queued", "queued", "blocked"]
    r1 = await claim_http(client, b, "run1")
    r2 = await claim_http(client, b, "run2")
    cancelled = await client.post(f"/v1/jobs/{parent['id']}/cancel", headers=bearer(key))
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
    for k in kids:
        assert (await job(client, key, k["id"]))["status"] == "cancelled"
    before = await head(db_url)
    for r in (r1, r2):
        base = f"/v1/agent/jobs/{r['job']['id']}"
        attempt = r["job"]["attempt"]
        answers = [
            await client.post(f"{base}/renew", json={"attempt": attempt}, headers=bearer(b)),
            await client.post(f"{base}/complete", json={"attempt": attempt, "result": {}}, headers=bearer(b)),
            await client.post(f"{base}/complete", params={"claim_next": "true"}, json={"attempt": attempt},
                              headers=bearer(b)),
            await client.post(f"{base}/fail", json={"attempt": attempt, "error": "x", "retry": True}, headers=bearer(b)),
        ]
        for answer in answers:
            assert (answer.status_code, answer.json()["error"]) == (409, "job_cancelled"), answer.text
    many = await client.post("/v1/agent/complete", params={"claim_next": "2"}, json={"results": [
        {"job_id": r1["job"]["id"], "attempt": 1}, {"job_id": r2["job"]["id"], "attempt": 1}]}, headers=bearer(b))
    assert many.status_code == 200, many.text
    assert [(x["status"], x["error"]) for x in many.json()["results"]] == [(409, "job_cancelled")] * 2
    # the report claims whatever its results' answers: the spare job, nothing of the cancelled tree
    claimed_ids = [c["job"]["id"] for c in many.json()["next_claims"]]
    assert set(claimed_ids) <= {spare["id"]}
    if not claimed_ids:
        assert await head(db_url) == before
    assert (await job(client, key, parent["id"]))["status"] == "cancelled"
    await verify_ok(client, key)


async def test_cancelling_a_parent_cancels_the_whole_tree_and_a_grandparent_settles(conn, org):
    """Cancelling a container cancels every open descendant (grandchildren included), leaves the finished
    ones as they were, and the container's own parent settles `partial` (a cancelled child counts against it)
    in the same transaction; the holder of a cancelled grandchild learns so at its next renewal."""
    org_id, _ = org
    a = await add_node(conn, org_id, "a", [CPU64])
    root = await submit(conn, org_id, "root")
    got = await claim(conn, org_id, a)
    mid, leaf = await claims.add_children(conn, organization_id=org_id, node_id=a, job_id=root.id, attempt=got.attempt,
                                          children=[child("mid", priority=1), child("leaf", priority=50)])  # fmt: skip
    got = await claim(conn, org_id, a)
    assert got.job_id == mid.id
    g1, g2, g3 = await claims.add_children(conn, organization_id=org_id, node_id=a, job_id=mid.id, attempt=got.attempt,
                                           children=[child("g", priority=2), child("g", priority=3), child("g", priority=4)])
    c1 = await claim(conn, org_id, a)
    assert c1.job_id == g1.id
    await claims.complete(conn, organization_id=org_id, node_id=a, job_id=g1.id, attempt=1, result={"ok": 1})
    c2 = await claim(conn, org_id, a)
    assert c2.job_id == g2.id  # g2 running, g3 queued
    c3 = await claim(conn, org_id, a)
    assert c3.job_id == g3.id
    await claims.fail(conn, organization_id=org_id, node_id=a, job_id=g3.id, attempt=1, error="x", retry=True)
    leaf_claim = await claim(conn, org_id, a)
    assert leaf_claim.job_id == leaf.id
    await claims.complete(conn, organization_id=org_id, node_id=a, job_id=leaf.id, attempt=1, result=None)
    assert (await queue.load(conn, root.id, org_id)).status == "running"
    cancelled = await jobs.cancel(conn, org_id, mid.id, actor="key:x")
    assert cancelled.status == "cancelled"
    statuses = [(await queue.load(conn, j.id, org_id)).status for j in (g1, g2, g3)]
    assert statuses == ["complete", "cancelled", "cancelled"]
    settled = await queue.load(conn, root.id, org_id)
    assert (settled.status, settled.error) == ("partial", "1 of 2 children failed")
    with pytest.raises(Exception) as caught:
        await claims.renew(conn, organization_id=org_id, node_id=a, job_id=g2.id, attempt=1, lease_seconds=60)
    assert caught.value.code == "job_cancelled"


async def test_cancelling_one_child_settles_its_parent_partial(client, org, db_url):
    """When every child is terminal the parent settles: a cancelled child makes it `partial`, with the count
    in the detail, in the cancel's own transaction; the settled parent's cancel is then 409 job_terminal."""
    _, key = org
    _, a = await http_pair(client, key, "a")
    parent = (await client.post("/v1/jobs", json={"kind": "book"}, headers=bearer(key))).json()
    got = await claim_http(client, a, "book")
    kids = await split(client, a, parent["id"], got["job"]["attempt"], [{"kind": "x"}, {"kind": "y"}])
    c = await claim_http(client, a, "x")
    done = await client.post(f"/v1/agent/jobs/{c['job']['id']}/complete", json={"attempt": 1, "result": {"n": 1}},
                             headers=bearer(a))  # fmt: skip
    assert done.status_code == 200
    assert (await job(client, key, parent["id"]))["status"] == "running"
    cancel = await client.post(f"/v1/jobs/{kids[1]['id']}/cancel", headers=bearer(key))
    assert cancel.status_code == 200
    settled = await job(client, key, parent["id"])
    assert (settled["status"], settled["error"]) == ("partial", "1 of 2 children failed")
    assert settled["result"]["children_total"] == 2 and settled["finished_at"]
    again = await client.post(f"/v1/jobs/{parent['id']}/cancel", headers=bearer(key))
    assert (again.status_code, again.json()["error"]) == (409, "job_terminal")
    history = (await client.get(f"/v1/jobs/{parent['id']}/events", headers=bearer(key))).json()["events"]
    assert [e["type"] for e in history] == ["job.submitted", "job.claimed", "job.decomposed", "job.settled"]
    await verify_ok(client, key)


async def test_a_child_failure_with_retry_after_its_parent_was_cancelled_is_refused(client, org, db_url):
    """A running child's retryable failure after its container's cancel is refused 409 job_cancelled and
    changes nothing: the child is not requeued to run again for a cancelled tree."""
    _, key = org
    _, a = await http_pair(client, key, "a")
    parent, k, c = await container_with_a_running_child(client, key, a, "")
    assert (await client.post(f"/v1/jobs/{parent['id']}/cancel", headers=bearer(key))).status_code == 200
    before = await head(db_url)
    failed = await client.post(f"/v1/agent/jobs/{k['id']}/fail", json={"attempt": c["job"]["attempt"], "error": "x",
                                                                       "retry": True}, headers=bearer(a))  # fmt: skip
    assert (failed.status_code, failed.json()["error"]) == (409, "job_cancelled")
    assert await head(db_url) == before
    assert (await job(client, key, k["id"]))["status"] == "cancelled"
    assert await claim_http(client, a) is None


async def test_a_wide_tree_of_ten_thousand_children_is_made_and_cancelled_in_one_request_each(client, org, db_url):
    """A decomposition takes up to 10,000 children: making them and cancelling the container (which cancels
    them all in one transaction) each answer in one request within seconds, and verify agrees after."""
    _, key = org
    _, a = await http_pair(client, key, "a")
    parent = (await client.post("/v1/jobs", json={"kind": "wide"}, headers=bearer(key))).json()
    got = await claim_http(client, a, "wide")
    started = time.monotonic()
    kids = await split(client, a, parent["id"], got["job"]["attempt"], [{"kind": "c", "payload": {"i": i}} for i in range(10_000)])
    made = time.monotonic() - started
    assert len(kids) == 10_000
    started = time.monotonic()
    cancelled = await client.post(f"/v1/jobs/{parent['id']}/cancel", headers=bearer(key))
    took = time.monotonic() - started
    assert cancelled.status_code == 200 and made < 20 and took < 20, (made, took)
    counts = (await client.get("/v1/projections/queue", params={"limit": 0}, headers=bearer(key))).json()["counts"]
    assert counts["cancelled"] == 10_001 and counts["queued"] == 0
    await verify_ok(client, key)


# -- settlement -------------------------------------------------------------------------------------


async def test_a_child_whose_lease_expires_on_its_last_attempt_fails_and_the_parent_settles(conn, org):
    """An expired lease on a child's last attempt fails it, and the sweeper's transaction settles the
    parent `partial`."""
    org_id, _ = org
    a = await add_node(conn, org_id, "a", [CPU64])
    parent, (k,) = await split_claimed(conn, org_id, a, [child(max_attempts=1)])
    kc = await claim(conn, org_id, a, lease_seconds=5)
    assert kc.job_id == k.id
    await set_clock(conn, 10)
    report = await sweep_once(conn, SETTINGS)
    assert report.leases_failed == 1
    assert (await queue.load(conn, k.id, org_id)).status == "failed"
    settled = await queue.load(conn, parent.id, org_id)
    assert (settled.status, settled.error) == ("partial", "1 of 1 children failed")


async def test_a_child_retried_then_exhausted_settles_the_parent_only_at_the_end(conn, org):
    """A child's retryable failure requeues it (the parent stays `running`); only when its attempts are
    spent does it fail and the parent settle."""
    org_id, _ = org
    a = await add_node(conn, org_id, "a", [CPU64])
    parent, (k,) = await split_claimed(conn, org_id, a, [child(max_attempts=2)])
    c = await claim(conn, org_id, a)
    requeued = await claims.fail(conn, organization_id=org_id, node_id=a, job_id=k.id, attempt=c.attempt, error="e", retry=True)
    assert requeued.status == "queued"
    assert (await queue.load(conn, parent.id, org_id)).status == "running"
    await set_clock(conn, 6)
    c = await claim(conn, org_id, a)
    assert c.job_id == k.id and c.attempt == 2
    failed = await claims.fail(conn, organization_id=org_id, node_id=a, job_id=k.id, attempt=2, error="e", retry=True)
    assert failed.status == "failed"
    assert (await queue.load(conn, parent.id, org_id)).status == "partial"


async def test_all_children_failing_settles_partial_and_a_grandparent_follows(conn, org):
    """A container settled `partial` counts against its own parent: a leaf's failure settles every level
    above it, in the leaf's own transaction."""
    org_id, _ = org
    a = await add_node(conn, org_id, "a", [CPU64])
    root = await submit(conn, org_id, "root")
    got = await claim(conn, org_id, a)
    (mid,) = await claims.add_children(conn, organization_id=org_id, node_id=a, job_id=root.id, attempt=got.attempt,
                                       children=[child("mid")])  # fmt: skip
    got = await claim(conn, org_id, a)
    (g,) = await claims.add_children(conn, organization_id=org_id, node_id=a, job_id=mid.id, attempt=got.attempt,
                                     children=[child("g")])  # fmt: skip
    c = await claim(conn, org_id, a)
    await claims.fail(conn, organization_id=org_id, node_id=a, job_id=g.id, attempt=c.attempt, error="bad", retry=False)
    m, r = await queue.load(conn, mid.id, org_id), await queue.load(conn, root.id, org_id)
    assert (m.status, m.error) == ("partial", "1 of 1 children failed")
    assert (r.status, r.error) == ("partial", "1 of 1 children failed")
    last_g = (await store.read_stream(conn, store.job_stream(g.id)))[-1]
    last_r = (await store.read_stream(conn, store.job_stream(root.id)))[-1]
    assert last_r.type == "job.settled" and last_r.recorded_at == last_g.recorded_at


async def test_a_deep_tree_completes_over_http_through_the_group_commit(client, org):
    """When every child is complete the parent settles `complete`: over HTTP (completions go through the
    group commit's batch) a three-level tree settles level by level, explain reads the settlement, and verify
    agrees."""
    _, key = org
    _, a = await http_pair(client, key, "a")
    root = (await client.post("/v1/jobs", json={"kind": "root"}, headers=bearer(key))).json()
    got = await claim_http(client, a, "root")
    mids = await split(client, a, root["id"], got["job"]["attempt"], [{"kind": "mid"}, {"kind": "mid"}])
    leaves = []
    for _ in mids:
        m = await claim_http(client, a, "mid")
        leaves += await split(client, a, m["job"]["id"], m["job"]["attempt"], [{"kind": "leaf"}, {"kind": "leaf"}])
    for _ in leaves:
        c = await claim_http(client, a, "leaf")
        done = await client.post(f"/v1/agent/jobs/{c['job']['id']}/complete", json={"attempt": 1, "result": {}},
                                 headers=bearer(a))  # fmt: skip
        assert done.status_code == 200, done.text
    for m in mids:
        assert (await job(client, key, m["id"]))["status"] == "complete"
    r = await job(client, key, root["id"])
    assert (r["status"], r["error"], r["result"]["detail"]) == ("complete", None, "all 2 children complete")
    explained = (await client.get(f"/v1/jobs/{root['id']}/explain", headers=bearer(key))).json()
    assert explained["summary"] == "Complete: all 2 children complete."
    await verify_ok(client, key)


async def test_the_last_child_completed_with_claim_next_settles_the_parent_and_claims(client, org):
    """complete?claim_next=true is the completion (the parent settles in its transaction) plus the node's
    next claim."""
    _, key = org
    _, a = await http_pair(client, key, "a")
    parent = (await client.post("/v1/jobs", json={"kind": "book", "priority": 1}, headers=bearer(key))).json()
    got = await claim_http(client, a, "book")
    (k,) = await split(client, a, parent["id"], got["job"]["attempt"], [{"kind": "x"}])
    later = (await client.post("/v1/jobs", json={"kind": "later"}, headers=bearer(key))).json()
    c = await claim_http(client, a, "x")
    done = await client.post(f"/v1/agent/jobs/{k['id']}/complete", params={"claim_next": "true"},
                             json={"attempt": c["job"]["attempt"], "result": {"ok": 1}}, headers=bearer(a))  # fmt: skip
    assert done.status_code == 200 and done.json()["next_claim"]["job"]["id"] == later["id"]
    assert (await job(client, key, parent["id"]))["status"] == "complete"


# -- blocked children -------------------------------------------------------------------------------


async def test_a_blocked_child_is_unblocked_when_a_node_that_can_run_it_pairs(conn, org):
    """A child no registered device could run is `blocked`, returns to `queued` when a node that could run
    it pairs, and then settles its parent normally."""
    org_id, _ = org
    a = await add_node(conn, org_id, "a", [CPU64])
    parent, (k,) = await split_claimed(conn, org_id, a, [child(requires={"ram_min_mb": 100_000})])
    assert k.status == "blocked"
    big = msgspec.structs.replace(CPU64, ram_total_mb=200_000, ram_free_mb=150_000)
    b = await add_node(conn, org_id, "b", [big])
    assert (await queue.load(conn, k.id, org_id)).status == "queued"
    c = await claim(conn, org_id, b)
    assert c.job_id == k.id
    await claims.complete(conn, organization_id=org_id, node_id=b, job_id=k.id, attempt=1, result=None)
    assert (await queue.load(conn, parent.id, org_id)).status == "complete"


# -- decomposition ----------------------------------------------------------------------------------


async def test_children_priority_defaults_to_the_parents_and_zero_is_kept(conn, org):
    """Children inherit the parent's priority by default; an explicit priority (0 and below included) is
    kept, and lower runs first."""
    org_id, _ = org
    a = await add_node(conn, org_id, "a", [CPU64])
    _, kids = await split_claimed(conn, org_id, a, [child("d"), child("z", priority=0), child("n", priority=-5)],
                                  priority=40)  # fmt: skip
    assert [k.priority for k in kids] == [40, 0, -5]
    order = [(await claim(conn, org_id, a)).job_id for _ in kids]
    assert order == [kids[2].id, kids[1].id, kids[0].id]


async def test_children_of_one_split_with_equal_priority_run_in_the_order_given(conn, org):
    """Children of one decomposition with the same priority are claimed in the order the decomposition
    listed them."""
    org_id, _ = org
    a = await add_node(conn, org_id, "a", [CPU64])
    _, kids = await split_claimed(conn, org_id, a, [child(payload={"i": i}) for i in range(8)])
    order = [(await claim(conn, org_id, a)).job_id for _ in kids]
    assert order == [k.id for k in kids]


async def test_child_idempotency_keys(client, org, db_url):
    """A decomposition sent again by its node for the same attempt answers 201 with the same children and
    makes nothing; a key another job already has refuses the whole decomposition (422 naming the index) and
    writes nothing; a submitter's POST with a child's key gets that child back (200)."""
    _, key = org
    _, a = await http_pair(client, key, "a")
    parent = (await client.post("/v1/jobs", json={"kind": "book"}, headers=bearer(key))).json()
    other = (await client.post("/v1/jobs", json={"kind": "other", "idempotency_key": "used"}, headers=bearer(key))).json()
    got = await claim_http(client, a, "book")
    before = await head(db_url)
    refused = await client.post(f"/v1/agent/jobs/{parent['id']}/children", json={"attempt": 1, "children": [
        {"kind": "c", "idempotency_key": "k1"}, {"kind": "c", "idempotency_key": "used"}]}, headers=bearer(a))
    assert (refused.status_code, refused.json()["error"], refused.json()["index"]) == (422, "invalid_request", 1)
    assert await head(db_url) == before and (await job(client, key, parent["id"]))["lease_owner"] is not None
    body = [{"kind": "c", "idempotency_key": "k1"}, {"kind": "c", "idempotency_key": "k2"}]
    first = await split(client, a, parent["id"], got["job"]["attempt"], body)
    mid = await head(db_url)
    again = await split(client, a, parent["id"], got["job"]["attempt"], body)
    assert [k["id"] for k in again] == [k["id"] for k in first] and await head(db_url) == mid
    resubmitted = await client.post("/v1/jobs", json={"kind": "whatever", "idempotency_key": "k2"}, headers=bearer(key))
    assert resubmitted.status_code == 200 and resubmitted.json()["id"] == first[1]["id"]
    assert other["id"] not in {k["id"] for k in first}


async def test_decomposing_a_job_whose_lease_expired_and_was_swept_is_refused(conn, org):
    """A lapsed lease is still its holder's until swept: its decomposition lands (and the container holds
    no lease for the sweeper to take); once the sweeper took a job back, its old holder's decomposition is
    refused 409 job_not_claimed_by_this_node and changes nothing."""
    org_id, _ = org
    a = await add_node(conn, org_id, "a", [CPU64])
    p1 = await submit(conn, org_id, "p1")
    got = await claim(conn, org_id, a, lease_seconds=5)
    await set_clock(conn, 10)
    # not yet swept: still the holder's
    kids = await claims.add_children(conn, organization_id=org_id, node_id=a, job_id=p1.id, attempt=got.attempt,
                                     children=[child()])  # fmt: skip
    assert len(kids) == 1
    assert (await sweep_once(conn, SETTINGS)).leases_requeued == 0  # the container has no lease
    p2 = await submit(conn, org_id, "p2", priority=0)
    got2 = await claim(conn, org_id, a, lease_seconds=5)
    assert got2.job_id == p2.id
    await set_clock(conn, 20)
    assert (await sweep_once(conn, SETTINGS)).leases_requeued == 1
    position = await store.head_position(conn)
    with pytest.raises(Exception) as caught:
        await claims.add_children(conn, organization_id=org_id, node_id=a, job_id=p2.id, attempt=got2.attempt,
                                  children=[child()])  # fmt: skip
    assert caught.value.code == "job_not_claimed_by_this_node"
    assert await store.head_position(conn) == position


async def test_the_decomposer_cannot_complete_fail_or_renew_the_container(client, org, db_url):
    """After a decomposition the node that split the job no longer holds it: a completion, failure or
    renewal it sends for the container is refused 409 job_not_claimed_by_this_node and changes nothing, and
    the container still settles from its child."""
    _, key = org
    _, a = await http_pair(client, key, "a")
    parent = (await client.post("/v1/jobs", json={"kind": "book"}, headers=bearer(key))).json()
    got = await claim_http(client, a, "book")
    (k,) = await split(client, a, parent["id"], got["job"]["attempt"], [{"kind": "x"}])
    before = await head(db_url)
    base = f"/v1/agent/jobs/{parent['id']}"
    for path, body in (("complete", {"attempt": 1, "result": {"bogus": 1}}), ("renew", {"attempt": 1}),
                       ("fail", {"attempt": 1, "error": "x", "retry": False})):
        r = await client.post(f"{base}/{path}", json=body, headers=bearer(a))
        assert (r.status_code, r.json()["error"]) == (409, "job_not_claimed_by_this_node"), (path, r.text)
    assert await head(db_url) == before
    c = await claim_http(client, a, "x")
    await client.post(f"/v1/agent/jobs/{k['id']}/complete", json={"attempt": c["job"]["attempt"]}, headers=bearer(a))
    assert (await job(client, key, parent["id"]))["status"] == "complete"


# -- races ------------------------------------------------------------------------------------------


async def test_the_last_children_completing_at_once_settle_the_parent_exactly_once(client, org):
    """The parent settles in the transaction of the child that ends last: children finishing at the same
    moment (separate agents, separate requests, and several in one report) settle it exactly once, never
    leave it open, and verify agrees."""
    _, key = org
    agents = [await http_pair(client, key, f"n{i}") for i in range(4)]
    for round_ in range(3):
        parent = (await client.post("/v1/jobs", json={"kind": f"book{round_}"}, headers=bearer(key))).json()
        got = await claim_http(client, agents[0][1], f"book{round_}")
        await split(client, agents[0][1], parent["id"], got["job"]["attempt"], [{"kind": f"c{round_}"}] * 6)
        held = []
        for i in range(6):
            credential = agents[i % 4][1]
            c = await claim_http(client, credential, f"c{round_}")
            held.append((credential, c["job"]["id"]))
        # agent 0 holds two children: report them together; the others one each, all at once
        by_agent: dict[str, list[str]] = {}
        for credential, job_id in held:
            by_agent.setdefault(credential, []).append(job_id)
        answers = []

        async def report(credential, ids):
            if len(ids) > 1:
                r = await client.post("/v1/agent/complete", json={"results": [{"job_id": j, "attempt": 1} for j in ids]},
                                      headers=bearer(credential))  # fmt: skip
            else:
                r = await client.post(f"/v1/agent/jobs/{ids[0]}/complete", json={"attempt": 1}, headers=bearer(credential))
            answers.append(r.status_code)

        async with anyio.create_task_group() as tg:
            for credential, ids in by_agent.items():
                tg.start_soon(report, credential, ids)
        assert answers == [200] * len(by_agent)
        settled = await job(client, key, parent["id"])
        assert settled["status"] == "complete", settled
        history = (await client.get(f"/v1/jobs/{parent['id']}/events", headers=bearer(key))).json()["events"]
        assert [e["type"] for e in history].count("job.settled") == 1
    await verify_ok(client, key)


async def test_cancelling_a_parent_while_its_last_child_completes_ends_one_way(client, org):
    """A container's cancel raced with the completion of its last open child ends one consistent way:
    either the completion lands and the parent settles (the cancel answers 409 job_terminal), or the cancel
    lands and the completion is refused 409 job_cancelled. Never both, never a parent left open."""
    _, key = org
    _, a = await http_pair(client, key, "a")
    for round_ in range(6):
        parent, k, _ = await container_with_a_running_child(client, key, a, round_)
        cancelled, completed = await at_once(
            client.post(f"/v1/jobs/{parent['id']}/cancel", headers=bearer(key)),
            client.post(f"/v1/agent/jobs/{k['id']}/complete", json={"attempt": 1}, headers=bearer(a)))
        p, c = await job(client, key, parent["id"]), await job(client, key, k["id"])
        if completed.status_code == 200:
            assert (p["status"], c["status"]) == ("complete", "complete")
            assert (cancelled.status_code, cancelled.json()["error"]) == (409, "job_terminal")
        else:
            assert (completed.status_code, completed.json()["error"]) == (409, "job_cancelled")
            assert cancelled.status_code == 200 and (p["status"], c["status"]) == ("cancelled", "cancelled")
    await verify_ok(client, key)


async def test_cancelling_the_root_while_a_child_is_split_leaves_no_open_descendant(client, org, db_url):
    """A container's cancel raced with the decomposition of one of its children ends one of two ways and
    never leaves an open job under a cancelled root: either the split is refused 409 job_cancelled and made
    nothing, or it landed and its grandchildren are cancelled with the tree."""
    _, key = org
    _, a = await http_pair(client, key, "a")
    for round_ in range(6):
        root, mid, m = await container_with_a_running_child(client, key, a, round_)
        made, cancelled = await at_once(
            client.post(f"/v1/agent/jobs/{mid['id']}/children", json={
                "attempt": m["job"]["attempt"], "children": [{"kind": f"g{round_}"}] * 20}, headers=bearer(a)),
            client.post(f"/v1/jobs/{root['id']}/cancel", headers=bearer(key)))
        assert cancelled.status_code == 200, cancelled.text
        if made.status_code == 201:
            for g in made.json()["children"]:
                assert (await job(client, key, g["id"]))["status"] == "cancelled"
        else:
            assert (made.status_code, made.json()["error"]) == (409, "job_cancelled")
        assert (await job(client, key, mid["id"]))["status"] == "cancelled"
    open_jobs = (await client.get("/v1/jobs", params={"status": "queued,running,blocked"}, headers=bearer(key))).json()["jobs"]
    assert open_jobs == []
    await verify_ok(client, key)


async def test_a_childs_retryable_failure_raced_with_its_parents_cancel_never_leaves_it_open(client, org):
    """A child's retryable failure raced with its container's cancel either lands first (the child
    requeued, then cancelled with the tree) or is refused 409 job_cancelled: the child never stays queued
    under a cancelled parent."""
    _, key = org
    _, a = await http_pair(client, key, "a")
    for round_ in range(6):
        parent, k, _ = await container_with_a_running_child(client, key, a, round_)
        failed, cancelled = await at_once(
            client.post(f"/v1/agent/jobs/{k['id']}/fail", json={"attempt": 1, "error": "e"}, headers=bearer(a)),
            client.post(f"/v1/jobs/{parent['id']}/cancel", headers=bearer(key)))
        assert cancelled.status_code == 200, cancelled.text
        assert failed.status_code == 200 or failed.json()["error"] == "job_cancelled", failed.text
        assert (await job(client, key, k["id"]))["status"] == "cancelled"
    await verify_ok(client, key)


async def test_a_parked_agent_wakes_for_children_as_they_are_made(client, org):
    """Children are claimable as their decomposition commits: an agent parked in a long-poll is woken and
    takes one well before its wait ends."""
    _, key = org
    _, a = await http_pair(client, key, "a")
    _, b = await http_pair(client, key, "b")
    parent = (await client.post("/v1/jobs", json={"kind": "book"}, headers=bearer(key))).json()
    got = await claim_http(client, a, "book")
    result = {}

    async def park():
        started = time.monotonic()
        r = await client.post("/v1/agent/claim", params={"wait": 20}, headers=bearer(b))
        result["status"], result["took"] = r.status_code, time.monotonic() - started
        result["job"] = r.json()["job"] if r.status_code == 200 else None

    async with anyio.create_task_group() as tg:
        tg.start_soon(park)
        await anyio.sleep(0.5)
        (k,) = await split(client, a, parent["id"], got["job"]["attempt"], [{"kind": "x"}])
    assert result["status"] == 200 and result["job"]["id"] == k["id"] and result["took"] < 5


# -- how a container reads --------------------------------------------------------------------------


async def test_explain_a_blocked_child_and_a_container(client, org):
    """Explain says why a blocked child waits (the rule each device fails), and a running container reads
    as a container counting its finished children."""
    _, key = org
    _, a = await http_pair(client, key, "a")
    parent = (await client.post("/v1/jobs", json={"kind": "book"}, headers=bearer(key))).json()
    got = await claim_http(client, a, "book")
    kids = await split(client, a, parent["id"], got["job"]["attempt"], [
        {"kind": "x"}, {"kind": "gpu", "requires": {"accelerators": ["cuda"]}}])
    e = (await client.get(f"/v1/jobs/{kids[1]['id']}/explain", headers=bearer(key))).json()
    assert e["status"] == "blocked" and [i["reason"] for i in e["ineligible"]] == ["accelerator_missing"]
    p = (await client.get(f"/v1/jobs/{parent['id']}/explain", headers=bearer(key))).json()
    assert p["status"] == "running" and p["summary"].startswith("Running as a container: 0 of 2 children finished")


async def test_explain_a_partial_container(client, org):
    """Explain of a finished container reads its settlement: `partial`, with the count of children that
    did not complete."""
    _, key = org
    _, a = await http_pair(client, key, "a")
    p1 = (await client.post("/v1/jobs", json={"kind": "b1"}, headers=bearer(key))).json()
    got = await claim_http(client, a, "b1")
    (k,) = await split(client, a, p1["id"], got["job"]["attempt"], [{"kind": "x"}])
    assert (await client.post(f"/v1/jobs/{k['id']}/cancel", headers=bearer(key))).status_code == 200
    e1 = (await client.get(f"/v1/jobs/{p1['id']}/explain", headers=bearer(key))).json()
    assert (e1["status"], e1["summary"]) == ("partial", "Partial: 1 of 1 children failed.")


async def test_explain_of_a_cancelled_container_does_not_say_it_was_running_on_a_node(client, org):
    """A container runs on no node once its decomposition released it: explained running, it reads as a
    container; cancelled, it reads as a cancelled container with its count of children, never as cancelled
    while running on the node that split it."""
    _, key = org
    _, a = await http_pair(client, key, "a")
    p2 = (await client.post("/v1/jobs", json={"kind": "b2"}, headers=bearer(key))).json()
    got = await claim_http(client, a, "b2")
    await split(client, a, p2["id"], got["job"]["attempt"], [{"kind": "y"}, {"kind": "z"}])
    running = (await client.get(f"/v1/jobs/{p2['id']}/explain", headers=bearer(key))).json()
    assert running["summary"].startswith("Running as a container")
    assert (await client.post(f"/v1/jobs/{p2['id']}/cancel", headers=bearer(key))).status_code == 200
    e2 = (await client.get(f"/v1/jobs/{p2['id']}/explain", headers=bearer(key))).json()
    assert e2["status"] == "cancelled" and "running on" not in e2["summary"], e2["summary"]
    assert e2["summary"] == "Cancelled as a container of 2 children; those still open were cancelled with it."


async def test_a_running_container_is_not_shown_as_placed_on_the_node_that_released_it(client, org):
    """A container is released by its decomposition: while its children run it is `running` with neither a
    lease owner nor a placement, in the queue view and in the Job object alike, so nothing shows the node that
    split it as running it."""
    _, key = org
    _, a = await http_pair(client, key, "a")
    parent = (await client.post("/v1/jobs", json={"kind": "book"}, headers=bearer(key))).json()
    got = await claim_http(client, a, "book")
    await split(client, a, parent["id"], got["job"]["attempt"], [{"kind": "x"}])
    view = (await client.get("/v1/projections/queue", headers=bearer(key))).json()
    [container] = [j for j in view["jobs"] if j["id"] == parent["id"]]
    assert (container["status"], container["lease_owner"]) == ("running", None)
    assert container["placement"] is None, container["placement"]
    assert (await job(client, key, parent["id"]))["placement"] is None


async def test_a_container_gives_back_its_memory_so_its_children_can_run_where_it_ran(conn, org):
    """A container gives back at once the memory its claim promised on the node, so a child needing as
    much runs on the same node (were the container still counted, its children could never be placed there
    and it would never settle)."""
    org_id, _ = org
    a = await add_node(conn, org_id, "a", [CPU64])  # 60,000 MB free
    parent = await submit(conn, org_id, "p", requires={"ram_min_mb": 50_000})
    got = await claim(conn, org_id, a)
    assert got.job_id == parent.id
    await submit(conn, org_id, "q", requires={"ram_min_mb": 50_000})
    assert await claim(conn, org_id, a) is None  # the running parent holds the memory
    (k,) = await claims.add_children(conn, organization_id=org_id, node_id=a, job_id=parent.id, attempt=got.attempt,
                                     children=[child(requires={"ram_min_mb": 50_000}, priority=0)])  # fmt: skip
    c = await claim(conn, org_id, a)
    assert c is not None and c.job_id == k.id
    await claims.complete(conn, organization_id=org_id, node_id=a, job_id=k.id, attempt=1, result=None)
    assert (await queue.load(conn, parent.id, org_id)).status == "complete"
