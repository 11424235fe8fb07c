"""``umbra admin pairing-code|drain|retire|revoke`` against a real database."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import anyio
import httpx
import pytest

from umbra.cli import main

pytestmark = pytest.mark.anyio


@pytest.fixture
def cli(db_url, monkeypatch, capsys):
    """Run ``umbra ...`` in a worker thread (it has its own event loop); returns (status, stdout, stderr)."""
    monkeypatch.setenv("UMBRA_DATABASE_URL", db_url)

    async def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        status = await anyio.to_thread.run_sync(main, list(argv))
        out, err = capsys.readouterr()
        return status, out, err

    return run


async def _events(conn, stream: str) -> list[str]:
    rows = await (await conn.execute("SELECT type FROM events WHERE stream = %s ORDER BY version", (stream,))).fetchall()
    return [r[0] for r in rows]


async def test_pairing_code_prints_a_code_that_an_agent_can_redeem(cli, org, live_server):
    org_id, _ = org
    status, out, err = await cli("admin", "pairing-code", "--org", str(org_id), "--name", "gpu-box", "--ttl", "120", "--json")
    assert status == 0, err
    issued = json.loads(out)
    assert issued["node_name"] == "gpu-box" and len(issued["code"]) == 6 and issued["code"].isdigit()
    async with httpx.AsyncClient(base_url=live_server.url) as client:
        redeemed = await client.post("/v1/pairings/redeem", json={"code": issued["code"], "name": "gpu-box"})
    assert redeemed.status_code == 201, redeemed.text
    assert redeemed.json()["credential"]


async def test_pairing_code_text_output_tells_the_operator_what_to_run(cli, org):
    status, out, _ = await cli("admin", "pairing-code", "--org", str(org[0]), "--name", "box-2")
    assert status == 0
    assert "pairing code for box-2:" in out and "umbra agent --server URL --name box-2 --code" in out


async def test_pairing_code_refusals_are_one_line_and_write_nothing(cli, org, conn):
    status, _, err = await cli("admin", "pairing-code", "--org", str(org[0]), "--name", "x", "--ttl", "5")
    assert status == 1
    assert err.startswith("umbra: invalid_request:") and "ttl_seconds" in err and "Traceback" not in err
    status, _, err = await cli("admin", "pairing-code", "--org", str(uuid.uuid4()), "--name", "x")
    assert status == 1 and err.startswith("umbra: organization_not_found:")
    assert (await (await conn.execute("SELECT count(*) FROM pairing_codes")).fetchone())[0] == 0


async def _paired_node(live_server, api_key: str, name: str) -> tuple[str, str]:
    async with httpx.AsyncClient(base_url=live_server.url, headers={"Authorization": f"Bearer {api_key}"}) as client:
        code = (await client.post("/v1/pairings", json={"name": name})).json()["code"]
        redeemed = (await client.post("/v1/pairings/redeem", json={"code": code, "name": name})).json()
    return redeemed["node_id"], redeemed["credential"]


async def test_drain_and_retire_record_events_attributed_to_the_cli(cli, org, conn, live_server):
    org_id, key = org
    node_id, _ = await _paired_node(live_server, key, "worker-1")
    status, out, err = await cli("admin", "drain", "--org", str(org_id), node_id, "--json")
    assert status == 0, err
    assert json.loads(out) == {"node_id": node_id, "name": "worker-1", "stored_status": "draining"}
    status, out, _ = await cli("admin", "retire", "--org", str(org_id), node_id)
    assert status == 0 and "stored_status: retired" in out
    assert await _events(conn, f"node:{node_id}") == ["node.created", "node.paired", "node.draining", "node.retired"]
    meta = await (await conn.execute(
        "SELECT metadata->>'actor' FROM events WHERE stream = %s AND type = 'node.draining'", (f"node:{node_id}",)
    )).fetchone()
    assert meta[0] == "cli"


async def test_revoke_makes_the_credential_fail_at_once(cli, org, live_server):
    org_id, key = org
    node_id, credential = await _paired_node(live_server, key, "worker-2")
    async with httpx.AsyncClient(base_url=live_server.url, headers={"Authorization": f"Bearer {credential}"}) as node:
        assert (await node.post("/v1/agent/heartbeat", json={"devices": []})).status_code == 200
        status, out, err = await cli("admin", "revoke", "--org", str(org_id), node_id, "--json")
        assert status == 0, err
        assert len(json.loads(out)["revoked_credentials"]) == 1
        refused = await node.post("/v1/agent/heartbeat", json={"devices": []})
    assert refused.status_code == 401 and refused.json()["error"] == "unauthenticated"


async def test_another_organizations_node_is_not_found(cli, org, conn, live_server):
    from umbra.compute.accounts import create_organization

    _, key = org
    node_id, _ = await _paired_node(live_server, key, "worker-3")
    other_org, _ = await create_organization(conn, "other")
    for command in ("drain", "retire", "revoke"):
        status, _, err = await cli("admin", command, "--org", str(other_org), node_id)
        assert status == 1 and err.startswith("umbra: node_not_found:"), err
    assert await _events(conn, f"node:{node_id}") == ["node.created", "node.paired"]


async def test_every_command_has_help(cli):
    for argv in (["admin", "pairing-code"], ["admin", "drain"], ["admin", "retire"], ["admin", "revoke"],
                 ["events", "tail"], ["events", "replay"], ["agent"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--help"])
        assert exit_info.value.code == 0


async def test_an_api_key_revoked_from_the_shell_fails_at_once_and_list_keys_shows_no_secret(cli, org, conn, live_server):
    org_id, key = org
    status, out, err = await cli("admin", "create-key", "--org", str(org_id), "--scopes", "jobs:read", "--json")
    assert status == 0, err
    reader = json.loads(out)["api_key"]
    status, out, err = await cli("admin", "list-keys", "--org", str(org_id), "--json")
    assert status == 0, err
    keys = json.loads(out)["api_keys"]
    assert [sorted(k["scopes"]) for k in keys] == [["events:read", "jobs:read", "jobs:write", "nodes:admin"], ["jobs:read"]]
    assert [k["prefix"] for k in keys] == [key.split("_")[1], reader.split("_")[1]] and not any(k["revoked_at"] for k in keys)
    assert key.split("_", 2)[2] not in out and reader.split("_", 2)[2] not in out and "argon2" not in out
    async with httpx.AsyncClient(base_url=live_server.url) as client:
        assert (await client.get("/v1/jobs", headers={"Authorization": f"Bearer {reader}"})).status_code == 200
        status, out, err = await cli("admin", "revoke-key", "--org", str(org_id), keys[1]["id"], "--json")
        assert status == 0, err
        revoked_at = json.loads(out)["revoked_at"]
        refused = await client.get("/v1/jobs", headers={"Authorization": f"Bearer {reader}"})
        assert refused.status_code == 401 and refused.json()["error"] == "unauthenticated"
        assert (await client.get("/v1/jobs", headers={"Authorization": f"Bearer {key}"})).status_code == 200
    status, out, _ = await cli("admin", "revoke-key", "--org", str(org_id), keys[1]["id"], "--json")
    assert status == 0 and json.loads(out)["revoked_at"] == revoked_at  # idempotent: the first revocation stands
    status, out, _ = await cli("admin", "list-keys", "--org", str(org_id))
    assert status == 0 and f"uk_{keys[1]['prefix']}_…" in out and "revoked" in out.splitlines()[1]


async def test_revoke_key_refuses_another_organizations_key(cli, org, conn):
    from umbra.compute.accounts import create_organization

    other, _ = await create_organization(conn, "other")
    [(key_id,)] = await (await conn.execute("SELECT id FROM api_keys WHERE organization_id = %s", (org[0],))).fetchall()
    status, _, err = await cli("admin", "revoke-key", "--org", str(other), str(key_id))
    assert status == 1 and err.startswith("umbra: api_key_not_found:")
    revoked = (await (await conn.execute("SELECT revoked_at FROM api_keys WHERE id = %s", (key_id,))).fetchone())[0]
    assert revoked is None


async def test_revoke_key_takes_the_prefix_create_key_printed_or_the_key_itself(cli, org, conn):
    org_id, _ = org
    made = []
    for _ in range(2):
        status, out, err = await cli("admin", "create-key", "--org", str(org_id), "--scopes", "jobs:read", "--json")
        assert status == 0, err
        made.append(json.loads(out))
    assert all(m["prefix"] == "_".join(m["api_key"].split("_")[:2]) for m in made)
    status, out, err = await cli("admin", "revoke-key", "--org", str(org_id), made[0]["prefix"], "--json")
    assert status == 0, err
    status, out, err = await cli("admin", "revoke-key", "--org", str(org_id), made[1]["api_key"])
    assert status == 0 and made[1]["api_key"].split("_", 2)[2] not in out + err
    revoked = {prefix for (prefix,) in await (await conn.execute(
        "SELECT prefix FROM api_keys WHERE organization_id = %s AND revoked_at IS NOT NULL", (org_id,))).fetchall()}  # fmt: skip
    assert revoked == {m["prefix"].split("_")[1] for m in made}
    status, _, err = await cli("admin", "revoke-key", "--org", str(org_id), "uk_0000000000")
    assert status == 1 and err.startswith("umbra: api_key_not_found:")


async def test_revoke_key_given_a_wrong_key_does_not_revoke_the_key_sharing_its_prefix(cli, org, conn):
    """revoke-key given a whole key revokes only the key it verifies against: its prefix followed by any
    other secret names no key."""
    org_id, _ = org
    status, out, err = await cli("admin", "create-key", "--org", str(org_id), "--scopes", "jobs:read", "--json")
    assert status == 0, err
    made = json.loads(out)
    not_the_key = made["prefix"] + "_" + "x" * 43
    status, out, err = await cli("admin", "revoke-key", "--org", str(org_id), not_the_key)
    revoked = (await (await conn.execute("SELECT revoked_at FROM api_keys WHERE prefix = %s",
                                         (made["prefix"].split("_")[1],))).fetchone())[0]  # fmt: skip
    assert revoked is None, f"a wrong key revoked the real one (exit {status}): {out}{err}"
    assert status == 1 and err.startswith("umbra: api_key_not_found:")


def test_dev_umbra_bench_runs_from_the_checkout_as_the_readme_says():
    """README: ``./dev umbra bench``, from the checkout, finds the benchmarks (the console script's
    own path holds .venv/bin, not the working directory). ``--only nope`` is refused before anything runs."""
    done = subprocess.run([str(Path(__file__).resolve().parents[2] / "dev"), "umbra", "bench", "--only", "nope"], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "run this from its root" not in done.stderr, done.stderr
    assert "unknown workload" in done.stderr, (done.returncode, done.stderr)
