"""The claim places a job on the device explain ranks first, and a model a heartbeat reports resident moves it."""

from __future__ import annotations

from uuid import UUID

import msgspec
import pytest

from tests.helpers import bearer
from umbra.events import store
from umbra.events.types import ResidentModel

from .queue_support import GPU24, register_model, submit
from .test_explain_api import explain
from .test_longpoll import online_node

pytestmark = pytest.mark.anyio


async def test_the_claim_takes_the_device_explain_ranks_first_and_a_reported_resident_model_moves_it(conn, org, client):
    """A node's claim places the job on the device explain ranks first, with explain's score; once a heartbeat
    reports the job's model resident on the slower card, both move to it (8.0 resident beats 10.0 × 0.7 cold)
    and the placement says ``resident: true``, ``estimated_seconds: 0.0``, ``would_evict: []``, on the Job and
    in its ``job.claimed`` event."""
    org_id, key = org
    slow = msgspec.structs.replace(GPU24, label="gpu1", throughput_factor=8.0)
    node_id, credential = await online_node(conn, org_id, "box", [GPU24, slow])
    await register_model(conn, org_id, "m", vram_min_mb=8000, load_seconds=45)

    async def claim_one() -> tuple[dict, UUID]:
        job = await submit(conn, org_id, kind="infer", requires={"models": ["m"]})
        first = (await explain(client, key, job.id))["eligible"][0]
        claim = await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(credential))
        assert claim.status_code == 200, claim.text
        assert claim.json()["job"]["id"] == str(job.id)
        placement = claim.json()["placement"]
        assert (placement["device_id"], placement["score"]) == (first["device_label"], first["score"])
        return placement, job.id

    cold, cold_job = await claim_one()
    assert (cold["device_id"], cold["resident"], cold["estimated_seconds"], cold["score"]) == ("gpu0", False, 45.0, 7.0)
    done = await client.post(f"/v1/agent/jobs/{cold_job}/complete", json={"attempt": 1, "result": {}},
                             headers=bearer(credential))  # fmt: skip
    assert done.status_code == 200, done.text
    # Nothing runs now; the agent reports m resident (idle) on the slower card only.
    warm_slow = msgspec.structs.replace(slow, vram_free_mb=14000, resident_models=(ResidentModel(slug="m", vram_held_mb=10000),))
    beat = await client.post("/v1/agent/heartbeat", json={"devices": msgspec.to_builtins([GPU24, warm_slow]), "agent_version": "1"},
                             headers=bearer(credential))  # fmt: skip
    assert beat.status_code == 200, beat.text
    warm, warm_job = await claim_one()
    assert warm == {**warm, "node_id": str(node_id), "device_id": "gpu1", "device_kind": "gpu_discrete",
                    "reason": "placed:gpu_discrete", "resident": True, "would_evict": [], "estimated_seconds": 0.0,
                    "score": 8.0}  # fmt: skip
    assert (await client.get(f"/v1/jobs/{warm_job}", headers=bearer(key))).json()["placement"] == warm
    [claimed] = [e for e in await store.read_stream(conn, store.job_stream(warm_job)) if e.type == "job.claimed"]
    assert (claimed.event.placement.device_id, claimed.event.placement.resident) == ("gpu1", True)
