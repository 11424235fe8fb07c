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
from tests.helpers import bearer
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
