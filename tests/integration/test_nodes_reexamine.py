"""Pairing, a heartbeat that changes devices, and a registry update each re-examine blocked jobs."""

from __future__ import annotations

import msgspec
import pytest

from umbra.compute import claims
from umbra.compute.heartbeat import heartbeat
from umbra.compute.jobs import RequiresRequest
from umbra.compute.nodes import retire_node
from umbra.compute.sweeper import sweep_once
from umbra.compute.jobs import JobRequest, submit
from umbra.compute.models import upsert_model
from umbra.compute.pairing import issue_pairing_code, redeem_pairing_code
from umbra.domain.heartbeat import HeartbeatReport
from umbra.domain.models import RegisteredModel
from umbra.events import store
from umbra.events.types import Device
from umbra.settings import load_settings

from tests.helpers import bearer

from .queue_support import CPU8, GPU24, add_node, beat, set_clock
from .test_explain_api import explain

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


async def test_registering_a_model_too_big_for_every_device_keeps_its_job_blocked_with_the_new_reason(client, conn, org):
    """A job blocked on ``model_not_registered`` whose model is then registered with a floor no device meets
    stays ``blocked`` with the new shortfall (one more ``job.blocked``, not an unblock/block pair), the Job and
    explain agree on it, and a registry update lowering the floor returns it to ``queued``."""
    org_id, key = org
    await add_node(conn, org_id, "gpu-box", [GPU24, CPU8])
    job_id = await job(conn, org_id, models=["huge"])

    async def stored() -> dict:
        return (await client.get(f"/v1/jobs/{job_id}", headers=bearer(key))).json()

    shown = await stored()
    assert (shown["status"], shown["blocked_reason"]) == ("blocked", "model_not_registered: huge")
    await upsert_model(conn, org_id, RegisteredModel(slug="huge", vram_min_mb=80000, ram_min_mb=90000))
    shown, body = await stored(), await explain(client, key, job_id)
    assert shown["status"] == "blocked" and shown["blocked_reason"].startswith("no_eligible_device: needs 80000 MB VRAM")
    assert "needs 90000 MB RAM" in shown["blocked_reason"] and body["blocked_reason"] == shown["blocked_reason"]
    assert body["eligible"] == [] and {r["reason"] for r in body["ineligible"]} == {"vram_insufficient", "ram_insufficient"}
    types = [e.type for e in await store.read_stream(conn, store.job_stream(job_id))]
    assert types == ["job.submitted", "job.blocked", "job.blocked"]
    await upsert_model(conn, org_id, RegisteredModel(slug="huge", vram_min_mb=16000))
    assert await status(conn, job_id) == "queued"
    assert (await explain(client, key, job_id))["eligible"][0]["device_label"] == "gpu0"


async def test_removing_a_model_blocks_the_work_naming_it_and_registering_it_again_unblocks(client, conn, org):
    """``DELETE /v1/models/{slug}`` (a model withdrawn): queued work naming it is blocked ``model_not_registered``
    at once (by a ``job.blocked`` whose cause is the registry), work naming others is untouched, a job it
    already placed runs on, a second removal is 404 ``model_not_found`` and writes nothing, another
    organization's registry is out of reach, and registering the model again returns the work to the queue."""
    org_id, key = org
    await add_node(conn, org_id, "gpu-box", [GPU24, CPU8])
    for slug in ("gemma", "other"):
        await upsert_model(conn, org_id, RegisteredModel(slug=slug, vram_min_mb=8000))
    placed = await job(conn, org_id, models=["gemma"])
    node_id = (await (await conn.execute("SELECT id FROM nodes")).fetchone())[0]
    running = await claims.claim(conn, node_id=node_id, organization_id=org_id, lease_seconds=60)
    assert running is not None and running.row.id == placed
    waiting, unrelated = await job(conn, org_id, models=["gemma"]), await job(conn, org_id, models=["other"])
    assert await status(conn, waiting) == "queued"

    removed = await client.delete("/v1/models/gemma", headers=bearer(key))
    assert removed.status_code == 200 and removed.json()["slug"] == "gemma" and removed.json()["vram_min_mb"] == 8000
    shown = (await client.get(f"/v1/jobs/{waiting}", headers=bearer(key))).json()
    assert (shown["status"], shown["blocked_reason"]) == ("blocked", "model_not_registered: gemma")
    assert [await status(conn, j) for j in (placed, unrelated)] == ["running", "queued"]
    assert [m["slug"] for m in (await client.get("/v1/models", headers=bearer(key))).json()["models"]] == ["other"]
    blocked = (await store.read_stream(conn, store.job_stream(waiting)))[-1]
    assert blocked.type == "job.blocked" and blocked.metadata["causation"] == "models"

    head = await store.head_position(conn, org_id)
    again = await client.delete("/v1/models/gemma", headers=bearer(key))
    assert again.status_code == 404 and again.json()["error"] == "model_not_found"
    _, other_key = await _other_org(conn)
    assert (await client.delete("/v1/models/other", headers=bearer(other_key))).status_code == 404
    assert await store.head_position(conn, org_id) == head
    assert (await client.put("/v1/models/gemma", json={"vram_min_mb": 8000}, headers=bearer(key))).status_code == 200
    assert await status(conn, waiting) == "queued"


async def _other_org(conn):
    from umbra.compute.accounts import create_organization

    return await create_organization(conn, "elsewhere")


# Capacity that goes away: queued work nothing could ever run any more is blocked, so it cannot
# look alive for ever, and a child blocked like that fails after the blocked timeout and lets its
# parent settle.

GPU48 = Device(kind="gpu_discrete", label="gpu0", vram_total_mb=49152, vram_free_mb=48000, accelerators=("cuda",))
SETTINGS = load_settings({})


async def test_retiring_the_only_capable_node_blocks_the_work_only_it_could_run(conn, org):
    org_id, _ = org
    big = await add_node(conn, org_id, "big", [GPU48])
    await add_node(conn, org_id, "small", [GPU])
    needs_big = await job(conn, org_id, vram_min_mb=40000, accelerators=["cuda"])
    fits_small = await job(conn, org_id, vram_min_mb=8000, accelerators=["cuda"])
    assert (await status(conn, needs_big), await status(conn, fits_small)) == ("queued", "queued")
    await retire_node(conn, org_id, big, actor="admin")
    assert (await status(conn, needs_big), await status(conn, fits_small)) == ("blocked", "queued")
    blocked = (await store.read_stream(conn, store.job_stream(needs_big)))[-1]
    assert blocked.type == "job.blocked" and "40000" in blocked.event.reason
    assert blocked.metadata["actor"] == "reexamine" and blocked.metadata["causation"] == f"node:{big}"
    await add_node(conn, org_id, "bigger", [GPU48])
    assert await status(conn, needs_big) == "queued"


async def test_revoking_the_only_capable_node_blocks_the_work_only_it_could_run_at_once(conn, org):
    """Nothing gives a revoked node a credential again: it reads retired, and the revocation re-examines
    waiting work as a retirement does. Read as offline, work only it could run stayed queued, looking
    alive, and the blocked timeout never failed it (so a parent waiting on it never settled)."""
    from umbra.compute.credentials import revoke_node

    org_id, _ = org
    big = await add_node(conn, org_id, "big", [GPU48])
    await add_node(conn, org_id, "small", [GPU])
    needs_big = await job(conn, org_id, vram_min_mb=40000, accelerators=["cuda"])
    fits_small = await job(conn, org_id, vram_min_mb=8000, accelerators=["cuda"])
    state, revoked = await revoke_node(conn, org_id, big, actor="admin")
    assert state.status == "retired" and len(revoked) == 1
    assert (await status(conn, needs_big), await status(conn, fits_small)) == ("blocked", "queued")
    blocked = (await store.read_stream(conn, store.job_stream(needs_big)))[-1]
    assert blocked.type == "job.blocked" and blocked.metadata["causation"] == f"node:{big}"
    assert [e.type for e in await store.read_stream(conn, store.node_stream(big))][-1] == "node.revoked"
    assert await revoke_node(conn, org_id, big, actor="admin") == (state, [])  # twice: nothing more recorded


async def test_raising_a_models_floor_past_every_device_blocks_its_queued_jobs(conn, org):
    org_id, _ = org
    await pair(conn, org_id, [CPU, GPU])
    await upsert_model(conn, org_id, RegisteredModel(slug="gemma4:26b", vram_min_mb=16000))
    job_id = await job(conn, org_id, models=["gemma4:26b"])
    assert await status(conn, job_id) == "queued"
    await upsert_model(conn, org_id, RegisteredModel(slug="gemma4:26b", vram_min_mb=80000))
    assert await status(conn, job_id) == "blocked"
    await upsert_model(conn, org_id, RegisteredModel(slug="gemma4:26b", vram_min_mb=16000))
    assert await status(conn, job_id) == "queued"


async def test_a_heartbeat_that_loses_a_device_blocks_what_needed_it_and_nothing_else(conn, org):
    org_id, _ = org
    node_id = await add_node(conn, org_id, "box", [CPU, GPU])
    needs_gpu = await job(conn, org_id, accelerators=["cuda"])
    any_device = await job(conn, org_id)
    await beat(conn, org_id, node_id, [CPU])
    assert (await status(conn, needs_gpu), await status(conn, any_device)) == ("blocked", "queued")


async def test_a_child_nothing_can_run_any_more_fails_after_the_blocked_timeout_and_its_parent_settles(conn, org):
    org_id, _ = org
    big = await add_node(conn, org_id, "big", [GPU48])
    cpu = await add_node(conn, org_id, "cpu", [CPU])
    parent = await job(conn, org_id, ram_min_mb=1024)
    got = await claims.claim(conn, node_id=cpu, organization_id=org_id, lease_seconds=60)
    assert got is not None and got.job_id == parent
    big_child = claims.ChildRequest(kind="render", requires=RequiresRequest(vram_min_mb=40000, accelerators=["cuda"]))
    [child] = await claims.add_children(conn, organization_id=org_id, node_id=cpu, job_id=parent, attempt=got.attempt,
                                        children=[big_child])  # fmt: skip
    await retire_node(conn, org_id, big, actor="admin")
    assert (await status(conn, child.id), await status(conn, parent)) == ("blocked", "running")
    await set_clock(conn, SETTINGS.blocked_timeout_seconds + 60)
    await sweep_once(conn, SETTINGS)
    assert (await status(conn, child.id), await status(conn, parent)) == ("failed", "partial")


async def test_a_job_requeued_after_its_only_capable_node_retired_is_blocked_by_the_next_sweep(conn, org):
    org_id, _ = org
    big = await add_node(conn, org_id, "big", [GPU48])
    job_id = await job(conn, org_id, vram_min_mb=40000, accelerators=["cuda"])
    got = await claims.claim(conn, node_id=big, organization_id=org_id, lease_seconds=60)
    assert got is not None and got.job_id == job_id
    await retire_node(conn, org_id, big, actor="admin")
    assert await status(conn, job_id) == "running"  # a job running on a retired node runs on
    await set_clock(conn, 61)  # its lease runs out: back to the queue, where nothing could run it
    report = await sweep_once(conn, SETTINGS)
    assert (report.leases_requeued, report.jobs_blocked) == (1, 1)
    assert await status(conn, job_id) == "blocked"
    types = [r.type for r in await store.read_stream(conn, store.job_stream(job_id))]
    assert types[-2:] == ["job.lease_expired", "job.blocked"]
    assert (await sweep_once(conn, SETTINGS)).jobs_blocked == 0  # judged once, not again every sweep


async def test_a_drain_that_blocks_work_notifies_once_with_the_last_position(db_url, conn, org):
    """The drain's transaction appends the node's event and the jobs' blocks: one NOTIFY carries both."""
    import psycopg

    from umbra.compute.nodes import drain_node

    org_id, _ = org
    big = await add_node(conn, org_id, "big", [GPU48])
    job_id = await job(conn, org_id, vram_min_mb=40000, accelerators=["cuda"])
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as listener:
        await listener.execute(f"LISTEN {store.LOG_CHANNEL}")
        await drain_node(conn, org_id, big, actor="admin")
        notes = [n async for n in listener.notifies(timeout=0.5)]
    assert await status(conn, job_id) == "blocked"
    assert [store.parse_hints(n.payload) for n in notes] == [[(org_id, await store.head_position(conn), 0)]]


async def test_retiring_the_only_gpu_blocks_its_job_however_many_kinds_are_queued(conn, org):
    """Re-examination judges each distinct requirement once, whatever the number of kinds sharing them:
    a thousand kinds of plain jobs queued in front must not hide the one job that needs CUDA."""
    from umbra.compute.blocked import reexamine_waiting_jobs
    from umbra.projections import jobs as queue

    from .queue_support import CPU64, GPU24, spec, submit as submit_one

    org_id, _ = org
    await add_node(conn, org_id, "cpu", [CPU64])
    gpu = await add_node(conn, org_id, "gpu", [GPU24])
    await submit(conn, org_id, [spec(f"a{i:04d}") for i in range(1_000)], actor="t", batch=True)
    cuda = await submit_one(conn, org_id, "b", requires={"accelerators": ["cuda"]})
    assert (await queue.load(conn, cuda.id, org_id)).status == "queued"
    await retire_node(conn, org_id, gpu, actor="admin")  # the only CUDA device is gone for good
    assert (await queue.load(conn, cuda.id, org_id)).status == "blocked"
    await reexamine_waiting_jobs(conn, org_id)  # and as the sweeper does, again: it stays blocked
    assert (await queue.load(conn, cuda.id, org_id)).status == "blocked"
