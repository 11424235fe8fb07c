"""An agent runs for months: what it keeps of the jobs it finished must not grow with their number.

Each finished job's :class:`~umbra.agent.runner.Outcome` holds the Job object the server answered
(payload and result, up to a MiB each). Kept in a list for the agent's life, an agent completing a job a
second with 50 KB results held gigabytes within a day, until the machine ran out of memory: it keeps the
last :data:`~umbra.agent.runner.OUTCOMES_KEPT`.
"""

from __future__ import annotations

import anyio
import httpx
import pytest

from umbra.agent.client import AgentClient
from umbra.agent.handlers import BUILTINS, HandlerRegistry
from umbra.agent.runner import OUTCOMES_KEPT, Agent, AgentConfig
from umbra.events.types import Device

pytestmark = pytest.mark.anyio

NODE = "00000000-0000-0000-0000-000000000001"
CPU = Device(kind="cpu", label="c0", ram_total_mb=8192, ram_free_mb=8000)
BLOB = 50_000
LEASE = {"Umbra-Lease-Seconds": "60"}


def _job(n: int) -> dict:
    return {"id": f"00000000-0000-0000-0000-{n:012d}", "kind": "echo", "payload": {"blob": f"{n}" + "x" * BLOB},
            "attempt": 1, "status": "running", "requires": {}}  # fmt: skip


def _claim(n: int) -> dict:
    return {"job": _job(n), "placement": {}, "lease_expires_at": "2100-01-01T00:00:00Z"}


async def _run(jobs: int) -> tuple[int, Agent]:
    """Run ``jobs`` echo jobs (each the next of the last one's completion); returns how many finished and the
    agent, stopped once they have."""
    done: list[int] = []

    async def server(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/agent/heartbeat":
            return httpx.Response(200, json={"node_id": NODE, "status": "online", "heartbeat_interval_seconds": 5})
        if path == "/v1/agent/claim" and not done:
            done.append(0)
            return httpx.Response(200, json=_claim(1), headers=LEASE)
        if path.endswith("/complete"):
            n = int(path.split("/")[4].rsplit("-", 1)[1])
            done.append(n)
            job = {**_job(n), "status": "complete", "result": {"blob": f"{n}" + "x" * BLOB}}
            following = _claim(n + 1) if n < jobs else None
            return httpx.Response(200, json={**job, "next_claim": following}, headers=LEASE if following else None)
        if path == "/v1/agent/offline":
            return httpx.Response(200, json={"id": NODE, "status": "offline"})
        return httpx.Response(204)

    config = AgentConfig(agent_version="t", claim_wait_seconds=0)
    async with AgentClient("http://umbra", "un_0_x", transport=httpx.MockTransport(server)) as client:
        agent = Agent(client, HandlerRegistry(dict(BUILTINS)), lambda: [CPU], config)
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                await tg.start(agent.run)
                while len(agent.outcomes) < min(jobs, OUTCOMES_KEPT) or len(done) <= jobs:  # the claim, every completion
                    await anyio.sleep(0.01)
                await anyio.sleep(0.1)
                agent.stop(immediately=True)
    return len(done) - 1, agent


async def test_what_an_agent_keeps_of_finished_jobs_does_not_grow_with_their_number():
    finished, agent = await _run(OUTCOMES_KEPT + 150)
    assert finished == OUTCOMES_KEPT + 150
    kept = [int(o.job_id.rsplit("-", 1)[1]) for o in agent.outcomes]
    assert kept == list(range(151, OUTCOMES_KEPT + 151)), kept[:3]  # the last ones, in order
    assert all(o.status == "complete" for o in agent.outcomes)
