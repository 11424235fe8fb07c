"""Moving a waiting job to another priority (``POST /v1/jobs/{id}/priority``): the queue's order changes with it,
the move is in the job's own history, a claimer it held up is woken, and a refusal writes nothing."""

from __future__ import annotations

import uuid

import anyio
import httpx
import psycopg
import pytest

from tests.conftest import LiveServer
from tests.helpers import bearer, run_umbra
from umbra.compute import claims, priorities
from umbra.compute.accounts import create_api_key, create_organization
from umbra.errors import Conflict
from umbra.projections.verify import verify

from .queue_support import CPU64, add_node, beat, http_claim, http_complete, http_pair, set_clock, submit, written
from .test_model_affinity import HOLDS_MISTRAL, fleet, take

pytestmark = pytest.mark.anyio


async def submitted(client, key: str, name: str, **fields) -> dict:
    answer = await client.post("/v1/jobs", json={"kind": "render", "payload": {"name": name}, **fields}, headers=bearer(key))
    assert answer.status_code == 201, answer.text
    return answer.json()


async def test_a_job_moved_ahead_is_claimed_first_and_its_history_says_who_moved_it(client, org):
    """Three jobs of one priority: the last moved to 10 is claimed first, the first moved to 200 last; each takes
    its place among its new priority's jobs. ``job.reprioritized`` names the old priority and who moved it; the
    views still agree with the log."""
    _, key = org
    _, credential = await http_pair(client, key)
    first, second, third = [await submitted(client, key, name) for name in ("first", "second", "third")]
    moved = await client.post(f"/v1/jobs/{third['id']}/priority", json={"priority": 10}, headers=bearer(key))
    assert moved.status_code == 200, moved.text
    assert (moved.json()["id"], moved.json()["status"], moved.json()["priority"]) == (third["id"], "queued", 10)
    behind = await client.post(f"/v1/jobs/{first['id']}/priority", json={"priority": 200}, headers=bearer(key))
    assert behind.json()["priority"] == 200
    order = []
    for _ in range(3):
        job = await http_claim(client, credential)
        order.append(job["id"])
        await http_complete(client, credential, job)
    assert order == [third["id"], second["id"], first["id"]]
    history = (await client.get(f"/v1/jobs/{third['id']}/events", headers=bearer(key))).json()["events"]
    assert [e["type"] for e in history] == ["job.submitted", "job.reprioritized", "job.claimed", "job.completed"]
    assert history[1]["data"]["priority"] == 10 and history[1]["data"]["previous"] == 100 and history[1]["data"]["by"]
    verified = await client.post("/v1/projections/verify", headers=bearer(key))
    assert verified.json() == {"ok": True, "differences": []}, verified.text


async def test_the_same_priority_again_records_nothing(client, org, db_url):
    _, key = org
    job = await submitted(client, key, "a", priority=7)
    before = await written(db_url)
    again = await client.post(f"/v1/jobs/{job['id']}/priority", json={"priority": 7}, headers=bearer(key))
    assert (again.status_code, again.json()["priority"]) == (200, 7)
    assert await written(db_url) == before


async def test_a_moved_job_keeps_the_wait_it_has_for_model_affinity(conn, org):
    """With affinity (60 s), llama's job, queued first at 200, is moved to 100 after 61 s beside mistral's, on a
    node holding mistral: it has waited past the affinity, so it is taken in its place (first), not made to
    wait the affinity again from the move."""
    org_id, _ = org
    node = await fleet(conn, org_id)
    llama = await submit(conn, org_id, "chat", requires={"models": ["llama"]}, priority=200)
    await submit(conn, org_id, "chat", requires={"models": ["mistral"]}, priority=100)
    await set_clock(conn, 61)
    await beat(conn, org_id, node, [HOLDS_MISTRAL])
    await priorities.reprioritize(conn, org_id, llama.id, 100, actor="ops")
    assert await take(conn, org_id, node, 60) == "llama"


async def test_a_claimer_parked_while_a_move_held_the_job_is_woken_when_it_commits(db_url, org):
    """A long-poll that looked while the move's transaction held the only queued job skipped it and parked;
    the move's commit announces the job claimable, so the poll takes it then, not at its 30 s safety poll."""
    org_id, key = org
    with LiveServer(db_url, UMBRA_POLL_FALLBACK_SECONDS="30") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            _, credential = await http_pair(client, key)
            job = await submitted(client, key, "a")
            answered: dict = {}

            async def poll():
                started = anyio.current_time()
                answer = await client.post("/v1/agent/claim", params={"wait": 8}, headers=bearer(credential))
                answered["status"], answered["took"] = answer.status_code, anyio.current_time() - started

            async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as operator:
                async with anyio.create_task_group() as tg:
                    async with operator.transaction():
                        await priorities.reprioritize(operator, org_id, uuid.UUID(job["id"]), 5, actor="ops")
                        tg.start_soon(poll)
                        await anyio.sleep(1.0)  # the claim has looked, skipped the held row and parked
            assert answered["status"] == 200 and answered["took"] < 4, answered


async def test_who_may_move_a_job_and_what_a_bad_request_gets(client, org, conn, db_url):
    """No credential → 401; a key without ``jobs:write`` or a node → 403; another organization's job, none, or
    a malformed id → 404 ``job_not_found``; a body not as the contract says → 422 naming the field; a job that
    ended → 409 ``job_terminal``. None writes."""
    org_id, key = org
    _, credential = await http_pair(client, key)
    done = await submitted(client, key, "done")
    await http_complete(client, credential, await http_claim(client, credential))
    job = await submitted(client, key, "waiting")
    _, other_key = await create_organization(conn, "other")
    reader = await create_api_key(conn, org_id, ["jobs:read"])
    path, body = f"/v1/jobs/{job['id']}/priority", {"priority": 1}
    before = await written(db_url)
    assert (await client.post(path, json=body)).status_code == 401
    assert (await client.post(path, json=body, headers=bearer(reader))).status_code == 403
    assert (await client.post(path, json=body, headers=bearer(credential))).status_code == 403
    for other in (path, "/v1/jobs/00000000-0000-0000-0000-000000000000/priority", "/v1/jobs/not-a-uuid/priority"):
        gone = await client.post(other, json=body, headers=bearer(other_key if other == path else key))
        assert (gone.status_code, gone.json()["error"]) == (404, "job_not_found"), other
    for bad, field in (({}, "priority"), ({"priority": "1"}, "priority"), ({"priority": 2**31}, "priority"),
                       ({"priority": 1.5}, "priority"), ({"priority": 1, "urgent": True}, None)):  # fmt: skip
        refused = await client.post(path, json=bad, headers=bearer(key))
        assert (refused.status_code, refused.json()["error"]) == (422, "invalid_request"), bad
        assert refused.json().get("field") == field, refused.json()
    ended = await client.post(f"/v1/jobs/{done['id']}/priority", json=body, headers=bearer(key))
    assert (ended.status_code, ended.json()["error"], ended.json()["status"]) == (409, "job_terminal", "complete")
    assert await written(db_url) == before
    assert (await client.get(f"/v1/jobs/{job['id']}", headers=bearer(key))).json()["priority"] == 100


async def test_a_running_job_and_one_that_made_children_are_refused_and_the_children_can_be_moved(conn, org, db_url):
    """A running job has its device (its claim stands untouched until its agent acts on it); a container runs
    nothing itself. Both → 409 ``job_not_reprioritizable``, nothing written; a waiting child moves."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    parent = await submit(conn, org_id)
    held = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60)
    before = await written(db_url)
    with pytest.raises(Conflict) as refused:
        await priorities.reprioritize(conn, org_id, parent.id, 1, actor="ops")
    assert (refused.value.code, await written(db_url)) == ("job_not_reprioritizable", before)
    [child, _] = await claims.add_children(conn, organization_id=org_id, node_id=node, job_id=parent.id, attempt=held.attempt,
                                           children=[claims.ChildRequest(kind="part"), claims.ChildRequest(kind="part")])  # fmt: skip
    with pytest.raises(Conflict) as refused:
        await priorities.reprioritize(conn, org_id, parent.id, 1, actor="ops")
    assert refused.value.code == "job_not_reprioritizable"
    assert (await priorities.reprioritize(conn, org_id, child.id, 1, actor="ops")).priority == 1
    assert await verify(conn, org_id) == []


async def test_the_cli_moves_a_job(client, org, live_server):
    """``umbra jobs priority ID N`` sends it through the API with an API key and prints the job as it stands."""
    _, key = org
    job = await submitted(client, key, "a")
    moved = await anyio.to_thread.run_sync(lambda: run_umbra("jobs", "priority", job["id"], "-5", "--server", live_server.url,
                                                             env={"UMBRA_API_KEY": key}))  # fmt: skip
    assert moved.returncode == 0, moved.stderr
    assert moved.stdout.split() == [job["id"], job["status"], "priority", "-5"], moved.stdout  # blocked: no node here
