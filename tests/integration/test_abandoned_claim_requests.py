"""Claim requests their agents gave up on, kept in the database (``umbra.compute.abandoned_claims``).

``POST /v1/agent/claim/release`` records (node, request id) in ``abandoned_claim_requests`` under the node's
claim guard, then gives back what the request took; claims read the table after sharing the guard and answer
204 (``ClaimAbandoned``). Held here: request ids at their limits, tenancy, revocation first, the same id
released again, the prune, chained claims, multi-claims racing a release, other ids of the same node, the
guard's buckets and fleet changes, the hub's wake hand-off, metrics, the group commit's one-by-one fallback,
and two server processes.
"""

from __future__ import annotations

import time
from uuid import UUID

import anyio
import httpx
import psycopg
import pytest

from tests.conftest import LiveServer
from tests.helpers import bearer, eventually, until, waiting_on_a_lock
from umbra import metrics
from umbra.api.rates import RELEASE_BURST
from umbra.compute import batch_commands
from umbra.compute.abandoned_claims import ABANDONED_SECONDS
from umbra.compute.accounts import create_organization
from umbra.compute.nodes import CLAIM_GUARD_CLASS, NODE_GUARDS, guard_key
from umbra.compute.sweeper import sweep_once
from umbra.projections.verify import verify
from umbra.settings import load_settings

from .test_broken_commit import paired
from .test_give_back import claim_as, release_unread
from .test_multiprocess import servers  # noqa: F401
from .test_multiprocess_promises import _pair, _submit, _two
from .test_revocation import get_job, job_events, online, post_job

pytestmark = pytest.mark.anyio

SETTINGS = load_settings({})
ALLOWED = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:@-"


async def claim_raw(client, credential: str, request: str | None, **params) -> httpx.Response:
    headers = bearer(credential)
    if request is not None:
        headers["X-Request-ID"] = request
    return await client.post("/v1/agent/claim", params={"wait": 0, **params}, headers=headers)


async def claim_racing_release(client, credential: str, request: str, delay: float, **params) -> tuple[httpx.Response, list[str]]:
    """A claim (``wait=0``) and, ``delay`` seconds later, the release of its request, sent together: the claim's
    answer (200 or 204) and the jobs the release gave back."""
    results: dict[str, httpx.Response] = {}

    async def claim() -> None:
        results["claim"] = await claim_raw(client, credential, request, **params)

    async def release() -> None:
        await anyio.sleep(delay)
        results["release"] = await release_unread(client, credential, request)

    async with anyio.create_task_group() as tg:
        tg.start_soon(claim)
        tg.start_soon(release)
    assert results["claim"].status_code in (200, 204), results["claim"].text
    return results["claim"], results["release"].json()["released"]


async def running_jobs(client, key: str) -> list[dict]:
    return (await client.get("/v1/jobs", params={"status": "running"}, headers=bearer(key))).json()["jobs"]


async def queued_count(client, key: str) -> int:
    return len((await client.get("/v1/jobs", params={"status": "queued", "limit": 1000}, headers=bearer(key))).json()["jobs"])


async def abandoned_rows(conn) -> list[tuple]:
    return await (await conn.execute("SELECT node_id, request_id, abandoned_at FROM abandoned_claim_requests"
                                      " ORDER BY request_id")).fetchall()  # fmt: skip


def _given_back(reason: str) -> float:
    return metrics.CLAIMS_GIVEN_BACK.labels(reason=reason)._value.get()


def _wait_count(outcome: str) -> float:
    for sample in metrics.CLAIM_WAIT.collect()[0].samples:
        if sample.name.endswith("_count") and sample.labels.get("outcome") == outcome:
            return sample.value
    return 0.0


def _claims_counted() -> float:
    return sum(s.value for s in metrics.CLAIMS.collect()[0].samples if s.name.endswith("_total"))


# -- request ids at the limits ---------------------------------------------------------------------------


async def test_a_release_id_of_128_characters_and_a_newline_is_refused_422_not_a_server_error(client, conn, org):
    """API.md: a request_id the server would not have kept (1 to 128 of ``A-Z a-z 0-9 . _ : @ -``) → 422
    ``invalid_request``. msgspec's ``pattern`` is a ``re.search``, and a bare ``$`` matches before a final
    newline: 128 allowed characters and a ``\\n`` passed the body's check, and the table's CHECK (length
    1..128) refused the id inside the release's transaction, a 500."""
    _, key = org
    _, node = await online(client, key, "box")
    answer = await release_unread(client, node, "x" * 128 + "\n")
    assert (answer.status_code, answer.json().get("error")) == (422, "invalid_request"), (answer.status_code, answer.text)


async def test_a_release_id_with_a_trailing_newline_is_refused_and_records_nothing(client, conn, org):
    """``"late-1\\n"`` is not an id the server would have kept (the middleware strips a header's value, and the
    pattern excludes ``\\n``): 422, and no row (one no claim could ever match) is written."""
    _, key = org
    _, node = await online(client, key, "box")
    answer = await release_unread(client, node, "late-1\n")
    rows = await abandoned_rows(conn)
    assert (answer.status_code, rows) == (422, []), (answer.status_code, answer.text, rows)


async def test_request_ids_at_the_limits_are_kept_and_matched_exactly(client, conn, org):
    """128 characters of every allowed kind, ``NULL`` (a text[] literal's keyword) and ``a`` are kept and refuse
    their late claims (the batch's ``db.text_array`` quoting holds); ids with ``\\ , " { }`` or a space are
    422; a 129-character header is replaced by a fresh id (so it claims); the match is case-sensitive."""
    _, key = org
    _, node = await online(client, key, "box")
    longest = (ALLOWED * 2)[:128]
    for request in (longest, "NULL", "null\\", "a"):
        if request == "null\\":
            refused = await release_unread(client, node, request)
            assert refused.status_code == 422, refused.text
            continue
        answer = await release_unread(client, node, request)
        assert answer.status_code == 200 and answer.json() == {"released": []}, answer.text
    for bad in ("a,b", 'a"b', "{a}", "a b"):
        refused = await release_unread(client, node, bad)
        assert refused.status_code == 422, (bad, refused.text)
    job_id = await post_job(client, key, max_attempts=1)
    for request in (longest, "NULL", "a"):
        late = await claim_raw(client, node, request)
        assert late.status_code == 204, (request, late.status_code, late.text)
        assert late.headers.get("x-request-id") == request
    assert (await get_job(client, key, job_id))["status"] == "queued"
    # Not abandoned: another case, a longer id (replaced by a fresh one).
    taken = await claim_raw(client, node, "Null")
    assert taken.status_code == 200 and taken.json()["job"]["id"] == job_id, taken.text
    second = await post_job(client, key, max_attempts=1)
    over = await claim_raw(client, node, longest + "x")
    assert over.status_code == 200 and over.json()["job"]["id"] == second, over.text
    assert over.headers["x-request-id"] != longest + "x"
    assert len(await abandoned_rows(conn)) == 3


# -- tenancy ---------------------------------------------------------------------------------------------


async def test_another_organizations_release_of_the_same_id_blocks_nothing_here(client, conn, org):
    """A node of another organization gives up request ``t-1``: this organization's node's ``t-1`` claims as
    usual (and its own later release gives back what it took). The body cannot name a node (unknown field:
    422), and an API key of either organization cannot release (403)."""
    org_id, key = org
    node_id, node = await online(client, key, "box")
    _, other_key = await create_organization(conn, "elsewhere")
    stranger_id, stranger = await online(client, other_key, "stranger")
    assert (await release_unread(client, stranger, "t-1")).json() == {"released": []}
    job_id = await post_job(client, key, max_attempts=1)
    taken = await claim_raw(client, node, "t-1")
    assert taken.status_code == 200 and taken.json()["job"]["id"] == job_id, taken.text
    named = await client.post("/v1/agent/claim/release", json={"request_id": "t-1", "node_id": node_id},
                              headers=bearer(stranger))  # fmt: skip
    assert named.status_code == 422, named.text
    assert (await client.post("/v1/agent/claim/release", json={"request_id": "t-1"},
                              headers=bearer(other_key))).status_code == 403  # fmt: skip
    assert (await get_job(client, key, job_id))["status"] == "running"
    rows = await abandoned_rows(conn)
    assert [(str(n), r) for n, r, _ in rows] == [(stranger_id, "t-1")]
    assert (await release_unread(client, node, "t-1")).json() == {"released": [job_id]}
    assert await verify(conn, org_id) == []


# -- revocation ------------------------------------------------------------------------------------------


async def test_a_revoked_credential_with_an_abandoned_request_id_is_401_not_204(client, conn, org):
    """Revoked after giving request ``rv-1`` up: its claim with that id (the token cached by this process, so
    the batch checks revocation), a parked one woken by the revocation, and its release again are all 401."""
    _, key = org
    node_id, node = await online(client, key, "box")
    assert (await release_unread(client, node, "rv-1")).json() == {"released": []}
    assert (await claim_raw(client, node, "rv-1")).status_code == 204  # cached and abandoned
    answers: list[httpx.Response] = []

    async def parked() -> None:
        answers.append(await claim_raw(client, node, "rv-2", wait=10))

    async with anyio.create_task_group() as tg:
        tg.start_soon(parked)
        await anyio.sleep(0.5)  # parked; then given up (nothing to give back, so nothing wakes it)
        assert (await release_unread(client, node, "rv-2")).json() == {"released": []}
        assert not answers
        assert (await client.post(f"/v1/nodes/{node_id}/revoke", headers=bearer(key))).status_code == 200
    assert answers[0].status_code == 401, (answers[0].status_code, answers[0].text)
    late = await claim_raw(client, node, "rv-1")
    assert late.status_code == 401, (late.status_code, late.text)
    again = await release_unread(client, node, "rv-1")
    assert again.status_code == 401, again.text


# -- the same id twice, and its prune --------------------------------------------------------------------


async def test_a_request_released_twice_keeps_one_row_renewed_and_still_claims_nothing(client, conn, org):
    """Released twice: one row, its time moved to the second release (so it is remembered five minutes from
    then); the second release gives back nothing the first did not."""
    _, key = org
    _, node = await online(client, key, "box")
    job_id = await post_job(client, key, max_attempts=1)
    assert (await claim_as(client, node, "twice-1"))["job"]["id"] == job_id
    assert (await release_unread(client, node, "twice-1")).json() == {"released": [job_id]}
    [(_, _, first_at)] = await abandoned_rows(conn)
    await anyio.sleep(0.05)
    assert (await release_unread(client, node, "twice-1")).json() == {"released": []}
    [(_, _, second_at)] = await abandoned_rows(conn)
    assert second_at > first_at
    assert (await claim_raw(client, node, "twice-1")).status_code == 204
    assert (await get_job(client, key, job_id))["status"] == "queued"


async def test_the_same_request_released_five_times_at_once_gives_each_job_back_once(client, conn, org):
    """Five releases of one request at once (an agent retrying a release whose answers were slow): all 200,
    the two jobs it took given back once between them, one row, and a long-poll of that id (``wait=10``)
    answers 204 at once rather than parking."""
    org_id, key = org
    _, node = await online(client, key, "box")
    jobs = [await post_job(client, key, max_attempts=1) for _ in range(2)]
    assert [c["job"]["id"] for c in (await claim_as(client, node, "five-1", max=2))["claims"]] == jobs
    answers: list[httpx.Response] = []

    async def release() -> None:
        answers.append(await release_unread(client, node, "five-1"))

    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(release)
    assert [a.status_code for a in answers] == [200] * 5
    given = sorted(j for a in answers for j in a.json()["released"])
    assert given == sorted(jobs), given
    assert len(await abandoned_rows(conn)) == 1
    started = time.monotonic()
    late = await claim_raw(client, node, "five-1", wait=10)
    assert late.status_code == 204 and time.monotonic() - started < 1, (late.status_code, time.monotonic() - started)
    assert late.headers["x-request-id"] == "five-1"
    for job_id in jobs:
        events = await job_events(client, key, job_id)
        assert [e["type"] for e in events] == ["job.submitted", "job.claimed", "job.released"]
    assert await verify(conn, org_id) == []


async def test_the_prune_forgets_only_rows_past_five_minutes(client, conn, org):
    """Three ids: one abandoned 301 s ago, one 299 s ago, one now. The second look prunes the first only; the
    others still claim nothing, the first claims again."""
    _, key = org
    _, node = await online(client, key, "box")
    for request in ("old", "edge", "new"):
        assert (await release_unread(client, node, request)).status_code == 200
    await conn.execute("UPDATE abandoned_claim_requests SET abandoned_at = abandoned_at - make_interval(secs => %s)"
                       " WHERE request_id = 'old'", (ABANDONED_SECONDS + 1,))  # fmt: skip
    await conn.execute("UPDATE abandoned_claim_requests SET abandoned_at = abandoned_at - make_interval(secs => %s)"
                       " WHERE request_id = 'edge'", (ABANDONED_SECONDS - 1,))  # fmt: skip
    await sweep_once(conn, SETTINGS, reexamine=True)
    assert [r for _, r, _ in await abandoned_rows(conn)] == ["edge", "new"]
    job_id = await post_job(client, key, max_attempts=1)
    for request in ("edge", "new"):
        assert (await claim_raw(client, node, request)).status_code == 204
    taken = await claim_raw(client, node, "old")
    assert taken.status_code == 200 and taken.json()["job"]["id"] == job_id, taken.text


# -- chained claims --------------------------------------------------------------------------------------


async def test_a_completion_sent_with_an_abandoned_request_id_completes_and_chains_no_claim(client, conn, org):
    """Request ``c-1`` given up before it arrives: ``complete?claim_next=true`` with it records the completion
    and claims nothing (``next_claim`` null); so does ``POST /v1/agent/complete?claim_next=2``; a renewal and a
    plain completion with an abandoned id are not affected. The next job stays queued, never claimed."""
    org_id, key = org
    _, node = await online(client, key, "box")
    first = await post_job(client, key, max_attempts=1)
    second = await post_job(client, key, max_attempts=1)
    held = await claim_as(client, node, "fresh-a", max=2)
    assert [c["job"]["id"] for c in held["claims"]] == [first, second]
    waiting = [await post_job(client, key, max_attempts=1) for _ in range(3)]
    for request in ("c-1", "c-2", "c-3"):
        assert (await release_unread(client, node, request)).json() == {"released": []}

    renewed = await client.post(f"/v1/agent/jobs/{second}/renew", json={"attempt": 1},
                                headers={**bearer(node), "X-Request-ID": "c-3"})  # fmt: skip
    assert renewed.status_code == 200, renewed.text
    done = await client.post(f"/v1/agent/jobs/{first}/complete", params={"claim_next": "true"},
                             json={"attempt": 1, "result": {}}, headers={**bearer(node), "X-Request-ID": "c-1"})  # fmt: skip
    assert done.status_code == 200, done.text
    assert (done.json()["status"], done.json()["next_claim"]) == ("complete", None), done.json()
    report = await client.post("/v1/agent/complete", params={"claim_next": 2},
                               json={"results": [{"job_id": second, "attempt": 1, "result": {}}]},
                               headers={**bearer(node), "X-Request-ID": "c-2"})  # fmt: skip
    assert report.status_code == 200, report.text
    assert report.json()["results"][0]["status"] == 200 and report.json()["next_claims"] == [], report.json()
    for job_id in waiting:
        assert [e["type"] for e in await job_events(client, key, job_id)] == ["job.submitted"]
    taken = await claim_as(client, node, "fresh-b", max=3)
    assert [c["job"]["id"] for c in taken["claims"]] == waiting
    assert await verify(conn, org_id) == []


async def test_a_chained_claim_racing_its_requests_release_never_leaves_a_job_under_it(client, conn, org):
    """``complete?claim_next=true`` with X-Request-ID ``cr-N`` and the release of ``cr-N`` sent together, round
    after round: either the chained claim committed first and the release gave back exactly it, or it claimed
    nothing; no job stays leased under a given-up request."""
    org_id, key = org
    _, node = await online(client, key, "box")
    for round_ in range(15):
        current = await post_job(client, key, max_attempts=1)
        nxt = await post_job(client, key, max_attempts=1)
        assert (await claim_as(client, node, f"take-{round_}"))["job"]["id"] == current
        request = f"cr-{round_}"
        results: dict[str, httpx.Response] = {}

        async def complete() -> None:
            if round_ % 3 == 0:
                await anyio.sleep(0.01)
            elif round_ % 3 == 1:
                await anyio.sleep(0.003)
            results["done"] = await client.post(f"/v1/agent/jobs/{current}/complete", params={"claim_next": "true"},
                                                json={"attempt": 1, "result": {}},
                                                headers={**bearer(node), "X-Request-ID": request})  # fmt: skip

        async def release() -> None:
            results["release"] = await release_unread(client, node, request)

        async with anyio.create_task_group() as tg:
            tg.start_soon(complete)
            tg.start_soon(release)
        done, released = results["done"], results["release"].json()["released"]
        assert done.status_code == 200 and done.json()["status"] == "complete", done.text
        chained = done.json()["next_claim"]
        assert released == ([chained["job"]["id"]] if chained else []), (round_, chained, released)
        assert await running_jobs(client, key) == [], round_
        # The next one is queued: take it so that the next round starts from an empty queue.
        again = await claim_as(client, node, f"mop-{round_}")
        assert again["job"]["id"] == nxt
        assert (await client.post(f"/v1/agent/jobs/{nxt}/complete", json={"attempt": again["job"]["attempt"], "result": {}},
                                  headers=bearer(node))).status_code == 200  # fmt: skip
    assert await verify(conn, org_id) == []


# -- multi-claims and concurrency ------------------------------------------------------------------------


async def test_a_multi_claim_racing_its_requests_release_takes_all_or_nothing_and_gives_all_back(client, conn, org):
    """``claim?max=3`` and the release of its request at the same moment: it took three jobs and the release
    gave back those three, or it took none and the release gave back none."""
    org_id, key = org
    _, node = await online(client, key, "box")
    for _ in range(4):
        await post_job(client, key, max_attempts=1)
    for round_ in range(20):
        claimed, released = await claim_racing_release(client, node, f"m-{round_}", 0.001 * (round_ % 4), max=3)
        if claimed.status_code == 200:
            ids = [c["job"]["id"] for c in claimed.json()["claims"]]
            assert len(ids) == 3 and sorted(released) == sorted(ids), (round_, ids, released)
        else:
            assert released == [], (round_, released)
        assert await running_jobs(client, key) == [], round_
    assert await verify(conn, org_id) == []


async def test_many_claims_and_releases_of_other_ids_for_one_node_all_claim(client, conn, org):
    """Twelve claims (each its own id, ``wait=10``) and twelve releases of other ids of the same node, all at
    once: every claim gets a job (there are enough), no abandoned id takes one, and each id abandoned claims
    nothing afterwards."""
    org_id, key = org
    _, node = await online(client, key, "box")
    jobs = {await post_job(client, key, max_attempts=1) for _ in range(12)}
    claims_: dict[int, httpx.Response] = {}
    releases: dict[int, httpx.Response] = {}

    async def claim(i: int) -> None:
        claims_[i] = await claim_raw(client, node, f"keep-{i}", wait=10)

    async def release(i: int) -> None:
        releases[i] = await release_unread(client, node, f"gone-{i}")

    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        for i in range(12):
            tg.start_soon(claim, i)
            tg.start_soon(release, i)
    took = time.monotonic() - started
    assert all(r.status_code == 200 and r.json() == {"released": []} for r in releases.values())
    assert [r.status_code for r in claims_.values()] == [200] * 12, [(r.status_code, r.text[:60]) for r in claims_.values()]
    assert {r.json()["job"]["id"] for r in claims_.values()} == jobs
    assert took < 5, took
    await post_job(client, key, max_attempts=1)
    for i in range(12):
        assert (await claim_raw(client, node, f"gone-{i}")).status_code == 204
    assert await verify(conn, org_id) == []


async def test_a_node_sending_give_backs_back_to_back_is_refused_past_its_burst_and_the_refused_write_nothing(client, conn, org):
    """Each give-back holds the claim guard a 64th of the organization's nodes share: a node sending them back
    to back kept its neighbours' ``wait=0`` claims answering 204 with work queued. Past ``RELEASE_BURST`` (and
    the refill meanwhile) it is refused 429 ``rate_limited`` with ``Retry-After``, recording nothing; another
    node's give-backs go on."""
    _, key = org
    _, node = await online(client, key, "box")
    _, neighbour = await online(client, key, "neighbour")
    answers = []
    while len(answers) < 10 * RELEASE_BURST and (not answers or answers[-1].status_code == 200):
        answers.append(await release_unread(client, node, f"r-{len(answers)}"))
    refused = answers[-1]
    assert refused.status_code == 429 and refused.json()["error"] == "rate_limited", (len(answers), refused.text)
    assert int(refused.headers["Retry-After"]) >= 1
    allowed = len(answers) - 1
    assert allowed >= RELEASE_BURST
    assert [row[1] for row in await abandoned_rows(conn)] == sorted(f"r-{i}" for i in range(allowed))
    assert (await release_unread(client, neighbour, "n-0")).status_code == 200


# -- the claim guard: buckets and fleet changes ----------------------------------------------------------


async def _same_bucket_pair(conn, org_id) -> tuple[tuple[UUID, str], tuple[UUID, str]]:
    """Two nodes of the organization whose claim guards are the same lock (one of NODE_GUARDS buckets)."""
    by_bucket: dict[int, tuple[UUID, str]] = {}
    for i in range(NODE_GUARDS + 1):
        node = await paired(conn, org_id, f"n{i}")
        bucket = node[0].int % NODE_GUARDS
        if bucket in by_bucket:
            return by_bucket[bucket], node
        by_bucket[bucket] = node
    raise AssertionError("pigeonhole")


async def _elsewhere(conn, org_id, node_id: UUID) -> tuple[UUID, str]:
    """A node of the organization whose claim guard is not ``node_id``'s (the control)."""
    for i in range(8):
        node = await paired(conn, org_id, f"control{i}")
        if guard_key(org_id, node[0]) != guard_key(org_id, node_id):
            return node
    raise AssertionError("no node outside the bucket")


async def test_a_release_waiting_for_a_row_does_not_stall_claims_of_another_node_in_its_guard_bucket(client, conn, org, db_url):
    """Node A's release of its request waits for the row of a job that request took (held by another
    transaction for 1.5 s: an operator's cancel of a large tree, say). Node B shares A's claim guard (64 per
    organization) and has nothing to do with A's request: the release holds the guard only to record the
    abandonment, not while it gives back, so B's ``wait=0`` claim with jobs queued claims, and its ``wait=5``
    claim answers at once, not when the row is free."""
    org_id, key = org
    (a_id, a_cred), (b_id, b_cred) = await _same_bucket_pair(conn, org_id)
    assert guard_key(org_id, a_id) == guard_key(org_id, b_id)
    _, c_cred = await _elsewhere(conn, org_id, a_id)
    held_job = await post_job(client, key, max_attempts=1)
    assert (await claim_as(client, a_cred, "a-req"))["job"]["id"] == held_job
    for_b = [await post_job(client, key, max_attempts=1) for _ in range(3)]
    results: dict[str, object] = {}
    async with await psycopg.AsyncConnection.connect(db_url) as holder:
        await holder.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (held_job,))

        async def release() -> None:
            results["release"] = await release_unread(client, a_cred, "a-req")

        async def b_waits() -> None:
            started = time.monotonic()
            results["b_wait"] = await claim_raw(client, b_cred, "b-wait", wait=5)
            results["b_took"] = time.monotonic() - started

        async with anyio.create_task_group() as tg:
            tg.start_soon(release)
            await eventually(lambda: waiting_on_a_lock(conn), timeout=5)
            held_at = time.monotonic()
            results["b_now"] = await claim_raw(client, b_cred, "b-now")
            results["c_now"] = await claim_raw(client, c_cred, "c-now")  # the control: another bucket
            tg.start_soon(b_waits)
            await anyio.sleep(max(0.0, 1.5 - (time.monotonic() - held_at)))
            await holder.commit()
    assert results["release"].json() == {"released": [held_job]}, results["release"].text
    b_now, b_wait = results["b_now"], results["b_wait"]
    assert results["c_now"].status_code == 200, results["c_now"].text  # a node of another bucket claims at once
    summary = (f"B's wait=0 claim answered {b_now.status_code} with jobs queued (C's, another bucket's, "
               f"{results['c_now'].status_code}); B's wait=5 claim answered {b_wait.status_code} after "
               f"{results['b_took']:.2f}s (the row was held 1.5 s)")
    assert b_now.status_code == 200 and b_now.json()["job"]["id"] in for_b, summary
    assert b_wait.status_code == 200 and results["b_took"] < 0.5, summary


async def test_a_release_while_a_fleet_change_holds_the_guard_waits_for_it_then_records(client, conn, org, db_url):
    """A change (drain, heartbeat) holds the node's claim guard for a second: the release waits for it and
    then answers; a claim of that request sent meanwhile (``wait=5``) either claims nothing or is given back;
    no job stays leased under it, and the request claims nothing afterwards."""
    org_id, key = org
    node_id, node = await online(client, key, "box")
    await post_job(client, key, max_attempts=1)
    key_ = guard_key(org_id, UUID(node_id))
    results: dict[str, httpx.Response] = {}
    async with await psycopg.AsyncConnection.connect(db_url) as holder:
        await holder.execute("SELECT pg_advisory_xact_lock(%s, %s)", (CLAIM_GUARD_CLASS, key_))

        async def release() -> None:
            results["release"] = await release_unread(client, node, "held-1")

        async def claim() -> None:
            results["claim"] = await claim_raw(client, node, "held-1", wait=5)

        async with anyio.create_task_group() as tg:
            tg.start_soon(release)
            await eventually(lambda: waiting_on_a_lock(conn, "advisory"), timeout=5)
            tg.start_soon(claim)
            await anyio.sleep(1.0)
            assert "release" not in results and "claim" not in results
            await holder.commit()
    assert results["release"].status_code == 200, results["release"].text
    claimed, released = results["claim"], results["release"].json()["released"]
    if claimed.status_code == 200:
        assert released == [claimed.json()["job"]["id"]]
    else:
        assert claimed.status_code == 204 and released == [], (claimed.status_code, released)
    assert await running_jobs(client, key) == []
    assert (await claim_raw(client, node, "held-1")).status_code == 204


async def test_a_real_drain_and_a_release_together_leave_nothing_leased(client, conn, org):
    """A drain and a release of the node's request at once, with a claim of that request in flight: the node
    ends draining, the release answers, and no job is leased to the node."""
    org_id, key = org
    node_id, node = await online(client, key, "box")
    await post_job(client, key, max_attempts=1)
    results: dict[str, httpx.Response] = {}

    async def drain() -> None:
        results["drain"] = await client.post(f"/v1/nodes/{node_id}/drain", headers=bearer(key))

    async def release() -> None:
        results["release"] = await release_unread(client, node, "dr-1")

    async def claim() -> None:
        results["claim"] = await claim_raw(client, node, "dr-1", wait=1)

    async with anyio.create_task_group() as tg:
        tg.start_soon(claim)
        tg.start_soon(drain)
        tg.start_soon(release)
    assert results["drain"].status_code == 200, results["drain"].text
    assert results["release"].status_code == 200, results["release"].text
    assert results["claim"].status_code in (200, 204)
    if results["claim"].status_code == 200:
        assert results["release"].json()["released"] == [results["claim"].json()["job"]["id"]]
    assert await running_jobs(client, key) == []
    assert await verify(conn, org_id) == []


# -- the hub: a parked abandoned request passes its wake on ----------------------------------------------


@pytest.fixture
def slow_poll_server(db_url):
    with LiveServer(db_url, UMBRA_SWEEP_INTERVAL_SECONDS="0.2", UMBRA_POLL_FALLBACK_SECONDS="30") as server:
        yield server


async def test_a_parked_abandoned_request_passes_its_wake_to_the_next_waiter_at_once(slow_poll_server, org):
    """Node A's long-poll (parked first, so the oldest waiter) was given up; node B's is parked behind it. One
    job submitted: the hint's token goes to A's waiter, which claims nothing (204) and must hand it on: B gets
    the job at once, not at the safety poll (30 s away here)."""
    _, key = org
    async with httpx.AsyncClient(base_url=slow_poll_server.url, timeout=30) as client:
        _, a = await online(client, key, "a")
        _, b = await online(client, key, "b")
        hub = slow_poll_server.app.state.waiters
        answers: dict[str, httpx.Response] = {}
        at: dict[str, float] = {}

        async def poll(name: str, credential: str, request: str) -> None:
            answers[name] = await claim_raw(client, credential, request, wait=15)
            at[name] = time.monotonic()

        async with anyio.create_task_group() as tg:
            tg.start_soon(poll, "a", a, "pa-1")
            await until(lambda: hub.waiting() == 1)
            tg.start_soon(poll, "b", b, "pb-1")
            await until(lambda: hub.waiting() == 2)
            assert (await release_unread(client, a, "pa-1")).json() == {"released": []}
            submitted = time.monotonic()
            job_id = await post_job(client, key, max_attempts=1)
            await until(lambda: "a" in answers and "b" in answers, timeout=20)
        assert answers["a"].status_code == 204, answers["a"].text
        assert answers["b"].status_code == 200 and answers["b"].json()["job"]["id"] == job_id, answers["b"].text
        assert at["b"] - submitted < 2, at["b"] - submitted


# -- metrics ---------------------------------------------------------------------------------------------


async def test_metrics_count_an_abandoned_claim_as_gone_and_each_job_given_back_once(client, conn, org):
    """An abandoned request's claim: ``umbra_claim_wait_seconds{outcome="client_gone"}`` +1, no claim counted,
    ``claimed`` unchanged. A release that gives back two jobs: ``umbra_claims_given_back_total{answer_unread}``
    +2; the same release again and a release of nothing: +0. ``/metrics`` says the same."""
    _, key = org
    _, node = await online(client, key, "box")
    for _ in range(2):
        await post_job(client, key, max_attempts=1)
    before = (_wait_count("client_gone"), _wait_count("claimed"), _claims_counted(), _given_back("answer_unread"))
    taken = await claim_as(client, node, "mx-1", max=2)
    assert len(taken["claims"]) == 2
    assert (await release_unread(client, node, "mx-1")).json()["released"]
    assert (await release_unread(client, node, "mx-1")).json() == {"released": []}
    assert (await release_unread(client, node, "mx-2")).json() == {"released": []}
    assert (await claim_raw(client, node, "mx-2")).status_code == 204
    after = (_wait_count("client_gone"), _wait_count("claimed"), _claims_counted(), _given_back("answer_unread"))
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2], after[3] - before[3]) == (1, 1, 2, 2)
    text = (await client.get("/metrics")).text
    assert f'umbra_claims_given_back_total{{reason="answer_unread"}} {after[3]}' in text


async def test_an_abandoned_claims_transaction_is_counted_as_a_claim_attempt(client, conn, org):
    """``umbra_claim_attempts_total``: "Claim transactions run by long-polls (successful or not)". An abandoned
    request's claim runs its batch (guards, nodes read, ClaimAbandoned) as a fresh one that finds nothing does:
    each is one attempt."""
    _, key = org
    _, node = await online(client, key, "box")
    assert (await release_unread(client, node, "ca-1")).json() == {"released": []}
    before = metrics.CLAIM_ATTEMPTS._value.get()
    assert (await claim_raw(client, node, "ca-fresh")).status_code == 204  # nothing queued: one attempt
    middle = metrics.CLAIM_ATTEMPTS._value.get()
    assert (await claim_raw(client, node, "ca-1")).status_code == 204
    after = metrics.CLAIM_ATTEMPTS._value.get()
    assert (middle - before, after - middle) == (1, 1), (middle - before, after - middle)


# -- the group commit's one-by-one fallback ---------------------------------------------------------------


def _roll_back_batches_with(monkeypatch, prefix: str) -> list[int]:
    """Every batch holding a command whose request id starts with ``prefix`` fails after staging (as a
    deadlock or a string PostgreSQL cannot store would): its commands then run one by one."""
    original = batch_commands.stage
    fired: list[int] = []

    async def stage(conn, commands, **kwargs):
        staged = await original(conn, commands, **kwargs)
        if any((c.request_id or "").startswith(prefix) for c in commands):
            fired.append(len(commands))
            raise RuntimeError("batch rolled back (test)")
        return staged

    monkeypatch.setattr(batch_commands, "stage", stage)
    return fired


async def test_the_single_claim_path_refuses_an_abandoned_request_as_the_batch_does(client, conn, org, monkeypatch):
    """A batch that rolls back runs its claims alone (``claims.claim``): an abandoned request's claim (max=1
    and max=3) answers 204 and takes nothing; a fresh id claims."""
    org_id, key = org
    node_id, node = await online(client, key, "box")
    other_id, other = await online(client, key, "other")
    jobs = [await post_job(client, key, max_attempts=1) for _ in range(3)]
    for request in ("fb-1", "fb-3", "fb-r"):
        assert (await release_unread(client, node, request)).json() == {"released": []}
    assert (await release_unread(client, other, "fb-r")).json() == {"released": []}
    fallbacks = metrics.GROUP_COMMIT_FALLBACKS._value.get()
    fired = _roll_back_batches_with(monkeypatch, "fb-")
    assert (await claim_raw(client, node, "fb-1")).status_code == 204
    assert (await claim_raw(client, node, "fb-3", max=3)).status_code == 204
    assert [(await get_job(client, key, j))["status"] for j in jobs] == ["queued"] * 3
    assert (await client.post(f"/v1/nodes/{other_id}/revoke", headers=bearer(key))).status_code == 200
    revoked = await claim_raw(client, other, "fb-r")  # this process forgot the token: refused before any batch
    assert revoked.status_code == 401, (revoked.status_code, revoked.text)
    fresh = await claim_raw(client, node, "fb-fresh", max=3)
    assert fresh.status_code == 200 and [c["job"]["id"] for c in fresh.json()["claims"]] == jobs, fresh.text
    assert len(fired) >= 3 and metrics.GROUP_COMMIT_FALLBACKS._value.get() - fallbacks >= 3
    assert await verify(conn, org_id) == []


@pytest.mark.parametrize("rolled_back", [True, False])
async def test_a_batch_rolled_back_by_a_bad_completion_answers_each_claim_as_alone(db_url, conn, org, rolled_back):
    """One batch: node C's completion carrying a NUL (PostgreSQL cannot store it: the batch rolls back), node A's
    claim of a request it gave up, node B's claim of a request it gave up with a credential revoked since, and
    node D's fresh claim. Run one by one: A's is ClaimAbandoned, B's 401 (revocation first, not 204), D's claims.
    The same batch with a good completion answers the same in the batch."""
    from umbra.compute import claims
    from umbra.compute.abandoned_claims import ClaimAbandoned, abandon
    from umbra.errors import InvalidRequest, Unauthenticated

    from .queue_support import CPU64, add_node, submit
    from .test_group_commit import group_commit, in_one_batch

    org_id, _ = org
    a = await add_node(conn, org_id, "a", [CPU64])
    b_id, _ = await paired(conn, org_id, "b")
    c = await add_node(conn, org_id, "c", [CPU64])
    d = await add_node(conn, org_id, "d", [CPU64])
    held = await submit(conn, org_id)
    assert (await claims.claim(conn, node_id=c, organization_id=org_id, lease_seconds=60)).job_id == held.id
    queued = [(await submit(conn, org_id)).id for _ in range(3)]
    for node, request in ((a, "g-1"), (b_id, "g-2")):
        async with conn.transaction():
            await abandon(conn, org_id, node, request)
    [(b_credential,)] = await (await conn.execute("SELECT id FROM node_credentials WHERE node_id = %s", (b_id,))).fetchall()
    await conn.execute("UPDATE node_credentials SET revoked_at = now() WHERE id = %s", (b_credential,))
    async with group_commit(db_url) as (group, _, tg):
        abandoned, revoked_, bad, fresh = await in_one_batch(group, tg, [
            lambda: group.claim_many(node_id=a, organization_id=org_id, count=3, lease_seconds=60, stale_seconds=45,
                                     request_id="g-1"),
            lambda: group.claim_many(node_id=b_id, organization_id=org_id, count=1, lease_seconds=60, stale_seconds=45,
                                     request_id="g-2", credential_id=b_credential),
            lambda: group.complete(organization_id=org_id, node_id=c, job_id=held.id, attempt=1,
                                   result={"bad": "\u0000"} if rolled_back else {"ok": True}),
            lambda: group.claim_many(node_id=d, organization_id=org_id, count=1, lease_seconds=60, stale_seconds=45,
                                     request_id="g-3"),
        ])  # fmt: skip
    if rolled_back:
        assert group.fallbacks == 1 and isinstance(bad, InvalidRequest)
    else:
        assert group.fallbacks == 0 and group.batches == 1 and bad.status == "complete"
    assert isinstance(abandoned, ClaimAbandoned), abandoned
    assert isinstance(revoked_, Unauthenticated), revoked_
    assert [r.job_id for r in fresh] == queued[:1]
    assert await verify(conn, org_id) == []


async def test_a_fallback_multi_claim_racing_its_release_leaves_nothing_leased(client, conn, org, monkeypatch):
    """Run alone, a ``max=3`` claim is up to three transactions; its request released in between: whatever it
    committed first is given back, the rest is not claimed, and nothing stays leased under it."""
    org_id, key = org
    _, node = await online(client, key, "box")
    for _ in range(4):
        await post_job(client, key, max_attempts=1)
    _roll_back_batches_with(monkeypatch, "fm-")
    for round_ in range(12):
        claimed, released = await claim_racing_release(client, node, f"fm-{round_}", 0.002 * (round_ % 6), max=3)
        if claimed.status_code == 200:
            ids = [c["job"]["id"] for c in claimed.json()["claims"]]
            assert set(ids) >= set(released), (round_, ids, released)
        assert await running_jobs(client, key) == [], (round_, claimed.status_code, released)
    assert await verify(conn, org_id) == []


# -- two processes ---------------------------------------------------------------------------------------


async def test_claims_through_b_racing_releases_through_a_never_leave_a_job_under_a_given_up_request(conn, org, servers):
    """The claim (``max=2``) goes to B and its release to A at the same moment, round after round: either the
    claim took nothing (204) and the release nothing, or the release gave back exactly what it took."""
    org_id, key = org
    a, b = await _two(servers)
    async with httpx.AsyncClient(timeout=60) as client:
        _, node = await _pair(client, a, b, key, "box")
        for _ in range(3):
            await _submit(client, a, key, max_attempts=1)
        for round_ in range(15):
            request = f"x-{round_}"
            results: dict[str, httpx.Response] = {}

            async def claim() -> None:
                results["claim"] = await client.post(f"{b.url}/v1/agent/claim", params={"wait": 0, "max": 2},
                                                     headers={**bearer(node), "X-Request-ID": request})  # fmt: skip

            async def release() -> None:
                await anyio.sleep(0.002 * (round_ % 4))
                results["release"] = await client.post(f"{a.url}/v1/agent/claim/release", json={"request_id": request},
                                                       headers=bearer(node))  # fmt: skip

            async with anyio.create_task_group() as tg:
                tg.start_soon(claim)
                tg.start_soon(release)
            claimed, released = results["claim"], results["release"].json()["released"]
            if claimed.status_code == 200:
                assert sorted(released) == sorted(c["job"]["id"] for c in claimed.json()["claims"]), round_
            else:
                assert claimed.status_code == 204 and released == [], (round_, claimed.status_code, released)
            running = (await client.get(f"{a.url}/v1/jobs", params={"status": "running"},
                                        headers=bearer(key))).json()["jobs"]  # fmt: skip
            assert running == [], round_
        assert await verify(conn, org_id) == []
