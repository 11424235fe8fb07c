"""The fleet changing under a live queue, through the real HTTP routes.

Nodes pair, report devices by heartbeat, go stale and come back, are drained, retired and signed off; the
model registry changes. Jobs move between ``queued`` and ``blocked`` with reasons that are true and say
what to change, explain agrees at each step, nodes out of service take nothing new, and the log explains
every state a view showed.
"""

from __future__ import annotations

import time
from datetime import datetime

import anyio
import httpx
import msgspec
import pytest

from tests.conftest import LiveServer
from tests.helpers import bearer, eventually, until

from .queue_support import CPU64_JSON, GPU24, http_claim, http_complete

pytestmark = pytest.mark.anyio

CPU = CPU64_JSON
GPU = msgspec.to_builtins(GPU24)
SMALL_GPU = {**GPU, "vram_total_mb": 8192, "vram_free_mb": 8000}


async def pair(client, key: str, name: str, devices, *, trust_domain: str = "local", beat: bool = True) -> tuple[str, str]:
    """``(node_id, credential)`` of a node paired with ``devices`` (and heartbeated online unless ``beat`` is False)."""
    issued = await client.post("/v1/pairings", json={"name": name, "trust_domain": trust_domain}, headers=bearer(key))
    assert issued.status_code == 201, issued.text
    redeemed = await client.post("/v1/pairings/redeem", json={"code": issued.json()["code"], "name": name,
                                                              "agent_version": "1", "devices": list(devices)})  # fmt: skip
    assert redeemed.status_code == 201, redeemed.text
    node_id, credential = redeemed.json()["node_id"], redeemed.json()["credential"]
    if beat:
        await heartbeat(client, credential, devices)
    return node_id, credential


async def heartbeat(client, credential: str, devices) -> dict:
    answer = await client.post("/v1/agent/heartbeat", json={"devices": list(devices), "agent_version": "1"},
                               headers=bearer(credential))  # fmt: skip
    assert answer.status_code == 200, answer.text
    return answer.json()


async def submit(client, key: str, **requires) -> dict:
    answer = await client.post("/v1/jobs", json={"kind": "infer", "payload": {}, "requires": requires}, headers=bearer(key))
    assert answer.status_code == 201, answer.text
    return answer.json()


async def get(client, key: str, path: str, **params) -> dict:
    answer = await client.get(path, params=params, headers=bearer(key))
    assert answer.status_code == 200, answer.text
    return answer.json()


async def job(client, key: str, job_id: str) -> dict:
    return await get(client, key, f"/v1/jobs/{job_id}")


async def explain(client, key: str, job_id: str) -> dict:
    return await get(client, key, f"/v1/jobs/{job_id}/explain")


async def job_events(client, key: str, job_id: str) -> list[dict]:
    return (await get(client, key, f"/v1/jobs/{job_id}/events"))["events"]


async def node_events(client, key: str, node_id: str) -> list[dict]:
    return (await get(client, key, f"/v1/nodes/{node_id}/events"))["events"]


async def claim(client, credential: str, wait: float = 0) -> httpx.Response:
    return await client.post("/v1/agent/claim", params={"wait": wait}, headers=bearer(credential))


async def put_model(client, key: str, slug: str, **spec) -> dict:
    answer = await client.put(f"/v1/models/{slug}", json=spec, headers=bearer(key))
    assert answer.status_code == 200, answer.text
    return answer.json()


async def verified(client, key: str) -> None:
    answer = await client.post("/v1/projections/verify", headers=bearer(key))
    assert answer.status_code == 200 and answer.json()["ok"], answer.text


def by_device(body: dict) -> dict[tuple[str, str | None], str]:
    """Explain's refusals, by (node id, device label)."""
    return {(r["node_id"], r["device_label"]): r["reason"] for r in body["ineligible"]}


# -- blocking reasons say what to change ---------------------------------------------------------


async def test_a_blocking_reason_names_a_too_small_card_not_a_missing_accelerator(api, org):
    """A CUDA job needing 40 GB beside a 24 GB CUDA card and a CPU: the shortfall is the card's size. The reason
    must not also say that no device supports CUDA (the card does), or the operator looks for the wrong fix."""
    _, key = org
    await pair(api, key, "box", [CPU, GPU])
    waiting = await submit(api, key, vram_min_mb=40000, accelerators=["cuda"])
    shown = await job(api, key, waiting["id"])
    assert (shown["status"], shown["blocked_reason"]) == (
        "blocked", "no_eligible_device: needs 40000 MB VRAM, largest is 24576 MB (box/gpu0)")


async def test_a_blocking_reason_names_a_card_that_would_fit_outside_the_jobs_trust_domain(api, org):
    """A 40 GB job allowed only in ``secure``, whose card there is 24 GB, while a 48 GB card sits in ``local``:
    the reason says both, so the operator widens the trust domain (or moves the node) rather than buying
    hardware; and once the job may run in ``local`` it is queued there."""
    _, key = org
    await pair(api, key, "local-box", [{**GPU, "vram_total_mb": 49152, "vram_free_mb": 48000}])
    await pair(api, key, "vault", [GPU], trust_domain="secure")
    waiting = await submit(api, key, vram_min_mb=40000, trust_domains=["secure"])
    shown = await job(api, key, waiting["id"])
    assert (shown["status"], shown["blocked_reason"]) == (
        "blocked", "no_eligible_device: needs 40000 MB VRAM, largest is 24576 MB (vault/gpu0); "
                   "local-box/gpu0 would fit but is outside trust domain secure (in local)")  # fmt: skip
    assert (await submit(api, key, vram_min_mb=40000, trust_domains=["secure", "local"]))["status"] == "queued"


# -- liveness: the log explains every status a view showed ---------------------------------------


@pytest.fixture
def lazy_sweeper_server(db_url):
    """Stale after 2 s of silence; the sweeper looks at startup and then only every 30 s (as a loaded or
    restarting controller may), so whatever records a node going stale must not depend on its timing."""
    with LiveServer(db_url, UMBRA_HEARTBEAT_INTERVAL_SECONDS="1", UMBRA_HEARTBEAT_STALE_SECONDS="2",
                    UMBRA_SWEEP_INTERVAL_SECONDS="30") as server:  # fmt: skip
        yield server


async def test_a_node_read_offline_and_back_before_the_sweeper_looked_has_the_spell_in_its_log(lazy_sweeper_server, org):
    """A node read ``offline`` (silent past the threshold) and brought back by a heartbeat before the sweeper
    looked has that spell in its stream: ``node.went_offline`` with its last beat before the silence, then
    the heartbeat that promoted it. The sweeper records no second spell, and the views equal the log."""
    _, key = org
    async with httpx.AsyncClient(base_url=lazy_sweeper_server.url, timeout=30) as api:
        node_id, credential = await pair(api, key, "box", [CPU])
        first_seen = (await get(api, key, f"/v1/nodes/{node_id}"))["last_heartbeat_at"]
        await anyio.sleep(2.6)
        seen = await get(api, key, f"/v1/nodes/{node_id}")
        assert (seen["status"], seen["stored_status"], seen["schedulable"]) == ("offline", "online", False)
        assert (await heartbeat(api, credential, [CPU]))["status"] == "online"
        events = await node_events(api, key, node_id)
        assert [e["type"] for e in events][-2:] == ["node.went_offline", "node.heartbeat"]
        went = events[-2]
        assert datetime.fromisoformat(went["data"]["last_seen_at"]) == datetime.fromisoformat(first_seen)
        assert went["metadata"]["actor"] == "sweeper"
        assert events[-1]["metadata"]["actor"] == f"node:{node_id}"
        assert (await heartbeat(api, credential, [CPU]))["status"] == "online"
        await verified(api, key)
        types = [e["type"] for e in await node_events(api, key, node_id)]
        assert types.count("node.went_offline") == 1, types


@pytest.fixture
def fast_server(db_url):
    """Stale after 2 s of silence, blocked jobs fail after 3 s, the sweeper every 0.2 s."""
    with LiveServer(db_url, UMBRA_HEARTBEAT_INTERVAL_SECONDS="1", UMBRA_HEARTBEAT_STALE_SECONDS="2",
                    UMBRA_BLOCKED_TIMEOUT_SECONDS="3", UMBRA_SWEEP_INTERVAL_SECONDS="0.2") as server:  # fmt: skip
        yield server


async def test_the_blocked_timeout_counts_from_the_latest_block_and_fails_with_the_reason(fast_server, org):
    """A job blocked, returned to the queue and blocked again is timed from its second block (time spent
    queued in between does not count against it); when the timeout passes it fails with the blocking reason,
    and explain said when it would."""
    _, key = org
    async with httpx.AsyncClient(base_url=fast_server.url, timeout=30) as api:
        _, credential = await pair(api, key, "box", [CPU, GPU])
        cuda = await submit(api, key, accelerators=["cuda"])
        await heartbeat(api, credential, [CPU])
        assert (await job(api, key, cuda["id"]))["status"] == "blocked"
        await anyio.sleep(2.0)
        await heartbeat(api, credential, [CPU, GPU])
        assert (await job(api, key, cuda["id"]))["status"] == "queued"
        await heartbeat(api, credential, [CPU])
        reblocked = time.monotonic()
        assert (await job(api, key, cuda["id"]))["status"] == "blocked"
        assert "it fails at" in (await explain(api, key, cuda["id"]))["summary"]
        await anyio.sleep(1.5)  # 3.5 s after the first block, 1.5 s after the second
        assert (await job(api, key, cuda["id"]))["status"] == "blocked"

        async def failed() -> dict | None:
            shown = await job(api, key, cuda["id"])
            return shown if shown["status"] == "failed" else None

        ended = await eventually(failed, timeout=8)
        assert time.monotonic() - reblocked >= 2.5
        assert "cuda" in ended["error"]
        last = (await job_events(api, key, cuda["id"]))[-1]
        assert last["type"] == "job.failed" and last["data"]["reason"] == "blocked_timeout"


# -- devices shrinking and vanishing -------------------------------------------------------------


async def test_a_gpu_shrinking_below_a_jobs_floor_blocks_it_with_the_new_largest(api, org):
    """A heartbeat that reports a smaller card under the same label blocks a job only the old card could run,
    naming the need and the new largest card; the bigger card's return brings the job back."""
    _, key = org
    node_id, credential = await pair(api, key, "box", [GPU])
    big = await submit(api, key, vram_min_mb=16000)
    await heartbeat(api, credential, [SMALL_GPU])
    shown = await job(api, key, big["id"])
    assert shown["status"] == "blocked"
    assert "needs 16000 MB VRAM, largest is 8192 MB (box/gpu0)" in shown["blocked_reason"]
    assert by_device(await explain(api, key, big["id"])) == {(node_id, "gpu0"): "vram_insufficient"}
    await heartbeat(api, credential, [GPU])
    assert (await job(api, key, big["id"]))["status"] == "queued"


async def test_a_node_reporting_no_devices_blocks_everything_until_it_reports_some(api, org):
    """A heartbeat with an empty device set leaves no device in the organization: waiting work is blocked (it
    must not look alive), and the next report with devices brings it back and it is claimed."""
    _, key = org
    _, credential = await pair(api, key, "box", [CPU])
    plain = await submit(api, key)
    await heartbeat(api, credential, [])
    shown = await job(api, key, plain["id"])
    assert shown["status"] == "blocked" and shown["blocked_reason"].startswith("no_eligible_device"), shown
    await heartbeat(api, credential, [CPU])
    assert (await job(api, key, plain["id"]))["status"] == "queued"
    assert (await http_claim(api, credential))["id"] == plain["id"]


async def test_a_gpu_gone_while_a_job_runs_on_it_leaves_the_node_readable_and_claiming(api, org):
    """A heartbeat drops the GPU a running job was placed on: the job runs on (its holder completes it), the node
    and the job stay readable, explain says where it ran, and the node claims CPU work meanwhile."""
    _, key = org
    node_id, credential = await pair(api, key, "box", [CPU, GPU])
    await submit(api, key, vram_min_mb=8000, accelerators=["cuda"])
    held = (await claim(api, credential)).json()
    assert held["placement"]["device_id"] == "gpu0"
    await heartbeat(api, credential, [CPU])
    assert [d["label"] for d in (await get(api, key, f"/v1/nodes/{node_id}"))["devices"]] == ["cpu"]
    running = await explain(api, key, held["job"]["id"])
    assert running["status"] == "running" and "box/gpu0" in running["summary"]
    plain = await submit(api, key, ram_min_mb=1000)
    answer = await claim(api, credential)
    assert answer.status_code == 200 and answer.json()["job"]["id"] == plain["id"]
    assert answer.json()["placement"]["device_id"] == "cpu"
    await http_complete(api, credential, held["job"])
    await verified(api, key)


# -- the model registry and trust domains --------------------------------------------------------


async def test_a_model_newly_requiring_an_accelerator_blocks_its_jobs_and_putting_it_back_unblocks(api, org):
    """A job naming an unregistered model is blocked with that reason and returns when it is registered; a
    registry update making the model require an accelerator no device has blocks it again (reason and explain
    name it, no claim takes it); putting the model back returns it. Each transition is in the job's log,
    caused by the registry, and the claim lands on the GPU."""
    _, key = org
    _, credential = await pair(api, key, "box", [CPU, GPU])
    waiting = await submit(api, key, models=["llama3:8b"])
    shown = await job(api, key, waiting["id"])
    assert (shown["status"], shown["blocked_reason"]) == ("blocked", "model_not_registered: llama3:8b")
    assert set(by_device(await explain(api, key, waiting["id"])).values()) == {"model_not_registered"}
    await put_model(api, key, "llama3:8b", vram_min_mb=8000)
    assert (await job(api, key, waiting["id"]))["status"] == "queued"
    await put_model(api, key, "llama3:8b", vram_min_mb=8000, requires_accelerators=["rocm"])
    shown = await job(api, key, waiting["id"])
    assert shown["status"] == "blocked" and "rocm" in shown["blocked_reason"]
    assert set(by_device(await explain(api, key, waiting["id"])).values()) == {"accelerator_missing"}
    assert (await claim(api, credential)).status_code == 204
    await put_model(api, key, "llama3:8b", vram_min_mb=8000)
    assert (await job(api, key, waiting["id"]))["status"] == "queued"
    events = await job_events(api, key, waiting["id"])
    assert [e["type"] for e in events] == ["job.submitted", "job.blocked", "job.unblocked", "job.blocked", "job.unblocked"]
    assert all(e["metadata"].get("causation") == "models" for e in events[2:])
    answer = await claim(api, credential)
    assert answer.status_code == 200 and answer.json()["placement"]["device_id"] == "gpu0"
    await verified(api, key)


@pytest.mark.parametrize("slug", ["gemma4:26b", "meta-llama/Llama-3-8B", "llama3@q4+k_m"])
async def test_registering_a_model_whose_slug_has_punctuation_unblocks_its_jobs(api, org, slug):
    """Slugs such as ``gemma4:26b`` or ``meta-llama/Llama-3-8B`` registered with ``PUT /v1/models/{slug}`` are the
    slugs jobs name: the job blocked on ``model_not_registered`` returns to the queue."""
    _, key = org
    await pair(api, key, "box", [GPU])
    waiting = await submit(api, key, models=[slug])
    assert (await job(api, key, waiting["id"]))["blocked_reason"] == f"model_not_registered: {slug}"
    assert (await put_model(api, key, slug, vram_min_mb=1000))["slug"] == slug
    assert (await job(api, key, waiting["id"]))["status"] == "queued"


async def test_trust_domains_hold_through_pairing_and_claims(api, org):
    """A CUDA job allowed only in ``secure`` is blocked while no node is there; stays blocked (now for CUDA, with
    the capable node outside the domain named) when a CPU-only ``secure`` node pairs; returns to the queue when
    that node reports a GPU; and is never claimed by the other domain's node, only by the ``secure`` one."""
    _, key = org
    _, local = await pair(api, key, "local-box", [CPU, GPU])
    secured = await submit(api, key, trust_domains=["secure"], accelerators=["cuda"])
    shown = await job(api, key, secured["id"])
    assert shown["status"] == "blocked" and "secure" in shown["blocked_reason"]
    assert set(by_device(await explain(api, key, secured["id"])).values()) == {"trust_domain"}
    secure_id, secure = await pair(api, key, "vault", [CPU], trust_domain="secure")
    shown = await job(api, key, secured["id"])
    assert shown["blocked_reason"] == ("no_eligible_device: needs accelerator cuda, which no eligible device supports; "
                                       "local-box/gpu0 would fit but is outside trust domain secure (in local)")  # fmt: skip
    await heartbeat(api, secure, [CPU, GPU])
    assert (await job(api, key, secured["id"]))["status"] == "queued"
    assert (await claim(api, local)).status_code == 204
    answer = await claim(api, secure)
    assert answer.status_code == 200 and answer.json()["job"]["id"] == secured["id"]
    assert answer.json()["placement"]["node_id"] == secure_id


# -- drain, retire, sign-off, provisioning -------------------------------------------------------


async def test_a_draining_node_finishes_its_work_but_its_completion_claims_nothing_next(api, org):
    """Draining: the running job completes normally, but ``complete?claim_next=true`` claims nothing (the node
    takes no new work), a plain claim finds nothing, and work only it could run is blocked, explain saying
    ``node_draining``."""
    _, key = org
    node_id, credential = await pair(api, key, "box", [CPU, GPU])
    await submit(api, key, accelerators=["cuda"])
    held = await http_claim(api, credential)
    second = await submit(api, key, accelerators=["cuda"])
    drained = await api.post(f"/v1/nodes/{node_id}/drain", headers=bearer(key))
    assert drained.status_code == 200 and drained.json()["status"] == "draining"
    assert (await job(api, key, second["id"]))["status"] == "blocked"
    done = await api.post(f"/v1/agent/jobs/{held['id']}/complete", params={"claim_next": "true"},
                          json={"attempt": held["attempt"], "result": {}}, headers=bearer(credential))  # fmt: skip
    assert done.status_code == 200 and done.json()["status"] == "complete"
    assert done.json()["next_claim"] is None
    assert (await claim(api, credential)).status_code == 204
    body = await explain(api, key, second["id"])
    assert by_device(body) == {(node_id, "cpu"): "node_draining", (node_id, "gpu0"): "node_draining"}


async def test_a_draining_nodes_batch_report_claims_nothing_next(api, org):
    """``POST /v1/agent/complete?claim_next=N`` from a draining node completes its results and claims no new job."""
    _, key = org
    node_id, credential = await pair(api, key, "box", [CPU])
    await submit(api, key)
    held = await http_claim(api, credential)
    await submit(api, key)
    assert (await api.post(f"/v1/nodes/{node_id}/drain", headers=bearer(key))).status_code == 200
    report = await api.post("/v1/agent/complete", params={"claim_next": 2},
                            json={"results": [{"job_id": held["id"], "attempt": held["attempt"], "result": {}}]},
                            headers=bearer(credential))  # fmt: skip
    assert report.status_code == 200, report.text
    assert report.json()["results"][0]["status"] == 200 and report.json()["next_claims"] == []


@pytest.mark.parametrize("change", ["drain", "retire"])
async def test_a_node_drained_or_retired_mid_job_may_renew_and_complete_it(api, org, change):
    """Draining is "finish current work, take no new", and a job running on a retired node runs on: the holder's
    renewal and completion are accepted after the change."""
    _, key = org
    node_id, credential = await pair(api, key, "box", [CPU])
    await submit(api, key)
    held = await http_claim(api, credential)
    assert (await api.post(f"/v1/nodes/{node_id}/{change}", headers=bearer(key))).status_code == 200
    renewed = await api.post(f"/v1/agent/jobs/{held['id']}/renew", json={"attempt": held["attempt"]}, headers=bearer(credential))
    assert renewed.status_code == 200, renewed.text
    assert (await http_complete(api, credential, held))["status"] == "complete"


async def test_a_provisioning_node_counts_for_unblocking_and_draining_it_blocks_again(api, org):
    """A paired node never heard from may yet come online: its devices unblock work (explain says
    ``node_provisioning``); draining it before it ever beat blocks that work again."""
    _, key = org
    cuda = await submit(api, key, accelerators=["cuda"])
    assert (await job(api, key, cuda["id"]))["status"] == "blocked"
    node_id, _ = await pair(api, key, "new-box", [GPU], beat=False)
    assert (await job(api, key, cuda["id"]))["status"] == "queued"
    assert by_device(await explain(api, key, cuda["id"])) == {(node_id, "gpu0"): "node_provisioning"}
    assert (await api.post(f"/v1/nodes/{node_id}/drain", headers=bearer(key))).status_code == 200
    assert (await job(api, key, cuda["id"]))["status"] == "blocked"


async def test_signing_off_leaves_its_work_queued_and_explain_says_offline(api, org):
    """An agent that signs off reads ``offline`` (it may come back): work only it could run stays queued, not
    blocked; explain says ``node_offline``; its next heartbeat brings it back and it claims."""
    _, key = org
    _, credential = await pair(api, key, "box", [CPU, GPU])
    cuda = await submit(api, key, accelerators=["cuda"])
    off = await api.post("/v1/agent/offline", headers=bearer(credential))
    assert off.status_code == 200 and off.json()["status"] == "offline"
    assert (await job(api, key, cuda["id"]))["status"] == "queued"
    body = await explain(api, key, cuda["id"])
    assert body["eligible"] == [] and set(by_device(body).values()) == {"node_offline"}
    assert (await claim(api, credential)).status_code == 204
    await heartbeat(api, credential, [CPU, GPU])
    assert (await http_claim(api, credential))["id"] == cuda["id"]


async def test_a_retired_nodes_parked_long_poll_takes_nothing_and_does_not_hold_up_a_capable_node(api, org, live_server):
    """A node retired while its long-poll is parked never takes a job afterwards; a job submitted then goes to
    the other parked (capable) node at once, though the retired one parked first."""
    org_id, key = org
    retired_id, retired = await pair(api, key, "old", [CPU])
    live_id, alive = await pair(api, key, "new", [CPU])
    hub = live_server.app.state.waiters
    answers: dict[str, httpx.Response] = {}
    async with httpx.AsyncClient(base_url=live_server.url, timeout=60) as other:

        async def poll(name: str, credential: str, wait: float) -> None:
            answers[name] = await claim(other, credential, wait)

        async with anyio.create_task_group() as tg:
            tg.start_soon(poll, "retired", retired, 4)
            await until(lambda: hub.waiting(org_id) == 1)
            tg.start_soon(poll, "alive", alive, 20)
            await until(lambda: hub.waiting(org_id) == 2)
            assert (await api.post(f"/v1/nodes/{retired_id}/retire", headers=bearer(key))).status_code == 200
            started = time.monotonic()
            submitted = await submit(api, key)
            await until(lambda: "alive" in answers, timeout=10)
            assert time.monotonic() - started < 3
    assert answers["alive"].status_code == 200
    assert answers["alive"].json()["job"]["id"] == submitted["id"]
    assert answers["alive"].json()["placement"]["node_id"] == live_id
    assert answers["retired"].status_code == 204


@pytest.mark.parametrize("change", ["drain", "offline"])
async def test_a_node_drained_or_signed_off_while_parked_takes_nothing_afterwards(api, org, live_server, change):
    """A node drained (administrator) or signed off (agent) while its long-poll is parked takes no job submitted
    after the change answered; the job is blocked after a drain and stays queued after a sign-off (the node
    may come back)."""
    org_id, key = org
    node_id, credential = await pair(api, key, "box", [CPU])
    hub = live_server.app.state.waiters
    answers: list[httpx.Response] = []
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as other:

        async def poll() -> None:
            answers.append(await claim(other, credential, 3))

        async with anyio.create_task_group() as tg:
            tg.start_soon(poll)
            await until(lambda: hub.waiting(org_id) == 1)
            if change == "drain":
                done = await api.post(f"/v1/nodes/{node_id}/drain", headers=bearer(key))
            else:
                done = await api.post("/v1/agent/offline", headers=bearer(credential))
            assert done.status_code == 200
            waiting = await submit(api, key)
    assert answers[0].status_code == 204
    assert (await job(api, key, waiting["id"]))["status"] == ("blocked" if change == "drain" else "queued")


@pytest.fixture
def no_poll_server(db_url):
    """The safety poll 30 s away: a prompt answer can only come from a notification."""
    with LiveServer(db_url, UMBRA_POLL_FALLBACK_SECONDS="30") as server:
        yield server


async def test_a_node_coming_back_online_wakes_its_own_parked_long_poll(no_poll_server, org):
    """A node that signed off keeps a long-poll parked; a job only it could run is queued meanwhile (it may come
    back, so not blocked). Its next heartbeat brings it online and its parked long-poll takes the job at once,
    not at the safety poll."""
    org_id, key = org
    async with httpx.AsyncClient(base_url=no_poll_server.url, timeout=60) as api:
        _, credential = await pair(api, key, "box", [CPU, GPU])
        assert (await api.post("/v1/agent/offline", headers=bearer(credential))).status_code == 200
        hub = no_poll_server.app.state.waiters
        answers: list[httpx.Response] = []
        async with httpx.AsyncClient(base_url=no_poll_server.url, timeout=60) as other:

            async def poll() -> None:
                answers.append(await claim(other, credential, 20))

            async with anyio.create_task_group() as tg:
                tg.start_soon(poll)
                await until(lambda: hub.waiting(org_id) == 1)
                cuda = await submit(api, key, accelerators=["cuda"])
                await anyio.sleep(0.5)
                assert not answers
                await heartbeat(api, credential, [CPU, GPU])
                started = time.monotonic()
                await until(lambda: answers, timeout=25)
                elapsed = time.monotonic() - started
    assert answers[0].status_code == 200 and answers[0].json()["job"]["id"] == cuda["id"]
    assert elapsed < 5, elapsed


# -- blocked jobs in the queue's views -----------------------------------------------------------


async def test_blocked_jobs_are_listed_and_counted_as_blocked_until_unblocked(api, org):
    """A job blocked by a fleet change is listed by ``GET /v1/jobs?status=blocked`` and counted as blocked by the
    queue view, and leaves both once unblocked."""
    _, key = org
    _, credential = await pair(api, key, "box", [CPU, GPU])
    cuda = await submit(api, key, accelerators=["cuda"])
    await heartbeat(api, credential, [CPU])
    assert [j["id"] for j in (await get(api, key, "/v1/jobs", status="blocked"))["jobs"]] == [cuda["id"]]
    view = await get(api, key, "/v1/projections/queue")
    assert view["counts"].get("blocked") == 1 and view["counts"].get("queued", 0) == 0
    assert [j["id"] for j in view["jobs"]] == [cuda["id"]]
    await heartbeat(api, credential, [CPU, GPU])
    assert (await get(api, key, "/v1/jobs", status="blocked"))["jobs"] == []
    view = await get(api, key, "/v1/projections/queue")
    assert view["counts"].get("blocked", 0) == 0 and view["counts"].get("queued") == 1


async def test_as_of_shows_a_job_blocked_between_its_block_and_unblock(api, org):
    """``GET /v1/jobs/{id}?as_of=P`` at the position of ``job.blocked`` shows it blocked, at ``job.unblocked`` queued."""
    _, key = org
    _, credential = await pair(api, key, "box", [CPU, GPU])
    cuda = await submit(api, key, accelerators=["cuda"])
    await heartbeat(api, credential, [CPU])
    await heartbeat(api, credential, [CPU, GPU])
    events = await job_events(api, key, cuda["id"])
    blocked, unblocked = events[1]["position"], events[2]["position"]
    assert (await get(api, key, f"/v1/jobs/{cuda['id']}", as_of=blocked))["status"] == "blocked"
    assert (await get(api, key, f"/v1/jobs/{cuda['id']}", as_of=unblocked))["status"] == "queued"


async def test_a_job_unblocked_keeps_its_place_in_submission_order(api, org):
    """Ties of priority run in submission order: a job blocked and later unblocked is claimed before an
    equal-priority job submitted after it."""
    _, key = org
    _, credential = await pair(api, key, "box", [CPU])
    early = await submit(api, key, accelerators=["cuda"])
    await submit(api, key)
    assert (await job(api, key, early["id"]))["status"] == "blocked"
    await heartbeat(api, credential, [CPU, GPU])
    assert (await job(api, key, early["id"]))["status"] == "queued"
    assert (await http_claim(api, credential))["id"] == early["id"]


async def test_cancelling_a_blocked_job_ends_it_and_no_fleet_change_revives_it(api, org):
    """A blocked job can be cancelled; a later change that would have unblocked it leaves it cancelled, and a job
    it unblocks no longer carries a blocking reason."""
    _, key = org
    _, credential = await pair(api, key, "box", [CPU])
    doomed = await submit(api, key, accelerators=["cuda"])
    kept = await submit(api, key, accelerators=["cuda"])
    cancelled = await api.post(f"/v1/jobs/{doomed['id']}/cancel", headers=bearer(key))
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    await heartbeat(api, credential, [CPU, GPU])
    assert (await job(api, key, doomed["id"]))["status"] == "cancelled"
    shown = await job(api, key, kept["id"])
    assert shown["status"] == "queued" and shown["blocked_reason"] is None
    assert [e["type"] for e in await job_events(api, key, doomed["id"])] == ["job.submitted", "job.blocked", "job.cancelled"]
