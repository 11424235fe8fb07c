"""Pairing, a heartbeat that changes devices, and a registry update each re-examine blocked jobs."""

from __future__ import annotations

import msgspec
import pytest

from umbra.compute.heartbeat import heartbeat
from umbra.compute.jobs import JobRequest, submit
from umbra.compute.models import upsert_model
from umbra.compute.pairing import issue_pairing_code, redeem_pairing_code
from umbra.domain.heartbeat import HeartbeatReport
from umbra.domain.models import RegisteredModel
from umbra.events import store
from umbra.events.types import Device

pytestmark = pytest.mark.anyio

CPU = Device(kind="cpu", label="cpu", ram_total_mb=65536, ram_free_mb=60000)
GPU = Device(kind="gpu_discrete", label="gpu0", vram_total_mb=24576, vram_free_mb=24000, accelerators=("cuda",))


async def job(conn, org_id, **requires):
    spec = msgspec.convert({"kind": "infer", "requires": requires}, JobRequest)
    (row,), _ = await submit(conn, org_id, [spec], actor="test", batch=False)
    return row.id


async def status(conn, job_id) -> str:
    return (await (await conn.execute("SELECT status FROM jobs WHERE id = %s", (job_id,))).fetchone())[0]


async def pair(conn, org_id, devices):
    code = (await issue_pairing_code(conn, org_id, "box")).code
    return (await redeem_pairing_code(conn, code=code, name="box", source="10.0.0.1", devices=devices)).node_id


async def test_pairing_a_capable_node_unblocks(conn, org):
    org_id, _ = org
    job_id = await job(conn, org_id, vram_min_mb=8000, accelerators=["cuda"])
    assert await status(conn, job_id) == "blocked"
    await pair(conn, org_id, [CPU, GPU])
    assert await status(conn, job_id) == "queued"
    history = await store.read_stream(conn, store.job_stream(job_id))
    assert history[-1].type == "job.unblocked" and history[-1].metadata["actor"] == "reexamine"


async def test_a_heartbeat_that_adds_a_device_unblocks(conn, org):
    org_id, _ = org
    node_id = await pair(conn, org_id, [CPU])
    job_id = await job(conn, org_id, accelerators=["cuda"])
    assert await status(conn, job_id) == "blocked"
    await heartbeat(conn, org_id, node_id, HeartbeatReport(devices=(CPU,)), event_interval_seconds=300)
    assert await status(conn, job_id) == "blocked"
    await heartbeat(conn, org_id, node_id, HeartbeatReport(devices=(CPU, GPU)), event_interval_seconds=300)
    assert await status(conn, job_id) == "queued"


async def test_registering_the_model_unblocks(conn, org):
    org_id, _ = org
    await pair(conn, org_id, [CPU, GPU])
    job_id = await job(conn, org_id, models=["gemma4:26b"])
    assert await status(conn, job_id) == "blocked"
    await upsert_model(conn, org_id, RegisteredModel(slug="gemma4:26b", vram_min_mb=16000))
    assert await status(conn, job_id) == "queued"
