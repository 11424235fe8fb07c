"""A claim of several jobs places them within the memory its node reported free.

The jobs of one claim (``?max=N``) are decided together, against the memory
the node's last heartbeat reported: each job placed takes its memory on its
device before the next is judged. Before, one claim put two 16,000 MB jobs on
one 24,000 MB card.
"""

from __future__ import annotations

import pytest

from tests.helpers import bearer

pytestmark = pytest.mark.anyio


def gpu(label: str, free: int = 24000) -> dict:
    return {"kind": "gpu_discrete", "label": label, "vram_total_mb": 24576, "vram_free_mb": free, "ram_total_mb": 0,
            "ram_free_mb": 0, "throughput_factor": 10.0, "accelerators": ["cuda"], "resident_models": []}  # fmt: skip


async def online_node(client, key: str, name: str, devices: list[dict]) -> str:
    issued = await client.post("/v1/pairings", json={"name": name}, headers=bearer(key))
    redeemed = await client.post("/v1/pairings/redeem", json={"code": issued.json()["code"], "name": name,
                                                              "agent_version": "1", "devices": devices})  # fmt: skip
    credential = redeemed.json()["credential"]
    beat = await client.post("/v1/agent/heartbeat", json={"devices": devices, "agent_version": "1"}, headers=bearer(credential))
    assert beat.status_code == 200, beat.text
    return credential


async def submit(client, key: str, requires: dict, count: int = 1) -> list[str]:
    made = [await client.post("/v1/jobs", json={"kind": "infer", "requires": requires}, headers=bearer(key)) for _ in range(count)]
    assert all(m.status_code == 201 and m.json()["status"] == "queued" for m in made), [m.text for m in made]
    return [m.json()["id"] for m in made]


async def claim(client, credential: str, count: int) -> list[dict]:
    answer = await client.post(f"/v1/agent/claim?wait=0&max={count}", headers=bearer(credential))
    assert answer.status_code == 200, answer.text
    return [c["placement"] for c in answer.json()["claims"]]


async def test_one_claim_puts_no_more_on_a_card_than_it_has_free(client, org):
    _, key = org
    credential = await online_node(client, key, "one-card", [gpu("gpu0")])
    first, second = await submit(client, key, {"vram_min_mb": 16000}, count=2)
    placed = await claim(client, credential, 2)
    assert [p["device_id"] for p in placed] == ["gpu0"]  # the second does not fit beside the first
    job = (await client.get(f"/v1/jobs/{second}", headers=bearer(key))).json()
    assert job["status"] == "queued" and job["lease_owner"] is None


async def test_the_next_job_of_a_claim_goes_to_the_card_with_room(client, org):
    _, key = org
    credential = await online_node(client, key, "two-cards", [gpu("gpu0"), gpu("gpu1")])
    await submit(client, key, {"vram_min_mb": 16000}, count=3)
    placed = await claim(client, credential, 3)
    assert sorted(p["device_id"] for p in placed) == ["gpu0", "gpu1"]


async def test_jobs_of_one_model_share_it_once_it_is_loaded(client, org):
    """The first job loads the model; the next ones find it resident, as a resident model is not loaded twice."""
    _, key = org
    put = await client.put("/v1/models/big:16b", json={"vram_min_mb": 16000}, headers=bearer(key))
    assert put.status_code == 200, put.text
    credential = await online_node(client, key, "one-card", [gpu("gpu0")])
    await submit(client, key, {"models": ["big:16b"]}, count=3)
    placed = await claim(client, credential, 3)
    assert [(p["device_id"], p["resident"]) for p in placed] == [("gpu0", False), ("gpu0", True), ("gpu0", True)]


async def test_jobs_that_need_no_memory_are_all_taken(client, org):
    _, key = org
    credential = await online_node(client, key, "one-card", [gpu("gpu0", free=100)])
    await submit(client, key, {}, count=5)
    assert len(await claim(client, credential, 5)) == 5
