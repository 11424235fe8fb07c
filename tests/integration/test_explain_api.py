"""``GET /v1/jobs/{id}/explain`` over real HTTP: queued, blocked, running and finished jobs, and refusals."""

from __future__ import annotations

import msgspec
import pytest

from umbra.compute import claims
from umbra.compute.accounts import create_api_key, create_organization
from umbra.compute.nodes import drain_node, retire_node
from umbra.events.types import Device

from .queue_support import CPU8, CPU64, GPU24, add_node, beat, register_model, submit
from tests.helpers import bearer

pytestmark = pytest.mark.anyio


async def explain(client, key: str, job_id) -> dict:
    response = await client.get(f"/v1/jobs/{job_id}/explain", headers=bearer(key))
    assert response.status_code == 200, response.text
    return response.json()


async def test_a_queued_job_lists_every_device_and_says_where_it_would_run(client, conn, org):
    org_id, key = org
    gpu_box = await add_node(conn, org_id, "gpu-box", [GPU24])
    cpu_box = await add_node(conn, org_id, "cpu-box", [CPU8])
    new_box = await add_node(conn, org_id, "new-box", [GPU24], online=False)
    job = await submit(conn, org_id, requires={"vram_min_mb": 20000})
    body = await explain(client, key, job.id)
    assert body["job_id"] == str(job.id) and body["status"] == "queued"
    assert body["eligible"] == [{
        "node_id": str(gpu_box), "node_name": "gpu-box", "device_label": "gpu0", "device_kind": "gpu_discrete",
        "via": "vram", "score": 10.0, "resident": False, "would_evict": [], "placement_reason": "placed:gpu_discrete",
        "estimated_seconds": None,
    }]  # fmt: skip
    # Node order is name order (the claim's reader): cpu-box, gpu-box, new-box.
    assert [(r["node_id"], r["device_label"], r["reason"]) for r in body["ineligible"]] == [
        (str(cpu_box), "cpu", "ram_insufficient"), (str(new_box), "gpu0", "node_provisioning"),
    ]  # fmt: skip
    assert body["ineligible"][0]["needed_mb"] == 20000 and body["ineligible"][0]["available_mb"] == 6000
    assert body["summary"] == (
        "Can run on 1 device; the best is gpu-box/gpu0 via vram (score 10, placed:gpu_discrete); "
        "nothing holds it back: the next claim by an eligible node takes it."
    )
    assert body["ahead"] == 0 and body["not_before"] is None and body["placement"] is None


async def test_jobs_ahead_are_counted_only_when_the_same_nodes_would_take_them_first(client, conn, org):
    org_id, key = org
    await add_node(conn, org_id, "gpu-box", [GPU24])
    await add_node(conn, org_id, "cpu-box", [CPU64])
    for _ in range(2):
        await submit(conn, org_id, priority=1, requires={"accelerators": ["cuda"]})  # gpu-box would take these first
    await submit(conn, org_id, priority=1, requires={"vram_min_mb": 30000})  # only cpu-box can run it (from RAM)
    await submit(conn, org_id, priority=500, requires={"accelerators": ["cuda"]})  # behind, not ahead
    job = await submit(conn, org_id, priority=100, requires={"vram_min_mb": 1000, "accelerators": ["cuda"]})
    body = await explain(client, key, job.id)
    assert body["ahead"] == 2
    assert body["summary"].endswith("; 2 jobs ahead of it in the queue would be claimed first by the same nodes.")


async def test_a_job_no_device_fits_now_names_the_shortfall_and_the_absent_nodes(client, conn, org):
    org_id, key = org
    busy = Device(kind="gpu_discrete", label="gpu0", vram_total_mb=24576, vram_free_mb=10000, accelerators=("cuda",))
    gpu_box = await add_node(conn, org_id, "gpu-box", [GPU24])
    await beat(conn, org_id, gpu_box, [busy])
    await add_node(conn, org_id, "spare-a", [GPU24], online=False)
    spare_b = await add_node(conn, org_id, "spare-b", [GPU24])
    await drain_node(conn, org_id, spare_b)
    job = await submit(conn, org_id, requires={"vram_min_mb": 20000})
    body = await explain(client, key, job.id)
    assert body["status"] == "queued" and body["eligible"] == []  # 24576 MB in total: it can run, just not now
    assert body["summary"] == (
        "No device can take it now: needs 20000 MB VRAM, the largest free is 10000 MB on gpu-box/gpu0; "
        "1 node is still provisioning (paired, never heard from); 1 node is draining."
    )


async def test_a_retried_job_says_it_is_not_due_yet(client, conn, org):
    org_id, key = org
    node = await add_node(conn, org_id, "gpu-box", [GPU24])
    job = await submit(conn, org_id)
    held = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60)
    await claims.fail(conn, organization_id=org_id, node_id=node, job_id=job.id, attempt=held.attempt, error="flaky", retry=True)
    body = await explain(client, key, job.id)
    assert body["status"] == "queued" and body["eligible"][0]["node_name"] == "gpu-box"
    assert body["not_before"] is not None
    assert "; it is not due until " in body["summary"] and "a retry backoff" in body["summary"]


async def test_a_blocked_job_and_its_explanation_give_the_same_reason_as_the_fleet_changes(client, conn, org):
    org_id, key = org
    gpu_box = await add_node(conn, org_id, "gpu-box", [GPU24])
    big = await submit(conn, org_id, requires={"vram_min_mb": 40000})
    modelled = await submit(conn, org_id, requires={"models": ["llama"]})

    async def agree(job_id) -> dict:
        job = (await client.get(f"/v1/jobs/{job_id}", headers=bearer(key))).json()
        body = await explain(client, key, job_id)
        assert body["status"] == job["status"]
        if job["status"] == "blocked":
            assert body["blocked_reason"] == job["blocked_reason"]
            assert body["summary"].startswith("Blocked because ")
        return body

    body = await agree(big.id)
    assert body["blocked_reason"] == "no_eligible_device: needs 40000 MB VRAM, largest is 24576 MB (gpu-box/gpu0)"
    assert body["summary"].startswith(
        "Blocked because no registered device could ever run it: needs 40000 MB VRAM, largest is 24576 MB "
        "(gpu-box/gpu0); it fails at "
    )
    assert [r["reason"] for r in body["ineligible"]] == ["vram_insufficient"]
    assert (await agree(modelled.id))["blocked_reason"] == "model_not_registered: llama"

    # A bigger GPU is paired (never heard from yet): the shortfall names it, in both places.
    await add_node(conn, org_id, "bigger", [Device(kind="gpu_discrete", label="g", vram_total_mb=32768, vram_free_mb=32768)],
                   online=False)  # fmt: skip
    assert "largest is 32768 MB (bigger/g)" in (await agree(big.id))["blocked_reason"]
    # gpu-box reports a bigger card in a heartbeat: re-examined there, and explain says the same.
    upgraded = Device(kind="gpu_discrete", label="gpu0", vram_total_mb=36864, vram_free_mb=36864, accelerators=("cuda",))
    await beat(conn, org_id, gpu_box, [upgraded])
    assert "largest is 36864 MB (gpu-box/gpu0)" in (await agree(big.id))["blocked_reason"]
    await register_model(conn, org_id, "llama", vram_min_mb=30000)
    assert (await agree(modelled.id))["status"] == "queued"  # runnable on bigger once it is heard from
    huge = await add_node(conn, org_id, "huge", [Device(kind="gpu_discrete", label="g", vram_total_mb=49152, vram_free_mb=49152)])
    body = await agree(big.id)
    assert body["status"] == "queued" and body["eligible"][0]["node_id"] == str(huge)


async def test_a_running_job_names_its_recorded_placement_and_a_finished_one_how_it_ended(client, conn, org):
    org_id, key = org
    node = await add_node(conn, org_id, "gpu-box", [GPU24])
    job = await submit(conn, org_id, requires={"accelerators": ["cuda"]})
    held = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60)
    body = await explain(client, key, job.id)
    assert (body["status"], body["eligible"], body["ineligible"]) == ("running", [], [])
    assert body["placement"] == held.placement and body["placement_node_name"] == "gpu-box"
    assert body["summary"].startswith("Running on gpu-box/gpu0 via vram (placed:gpu_discrete), attempt 1 of 3; its lease expires in ")
    await claims.complete(conn, organization_id=org_id, node_id=node, job_id=job.id, attempt=1, result={"ok": True})
    body = await explain(client, key, job.id)
    assert body["status"] == "complete" and body["summary"] == "Complete on gpu-box/gpu0 after attempt 1."


async def test_a_container_counts_its_finished_children(client, conn, org):
    org_id, key = org
    node = await add_node(conn, org_id, "gpu-box", [GPU24])
    parent = await submit(conn, org_id)
    await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60)
    children = [msgspec.convert({"kind": "part"}, claims.ChildRequest) for _ in range(3)]
    made = await claims.add_children(conn, organization_id=org_id, node_id=node, job_id=parent.id, attempt=1, children=children)
    got = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60)
    await claims.complete(conn, organization_id=org_id, node_id=node, job_id=got.job_id, attempt=1, result=None)
    body = await explain(client, key, parent.id)
    assert body["summary"] == "Running as a container: 1 of 3 children finished; it settles when all have."
    assert {str(c.id) for c in made} >= {str(got.job_id)}


async def test_explain_refuses_other_organizations_unknown_ids_and_missing_scopes(client, conn, org):
    org_id, key = org
    job = await submit(conn, org_id)
    other_id, other_key = await create_organization(conn, "other")
    before = (await (await conn.execute("SELECT count(*), max(position) FROM events")).fetchone())
    response = await client.get(f"/v1/jobs/{job.id}/explain", headers=bearer(other_key))
    assert response.status_code == 404 and response.json()["error"] == "job_not_found"
    for path in ("/v1/jobs/00000000-0000-0000-0000-000000000000/explain", "/v1/jobs/not-a-uuid/explain"):
        response = await client.get(path, headers=bearer(key))
        assert response.status_code == 404 and response.json()["error"] == "job_not_found"
    assert (await client.get(f"/v1/jobs/{job.id}/explain")).status_code == 401
    writer = await create_api_key(conn, org_id, ["jobs:write"])
    response = await client.get(f"/v1/jobs/{job.id}/explain", headers=bearer(writer))
    assert response.status_code == 403 and response.json()["error"] == "forbidden"
    after = (await (await conn.execute("SELECT count(*), max(position) FROM events")).fetchone())
    assert after == before


async def test_draining_or_retiring_a_node_keeps_the_stored_blocked_reason_and_explain_in_agreement(client, conn, org):
    org_id, key = org
    small = await add_node(conn, org_id, "small", [GPU24])
    big = await add_node(conn, org_id, "big", [Device(kind="gpu_discrete", label="g", vram_total_mb=32768, vram_free_mb=32768)])
    job = await submit(conn, org_id, requires={"vram_min_mb": 40000})
    for change, expected in (
        (lambda: drain_node(conn, org_id, big), "no_eligible_device: needs 40000 MB VRAM, largest is 24576 MB (small/gpu0)"),
        (lambda: retire_node(conn, org_id, small), "no_eligible_device: no active node with devices is registered"),
    ):
        await change()
        stored = (await client.get(f"/v1/jobs/{job.id}", headers=bearer(key))).json()["blocked_reason"]
        assert stored == (await explain(client, key, job.id))["blocked_reason"] == expected



async def test_times_are_utc_whatever_the_sessions_time_zone(conn, org):
    from umbra.compute.explain import explain as explain_job

    org_id, _ = org
    node = await add_node(conn, org_id, "gpu-box", [GPU24])
    job = await submit(conn, org_id)
    held = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60)
    await claims.fail(conn, organization_id=org_id, node_id=node, job_id=job.id, attempt=held.attempt, error="x", retry=True)
    await conn.execute("SET timezone = 'Asia/Kolkata'")
    body = msgspec.json.decode(msgspec.json.encode(await explain_job(conn, org_id, job.id)))
    assert body["not_before"].endswith("Z"), body["not_before"]
    assert "Z (" in body["summary"]
