"""Model affinity (``UMBRA_MODEL_AFFINITY_SECONDS``): a node takes the job whose model it holds before an older
one of the same priority that would make it load another, until that one has waited the affinity; off by
default, the queue's order stands. Through the single claim and through the agents' group commit alike."""

from __future__ import annotations

import re
from contextlib import asynccontextmanager

import anyio
import httpx
import msgspec
import pytest
from psycopg_pool import AsyncConnectionPool

from tests.conftest import LiveServer
from tests.helpers import bearer
from umbra import metrics
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


async def register_both(conn, org_id):
    for slug in ("llama", "mistral"):
        await register_model(conn, org_id, slug, vram_min_mb=8000)


async def fleet(conn, org_id):
    await register_both(conn, org_id)
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
            agent = await paired(client, key, "rig-2", HOLDS_MISTRAL)
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
    await register_both(conn, org_id)
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


# -- across nodes: a node leaves a job to the node that holds its models -----------------------------------


async def two_nodes(conn, org_id):
    """``cold`` holds mistral, ``warm`` holds llama; both online."""
    await register_both(conn, org_id)
    return await add_node(conn, org_id, "cold", [HOLDS_MISTRAL]), await add_node(conn, org_id, "warm", [HOLDS_LLAMA])


async def test_an_idle_node_leaves_a_job_to_the_node_that_holds_its_model_until_it_has_waited_the_affinity(conn, org):
    """llama's job is the only one queued. The node holding mistral has nothing else to take, yet with an
    affinity of 60 s it leaves the job to the node holding llama, which takes it resident. A second such job,
    once it has waited the affinity, the cold node takes: no job waits longer for its holder."""
    org_id, _ = org
    cold, warm = await two_nodes(conn, org_id)
    await submit(conn, org_id, "chat", requires={"models": ["llama"]})
    assert await take(conn, org_id, cold, 60) is None
    claimed = await claims.claim(conn, node_id=warm, organization_id=org_id, lease_seconds=60, affinity_seconds=60)
    assert (model_of(claimed), claimed.placed.resident) == ("llama", True)
    await submit(conn, org_id, "chat", requires={"models": ["llama"]})
    assert await take(conn, org_id, cold, 60) is None
    await set_clock(conn, 61)
    for node, device in ((cold, HOLDS_MISTRAL), (warm, HOLDS_LLAMA)):
        await beat(conn, org_id, node, [device])  # both heard from a minute later
    assert await take(conn, org_id, cold, 60) == "llama"


async def test_a_job_is_taken_at_once_when_no_node_that_could_start_it_holds_its_model(conn, org):
    """Nobody to leave it to: affinity off, the holder silent past the stale threshold (offline), or its card
    cordoned. Then the cold node takes the job at once, as with one node."""
    org_id, _ = org
    cold, warm = await two_nodes(conn, org_id)
    await submit(conn, org_id, "chat", requires={"models": ["llama"]})
    await conn.execute("UPDATE nodes SET cordoned = '{\"gpu0\": \"maintenance\"}' WHERE id = %s", (warm,))
    assert await take(conn, org_id, cold, 60) == "llama"
    await conn.execute("UPDATE nodes SET cordoned = '{}' WHERE id = %s", (warm,))
    await submit(conn, org_id, "chat", requires={"models": ["llama"]})
    await set_clock(conn, 50)
    await beat(conn, org_id, cold, [HOLDS_MISTRAL])  # warm's last word is 50 s old: offline
    assert await take(conn, org_id, cold, 60) == "llama"
    await submit(conn, org_id, "chat", requires={"models": ["llama"]})
    await beat(conn, org_id, warm, [HOLDS_LLAMA])
    assert await take(conn, org_id, cold, 0) == "llama"


async def test_the_group_commit_leaves_the_job_to_its_holder_and_says_when_to_look_again(db_url, conn, org):
    """In one batch, the cold node asking first: the warm node gets llama's job and the cold one nothing, with
    the seconds until it may take such a job (``later``); alone, the cold one is told the same."""
    org_id, _ = org
    cold, warm = await two_nodes(conn, org_id)
    for _ in range(2):
        await submit(conn, org_id, "chat", requires={"models": ["llama"]})

    def asks(node_id):
        return lambda: group.claim_many(node_id=node_id, organization_id=org_id, count=1, lease_seconds=60, stale_seconds=45,
                                        empty="empty", later=lambda seconds: ("later", seconds))  # fmt: skip

    left_before = metrics.CLAIMS_LEFT_TO_HOLDERS._value.get()
    async with affinity_group(db_url) as (group, tg):
        got_cold, got_warm = await in_one_batch(group, tg, [asks(cold), asks(warm)])
        assert group.batches == 1
        assert [model_of(c) for c in got_warm] == ["llama"] and got_warm[0].placed.resident
        assert got_cold[0] == "later" and 50 < got_cold[1] <= 60, got_cold
        alone = await asks(cold)()
        assert alone[0] == "later" and 50 < alone[1] <= 60, alone
    assert metrics.CLAIMS_LEFT_TO_HOLDERS._value.get() - left_before == 2
    queued = await (await conn.execute("SELECT count(*) FROM jobs WHERE status = 'queued'")).fetchone()
    assert queued == (1,)


async def paired(client, key, name: str, device: Device) -> dict[str, str]:
    """Pair a node over HTTP and heartbeat it: its agent's headers."""
    issued = await client.post("/v1/pairings", json={"name": name}, headers=bearer(key))
    body = msgspec.to_builtins(device)
    redeemed = (await client.post("/v1/pairings/redeem", json={"code": issued.json()["code"], "name": name, "devices": [body]})).json()
    agent = bearer(redeemed["credential"])
    assert (await client.post("/v1/agent/heartbeat", json={"devices": [body]}, headers=agent)).status_code == 200
    return agent


@asynccontextmanager
async def agents_of_two_nodes(db_url, conn, org, *, affinity: int):
    """A live server with a model affinity of ``affinity`` seconds (the safety poll a minute away: a parked claim
    wakes only as the hub wakes it) and ``cold`` (holding mistral) and ``warm`` (holding llama) paired over HTTP:
    a client, and each node's agent's headers."""
    org_id, key = org
    await register_both(conn, org_id)
    with LiveServer(db_url, UMBRA_MODEL_AFFINITY_SECONDS=str(affinity), UMBRA_POLL_FALLBACK_SECONDS="60") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            yield client, await paired(client, key, "cold", HOLDS_MISTRAL), await paired(client, key, "warm", HOLDS_LLAMA)


async def test_the_long_poll_wakes_the_holder_when_the_cold_node_waited_longest(db_url, conn, org):
    """The cold node has waited longest, so the new job's wake goes to it first: it passes the job over and the
    wake goes on to the node holding llama, which takes it; the cold one is still waiting when its poll ends.
    (The safety poll is a minute away: only the wake passed on can bring the job to the warm node.)"""
    _, key = org
    async with agents_of_two_nodes(db_url, conn, org, affinity=60) as (client, cold, warm):
        answers: dict[str, httpx.Response] = {}

        async def poll(name, headers, wait):
            answers[name] = await client.post("/v1/agent/claim", params={"wait": wait}, headers=headers)

        async with anyio.create_task_group() as tg:
            tg.start_soon(poll, "cold", cold, 4)
            await anyio.sleep(0.5)
            tg.start_soon(poll, "warm", warm, 10)
            await anyio.sleep(0.5)
            queued = await client.post("/v1/jobs", json={"kind": "chat", "requires": {"models": ["llama"]}}, headers=bearer(key))
            assert queued.status_code == 201, queued.text
    assert answers["warm"].status_code == 200, answers["warm"].text
    assert answers["warm"].json()["job"]["id"] == queued.json()["id"] and answers["warm"].json()["placement"]["resident"] is True
    assert answers["cold"].status_code == 204


async def test_a_parked_cold_node_takes_the_job_once_it_has_waited_the_affinity(db_url, conn, org):
    """The node holding llama is online but not asking (busy). The cold node's long-poll passes the job over,
    then looks again of its own accord when the job has waited the affinity (2 s) and takes it, loading
    llama; no notification comes at that moment, and the safety poll is a minute away."""
    _, key = org
    async with agents_of_two_nodes(db_url, conn, org, affinity=2) as (client, cold, _warm):
        answer: list[httpx.Response] = []

        async def poll():
            answer.append(await client.post("/v1/agent/claim", params={"wait": 20}, headers=cold))

        async with anyio.create_task_group() as tg:
            tg.start_soon(poll)
            await anyio.sleep(0.5)
            submitted = anyio.current_time()
            queued = await client.post("/v1/jobs", json={"kind": "chat", "requires": {"models": ["llama"]}}, headers=bearer(key))
            assert queued.status_code == 201, queued.text
        took = anyio.current_time() - submitted
    assert answer[0].status_code == 200, answer[0].text
    assert answer[0].json()["job"]["id"] == queued.json()["id"] and answer[0].json()["placement"]["resident"] is False
    assert took >= 1.5  # left to the holder for the affinity first (20 s, the poll's end, would mean no look again)


async def test_explain_says_a_job_is_left_to_the_node_that_holds_its_model(db_url, conn, org):
    """``GET /v1/jobs/{id}/explain`` on a server with an affinity of 60 s: the queued llama job is left to warm
    for about a minute more, and the summary says so (the cold node, asked now, takes nothing)."""
    _, key = org
    async with agents_of_two_nodes(db_url, conn, org, affinity=60) as (client, cold, _warm):
        queued = await client.post("/v1/jobs", json={"kind": "chat", "requires": {"models": ["llama"]}}, headers=bearer(key))
        assert (await client.post("/v1/agent/claim", params={"wait": 0}, headers=cold)).status_code == 204
        explained = await client.get(f"/v1/jobs/{queued.json()['id']}/explain", headers=bearer(key))
    assert explained.status_code == 200, explained.text
    assert re.search(r"nodes that would load llama leave it to warm, which holds it, for (5\d|60) s more \(model affinity\)\.$",
                     explained.json()["summary"]), explained.json()["summary"]  # fmt: skip
    assert [e["node_name"] for e in explained.json()["eligible"] if e["resident"]] == ["warm"]


async def test_a_job_is_not_left_to_a_holder_whose_agent_does_not_take_its_kind(conn, org):
    """warm holds llama, but its agent takes only ``embed`` (its heartbeat's kinds): it never claims a ``chat``
    job. Leaving the llama chat job to it kept the cold node idle for the whole affinity while ``explain`` said
    nothing held the job back; nobody else would take it, so the cold node takes it at once."""
    from umbra.compute.explain import explain

    org_id, _ = org
    cold, warm = await two_nodes(conn, org_id)
    await conn.execute("UPDATE nodes SET kinds = '{embed}' WHERE id = %s", (warm,))
    job = await submit(conn, org_id, "chat", requires={"models": ["llama"]})
    explained = await explain(conn, org_id, job.id, affinity_seconds=60)
    assert explained.summary.endswith("nothing holds it back: the next claim by an eligible node takes it."), explained.summary
    assert await take(conn, org_id, cold, 60) == "llama"


async def test_explain_says_a_job_is_left_to_a_holder_whose_card_its_running_job_fills(conn, org):
    """warm holds llama (8,576 MB) and runs a llama job that reserves the rest of its card: a claim judges its
    card busy until that job ends, yet warm, as it last reported, holds llama, and the cold node leaves the next
    llama job to it for the affinity (as delay scheduling does: docs/API.md). ``explain`` must say so, not that
    nothing holds the job back while every claim of the cold node takes nothing."""
    from umbra.compute.explain import explain

    org_id, _ = org
    await register_both(conn, org_id)
    cold = await add_node(conn, org_id, "cold", [HOLDS_MISTRAL])
    warm_card = msgspec.structs.replace(HOLDS_MISTRAL, resident_models=(ResidentModel(slug="llama", vram_held_mb=8576),))
    warm = await add_node(conn, org_id, "warm", [warm_card])
    await submit(conn, org_id, "chat", requires={"models": ["llama"], "vram_min_mb": 24576})
    claimed = await claims.claim(conn, node_id=warm, organization_id=org_id, lease_seconds=60)
    assert claimed is not None and claimed.placed.resident
    job = await submit(conn, org_id, "chat", requires={"models": ["llama"]})
    assert await take(conn, org_id, cold, 60) is None  # left to warm, which holds llama
    explained = await explain(conn, org_id, job.id, affinity_seconds=60)
    assert re.search(r"nodes that would load llama leave it to warm, which holds it, for (5\d|60) s more \(model affinity\)\.$",
                     explained.summary), explained.summary  # fmt: skip
