"""Nodes, pairing and models over real HTTP: shapes, revocation, tenancy, refusals."""

from __future__ import annotations

from datetime import datetime

import httpx
import pytest

from umbra.compute.accounts import create_api_key, create_organization
from umbra.compute.auth import NODE_SCOPES
from umbra.compute.pairing import ATTEMPTS_PER_WINDOW as ATTEMPTS, WINDOW_SECONDS
from tests.conftest import LiveServer
from tests.helpers import bearer

pytestmark = pytest.mark.anyio

GPU = {"kind": "gpu_discrete", "label": "gpu0", "vram_total_mb": 24576, "vram_free_mb": 24000, "ram_total_mb": 0,
       "ram_free_mb": 0, "throughput_factor": 8.0, "accelerators": ["cuda"],
       "resident_models": [{"slug": "gemma4:26b", "vram_held_mb": 4000}]}
CPU = {"kind": "cpu", "label": "cpu", "vram_total_mb": 0, "vram_free_mb": 0, "ram_total_mb": 65536,
       "ram_free_mb": 30000, "throughput_factor": 1.0, "accelerators": [], "resident_models": []}


async def pair(client, key: str, name: str = "gpu-box", devices=(GPU, CPU)) -> tuple[str, str]:
    issued = await client.post("/v1/pairings", json={"name": name}, headers=bearer(key))
    assert issued.status_code == 201, issued.text
    redeemed = await client.post(
        "/v1/pairings/redeem",
        json={"code": issued.json()["code"], "name": name, "agent_version": "1.0", "devices": list(devices)},
    )
    assert redeemed.status_code == 201, redeemed.text
    return redeemed.json()["node_id"], redeemed.json()["credential"]


async def footprint(conn) -> tuple:
    row = await (await conn.execute(
        "SELECT (SELECT count(*) FROM events), (SELECT count(*) FROM nodes), (SELECT count(*) FROM node_liveness), "
        "(SELECT count(*) FROM pairing_codes), (SELECT count(*) FROM models), "
        "(SELECT count(*) FROM node_credentials WHERE revoked_at IS NOT NULL)")).fetchone()
    return tuple(row)


async def test_pair_beat_and_read_a_node(client, org):
    _, key = org
    issued = await client.post("/v1/pairings", json={"name": "gpu-box", "ttl_seconds": 120}, headers=bearer(key))
    assert issued.status_code == 201
    body = issued.json()
    assert body["node_name"] == "gpu-box" and len(body["code"]) == 6 and body["expires_at"].endswith("Z")
    assert (await client.get("/v1/nodes", headers=bearer(key))).json() == {"nodes": []}
    redeemed = await client.post("/v1/pairings/redeem", json={"code": body["code"], "name": "gpu-box",
                                                                "agent_version": "1.0", "devices": [GPU, CPU]})
    assert redeemed.status_code == 201 and set(redeemed.json()["scopes"]) == set(NODE_SCOPES)
    node_id, credential = redeemed.json()["node_id"], redeemed.json()["credential"]
    node = (await client.get(f"/v1/nodes/{node_id}", headers=bearer(key))).json()
    assert (node["status"], node["stored_status"], node["schedulable"], node["last_heartbeat_at"]) == (
        "provisioning", "provisioning", False, None)
    beat = await client.post("/v1/agent/heartbeat", json={"devices": [GPU, CPU], "agent_version": "1.0",
                                                          "agent_started_at": "2026-03-01T08:00:00Z"},
                             headers=bearer(credential))
    assert beat.status_code == 200
    assert beat.json() == {"node_id": node_id, "status": "online", "heartbeat_interval_seconds": 10}
    (node,) = (await client.get("/v1/nodes", headers=bearer(key))).json()["nodes"]
    assert {k: node[k] for k in ("id", "name", "status", "stored_status", "trust_domain", "agent_version",
                                 "agent_started_at", "schedulable")} == {
        "id": node_id, "name": "gpu-box", "status": "online", "stored_status": "online", "trust_domain": "local",
        "agent_version": "1.0", "agent_started_at": "2026-03-01T08:00:00Z", "schedulable": True}
    assert node["last_heartbeat_at"].endswith("Z") and "locality" in node
    assert [d["label"] for d in node["devices"]] == ["cpu", "gpu0"]
    assert node["devices"][1]["resident_models"] == [{"slug": "gemma4:26b", "vram_held_mb": 4000}]


async def test_a_revoked_credential_fails_at_once(client, org):
    _, key = org
    node_id, credential = await pair(client, key)
    for _ in range(2):  # the second beat is served from the verified-token cache
        assert (await client.post("/v1/agent/heartbeat", json={}, headers=bearer(credential))).status_code == 200
    revoked = await client.post(f"/v1/nodes/{node_id}/revoke", headers=bearer(key))
    assert revoked.status_code == 200 and revoked.json()["status"] == "retired"
    refused = await client.post("/v1/agent/heartbeat", json={}, headers=bearer(credential))
    assert refused.status_code == 401 and refused.json()["error"] == "unauthenticated"
    assert (await client.get("/v1/models", headers=bearer(credential))).status_code == 401


async def test_a_credential_revoked_elsewhere_fails_on_the_agent_hot_path(client, conn, org):
    """Claim, renew and complete re-check revocation inside their batch, not per request."""
    _, key = org
    node_id, credential = await pair(client, key, devices=(CPU,))
    await client.post("/v1/agent/heartbeat", json={"devices": [CPU]}, headers=bearer(credential))
    for _ in range(2):
        assert (await client.post("/v1/jobs", json={"kind": "echo"}, headers=bearer(key))).status_code == 201
    claimed = await client.post("/v1/agent/claim?wait=0", headers=bearer(credential))
    assert claimed.status_code == 200  # the token is now in this server's cache
    job = claimed.json()["job"]
    # Another server process revoked it: this one's cache was not told.
    await conn.execute("UPDATE node_credentials SET revoked_at = now() WHERE node_id = %s", (node_id,))
    before = await footprint(conn)
    attempt = {"attempt": job["attempt"]}
    for path, body in [("/v1/agent/claim?wait=0", None), (f"/v1/agent/jobs/{job['id']}/renew", attempt),
                       (f"/v1/agent/jobs/{job['id']}/complete", {**attempt, "result": None})]:
        refused = await client.post(path, json=body, headers=bearer(credential))
        assert refused.status_code == 401 and refused.json()["error"] == "unauthenticated", (path, refused.text)
    assert await footprint(conn) == before
    status = await client.get(f"/v1/jobs/{job['id']}", headers=bearer(key))
    assert status.json()["status"] == "running"


async def test_revoking_a_node_ends_the_leases_it_holds_at_once(client, conn, org):
    """A revoked node can never report: its jobs go back to the queue when the revocation answers,
    claimable by another node at once, instead of waiting out their leases. The run is not charged:
    a job allowed one attempt still runs elsewhere, and its next failure finds its attempts as they were."""
    _, key = org
    revoked_id, revoked_credential = await pair(client, key, name="lost-box", devices=(CPU,))
    _, other_credential = await pair(client, key, name="spare-box", devices=(CPU,))
    for credential in (revoked_credential, other_credential):
        await client.post("/v1/agent/heartbeat", json={"devices": [CPU]}, headers=bearer(credential))
    submitted = [(await client.post("/v1/jobs", json={"kind": "echo", "max_attempts": attempts},
                                    headers=bearer(key))).json()["id"] for attempts in (3, 1, 3)]  # fmt: skip
    held = [(await client.post("/v1/agent/claim?wait=0", headers=bearer(revoked_credential))).json()["job"]["id"]
            for _ in range(2)]  # fmt: skip
    kept = (await client.post("/v1/agent/claim?wait=0", headers=bearer(other_credential))).json()["job"]["id"]
    assert held == submitted[:2] and kept == submitted[2]

    revoked = await client.post(f"/v1/nodes/{revoked_id}/revoke", headers=bearer(key))
    assert revoked.status_code == 200
    jobs = {job_id: (await client.get(f"/v1/jobs/{job_id}", headers=bearer(key))).json() for job_id in submitted}
    for job_id in held:
        assert (jobs[job_id]["status"], jobs[job_id]["lease_owner"], jobs[job_id]["attempt"]) == ("queued", None, 1)
        assert jobs[job_id]["error"] == "lease ended: the holding node's credentials were revoked"
    assert jobs[kept]["status"] == "running"  # another node's lease is its own
    ended = (await client.get(f"/v1/jobs/{held[0]}/events", headers=bearer(key))).json()["events"][-1]
    assert ended["type"] == "job.lease_expired"
    assert {k: ended["data"][k] for k in ("cause", "node_id", "requeued")} == {
        "cause": "node_revoked", "node_id": revoked_id, "requeued": True}
    [(metadata,)] = await (await conn.execute(
        "SELECT metadata FROM events WHERE position = %s", (ended["position"],))).fetchall()
    assert metadata["causation"] == f"node:{revoked_id}" and metadata["actor"]

    taken = await client.post("/v1/agent/claim?wait=0", headers=bearer(other_credential))
    assert taken.status_code == 200 and taken.json()["job"]["id"] == held[0]
    last = (await client.post("/v1/agent/claim?wait=0", headers=bearer(other_credential))).json()["job"]
    assert (last["id"], last["max_attempts"], last["attempt"]) == (held[1], 1, 2)  # one attempt, uncharged run
    failed = await client.post(f"/v1/agent/jobs/{held[1]}/fail", json={"attempt": 2, "error": "oom", "retry": True},
                               headers=bearer(other_credential))  # fmt: skip
    assert failed.json()["status"] == "failed"  # its one charged run was this one
    explained = (await client.get(f"/v1/jobs/{held[1]}/explain", headers=bearer(key))).json()["summary"]
    assert "attempt 2 (run 1 of 1; 1 earlier claim not charged)" in explained, explained
    before = await footprint(conn)
    assert (await client.post(f"/v1/nodes/{revoked_id}/revoke", headers=bearer(key))).status_code == 200
    assert await footprint(conn) == before  # revoking again changes nothing


async def test_drain_and_retire(client, org):
    _, key = org
    node_id, credential = await pair(client, key)
    await client.post("/v1/agent/heartbeat", json={}, headers=bearer(credential))
    drained = await client.post(f"/v1/nodes/{node_id}/drain", headers=bearer(key))
    assert drained.status_code == 200 and (drained.json()["status"], drained.json()["schedulable"]) == ("draining", False)
    beat = await client.post("/v1/agent/heartbeat", json={"devices": [CPU]}, headers=bearer(credential))
    assert beat.json()["status"] == "draining"
    assert (await client.post(f"/v1/nodes/{node_id}/retire", headers=bearer(key))).json()["status"] == "retired"
    refused = await client.post(f"/v1/nodes/{node_id}/drain", headers=bearer(key))
    assert refused.status_code == 409 and refused.json()["error"] == "node_retired"


async def test_another_organizations_node_is_not_found(client, conn, org):
    _, key = org
    node_id, credential = await pair(client, key)
    other_org, other_key = await create_organization(conn, "globex")
    _, other_credential = await pair(client, other_key, "other-box")
    before = await footprint(conn)
    for method, path in [("GET", f"/v1/nodes/{node_id}"), ("POST", f"/v1/nodes/{node_id}/drain"),
                         ("POST", f"/v1/nodes/{node_id}/retire"), ("POST", f"/v1/nodes/{node_id}/revoke")]:
        answer = await client.request(method, path, headers=bearer(other_key))
        assert answer.status_code == 404 and answer.json()["error"] == "node_not_found", path
    assert (await client.get(f"/v1/nodes/{node_id}", headers=bearer(other_credential))).status_code == 404
    assert [n["name"] for n in (await client.get("/v1/nodes", headers=bearer(other_key))).json()["nodes"]] == ["other-box"]
    assert await footprint(conn) == before
    own = await client.get(f"/v1/nodes/{node_id}", headers=bearer(credential))
    assert own.status_code == 200 and own.json()["id"] == node_id
    assert (await client.get("/v1/nodes", headers=bearer(credential))).status_code == 403
    assert (await client.get("/v1/nodes/not-a-uuid", headers=bearer(key))).json()["error"] == "node_not_found"


async def test_refused_requests_write_nothing(client, conn, org):
    org_id, key = org
    reader = await create_api_key(conn, org_id, ["jobs:read"])
    node_id, credential = await pair(client, key)
    before = await footprint(conn)
    attempts = [
        ("POST", "/v1/pairings", {"name": "x"}, None, 401, "unauthenticated"),
        ("POST", "/v1/pairings", {"name": "x"}, reader, 403, "forbidden"),
        ("POST", "/v1/pairings", {"name": "x", "ttl_seconds": 59}, key, 422, "invalid_request"),
        ("POST", "/v1/pairings", {"name": "x", "colour": "red"}, key, 422, "invalid_request"),
        ("POST", "/v1/agent/heartbeat", {"devices": [{**CPU, "vram_fre_mb": 1}]}, credential, 422, "invalid_request"),
        ("POST", "/v1/agent/heartbeat", {"devices": [CPU, CPU]}, credential, 422, "invalid_request"),
        ("POST", "/v1/agent/heartbeat", {}, key, 403, "forbidden"),
        ("POST", f"/v1/nodes/{node_id}/drain", None, reader, 403, "forbidden"),
        ("POST", f"/v1/nodes/{node_id}/revoke", None, credential, 403, "forbidden"),
        ("PUT", "/v1/models/gemma4:26b", {"vram_min_mb": 1}, reader, 403, "forbidden"),
        ("PUT", "/v1/models/gemma4:26b", {"kind": "llm"}, key, 422, "invalid_request"),
        ("PUT", "/v1/models/gemma4:26b", {"vram_min_mb": 16000, "vram_preferred_mb": 8000}, key, 422, "invalid_request"),
        ("PUT", "/v1/models/-bad", {"vram_min_mb": 1}, key, 422, "invalid_request"),
        # A path's last newline is part of it: no route takes it for the model the slug names before it.
        ("PUT", "/v1/models/gemma4:26b%0A", {"vram_min_mb": 1}, key, 404, "not_found"),
        ("POST", f"/v1/nodes/{node_id}/drain%0A", None, key, 404, "not_found"),
    ]
    for method, path, body, token, status, code in attempts:
        answer = await client.request(method, path, json=body, headers=bearer(token) if token else {})
        assert (answer.status_code, answer.json()["error"]) == (status, code), (path, body, answer.text)
        assert answer.json()["message"]
    assert await footprint(conn) == before


async def test_the_model_registry_is_per_organization(client, conn, org):
    org_id, key = org
    _, credential = await pair(client, key)
    put = await client.put("/v1/models/gemma4:26b", json={"vram_min_mb": 16000, "vram_preferred_mb": 20000,
                                                          "requires_accelerators": ["cuda"]}, headers=bearer(key))
    assert put.status_code == 200
    assert {k: put.json()[k] for k in ("slug", "kind", "vram_min_mb", "ram_min_mb", "ram_floor_mb")} == {
        "slug": "gemma4:26b", "kind": "llm", "vram_min_mb": 16000, "ram_min_mb": None, "ram_floor_mb": 16000}
    replaced = await client.put("/v1/models/gemma4:26b", json={"vram_min_mb": 18000, "ram_min_mb": 20000},
                                headers=bearer(key))
    assert (replaced.json()["vram_min_mb"], replaced.json()["requires_accelerators"]) == (18000, [])
    await client.put("/v1/models/meta-llama/Llama-3-8B", json={"vram_min_mb": 8000}, headers=bearer(key))
    reader = await create_api_key(conn, org_id, ["jobs:read"])
    for token in (key, reader, credential):
        listed = await client.get("/v1/models", headers=bearer(token))
        assert [m["slug"] for m in listed.json()["models"]] == ["gemma4:26b", "meta-llama/Llama-3-8B"]
    _, other_key = await create_organization(conn, "globex")
    assert (await client.get("/v1/models", headers=bearer(other_key))).json() == {"models": []}


async def test_a_model_registered_with_a_zero_ram_floor_is_not_run_from_a_smaller_cpu(client, org):
    """A RAM floor of 0 beside a VRAM floor is no measurement: the VRAM floor stands in for RAM, so a
    16,000 MB model waits (blocked) rather than running on a CPU with 3,000 MB free."""
    _, key = org
    put = await client.put("/v1/models/big:16b", json={"vram_min_mb": 16000, "ram_min_mb": 0}, headers=bearer(key))
    assert put.status_code == 200, put.text
    small_cpu = {**CPU, "ram_total_mb": 4096, "ram_free_mb": 3000}
    _, credential = await pair(client, key, "small-box", devices=(small_cpu,))
    created = await client.post("/v1/jobs", json={"kind": "infer", "requires": {"models": ["big:16b"]}}, headers=bearer(key))
    assert (created.status_code, created.json()["status"]) == (201, "blocked"), created.text
    assert (await client.post("/v1/agent/claim?wait=0", headers=bearer(credential))).status_code == 204


async def seconds_until_the_first_attempt_leaves(conn) -> int:
    """What ``Retry-After`` should say now: when the oldest counted attempt leaves the 15-minute window (database clock)."""
    [(left,)] = await (await conn.execute(
        "SELECT greatest(1, ceil(extract(epoch FROM attempted_at[1] + make_interval(secs => %s) - umbra_now())))::int"
        " FROM pairing_attempt_times", (WINDOW_SECONDS,))).fetchall()  # fmt: skip
    return left


async def test_the_twenty_first_redeem_is_429_with_retry_after(client, conn, org):
    _, key = org
    code = (await client.post("/v1/pairings", json={"name": "gpu-box"}, headers=bearer(key))).json()["code"]
    wrong = f"{(int(code) + 1) % 1_000_000:06d}"
    for _ in range(20):
        answer = await client.post("/v1/pairings/redeem", json={"code": wrong, "name": "gpu-box"})
        assert answer.status_code == 401 and answer.json()["error"] == "pairing_code_invalid"
    before = await seconds_until_the_first_attempt_leaves(conn)
    limited = await client.post("/v1/pairings/redeem", json={"code": code, "name": "gpu-box"})
    after = await seconds_until_the_first_attempt_leaves(conn)
    assert limited.status_code == 429 and limited.json()["error"] == "rate_limited"
    # The seconds until the first of the twenty leaves the window, when the next attempt is admitted: no more, no less.
    assert after <= int(limited.headers["Retry-After"]) <= before
    assert (await client.get("/v1/nodes", headers=bearer(key))).json() == {"nodes": []}


async def redeem_from(client, source: str, code: str = "000000") -> int:
    """The status of a redemption relayed by the trusted proxy for ``source``."""
    answer = await client.post("/v1/pairings/redeem", json={"code": code, "name": "gpu-box"},
                               headers={"X-Forwarded-For": source})
    return answer.status_code


async def test_an_ipv6_client_is_counted_by_its_64_not_by_each_address_it_takes(db_url, conn):
    """An IPv6 client holds a whole /64 at least: counted per address, it took a fresh one for each guess and
    was never limited. The 21st attempt from one /64 is refused, whatever address in it; another /64 is not."""
    with LiveServer(db_url, UMBRA_TRUSTED_PROXIES="127.0.0.1") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            answers = [await redeem_from(client, f"2001:db8:1:2:{i:x}::{i + 1:x}") for i in range(ATTEMPTS + 1)]
            assert answers == [401] * ATTEMPTS + [429], answers
            assert await redeem_from(client, "[2001:db8:1:2:ffff:ffff:ffff:ffff]:443") == 429
            assert await redeem_from(client, "2001:db8:1:3::1") == 401  # the neighbouring /64 has its own budget
    sources = [s for (s,) in await (await conn.execute("SELECT source FROM pairing_attempt_times ORDER BY 1")).fetchall()]
    assert sources == ["2001:db8:1:2::/64", "2001:db8:1:3::/64"]


async def test_the_ipv6_prefix_counted_is_a_setting(db_url):
    """``UMBRA_RATE_LIMIT_IPV6_PREFIX``: a site whose clients each hold a /56 counts them by it."""
    with LiveServer(db_url, UMBRA_TRUSTED_PROXIES="127.0.0.1", UMBRA_RATE_LIMIT_IPV6_PREFIX="56") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            answers = [await redeem_from(client, f"2001:db8:1:{i:x}::1") for i in range(ATTEMPTS + 1)]
            assert answers == [401] * ATTEMPTS + [429], answers
            assert await redeem_from(client, "2001:db8:1:100::1") == 401  # the next /56


async def test_an_ipv4_mapped_client_is_counted_as_its_ipv4_address(db_url):
    """Not by the /64 every IPv4-mapped address shares (``::ffff:0:0/96``): that would put every IPv4
    client written so in one budget, and give a client that writes both forms two."""
    with LiveServer(db_url, UMBRA_TRUSTED_PROXIES="127.0.0.1") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            answers = [await redeem_from(client, "203.0.113.7" if i % 2 else "::ffff:203.0.113.7")
                       for i in range(ATTEMPTS + 1)]  # fmt: skip
            assert answers == [401] * ATTEMPTS + [429], answers
            assert await redeem_from(client, "::ffff:203.0.113.8") == 401


async def test_an_invalid_redeem_body_counts_as_an_attempt(client, conn, org):
    """Otherwise invalid bodies would be free probes, and past the budget they would get 422 rather than 429."""
    _, key = org
    code = (await client.post("/v1/pairings", json={"name": "gpu-box"}, headers=bearer(key))).json()["code"]
    tpu = {**CPU, "kind": "tpu"}
    answer = await client.post("/v1/pairings/redeem", json={"code": code, "name": "gpu-box", "devices": [tpu]})
    assert (answer.status_code, answer.json()["error"]) == (422, "invalid_request"), answer.text
    assert (await (await conn.execute("SELECT sum(cardinality(attempted_at)) FROM pairing_attempt_times")).fetchone())[0] == 1
    assert (await client.get("/v1/nodes", headers=bearer(key))).json() == {"nodes": []}


async def test_the_twenty_first_redeem_is_429_after_twenty_invalid_bodies(client, conn, org):
    """The limit is checked before the body as well as the code: the 21st gets 429 whatever it carries."""
    _, key = org
    code = (await client.post("/v1/pairings", json={"name": "gpu-box"}, headers=bearer(key))).json()["code"]
    invalid = [{"json": {"code": code, "name": "gpu-box", "devices": [{**CPU, "kind": "tpu"}]}},  # an unknown device kind
               {"json": {"code": "1" * 33, "name": "gpu-box"}},  # a code longer than 32 characters
               {"content": b"{not json", "headers": {"content-type": "application/json"}}]  # fmt: skip
    for i in range(ATTEMPTS):
        answer = await client.post("/v1/pairings/redeem", **invalid[i % len(invalid)])
        assert (answer.status_code, answer.json()["error"]) == (422, "invalid_request"), answer.text
    before = await seconds_until_the_first_attempt_leaves(conn)
    limited = await client.post("/v1/pairings/redeem", json={"code": code, "name": "gpu-box"})
    after = await seconds_until_the_first_attempt_leaves(conn)
    assert (limited.status_code, limited.json()["error"]) == (429, "rate_limited")
    assert after <= int(limited.headers["Retry-After"]) <= before
    still = await client.post("/v1/pairings/redeem", **invalid[0])
    assert (still.status_code, still.json()["error"]) == (429, "rate_limited")
    assert (await client.get("/v1/nodes", headers=bearer(key))).json() == {"nodes": []}


@pytest.mark.parametrize(
    "trusted, forwarded, logged_as, counted",
    [
        # No proxy is trusted: the header is the client's own word, whatever the peer (here 127.0.0.1).
        ("", lambda i: [("x-forwarded-for", f"198.51.100.{i}")], "127.0.0.1", "127.0.0.1"),
        # A trusted proxy that adds its own line after the client's: the client is in the last line.
        ("127.0.0.1/32", lambda i: [("x-forwarded-for", f"198.51.100.{i}"), ("x-forwarded-for", "203.0.113.7")],
         "203.0.113.7", "203.0.113.7"),
        # A trusted proxy that writes the client's port too (as Azure's Application Gateway does): each
        # connection of the client comes from another port, and is still the one source.
        ("127.0.0.1/32", lambda i: [("x-forwarded-for", f"198.51.100.{i}, 203.0.113.7:{40000 + i}")], "203.0.113.7",
         "203.0.113.7"),
        # An IPv6 client is counted by its /64 (and logged by its address).
        ("127.0.0.1/32", lambda i: [("x-forwarded-for", f"[2001:DB8::7]:{40000 + i}")], "2001:db8::7", "2001:db8::/64"),
    ],
    ids=["no-trusted-proxy", "proxy-adds-a-line", "proxy-adds-the-port", "proxy-adds-an-ipv6-port"],
)
async def test_a_client_cannot_choose_its_rate_limit_bucket_with_x_forwarded_for(db_url, conn, org, trusted, forwarded,
                                                                                 logged_as, counted):  # fmt: skip
    """Every attempt names another address in ``X-Forwarded-For``; all are still charged to one source.

    The access log names the client the rate limit counts (an IPv6 client by its address, counted by its /64).
    """
    import logging

    import httpx

    from tests.conftest import LiveServer

    logged: list[logging.LogRecord] = []
    access_log = logging.getLogger("umbra.api.middleware")
    capture = logging.Handler()
    capture.emit = logged.append
    access_log.addHandler(capture)
    old_level = access_log.level
    access_log.setLevel(logging.INFO)
    try:
        with LiveServer(db_url, UMBRA_TRUSTED_PROXIES=trusted) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                answers = [
                    (await client.post("/v1/pairings/redeem", json={"code": "000000", "name": "gpu-box"},
                                       headers=forwarded(i))).status_code  # fmt: skip
                    for i in range(ATTEMPTS + 1)
                ]
    finally:
        access_log.removeHandler(capture)
        access_log.setLevel(old_level)
    assert answers == [401] * ATTEMPTS + [429]
    sources = await (await conn.execute("SELECT source, cardinality(attempted_at), refused FROM pairing_attempt_times")).fetchall()
    assert sources == [(counted, ATTEMPTS, True)]  # the 21st was charged to the same source, and refused
    requests = [r for r in logged if getattr(r, "action", None) == "http_request"]
    assert len(requests) == ATTEMPTS + 1 and {r.client for r in requests} == {logged_as}


async def _beat(client, credential):
    answer = await client.post("/v1/agent/heartbeat", json={"devices": [GPU, CPU], "agent_version": "1.0"},
                               headers=bearer(credential))  # fmt: skip
    assert answer.status_code == 200, answer.text
    return answer.json()


async def test_an_agent_signing_off_reads_offline_at_once_and_its_next_beat_brings_it_back(client, conn, org):
    _, key = org
    node_id, credential = await pair(client, key)
    assert (await _beat(client, credential))["status"] == "online"
    signed = await client.post("/v1/agent/offline", headers=bearer(credential))
    assert signed.status_code == 200, signed.text
    assert (signed.json()["id"], signed.json()["status"], signed.json()["schedulable"]) == (node_id, "offline", False)
    read = (await client.get(f"/v1/nodes/{node_id}", headers=bearer(key))).json()
    assert (read["status"], read["stored_status"]) == ("offline", "offline")  # not online for another 45 s
    [(actor, last_seen)] = await (await conn.execute(
        "SELECT metadata->>'actor', data->>'last_seen_at' FROM events WHERE type = 'node.went_offline'")).fetchall()
    liveness = (await (await conn.execute("SELECT last_seen_at FROM node_liveness WHERE node_id = %s", (node_id,))).fetchone())[0]
    assert actor == f"node:{node_id}" and datetime.fromisoformat(last_seen) == liveness  # as the sweeper records it
    again = await client.post("/v1/agent/offline", headers=bearer(credential))  # nothing more to record
    assert again.status_code == 200 and again.json()["status"] == "offline"
    assert (await (await conn.execute("SELECT count(*) FROM events WHERE type = 'node.went_offline'")).fetchone())[0] == 1
    assert (await _beat(client, credential))["status"] == "online"
    assert (await client.get(f"/v1/nodes/{node_id}", headers=bearer(key))).json()["status"] == "online"


async def test_signing_off_leaves_an_administrators_drain_and_needs_a_node_credential(client, conn, org):
    _, key = org
    node_id, credential = await pair(client, key)
    await _beat(client, credential)
    assert (await client.post(f"/v1/nodes/{node_id}/drain", headers=bearer(key))).status_code == 200
    signed = await client.post("/v1/agent/offline", headers=bearer(credential))
    assert signed.status_code == 200 and signed.json()["status"] == "draining"
    before = await footprint(conn)
    assert (await client.post("/v1/agent/offline", headers=bearer(key))).status_code == 403
    assert (await client.post("/v1/agent/offline")).status_code == 401
    assert (await client.post(f"/v1/nodes/{node_id}/revoke", headers=bearer(key))).status_code == 200
    assert (await client.post("/v1/agent/offline", headers=bearer(credential))).status_code == 401
    assert (await footprint(conn))[0] == before[0] + 1  # the revocation's event, nothing from the refusals


async def test_the_kinds_an_agent_takes_are_shown_and_explain_says_when_none_takes_a_jobs(client, conn, org):
    from umbra.projections.verify import verify

    _, key = org
    node_id, credential = await pair(client, key)
    assert (await client.get(f"/v1/nodes/{node_id}", headers=bearer(key))).json()["kinds"] is None  # not reported
    beat = await client.post("/v1/agent/heartbeat", json={"devices": [GPU, CPU], "kinds": ["sleep", "echo"]},
                             headers=bearer(credential))  # fmt: skip
    assert beat.status_code == 200, beat.text
    assert (await client.get(f"/v1/nodes/{node_id}", headers=bearer(key))).json()["kinds"] == ["echo", "sleep"]
    job = (await client.post("/v1/jobs", json={"kind": "render"}, headers=bearer(key))).json()
    explained = (await client.get(f"/v1/jobs/{job['id']}/explain", headers=bearer(key))).json()
    assert explained["summary"] == ("Can run on 2 devices of gpu-box, but its agent does not take kind 'render' "
                                    "(it takes echo, sleep): it waits for an agent with a handler for it."), explained["summary"]
    assert explained["eligible"]  # the devices could run it: it is not blocked, it waits for a handler
    echo = (await client.post("/v1/jobs", json={"kind": "echo"}, headers=bearer(key))).json()
    summary = (await client.get(f"/v1/jobs/{echo['id']}/explain", headers=bearer(key))).json()["summary"]
    assert summary.startswith("Can run on 2 devices; the best is gpu-box/gpu0"), summary
    every = await client.post("/v1/agent/heartbeat", json={"kinds": []}, headers=bearer(credential))  # names none
    assert every.status_code == 200 and (await client.get(f"/v1/nodes/{node_id}", headers=bearer(key))).json()["kinds"] is None
    summary = (await client.get(f"/v1/jobs/{job['id']}/explain", headers=bearer(key))).json()["summary"]
    assert "takes kind" not in summary and summary.startswith("Can run on 2 devices; the best is"), summary
    too_many = await client.post("/v1/agent/heartbeat", json={"kinds": [f"k{i}" for i in range(101)]}, headers=bearer(credential))
    assert too_many.status_code == 422 and too_many.json()["error"] == "invalid_request"
    assert await verify(conn) == []  # the kinds are folded from the log like the rest of the node


async def test_explain_counts_no_jobs_ahead_of_a_kind_the_nodes_agent_never_claims(client, org):
    _, key = org
    _, credential = await pair(client, key)
    beat = await client.post("/v1/agent/heartbeat", json={"devices": [GPU, CPU], "kinds": ["render"]}, headers=bearer(credential))
    assert beat.status_code == 200, beat.text
    for _ in range(3):
        assert (await client.post("/v1/jobs", json={"kind": "echo"}, headers=bearer(key))).status_code == 201
    render = (await client.post("/v1/jobs", json={"kind": "render"}, headers=bearer(key))).json()
    explained = (await client.get(f"/v1/jobs/{render['id']}/explain", headers=bearer(key))).json()
    assert "ahead of it" not in explained["summary"] and explained["summary"].endswith("the next claim by an eligible node takes it.")
    assert (await client.post("/v1/agent/heartbeat", json={"kinds": []}, headers=bearer(credential))).status_code == 200
    explained = (await client.get(f"/v1/jobs/{render['id']}/explain", headers=bearer(key))).json()
    assert "3 jobs ahead of it" in explained["summary"], explained["summary"]  # an agent of every kind takes them first


async def test_explain_gives_every_listed_device_one_of_the_contracts_reasons(client, org):
    """A node that reports no devices and fails no node-level rule has nothing to judge: it is not listed
    (it was, with a null device and a null reason); its summary clause still says it reports no devices."""
    from umbra.domain.eligibility import REASONS

    _, key = org
    node_id, _ = await pair(client, key, "full", devices=(CPU,))
    _, empty = await pair(client, key, "empty")
    assert (await client.post("/v1/agent/heartbeat", json={"devices": []}, headers=bearer(empty))).status_code == 200
    job = (await client.post("/v1/jobs", json={"kind": "x", "requires": {"ram_min_mb": 40000}}, headers=bearer(key))).json()
    explained = (await client.get(f"/v1/jobs/{job['id']}/explain", headers=bearer(key))).json()
    assert explained["ineligible"] and all(item["reason"] in REASONS for item in explained["ineligible"]), explained
    assert [item["node_id"] for item in explained["ineligible"]] == [node_id]
    assert "1 node reports no devices" in explained["summary"], explained["summary"]


async def test_the_node_list_filters_by_effective_status(client, org, conn):
    """``?status=`` (comma-separated or repeated) keeps the nodes whose *effective* status is one of them: a node
    stored online but silent past the stale threshold is listed as offline, not online; retired nodes leave
    the list when not asked for. An unknown or empty status → 422 naming it."""
    _, key = org
    names = {}
    for name in ("live", "quiet", "old", "fresh"):
        names[name], credential = await pair(client, key, name)
        if name != "fresh":
            beat = await client.post("/v1/agent/heartbeat", json={"devices": [GPU, CPU], "agent_version": "1.0"},
                                     headers=bearer(credential))  # fmt: skip
            assert beat.status_code == 200
    await conn.execute("UPDATE node_liveness SET last_seen_at = now() - interval '1 hour' WHERE node_id = %s", (names["quiet"],))
    assert (await client.post(f"/v1/nodes/{names['old']}/retire", headers=bearer(key))).status_code == 200

    async def listed(*params: tuple[str, str]) -> list[tuple[str, str]]:
        answer = await client.get("/v1/nodes", params=list(params), headers=bearer(key))
        assert answer.status_code == 200, answer.text
        return [(n["name"], n["status"]) for n in answer.json()["nodes"]]

    assert await listed() == [("fresh", "provisioning"), ("live", "online"), ("old", "retired"), ("quiet", "offline")]
    assert await listed(("status", "online")) == [("live", "online")]
    assert await listed(("status", "offline,provisioning")) == [("fresh", "provisioning"), ("quiet", "offline")]
    assert await listed(("status", "online"), ("status", "offline")) == [("live", "online"), ("quiet", "offline")]
    assert await listed(("status", "retired")) == [("old", "retired")]
    for bad in ("gone", "online,", "queued"):
        refused = await client.get("/v1/nodes", params={"status": bad}, headers=bearer(key))
        assert (refused.status_code, refused.json()["error"], refused.json()["field"]) == (422, "invalid_request", "status")
