"""A device taken out of service alone (``POST /v1/nodes/{id}/cordon``, ``/uncordon``): a GPU throwing ECC
errors stops taking work while the node's other devices go on; what runs there runs on; work only it could
run is blocked, with a reason that names it, until it is back; the node's history records who did it and why."""

from __future__ import annotations

import anyio
import httpx
import msgspec
import psycopg
import pytest

from tests.conftest import LiveServer
from tests.helpers import bearer, eventually, run_umbra
from umbra.compute.accounts import create_api_key, create_organization
from umbra.events.types import Device

from .queue_support import CPU64, GPU24, http_pair, written

pytestmark = pytest.mark.anyio

DEVICES = [msgspec.to_builtins(GPU24), msgspec.to_builtins(CPU64)]
TWO_GPUS = [msgspec.to_builtins(GPU24), msgspec.to_builtins(msgspec.structs.replace(GPU24, label="gpu1")), DEVICES[1]]
IGPU = Device(kind="gpu_integrated", label="igpu", vram_total_mb=8192, vram_free_mb=8000, ram_total_mb=65536,
              ram_free_mb=60000, accelerators=("metal",), throughput_factor=3.0)  # fmt: skip
UNIFIED = [msgspec.to_builtins(CPU64), msgspec.to_builtins(IGPU)]
GPU_JOB = {"kind": "render", "requires": {"vram_min_mb": 16000, "accelerators": ["cuda"]}}
CPU_JOB = {"kind": "tally", "requires": {"ram_min_mb": 1000}}


async def pair(client, key: str, name: str = "gpu-box", devices: list = DEVICES) -> tuple[str, dict]:
    """A node with (by default) a 24 GB GPU (``gpu0``) and a CPU (``cpu``), paired and online: its id and
    credential headers."""
    node_id, credential = await http_pair(client, key, name, devices)
    return node_id, bearer(credential)


async def submit(client, key: str, job: dict) -> dict:
    answer = await client.post("/v1/jobs", json=job, headers=bearer(key))
    assert answer.status_code == 201, answer.text
    return answer.json()


async def job(client, key: str, job_id: str) -> dict:
    return (await client.get(f"/v1/jobs/{job_id}", headers=bearer(key))).json()


async def test_a_cordoned_gpu_takes_no_new_work_while_the_nodes_cpu_goes_on(client, org):
    """Cordoned, the node's GPU is passed over: a GPU job only it could run is blocked at once, its reason
    naming the cordoned card; a CPU job is still claimed by the same node. Put back, the GPU job is queued
    again and claimed there. The Node object says what is cordoned and why."""
    _, key = org
    node_id, node = await pair(client, key)
    cordoned = await client.post(f"/v1/nodes/{node_id}/cordon", json={"device": "gpu0", "reason": "ECC errors"},
                                 headers=bearer(key))  # fmt: skip
    assert cordoned.status_code == 200, cordoned.text
    assert (cordoned.json()["cordoned"], cordoned.json()["schedulable"]) == ({"gpu0": "ECC errors"}, True)
    gpu_job = await submit(client, key, GPU_JOB)
    assert gpu_job["status"] == "blocked"
    blocked_reason = (await client.get(f"/v1/jobs/{gpu_job['id']}/explain", headers=bearer(key))).json()["summary"]
    assert "gpu-box/gpu0 would fit but is cordoned" in blocked_reason, blocked_reason
    cpu_job = await submit(client, key, CPU_JOB)
    claimed = await client.post("/v1/agent/claim", params={"wait": 0}, headers=node)
    assert (claimed.status_code, claimed.json()["job"]["id"], claimed.json()["placement"]["device_id"]) == (200, cpu_job["id"], "cpu")

    back = await client.post(f"/v1/nodes/{node_id}/uncordon", json={"device": "gpu0"}, headers=bearer(key))
    assert (back.status_code, back.json()["cordoned"]) == (200, {})
    assert (await job(client, key, gpu_job["id"]))["status"] == "queued"
    claimed = await client.post("/v1/agent/claim", params={"wait": 0}, headers=node)
    assert (claimed.json()["job"]["id"], claimed.json()["placement"]["device_id"]) == (gpu_job["id"], "gpu0")


async def test_work_running_on_a_device_runs_on_when_it_is_cordoned(client, org):
    """A job already running on the GPU is its holder's still: renewed and completed as before."""
    _, key = org
    node_id, node = await pair(client, key)
    running = await submit(client, key, GPU_JOB)
    held = (await client.post("/v1/agent/claim", params={"wait": 0}, headers=node)).json()["job"]
    assert held["id"] == running["id"]
    assert (await client.post(f"/v1/nodes/{node_id}/cordon", json={"device": "gpu0"}, headers=bearer(key))).status_code == 200
    renewed = await client.post(f"/v1/agent/jobs/{held['id']}/renew", json={"attempt": 1}, headers=node)
    done = await client.post(f"/v1/agent/jobs/{held['id']}/complete", json={"attempt": 1, "result": {}}, headers=node)
    assert (renewed.status_code, done.status_code, done.json()["status"]) == (200, 200, "complete")


async def test_explain_names_the_cordoned_device_and_another_node_takes_the_work(client, org):
    """With a second node's GPU free, a GPU job is queued, not blocked; explain lists the cordoned GPU as
    ineligible (``device_cordoned``) and the other as the place it will run."""
    _, key = org
    first, _ = await pair(client, key, "first")
    await pair(client, key, "second")
    await client.post(f"/v1/nodes/{first}/cordon", json={"device": "gpu0", "reason": "Xid 79"}, headers=bearer(key))
    queued = await submit(client, key, GPU_JOB)
    assert queued["status"] == "queued"
    explained = (await client.get(f"/v1/jobs/{queued['id']}/explain", headers=bearer(key))).json()
    refused = {(r["node_id"], r["device_label"]): r["reason"] for r in explained["ineligible"]}
    assert refused[(first, "gpu0")] == "device_cordoned", refused
    assert [(e["device_label"]) for e in explained["eligible"]] == ["gpu0"]
    assert explained["eligible"][0]["node_id"] != first


async def test_a_cordon_is_recorded_once_and_verify_agrees(client, org):
    """The node's stream holds each change once, with who made it and why: the same cordon again records
    nothing, a new reason is recorded, an uncordon of a device not cordoned records nothing. The views rebuilt
    from the log equal the live ones."""
    _, key = org
    node_id, _ = await pair(client, key)
    path = f"/v1/nodes/{node_id}"
    for body in ({"device": "gpu0", "reason": "ECC"}, {"device": "gpu0", "reason": "ECC"}, {"device": "gpu0", "reason": "Xid 48"}):
        assert (await client.post(f"{path}/cordon", json=body, headers=bearer(key))).status_code == 200
    for _ in range(2):
        assert (await client.post(f"{path}/uncordon", json={"device": "gpu0"}, headers=bearer(key))).status_code == 200
    history = (await client.get(f"{path}/events", headers=bearer(key))).json()["events"]
    changes = [(e["type"], e["data"].get("reason")) for e in history if "cordon" in e["type"]]
    assert changes == [("node.device_cordoned", "ECC"), ("node.device_cordoned", "Xid 48"), ("node.device_uncordoned", None)]
    assert all(e["data"]["by"] for e in history if "cordon" in e["type"])
    verified = await client.post("/v1/projections/verify", headers=bearer(key))
    assert verified.json() == {"ok": True, "differences": []}, verified.text


async def test_who_may_cordon_and_what_a_bad_request_gets(client, org, conn, db_url):
    """No credential → 401; a key without ``nodes:admin`` → 403; the node's own credential → 403; another
    organization's node or none → 404 ``node_not_found``; a device the node does not report → 404
    ``device_not_found``; a body not as the contract says → 422; a retired node → 409 ``node_retired``. None
    of these writes anything."""
    org_id, key = org
    node_id, node = await pair(client, key)
    _, other_key = await create_organization(conn, "other")
    reader = await create_api_key(conn, org_id, ["jobs:read"])
    path = f"/v1/nodes/{node_id}/cordon"
    body = {"device": "gpu0"}
    before = await written(db_url, "nodes WHERE cordoned <> '{}'")
    assert (await client.post(path, json=body)).status_code == 401
    assert (await client.post(path, json=body, headers=bearer(reader))).status_code == 403
    assert (await client.post(path, json=body, headers=node)).status_code == 403
    for url, headers in ((path, bearer(other_key)), ("/v1/nodes/00000000-0000-0000-0000-000000000000/cordon", bearer(key))):
        gone = await client.post(url, json=body, headers=headers)
        assert (gone.status_code, gone.json()["error"]) == (404, "node_not_found"), url
    for verb in ("cordon", "uncordon"):
        missing = await client.post(f"/v1/nodes/{node_id}/{verb}", json={"device": "gpu7"}, headers=bearer(key))
        assert (missing.status_code, missing.json()["error"]) == (404, "device_not_found"), verb
    for bad, field in (({}, "device"), ({"device": ""}, "device"), ({"device": "gpu0", "reason": ""}, "reason"),
                       ({"device": "gpu0", "reason": "x" * 501}, "reason"), ({"device": "gpu0", "why": "x"}, None)):  # fmt: skip
        refused = await client.post(path, json=bad, headers=bearer(key))
        assert (refused.status_code, refused.json()["error"], refused.json().get("field")) == (422, "invalid_request", field), bad
    assert await written(db_url, "nodes WHERE cordoned <> '{}'") == before
    assert (await client.post(f"/v1/nodes/{node_id}/retire", headers=bearer(key))).status_code == 200
    before = await written(db_url, "nodes WHERE cordoned <> '{}'")
    retired = await client.post(path, json=body, headers=bearer(key))
    assert (retired.status_code, retired.json()["error"]) == (409, "node_retired")
    assert await written(db_url, "nodes WHERE cordoned <> '{}'") == before


async def test_a_parked_long_poll_takes_work_its_device_gets_back(db_url, org):
    """A node whose only GPU is cordoned long-polls while a GPU job waits, queued for another GPU node that is
    offline now (so nothing unblocks when the card comes back); put back in service, the card's job is claimed
    by that poll at once, woken by the uncordon's own hint: the safety poll is 30 s away."""
    _, key = org
    with LiveServer(db_url, UMBRA_POLL_FALLBACK_SECONDS="30") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            node_id, node = await pair(client, key)
            _, away = await pair(client, key, "gpu-box-away")
            assert (await client.post("/v1/agent/offline", headers=away)).json()["status"] == "offline"
            await client.post(f"/v1/nodes/{node_id}/cordon", json={"device": "gpu0"}, headers=bearer(key))
            waiting = await submit(client, key, GPU_JOB)
            assert waiting["status"] == "queued"  # the node away could run it
            answers = []
            async with anyio.create_task_group() as tg:

                async def poll() -> None:
                    answers.append(await client.post("/v1/agent/claim", params={"wait": 20}, headers=node))

                tg.start_soon(poll)
                await anyio.sleep(0.5)
                started = anyio.current_time()
                await client.post(f"/v1/nodes/{node_id}/uncordon", json={"device": "gpu0"}, headers=bearer(key))
            (claimed,) = answers
            assert (claimed.status_code, claimed.json()["job"]["id"]) == (200, waiting["id"]), claimed.text
            assert anyio.current_time() - started < 5


async def test_the_cli_cordons_and_uncordons_a_device(client, org, db_url):
    """``umbra admin cordon|uncordon --org ORG NODE DEVICE`` records the same events, attributed to ``cli``."""
    org_id, key = org
    node_id, _ = await pair(client, key)
    env = {"UMBRA_DATABASE_URL": db_url}
    done = await anyio.to_thread.run_sync(lambda: run_umbra("admin", "cordon", "--org", str(org_id), node_id, "gpu0",
                                                            "--reason", "fan failing", "--json", env=env))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert '"cordoned": {"gpu0": "fan failing"}' in done.stdout, done.stdout
    node = (await client.get(f"/v1/nodes/{node_id}", headers=bearer(key))).json()
    assert node["cordoned"] == {"gpu0": "fan failing"}
    undone = await anyio.to_thread.run_sync(lambda: run_umbra("admin", "uncordon", "--org", str(org_id), node_id, "gpu0",
                                                              env=env))  # fmt: skip
    assert undone.returncode == 0, undone.stderr
    history = (await client.get(f"/v1/nodes/{node_id}/events", headers=bearer(key))).json()["events"]
    assert [e["data"]["by"] for e in history if "cordon" in e["type"]] == ["cli", "cli"]
    missing = await anyio.to_thread.run_sync(lambda: run_umbra("admin", "cordon", "--org", str(org_id), node_id, "gpu9",
                                                               env=env))  # fmt: skip
    assert missing.returncode != 0 and "device_not_found" in missing.stderr, missing.stderr


async def test_claims_of_several_jobs_never_use_the_cordoned_card(client, org):
    """A node with two GPUs, gpu0 cordoned: a claim of five, a completion that claims the next and a report
    that claims three place nothing on gpu0."""
    _, key = org
    node_id, node = await pair(client, key, devices=TWO_GPUS)
    await client.post(f"/v1/nodes/{node_id}/cordon", json={"device": "gpu0"}, headers=bearer(key))
    for job in [GPU_JOB] * 3 + [CPU_JOB] * 2:
        await submit(client, key, job)
    claimed = (await client.post("/v1/agent/claim", params={"wait": 0, "max": 5}, headers=node)).json()["claims"]
    places = sorted((c["job"]["kind"], c["placement"]["device_id"]) for c in claimed)
    assert [kind for kind, _ in places] == ["render", "tally", "tally"], places  # one 16 GB render per card
    assert "gpu0" not in {device for _, device in places}, places
    gpu_job = next(c["job"] for c in claimed if c["job"]["kind"] == "render")
    chained = await client.post(f"/v1/agent/jobs/{gpu_job['id']}/complete", params={"claim_next": "true"},
                                json={"attempt": gpu_job["attempt"], "result": {}}, headers=node)  # fmt: skip
    following = chained.json()["next_claim"]
    assert following["placement"]["device_id"] == "gpu1", chained.text
    reported = await client.post("/v1/agent/complete", params={"claim_next": 3}, headers=node, json={
        "results": [{"job_id": following["job"]["id"], "attempt": following["job"]["attempt"], "result": {}}]})
    assert [c["placement"]["device_id"] for c in reported.json()["next_claims"]] == ["gpu1"], reported.text


async def test_a_job_on_a_cordoned_integrated_gpu_still_holds_the_ram_it_shares(client, org):
    """Unified memory: a 40 GB job runs on the integrated GPU, which is then cordoned; the CPU beside it shares
    that RAM (64 GB), so a second 40 GB job is not placed on the CPU while the first runs."""
    _, key = org
    node_id, node = await pair(client, key, "mac", devices=UNIFIED)
    first = await submit(client, key, {"kind": "gen", "requires": {"vram_min_mb": 40000, "accelerators": ["metal"]}})
    held = (await client.post("/v1/agent/claim", params={"wait": 0}, headers=node)).json()
    assert (held["job"]["id"], held["placement"]["device_id"]) == (first["id"], "igpu")
    await client.post(f"/v1/nodes/{node_id}/cordon", json={"device": "igpu", "reason": "driver"}, headers=bearer(key))
    assert (await submit(client, key, {"kind": "crunch", "requires": {"ram_min_mb": 40000}}))["status"] == "queued"
    assert (await client.post("/v1/agent/claim", params={"wait": 0}, headers=node)).status_code == 204


async def test_no_claim_lands_on_the_card_once_its_cordon_has_answered(client, org, db_url):
    """Four agents claim from a two-GPU node while gpu0 is cordoned under them: no ``job.claimed`` on gpu0
    comes after the cordon in the log (its change holds the node's claim guard), and claims go on, on gpu1."""
    _, key = org
    node_id, node = await pair(client, key, devices=TWO_GPUS)
    light = {"kind": "light", "requires": {"accelerators": ["cuda"]}}  # takes no memory: many fit one card
    assert (await client.post("/v1/jobs/batch", json={"jobs": [light] * 900}, headers=bearer(key))).status_code == 201
    stop = anyio.Event()
    claimed = {"before": 0, "after": 0}
    moment = "before"

    async def claimer() -> None:
        while not stop.is_set():
            answer = await client.post("/v1/agent/claim", params={"wait": 0, "max": 3}, headers=node)
            if answer.status_code == 200:
                claimed[moment] += len(answer.json()["claims"])

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(claimer)
        await eventually(lambda: _at_least(claimed, "before", 30), timeout=20)  # claims are going on, on both cards
        assert (await client.post(f"/v1/nodes/{node_id}/cordon", json={"device": "gpu0"}, headers=bearer(key))).status_code == 200
        moment = "after"
        await eventually(lambda: _at_least(claimed, "after", 30), timeout=20)  # and go on after it answered
        stop.set()
    async with await psycopg.AsyncConnection.connect(db_url) as c:
        [(cordoned_at,)] = await (await c.execute("SELECT position FROM events WHERE type = 'node.device_cordoned'")).fetchall()
        after = await (await c.execute("SELECT data->'placement'->>'device_id', count(*) FROM events WHERE type = 'job.claimed'"
                                       " AND position > %s GROUP BY 1", (cordoned_at,))).fetchall()  # fmt: skip
    assert dict(after).keys() == {"gpu1"}, after


async def _at_least(counts: dict, key: str, least: int) -> bool:
    return counts[key] >= least
