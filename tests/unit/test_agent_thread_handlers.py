"""Plain (thread) handlers on an agent with many slots: each slot runs its job, and the heartbeat goes on.

A plain handler runs in a worker thread. ``--concurrency`` allows up to 64 slots, but anyio's default
thread limiter lets 40 threads run at once, shared with the heartbeat's device discovery (also run in
a thread). With every slot busy in a long handler (hours of GPU work), a job past the 40th waited,
claimed and renewed but never started, and the heartbeat waited behind it: the node read offline
while it ran forty jobs.
"""

from __future__ import annotations

import threading

import anyio
import httpx
import pytest

from umbra.agent.client import AgentClient
from umbra.agent.handlers import HandlerRegistry
from umbra.agent.runner import Agent, AgentConfig
from umbra.events.types import Device

pytestmark = pytest.mark.anyio

NODE = "00000000-0000-0000-0000-000000000001"
CPU = Device(kind="cpu", label="c0", ram_total_mb=8192, ram_free_mb=8000)
SLOTS = 48


async def test_every_slot_runs_its_plain_handler_and_the_heartbeat_goes_on():
    beats: list[float] = []
    claimed: list[str] = []
    release = threading.Event()
    started: list[str] = []
    lock = threading.Lock()

    def blocking(claim):
        with lock:
            started.append(claim.job_id)
        release.wait(30)
        return {"ok": True}

    async def server(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/agent/heartbeat":
            beats.append(anyio.current_time())
            return httpx.Response(200, json={"node_id": NODE, "status": "online", "heartbeat_interval_seconds": 0.2})
        if path == "/v1/agent/claim" and len(claimed) < SLOTS:
            job_id = f"00000000-0000-0000-0000-{len(claimed):012d}"
            claimed.append(job_id)
            job = {"id": job_id, "kind": "block", "payload": {}, "attempt": 1, "status": "running", "requires": {}}
            return httpx.Response(200, json={"job": job, "placement": {}, "lease_expires_at": "2100-01-01T00:00:00Z"},
                                  headers={"Umbra-Lease-Seconds": "60"})  # fmt: skip
        if path.endswith("/renew"):
            return httpx.Response(200, json={"lease_expires_at": "2100-01-01T00:00:00Z", "attempt": 1},
                                  headers={"Umbra-Lease-Seconds": "60"})  # fmt: skip
        if path.endswith("/complete"):
            return httpx.Response(200, json={"id": path.split("/")[4], "status": "complete", "next_claim": None})
        if path == "/v1/agent/offline":
            return httpx.Response(200, json={"id": NODE, "status": "offline"})
        return httpx.Response(204)

    config = AgentConfig(agent_version="t", claim_wait_seconds=0, concurrency=SLOTS, heartbeat_seconds=0.2)
    async with AgentClient("http://umbra", "un_0_x", transport=httpx.MockTransport(server)) as client:
        agent = Agent(client, HandlerRegistry({"block": blocking}), lambda: [CPU], config)
        try:
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    await tg.start(agent.run)
                    with anyio.move_on_after(15):  # a loaded machine may be slow to start them; a stuck one never does
                        while len(started) < SLOTS:
                            await anyio.sleep(0.05)
                    running_then, beats_then = len(started), len(beats)
                    with anyio.move_on_after(8):  # every slot busy: the beats (every 0.2 s) go on
                        while len(beats) < beats_then + 3:
                            await anyio.sleep(0.05)
                    beats_later = len(beats)
                    release.set()
                    agent.stop()
        finally:
            release.set()
    assert len(claimed) == SLOTS
    assert (running_then, beats_later - beats_then >= 3) == (SLOTS, True), (
        f"{running_then} of {SLOTS} claimed jobs started; {beats_later - beats_then} beats with every slot busy")
