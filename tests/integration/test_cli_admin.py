"""``umbra admin`` against a real database: organizations' keys, pairing codes, drain, retire, revoke."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import uuid
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.anyio


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


async def test_the_agent_command_pairing_code_prints_names_the_node_when_pasted_into_a_shell(cli, org):
    """The name in the printed ``umbra agent`` line is quoted for a shell: a name with a space or a ``#``
    (which the API and the CLI take) reaches the agent whole, and ``--code`` is not swallowed as a comment."""
    status, out, err = await cli("admin", "pairing-code", "--org", str(org[0]), "--name", "gpu box #2; rm -rf ~")
    assert status == 0, err
    line = next(line for line in out.splitlines() if line.startswith("on the node: "))
    argv = shlex.split(line.removeprefix("on the node: "), comments=True)
    assert argv[argv.index("--name") + 1] == "gpu box #2; rm -rf ~" and "--code" in argv, argv


async def test_pairing_code_refusals_are_one_line_and_write_nothing(cli, org, conn):
    """A value the command refuses is refused as an argument (exit 2, one line); an unknown organization
    is refused by the command (exit 1); neither stores a code."""
    status, _, err = await cli("admin", "pairing-code", "--org", str(org[0]), "--name", "x", "--ttl", "5")
    assert status == 2 and err.count("\n") == 1
    assert err.startswith("umbra: invalid_request: umbra admin pairing-code: argument --ttl:") and "ttl_seconds" in err
    status, _, err = await cli("admin", "pairing-code", "--org", str(uuid.uuid4()), "--name", "x")
    assert status == 1 and err.startswith("umbra: organization_not_found:")
    assert (await (await conn.execute("SELECT count(*) FROM pairing_codes")).fetchone())[0] == 0


async def test_pairing_code_refuses_the_trust_domain_and_locality_the_api_refuses(cli, org, api, conn):
    """The command line and ``POST /v1/pairings`` hold a node's trust domain (1..100 characters) and locality
    (at most 200) to the same bounds: what the API answers 422 the CLI refuses as an argument (exit 2, one
    line naming the flag) and stores nothing; the API's answers name the field, as they always did."""
    refused = {"trust_domain": [{"trust_domain": ""}, {"trust_domain": "t" * 101}],
               "locality": [{"locality": "l" * 201}]}  # fmt: skip
    for field, bodies in refused.items():
        for body in bodies:
            answer = await api.post("/v1/pairings", json={"name": "api-node", **body})
            assert answer.status_code == 422, (body, answer.text)
            assert (answer.json()["error"], answer.json()["field"]) == ("invalid_request", field)
    for flag, value in (("--trust-domain", ""), ("--trust-domain", "t" * 101), ("--locality", "l" * 201)):
        status, out, err = await cli("admin", "pairing-code", "--org", str(org[0]), "--name", "cli-node", flag, value)
        assert status == 2 and not out and err.count("\n") == 1, (flag, len(value), err)
        assert err.startswith(f"umbra: invalid_request: umbra admin pairing-code: argument {flag}:"), err
    assert (await (await conn.execute("SELECT count(*) FROM pairing_codes")).fetchone())[0] == 0
    status, out, err = await cli("admin", "pairing-code", "--org", str(org[0]), "--name", "edge", "--trust-domain",
                                 "t" * 100, "--locality", "l" * 200, "--json")  # fmt: skip
    assert status == 0, err


async def test_pairing_code_refuses_a_name_a_node_holds_even_retired(cli, org, live_server):
    """A node's name stays taken, a retired node's too, so a code for it could never be redeemed: the CLI
    refuses to issue one (node_name_taken, saying to choose another name). ``POST /v1/pairings`` issues it
    as the contract says, and redemption refuses it with the same message, which names no operation that
    does not exist."""
    org_id, key = org
    node_id, _ = await _paired_node(live_server, key, "laptop")
    status, _, err = await cli("admin", "retire", "--org", str(org_id), node_id)
    assert status == 0, err
    status, out, err = await cli("admin", "pairing-code", "--org", str(org_id), "--name", " laptop ", "--json")
    assert status == 1 and not out and err.count("\n") == 1, err
    assert err.startswith("umbra: node_name_taken: A node named 'laptop' already exists") and "choose another name" in err
    async with httpx.AsyncClient(base_url=live_server.url, headers={"Authorization": f"Bearer {key}"}) as client:
        issued = await client.post("/v1/pairings", json={"name": "laptop"})
        assert issued.status_code == 201, issued.text
        redeemed = await client.post("/v1/pairings/redeem", json={"code": issued.json()["code"], "name": "laptop"})
    assert redeemed.status_code == 409 and redeemed.json()["error"] == "node_name_taken"
    assert redeemed.json()["message"] == err.removeprefix("umbra: node_name_taken: ").strip()
    assert "rename" not in redeemed.json()["message"]
    status, _, err = await cli("admin", "pairing-code", "--org", str(org_id), "--name", "laptop-2")
    assert status == 0, err


async def _paired_node(live_server, api_key: str, name: str) -> tuple[str, str]:
    async with httpx.AsyncClient(base_url=live_server.url, headers={"Authorization": f"Bearer {api_key}"}) as client:
        code = (await client.post("/v1/pairings", json={"name": name})).json()["code"]
        redeemed = await client.post("/v1/pairings/redeem", json={"code": code, "name": name})
    assert redeemed.status_code == 201, redeemed.text
    return redeemed.json()["node_id"], redeemed.json()["credential"]


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


async def test_node_commands_print_a_nodes_name_escaped(cli, org, live_server):
    """A node's name is its agent's to choose (the API takes any text): ``admin drain|retire|revoke`` print it
    with the characters a terminal acts on escaped, so a name cannot clear the operator's screen or forge a
    line of the output, as ``events replay`` and ``jobs explain`` print it."""
    org_id, key = org
    name = "evil\x1b[2J\nnode_id: forged\u202e"
    node_id, _ = await _paired_node(live_server, key, name)
    for command in ("drain", "retire", "revoke"):
        status, out, err = await cli("admin", command, "--org", str(org_id), node_id)
        assert status == 0, err
        assert not re.search("[\x1b\u202e]", out), f"a raw escape reached the terminal: {out!r}"
        assert "node_id: forged" not in out.splitlines(), f"a forged line: {out!r}"
        assert "name: evil\\x1b[2J\\nnode_id: forged\\u202e" in out.splitlines(), out
    status, out, err = await cli("admin", "revoke", "--org", str(org_id), node_id, "--json")
    assert status == 0 and json.loads(out)["name"] == name, "JSON carries the name as it is"


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


@pytest.mark.parametrize("elided", ["…", "..."])
async def test_revoke_key_takes_the_name_list_keys_prints(cli, org, conn, elided):
    """list-keys prints each key as ``uk_<prefix>_…``: pasted (or typed with ``...``) into revoke-key, it names
    the key by its prefix, and revokes that key alone."""
    org_id, _ = org
    status, out, err = await cli("admin", "create-key", "--org", str(org_id), "--scopes", "jobs:read", "--json")
    assert status == 0, err
    prefix = json.loads(out)["prefix"]
    status, out, _ = await cli("admin", "list-keys", "--org", str(org_id))
    shown = next(token for line in out.splitlines() for token in line.split() if token.startswith(prefix))
    assert shown == f"{prefix}_…"
    status, out, err = await cli("admin", "revoke-key", "--org", str(org_id), shown.replace("…", elided), "--json")
    assert status == 0, f"revoke-key {shown!r}: {err.strip()}"
    revoked = await (await conn.execute(
        "SELECT prefix FROM api_keys WHERE organization_id = %s AND revoked_at IS NOT NULL", (org_id,))).fetchall()  # fmt: skip
    assert revoked == [(prefix.split("_")[1],)]


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


async def test_revoke_key_given_no_key_it_can_name_repeats_no_secret(cli, org, conn):
    """revoke-key takes the key itself, so what it is given may be a key: refused, its message names the prefix
    only when it was given one, never the rest. The secret half alone, or the key with its underscores turned
    to hyphens, was quoted whole as "prefix ..." on stderr."""
    org_id, key = org
    secret = key.split("_", 2)[2]
    for mangled in (secret.replace("_", "-"), key.replace("_", "-"), f"Bearer {key}", key.upper()):
        status, out, err = await cli("admin", "revoke-key", "--org", str(org_id), mangled)
        assert status == 1 and err.startswith("umbra: api_key_not_found:") and err.count("\n") == 1, (mangled, err)
        assert secret[:20].replace("_", "-") not in err.replace("_", "-") and secret[:20].upper() not in err.upper(), err
    status, _, err = await cli("admin", "revoke-key", "--org", str(org_id), "uk_0123456789")
    assert status == 1 and "0123456789" in err, "a prefix given is named"
    assert (await (await conn.execute("SELECT count(*) FROM api_keys WHERE revoked_at IS NOT NULL")).fetchone())[0] == 0


async def test_every_json_output_is_one_json_document_and_secrets_appear_only_where_issued(cli, org, api, live_server):
    """Each command's ``--json`` output parses as one JSON document (``events tail``: one per line), so a
    script can read it; an API key appears only in the answer of the command that created it, a pairing
    code only in ``pairing-code``'s."""
    org_id, key = org
    outputs = {}

    async def ok(*argv: str) -> str:
        status, out, err = await cli(*argv)
        assert status == 0, (argv, err)
        outputs[argv[:2]] = out
        return out

    made = json.loads(await ok("admin", "create-org", "second", "--json"))
    assert set(made) >= {"organization_id", "api_key"}
    issued = json.loads(await ok("admin", "create-key", "--org", str(org_id), "--scopes", "jobs:read", "--json"))
    json.loads(await ok("admin", "list-keys", "--org", str(org_id), "--json"))
    json.loads(await ok("admin", "create-project", "--org", str(org_id), "demo", "--json"))
    code = json.loads(await ok("admin", "pairing-code", "--org", str(org_id), "--name", "jbox", "--json"))["code"]
    node_id, _ = await _paired_node(live_server, key, "other-box")
    json.loads(await ok("admin", "drain", "--org", str(org_id), node_id, "--json"))
    json.loads(await ok("admin", "revoke-key", "--org", str(org_id), issued["prefix"], "--json"))
    job = (await api.post("/v1/jobs", json={"kind": "echo", "payload": {}})).json()
    http = ("--server", live_server.url, "--api-key", key, "--json")
    for line in (await ok("events", "tail", *http)).splitlines():
        assert json.loads(line)["position"] > 0
    assert json.loads(await ok("events", "replay", job["id"], *http))["state"]["id"] == job["id"]
    assert json.loads(await ok("events", "replay", node_id, *http))["state"]["id"] == node_id
    assert json.loads(await ok("jobs", "explain", job["id"], *http))["job_id"] == job["id"]
    assert json.loads(await ok("verify", "--json")) == {"ok": True, "differences": []}
    for argv, out in outputs.items():
        if argv != ("admin", "create-key"):
            assert issued["api_key"].split("_", 2)[2] not in out, argv
        if argv != ("admin", "pairing-code"):
            assert not re.search(rf"(?<![0-9]){code}(?![0-9])", out), argv


def test_dev_umbra_bench_runs_from_the_checkout_as_the_readme_says():
    """README: ``./dev umbra bench``, from the checkout, finds the benchmarks (the console script's
    own path holds .venv/bin, not the working directory). ``--only nope`` is refused before anything runs."""
    done = subprocess.run([str(Path(__file__).resolve().parents[2] / "dev"), "umbra", "bench", "--only", "nope"], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "run this from its root" not in done.stderr, done.stderr
    assert "unknown workload" in done.stderr, (done.returncode, done.stderr)
