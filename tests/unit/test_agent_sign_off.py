"""A stopping agent signs off after any heartbeat already on its way, against a scripted server."""

from __future__ import annotations

import anyio
import httpx
import pytest

from umbra.agent.client import AgentClient, claim_kinds
from umbra.agent.handlers import BUILTINS, HandlerRegistry
from umbra.agent.runner import Agent, AgentConfig

pytestmark = pytest.mark.anyio

NODE = "00000000-0000-0000-0000-000000000001"


async def test_a_heartbeat_on_its_way_when_the_agent_stops_is_answered_before_the_sign_off():
    """Cancelled instead, it could still reach the server after the sign-off and bring the node back online."""
    said: list[str] = []
    second_beat = anyio.Event()

    async def server(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/agent/heartbeat":
            beats = said.count("beat")
            said.append("beat")
            if beats:  # the second beat is slow: the agent stops while it is on its way
                second_beat.set()
                await anyio.sleep(0.5)
                said.append("beat answered")
            return httpx.Response(200, json={"node_id": NODE, "status": "online", "heartbeat_interval_seconds": 0.2})
        if path == "/v1/agent/claim":
            return httpx.Response(204)
        if path == "/v1/agent/offline":
            said.append("offline")
            return httpx.Response(200, json={"id": NODE, "status": "offline"})
        return httpx.Response(404, json={"error": "not_found", "message": path})

    async with AgentClient("http://umbra", "uk_0_x", transport=httpx.MockTransport(server)) as client:
        agent = Agent(client, HandlerRegistry(dict(BUILTINS)), lambda: [], AgentConfig(agent_version="t", claim_wait_seconds=0,
                                                                                          heartbeat_seconds=0.2))
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(agent.run)
                await second_beat.wait()
                agent.stop()
    assert said[-3:] == ["beat", "beat answered", "offline"], said


async def test_a_second_stop_leaves_at_once_without_waiting_for_the_beat_or_signing_off():
    """A server that stopped answering holds a beat for ever: the first stop waits for it (a few seconds at
    most), a second one (the second Ctrl-C) leaves now."""
    said: list[str] = []
    hung = anyio.Event()

    async def server(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        said.append(path)
        if path == "/v1/agent/heartbeat":
            if said.count(path) > 1:
                hung.set()
                await anyio.sleep_forever()
            return httpx.Response(200, json={"node_id": NODE, "status": "online", "heartbeat_interval_seconds": 0.2})
        return httpx.Response(204)

    async with AgentClient("http://umbra", "uk_0_x", transport=httpx.MockTransport(server)) as client:
        agent = Agent(client, HandlerRegistry(dict(BUILTINS)), lambda: [],
                      AgentConfig(agent_version="t", claim_wait_seconds=0, heartbeat_seconds=0.2))  # fmt: skip
        finished = anyio.Event()

        async def run(*, task_status=anyio.TASK_STATUS_IGNORED) -> None:
            await agent.run(task_status=task_status)
            finished.set()

        async with anyio.create_task_group() as tg:
            await tg.start(run)
            await hung.wait()
            agent.stop()
            await anyio.sleep(0.3)  # the work is done: the agent waits for the hung beat
            assert not finished.is_set()
            with anyio.fail_after(2):
                agent.stop(immediately=True)
                await finished.wait()
    assert "/v1/agent/offline" not in said


def test_a_claim_names_the_kinds_the_server_takes_or_none():
    assert claim_kinds(["echo", "sleep"]) == ["echo", "sleep"]
    assert claim_kinds(["echo", "x" * 201]) == ["echo"]  # no job can have that kind
    assert claim_kinds(["echo", " ", "\t\u3000"]) == ["echo"]  # nor a blank one
    assert claim_kinds([f"k{i}" for i in range(101)]) == []  # too many to name: every kind
    assert claim_kinds(["渲染" * 90 + f"-{i}" for i in range(40)]) == []  # too long for a request line
