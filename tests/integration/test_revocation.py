"""Revoking a node ends the leases it holds, in the revocation's own transaction.

Revoking a node (``POST /v1/nodes/{id}/revoke``, ``credentials.revoke_node``) ends the leases of the jobs
it holds when it answers (``job.lease_expired``, ``cause: node_revoked``): uncharged, requeued, claimable
by another node at once, or blocked when only that node could run them. All of it lands or none of it
does. Checked against in-flight reports, the sweeper, containers, cancelled jobs, concurrent
revocations, the log's replays and verify, long-polls, explain and the CLI.
"""

from __future__ import annotations

import json
import time
from uuid import UUID

import anyio
import httpx
import psycopg
import pytest

from tests.conftest import LiveServer
from tests.helpers import bearer, eventually, generic_plans, index_names
from umbra.compute import claims, credentials
from umbra.compute.sweeper import sweep_once
from umbra.events import store
from umbra.projections import jobs as queue
from umbra.projections.verify import verify
from umbra.settings import load_settings

from .queue_support import CPU64, add_node, set_clock, submit
from .test_nodes_api import CPU, GPU, footprint, pair

pytestmark = pytest.mark.anyio

REVOKED_ERROR = "lease ended: the holding node's credentials were revoked"
EXPIRED_ERROR = "lease expired: the holding node stopped renewing"
SETTINGS = load_settings({})


async def online(client, key: str, name: str, devices=(CPU,)) -> tuple[str, str]:
    """A node paired and heartbeated online over HTTP: ``(node_id, credential)``."""
    node_id, credential = await pair(client, key, name=name, devices=devices)
    beat = await client.post("/v1/agent/heartbeat", json={"devices": list(devices)}, headers=bearer(credential))
    assert beat.status_code == 200, beat.text
    return node_id, credential


async def post_job(client, key: str, **body) -> str:
    made = await client.post("/v1/jobs", json={"kind": "echo", **body}, headers=bearer(key))
    assert made.status_code in (200, 201), made.text
    return made.json()["id"]


async def claim_now(client, credential: str) -> dict:
    taken = await client.post("/v1/agent/claim?wait=0", headers=bearer(credential))
    assert taken.status_code == 200, (taken.status_code, taken.text)
    return taken.json()["job"]


async def get_job(client, key: str, job_id: str, **params) -> dict:
    got = await client.get(f"/v1/jobs/{job_id}", params=params, headers=bearer(key))
    assert got.status_code == 200, got.text
    return got.json()


async def job_events(client, key: str, job_id: str) -> list[dict]:
    return (await client.get(f"/v1/jobs/{job_id}/events", headers=bearer(key))).json()["events"]


async def lock_waiters(conn) -> int:
    row = await (await conn.execute(
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
        "WHERE NOT l.granted AND a.datname = current_database()")).fetchone()  # fmt: skip
    return row[0]


async def test_a_revocation_that_cannot_end_a_lease_changes_nothing_and_sent_again_does_all_of_it(client, conn, org, db_url):
    """The credentials and the leases change in one transaction: a revocation that cannot lock a job the
    node holds (an operator's session holds its row past the lock timeout) is answered 503 and changes
    nothing (the credential still works); sent again, it revokes and ends the lease. Two transactions left
    the credentials revoked and the job leased to a node that can never report, and the second revoke,
    finding no live credential, ended nothing."""
    org_id, key = org
    node_id, credential = await online(client, key, "lost-box")
    await online(client, key, "spare-box")
    job_id = await post_job(client, key)
    assert (await claim_now(client, credential))["id"] == job_id
    before = await footprint(conn)

    async with await psycopg.AsyncConnection.connect(db_url) as holder:  # an operator's open transaction
        await holder.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (job_id,))
        first = await client.post(f"/v1/nodes/{node_id}/revoke", headers=bearer(key))  # waits out lock_timeout (5 s)
        await holder.rollback()
    assert first.status_code == 503 and first.json()["error"] == "database_unavailable", first.text
    assert await footprint(conn) == before
    assert (await client.post("/v1/agent/claim?wait=0", headers=bearer(credential))).status_code == 204  # still live
    second = await client.post(f"/v1/nodes/{node_id}/revoke", headers=bearer(key))
    assert second.status_code == 200, second.text
    job = await get_job(client, key, job_id)
    assert (job["status"], job["lease_owner"], job["error"]) == ("queued", None, REVOKED_ERROR)
    assert (await client.post("/v1/agent/claim?wait=0", headers=bearer(credential))).status_code == 401
    assert await verify(conn, org_id) == []


async def test_a_revocation_ends_a_childs_lease_at_once_while_an_operator_holds_its_container(client, conn, org, db_url):
    """A requeue settles no parent, so ending a child's lease waits for no ancestor: the revocation answers
    at once while an operator's session holds the child's container, and the child is back in the queue."""
    _, key = org
    node_id, credential = await online(client, key, "lost-box")
    await online(client, key, "spare-box")
    parent_id = await post_job(client, key, kind="split")
    parent = await claim_now(client, credential)
    made = await client.post(f"/v1/agent/jobs/{parent_id}/children",
                             json={"attempt": parent["attempt"], "children": [{"kind": "part"}]}, headers=bearer(credential))  # fmt: skip
    assert made.status_code == 201, made.text
    child = await claim_now(client, credential)

    async with await psycopg.AsyncConnection.connect(db_url) as holder:
        await holder.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (parent_id,))
        with anyio.fail_after(3):  # well inside the 5 s lock timeout: it waited for nothing
            revoked = await client.post(f"/v1/nodes/{node_id}/revoke", headers=bearer(key))
        await holder.rollback()
    assert revoked.status_code == 200, revoked.text
    job = await get_job(client, key, child["id"])
    assert (job["status"], job["lease_owner"], job["error"]) == ("queued", None, REVOKED_ERROR)


async def test_a_requeued_job_only_the_revoked_node_could_run_is_blocked_at_once(client, org):
    """API.md: a revoked node reads retired and "work only it could run is blocked at once". That must hold
    for the jobs its revocation returns to the queue too, not only for those that were already waiting: a
    cuda job the revoked node held, with no other node able to run it, must read ``blocked`` when the
    revocation answers, as its queued twin does, not ``queued`` looking alive until the sweeper's next
    re-examination (up to 30 s later): the re-examination follows the leases' end."""
    _, key = org
    gpu_id, gpu_credential = await online(client, key, "gpu-box", devices=(GPU, CPU))
    await online(client, key, "cpu-box", devices=(CPU,))
    held = await post_job(client, key, requires={"accelerators": ["cuda"]})
    assert (await claim_now(client, gpu_credential))["id"] == held
    waiting = await post_job(client, key, requires={"accelerators": ["cuda"]})

    assert (await client.post(f"/v1/nodes/{gpu_id}/revoke", headers=bearer(key))).status_code == 200
    twin = await get_job(client, key, waiting)
    requeued = await get_job(client, key, held)
    assert twin["status"] == "blocked"  # the job that was waiting is blocked at once
    assert requeued["status"] == "blocked", (
        f"the job the revoked node held reads {requeued['status']!r} (error {requeued['error']!r}) while its "
        f"twin reads blocked ({twin.get('blocked_reason')!r}): nothing can ever run it")


async def test_a_lease_that_had_already_run_out_when_its_node_was_revoked_is_charged_as_an_expiry(conn, org):
    """SPEC: an expired lease is charged (the job fails when its attempts are spent) so a job that kills
    every node that takes it still ends. A lease that had already run out before the administrator revoked
    the (dead) node was not ended by the revocation: it is judged as the expiry it is, whichever of the
    sweeper and the revocation reaches it first, not as an uncharged ``node_revoked`` end. (Here the
    sweeper has not yet run its tick; had it, the job would have failed.)"""
    org_id, _ = org
    node = await add_node(conn, org_id, "dead-box", [CPU64])
    job = await submit(conn, org_id, max_attempts=1)
    assert (await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=30)).attempt == 1
    await set_clock(conn, 45)  # the lease ran out 15 s ago; the node died with the job
    await credentials.revoke_node(conn, org_id, node, actor="admin")
    row = await queue.load(conn, job.id, org_id)
    [*_, ended] = await store.read_stream(conn, store.job_stream(job.id))
    assert ended.type == "job.lease_expired"
    assert (ended.event.cause, row.status, row.error) == ("expired", "failed", EXPIRED_ERROR), (
        f"a lease that expired before the revocation was ended as {ended.event.cause!r}: the job reads "
        f"{row.status!r} ({row.error!r}) and its run is not charged; a sweep a moment earlier would have failed it")


@pytest.mark.parametrize("first", ["completion", "revocation"])
async def test_a_completion_in_flight_and_the_revocation_never_both_land(client, conn, org, db_url, first):
    """A completion and the revocation both waiting on the job's row: exactly one of them ends the attempt,
    the first in line. Either the job is complete and no lease_expired follows, or the completion is
    refused (401, or 409 when it passed its credential check before the revocation committed) and the job
    is requeued; the log, the row and verify agree."""
    org_id, key = org
    node_id, credential = await online(client, key, "racing-box")
    await online(client, key, "spare-box")
    job_id = await post_job(client, key, max_attempts=1)
    claimed = await claim_now(client, credential)
    answers: dict[str, int] = {}

    async def complete() -> None:
        done = await client.post(f"/v1/agent/jobs/{job_id}/complete", json={"attempt": claimed["attempt"], "result": {"ok": 1}},
                                 headers=bearer(credential))  # fmt: skip
        answers["complete"] = done.status_code

    async def revoke() -> None:
        answers["revoke"] = (await client.post(f"/v1/nodes/{node_id}/revoke", headers=bearer(key))).status_code

    async with await psycopg.AsyncConnection.connect(db_url) as holder:
        await holder.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (job_id,))
        async with anyio.create_task_group() as tg:
            steps = [complete, revoke] if first == "completion" else [revoke, complete]
            tg.start_soon(steps[0])
            await eventually(lambda: _at_least(conn, 1))
            tg.start_soon(steps[1])
            await eventually(lambda: _at_least(conn, 2))  # both wait for the row
            await holder.rollback()
    job = await get_job(client, key, job_id)
    types = [e["type"] for e in await job_events(client, key, job_id)]
    assert answers["revoke"] == 200
    if answers["complete"] == 200:
        assert job["status"] == "complete" and "job.lease_expired" not in types, (job["status"], types)
    else:
        assert answers["complete"] in (401, 409), answers
        assert (job["status"], job["error"]) == ("queued", REVOKED_ERROR) and "job.completed" not in types, types
    # The first in line for the row wins.
    assert answers["complete"] == 200 if first == "completion" else answers["complete"] in (401, 409)
    late = await client.post(f"/v1/agent/jobs/{job_id}/complete", json={"attempt": claimed["attempt"], "result": {}},
                             headers=bearer(credential))  # fmt: skip
    assert late.status_code == 401
    assert await verify(conn, org_id) == []


async def _at_least(conn, n: int) -> bool:
    return await lock_waiters(conn) >= n


async def test_the_sweeper_and_a_revocation_racing_on_one_lease_end_it_once(db_url, org):
    """The sweeper expiring a lease and the revocation ending it at the same moment: one ``job.lease_expired``
    for the attempt, whichever wins, and the projection agrees with the log."""
    org_id, _ = org
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as a, \
            await psycopg.AsyncConnection.connect(db_url, autocommit=True) as b:  # fmt: skip
        node = await add_node(a, org_id, "box", [CPU64])
        await add_node(a, org_id, "spare", [CPU64])  # the job stays runnable: queued, not blocked
        job = await submit(a, org_id, max_attempts=3)
        await claims.claim(a, node_id=node, organization_id=org_id, lease_seconds=30)
        await set_clock(a, 31)
        await set_clock(b, 31)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sweep_once, a, SETTINGS)
            tg.start_soon(lambda: credentials.revoke_node(b, org_id, node, actor="admin"))
        recorded = await store.read_stream(a, store.job_stream(job.id))
        ended = [r for r in recorded if r.type == "job.lease_expired"]
        assert len(ended) == 1 and ended[0].event.attempt == 1
        row = await queue.load(a, job.id, org_id)
        assert (row.status, row.lease_owner) == ("queued", None)
        assert await verify(a, org_id) == []


async def test_a_decomposed_container_is_left_alone_and_its_childrens_revoked_runs_settle_it(client, conn, org):
    """A container the revoked node split holds no lease: the revocation appends nothing to it. A child the
    node held goes back to the queue uncharged; once another node completes every child, the parent
    settles complete, and verify agrees."""
    org_id, key = org
    lost_id, lost = await online(client, key, "lost-box")
    _, spare = await online(client, key, "spare-box")
    parent_id = await post_job(client, key, kind="split", max_attempts=1)
    parent = await claim_now(client, lost)
    made = await client.post(f"/v1/agent/jobs/{parent_id}/children",
                             json={"attempt": parent["attempt"], "children": [{"kind": "part", "max_attempts": 1}] * 2},
                             headers=bearer(lost))  # fmt: skip
    assert made.status_code == 201, made.text
    child = await claim_now(client, lost)
    parent_events = len(await job_events(client, key, parent_id))

    assert (await client.post(f"/v1/nodes/{lost_id}/revoke", headers=bearer(key))).status_code == 200
    assert len(await job_events(client, key, parent_id)) == parent_events
    assert (await get_job(client, key, parent_id))["status"] == "running"
    requeued = await get_job(client, key, child["id"])
    assert (requeued["status"], requeued["error"]) == ("queued", REVOKED_ERROR)
    for _ in range(2):
        taken = await claim_now(client, spare)
        done = await client.post(f"/v1/agent/jobs/{taken['id']}/complete", json={"attempt": taken["attempt"], "result": {}},
                                 headers=bearer(spare))  # fmt: skip
        assert done.status_code == 200, done.text
    assert (await get_job(client, key, parent_id))["status"] == "complete"
    assert await verify(conn, org_id) == []


async def test_a_cancelled_job_the_revoked_node_still_runs_stays_cancelled(client, conn, org):
    """A job cancelled while its node ran it is not the node's lease any more: the revocation appends nothing
    to it and it stays cancelled (not requeued)."""
    org_id, key = org
    node_id, credential = await online(client, key, "box")
    job_id = await post_job(client, key)
    await claim_now(client, credential)
    assert (await client.post(f"/v1/jobs/{job_id}/cancel", headers=bearer(key))).status_code == 200
    before = await job_events(client, key, job_id)
    assert (await client.post(f"/v1/nodes/{node_id}/revoke", headers=bearer(key))).status_code == 200
    assert await job_events(client, key, job_id) == before
    assert (await get_job(client, key, job_id))["status"] == "cancelled"
    assert await verify(conn, org_id) == []


async def test_two_revocations_at_once_end_each_lease_once(client, conn, org):
    """Two administrators revoking one node at the same moment: both are answered 200, and each job it held
    gets exactly one ``job.lease_expired`` (node_revoked)."""
    org_id, key = org
    node_id, credential = await online(client, key, "box")
    await online(client, key, "spare-box")
    held = [await post_job(client, key) for _ in range(3)]
    for _ in held:
        await claim_now(client, credential)
    answers = []

    async def revoke() -> None:
        answers.append((await client.post(f"/v1/nodes/{node_id}/revoke", headers=bearer(key))).status_code)

    async with anyio.create_task_group() as tg:
        for _ in range(2):
            tg.start_soon(revoke)
    assert answers == [200, 200]
    for job_id in held:
        ended = [e for e in await job_events(client, key, job_id) if e["type"] == "job.lease_expired"]
        assert [e["data"]["cause"] for e in ended] == ["node_revoked"]
        assert (await get_job(client, key, job_id))["status"] == "queued"
    assert await verify(conn, org_id) == []


async def test_a_node_with_two_credentials_is_revoked_whole_and_its_leases_end_once(client, conn, org):
    """A node holding two live credentials: the revocation refuses both, and ends each lease once."""
    org_id, key = org
    node_id, credential = await online(client, key, "box")
    second = await credentials.mint_node_credential()
    await credentials.store_node_credential(conn, second, node_id=UUID(node_id), organization_id=org_id)
    job_id = await post_job(client, key)
    assert (await claim_now(client, second.token))["id"] == job_id

    revoked = await client.post(f"/v1/nodes/{node_id}/revoke", headers=bearer(key))
    assert revoked.status_code == 200 and revoked.json()["status"] == "retired"
    for token in (credential, second.token):
        assert (await client.post("/v1/agent/claim?wait=0", headers=bearer(token))).status_code == 401
    node_events = (await client.get(f"/v1/nodes/{node_id}/events", headers=bearer(key))).json()["events"]
    assert sum(e["type"] == "node.revoked" for e in node_events) == 2
    ended = [e for e in await job_events(client, key, job_id) if e["type"] == "job.lease_expired"]
    assert len(ended) == 1 and ended[0]["data"]["cause"] == "node_revoked"


async def test_a_revocation_finds_the_node_s_live_credentials_by_index_not_by_reading_every_credential(conn, org):
    """Credentials are kept for ever, revoked ones too: the revocation's look-up by node id read them all, of
    every organization (no index of node_id). It reads ``node_credentials_live_by_node`` (migration 0053), and
    still revokes exactly the node's live credentials, and no other node's."""
    org_id, _ = org
    revoked, kept = await add_node(conn, org_id, "gone", [CPU64]), await add_node(conn, org_id, "kept", [CPU64])
    second = await credentials.mint_node_credential()
    await credentials.store_node_credential(conn, second, node_id=revoked, organization_id=org_id)
    outcome: list = []

    async def revoke() -> None:
        outcome.append(await credentials.revoke_node(conn, org_id, revoked, actor="admin"))

    for plan in await generic_plans(conn, revoke, table="node_credentials"):
        assert "node_credentials_live_by_node" in index_names(plan), plan
    live = await (await conn.execute("SELECT node_id, count(*) FROM node_credentials WHERE revoked_at IS NULL"
                                     " GROUP BY node_id")).fetchall()  # fmt: skip
    assert len(outcome[0][1]) == 2 and dict(live) == {kept: 1}


async def test_the_log_replays_and_verify_agree_after_a_revocation_and_explain_counts_the_uncharged_run(client, conn, org):
    """``GET /v1/jobs/{id}?as_of=P`` replays the job as it stood before and after the revocation's event;
    verify finds no difference; and explain of the job running again elsewhere says its revoked run was not
    charged."""
    org_id, key = org
    lost_id, lost = await online(client, key, "lost-box")
    _, spare = await online(client, key, "spare-box")
    job_id = await post_job(client, key, max_attempts=2)
    await claim_now(client, lost)

    assert (await client.post(f"/v1/nodes/{lost_id}/revoke", headers=bearer(key))).status_code == 200
    events = await job_events(client, key, job_id)
    ended = events[-1]
    assert ended["type"] == "job.lease_expired" and ended["data"]["cause"] == "node_revoked"
    before = await get_job(client, key, job_id, as_of=ended["position"] - 1)
    after = await get_job(client, key, job_id, as_of=ended["position"])
    assert (before["status"], before["lease_owner"]) == ("running", lost_id)
    assert (after["status"], after["lease_owner"], after["error"]) == ("queued", None, REVOKED_ERROR)
    assert await verify(conn, org_id) == []
    waiting = (await client.get(f"/v1/jobs/{job_id}/explain", headers=bearer(key))).json()["summary"]
    assert "spare-box" in waiting and "not due" not in waiting, waiting  # claimable now, by the spare node

    again = await claim_now(client, spare)
    assert (again["id"], again["attempt"]) == (job_id, 2)
    said = (await client.get(f"/v1/jobs/{job_id}/explain", headers=bearer(key))).json()["summary"]
    assert "attempt 2 (run 1 of 2; 1 earlier claim not charged)" in said, said
    assert await verify(conn, org_id) == []


async def test_an_old_lease_expiry_without_a_cause_folds_and_is_charged_as_before(client, conn, org):
    """Events written before ``cause`` existed (``job.lease_expired`` without it) read as ``expired``: the
    replayed job says the lease expired, and the run is charged (not counted among the uncharged claims)."""
    org_id, key = org
    node_id, credential = await online(client, key, "box")
    job_id = await post_job(client, key)
    claimed = await claim_now(client, credential)
    [(version,)] = await (await conn.execute(
        "SELECT max(version) FROM events WHERE stream = %s", (store.job_stream(UUID(job_id)),))).fetchall()
    old = {"type": "job.lease_expired", "attempt": claimed["attempt"], "node_id": node_id, "requeued": True,
           "not_before": "2026-01-01T00:00:00Z"}  # fmt: skip
    await conn.execute(
        "INSERT INTO events (stream, version, type, organization_id, data) VALUES (%s, %s, %s, %s, %s::jsonb)",
        (store.job_stream(UUID(job_id)), version + 1, "job.lease_expired", org_id, json.dumps(old)))  # fmt: skip
    [(position,)] = await (await conn.execute("SELECT max(position) FROM events")).fetchall()
    replayed = await get_job(client, key, job_id, as_of=position)
    assert (replayed["status"], replayed["error"], replayed["lease_owner"]) == ("queued", EXPIRED_ERROR, None)
    assert await claims.uncharged_claims(conn, [UUID(job_id)]) == {}
    [*_, read] = await store.read_stream(conn, store.job_stream(UUID(job_id)))
    assert read.event.cause == "expired"


async def test_another_nodes_long_poll_gets_the_revoked_nodes_job_at_once(db_url, org):
    """A node parked in a long-poll (``claim?wait=20``) is handed the revoked node's job as soon as the
    revocation answers, by the revocation's own hint (the sweeper, which would also announce the job once
    due, is made to tick only every 60 s here), not at its deadline."""
    _, key = org
    with LiveServer(db_url, UMBRA_SWEEP_INTERVAL_SECONDS="60") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            lost_id, lost = await online(client, key, "lost-box")
            _, spare = await online(client, key, "spare-box")
            job_id = await post_job(client, key)
            await claim_now(client, lost)
            got: dict = {}

            async def park() -> None:
                answer = await client.post("/v1/agent/claim?wait=20", headers=bearer(spare))
                got["answer"], got["at"] = answer, time.monotonic()

            async with anyio.create_task_group() as tg:
                tg.start_soon(park)
                await anyio.sleep(1.0)  # parked
                assert "answer" not in got
                revoked_at = time.monotonic()
                assert (await client.post(f"/v1/nodes/{lost_id}/revoke", headers=bearer(key))).status_code == 200
    assert got["answer"].status_code == 200 and got["answer"].json()["job"]["id"] == job_id
    assert got["at"] - revoked_at < 1.5, got["at"] - revoked_at


async def test_the_cli_revoke_ends_the_leases_too(cli, client, conn, org):
    """``umbra admin revoke`` is the same command as the route: the node's jobs go back to the queue at once."""
    org_id, key = org
    node_id, credential = await online(client, key, "box")
    await online(client, key, "spare-box")
    job_id = await post_job(client, key)
    await claim_now(client, credential)
    status, out, err = await cli("admin", "revoke", "--org", str(org_id), node_id, "--json")
    assert status == 0, err
    assert len(json.loads(out)["revoked_credentials"]) == 1
    job = await get_job(client, key, job_id)
    assert (job["status"], job["lease_owner"], job["error"]) == ("queued", None, REVOKED_ERROR)
    ended = (await job_events(client, key, job_id))[-1]
    assert (ended["type"], ended["data"]["cause"]) == ("job.lease_expired", "node_revoked")
    assert await verify(conn, org_id) == []


async def test_a_job_revoked_then_expired_elsewhere_then_failed_counts_only_charged_runs(conn, org):
    """Runs ended by a revocation are not charged, runs ended by expiry or failure are: max_attempts=2,
    revoked (uncharged), expired on another node (run 1), failed on a third (run 2) fails for good."""
    org_id, _ = org
    a = await add_node(conn, org_id, "a", [CPU64])
    b = await add_node(conn, org_id, "b", [CPU64])
    c = await add_node(conn, org_id, "c", [CPU64])
    job = await submit(conn, org_id, max_attempts=2)
    assert (await claims.claim(conn, node_id=a, organization_id=org_id, lease_seconds=30)).attempt == 1
    await credentials.revoke_node(conn, org_id, a, actor="admin")
    assert (await claims.claim(conn, node_id=b, organization_id=org_id, lease_seconds=30)).attempt == 2
    await set_clock(conn, 31)
    report = await sweep_once(conn, SETTINGS, reexamine=False)
    assert (report.leases_requeued, report.leases_failed) == (1, 0)
    await set_clock(conn, 31 + SETTINGS.lease_expired_delay_seconds + 1)
    assert (await claims.claim(conn, node_id=c, organization_id=org_id, lease_seconds=30)).attempt == 3
    failed = await claims.fail(conn, organization_id=org_id, node_id=c, job_id=job.id, attempt=3, error="oom", retry=True)
    assert (failed.status, failed.attempt) == ("failed", 3)
    assert await verify(conn, org_id) == []
