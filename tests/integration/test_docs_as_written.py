"""The documentation as written (README, docs/API.md, the command line's help) against the live system.

Every concrete example a newcomer or an integrator would copy — a curl body, a CLI line, a field name, a
status or error code, a default — is run against a real server (or the CLI in-process) and compared with
what the docs say.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from datetime import datetime

import httpx
import pytest

from tests.helpers import bearer
from tests.integration.queue_support import CPU64_JSON, http_claim, http_pair

pytestmark = pytest.mark.anyio

JOB_FIELDS = {"id", "organization_id", "kind", "status", "priority", "requires", "payload", "project_id", "lang",
              "attempt", "max_attempts", "not_before", "parent_job_id", "idempotency_key", "lease_owner",
              "lease_expires_at", "result", "error", "placement", "created_at", "started_at", "finished_at"}
PLACEMENT_FIELDS = {"node_id", "device_id", "device_kind", "reason", "resident", "would_evict", "estimated_seconds"}
EVENT_FIELDS = {"position", "stream", "version", "type", "data", "recorded_at"}
NODE_FIELDS = {"id", "name", "status", "stored_status", "trust_domain", "locality", "last_heartbeat_at",
               "agent_version", "devices", "schedulable"}
DEVICE_FIELDS = {"kind", "label", "vram_total_mb", "vram_free_mb", "ram_total_mb", "ram_free_mb", "throughput_factor",
                 "accelerators", "resident_models"}


def _ts(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


_RFC3339_UTC = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|\+00:00)$")


async def _db_now(conn) -> datetime:
    return (await (await conn.execute("SELECT now()")).fetchone())[0]


async def test_readme_curl_submission_answers_201_with_an_id(live_server, org):
    """README step 6: `curl -d '{"kind": "sleep", "payload": {"seconds": 3}}' $URL/v1/jobs` with the key and
    `Content-Type: application/json` → 201 and a Job whose "id" the one-liner prints; defaults priority 100,
    max_attempts 3, attempt 0, status queued once an agent's node is online (README step 4 comes first)."""
    async with httpx.AsyncClient(base_url=live_server.url) as client:
        await http_pair(client, org[1], "laptop")
        response = await client.post("/v1/jobs", content=b'{"kind": "sleep", "payload": {"seconds": 3}}',
                                     headers={**bearer(org[1]), "Content-Type": "application/json"})  # fmt: skip
    assert response.status_code == 201, response.text
    job = response.json()
    uuid.UUID(job["id"])
    assert JOB_FIELDS <= set(job)
    assert job["priority"] == 100 and job["max_attempts"] == 3 and job["attempt"] == 0
    assert job["status"] == "queued" and job["kind"] == "sleep" and job["payload"] == {"seconds": 3}
    assert job["organization_id"] == str(org[0])
    assert job["created_at"].endswith("Z") or job["created_at"].endswith("+00:00")


async def test_readme_first_steps_cli_json_shapes(cli):
    """README "First steps" / API.md Bootstrap: create-org --json → {"organization_id", "api_key"};
    create-project --json → {"project_id"}; create-key --scopes jobs:read,events:read --json →
    {"api_key", "scopes": [...]} with those scopes."""
    status, out, err = await cli("admin", "create-org", "acme", "--json")
    assert status == 0, err
    created = json.loads(out)
    assert {"organization_id", "api_key"} <= set(created)
    org_id = created["organization_id"]
    status, out, err = await cli("admin", "create-project", "--org", org_id, "demo", "--json")
    assert status == 0, err
    assert "project_id" in json.loads(out)
    status, out, err = await cli("admin", "create-key", "--org", org_id, "--scopes", "jobs:read,events:read", "--json")
    assert status == 0, err
    key = json.loads(out)
    assert key["api_key"].startswith("uk_") and sorted(key["scopes"]) == ["events:read", "jobs:read"]


async def test_create_org_key_has_every_api_key_scope(cli, live_server):
    """API.md: the create-org key "has every API-key scope" — jobs:write, jobs:read, events:read, nodes:admin all
    answer (none 403)."""
    status, out, _ = await cli("admin", "create-org", "acme", "--json")
    key = json.loads(out)["api_key"]
    async with httpx.AsyncClient(base_url=live_server.url, headers=bearer(key)) as client:
        assert (await client.post("/v1/jobs", json={"kind": "echo"})).status_code == 201
        assert (await client.get("/v1/jobs")).status_code == 200
        assert (await client.get("/v1/events")).status_code == 200
        assert (await client.post("/v1/pairings", json={"name": "n1"})).status_code == 201
        assert (await client.post("/v1/projections/verify")).status_code == 200


async def test_readme_pairing_code_text_and_default_ttl(cli, org, conn):
    """README step 3: `admin pairing-code --org ORG --name laptop` prints `pairing code for laptop: NNNNNN
    (single use, expires …)` and `on the node: umbra agent --server URL --name laptop --code NNNNNN`; valid 10
    minutes by default."""
    status, out, err = await cli("admin", "pairing-code", "--org", str(org[0]), "--name", "laptop")
    assert status == 0, err
    lines = out.splitlines()
    m = re.fullmatch(r"pairing code for laptop: (\d{6}) \(single use, expires (\S+)\)", lines[0])
    assert m, lines
    assert lines[1] == f"on the node: umbra agent --server URL --name laptop --code {m.group(1)}"
    left = (_ts(m.group(2)) - await _db_now(conn)).total_seconds()
    assert 590 <= left <= 601, left


async def test_readme_create_key_prefix_and_revoke_key_by_each_name(cli, org, live_server):
    """README: revoke-key names a key by its id, its prefix as create-key prints it (`uk_…`), as list-keys
    does (`uk_…_…`), or the key itself; the key then fails at once (401). list-keys never shows a secret."""
    org_id = str(org[0])
    keys = []
    for _ in range(4):
        status, out, err = await cli("admin", "create-key", "--org", org_id, "--scopes", "jobs:read", "--json")
        assert status == 0, err
        keys.append(json.loads(out))
    status, out, err = await cli("admin", "list-keys", "--org", org_id, "--json")
    assert status == 0, err
    rows = {f"uk_{row['prefix']}": row for row in json.loads(out)["api_keys"]}
    assert all(k["api_key"] not in out for k in keys)
    status, text, err = await cli("admin", "list-keys", "--org", org_id)
    listed = {m.group(1) for m in re.finditer(r"(uk_[0-9a-f]+_…)", text)}
    assert f"{keys[3]['prefix']}_…" in listed, text
    names = [keys[0]["api_key"], rows[keys[1]["prefix"]]["id"], keys[2]["prefix"], f"{keys[3]['prefix']}_…"]
    async with httpx.AsyncClient(base_url=live_server.url) as client:
        for key, name in zip(keys, names):
            assert (await client.get("/v1/jobs", headers=bearer(key["api_key"]))).status_code == 200
            status, out, err = await cli("admin", "revoke-key", "--org", org_id, name)
            assert status == 0, (name, err)
            refused = await client.get("/v1/jobs", headers=bearer(key["api_key"]))
            assert refused.status_code == 401 and refused.json()["error"] == "unauthenticated"


async def test_models_registry_shapes(api, live_server, org):
    """API.md: PUT /v1/models/{slug} body {"vram_min_mb", ...} → 200 the model (a slug with a colon, as
    `gemma4:26b`); GET /v1/models → {"models": [...]}; SPEC: a VRAM floor with no RAM floor counts as needing that
    much RAM."""
    put = await api.put("/v1/models/gemma4:26b", json={"vram_min_mb": 18000, "vram_preferred_mb": 20000})
    assert put.status_code == 200, put.text
    model = put.json()
    assert model["slug"] == "gemma4:26b" and model["vram_min_mb"] == 18000 and model["kind"] == "llm"
    assert model["ram_floor_mb"] == 18000
    listed = (await api.get("/v1/models")).json()
    assert [m["slug"] for m in listed["models"]] == ["gemma4:26b"]
    job = (await api.post("/v1/jobs", json={"kind": "infer", "requires": {"models": ["nope:1b"]}})).json()
    assert job["status"] == "blocked"


async def test_stale_threshold_is_45_seconds_and_heartbeat_interval_10(api, live_server, org, conn):
    """SPEC/README: a stored `online` node silent for more than 45 s reads `offline` (stored_status stays
    `online`); at 44 s it still reads online; the heartbeat answer names the 10 s interval agents are told."""
    node_id, credential = await http_pair(api, org[1])
    beat = await api.post("/v1/agent/heartbeat", json={"devices": [CPU64_JSON]}, headers=bearer(credential))
    assert beat.json().get("heartbeat_interval_seconds") == 10
    await conn.execute("UPDATE node_liveness SET last_seen_at = now() - interval '44 seconds' WHERE node_id = %s", (node_id,))
    node = (await api.get(f"/v1/nodes/{node_id}")).json()
    assert node["status"] == "online", node
    await conn.execute("UPDATE node_liveness SET last_seen_at = now() - interval '46 seconds' WHERE node_id = %s", (node_id,))
    node = (await api.get(f"/v1/nodes/{node_id}")).json()
    assert node["status"] == "offline" and node["schedulable"] is False, node


async def test_lease_seconds_and_metrics_token_settings(db_url, org):
    """README: `UMBRA_LEASE_SECONDS` sets the lease per claim/renew; `UMBRA_METRICS_TOKEN`, if set, makes
    /metrics need it as a bearer token."""
    from tests.conftest import LiveServer

    with LiveServer(db_url, UMBRA_LEASE_SECONDS="7", UMBRA_METRICS_TOKEN="s3cret") as server:
        async with httpx.AsyncClient(base_url=server.url, headers=bearer(org[1])) as client:
            _, credential = await http_pair(client, org[1])
            await client.post("/v1/jobs", json={"kind": "echo"})
            claimed = await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(credential))
            assert claimed.status_code == 200
            assert 5 <= float(claimed.headers["Umbra-Lease-Seconds"]) <= 7
            assert (await client.get("/metrics", headers={"Authorization": ""})).status_code == 401
            assert (await client.get("/metrics", headers=bearer("s3cret"))).status_code == 200


async def test_forwarded_for_is_ignored_without_trusted_proxies(live_server):
    """API.md: the source address is the TCP peer; `X-Forwarded-For` is honoured only from
    `UMBRA_TRUSTED_PROXIES` (empty by default): a client that varies the header is still limited at 21."""
    async with httpx.AsyncClient(base_url=live_server.url) as anon:
        answers = []
        for i in range(21):
            r = await anon.post("/v1/pairings/redeem", json={"code": "123456", "name": "n"},
                                headers={"X-Forwarded-For": f"10.0.0.{i + 1}"})  # fmt: skip
            answers.append(r.status_code)
    assert answers[20] == 429, answers


async def test_priority_lower_runs_first_and_zero_is_kept(api, live_server, org):
    """SPEC: priority default 100, lower runs first, ties by submission order; 0 stays 0."""
    _, credential = await http_pair(api, org[1])
    a = (await api.post("/v1/jobs", json={"kind": "echo"})).json()
    b = (await api.post("/v1/jobs", json={"kind": "echo", "priority": 0})).json()
    c = (await api.post("/v1/jobs", json={"kind": "echo", "priority": 0})).json()
    assert b["priority"] == 0
    order = []
    for _ in range(3):
        job = await http_claim(api, credential)
        order.append(job["id"])
        await api.post(f"/v1/agent/jobs/{job['id']}/complete", json={"attempt": job["attempt"], "result": {}},
                       headers=bearer(credential))  # fmt: skip
    assert order == [b["id"], c["id"], a["id"]]


async def test_cli_clients_find_the_server_and_key_in_the_environment(cli, api, live_server, org, monkeypatch):
    """README step 7: with `UMBRA_API_KEY` and `UMBRA_SERVER` exported, `umbra events tail`, `events replay
    JOB_ID --as-of P` and `jobs explain JOB_ID` need no flags; `tail --after P` starts after P."""
    _, credential = await http_pair(api, org[1])
    job = (await api.post("/v1/jobs", json={"kind": "echo"})).json()
    history = (await api.get(f"/v1/jobs/{job['id']}/events")).json()["events"]
    monkeypatch.setenv("UMBRA_API_KEY", org[1])
    monkeypatch.setenv("UMBRA_SERVER", live_server.url)
    status, out, err = await cli("events", "tail", "--json")
    assert status == 0, err
    positions = [json.loads(line)["position"] for line in out.splitlines()]
    assert history[0]["position"] in positions and positions == sorted(positions)
    status, out, err = await cli("events", "tail", "--after", str(history[0]["position"] - 1), "--json")
    assert status == 0, err
    assert [json.loads(line)["position"] for line in out.splitlines()] == [history[0]["position"]]
    status, out, err = await cli("events", "replay", job["id"], "--as-of", str(history[0]["position"]))
    assert status == 0 and "job.submitted" in out, err
    status, out, err = await cli("jobs", "explain", job["id"], "--json")
    assert status == 0, err
    assert json.loads(out)["job_id"] == job["id"]


async def test_cli_node_admin_and_verify_exit_codes(cli, api, live_server, org):
    """README: `admin drain --org ORG NODE_ID` drains (no more work); `admin revoke` makes the node read
    `retired` and its credential fail at once (401 unauthenticated); `verify` exits 0 on a consistent
    database, 2 for an unknown --org (help); `migrate` again is idempotent (exit 0)."""
    drained_id, _ = await http_pair(api, org[1], "a")
    revoked_id, credential = await http_pair(api, org[1], "b")
    status, out, err = await cli("admin", "drain", "--org", str(org[0]), drained_id, "--json")
    assert status == 0 and json.loads(out)["stored_status"] == "draining", err
    assert (await api.get(f"/v1/nodes/{drained_id}")).json()["status"] == "draining"
    status, out, err = await cli("admin", "revoke", "--org", str(org[0]), revoked_id, "--json")
    assert status == 0, err
    node = (await api.get(f"/v1/nodes/{revoked_id}")).json()
    assert node["status"] == "retired" and node["stored_status"] == "retired"
    refused = await api.post("/v1/agent/heartbeat", json={"devices": [CPU64_JSON]}, headers=bearer(credential))
    assert refused.status_code == 401 and refused.json()["error"] == "unauthenticated"
    status, out, err = await cli("admin", "pairing-code", "--org", str(org[0]), "--name", "b")
    assert status != 0
    status, out, err = await cli("verify")
    assert status == 0, out + err
    status, out, err = await cli("verify", "--org", str(uuid.uuid4()))
    assert status == 2, (status, out, err)
    status, out, err = await cli("migrate")
    assert status == 0, err


async def _sse_messages(client, path, *, headers=None, params=None, count=2, timeout=10.0):
    """The first ``count`` SSE messages (dicts of their fields) of ``path``, skipping comments."""
    import anyio

    messages, current = [], {}
    with anyio.fail_after(timeout):
        async with client.stream("GET", path, headers=headers, params=params) as response:
            assert response.status_code == 200, await response.aread()
            assert response.headers["content-type"].startswith("text/event-stream")
            async for line in response.aiter_lines():
                if line == "":
                    if current and "data" in current:
                        messages.append(current)
                        current = {}
                        if len(messages) >= count:
                            break
                    elif current:
                        current = {}
                    continue
                if line.startswith(":"):
                    continue
                name, _, value = line.partition(":")
                current[name] = current.get(name, "") + value.removeprefix(" ")
    return messages


async def test_create_key_refuses_unknown_and_node_scopes(cli, org):
    """README: API key scopes are `jobs:write`, `jobs:read`, `events:read` and `nodes:admin`; a misspelt scope
    or a node scope (`compute:claim`) is refused rather than minting a key that can do nothing (or act as a
    node)."""
    for scopes in ("jobs:reed", "compute:claim", ""):
        status, out, err = await cli("admin", "create-key", "--org", str(org[0]), "--scopes", scopes, "--json")
        assert status != 0, (scopes, out)


async def _node_with(api, key, name, devices):
    code = (await api.post("/v1/pairings", json={"name": name})).json()["code"]
    redeemed = (await api.post("/v1/pairings/redeem", json={"code": code, "name": name, "devices": devices})).json()
    beat = await api.post("/v1/agent/heartbeat", json={"devices": devices}, headers=bearer(redeemed["credential"]))
    assert beat.status_code == 200, beat.text
    return redeemed["node_id"], redeemed["credential"]


def _timestamps(value, path=""):
    if isinstance(value, dict):
        for k, v in value.items():
            if (k.endswith("_at") or k == "not_before") and isinstance(v, str):
                yield f"{path}.{k}", v
            else:
                yield from _timestamps(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _timestamps(v, f"{path}[{i}]")


async def test_every_timestamp_is_rfc3339_utc(api, live_server, org):
    """API.md: timestamps are RFC 3339 UTC strings — in Jobs, claims, nodes, events, pairings, models and the
    views."""
    node_id, credential = await http_pair(api, org[1])
    answers = [(await api.post("/v1/pairings", json={"name": "t"})).json()]
    answers.append((await api.put("/v1/models/m:1", json={"vram_min_mb": 1})).json())
    job = (await api.post("/v1/jobs", json={"kind": "e"})).json()
    answers.append((await api.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(credential))).json())
    answers.append((await api.post(f"/v1/agent/jobs/{job['id']}/renew", json={"attempt": 1}, headers=bearer(credential))).json())
    answers.append((await api.post(f"/v1/agent/jobs/{job['id']}/fail", json={"attempt": 1, "error": "x"},
                                   headers=bearer(credential))).json())  # fmt: skip
    for path in ("/v1/jobs", f"/v1/jobs/{job['id']}", f"/v1/jobs/{job['id']}/events", "/v1/nodes", f"/v1/nodes/{node_id}",
                 "/v1/events", "/v1/projections/queue", "/v1/projections/nodes", "/v1/models", f"/v1/nodes/{node_id}/events"):
        answers.append((await api.get(path)).json())
    found = [(p, v) for answer in answers for p, v in _timestamps(answer)]
    assert len(found) > 20
    bad = [(p, v) for p, v in found if not _RFC3339_UTC.match(v)]
    assert bad == []


async def test_event_types_are_the_documented_names(api, live_server, org):
    """API.md event types: a node's pairing is `node.created`/`node.paired`, its beat `node.heartbeat`, drain
    `node.draining`, retirement `node.retired`, going offline `node.went_offline`; a job's renew is
    `job.lease_renewed`, a retryable failure `job.failed`/`job.requeued`, blocking and unblocking
    `job.blocked`/`job.unblocked`, cancelling `job.cancelled`."""
    node_id, credential = await http_pair(api, org[1], "n1")
    blocked = (await api.post("/v1/jobs", json={"kind": "e", "requires": {"ram_min_mb": 100000}})).json()
    assert blocked["status"] == "blocked"
    big = dict(CPU64_JSON, ram_total_mb=200000, ram_free_mb=150000)
    await api.post("/v1/agent/heartbeat", json={"devices": [big]}, headers=bearer(credential))
    assert (await api.get(f"/v1/jobs/{blocked['id']}")).json()["status"] == "queued"
    held = await http_claim(api, credential)
    await api.post(f"/v1/agent/jobs/{held['id']}/renew", json={"attempt": 1}, headers=bearer(credential))
    await api.post(f"/v1/agent/jobs/{held['id']}/fail", json={"attempt": 1, "error": "x", "retry": True},
                   headers=bearer(credential))  # fmt: skip
    await api.post(f"/v1/jobs/{held['id']}/cancel")
    job_types = [e["type"] for e in (await api.get(f"/v1/jobs/{held['id']}/events")).json()["events"]]
    for t in ("job.submitted", "job.blocked", "job.unblocked", "job.claimed", "job.lease_renewed", "job.cancelled"):
        assert t in job_types, (t, job_types)
    assert "job.failed" in job_types or "job.requeued" in job_types, job_types
    await api.post("/v1/agent/offline", headers=bearer(credential))
    await api.post(f"/v1/nodes/{node_id}/drain")
    await api.post(f"/v1/nodes/{node_id}/retire")
    node_types = [e["type"] for e in (await api.get(f"/v1/nodes/{node_id}/events")).json()["events"]]
    for t in ("node.created", "node.paired", "node.heartbeat", "node.went_offline", "node.draining", "node.retired"):
        assert t in node_types, (t, node_types)


async def test_invalid_setting_stops_naming_the_variable(cli, monkeypatch):
    """README: all settings come from the environment once, at start; an invalid value stops the process naming
    the variable (a stale threshold not longer than the heartbeat interval included)."""
    for name, value in (("UMBRA_LEASE_SECONDS", "abc"), ("UMBRA_HEARTBEAT_STALE_SECONDS", "5"), ("UMBRA_PORT", "70000")):
        monkeypatch.setenv(name, value)
        status, out, err = await cli("migrate")
        assert status not in (0, None) and name in err, (name, status, err)
        monkeypatch.delenv(name)


def test_the_folders_are_installed_under_umbra_and_never_bare(tmp_path):
    """README (Layout): each folder is installed as ``umbra.<folder>``, so ``import umbra.events`` works and
    ``import events`` does not. Asked of the installed interpreter run isolated from a directory holding
    nothing, so neither the checkout nor the tests' path can supply the bare names."""
    folders = ["events", "projections", "api", "domain", "compute", "migrations"]
    probe = ("import importlib.util as u, json, sys; "
             "print(json.dumps({n: [u.find_spec('umbra.' + n) is not None, u.find_spec(n) is not None] for n in sys.argv[1:]}))")
    done = subprocess.run([sys.executable, "-I", "-c", probe, *folders], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {name: [True, False] for name in folders}


async def test_the_longest_durations_the_settings_take_work_on_every_path(db_url, org):
    """README: an invalid value stops the process naming the variable; so a value it takes must work. The
    longest lease and blocked timeout it takes still claim, renew and explain (10**12 s was taken, and every
    claim and every explain of a blocked job answered 500); one longer stops it at start."""
    from tests.conftest import LiveServer
    from umbra.settings import MAX_DURATION_SECONDS, SettingsError, load_settings

    longest = {name: str(MAX_DURATION_SECONDS) for name in ("UMBRA_LEASE_SECONDS", "UMBRA_BLOCKED_TIMEOUT_SECONDS")}
    with LiveServer(db_url, **longest) as server:
        async with httpx.AsyncClient(base_url=server.url, headers=bearer(org[1])) as client:
            _, credential = await http_pair(client, org[1])
            blocked = (await client.post("/v1/jobs", json={"kind": "echo", "requires": {"vram_min_mb": 10**6}})).json()
            assert blocked["status"] == "blocked"
            explained = await client.get(f"/v1/jobs/{blocked['id']}/explain")
            assert explained.status_code == 200, explained.text
            await client.post("/v1/jobs", json={"kind": "echo"})
            claimed = await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(credential))
            assert claimed.status_code == 200, claimed.text
            job = claimed.json()["job"]
            renewed = await client.post(f"/v1/agent/jobs/{job['id']}/renew", json={"attempt": job["attempt"]},
                                        headers=bearer(credential))  # fmt: skip
            assert renewed.status_code == 200, renewed.text
    for name in longest:
        with pytest.raises(SettingsError, match=name):
            load_settings({name: str(MAX_DURATION_SECONDS + 1)})


async def test_the_node_status_filter_refuses_what_docs_api_says_and_takes_an_empty_one_as_none(api, live_server, org):
    """docs/API.md: `GET /v1/nodes?status=` — an unknown status, or an empty one in the list, → 422 naming
    `status`; left empty, every node, as `GET /v1/jobs?status=` is."""
    await http_pair(api, org[1], "a")
    for bad in ("gone", "online,", ","):
        refused = await api.get("/v1/nodes", params={"status": bad})
        assert (refused.status_code, refused.json().get("field")) == (422, "status"), (bad, refused.text)
    for empty in ("", " "):
        listed = await api.get("/v1/nodes", params={"status": empty})
        assert listed.status_code == 200 and [n["name"] for n in listed.json()["nodes"]] == ["a"], listed.text


def test_every_setting_is_in_the_readme_table_with_its_default():
    """README (Configuration): every variable ``umbra/settings.py`` reads has its row, naming its default;
    none of the rows names a variable that does not exist."""
    from pathlib import Path

    from umbra import settings as settings_module
    from umbra.settings import load_settings

    root = Path(__file__).resolve().parents[2]
    read = set(re.findall(r'"(UMBRA_[A-Z_]+)"', Path(settings_module.__file__).read_text())) - {
        settings_module.CHEAP_HASHING_VARIABLE}  # for a test suite only: the README says so where it runs the tests
    readme = (root / "README.md").read_text()
    table = readme.split("## Configuration", 1)[1].split("\n\n**", 1)[0]
    rows = {name: line for line in table.splitlines() if line.startswith("| `")
            for name in re.findall(r"`(UMBRA_[A-Z_]+)`", line.split("|")[1])}  # fmt: skip
    assert read - {"UMBRA_API_KEY"} <= set(rows), sorted(read - set(rows))
    assert set(rows) <= read | {"UMBRA_API_KEY"}, sorted(set(rows) - read)
    defaults = load_settings({})
    for name, field in (("UMBRA_POOL_SIZE", "pool_size"), ("UMBRA_SWEEP_INTERVAL_SECONDS", "sweep_interval_seconds"),
                        ("UMBRA_BLOCKED_TIMEOUT_SECONDS", "blocked_timeout_seconds"),
                        ("UMBRA_HEARTBEAT_EVENT_SECONDS", "heartbeat_event_seconds"),
                        ("UMBRA_LEASE_EXPIRED_DELAY_SECONDS", "lease_expired_delay_seconds"),
                        ("UMBRA_POLL_FALLBACK_SECONDS", "poll_fallback_seconds"), ("UMBRA_LOG_LEVEL", "log_level"),
                        ("UMBRA_HEARTBEAT_INTERVAL_SECONDS", "heartbeat_interval_seconds"),
                        ("UMBRA_MIGRATE_LOCK_TIMEOUT_SECONDS", "migrate_lock_timeout_seconds")):  # fmt: skip
        default = f"{getattr(defaults, field):g}" if isinstance(getattr(defaults, field), (int, float)) else getattr(defaults, field)
        assert f"| {default}" in rows[name].replace("`", ""), (name, default, rows[name])


async def test_heartbeat_event_seconds_spaces_the_heartbeats_that_changed_nothing(db_url, org):
    """README: `UMBRA_HEARTBEAT_EVENT_SECONDS` (300) — a heartbeat that changed nothing is recorded this often per
    node; at 0, every one is."""
    from tests.conftest import LiveServer

    for setting, recorded in (("300", 1), ("0", 3)):
        with LiveServer(db_url, UMBRA_HEARTBEAT_EVENT_SECONDS=setting) as server:
            async with httpx.AsyncClient(base_url=server.url, headers=bearer(org[1])) as client:
                node_id, credential = await http_pair(client, org[1], f"n{setting}")  # its first beat is recorded
                for _ in range(2):
                    beat = await client.post("/v1/agent/heartbeat", json={"devices": [CPU64_JSON], "agent_version": "1"},
                                             headers=bearer(credential))  # fmt: skip
                    assert beat.status_code == 200, beat.text
                history = (await client.get(f"/v1/nodes/{node_id}/events")).json()["events"]
        assert [e["type"] for e in history].count("node.heartbeat") == recorded, (setting, [e["type"] for e in history])
