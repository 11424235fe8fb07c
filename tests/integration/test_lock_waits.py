"""A row another session holds locked (an operator's open transaction) stalls nothing but the requests
that need it, and those only for ``LOCK_WAIT_SECONDS``.

The group commit's batch skips a held row it cannot lock and runs that command alone, beside the batches:
every other agent's claims, renewals and completions, in any organization, go on. A request that waits
for the lock longer than the pooled connections' ``lock_timeout`` is answered 503 ``database_unavailable``
(try again), changing nothing, and is done once the lock is let go. A stopping server is not held by it.
"""

from __future__ import annotations

import contextlib
import time
import uuid

import anyio
import httpx
import psycopg
import pytest

from tests.conftest import LiveServer
from tests.helpers import bearer, lock_held_for_a_second
from tests.integration.test_longpoll import online_node, submit_job
from umbra.db import LOCK_WAIT_SECONDS

pytestmark = pytest.mark.anyio

#: A request behind a lock answers within this: its lock waits, and a little more.
ANSWERED_WITHIN = 2 * LOCK_WAIT_SECONDS + 3


@contextlib.asynccontextmanager
async def row_locked(db_url: str, job_id: uuid.UUID):
    """Another session holding ``FOR UPDATE`` on one job's row until the block ends."""
    async with await psycopg.AsyncConnection.connect(db_url) as locker:
        await locker.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (job_id,))
        try:
            yield
        finally:
            await locker.rollback()


async def timed(call, limit: float) -> tuple[httpx.Response | None, float]:
    """``(answer, seconds)``; the answer is None if ``limit`` passed first."""
    started = time.monotonic()
    answer = None
    with anyio.move_on_after(limit):
        answer = await call()
    return answer, time.monotonic() - started


async def log_length(conn) -> int:
    return (await (await conn.execute("SELECT count(*) FROM events")).fetchone())[0]


def retry_later(answer: httpx.Response) -> None:
    assert answer.status_code == 503 and answer.json()["error"] == "database_unavailable", answer.text
    assert answer.headers["retry-after"] == "1"


async def test_a_locked_row_stalls_neither_another_organizations_claim_nor_a_long_polls_deadline(conn, org, db_url):
    """A completion and a renewal wait behind another session's lock on their job's row. A node of
    another organization, with work queued, is answered its job at once; an idle node of the same
    organization is answered 204 at its long-poll's deadline. Before, the batch waited on the lock, and
    every agent's command, whatever its organization, waited behind it for as long as the lock was held."""
    from umbra.compute.accounts import create_organization

    org_id, _ = org
    other_id, _ = await create_organization(conn, "other")
    with LiveServer(db_url, UMBRA_POLL_FALLBACK_SECONDS="30") as server:
        _, cred = await online_node(conn, org_id, "box")
        _, idle = await online_node(conn, org_id, "idle")
        _, other_cred = await online_node(conn, other_id, "elsewhere")
        job_id = await submit_job(conn, org_id)
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            claimed = await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(cred))
            attempt = claimed.json()["job"]["attempt"]
            other_job = await submit_job(conn, other_id)
            async with row_locked(db_url, job_id), anyio.create_task_group() as tg:
                for report in ("complete", "renew"):
                    tg.start_soon(lambda report=report: timed(lambda: client.post(
                        f"/v1/agent/jobs/{job_id}/{report}", json={"attempt": attempt, "result": {}}, headers=bearer(cred)), 15))  # fmt: skip
                await anyio.sleep(0.5)  # both are behind the lock now
                elsewhere, _ = await timed(lambda: client.post("/v1/agent/claim", params={"wait": 1}, headers=bearer(other_cred)), 4)
                parked, took = await timed(lambda: client.post("/v1/agent/claim", params={"wait": 1}, headers=bearer(idle)), 4)
                tg.cancel_scope.cancel()
    assert elsewhere is not None and elsewhere.status_code == 200, elsewhere and elsewhere.text
    assert elsewhere.json()["job"]["id"] == str(other_job)
    assert parked is not None and parked.status_code == 204 and took < 3, f"{parked} after {took:.1f} s"


async def test_a_completion_behind_a_lock_held_elsewhere_is_answered_503_and_lands_when_sent_again(conn, org, db_url):
    """The completion waits for the row for at most ``LOCK_WAIT_SECONDS``, then is answered 503
    ``database_unavailable`` with ``Retry-After``, having recorded nothing; sent again once the lock is
    let go, it lands. Before, it waited for as long as the other session held the lock."""
    org_id, _ = org
    with LiveServer(db_url, UMBRA_POLL_FALLBACK_SECONDS="30") as server:
        _, cred = await online_node(conn, org_id, "box")
        job_id = await submit_job(conn, org_id)
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            attempt = (await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(cred))).json()["job"]["attempt"]
            recorded = await log_length(conn)

            def complete():
                return client.post(f"/v1/agent/jobs/{job_id}/complete", json={"attempt": attempt, "result": {}}, headers=bearer(cred))

            async with row_locked(db_url, job_id):
                answer, took = await timed(complete, ANSWERED_WITHIN + 5)
            assert answer is not None, f"the completion got no answer in {took:.1f} s"
            retry_later(answer)
            assert took >= LOCK_WAIT_SECONDS - 0.5 and await log_length(conn) == recorded
            again = await complete()
    assert again.status_code == 200 and again.json()["status"] == "complete", again.text


async def test_cancels_behind_a_lock_held_elsewhere_are_bounded_and_leave_the_pool_to_others(conn, org, db_url):
    """Two cancels of a job whose row another session holds, on a pool of two connections: each is
    answered within its lock waits (503, nothing changed), an unrelated request meanwhile is served,
    and a cancel sent once the lock is let go cancels. Before, each held a pooled connection for as
    long as the lock was held, and every other request was answered 503."""
    org_id, key = org
    with LiveServer(db_url, UMBRA_POLL_FALLBACK_SECONDS="30", UMBRA_POOL_SIZE="2") as server:
        job_id = await submit_job(conn, org_id)
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 200
            recorded = await log_length(conn)
            cancels: list = []
            async with row_locked(db_url, job_id):
                async with anyio.create_task_group() as tg:

                    async def cancel():
                        cancels.append(await timed(lambda: client.post(f"/v1/jobs/{job_id}/cancel", headers=bearer(key)),
                                                   ANSWERED_WITHIN + 5))  # fmt: skip

                    tg.start_soon(cancel)
                    tg.start_soon(cancel)
                    await anyio.sleep(LOCK_WAIT_SECONDS + 1)  # one of them has given up on the lock by now
                    listing = await client.get("/v1/jobs", headers=bearer(key))
            assert listing.status_code == 200, listing.text
            assert all(answer is not None for answer, _ in cancels), [round(t, 1) for _, t in cancels]
            for answer, _ in cancels:
                retry_later(answer)
            assert await log_length(conn) == recorded
            cancelled = await client.post(f"/v1/jobs/{job_id}/cancel", headers=bearer(key))
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text


async def test_a_childs_completion_whose_parent_is_held_elsewhere_holds_up_no_other_writer(conn, org, db_url):
    """The last child of a parent completes while another session holds the parent's row. Settling the
    parent locked it after the child's event was appended, holding the log's ordering lock: every
    submission and every agent's command waited behind it. Now the parent is locked before the append:
    a submission and another node's claim are answered at once, the completion is answered 503 after
    its lock wait (nothing changed), and sent again once the parent is let go, it lands and settles it."""
    from umbra.compute import claims
    from umbra.compute.claims import ChildRequest

    org_id, key = org
    with LiveServer(db_url, UMBRA_POLL_FALLBACK_SECONDS="30") as server:
        node, cred = await online_node(conn, org_id, "box")
        _, other = await online_node(conn, org_id, "other")
        parent = await submit_job(conn, org_id)
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            claimed = await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(cred))
            assert claimed.json()["job"]["id"] == str(parent), claimed.text
            [child] = await claims.add_children(conn, organization_id=org_id, node_id=node, job_id=parent, attempt=1,
                                                children=[ChildRequest(kind="part")])  # fmt: skip
            claimed = await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(cred))
            assert claimed.json()["job"]["id"] == str(child.id), claimed.text
            recorded = await log_length(conn)

            def complete():
                return client.post(f"/v1/agent/jobs/{child.id}/complete", json={"attempt": 1, "result": {}}, headers=bearer(cred))

            async with row_locked(db_url, parent), anyio.create_task_group() as tg:
                answers: dict = {}

                async def completion():
                    answers["complete"] = await timed(complete, ANSWERED_WITHIN + 5)

                tg.start_soon(completion)
                await anyio.sleep(0.5)  # the completion waits for the parent now
                submitted, took_submit = await timed(lambda: client.post("/v1/jobs", json={"kind": "echo"}, headers=bearer(key)), 3)
                elsewhere, took_claim = await timed(lambda: client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(other)), 3)
            assert submitted is not None and submitted.status_code == 201, f"the submission waited {took_submit:.1f} s"
            assert elsewhere is not None and elsewhere.status_code == 200, f"the other node's claim waited {took_claim:.1f} s"
            answer, _ = answers["complete"]
            assert answer is not None
            retry_later(answer)
            assert await log_length(conn) == recorded + 2  # the submission and its claim only
            again = await complete()
            assert again.status_code == 200 and again.json()["status"] == "complete", again.text
            settled = await client.get(f"/v1/jobs/{parent}", headers=bearer(key))
    assert settled.json()["status"] == "complete", settled.text


async def test_a_grandchilds_completion_whose_grandparent_is_held_elsewhere_holds_up_no_other_writer(live_server, conn, org, db_url):
    """A grandchild's completion settles its parent, which settles the grandparent: every ancestor is
    locked before the append, not only the parent, so a submission is answered while another session
    holds the grandparent's row."""
    from umbra.compute import claims
    from umbra.compute.claims import ChildRequest

    from .test_repeated_reports import claim, paired
    from .queue_support import submit

    org_id, key = org
    node, credential = await paired(conn, org_id, "a")
    grand = await submit(conn, org_id)
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as http:
        await claim(http, credential, grand.id)
        [parent] = await claims.add_children(conn, organization_id=org_id, node_id=node, job_id=grand.id, attempt=1,
                                             children=[ChildRequest(kind="part")])  # fmt: skip
        await claim(http, credential, parent.id)
        [child] = await claims.add_children(conn, organization_id=org_id, node_id=node, job_id=parent.id, attempt=1,
                                            children=[ChildRequest(kind="part")])  # fmt: skip
        await claim(http, credential, child.id)

        def complete():
            return http.post(f"/v1/agent/jobs/{child.id}/complete", json={"attempt": 1, "result": {}}, headers=bearer(credential))

        answers: dict = {}
        async with row_locked(db_url, grand.id), anyio.create_task_group() as tg:

            async def completion():
                answers["complete"] = await timed(complete, ANSWERED_WITHIN + 5)

            tg.start_soon(completion)
            await anyio.sleep(0.5)
            submitted, took = await timed(lambda: http.post("/v1/jobs", json={"kind": "echo"}, headers=bearer(key)), 3)
        assert submitted is not None and submitted.status_code == 201, f"a submission waited {took:.1f} s"
        retry_later(answers["complete"][0])
        again = await complete()
        assert again.status_code == 200, again.text
        settled = (await http.get(f"/v1/jobs/{grand.id}", headers=bearer(key))).json()
    assert settled["status"] == "complete", settled


async def test_commands_waiting_for_rows_held_elsewhere_leave_the_pool_to_everyone_else(conn, org, db_url):
    """Another session holds the rows of the twelve jobs an agent runs. Its renewals, set aside by the
    batches, wait for their rows a few at a time (a quarter of the pool), each holding a connection:
    an agent of another organization is answered its job at once, and the renewals all land once the
    rows are let go."""
    from umbra.compute.accounts import create_organization

    from .test_repeated_reports import paired
    from .queue_support import submit

    org_id, _ = org
    other_id, _ = await create_organization(conn, "other")
    running = 12
    with LiveServer(db_url, UMBRA_POLL_FALLBACK_SECONDS="30") as server:
        node, credential = await paired(conn, org_id, "busy")
        _, other_cred = await paired(conn, other_id, "elsewhere")
        for _ in range(running):
            await submit(conn, org_id)
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            taken = await http.post(f"/v1/agent/claim?wait=0&max={running}", headers=bearer(credential))
            jobs = [c["job"] for c in taken.json()["claims"]]
            assert len(jobs) == running, taken.text
            other_job = await submit(conn, other_id)
            renewed: list = []
            async with await psycopg.AsyncConnection.connect(db_url) as locker:
                await locker.execute("SELECT 1 FROM jobs WHERE lease_owner = %s FOR UPDATE", (node,))
                async with anyio.create_task_group() as tg:

                    async def renew(job) -> None:
                        renewed.append(await http.post(f"/v1/agent/jobs/{job['id']}/renew", json={"attempt": job["attempt"]},
                                                       headers=bearer(credential)))  # fmt: skip

                    for job in jobs:
                        tg.start_soon(renew, job)
                    await anyio.sleep(0.7)  # every renewal is set aside by now
                    elsewhere, took = await timed(lambda: http.post("/v1/agent/claim?wait=0", headers=bearer(other_cred)), 15)
                    await locker.rollback()
            answers = renewed
    assert elsewhere is not None and elsewhere.status_code == 200 and took < 2, f"{elsewhere} after {took:.1f} s"
    assert elsewhere.json()["job"]["id"] == str(other_job.id)
    assert [a.status_code for a in answers] == [200] * running, [a.text for a in answers if a.status_code != 200]


async def test_a_completion_made_beside_the_batches_claims_nothing_next(live_server, conn, org, db_url):
    """``complete?claim_next`` whose row another session held for a moment is made alone, beside the
    batches: it claims nothing (``next_claim: null``), since a claim in a transaction of its own could
    not be answered again to the same request sent again, and nothing is left leased to the node. The
    agent long-polls and gets the next job."""
    from .test_repeated_reports import claim, paired, running_on
    from .queue_support import submit

    org_id, _ = org
    node, credential = await paired(conn, org_id, "a")
    a = await submit(conn, org_id)
    b = await submit(conn, org_id)
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as http:
        attempt = await claim(http, credential, a.id)
        path = f"/v1/agent/jobs/{a.id}/complete?claim_next=true"
        answers: list = []
        async def send() -> None:
            answers.append(await http.post(path, headers=bearer(credential), json={"attempt": attempt, "result": {}}))

        async with anyio.create_task_group() as tg:
            async with row_locked(db_url, a.id):
                tg.start_soon(send)
                await anyio.sleep(1.0)  # the batch set it aside: it waits for A's row
        [first] = answers
        assert first.status_code == 200 and first.json()["status"] == "complete", first.text
        assert first.json()["next_claim"] is None and await running_on(conn, node) == []
        again = await http.post(path, headers=bearer(credential), json={"attempt": attempt, "result": {}})
        assert again.status_code == 200 and again.json()["next_claim"] is None, again.text
        await claim(http, credential, b.id)  # asserts it claims B


async def test_the_services_own_locks_are_waited_for_past_the_bound_which_then_holds_again(db_url, monkeypatch):
    """An advisory lock of the service's (the log's order, idempotency keys, a fleet change, a node's
    claims) is only taken by its own transactions, and under a burst of large submissions the queue for
    it is longer than the bound for rows: it is waited for up to ``SERVICE_LOCK_WAIT_SECONDS``, then
    given up on too. Once it is held, the bound holds again for the rest of the transaction: a row
    held elsewhere is still given up on."""
    from umbra import db
    from umbra.db import service_lock_wait

    async with lock_held_for_a_second(db_url, "SELECT pg_advisory_xact_lock(7, 7)") as (waiter, holder):
        with anyio.fail_after(10):
            await waiter.execute(service_lock_wait("SELECT pg_advisory_xact_lock(%s, %s)"), (7, 7))
        assert (await (await waiter.execute("SHOW lock_timeout")).fetchone())[0] == "300ms"
        await holder.execute("SELECT pg_advisory_xact_lock(8, 8)")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            await waiter.execute("SELECT pg_advisory_xact_lock(8, 8)")  # the bound is back in this transaction
        await waiter.rollback()
        monkeypatch.setattr(db, "SERVICE_LOCK_WAIT_SECONDS", 1)
        started = time.monotonic()
        with pytest.raises(psycopg.errors.LockNotAvailable):  # still bounded, at its own bound
            await waiter.execute(db.service_lock_wait("SELECT pg_advisory_xact_lock(%s, %s)"), (8, 8))
        assert 0.9 <= time.monotonic() - started < 5
        await waiter.rollback()
        await holder.rollback()


@pytest.fixture
def serve_process(db_url, tmp_path):
    from tests.integration.test_outages import Serve

    started: list = []

    def start(**env: str):
        server = Serve(db_url, tmp_path / f"serve-{len(started)}.log", UMBRA_LOG_LEVEL="WARNING", **env)
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()


async def test_sigterm_ends_the_server_while_a_completion_waits_for_a_lock_held_elsewhere(serve_process, org, db_url):
    """`umbra serve` stops within its graceful bound while a completion waits behind another session's
    row lock. Before, the batch waiting on the lock was shielded, and the process waited with it."""
    from tests.integration.test_outages import pair_node

    _, key = org
    server = serve_process(UMBRA_POLL_FALLBACK_SECONDS="30")
    await server.ready()
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        node = await pair_node(client, server.url, key, "box")
        job = (await client.post("/v1/jobs", json={"kind": "echo"}, headers=bearer(key))).json()
        claimed = await client.post("/v1/agent/claim", params={"wait": 5}, headers=bearer(node["credential"]))
        attempt = claimed.json()["job"]["attempt"]
        async with row_locked(db_url, uuid.UUID(job["id"])), anyio.create_task_group() as tg:

            async def complete():
                with anyio.move_on_after(30), contextlib.suppress(httpx.HTTPError):
                    await client.post(f"/v1/agent/jobs/{job['id']}/complete",
                                      json={"attempt": attempt, "result": {}}, headers=bearer(node["credential"]))  # fmt: skip

            tg.start_soon(complete)
            await anyio.sleep(0.5)
            took, code = await anyio.to_thread.run_sync(lambda: server.signal_and_wait(timeout=20))
            tg.cancel_scope.cancel()
    assert code is not None, f"`umbra serve` still running {took:.0f} s after SIGTERM"
