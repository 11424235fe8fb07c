"""The nodes table is a pure fold of the log: rebuilt from events it equals the live rows."""

from __future__ import annotations

import random

import pytest

from umbra.compute.accounts import create_organization
from umbra.compute.credentials import revoke_node
from umbra.compute.heartbeat import heartbeat
from umbra.compute.nodes import drain_node, load_schedulable_view, mark_stale_page, retire_node
from umbra.compute.pairing import issue_pairing_code, redeem_pairing_code
from umbra.domain.heartbeat import HeartbeatReport
from umbra.errors import Conflict
from umbra.events.types import Device, ResidentModel
from umbra.projections import nodes as projection

pytestmark = pytest.mark.anyio


def random_devices(rng: random.Random) -> tuple[Device, ...]:
    devices = [Device(kind="cpu", label="cpu", ram_total_mb=65536, ram_free_mb=rng.choice([1000, 30000, 60000]))]
    if rng.random() < 0.7:
        held = rng.choice([(), (ResidentModel(slug="gemma4:26b", vram_held_mb=16000),)])
        devices.append(Device(kind="gpu_discrete", label="gpu0", vram_total_mb=24576,
                              vram_free_mb=rng.choice([0, 8000, 24000]), accelerators=("cuda",),
                              resident_models=held, throughput_factor=rng.choice([4.0, 8.5])))
    if rng.random() < 0.3:
        devices.append(Device(kind="gpu_integrated", label="igpu", ram_total_mb=32768, ram_free_mb=16000,
                              accelerators=("metal",)))
    rng.shuffle(devices)
    return tuple(devices)


async def random_history(conn, rng: random.Random) -> list:
    orgs = [org for org, _ in [await create_organization(conn, "acme"), await create_organization(conn, "globex")]]
    nodes = []
    for org_id in orgs:
        for i in range(3):
            name = f"node-{i}"
            code = (await issue_pairing_code(conn, org_id, name)).code
            redeemed = await redeem_pairing_code(conn, code=code, name=name, source="10.0.0.1",
                                                 agent_version="1.0", devices=random_devices(rng))
            nodes.append((org_id, redeemed.node_id))
    clock = 0
    for _ in range(60):
        org_id, node_id = rng.choice(nodes)
        action = rng.choices(["beat", "drain", "retire", "revoke", "time"], weights=[14, 1, 0.3, 0.5, 3])[0]
        if action == "beat":
            report = HeartbeatReport(devices=random_devices(rng), agent_version=rng.choice(["1.0", "1.1"]),
                                     agent_started_at=None)
            await heartbeat(conn, org_id, node_id, report, event_interval_seconds=300)
        elif action == "drain":
            try:
                await drain_node(conn, org_id, node_id, actor="test")
            except Conflict:
                pass  # a retired node cannot be drained
        elif action == "retire":
            await retire_node(conn, org_id, node_id, actor="test")
        elif action == "revoke":
            await revoke_node(conn, org_id, node_id, actor="test")
        else:
            clock += rng.choice([20, 50, 400])
            await conn.execute("SELECT set_config('umbra.clock_offset', %s, false)", (f"{clock} seconds",))
            await mark_stale_page(conn)
    return orgs


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_rebuild_equals_live_on_random_histories(conn, seed):
    orgs = await random_history(conn, random.Random(seed))
    live = await projection.live(conn)
    assert len(live) == 6
    assert await projection.rebuild(conn) == live
    for org_id in orgs:
        assert await projection.rebuild(conn, org_id) == await projection.live(conn, org_id)
        assert len(await projection.live(conn, org_id)) == 3
    # Read a few events at a time (pages end inside streams and organizations), the fold is the same.
    assert await projection.rebuild(conn, page=3) == live
    assert await projection.rebuild(conn, orgs[0], page=2) == await projection.live(conn, orgs[0])


async def test_rebuild_notices_a_row_that_disagrees_with_the_log(conn):
    await random_history(conn, random.Random(7))
    await conn.execute("UPDATE nodes SET status = 'retired' WHERE name = 'node-1' AND status <> 'retired'")
    await conn.execute("UPDATE nodes SET devices = '[]'::jsonb WHERE name = 'node-2'")
    assert await projection.rebuild(conn) != await projection.live(conn)


async def test_the_schedulable_view_holds_every_node_of_one_organization(conn, org):
    org_id, _ = org
    other, _ = await create_organization(conn, "globex")
    ids = {}
    for owner, name in [(org_id, "a"), (org_id, "b"), (org_id, "c"), (other, "z")]:
        code = (await issue_pairing_code(conn, owner, name)).code
        ids[name] = (await redeem_pairing_code(conn, code=code, name=name, source="10.0.0.1")).node_id
    gpu = Device(kind="gpu_discrete", label="gpu0", vram_total_mb=24576, vram_free_mb=8000, accelerators=("cuda",),
                 resident_models=(ResidentModel(slug="gemma4:26b", vram_held_mb=16000),))
    await heartbeat(conn, org_id, ids["a"], HeartbeatReport(devices=(gpu,)), event_interval_seconds=300)
    await heartbeat(conn, org_id, ids["b"], HeartbeatReport(devices=(gpu,)), event_interval_seconds=300)
    await retire_node(conn, org_id, ids["b"])
    views = {v.state.name: v for v in await load_schedulable_view(conn, org_id)}
    assert set(views) == {"a", "b", "c"}
    assert (views["a"].status, views["a"].schedulable, views["a"].trust_domain) == ("online", True, "local")
    assert views["a"].resident_models == {"gemma4:26b"} and views["a"].devices == (gpu,)
    assert (views["b"].status, views["b"].schedulable) == ("retired", False)
    assert (views["c"].status, views["c"].schedulable) == ("provisioning", False)
