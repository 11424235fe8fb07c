"""A claim judges the memory its node reported, less what the jobs claimed since that report will take.

The node's report says what memory is free as the agent last measured it. A
job claimed after that report is not in it: before, a second claim for the
same node (two agents on one node, or one agent's claims one after another
between two beats) found the first job's memory still free, and one
24,000 MB card took two 16,000 MB jobs. Now such a job's memory is reserved
until a report recorded after its claim shows it (for a job naming models:
once they are resident there), and its models are never evicted for another.
"""

from __future__ import annotations

import msgspec
import pytest

from tests.helpers import bearer
from umbra.compute import batch_commands, claims
from umbra.compute.batch_commands import Command
from umbra.compute.explain import explain
from umbra.events.types import ResidentModel

from .queue_support import GPU24, add_node, beat, register_model, submit

pytestmark = pytest.mark.anyio


async def claim_one(conn, org_id, node_id):
    return await claims.claim(conn, node_id=node_id, organization_id=org_id, lease_seconds=60)


async def claim_in_one_batch(conn, commands):
    staged, _ = await batch_commands.stage(conn, commands)
    await batch_commands.write(conn, staged)
    return staged


def reported(free: int, *resident: tuple[str, int]):
    return msgspec.structs.replace(GPU24, vram_free_mb=free, resident_models=tuple(ResidentModel(slug=s, vram_held_mb=mb) for s, mb in resident))


async def test_a_second_claim_before_the_next_report_finds_the_first_jobs_memory_taken(conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "one-card", [GPU24])
    first = await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    second = await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    assert (await claim_one(conn, org_id, node)).job_id == first.id
    assert await claim_one(conn, org_id, node) is None, "the card's 24,000 MB took two 16,000 MB jobs"
    small = await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 6000})
    claimed = await claim_one(conn, org_id, node)
    assert claimed is not None and claimed.job_id == small.id  # the 8,000 MB left still take what fits
    assert second.id != claimed.job_id


async def test_the_group_commit_reserves_the_memory_of_jobs_claimed_in_an_earlier_batch(conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "one-card", [GPU24])
    for _ in range(2):
        await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    assert len(await claim_in_one_batch(conn, [Command("claim", org_id, node)])) == 1
    assert await claim_in_one_batch(conn, [Command("claim", org_id, node)]) == []


async def test_two_claimers_of_one_node_in_one_batch_share_its_memory(conn, org):
    """Two agents on one node whose claims land in the same batch: what the first takes, the second finds taken."""
    org_id, _ = org
    node = await add_node(conn, org_id, "one-card", [GPU24])
    for _ in range(2):
        await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    staged = await claim_in_one_batch(conn, [Command("claim", org_id, node), Command("claim", org_id, node)])
    assert len(staged) == 1, "two claimers of one 24,000 MB card took a 16,000 MB job each in one batch"


async def test_a_report_recorded_after_the_claim_accounts_for_the_job_once(conn, org):
    """Once a report recorded after the claim shows the job's memory taken, the job reserves nothing more:
    its memory is not counted twice."""
    org_id, _ = org
    node = await add_node(conn, org_id, "one-card", [GPU24])
    await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    assert await claim_one(conn, org_id, node) is not None
    await beat(conn, org_id, node, [reported(8000)])  # the agent's job took its 16,000 MB
    fits = await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 7000})
    claimed = await claim_one(conn, org_id, node)
    assert claimed is not None and claimed.job_id == fits.id


async def test_a_job_whose_model_is_still_loading_keeps_its_reservation_past_a_later_report(conn, org):
    """A report recorded after the claim that does not show the job's model resident yet (the agent is still
    loading it) does not account for the model's memory: the job keeps its reservation."""
    org_id, _ = org
    await register_model(conn, org_id, "big:16b", vram_min_mb=16000)
    node = await add_node(conn, org_id, "one-card", [GPU24])
    await submit(conn, org_id, kind="infer", requires={"models": ["big:16b"]})
    assert await claim_one(conn, org_id, node) is not None
    await beat(conn, org_id, node, [reported(22000)])  # recorded (memory moved), the model not resident yet
    await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    assert await claim_one(conn, org_id, node) is None
    await beat(conn, org_id, node, [reported(8000, ("big:16b", 16000))])  # loaded: the report shows it now
    await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 7000})
    claimed = await claim_one(conn, org_id, node)
    assert claimed is not None and claimed.row.requires.vram_min_mb == 7000


async def test_a_claim_never_evicts_the_model_a_running_job_of_an_earlier_claim_runs_on(conn, org):
    org_id, _ = org
    await register_model(conn, org_id, "m", vram_min_mb=16000)
    await register_model(conn, org_id, "n", vram_min_mb=6000, vram_preferred_mb=12000)
    node = await add_node(conn, org_id, "one-card", [reported(8000, ("m", 16000))])
    await submit(conn, org_id, kind="infer", requires={"models": ["m"]})
    on_m = await claim_one(conn, org_id, node)
    assert on_m is not None and on_m.placed.resident
    await submit(conn, org_id, kind="infer", requires={"models": ["n"]})
    beside = await claim_one(conn, org_id, node)
    assert beside is not None, "n's 6,000 MB fit in the 8,000 MB free"
    assert beside.placed.would_evict == (), f"a claim evicted {beside.placed.would_evict} while a job runs on it"


async def test_a_completion_that_claims_the_next_job_frees_the_memory_of_the_job_it_completes(client, org):
    """``complete?claim_next`` in one batch: the completed job's memory is free for the job it claims next."""
    _, key = org
    issued = await client.post("/v1/pairings", json={"name": "one-card"}, headers=bearer(key))
    card = {"kind": "gpu_discrete", "label": "gpu0", "vram_total_mb": 24576, "vram_free_mb": 24000, "accelerators": ["cuda"]}
    redeemed = await client.post("/v1/pairings/redeem", json={"code": issued.json()["code"], "name": "one-card",
                                                              "agent_version": "1", "devices": [card]})  # fmt: skip
    credential = redeemed.json()["credential"]
    assert (await client.post("/v1/agent/heartbeat", json={"devices": [card]}, headers=bearer(credential))).status_code == 200
    for _ in range(2):
        made = await client.post("/v1/jobs", json={"kind": "infer", "requires": {"vram_min_mb": 16000}}, headers=bearer(key))
        assert made.status_code == 201, made.text
    first = (await client.post("/v1/agent/claim?wait=0", headers=bearer(credential))).json()
    done = await client.post(f"/v1/agent/jobs/{first['job']['id']}/complete?claim_next=true", headers=bearer(credential),
                             json={"attempt": first["job"]["attempt"], "result": {}})  # fmt: skip
    assert done.status_code == 200, done.text
    assert done.json()["next_claim"] is not None, f"the completion claimed nothing next: {done.json()}"


async def test_explain_judges_the_node_as_a_claim_would(conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "one-card", [GPU24])
    await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    assert await claim_one(conn, org_id, node) is not None
    waiting = await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    explained = await explain(conn, org_id, waiting.id)
    assert not explained.eligible
    assert [v.reason for v in explained.ineligible] == ["vram_insufficient"]
