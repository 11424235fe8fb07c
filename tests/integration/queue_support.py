"""Shared set-up for the queue tests: nodes made through the real pairing and heartbeat paths, directly or
over HTTP, and a node's claim and completion over HTTP."""

from __future__ import annotations

from typing import Any, Sequence
from uuid import UUID

import msgspec
import psycopg

from tests.helpers import bearer
from umbra.compute import jobs
from umbra.compute.heartbeat import heartbeat
from umbra.compute.jobs import JobRequest
from umbra.compute.pairing import issue_pairing_code, redeem_pairing_code
from umbra.domain.heartbeat import HeartbeatReport
from umbra.events.types import Device, ResidentModel

GPU24 = Device(kind="gpu_discrete", label="gpu0", vram_total_mb=24576, vram_free_mb=24000, ram_total_mb=0,
               ram_free_mb=0, accelerators=("cuda",), throughput_factor=10.0)  # fmt: skip
CPU64 = Device(kind="cpu", label="cpu", ram_total_mb=65536, ram_free_mb=60000, throughput_factor=1.0)
CPU8 = Device(kind="cpu", label="cpu", ram_total_mb=8192, ram_free_mb=6000, throughput_factor=1.0)
#: CPU64 as a request body carries it (pairing, heartbeats).
CPU64_JSON = msgspec.to_builtins(CPU64)


async def add_node(
    conn, org_id: UUID, name: str, devices: Sequence[Device], *, trust_domain: str = "local", online: bool = True
) -> UUID:
    """Pair a node (and heartbeat it online unless ``online`` is False)."""
    issued = await issue_pairing_code(conn, org_id, name, trust_domain=trust_domain)
    redeemed = await redeem_pairing_code(conn, code=issued.code, name=name, source=f"test:{name}", devices=list(devices))
    if online:
        await beat(conn, org_id, redeemed.node_id, devices)
    return redeemed.node_id


async def beat(conn, org_id: UUID, node_id: UUID, devices: Sequence[Device]):
    return await heartbeat(conn, org_id, node_id, HeartbeatReport(devices=tuple(devices)), event_interval_seconds=300)


def spec(kind: str = "echo", **fields: Any) -> JobRequest:
    return msgspec.convert({"kind": kind, **fields}, JobRequest)


async def submit(conn, org_id: UUID, kind: str = "echo", **fields: Any):
    rows, _ = await jobs.submit(conn, org_id, [spec(kind, **fields)], actor="test", batch=False)
    return rows[0]


async def register_model(conn, org_id: UUID, slug: str, **fields: Any) -> None:
    from umbra.compute.models import upsert_model
    from umbra.domain.models import RegisteredModel

    await upsert_model(conn, org_id, RegisteredModel(slug=slug, **fields))


async def set_clock(conn, seconds: float) -> None:
    """Move this connection's database clock (umbra_now) by ``seconds``."""
    await conn.execute("SELECT set_config('umbra.clock_offset', %s, false)", (f"{seconds} seconds",))


async def written(db_url: str, *also: str) -> tuple[int, ...]:
    """What a refusal must leave as it found it: the rows of ``jobs``, the events of the log, and a count of
    each of ``also`` (``"nodes WHERE ..."``: a table and what to count of it), read on a connection of its own."""
    counts = ["jobs", "events", *also]
    async with await psycopg.AsyncConnection.connect(db_url) as c:
        return tuple(await (await c.execute("SELECT " + ", ".join(f"(SELECT count(*) FROM {t})" for t in counts))).fetchone())


async def http_pair(client, key: str, name: str = "box", devices: Sequence[dict] | None = None) -> tuple[str, str]:
    """``(node_id, credential)`` of a node paired and heartbeated online through the routes, with ``devices``
    (one CPU64 unless given)."""
    devices = list(devices) if devices is not None else [CPU64_JSON]
    issued = await client.post("/v1/pairings", json={"name": name}, headers=bearer(key))
    redeemed = await client.post("/v1/pairings/redeem", json={"code": issued.json()["code"], "name": name,
                                                              "agent_version": "1", "devices": devices})  # fmt: skip
    node_id, credential = redeemed.json()["node_id"], redeemed.json()["credential"]
    beat = await client.post("/v1/agent/heartbeat", json={"devices": devices, "agent_version": "1"}, headers=bearer(credential))
    assert beat.status_code == 200, beat.text
    return node_id, credential


async def http_claim(client, credential: str) -> dict:
    """The job the node claims now (``wait=0``); there must be one."""
    claimed = await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(credential))
    assert claimed.status_code == 200, (claimed.status_code, claimed.text)
    return claimed.json()["job"]


async def http_complete(client, credential: str, job: dict) -> dict:
    """Complete the claimed ``job`` with an empty result; returns the completed job."""
    done = await client.post(f"/v1/agent/jobs/{job['id']}/complete", json={"attempt": job["attempt"], "result": {}},
                             headers=bearer(credential))  # fmt: skip
    assert done.status_code == 200, done.text
    return done.json()


__all__ = ["CPU64", "CPU64_JSON", "CPU8", "GPU24", "ResidentModel", "add_node", "beat", "http_claim", "http_complete", "http_pair",
           "register_model", "set_clock", "spec", "submit", "written"]  # fmt: skip
