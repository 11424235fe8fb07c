"""A claim places no more on a device than the jobs already running there leave of it.

The node's report says what memory was free when the agent last measured it,
and a job claimed after that is not in it: before, a second claim for the
same node (two agents on one node, an agent's slots, or one agent's claims
between two beats) found the first job's memory still free, and one
24,000 MB card took two 16,000 MB jobs. Now each device's free memory is the
lesser of what the report says and what the node's running jobs leave of the
device's total, so a job's memory is promised from its claim to its end,
whenever the report shows it, and never counted twice; claims that judge
memory for one node take its memory lock, so none misses another's job.
"""

from __future__ import annotations

import anyio
import msgspec
import psycopg
import pytest

from tests.helpers import bearer
from umbra.compute import batch_commands, claims, jobs
from umbra.compute.batch_commands import Command
from umbra.compute.explain import explain
from umbra.compute.heartbeat import heartbeat
from umbra.compute.nodes import node_view
from umbra.domain.eligibility import is_busy
from umbra.domain.heartbeat import HeartbeatReport
from umbra.events.types import ResidentModel

from .queue_support import CPU64, GPU24, add_node, beat, register_model, spec, submit

pytestmark = pytest.mark.anyio


async def claim_one(conn, org_id, node_id):
    return await claims.claim(conn, node_id=node_id, organization_id=org_id, lease_seconds=60)


async def claim_in_one_batch(conn, commands):
    staged, _ = await batch_commands.stage(conn, commands)
    await batch_commands.write(conn, staged)
    return staged


def reported(free: int, *resident: tuple[str, int]):
    """The one-card node's report: GPU24 (24,576 MB in all) with ``free`` MB free."""
    return msgspec.structs.replace(GPU24, vram_free_mb=free, resident_models=tuple(ResidentModel(slug=s, vram_held_mb=mb) for s, mb in resident))


async def in_two_batches(conn, db_url, first: list[Command], second: list[Command]) -> tuple[list, list]:
    """Stage ``first`` on ``conn`` and, before it commits, ``second`` on another connection (the group commit's
    two batches in flight); then commit both. Returns what each staged."""
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as other:
        staged_a, _ = await batch_commands.stage(conn, first)
        staged_b, _ = await batch_commands.stage(other, second)
        await batch_commands.write(other, staged_b)
        await batch_commands.write(conn, staged_a)
    return staged_a, staged_b


async def count(conn, org_id, status: str) -> int:
    cursor = await conn.execute("SELECT count(*) FROM jobs WHERE organization_id = %s AND status = %s", (org_id, status))
    return (await cursor.fetchone())[0]


async def test_a_second_claim_before_the_next_report_finds_the_first_jobs_memory_taken(conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "one-card", [GPU24])
    first = await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    assert (await claim_one(conn, org_id, node)).job_id == first.id
    assert await claim_one(conn, org_id, node) is None, "the card's 24,000 MB took two 16,000 MB jobs"
    small = await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 6000})
    claimed = await claim_one(conn, org_id, node)
    assert claimed is not None and claimed.job_id == small.id  # what is left still takes what fits


async def test_the_group_commit_bounds_a_claim_by_the_jobs_of_an_earlier_batch(conn, org):
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


async def test_claims_for_one_node_in_overlapping_transactions_do_not_both_fill_it(conn, org, db_url):
    """A batch that has staged a claim and not committed, and a claim for the same node in another transaction
    (the group commit's two workers, two server processes): the other batch takes nothing this time and looks
    again in a moment; the single path waits for the memory lock, then finds the first job running."""
    org_id, _ = org
    node = await add_node(conn, org_id, "one-card", [GPU24])
    for _ in range(2):
        await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as second:
        staged, _ = await batch_commands.stage(conn, [Command("claim", org_id, node)])
        assert len(staged) == 1
        other_batch = Command("claim", org_id, node)
        assert (await batch_commands.stage(second, [other_batch]))[0] == []
        assert other_batch.guard_held  # its long-poll looks again in a moment
        await second.rollback()
        alongside = []
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: _appended(alongside, claim_one(second, org_id, node)))
            await anyio.sleep(0.2)  # the single path reaches the lock and waits
            assert alongside == []
            await batch_commands.write(conn, staged)
        assert alongside == [None]
    assert await count(conn, org_id, "running") == 1


async def _appended(results: list, coroutine) -> None:
    results.append(await coroutine)


async def test_a_report_recorded_after_the_claim_shows_the_job_once(conn, org):
    """Once the report shows a running job's memory taken, it is not taken a second time."""
    org_id, _ = org
    node = await add_node(conn, org_id, "one-card", [GPU24])
    await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    assert await claim_one(conn, org_id, node) is not None
    await beat(conn, org_id, node, [reported(8000)])  # the agent's job took its 16,000 MB
    fits = await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 7000})
    claimed = await claim_one(conn, org_id, node)
    assert claimed is not None and claimed.job_id == fits.id


async def test_a_running_model_jobs_memory_is_not_counted_twice_when_no_model_is_listed(conn, org):
    """``umbra agent`` reports the memory a loaded model takes, not the model: 8,000 MB free of 24,576 with a
    16,000 MB model job running leaves room for a 7,000 MB job."""
    org_id, _ = org
    await register_model(conn, org_id, "big:16b", vram_min_mb=16000)
    node = await add_node(conn, org_id, "one-card", [GPU24])
    await submit(conn, org_id, kind="infer", requires={"models": ["big:16b"]})
    assert await claim_one(conn, org_id, node) is not None
    await beat(conn, org_id, node, [reported(8000)])
    fits = await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 7000})
    claimed = await claim_one(conn, org_id, node)
    assert claimed is not None and claimed.job_id == fits.id


async def test_a_report_measured_before_the_job_took_its_memory_does_not_free_it(conn, org):
    """A report recorded after a claim may have been measured before the job allocated anything (in
    ``complete?claim_next`` the completion frees memory, so the next beat moves and is recorded): the job's
    memory stays promised all the same."""
    org_id, _ = org
    node = await add_node(conn, org_id, "one-card", [GPU24])
    first = await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 8000})
    running = await claim_one(conn, org_id, node)
    await beat(conn, org_id, node, [reported(16000)])
    await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    staged = await claim_in_one_batch(conn, [Command("complete", org_id, node, first.id, running.attempt, result={},
                                                     then=Command("claim", org_id, node))])  # fmt: skip
    assert len(staged) == 2  # the completion, and the next job in the memory it freed
    await beat(conn, org_id, node, [reported(24000)])  # measured as the first job ended, before the next allocated
    await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    assert await claim_one(conn, org_id, node) is None, "a second 16,000 MB job was placed on the 24,000 MB card"


async def test_a_model_jobs_memory_stays_promised_until_its_job_ends(conn, org):
    org_id, _ = org
    await register_model(conn, org_id, "big:16b", vram_min_mb=16000)
    node = await add_node(conn, org_id, "one-card", [GPU24])
    await submit(conn, org_id, kind="infer", requires={"models": ["big:16b"]})
    running = await claim_one(conn, org_id, node)
    await beat(conn, org_id, node, [reported(22000)])  # recorded (memory moved), the model still loading
    await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    assert await claim_one(conn, org_id, node) is None
    await claims.complete(conn, organization_id=org_id, node_id=node, job_id=running.job_id, attempt=running.attempt, result={})
    assert await claim_one(conn, org_id, node) is not None  # its job ended: the report's 22,000 MB are free again


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


async def test_a_card_its_running_jobs_fill_is_busy_whatever_else_is_queued(conn, org):
    """The same node in the same state answers a job with no requirement the same way whether or not a job that
    takes memory is queued beside it, and ``explain`` says what the claim does."""
    org_id, _ = org
    whole = msgspec.structs.replace(GPU24, vram_total_mb=24000)
    node = await add_node(conn, org_id, "gpu-only", [whole])
    await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 24000})
    assert await claim_one(conn, org_id, node) is not None  # the whole card is promised
    alone = await submit(conn, org_id, kind="echo")
    assert await claim_one(conn, org_id, node) is None
    await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 1000})
    assert await claim_one(conn, org_id, node) is None
    explained = await explain(conn, org_id, alone.id)
    assert not explained.eligible and [v.reason for v in explained.ineligible] == ["device_busy"]


async def test_explain_judges_the_node_as_a_claim_would(conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "one-card", [GPU24])
    await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    assert await claim_one(conn, org_id, node) is not None
    waiting = await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    explained = await explain(conn, org_id, waiting.id)
    assert not explained.eligible
    assert [v.reason for v in explained.ineligible] == ["vram_insufficient"]


async def test_claimers_of_one_node_lock_only_the_rows_it_has_room_for(conn, org, db_url):
    """The one-shape path locks as many rows as the nodes have room for, each node counted once however many
    of its claimers wait: a row locked and not handed out would be skipped by a claimer of the other batch in
    flight, which could then be told nothing is left while a job it can run stays queued."""
    org_id, _ = org
    shared = await add_node(conn, org_id, "two-agents", [GPU24])
    other = await add_node(conn, org_id, "other-card", [GPU24])
    for _ in range(2):
        await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    late = Command("claim", org_id, other)
    staged, staged_b = await in_two_batches(conn, db_url, [Command("claim", org_id, shared), Command("claim", org_id, shared)], [late])
    assert len(staged) == 1
    assert len(staged_b) == 1, f"the other node's claim took nothing (nothing_left={late.nothing_left})"
    assert await count(conn, org_id, "queued") == 0


async def test_a_claimer_whose_node_another_claimer_filled_stops_reading_the_queue(conn, org):
    """With two shapes queued, a claimer whose node has room for nothing more stops reading pages, also when
    another claimer of its node filled it."""
    org_id, _ = org
    node = await add_node(conn, org_id, "two-agents", [GPU24])
    specs = [spec("infer", requires={"vram_min_mb": mb}) for _ in range(400) for mb in (16000, 12000)]
    await jobs.submit(conn, org_id, specs, actor="test", batch=True)
    scans = []
    real = conn.execute

    async def counting(query, *args, **kwargs):
        if query is claims.SHAPES_SCAN:
            scans.append(query)
        return await real(query, *args, **kwargs)

    conn.execute = counting
    try:
        staged = await claim_in_one_batch(conn, [Command("claim", org_id, node), Command("claim", org_id, node)])
    finally:
        del conn.execute
    assert len(staged) == 1
    assert len(scans) <= 2, f"{len(scans)} pages of the queue read for a node with room for nothing more"


async def test_a_warm_model_the_report_lists_is_not_free_memory_for_the_next_claim(conn, org):
    """The models the report lists resident hold their memory in the running jobs' bound too: with a warm n
    holding 8,000 MB of the 24,576 MB card, two jobs of 16,000 and 8,000 MB claimed one after the other are
    not both placed beside it, as one claim of both would not."""
    org_id, _ = org
    await register_model(conn, org_id, "n", vram_min_mb=8000)
    warm = msgspec.structs.replace(GPU24, vram_free_mb=16000, resident_models=(ResidentModel(slug="n", vram_held_mb=8000),))
    node = await add_node(conn, org_id, "warm-card", [warm])
    await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 8000})

    # One claim of both: the second does not fit beside the first and n.
    staged, _ = await batch_commands.stage(conn, [Command("claim", org_id, node, count=2)])
    assert len(staged) == 1
    await conn.rollback()

    first = await claim_one(conn, org_id, node)
    assert first is not None
    second = await claim_one(conn, org_id, node)
    assert second is None or "n" in second.placed.would_evict, (
        f"a second claim placed {second.row.requires} on the card beside the 16,000 MB job and the warm model n "
        f"it does not evict ({second.placed})"
    )


async def test_claimers_of_one_node_reading_pages_lock_only_the_rows_it_has_room_for(conn, org, db_url):
    """As above with two shapes queued (the page path): the claimers of a node with room for one job lock one
    row, so the other batch in flight finds the other."""
    org_id, _ = org
    shared = await add_node(conn, org_id, "two-agents", [GPU24], trust_domain="lab")
    other = await add_node(conn, org_id, "other-card", [GPU24])
    await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000, "trust_domains": ["lab"]})
    await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 15000})
    late = Command("claim", org_id, other)
    staged, staged_b = await in_two_batches(conn, db_url, [Command("claim", org_id, shared), Command("claim", org_id, shared)], [late])
    assert len(staged) == 1
    assert len(staged_b) == 1, "the other node's claim took nothing: the row it could run was locked and not handed out"


async def test_a_claim_of_kinds_whose_jobs_take_no_memory_is_not_stopped_by_the_memory_lock(conn, org, db_url):
    """Only a claim that may take a job that takes memory takes its node's memory lock: the slots of an agent
    that takes only ``echo`` claim side by side in the group commit's two batches, whatever else is queued."""
    org_id, _ = org
    node = await add_node(conn, org_id, "cpu-box", [CPU64])
    for _ in range(2):
        await submit(conn, org_id, kind="echo")
    await submit(conn, org_id, kind="infer", requires={"ram_min_mb": 1000})
    echo = frozenset({"echo"})
    slot = Command("claim", org_id, node, kinds=echo)
    staged, staged_b = await in_two_batches(conn, db_url, [Command("claim", org_id, node, kinds=echo)], [slot])
    assert len(staged) == 1
    assert len(staged_b) == 1, f"the second slot's echo claim took nothing (guard_held={slot.guard_held})"


async def test_a_node_whose_running_jobs_fill_its_only_device_is_not_schedulable(conn, org):
    """A node whose running jobs fill its only GPU is not schedulable, and its device reads busy: the node view
    says what a claim finds."""
    org_id, _ = org
    node_id = await add_node(conn, org_id, "gpu-box", [msgspec.structs.replace(GPU24, vram_total_mb=24576, vram_free_mb=24576)])
    for _ in range(3):
        await submit(conn, org_id, requires={"vram_min_mb": 12288})
    for _ in range(2):
        assert await claims.claim(conn, node_id=node_id, organization_id=org_id, lease_seconds=60) is not None
    # The claim path finds the card full: it takes nothing more.
    assert await claims.claim(conn, node_id=node_id, organization_id=org_id, lease_seconds=60) is None
    view = await node_view(conn, node_id, organization_id=org_id)
    assert view.schedulable is False and all(is_busy(d) for d in view.judged_devices)


async def test_a_job_cancelled_while_it_ran_holds_its_memory_until_the_node_next_reports(conn, org):
    """A cancelled job's handler runs on until its agent hears of the cancel (its next renewal) and stops:
    until the node next reports its devices, the job's memory stays promised, to claims and to ``explain``
    alike. A beat without devices says nothing of memory; the next report says what is still held."""
    org_id, _ = org
    node = await add_node(conn, org_id, "one-card", [GPU24])
    first = await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    assert (await claim_one(conn, org_id, node)).job_id == first.id
    await jobs.cancel(conn, org_id, first.id, actor="test")
    waiting = await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    assert await claim_one(conn, org_id, node) is None, "a 16,000 MB job went on a card the cancelled job still fills"
    assert await claim_in_one_batch(conn, [Command("claim", org_id, node)]) == []
    verdicts = (await explain(conn, org_id, waiting.id)).ineligible
    assert [v.reason for v in verdicts] == ["vram_insufficient"]
    await heartbeat(conn, org_id, node, HeartbeatReport(agent_version="2"), event_interval_seconds=300)
    assert await claim_one(conn, org_id, node) is None
    await beat(conn, org_id, node, [reported(8000)])  # the handler still holds its memory
    assert await claim_one(conn, org_id, node) is None  # the report says so
    await beat(conn, org_id, node, [reported(24000)])  # it stopped
    claimed = await claim_one(conn, org_id, node)
    assert claimed is not None and claimed.job_id == waiting.id


async def test_a_job_cancelled_before_it_was_claimed_or_after_it_decomposed_holds_no_memory(conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "one-card", [GPU24])
    never_ran = await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000}, priority=1)
    await jobs.cancel(conn, org_id, never_ran.id, actor="test")
    parent = await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000}, priority=2)
    running = await claim_one(conn, org_id, node)
    assert running.job_id == parent.id
    await claims.add_children(conn, organization_id=org_id, node_id=node, job_id=parent.id, attempt=running.attempt,
                              children=[spec("child", requires={"vram_min_mb": 16000})])  # fmt: skip
    await jobs.cancel(conn, org_id, parent.id, actor="test")  # the parent's handler ended when it decomposed
    await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    assert await claim_one(conn, org_id, node) is not None
