"""The projection stream: views on open, a fresh view on each change, stale nodes pushed."""

from __future__ import annotations

import json

import anyio
import httpx
import psycopg
import pytest

from tests.helpers import bearer
from tests.integration.test_events_api_projections import pair, submit
from tests.integration.test_sse import SseReader
from umbra.compute.heartbeat import heartbeat
from umbra.domain.heartbeat import HeartbeatReport
from umbra.events import store
from umbra.events.types import Device

pytestmark = pytest.mark.anyio

CPU = Device(kind="cpu", label="cpu", ram_total_mb=65536, ram_free_mb=30000)


async def next_view(reader: SseReader, event: str, timeout: float = 10) -> dict:
    with anyio.fail_after(timeout):
        while True:
            message = await reader.next_message()
            if message.get("event") == event:
                return json.loads(message["data"])


async def test_stream_sends_views_then_changes_tagged_with_positions(conn, org, live_server):
    org_id, key = org
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:
        # access_token: what a browser EventSource (no headers) uses.
        async with client.stream("GET", "/v1/projections/stream", params={"access_token": key}) as response:
            assert response.status_code == 200
            reader = SseReader(response)
            queue = await next_view(reader, "queue")
            nodes = await next_view(reader, "nodes")
            assert queue["counts"]["queued"] == 0 and nodes["nodes"] == []
            job_id = await submit(conn, org_id)
            queue = await next_view(reader, "queue")
            assert queue["counts"]["queued"] == 1 and queue["changed"] == [str(job_id)]
            assert queue["position"] == await store.head_position(conn, org_id)
            node_id = await pair(conn, org_id, "box-1")
            nodes = await next_view(reader, "nodes")
            assert nodes["changed"] == [str(node_id)] and nodes["nodes"][0]["status"] == "provisioning"
            assert nodes["position"] >= queue["position"]
            await heartbeat(conn, org_id, node_id, HeartbeatReport(devices=(CPU,)), event_interval_seconds=300)
            nodes = await next_view(reader, "nodes")
            assert nodes["nodes"][0]["status"] == "online"
            # Silent for longer than the stale threshold: no event is appended,
            # yet the view reads offline and the stream pushes it.
            await conn.execute("UPDATE node_liveness SET last_seen_at = now() - interval '1 minute' WHERE node_id = %s", (node_id,))
            nodes = await next_view(reader, "nodes")
            assert nodes["nodes"][0]["status"] == "offline"
            assert nodes["changed"] == [str(node_id)]


async def test_views_filter_and_bad_views_are_refused(conn, org, live_server):
    org_id, key = org
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:
        refused = await client.get("/v1/projections/stream", params={"views": "queue,bogus"}, headers=headers)
        unauthenticated = await client.get("/v1/projections/stream", params={"access_token": "uk_no_such"})
        async with client.stream("GET", "/v1/projections/stream", params={"views": "nodes"}, headers=headers) as response:
            reader = SseReader(response)
            first = await reader.next_message()
            await submit(conn, org_id)
            await pair(conn, org_id, "box-2")
            second = await reader.next_message()
    assert refused.status_code == 422 and refused.json()["field"] == "views"
    assert unauthenticated.status_code == 401
    assert (first["event"], second["event"]) == ("nodes", "nodes")


async def test_a_node_event_pushes_no_queue_message_to_a_queue_only_subscriber(client, org, live_server):
    """The queue view is sent again only when a job moved: a log that moved for nodes alone (a pairing,
    heartbeats, drains) sent every queue-only subscriber the same view again, with ``changed: []``."""
    _, key = org
    headers = bearer(key)
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as streams:
        async with streams.stream("GET", "/v1/projections/stream", params={"views": "queue"}, headers=headers) as response:
            reader = SseReader(response)
            first = json.loads((await reader.next_message())["data"])
            # A node is paired: the log moves, the queue does not.
            issued = await client.post("/v1/pairings", json={"name": "box"}, headers=headers)
            redeemed = await client.post("/v1/pairings/redeem", json={"code": issued.json()["code"], "name": "box",
                                                                      "agent_version": "1", "devices": []})  # fmt: skip
            assert redeemed.status_code == 201
            await anyio.sleep(1.5)  # past the stream's safety poll
            job = (await client.post("/v1/jobs", json={"kind": "echo"}, headers=headers)).json()
            with anyio.fail_after(10):
                following = await reader.next_message()
    view = json.loads(following["data"])
    assert following["event"] == "queue"
    assert view["changed"] == [job["id"]], (
        f"queue re-sent unchanged after a node event: position {first['position']} -> {view['position']}, "
        f"changed={view['changed']}, counts={view['counts']}")


async def test_a_node_change_stamped_with_the_time_of_the_one_before_is_pushed(conn, org, live_server, db_url):
    """An event is stamped no earlier than the one it follows on its stream, so a command whose transaction
    began before the previous one on the node committed records its change at that one's time: the node's
    ``updated_at`` does not move. The stream keyed re-sending a node on it, and the change (here a new agent
    version) was in every snapshot and never pushed."""
    org_id, key = org
    node_id = await pair(conn, org_id, "box")
    await heartbeat(conn, org_id, node_id, HeartbeatReport(devices=(CPU,), agent_version="1.0"),
                    event_interval_seconds=300)  # fmt: skip
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30, headers=bearer(key)) as client:
        async with client.stream("GET", "/v1/projections/stream", params={"views": "nodes"}) as response:
            reader = SseReader(response)
            assert (await next_view(reader, "nodes"))["nodes"][0]["agent_version"] == "1.0"
            async with await psycopg.AsyncConnection.connect(db_url) as late:
                async with late.transaction():
                    await late.execute("SELECT 1")  # its clock (now()) stops here
                    await heartbeat(conn, org_id, node_id, HeartbeatReport(devices=(CPU,), agent_version="2.0"),
                                    event_interval_seconds=300)  # fmt: skip
                    sent = await next_view(reader, "nodes")
                    assert sent["nodes"][0]["agent_version"] == "2.0"
                    await heartbeat(late, org_id, node_id, HeartbeatReport(devices=(CPU,), agent_version="3.0"),
                                    event_interval_seconds=300)  # fmt: skip
            snapshot = (await client.get("/v1/projections/nodes")).json()["nodes"][0]
            assert (snapshot["agent_version"], snapshot["updated_at"]) == ("3.0", sent["nodes"][0]["updated_at"])
            pushed = await next_view(reader, "nodes", timeout=5)
    assert pushed["nodes"][0]["agent_version"] == "3.0" and pushed["changed"] == [str(node_id)]
