"""What an agent gives back: a job it could not finish before stopping, a claim whose answer it never read.

``POST /v1/agent/jobs/{id}/release`` (API.md "Additions"): the holder, at its attempt, gives the job back:
``job.released`` with ``reason: agent_stopping``, queued at once in its place, not charged. Runs cut short
from outside (that, and a revocation's lease end) are free while the job has had fewer than its
``max_attempts`` of them; past that they are charged, so a job that takes down every node it runs on
still runs out of attempts. Refusals change nothing; a give-back sent again is answered as the first was.

``POST /v1/agent/claim/release`` names a claim request by the ``X-Request-ID`` it was sent with: what it took
and what still stands as it left it goes back to the queue (``answer_unread``, never charged).
"""

from __future__ import annotations

from uuid import UUID

import anyio
import httpx
import psycopg
import pytest

from tests.helpers import bearer
from umbra import metrics
from umbra.compute import claims
from umbra.compute.abandoned_claims import ABANDONED_SECONDS, ClaimAbandoned
from umbra.compute.accounts import create_organization
from umbra.compute.claims import ChildRequest
from umbra.compute.sweeper import sweep_once
from umbra.domain.jobs import UnchargedEnds
from umbra.events import store
from umbra.projections import jobs as queue
from umbra.projections.verify import verify
from umbra.settings import load_settings

from .queue_support import CPU64, add_node, set_clock, submit
from .test_nodes_api import CPU, footprint
from .test_revocation import claim_now, get_job, job_events, online, post_job

pytestmark = pytest.mark.anyio

STOPPED = "The agent stopped before the job finished."
SETTINGS = load_settings({})


async def give_back(client, credential: str, job_id: str, attempt: int):
    return await client.post(f"/v1/agent/jobs/{job_id}/release", json={"attempt": attempt}, headers=bearer(credential))


async def test_a_job_given_back_is_queued_at_once_in_its_place_and_uncharged(client, conn, org):
    """Given back: queued, no ``not_before``, the attempt kept (the fencing token), the reason on the job,
    and ahead of jobs submitted after it: another node's next claim takes it, not the later one. A job
    allowed one attempt keeps it."""
    org_id, key = org
    _, first = await online(client, key, "stopping-box")
    _, second = await online(client, key, "other-box")
    job_id = await post_job(client, key, max_attempts=1)
    later = await post_job(client, key)
    held = await claim_now(client, first)

    answer = await give_back(client, first, job_id, held["attempt"])
    assert answer.status_code == 200, answer.text
    job = answer.json()
    assert (job["status"], job["attempt"], job["not_before"], job["lease_owner"], job["error"]) == (
        "queued", 1, None, None, STOPPED)
    events = await job_events(client, key, job_id)
    assert (events[-1]["type"], events[-1]["data"]["reason"]) == ("job.released", "agent_stopping")
    assert events[-1]["metadata"]["actor"].startswith("node:")
    taken = await claim_now(client, second)
    assert (taken["id"], taken["attempt"]) == (job_id, 2)
    done = await client.post(f"/v1/agent/jobs/{job_id}/complete", json={"attempt": 2, "result": {"ok": True}},
                             headers=bearer(second))  # fmt: skip
    assert done.status_code == 200 and done.json()["status"] == "complete", done.text
    assert (await get_job(client, key, later))["status"] == "queued"
    assert await verify(conn, org_id) == []


async def test_a_give_back_sent_again_is_answered_as_the_first_and_records_nothing(client, org):
    """Its answer lost, the agent sends it again: the job as it stands, one ``job.released``. Once another
    node holds the job, the old attempt is refused (the agent takes it as lost) and nothing changes."""
    _, key = org
    _, first = await online(client, key, "stopping-box")
    _, second = await online(client, key, "other-box")
    job_id = await post_job(client, key)
    await claim_now(client, first)
    assert (await give_back(client, first, job_id, 1)).status_code == 200
    again = await give_back(client, first, job_id, 1)
    assert again.status_code == 200 and again.json()["status"] == "queued", again.text
    assert [e["type"] for e in await job_events(client, key, job_id)] == ["job.submitted", "job.claimed", "job.released"]
    await claim_now(client, second)
    late = await give_back(client, first, job_id, 1)
    assert (late.status_code, late.json()["error"]) == (409, "job_not_claimed_by_this_node")
    assert (await get_job(client, key, job_id))["lease_owner"] is not None


async def test_refused_give_backs_change_nothing(client, conn, org):
    """Not the holder, a stale or bad attempt, a cancelled job, a job of another organization, unknown
    fields: each refused with the contract's code, and nothing is written."""
    from umbra.compute.accounts import create_organization

    _, key = org
    _, holder = await online(client, key, "holder-box")
    _, bystander = await online(client, key, "bystander-box")
    held_id = await post_job(client, key)
    await claim_now(client, holder)
    cancelled_id = await post_job(client, key)
    await claim_now(client, holder)
    assert (await client.post(f"/v1/jobs/{cancelled_id}/cancel", headers=bearer(key))).status_code == 200
    _, other_key = await create_organization(conn, "elsewhere")
    _, stranger = await online(client, other_key, "stranger-box")
    before = await footprint(conn)

    refusals = [
        (await give_back(client, bystander, held_id, 1), 409, "job_not_claimed_by_this_node"),
        (await give_back(client, holder, held_id, 2), 409, "job_not_claimed_by_this_node"),
        (await give_back(client, holder, cancelled_id, 1), 409, "job_cancelled"),
        (await give_back(client, stranger, held_id, 1), 404, "job_not_found"),
        (await give_back(client, holder, held_id, 0), 422, "invalid_request"),
        (await client.post(f"/v1/agent/jobs/{held_id}/release", json={"attempt": 1, "retry": True},
                           headers=bearer(holder)), 422, "invalid_request"),  # fmt: skip
        (await give_back(client, key, held_id, 1), 403, "forbidden"),  # an API key holds no compute:complete
    ]
    for answer, status, code in refusals:
        assert answer.status_code == status, (answer.status_code, answer.text)
        if code:
            assert answer.json()["error"] == code, answer.text
    assert await footprint(conn) == before


async def test_interruptions_past_max_attempts_are_charged_and_the_job_fails(client, conn, org):
    """A job allowed one attempt: given back once (free), then its next node revoked (past the cap: charged,
    and that was its one run): it fails for good instead of going round the fleet for ever. The log's
    counts agree, and so do replay and verify."""
    org_id, key = org
    _, first = await online(client, key, "first-box")
    second_id, second = await online(client, key, "second-box")
    await online(client, key, "third-box")
    job_id = await post_job(client, key, max_attempts=1)
    await claim_now(client, first)
    assert (await give_back(client, first, job_id, 1)).json()["status"] == "queued"
    assert (await claim_now(client, second))["id"] == job_id
    assert (await client.post(f"/v1/nodes/{second_id}/revoke", headers=bearer(key))).status_code == 200

    job = await get_job(client, key, job_id)
    assert (job["status"], job["attempt"]) == ("failed", 2), job
    assert await claims.uncharged_claims(conn, [UUID(job_id)]) == {UUID(job_id): UnchargedEnds(interrupted=2)}
    events = await job_events(client, key, job_id)
    assert [(e["type"], e["data"].get("requeued")) for e in events[-2:]] == [("job.claimed", None), ("job.lease_expired", False)]
    assert await verify(conn, org_id) == []


async def test_a_give_back_past_the_cap_is_the_charged_retryable_failure_with_its_backoff(client, org):
    """Two interruptions already (a revocation, a give-back) on a job allowed two attempts: the third
    interruption, a give-back, is charged: ``job.requeued`` with attempt 3's back-off, not queued at once.
    Sent again it records nothing."""
    _, key = org
    first_id, first = await online(client, key, "first-box")
    _, second = await online(client, key, "second-box")
    _, third = await online(client, key, "third-box")
    job_id = await post_job(client, key, max_attempts=2)
    await claim_now(client, first)
    assert (await client.post(f"/v1/nodes/{first_id}/revoke", headers=bearer(key))).status_code == 200
    await claim_now(client, second)
    released = (await give_back(client, second, job_id, 2)).json()
    assert released["not_before"] == (await job_events(client, key, job_id))[-3]["data"]["not_before"]  # the revocation's: now
    await claim_now(client, third)

    charged = await give_back(client, third, job_id, 3)
    assert charged.status_code == 200, charged.text
    job = charged.json()
    assert (job["status"], job["attempt"], job["error"]) == ("queued", 3, STOPPED)
    assert job["not_before"] > released["not_before"]  # attempt 3's back-off: 20 s
    again = await give_back(client, third, job_id, 3)
    assert again.status_code == 200 and again.json()["not_before"] == job["not_before"]
    types = [e["type"] for e in await job_events(client, key, job_id)]
    assert types[-1] == "job.requeued" and types.count("job.requeued") == 1


async def test_explain_counts_the_free_interruptions_only(client, org):
    """``explain`` says how many earlier claims were not charged: a give-back is one of them."""
    _, key = org
    _, first = await online(client, key, "first-box")
    _, second = await online(client, key, "second-box")
    job_id = await post_job(client, key, max_attempts=3)
    await claim_now(client, first)
    await give_back(client, first, job_id, 1)
    await claim_now(client, second)
    explained = await client.get(f"/v1/jobs/{job_id}/explain", headers=bearer(key))
    assert explained.status_code == 200, explained.text
    assert "1 earlier claim not charged" in explained.json()["summary"]


async def claim_as(client, credential: str, request: str, **params) -> dict:
    taken = await client.post("/v1/agent/claim", params={"wait": 0, **params},
                              headers={**bearer(credential), "X-Request-ID": request})  # fmt: skip
    assert taken.status_code == 200, taken.text
    return taken.json()


async def release_unread(client, credential: str, request: str):
    return await client.post("/v1/agent/claim/release", json={"request_id": request}, headers=bearer(credential))


async def test_a_claim_request_never_read_gives_back_everything_it_took_that_stands_untouched(client, conn, org):
    """Three jobs taken by one claim request (``max=3``), one of them renewed since (its agent did hear of
    it, through another answer): the two untouched go back to the queue, uncharged, claimable now; the
    renewed one stays. Sent again, nothing more. A later claim request's jobs are not touched."""
    org_id, key = org
    _, credential = await online(client, key, "box")
    jobs = [await post_job(client, key, max_attempts=1) for _ in range(4)]
    taken = [c["job"]["id"] for c in (await claim_as(client, credential, "claim-1", max=3))["claims"]]
    assert taken == jobs[:3]
    later = (await claim_as(client, credential, "claim-2"))["job"]["id"]
    renewed = await client.post(f"/v1/agent/jobs/{jobs[1]}/renew", json={"attempt": 1}, headers=bearer(credential))
    assert renewed.status_code == 200, renewed.text

    answer = await release_unread(client, credential, "claim-1")
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"released": [jobs[0], jobs[2]]}
    for job_id in (jobs[0], jobs[2]):
        job = await get_job(client, key, job_id)
        assert (job["status"], job["attempt"], job["error"]) == ("queued", 1, None)
        last = (await job_events(client, key, job_id))[-1]
        assert (last["type"], last["data"]["reason"]) == ("job.released", "answer_unread")
    assert [(await get_job(client, key, j))["status"] for j in (jobs[1], later)] == ["running", "running"]
    assert (await release_unread(client, credential, "claim-1")).json() == {"released": []}
    again = await claim_as(client, credential, "claim-3", max=2)
    assert [c["job"]["id"] for c in again["claims"]] == [jobs[0], jobs[2]]  # in their place, uncharged
    assert await verify(conn, org_id) == []


async def test_only_the_claiming_nodes_own_unread_claims_are_given_back(client, conn, org):
    """Another node naming the request id, another organization's node, a malformed id, an API key: none
    gives anything back, and nothing is written."""
    from umbra.compute.accounts import create_organization

    _, key = org
    _, credential = await online(client, key, "box")
    _, neighbour = await online(client, key, "neighbour")
    job_id = await post_job(client, key)
    await claim_as(client, credential, "claim-x")
    _, other_key = await create_organization(conn, "elsewhere")
    _, stranger = await online(client, other_key, "stranger")
    before = await footprint(conn)

    assert (await release_unread(client, neighbour, "claim-x")).json() == {"released": []}
    assert (await release_unread(client, stranger, "claim-x")).json() == {"released": []}
    for bad in ("", "has space", "x" * 129):
        refused = await release_unread(client, credential, bad)
        assert (refused.status_code, refused.json()["error"]) == (422, "invalid_request"), refused.text
    assert (await release_unread(client, key, "claim-x")).status_code == 403
    assert await footprint(conn) == before
    assert (await get_job(client, key, job_id))["status"] == "running"


async def test_unheard_releases_are_never_capped_and_interruptions_are(client, conn, org):
    """max_attempts=2: an unread claim given back (unheard, free, never capped), two give-backs (free: fewer
    than 2 interruptions before each), a third give-back (charged: attempt 4 - 1 unheard - 2 interruptions
    = run 1 < 2, so requeued with attempt 4's back-off), then a retryable failure (run 2: fails for good)."""
    org_id, key = org
    _, node = await online(client, key, "box")
    job_id = await post_job(client, key, max_attempts=2)
    await claim_as(client, node, "r-1")
    assert (await release_unread(client, node, "r-1")).json() == {"released": [job_id]}
    for attempt in (2, 3):
        assert (await claim_as(client, node, f"r-{attempt}"))["job"]["attempt"] == attempt
        answer = (await give_back(client, node, job_id, attempt)).json()
        assert (answer["status"], answer["not_before"]) == ("queued", None), answer
    assert await claims.uncharged_claims(conn, [UUID(job_id)]) == {UUID(job_id): UnchargedEnds(unheard=1, interrupted=2)}
    assert (await claim_as(client, node, "r-4"))["job"]["attempt"] == 4
    charged = (await give_back(client, node, job_id, 4)).json()
    assert (charged["status"], charged["error"]) == ("queued", STOPPED) and charged["not_before"] is not None
    types = [e["type"] for e in await job_events(client, key, job_id)]
    assert types[-1] == "job.requeued"
    assert await verify(conn, org_id) == []


async def test_a_give_back_racing_the_sweeper_ends_the_attempt_once(db_url):
    """The lease ran out while the stopping agent's give-back was on its way: the sweeper's expiry and the
    give-back at the same moment (in both orders, twice each): exactly one ends attempt 1, the other changes nothing
    (the give-back is refused 409 when the sweeper won), and verify agrees."""
    for round_ in range(4):
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as setup:
            org_id, _ = await create_organization(setup, f"race-{round_}")
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as a, \
                await psycopg.AsyncConnection.connect(db_url, autocommit=True) as b:  # fmt: skip
            node = await add_node(a, org_id, f"box-{round_}", [CPU64])
            job = await submit(a, org_id, max_attempts=3)
            assert (await claims.claim(a, node_id=node, organization_id=org_id, lease_seconds=30)).job_id == job.id
            await set_clock(a, 31)
            await set_clock(b, 31)
            outcome: dict = {}

            async def do_give_back() -> None:
                try:
                    outcome["give_back"] = (await claims.give_back(b, organization_id=org_id, node_id=node, job_id=job.id,
                                                                   attempt=1)).status  # fmt: skip
                except Exception as exc:  # noqa: BLE001
                    outcome["give_back"] = getattr(exc, "code", type(exc).__name__)

            async with anyio.create_task_group() as tg:
                if round_ % 2:
                    tg.start_soon(do_give_back)
                    tg.start_soon(sweep_once, a, SETTINGS)
                else:
                    tg.start_soon(sweep_once, a, SETTINGS)
                    tg.start_soon(do_give_back)
            await sweep_once(a, SETTINGS)  # whatever it skipped while the give-back held the row
            assert await verify(a, org_id) == []
            recorded = await store.read_stream(a, store.job_stream(job.id))
            ends = [r.type for r in recorded if r.type in ("job.released", "job.lease_expired", "job.requeued")]
            assert len(ends) == 1, (round_, ends, outcome)
            assert outcome["give_back"] in ("queued", "job_not_claimed_by_this_node"), outcome
            assert (outcome["give_back"] == "queued") == (ends == ["job.released"]), (ends, outcome)


async def test_a_charged_give_back_of_a_childs_last_attempt_settles_its_container(conn, org):
    """A child allowed one attempt, given back twice (the second past the cap: charged, its one run): it fails
    for good, its container settles, and replay/verify agree."""
    org_id, _ = org
    node = await add_node(conn, org_id, "a", [CPU64])
    parent = await submit(conn, org_id, "p")
    got = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=30)
    [kid] = await claims.add_children(conn, organization_id=org_id, node_id=node, job_id=parent.id, attempt=got.attempt,
                                      children=[ChildRequest(kind="part", max_attempts=1)])  # fmt: skip
    for attempt, status in ((1, "queued"), (2, "failed")):
        assert (await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=30)).job_id == kid.id
        row = await claims.give_back(conn, organization_id=org_id, node_id=node, job_id=kid.id, attempt=attempt)
        assert row.status == status
    assert (await queue.load(conn, parent.id, org_id)).status in ("failed", "partial")
    assert await verify(conn, org_id) == []


async def test_a_give_back_is_refused_for_a_job_cancelled_while_it_ran_and_writes_nothing(client, conn, org):
    """Cancelled while it ran: 409 job_cancelled, no event. Given back first, then cancelled: the job stays
    cancelled, and the give-back sent again changes nothing."""
    org_id, key = org
    _, node = await online(client, key, "box")
    first = await post_job(client, key)
    await claim_now(client, node)
    assert (await client.post(f"/v1/jobs/{first}/cancel", headers=bearer(key))).status_code == 200
    before = len(await job_events(client, key, first))
    refused = await give_back(client, node, first, 1)
    assert (refused.status_code, refused.json()["error"]) == (409, "job_cancelled")
    assert len(await job_events(client, key, first)) == before
    second = await post_job(client, key)
    await claim_now(client, node)
    assert (await give_back(client, node, second, 1)).status_code == 200
    assert (await client.post(f"/v1/jobs/{second}/cancel", headers=bearer(key))).status_code == 200
    again = await give_back(client, node, second, 1)
    assert again.status_code in (200, 409)
    assert (await get_job(client, key, second))["status"] == "cancelled"
    assert await verify(conn, org_id) == []


async def test_unread_release_leaves_a_job_the_sweeper_requeued_and_the_node_took_again(conn, org):
    """A claim request's job whose lease ran out and was requeued, then taken again by the same node by
    another request: releasing the first request's unread claim gives back nothing."""
    org_id, _ = org
    node = await add_node(conn, org_id, "a", [CPU64])
    job = await submit(conn, org_id, max_attempts=3)
    await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=5, request_id="old")
    await set_clock(conn, 10)
    await sweep_once(conn, SETTINGS, reexamine=False)
    await set_clock(conn, 10 + SETTINGS.lease_expired_delay_seconds + 1)
    assert (await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=30, request_id="new")).job_id == job.id
    assert await claims.release_unread_claim(conn, organization_id=org_id, node_id=node, claim_request_id="old") == []
    assert (await queue.load(conn, job.id, org_id)).status == "running"


async def test_a_repeated_completion_does_not_answer_a_next_claim_given_back_as_unread(client, conn, org):
    """complete?claim_next=true sent with X-Request-ID c-1 chains job B. Given back as unread under that id
    (answer_unread, uncharged), the same completion sent again (its answer lost) answers ``next_claim``
    null and records nothing; B is another node's to take, at attempt 2, uncharged; verify agrees."""
    org_id, key = org
    _, node = await online(client, key, "box")
    _, other = await online(client, key, "other")
    a = await post_job(client, key)
    await claim_now(client, node)
    b = await post_job(client, key, max_attempts=1)
    headers = {**bearer(node), "X-Request-ID": "c-1"}
    done = await client.post(f"/v1/agent/jobs/{a}/complete", params={"claim_next": "true"},
                             json={"attempt": 1, "result": {}}, headers=headers)  # fmt: skip
    assert done.status_code == 200 and done.json()["next_claim"]["job"]["id"] == b, done.text
    assert (await release_unread(client, node, "c-1")).json() == {"released": [b]}
    again = await client.post(f"/v1/agent/jobs/{a}/complete", params={"claim_next": "true"},
                              json={"attempt": 1, "result": {}}, headers=bearer(node))  # fmt: skip
    assert again.status_code == 200 and again.json()["next_claim"] is None, again.text
    taken = await claim_now(client, other)
    assert (taken["id"], taken["attempt"]) == (b, 2)
    assert await claims.uncharged_claims(conn, [UUID(b)]) == {UUID(b): UnchargedEnds(unheard=1)}
    assert await verify(conn, org_id) == []


def _given_back(reason: str) -> float:
    return metrics.CLAIMS_GIVEN_BACK.labels(reason=reason)._value.get()


async def test_a_give_back_that_fails_the_job_for_good_is_not_counted_as_a_claim_back_in_the_queue(client, conn, org):
    """``umbra_claims_given_back_total`` counts claims that went back to the queue without a report. A job
    allowed one attempt, given back twice: the first goes back to the queue (counted), the second is past
    the cap and fails the job for good (``job.failed``): not counted."""
    _, key = org
    _, first = await online(client, key, "first-box")
    _, second = await online(client, key, "second-box")
    job_id = await post_job(client, key, max_attempts=1)
    before = _given_back("agent_stopping")
    await claim_now(client, first)
    assert (await give_back(client, first, job_id, 1)).json()["status"] == "queued"
    await claim_now(client, second)
    failed = (await give_back(client, second, job_id, 2)).json()
    assert failed["status"] == "failed", failed
    assert _given_back("agent_stopping") - before == 1, "a give-back that failed the job for good was counted as back in the queue"


async def test_a_claim_request_that_arrives_after_its_release_claims_nothing(client, org):
    """A claim request held up on its way (a proxy buffering it) reaches the server after its agent gave up on
    it and asked for its claim back, when there was nothing to give back yet: it claims nothing (204), and
    the job stays queued for an agent that will hear of it, instead of going to one that will not."""
    _, key = org
    _, node = await online(client, key, "box")
    assert (await release_unread(client, node, "late-1")).json() == {"released": []}
    job_id = await post_job(client, key, max_attempts=1)
    late = await client.post("/v1/agent/claim", params={"wait": 0}, headers={**bearer(node), "X-Request-ID": "late-1"})
    assert late.status_code == 204, late.text
    assert (await get_job(client, key, job_id))["status"] == "queued"
    assert (await claim_as(client, node, "fresh-1"))["job"]["id"] == job_id


async def test_a_parked_claim_whose_request_is_released_claims_nothing_when_woken(client, org):
    """The agent gave up on a parked long-poll and released its request while nothing was claimed; the
    long-poll, still parked on the server (its connection kept by a proxy), is then woken by a new job: it
    claims nothing and answers 204, and the job goes to the agent's next request instead, never claimed
    and given back in between."""
    _, key = org
    _, node = await online(client, key, "box")
    answers: list[httpx.Response] = []

    async def parked() -> None:
        answers.append(await client.post("/v1/agent/claim", params={"wait": 10},
                                         headers={**bearer(node), "X-Request-ID": "parked-1"}))  # fmt: skip

    async with anyio.create_task_group() as tg:
        tg.start_soon(parked)
        await anyio.sleep(0.5)  # parked
        assert (await release_unread(client, node, "parked-1")).json() == {"released": []}
        job_id = await post_job(client, key, max_attempts=1)
    assert answers[0].status_code == 204, answers[0].text
    job = await get_job(client, key, job_id)
    assert job["status"] == "queued" and job["lease_owner"] is None
    assert [e["type"] for e in await job_events(client, key, job_id)] == ["job.submitted"]
    assert (await claim_as(client, node, "fresh-2"))["job"]["id"] == job_id


async def test_an_abandoned_request_is_the_nodes_own_and_claims_nothing_on_any_path(client, conn, org):
    """The abandonment is recorded for the node that gave the request up, in the database: another node's
    request of the same id claims as usual, and a claim that does not go through the group commit (the
    single-claim path a batch that rolled back falls back on) is refused as the batched one is."""
    org_id, key = org
    _, first = await online(client, key, "first")
    second_id, second = await online(client, key, "second")
    assert (await release_unread(client, first, "shared-1")).json() == {"released": []}
    job_id = await post_job(client, key, max_attempts=1)
    late = await client.post("/v1/agent/claim", params={"wait": 0}, headers={**bearer(first), "X-Request-ID": "shared-1"})
    assert late.status_code == 204, late.text
    [(first_id,)] = await (await conn.execute(
        "SELECT node_id FROM abandoned_claim_requests WHERE request_id = 'shared-1'")).fetchall()
    with pytest.raises(ClaimAbandoned):
        await claims.claim(conn, node_id=first_id, organization_id=org_id, lease_seconds=60, request_id="shared-1")
    assert (await get_job(client, key, job_id))["status"] == "queued"
    assert (await claim_as(client, second, "shared-1"))["job"]["id"] == job_id
    assert str(first_id) != second_id


async def test_abandoned_requests_are_forgotten_by_the_sweepers_second_look_after_five_minutes(client, conn, org):
    """The rows only have to outlive a request's trip: the periodic second look prunes those older than
    ``ABANDONED_SECONDS``, and a request of that id claims again."""
    org_id, key = org
    _, node = await online(client, key, "box")
    assert (await release_unread(client, node, "old-1")).json() == {"released": []}
    assert (await sweep_once(conn, SETTINGS, reexamine=True)).abandoned_claims_pruned == 0
    await set_clock(conn, ABANDONED_SECONDS + 1)
    try:
        report = await sweep_once(conn, SETTINGS, reexamine=True)
    finally:
        await set_clock(conn, 0)
    assert report.abandoned_claims_pruned == 1
    assert (await (await conn.execute("SELECT count(*) FROM abandoned_claim_requests")).fetchone())[0] == 0
    # The moved clock left the node silent past the stale threshold: it beats again.
    beat = await client.post("/v1/agent/heartbeat", json={"devices": [CPU]}, headers=bearer(node))
    assert beat.status_code == 200, beat.text
    job_id = await post_job(client, key, max_attempts=1)
    assert (await claim_as(client, node, "old-1"))["job"]["id"] == job_id
