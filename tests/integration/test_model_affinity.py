"""Model affinity (``UMBRA_MODEL_AFFINITY_SECONDS``): a node takes the job whose model it holds before an older
one of the same priority that would make it load another, until that one has waited the affinity; off by
default, the queue's order stands. Through the single claim and through the agents' group commit alike."""

from __future__ import annotations

from contextlib import asynccontextmanager

import anyio
import httpx
import msgspec
import pytest
from psycopg_pool import AsyncConnectionPool

from tests.conftest import LiveServer
from tests.helpers import bearer
from umbra.compute import claims, jobs
from umbra.compute.group_commit import GroupCommit, HintNotifier
from umbra.events.types import Device, ResidentModel

from .queue_support import add_node, beat, register_model, set_clock, spec, submit
from .test_group_commit import in_one_batch

pytestmark = pytest.mark.anyio

#: A 24 GB card holding mistral (8 GB), with room to load llama beside it.
HOLDS_MISTRAL = Device(kind="gpu_discrete", label="gpu0", vram_total_mb=24576, vram_free_mb=16000, accelerators=("cuda",),
                       resident_models=(ResidentModel(slug="mistral", vram_held_mb=8000),))  # fmt: skip


HOLDS_LLAMA = msgspec.structs.replace(HOLDS_MISTRAL, resident_models=(ResidentModel(slug="llama", vram_held_mb=8000),))


@asynccontextmanager
async def affinity_group(db_url: str, affinity: int = 60):
    """A group commit whose claims follow a model affinity of ``affinity`` seconds."""
    async with AsyncConnectionPool(db_url, min_size=1, max_size=4, kwargs={"autocommit": True}, open=False) as pool:
        group = GroupCommit(pool, HintNotifier(pool), affinity_seconds=affinity)
        async with anyio.create_task_group() as tg:
            yield group, tg
            tg.cancel_scope.cancel()


def claim_many(group, org_id, node_id, count):
    return lambda: group.claim_many(node_id=node_id, organization_id=org_id, count=count, lease_seconds=60, stale_seconds=45)


def model_of(claimed) -> str:
    return claimed.row.requires.models[0] if claimed.row.requires.models else claimed.row.kind


async def fleet(conn, org_id):
    for slug in ("llama", "mistral"):
        await register_model(conn, org_id, slug, vram_min_mb=8000)
    return await add_node(conn, org_id, "rig", [HOLDS_MISTRAL])


async def take(conn, org_id, node, affinity: int):
    claimed = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60, affinity_seconds=affinity)
    return claimed.row.requires.models[0] if claimed and claimed.row.requires.models else (claimed and claimed.row.kind)


async def test_the_node_takes_the_job_whose_model_it_holds_first_within_the_affinity(conn, org):
    """llama's job was queued first, mistral's after it; the card holds mistral. With an affinity of 60 s it
    takes mistral's job first (resident: no load), then llama's; the placement says it is resident."""
    org_id, _ = org
    node = await fleet(conn, org_id)
    await submit(conn, org_id, "chat", requires={"models": ["llama"]})
    await submit(conn, org_id, "chat", requires={"models": ["mistral"]})
    claimed = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60, affinity_seconds=60)
    assert (claimed.row.requires.models, claimed.placed.resident) == (("mistral",), True)
    assert await take(conn, org_id, node, 60) == "llama"


async def test_without_affinity_the_queue_order_stands(conn, org):
    org_id, _ = org
    node = await fleet(conn, org_id)
    await submit(conn, org_id, "chat", requires={"models": ["llama"]})
    await submit(conn, org_id, "chat", requires={"models": ["mistral"]})
    assert [await take(conn, org_id, node, 0), await take(conn, org_id, node, 0)] == ["llama", "mistral"]


async def test_a_job_that_waited_the_affinity_is_taken_in_its_place(conn, org):
    """Once llama's job has been queued longer than the affinity, the node loads llama for it rather than pass
    it over again: no job waits longer than the affinity for a node that holds its model."""
    org_id, _ = org
    node = await fleet(conn, org_id)
    await submit(conn, org_id, "chat", requires={"models": ["llama"]})
    await submit(conn, org_id, "chat", requires={"models": ["mistral"]})
    await set_clock(conn, 61)
    await beat(conn, org_id, node, [HOLDS_MISTRAL])  # heard from a minute later, as its agent would be
    assert await take(conn, org_id, node, 60) == "llama"


async def test_affinity_never_reorders_priorities_nor_leaves_a_node_idle(conn, org):
    """A higher-priority job that needs a load still goes first, and a node with nothing it holds the model for
    takes the job that needs a load at once rather than waiting."""
    org_id, _ = org
    node = await fleet(conn, org_id)
    await submit(conn, org_id, "chat", requires={"models": ["llama"]}, priority=-5)
    await submit(conn, org_id, "chat", requires={"models": ["mistral"]})
    assert await take(conn, org_id, node, 60) == "llama"
    assert await take(conn, org_id, node, 60) == "mistral"
    await submit(conn, org_id, "chat", requires={"models": ["llama"]})
    assert await take(conn, org_id, node, 60) == "llama"


async def test_the_agents_claims_follow_the_affinity_the_server_is_given(db_url, conn, org):
    """Over HTTP, through the group commit: a server started with ``UMBRA_MODEL_AFFINITY_SECONDS=60`` hands the
    node mistral's job first, and a completion that claims the next job (``claim_next``) hands it llama's."""
    org_id, key = org
    await fleet(conn, org_id)
    with LiveServer(db_url, UMBRA_MODEL_AFFINITY_SECONDS="60") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            issued = await client.post("/v1/pairings", json={"name": "rig-2"}, headers=bearer(key))
            device = msgspec.to_builtins(HOLDS_MISTRAL)
            redeemed = (await client.post("/v1/pairings/redeem", json={"code": issued.json()["code"], "name": "rig-2",
                                                                       "devices": [device]})).json()  # fmt: skip
            agent = bearer(redeemed["credential"])
            assert (await client.post("/v1/agent/heartbeat", json={"devices": [device]}, headers=agent)).status_code == 200
            for model in ("llama", "mistral"):
                queued = await client.post("/v1/jobs", json={"kind": "chat", "requires": {"models": [model]}}, headers=bearer(key))
                assert queued.status_code == 201, queued.text
            first = (await client.post("/v1/agent/claim", params={"wait": 0}, headers=agent)).json()
            assert first["job"]["requires"]["models"] == ["mistral"] and first["placement"]["resident"] is True
            done = await client.post(f"/v1/agent/jobs/{first['job']['id']}/complete", params={"claim_next": "true"},
                                     json={"attempt": 1, "result": {}}, headers=agent)  # fmt: skip
            assert done.json()["next_claim"]["job"]["requires"]["models"] == ["llama"], done.text


async def test_the_job_whose_model_the_node_holds_is_found_behind_a_backlog_of_loads(db_url, conn, org):
    """Forty young llama jobs were queued before mistral's: the node holding mistral still takes mistral's job,
    through the single claim and through the group commit. The pages a claim reads end where the first shape's
    rows run out; affinity offers every shape's head read, or a backlog (when it matters) would hide it."""
    org_id, _ = org
    node = await fleet(conn, org_id)
    await jobs.submit(conn, org_id, [spec("chat", requires={"models": ["llama"]}) for _ in range(40)], actor="test", batch=True)
    for _ in range(2):
        await submit(conn, org_id, "chat", requires={"models": ["mistral"]})
    claimed = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60, affinity_seconds=60)
    assert (model_of(claimed), claimed.placed.resident) == ("mistral", True)
    async with affinity_group(db_url) as (group, tg):
        [got] = await in_one_batch(group, tg, [claim_many(group, org_id, node, 1)])
    assert [model_of(c) for c in got] == ["mistral"]


@pytest.mark.parametrize("mistral_first", [True, False])
async def test_two_nodes_in_one_batch_each_take_the_job_of_the_model_they_hold(db_url, conn, org, mistral_first):
    org_id, _ = org
    for slug in ("llama", "mistral"):
        await register_model(conn, org_id, slug, vram_min_mb=8000)
    a = await add_node(conn, org_id, "a", [HOLDS_MISTRAL])
    b = await add_node(conn, org_id, "b", [HOLDS_LLAMA])
    await submit(conn, org_id, "chat", requires={"models": ["llama"]})
    await submit(conn, org_id, "chat", requires={"models": ["mistral"]})
    async with affinity_group(db_url) as (group, tg):
        calls = [claim_many(group, org_id, a, 1), claim_many(group, org_id, b, 1)]
        got_a, got_b = await in_one_batch(group, tg, calls) if mistral_first else (await in_one_batch(group, tg, calls[::-1]))[::-1]
        assert group.batches == 1
    assert ([model_of(c) for c in got_a], [model_of(c) for c in got_b]) == (["mistral"], ["llama"])


async def test_a_claim_of_several_takes_the_held_models_jobs_first(db_url, conn, org):
    org_id, _ = org
    node = await fleet(conn, org_id)
    for model in ("llama", "mistral", "llama", "mistral"):
        await submit(conn, org_id, "chat", requires={"models": [model]})
    async with affinity_group(db_url) as (group, tg):
        [got] = await in_one_batch(group, tg, [claim_many(group, org_id, node, 3)])
    assert [model_of(c) for c in got][:2] == ["mistral", "mistral"]


async def test_a_delayed_job_waits_from_when_it_fell_due(conn, org):
    """A llama job held back 90 s (a retry's back-off, a delayed submission) has waited nothing when it falls
    due: a node holding mistral takes a fresh mistral job first, and a node holding llama gets its window."""
    org_id, _ = org
    node = await fleet(conn, org_id)
    delayed = await submit(conn, org_id, "chat", requires={"models": ["llama"]})
    await conn.execute("UPDATE jobs SET not_before = umbra_now() + interval '90 seconds' WHERE id = %s", (delayed.id,))
    await set_clock(conn, 91)
    await beat(conn, org_id, node, [HOLDS_MISTRAL])
    await submit(conn, org_id, "chat", requires={"models": ["mistral"]})
    claimed = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60, affinity_seconds=60)
    assert model_of(claimed) == "mistral"
