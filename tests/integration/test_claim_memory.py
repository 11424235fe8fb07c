"""A claim of several jobs places them within the memory its node reported free.

The jobs of one claim (``?max=N``) are decided together, against the memory
the node's last heartbeat reported: each job placed takes its memory on its
device before the next is judged. Before, one claim put two 16,000 MB jobs on
one 24,000 MB card.
"""

from __future__ import annotations

import psycopg
import pytest

from tests.helpers import bearer
from umbra.compute import batch_commands, claims, jobs
from umbra.compute.batch_commands import Command
from umbra.projections import jobs as queue

from .queue_support import GPU24, add_node, spec, submit

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


async def submit_jobs(client, key: str, requires: dict, count: int = 1) -> list[str]:
    made = [await client.post("/v1/jobs", json={"kind": "infer", "requires": requires}, headers=bearer(key)) for _ in range(count)]
    assert all(m.status_code == 201 and m.json()["status"] == "queued" for m in made), [m.text for m in made]
    return [m.json()["id"] for m in made]


async def submit_one(client, key: str, requires: dict) -> str:
    return (await submit_jobs(client, key, requires))[0]


async def claim(client, credential: str, count: int) -> list[dict]:
    answer = await client.post(f"/v1/agent/claim?wait=0&max={count}", headers=bearer(credential))
    assert answer.status_code == 200, answer.text
    return answer.json()["claims"]


async def placements(client, credential: str, count: int) -> list[dict]:
    return [c["placement"] for c in await claim(client, credential, count)]


async def test_one_claim_puts_no_more_on_a_card_than_it_has_free(client, org):
    _, key = org
    credential = await online_node(client, key, "one-card", [gpu("gpu0")])
    first, second = await submit_jobs(client, key, {"vram_min_mb": 16000}, count=2)
    placed = await placements(client, credential, 2)
    assert [p["device_id"] for p in placed] == ["gpu0"]  # the second does not fit beside the first
    job = (await client.get(f"/v1/jobs/{second}", headers=bearer(key))).json()
    assert job["status"] == "queued" and job["lease_owner"] is None


async def test_the_next_job_of_a_claim_goes_to_the_card_with_room(client, org):
    _, key = org
    credential = await online_node(client, key, "two-cards", [gpu("gpu0"), gpu("gpu1")])
    await submit_jobs(client, key, {"vram_min_mb": 16000}, count=3)
    placed = await placements(client, credential, 3)
    assert sorted(p["device_id"] for p in placed) == ["gpu0", "gpu1"]


async def test_jobs_of_one_model_share_it_once_it_is_loaded(client, org):
    """The first job loads the model; the next ones share it, as a resident model is not loaded twice (though not
    resident yet: they wait for the load too)."""
    _, key = org
    put = await client.put("/v1/models/big:16b", json={"vram_min_mb": 16000}, headers=bearer(key))
    assert put.status_code == 200, put.text
    credential = await online_node(client, key, "one-card", [gpu("gpu0")])
    await submit_jobs(client, key, {"models": ["big:16b"]}, count=3)
    placed = await placements(client, credential, 3)
    assert [(p["device_id"], p["resident"]) for p in placed] == [("gpu0", False)] * 3


async def test_jobs_that_need_no_memory_are_all_taken(client, org):
    _, key = org
    credential = await online_node(client, key, "one-card", [gpu("gpu0", free=100)])
    await submit_jobs(client, key, {}, count=5)
    assert len(await placements(client, credential, 5)) == 5


@pytest.mark.parametrize("resident_first", [False, True], ids=["loaded-by-the-claim", "resident-before"])
async def test_a_later_job_of_a_claim_never_evicts_the_model_an_earlier_one_runs_on(client, org, resident_first):
    """A later job of a claim never evicts a model an earlier one runs on: job 2 would have evicted m, which
    job 1 runs on, and with m's memory counted free again job 3 fitted too (28,000 MB of models in 20,000)."""
    _, key = org
    for slug, body in (("m", {"vram_min_mb": 8000, "vram_preferred_mb": 8000}),
                       ("n", {"vram_min_mb": 10000, "vram_preferred_mb": 16000}),
                       ("p", {"vram_min_mb": 10000})):  # fmt: skip
        assert (await client.put(f"/v1/models/{slug}", json=body, headers=bearer(key))).status_code == 200
    card = {"kind": "gpu_discrete", "label": "gpu0", "vram_total_mb": 24576, "vram_free_mb": 20000,
            "accelerators": ["cuda"], "resident_models": []}  # fmt: skip
    if resident_first:
        card |= {"vram_free_mb": 12000, "resident_models": [{"slug": "m", "vram_held_mb": 8000}]}
    credential = await online_node(client, key, "one-card", [card])
    for slug in ("m", "n", "p"):
        await submit_one(client, key, {"models": [slug]})
    claimed = await claim(client, credential, 3)
    placed = [(c["job"]["requires"]["models"][0], c["placement"]["would_evict"]) for c in claimed]
    in_use: set[str] = set()
    for slug, evicts in placed:
        assert not in_use & set(evicts), f"a job of the claim evicts {evicts}, which an earlier job of it runs on: {placed}"
        in_use.add(slug)
    floors = {"m": 8000, "n": 10000, "p": 10000}
    assert sum(floors[slug] for slug, _ in placed) <= 20000, f"the claim's models need more than the card's 20000 MB: {placed}"


async def test_a_unified_memory_device_is_not_counted_twice_by_one_claim(client, org):
    """gpu_integrated memory *is* system RAM: a job placed via vram takes RAM too, and the next job of the claim
    does not fit via ram in RAM the first one uses."""
    _, key = org
    mac = {"kind": "gpu_integrated", "label": "m2", "vram_total_mb": 16384, "vram_free_mb": 12288,
           "ram_total_mb": 65536, "ram_free_mb": 60000, "accelerators": ["metal"], "resident_models": []}  # fmt: skip
    credential = await online_node(client, key, "mac", [mac])
    await submit_one(client, key, {"vram_min_mb": 12000})  # via vram: 12000 MB of the unified memory
    await submit_one(client, key, {"vram_min_mb": 55000})  # via ram: 55000 MB of it
    claimed = await claim(client, credential, 2)
    taken = [(c["placement"]["via"], c["job"]["requires"]["vram_min_mb"]) for c in claimed]
    assert sum(mb for _, mb in taken) <= 60000, f"one claim put {taken} on a device with 60000 MB of unified memory free"


async def test_rows_a_full_claimer_locked_do_not_make_a_concurrent_claimer_report_nothing_left(db_url, conn, org):
    """The single-shape path locks only as many rows as the claimers' nodes have room for: a row locked and not
    handed out is skipped by a claimer of the other batch in flight, which then said nothing was left (ending
    the long-polls' wake chain) while jobs it could run stayed queued."""
    org_id, _ = org
    full = await add_node(conn, org_id, "a", [GPU24])
    other = await add_node(conn, org_id, "b", [GPU24])
    ids = [(await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})).id for _ in range(4)]
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as first, \
            await psycopg.AsyncConnection.connect(db_url, autocommit=True) as second:  # fmt: skip
        big = Command("claim", org_id, full, count=4)
        staged_a, _ = await batch_commands.stage(first, [big])
        assert len(staged_a) == 1  # the card fits one 16000 MB job: the others stay queued
        small = Command("claim", org_id, other)
        staged_b, _ = await batch_commands.stage(second, [small])
        await batch_commands.write(first, staged_a)
        await batch_commands.write(second, staged_b)
    still_queued = [i for i in ids if (await queue.load(conn, i, org_id)).status == "queued"]
    assert staged_b or not small.nothing_left, (
        f"claimer b reported nothing left while {len(still_queued)} jobs it can run stay queued")


async def test_a_claimer_whose_card_is_full_stops_reading_the_queue(conn, org, monkeypatch):
    """A claimer whose node has room for no queued shape any more stops reading the queue (the batch read up
    to MAX_SCAN_PAGES pages for a claimer that could take nothing)."""
    org_id, _ = org
    node = await add_node(conn, org_id, "a", [GPU24])
    for kind in ("a", "b"):  # two shapes: not the single-shape path
        await jobs.submit(conn, org_id, [spec(kind, requires={"vram_min_mb": 16000}) for _ in range(200)],
                          actor="test", batch=False)  # fmt: skip
    pages = 0
    original = claims.ClaimableScan.pages

    async def counted(self):
        nonlocal pages
        async for page in original(self):
            pages += 1
            yield page

    monkeypatch.setattr(claims.ClaimableScan, "pages", counted)
    command = Command("claim", org_id, node, count=2)
    staged, _ = await batch_commands.stage(conn, [command])
    await batch_commands.write(conn, staged)
    assert len(staged) == 1
    assert pages <= 2, f"a claimer with no room left read {pages} pages of the queue"


async def test_a_model_a_running_job_evicts_is_not_counted_resident_by_the_next_claim(client, org):
    """The first claim's job loads n and, for n's preferred size, evicts m (8,000 MB held). The node has not
    reported since. The next claim must not count m's memory twice: freed (the running job evicts it) and held
    for a job naming m. Before, it placed a 20,000 MB job on m beside n on a 24,576 MB card (n's 8,000 MB, m's
    8,000 and 12,000 more), which one claim of both jobs refuses."""
    _, key = org
    for slug, body in (("m", {"vram_min_mb": 8000}), ("n", {"vram_min_mb": 8000, "vram_preferred_mb": 20000})):
        assert (await client.put(f"/v1/models/{slug}", json=body, headers=bearer(key))).status_code == 200
    card = gpu("gpu0", free=16576) | {"resident_models": [{"slug": "m", "vram_held_mb": 8000}]}
    credential = await online_node(client, key, "one-card", [card])
    await submit_one(client, key, {"models": ["n"]})
    await submit_one(client, key, {"models": ["m"], "vram_min_mb": 20000})
    first = await client.post("/v1/agent/claim?wait=0", headers=bearer(credential))
    assert first.status_code == 200, first.text
    assert first.json()["job"]["requires"]["models"] == ["n"] and first.json()["placement"]["would_evict"] == ["m"]
    second = await client.post("/v1/agent/claim?wait=0", headers=bearer(credential))
    assert second.status_code == 204, f"the next claim put the job naming m beside n on a card they fill: {second.text}"
