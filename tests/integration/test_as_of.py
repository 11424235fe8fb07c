"""``GET /v1/jobs/{id}?as_of=P``: the job as it stood after log position P, at every position of its history.

After every command the live Job object (the projection row) is captured; the
time-travelled answer at each position of the log must equal the last capture
at or before it, and be 404 before the job existed. Other jobs' events are
interleaved so positions between a job's own events are checked too.
"""

from __future__ import annotations

import dataclasses
import json
from uuid import UUID

import anyio
import httpx
import pytest

from umbra.cli import main
from umbra.compute import claims, jobs
from umbra.compute.accounts import create_organization
from umbra.compute.sweeper import sweep_once
from umbra.events import store
from umbra.projections import jobs as queue

from .queue_support import CPU64, add_node, set_clock, submit
from .test_sweeper import SETTINGS, claim
from tests.helpers import bearer

pytestmark = pytest.mark.anyio


class Timeline:
    """Live Job objects captured after each command, per job."""

    def __init__(self, client: httpx.AsyncClient, key: str) -> None:
        self.client, self.key = client, key
        self.states: dict[str, list[dict]] = {}

    async def capture(self, *job_ids: UUID) -> None:
        for job_id in map(str, job_ids):
            state = (await self.client.get(f"/v1/jobs/{job_id}", headers=bearer(self.key))).json()
            seen = self.states.setdefault(job_id, [])
            if not seen or seen[-1]["position"] != state["position"]:
                seen.append(state)

    async def check_every_position(self) -> int:
        head = max(s["position"] for states in self.states.values() for s in states)
        checked = 0
        for job_id, states in self.states.items():
            events = (await self.client.get(f"/v1/jobs/{job_id}/events", headers=bearer(self.key))).json()["events"]
            # A capture after every event of the stream: nothing in the history goes unchecked.
            assert [s["position"] for s in states] == [e["position"] for e in events]
            for position in range(0, head + 2):
                response = await self.client.get(f"/v1/jobs/{job_id}", params={"as_of": position}, headers=bearer(self.key))
                before = [s for s in states if s["position"] <= position]
                if not before:
                    assert response.status_code == 404 and response.json()["error"] == "job_not_found"
                else:
                    assert response.status_code == 200, response.text
                    assert response.json() == before[-1], f"as_of={position}"
                checked += 1
        return checked


async def test_every_position_of_submit_claim_retry_claim_complete(client, conn, org):
    org_id, key = org
    node = await add_node(conn, org_id, "worker", [CPU64])
    timeline = Timeline(client, key)
    job = await submit(conn, org_id, priority=1, max_attempts=3)
    await timeline.capture(job.id)
    await submit(conn, org_id, priority=50)  # someone else's event in between
    first = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60)
    assert first.job_id == job.id
    await timeline.capture(job.id)
    await claims.renew(conn, organization_id=org_id, node_id=node, job_id=job.id, attempt=1, lease_seconds=90)
    await timeline.capture(job.id)
    await claims.fail(conn, organization_id=org_id, node_id=node, job_id=job.id, attempt=1, error="flaky", retry=True)
    await timeline.capture(job.id)
    await submit(conn, org_id, priority=60)
    await set_clock(conn, 30)  # past the retry backoff (5 s)
    second = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60)
    assert second.job_id == job.id and second.attempt == 2
    await timeline.capture(job.id)
    await claims.complete(conn, organization_id=org_id, node_id=node, job_id=job.id, attempt=2, result={"answer": 42})
    await timeline.capture(job.id)

    states = timeline.states[str(job.id)]
    assert [s["status"] for s in states] == ["queued", "running", "running", "queued", "running", "complete"]
    assert states[3]["not_before"] is not None and states[3]["error"] == "flaky"
    assert await timeline.check_every_position() > 10


async def test_every_position_of_a_decomposition_for_the_parent_and_each_child(client, conn, org):
    import msgspec

    org_id, key = org
    node = await add_node(conn, org_id, "worker", [CPU64])
    timeline = Timeline(client, key)
    parent = await submit(conn, org_id, priority=1)
    await timeline.capture(parent.id)
    await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60)
    await timeline.capture(parent.id)
    children = [msgspec.convert({"kind": "part", "priority": 1}, claims.ChildRequest) for _ in range(2)]
    made = await claims.add_children(conn, organization_id=org_id, node_id=node, job_id=parent.id, attempt=1, children=children)
    ids = [parent.id, *(c.id for c in made)]
    await timeline.capture(*ids)
    for outcome in ("complete", "fail"):
        got = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60)
        await timeline.capture(*ids)
        if outcome == "complete":
            await claims.complete(conn, organization_id=org_id, node_id=node, job_id=got.job_id, attempt=1, result=None)
        else:
            await claims.fail(conn, organization_id=org_id, node_id=node, job_id=got.job_id, attempt=1, error="bad", retry=False)
        await timeline.capture(*ids)

    assert [s["status"] for s in timeline.states[str(parent.id)]] == ["queued", "running", "running", "partial"]
    assert timeline.states[str(parent.id)][-1]["error"] == "1 of 2 children failed"
    assert await timeline.check_every_position() > 10


async def test_as_of_the_head_equals_the_live_job_after_sweeper_driven_transitions(conn, org):
    """A fold of the job's events up to the head equals its row, timestamps included, for jobs moved by
    time alone: a lease expired and requeued, a lease expired on the last attempt, a blocked timeout."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    requeued = await submit(conn, org_id, max_attempts=3)
    spent = await submit(conn, org_id, max_attempts=1)
    blocked = await submit(conn, org_id, requires={"accelerators": ["rocm"]})
    await claim(conn, org_id, node, lease_seconds=5)
    await claim(conn, org_id, node, lease_seconds=5)
    await set_clock(conn, 10)
    settings = dataclasses.replace(SETTINGS, blocked_timeout_seconds=5)
    report = await sweep_once(conn, settings, reexamine=False)
    assert (report.leases_requeued, report.leases_failed, report.blocked_failed) == (1, 1, 1)
    head = await store.head_position(conn)
    for job in (requeued, spent, blocked):
        live = await jobs.get_job(conn, org_id, job.id)
        folded = await jobs.get_job(conn, org_id, job.id, as_of=head)
        assert queue.to_json(folded) == queue.to_json(live)
    assert (await jobs.get_job(conn, org_id, spent.id)).status == "failed"


async def test_as_of_refuses_bad_positions_and_other_organizations(client, conn, org):
    org_id, key = org
    job = await submit(conn, org_id)
    for bad in ("abc", "-1", "1.5", "", "99999999999999999999"):
        response = await client.get(f"/v1/jobs/{job.id}", params={"as_of": bad}, headers=bearer(key))
        assert response.status_code == 422, bad
        assert response.json()["error"] == "invalid_request" and response.json()["field"] == "as_of"
    _, other_key = await create_organization(conn, "other")
    response = await client.get(f"/v1/jobs/{job.id}", params={"as_of": job.position}, headers=bearer(other_key))
    assert response.status_code == 404 and response.json()["error"] == "job_not_found"
    response = await client.get(f"/v1/jobs/{job.id}", params={"as_of": job.seq - 1}, headers=bearer(key))
    assert response.status_code == 404 and response.json()["error"] == "job_not_found"


async def test_replay_as_of_prints_the_same_state_as_the_api(client, conn, org, capsys):
    org_id, key = org
    node = await add_node(conn, org_id, "worker", [CPU64])
    job = await submit(conn, org_id)
    await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60)
    running = (await client.get(f"/v1/jobs/{job.id}", headers=bearer(key))).json()
    await claims.complete(conn, organization_id=org_id, node_id=node, job_id=job.id, attempt=1, result=None)
    common = ["--server", str(client.base_url), "--api-key", key]

    async def replay(*extra: str) -> tuple[int, str, str]:
        capsys.readouterr()
        status = await anyio.to_thread.run_sync(main, ["events", "replay", str(job.id), *extra, *common])
        out, err = capsys.readouterr()
        return status, out, err

    status, out, err = await replay("--as-of", str(running["position"]), "--json")
    assert status == 0, err
    printed = json.loads(out)
    assert printed["state"] == running
    assert [e["type"] for e in printed["events"]] == ["job.submitted", "job.claimed"]
    status, out, _ = await replay("--as-of", str(running["position"]))
    assert status == 0 and "-> running" in out and "job.completed" not in out
    status, _, err = await replay("--as-of", str(job.seq - 1))
    assert status == 1 and "invalid_request" in err
