"""Heartbeats against the database: promotion, coalescing, restarts, staleness."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import anyio
import msgspec
import psycopg
import pytest

from umbra.compute import claims
from umbra.compute.heartbeat import heartbeat
from umbra.compute.nodes import drain_node, mark_stale_page, node_view, retire_node
from umbra.compute.pairing import issue_pairing_code, redeem_pairing_code
from umbra.domain.heartbeat import MEMORY_EVENT_SPACING_SECONDS, HeartbeatReport
from umbra.events import store
from umbra.events.types import Device, ResidentModel

from tests.helpers import bearer, until_done_or_waiting

from .queue_support import CPU64, GPU24, add_node, http_pair, submit, written

pytestmark = pytest.mark.anyio

GPU = Device(kind="gpu_discrete", label="gpu0", vram_total_mb=24576, vram_free_mb=24000, accelerators=("cuda",))
CPU = Device(kind="cpu", label="cpu", ram_total_mb=65536, ram_free_mb=30000)
STARTED = datetime(2026, 3, 1, 8, 0, tzinfo=timezone.utc)


async def pair(conn, org_id, name="gpu-box"):
    issued = await issue_pairing_code(conn, org_id, name)
    return (await redeem_pairing_code(conn, code=issued.code, name=name, source="10.0.0.1", devices=[GPU, CPU])).node_id


async def beat(conn, org_id, node_id, **report):
    report.setdefault("devices", (GPU, CPU))
    return await heartbeat(conn, org_id, node_id, HeartbeatReport(**report), event_interval_seconds=300)


async def types(conn, node_id) -> list[str]:
    return [r.type for r in await store.read_stream(conn, store.node_stream(node_id))]


async def offset(conn, seconds: int) -> None:
    await conn.execute("SELECT set_config('umbra.clock_offset', %s, false)", (f"{seconds} seconds",))


async def past_the_memory_spacing(conn, org_id, node_id, devices) -> None:
    """The database clock moved past the spacing of memory-only events since the node's last recorded beat, with
    the node beating (``devices`` as last reported) on the way: not silent long enough to be read offline."""
    await offset(conn, MEMORY_EVENT_SPACING_SECONDS // 2)
    await beat(conn, org_id, node_id, devices=devices)
    await offset(conn, MEMORY_EVENT_SPACING_SECONDS)


async def test_the_first_beat_promotes_a_provisioning_node(conn, org):
    org_id, _ = org
    node_id = await pair(conn, org_id)
    assert (await node_view(conn, node_id)).status == "provisioning"
    result = await beat(conn, org_id, node_id, agent_version="1.0")
    assert (result.status, result.recorded, result.changed_capacity) == ("online", True, True)
    view = await node_view(conn, node_id, organization_id=org_id)
    assert (view.status, view.stored_status, view.schedulable) == ("online", "online", True)
    assert view.last_seen_at is not None
    assert await types(conn, node_id) == ["node.created", "node.paired", "node.heartbeat"]


async def test_unchanged_beats_append_nothing_but_refresh_liveness(conn, org):
    org_id, _ = org
    node_id = await pair(conn, org_id)
    await beat(conn, org_id, node_id, agent_version="1.0", agent_started_at=STARTED)
    head = await store.head_position(conn)
    seen = []
    for i in range(5):
        await offset(conn, i * 10)
        jitter = Device(kind="cpu", label="cpu", ram_total_mb=65536, ram_free_mb=30000 - i * 50)
        result = await beat(conn, org_id, node_id, devices=(jitter, GPU), agent_version="1.0", agent_started_at=STARTED)
        assert (result.recorded, result.status) == (False, "online")
        seen.append((await node_view(conn, node_id)).last_seen_at)
    assert await store.head_position(conn) == head
    assert seen == sorted(seen) and len(set(seen)) == 5


async def test_an_unchanged_beat_is_recorded_after_the_event_interval(conn, org):
    org_id, _ = org
    node_id = await pair(conn, org_id)
    await beat(conn, org_id, node_id)
    for seconds in range(30, 300, 30):  # a live node, never silent past the stale threshold
        await offset(conn, seconds)
        assert not (await beat(conn, org_id, node_id)).recorded
    await offset(conn, 299)
    assert not (await beat(conn, org_id, node_id)).recorded
    await offset(conn, 301)
    assert (await beat(conn, org_id, node_id)).recorded
    assert await types(conn, node_id) == ["node.created", "node.paired", "node.heartbeat", "node.heartbeat"]


async def test_agent_started_at_is_recorded_on_restart_not_every_beat(conn, org):
    org_id, _ = org
    node_id = await pair(conn, org_id)
    for _ in range(3):
        await beat(conn, org_id, node_id, agent_started_at=STARTED)
    await offset(conn, 400)  # a periodic beat must not reset it either
    await beat(conn, org_id, node_id, agent_started_at=STARTED)
    history = [r.event for r in await store.read_stream(conn, store.node_stream(node_id)) if r.type == "node.heartbeat"]
    assert [e.agent_started_at for e in history] == [STARTED, None]
    assert (await node_view(conn, node_id)).state.agent_started_at == STARTED
    restarted = STARTED + timedelta(hours=2)
    assert (await beat(conn, org_id, node_id, agent_started_at=restarted)).recorded
    assert (await node_view(conn, node_id)).state.agent_started_at == restarted


async def test_a_beat_replaces_the_device_set(conn, org):
    org_id, _ = org
    node_id = await pair(conn, org_id)
    await beat(conn, org_id, node_id)
    loaded = Device(kind="gpu_discrete", label="gpu0", vram_total_mb=24576, vram_free_mb=0,
                    resident_models=(ResidentModel(slug="gemma4:26b", vram_held_mb=24000),))
    result = await beat(conn, org_id, node_id, devices=(loaded,))
    assert result.recorded and result.changed_capacity
    view = await node_view(conn, node_id)
    assert [d.label for d in view.devices] == ["gpu0"] and view.resident_models == {"gemma4:26b"}
    assert view.schedulable is False  # its one device is a GPU with no free VRAM


@pytest.mark.parametrize("command,status", [(drain_node, "draining"), (retire_node, "retired")])
async def test_a_beat_never_resurrects_a_draining_or_retired_node(conn, org, command, status):
    org_id, _ = org
    node_id = await pair(conn, org_id)
    await beat(conn, org_id, node_id)
    await command(conn, org_id, node_id)
    await offset(conn, 400)
    result = await beat(conn, org_id, node_id, devices=(CPU,))
    assert result.recorded and result.status == status
    view = await node_view(conn, node_id)
    assert (view.status, view.stored_status, view.schedulable) == (status, status, False)


async def test_a_silent_node_reads_offline_and_the_sweep_records_it(conn, org):
    org_id, _ = org
    node_id = await pair(conn, org_id)
    quiet_id = await pair(conn, org_id, "never-beats")
    await beat(conn, org_id, node_id)
    await offset(conn, 44)
    assert (await node_view(conn, node_id)).status == "online"
    assert (await mark_stale_page(conn))[0] == []
    await offset(conn, 46)
    view = await node_view(conn, node_id)
    assert (view.status, view.stored_status, view.schedulable) == ("offline", "online", False)
    assert (await mark_stale_page(conn))[0] == [node_id]
    assert (await mark_stale_page(conn))[0] == []
    assert (await node_view(conn, node_id)).stored_status == "offline"
    assert (await node_view(conn, quiet_id)).status == "provisioning"  # intent never expires
    went = (await store.read_stream(conn, store.node_stream(node_id)))[-1]
    assert went.type == "node.went_offline" and went.event.last_seen_at is not None
    assert (await beat(conn, org_id, node_id)).status == "online"
    assert (await node_view(conn, node_id)).stored_status == "online"


async def test_a_node_of_another_organization_cannot_be_beaten_for(conn, org):
    from umbra.compute.accounts import create_organization
    from umbra.errors import NotFound

    other, _ = await create_organization(conn, "globex")
    node_id = await pair(conn, org[0])
    with pytest.raises(NotFound):
        await beat(conn, other, node_id)
    assert (await node_view(conn, node_id)).last_seen_at is None


async def _silent_node(conn, org_id):
    """A node that beat once, a minute ago: the sweep may mark it offline."""
    node_id = await pair(conn, org_id)
    await beat(conn, org_id, node_id)
    await conn.execute("UPDATE node_liveness SET last_seen_at = now() - interval '60 seconds' WHERE node_id = %s", (node_id,))
    return node_id


async def test_a_beat_that_waited_for_the_sweep_marking_its_node_offline_brings_it_back(db_url, conn, org):
    """The beat's own read said ``online``; the sweep, holding the row, was about to commit ``offline``."""
    org_id, _ = org
    node_id = await _silent_node(conn, org_id)
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as agent, \
            await psycopg.AsyncConnection.connect(db_url, autocommit=True) as sweeper:  # fmt: skip
        answers = []

        async def beat_now() -> None:
            answers.append(await beat(agent, org_id, node_id))

        async with anyio.create_task_group() as tg:
            async with sweeper.transaction():
                assert (await mark_stale_page(sweeper))[0] == [node_id]
                tg.start_soon(beat_now)
                await until_done_or_waiting(conn, lambda: bool(answers))
    assert answers[0].status == "online"
    assert (await node_view(conn, node_id)).stored_status == "online"
    assert (await types(conn, node_id))[-2:] == ["node.went_offline", "node.heartbeat"]


async def test_a_sweep_running_while_a_beat_commits_leaves_the_node_online(db_url, conn, org):
    org_id, _ = org
    node_id = await _silent_node(conn, org_id)
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as agent, \
            await psycopg.AsyncConnection.connect(db_url, autocommit=True) as sweeper:  # fmt: skip
        async with agent.transaction():  # the beat has run; its commit is on its way
            assert (await beat(agent, org_id, node_id)).status == "online"
            await mark_stale_page(sweeper)
    view = await node_view(conn, node_id)
    assert (view.stored_status, view.status) == ("online", "online")



async def test_a_beat_that_commits_between_the_sweeps_read_and_its_lock_leaves_the_node_online(db_url, conn, org, monkeypatch):
    """The sweep's read is made before it locks the rows: here the window is widened to half a second."""
    from umbra.compute import nodes

    org_id, _ = org
    node_id = await _silent_node(conn, org_id)
    monkeypatch.setattr(nodes, "_STALE", nodes._STALE.replace("WHERE n.status = 'online'",
                                                              "WHERE n.status = 'online' AND pg_sleep(0.5) IS NOT NULL"))
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as agent, \
            await psycopg.AsyncConnection.connect(db_url, autocommit=True) as sweeper:  # fmt: skip
        async with anyio.create_task_group() as tg:
            marked = []

            async def sweep() -> None:
                marked.extend((await mark_stale_page(sweeper))[0])

            tg.start_soon(sweep)
            await anyio.sleep(0.1)  # the sweep has read the node as stale and sleeps before locking it
            assert (await beat(agent, org_id, node_id)).status == "online"
    assert marked == []
    assert (await node_view(conn, node_id)).stored_status == "online"


async def test_a_beat_that_changes_only_free_memory_does_not_wait_for_submissions(db_url, conn, org):
    """Only a changed device set changes what could ever run: free memory and residency are placement's business."""
    from umbra.compute.blocked import hold_capacity

    org_id, _ = org
    node_id = await pair(conn, org_id)
    await beat(conn, org_id, node_id)
    await past_the_memory_spacing(conn, org_id, node_id, (GPU, CPU))  # a move of free memory alone is recorded no sooner
    busy = Device(kind="gpu_discrete", label="gpu0", vram_total_mb=24576, vram_free_mb=12000, accelerators=("cuda",))
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as submitter:
        async with submitter.transaction():
            await hold_capacity(submitter, org_id, exclusive=False)  # a submission judging the fleet, not committed
            with anyio.fail_after(5):
                result = await beat(conn, org_id, node_id, devices=(busy, CPU))
    assert result.recorded and result.changed_capacity


async def test_free_memory_moving_on_every_beat_is_recorded_once_per_spacing_and_claims_judge_the_latest(conn, org):
    """A training job's memory growing on every beat does not append an event each time: the first move after a
    recorded beat waits for the spacing, while the node as claims, ``explain`` and the API read it has the
    latest report; once the spacing has passed, the next move is recorded with the devices as they are then."""
    org_id, _ = org
    node_id = await pair(conn, org_id)
    await beat(conn, org_id, node_id)  # the first beat: recorded (a promotion)
    recorded = await types(conn, node_id)
    for free in (18000, 12000, 6000):
        result = await beat(conn, org_id, node_id, devices=(msgspec.structs.replace(GPU, vram_free_mb=free), CPU))
        assert not result.recorded
    assert await types(conn, node_id) == recorded
    latest = {d.label: d.vram_free_mb for d in (await node_view(conn, node_id)).devices}
    assert latest["gpu0"] == 6000  # the node as read: the last report
    await submit(conn, org_id, requires={"accelerators": ["cuda"], "vram_min_mb": 8000})
    assert await claims.claim(conn, node_id=node_id, organization_id=org_id, lease_seconds=60) is None  # 6,000 free
    await past_the_memory_spacing(conn, org_id, node_id, (msgspec.structs.replace(GPU, vram_free_mb=6000), CPU))
    assert await types(conn, node_id) == recorded
    result = await beat(conn, org_id, node_id, devices=(msgspec.structs.replace(GPU, vram_free_mb=5000), CPU))
    assert result.recorded and result.changed_capacity
    [event] = (await store.read_stream(conn, store.node_stream(node_id)))[len(recorded):]
    assert event.type == "node.heartbeat" and event.event.devices[1].vram_free_mb == 5000


async def test_an_unrecorded_beat_that_frees_memory_hints_only_while_jobs_are_queued(db_url, conn, org):
    """Its hint is a NOTIFY every listener of the cluster reads (the log's channel): sent while jobs are queued,
    for a parked claim that may fit now, and not for nothing."""
    org_id, _ = org
    node_id = await pair(conn, org_id)
    squeezed = msgspec.structs.replace(GPU, vram_free_mb=4000)
    await beat(conn, org_id, node_id, devices=(squeezed, CPU))  # the first beat: recorded
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as listener:
        await listener.execute(f"LISTEN {store.LOG_CHANNEL}")

        async def heard() -> list[tuple]:
            return [hint async for note in listener.notifies(timeout=0.5) for hint in store.parse_hints(note.payload)]

        assert not (await beat(conn, org_id, node_id, devices=(GPU, CPU))).recorded  # freed, nothing queued
        assert await heard() == []
        await submit(conn, org_id, requires={"accelerators": ["cuda"], "vram_min_mb": 16000})
        await heard()  # the submission's own
        assert not (await beat(conn, org_id, node_id, devices=(squeezed, CPU))).recorded  # taken: no hint
        assert await heard() == []
        assert not (await beat(conn, org_id, node_id, devices=(GPU, CPU))).recorded  # freed, a job queued
        assert await heard() == [(org_id, 0, 1)]


async def test_a_beat_authenticated_before_its_node_was_revoked_is_refused_and_not_recorded(conn, org):
    """The beat's credential was checked before its body arrived; the revocation committed meanwhile.
    The beat finds the node retired, checks its credential again and is refused 401: no beat after the
    revocation, and no ``retired`` answer that its agent would take for a retirement (exit 0)."""
    from umbra.compute.credentials import revoke_node
    from umbra.errors import Unauthenticated

    org_id, _ = org
    node_id = await add_node(conn, org_id, "box", [CPU64])
    [(credential_id,)] = await (await conn.execute("SELECT id FROM node_credentials WHERE node_id = %s", (node_id,))).fetchall()
    await revoke_node(conn, org_id, node_id, actor="admin")
    before = await store.read_stream(conn, store.node_stream(node_id))
    seen = "SELECT last_seen_at FROM node_liveness WHERE node_id = %s"
    seen_before = await (await conn.execute(seen, (node_id,))).fetchone()
    for devices in ([CPU64], [CPU64, GPU24]):  # an unchanged beat (no lock taken) and one that changes devices
        with pytest.raises(Unauthenticated):
            await heartbeat(conn, org_id, node_id, HeartbeatReport(devices=tuple(devices)), event_interval_seconds=0,
                            credential_id=credential_id)  # fmt: skip
    assert await store.read_stream(conn, store.node_stream(node_id)) == before
    assert await (await conn.execute(seen, (node_id,))).fetchone() == seen_before  # refused: nothing written


_GPU_JSON = {"kind": "gpu_discrete", "label": "gpu0", "vram_total_mb": 24576, "vram_free_mb": 24000, "ram_total_mb": 0,
             "ram_free_mb": 0, "throughput_factor": 1.0, "accelerators": ["cuda"], "resident_models": []}


async def test_a_heartbeat_replaces_the_device_set_free_memory_included(client, org):
    """A heartbeat replaces the device set: one reporting 300 MB less free VRAM (within the tolerance that
    records no event) is what the node view shows afterwards."""
    _, key = org
    issued = (await client.post("/v1/pairings", json={"name": "gpu-box"}, headers=bearer(key))).json()
    redeemed = (await client.post("/v1/pairings/redeem", json={"code": issued["code"], "name": "gpu-box",
                                                               "agent_version": "1", "devices": [_GPU_JSON]})).json()
    node_id, credential = redeemed["node_id"], redeemed["credential"]
    assert (await client.post("/v1/agent/heartbeat", json={"devices": [_GPU_JSON], "agent_version": "1"},
                              headers=bearer(credential))).status_code == 200
    lower = {**_GPU_JSON, "vram_free_mb": 23700}
    beat = await client.post("/v1/agent/heartbeat", json={"devices": [lower], "agent_version": "1"}, headers=bearer(credential))
    assert beat.status_code == 200
    node = (await client.get(f"/v1/nodes/{node_id}", headers=bearer(key))).json()
    assert node["devices"][0]["vram_free_mb"] == 23700


@pytest.mark.parametrize("field, device", [
    ("vram_free_mb", {**_GPU_JSON, "vram_free_mb": 30000}),
    ("ram_free_mb", {"kind": "cpu", "label": "cpu", "ram_total_mb": 8192, "ram_free_mb": 9000}),
], ids=["vram", "ram"])
async def test_a_device_reporting_more_free_memory_than_it_has_is_refused(client, org, db_url, field, device):
    """Claims judge a device's free memory: a 24,576 MB card that said 30,000 MB free was given a job needing
    28,000 MB (which a 48 GB card of the fleet was there for), and ran out of memory. Such a report (an agent's
    bug) is refused 422 naming the field, at pairing and at every beat, and writes nothing: the node keeps the
    devices it last reported."""
    _, key = org
    node_id, credential = await http_pair(client, key, "gpu-box", devices=[_GPU_JSON])
    before = await written(db_url, "node_liveness WHERE reported_at IS NOT NULL")
    beat = await client.post("/v1/agent/heartbeat", json={"devices": [_GPU_JSON, {**device, "label": "bad"}]},
                             headers=bearer(credential))  # fmt: skip
    assert (beat.status_code, beat.json()["error"], beat.json()["field"]) == (422, "invalid_request", f"devices[1].{field}")
    assert await written(db_url, "node_liveness WHERE reported_at IS NOT NULL") == before
    node = (await client.get(f"/v1/nodes/{node_id}", headers=bearer(key))).json()
    assert [d["label"] for d in node["devices"]] == ["gpu0"]
    issued = (await client.post("/v1/pairings", json={"name": "other"}, headers=bearer(key))).json()
    redeemed = await client.post("/v1/pairings/redeem", json={"code": issued["code"], "name": "other", "agent_version": "1",
                                                              "devices": [device]})  # fmt: skip
    assert (redeemed.status_code, redeemed.json()["field"]) == (422, f"devices[0].{field}")
    unsaid = {**device, "label": "no-total", "vram_total_mb": 0, "ram_total_mb": 0}  # a total left out contradicts nothing
    beat = await client.post("/v1/agent/heartbeat", json={"devices": [_GPU_JSON, unsaid]}, headers=bearer(credential))
    assert beat.status_code == 200, beat.text


async def test_a_device_reporting_free_memory_and_no_total_is_taken_to_have_that_much(client, org):
    """A total left out (0) while memory is free: blocking judges totals and claims what is free, so a job
    only that card could run was blocked (it read as having no VRAM) while a claim would have taken it. The
    total is taken as what is free: the job queues, and the card runs it."""
    _, key = org
    card = {"kind": "gpu_discrete", "label": "gpu0", "vram_free_mb": 8000, "accelerators": ["cuda"]}
    node_id, credential = await http_pair(client, key, "no-totals", devices=[card])
    node = (await client.get(f"/v1/nodes/{node_id}", headers=bearer(key))).json()
    assert [(d["vram_total_mb"], d["vram_free_mb"]) for d in node["devices"]] == [(8000, 8000)]
    job = (await client.post("/v1/jobs", json={"kind": "render", "requires": {"vram_min_mb": 6000}}, headers=bearer(key))).json()
    assert job["status"] == "queued", job
    claimed = await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(credential))
    assert (claimed.status_code, claimed.json()["job"]["id"]) == (200, job["id"])


async def test_a_job_is_not_claimed_onto_vram_the_last_beat_said_was_not_free(conn, org):
    """A claim judges the memory the node last reported free, also when the beat moved it too little to be
    recorded: the last beat said 23,700 MB free, so a job needing 23,900 MB is not placed there."""
    org_id, _ = org
    node_id = await add_node(conn, org_id, "gpu-box", [GPU])
    lower = msgspec.structs.replace(GPU, vram_free_mb=23700)
    await heartbeat(conn, org_id, node_id, HeartbeatReport(devices=(lower,)), event_interval_seconds=300)
    await submit(conn, org_id, requires={"vram_min_mb": 23900})
    claimed = await claims.claim(conn, node_id=node_id, organization_id=org_id, lease_seconds=60)
    assert claimed is None, claimed.placed if claimed else None


async def _revoke(conn, org_id, node_id):
    from umbra.compute.credentials import revoke_node

    await revoke_node(conn, org_id, node_id)


@pytest.mark.parametrize("command,status,last", [(drain_node, "draining", "node.draining"), (retire_node, "retired", "node.retired"),
                                                 (_revoke, "retired", "node.revoked")])  # fmt: skip
async def test_draining_or_retiring_a_node_read_offline_before_the_sweep_looked_records_the_spell(conn, org, command, status, last):
    """A node silent past the threshold reads ``offline`` before the sweeper records it; drained or retired then,
    it is no longer stored ``online`` and no sweep ever records that spell. The log must still explain the
    ``offline`` a view showed, as a beat after such a silence records it (see ``Silence``)."""
    org_id, _ = org
    node_id = await pair(conn, org_id)
    await beat(conn, org_id, node_id)
    await offset(conn, 60)
    view = await node_view(conn, node_id)
    assert (view.status, view.stored_status) == ("offline", "online")
    await command(conn, org_id, node_id)
    assert (await mark_stale_page(conn))[0] == []
    assert (await node_view(conn, node_id)).status == status
    history = await store.read_stream(conn, store.node_stream(node_id))
    assert [r.type for r in history][-2:] == ["node.went_offline", last]
    assert history[-2].metadata["actor"] == "sweeper"


async def test_a_cordon_committing_while_a_beat_ends_an_unrecorded_silence_leaves_the_spell_in_the_log(db_url, conn, org):
    """The beat read the node silent past the threshold and stored ``online`` (views read it ``offline``), then
    waited for the node's claim guard while an operator cordoned a device. The cordon moved the node's version
    but answered for no silence: the log must still say the node went offline before the beat's return (no
    sweep ever will: the node is live again)."""
    from umbra.compute.nodes import cordon_device

    org_id, _ = org
    node_id = await pair(conn, org_id)
    await beat(conn, org_id, node_id)
    await offset(conn, 60)
    assert (await node_view(conn, node_id)).status == "offline"
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as agent, \
            await psycopg.AsyncConnection.connect(db_url, autocommit=True) as admin:  # fmt: skip
        await offset(agent, 60)
        await offset(admin, 60)
        answers = []

        async def beat_now() -> None:
            answers.append(await beat(agent, org_id, node_id))

        async with anyio.create_task_group() as tg:
            async with admin.transaction():
                await cordon_device(admin, org_id, node_id, "gpu0", actor="admin")
                tg.start_soon(beat_now)
                await until_done_or_waiting(conn, lambda: bool(answers))
    assert answers[0].status == "online"
    assert (await mark_stale_page(conn))[0] == []
    assert "node.went_offline" in await types(conn, node_id)


async def test_a_cordon_committing_between_a_beats_first_read_and_its_lock_leaves_the_spell_in_the_log(db_url, conn, org, monkeypatch):
    """The beat's first statement (its liveness, committed) read the node silent past the threshold and stored
    ``online``; an operator's cordon committed before the beat locked the node's row. The cordon, finding the
    node heard from, had no spell to record, and answered for none: the beat must still record it."""
    from umbra.compute import heartbeat as beats
    from umbra.compute.nodes import cordon_device

    org_id, _ = org
    node_id = await pair(conn, org_id)
    await beat(conn, org_id, node_id)
    await offset(conn, 60)
    assert (await node_view(conn, node_id)).status == "offline"
    record = beats._record

    async def cordoned_first(*args, **kwargs):
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as admin:
            await offset(admin, 60)
            await cordon_device(admin, org_id, node_id, "gpu0", actor="admin")
        return await record(*args, **kwargs)

    monkeypatch.setattr(beats, "_record", cordoned_first)
    assert (await beat(conn, org_id, node_id)).status == "online"
    assert (await mark_stale_page(conn))[0] == []
    assert (await types(conn, node_id))[-3:] == ["node.device_cordoned", "node.went_offline", "node.heartbeat"]
