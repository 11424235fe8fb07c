"""Secrets: never in logs, hashed with one argon2id profile, and a log the service cannot rewrite.

* Logs: the server runs as ``umbra serve`` runs it (``api.server.config``:
  uvicorn's loggers at debug, its access log off), the ``umbra`` logger tree at debug, and
  every record any of them emits during a full cycle — pairing code, redeem,
  heartbeat, submit, claim, renew, complete by the reference agent, an event
  stream opened with ``?access_token=``, wrong tokens and wrong codes — is
  searched for the API key, the node credential, the pairing code, the secret
  half of each token and any argon2 hash.
* Hashes: every stored secret hash (API keys, node credentials, pairing codes)
  is argon2id with exactly the parameters of the profile in use (``umbra.security.PASSWORD_HASHER``:
  the real one, or the suite's cheap one), a process takes the real one unless told otherwise,
  and no other module imports argon2, so the profile lives in one place.
* The service's role: a pooled request connection (``umbra.db.open_pool``,
  what the server uses) runs as ``umbra_service`` and cannot rewrite the log.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import argon2
import httpx
import psycopg
import pytest

from tests.conftest import free_port
from tests.helpers import eventually
from umbra import security
from umbra.settings import CHEAP_HASHING_VARIABLE, cheap_hashing

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
#: Every logger a record of ours could be written through. ``uvicorn.access`` is not among them:
#: the server's config turns it off (no handler, no propagation), and uvicorn only formats access
#: lines when that logger has a handler, so attaching one here would switch it on. Its being off
#: is asserted instead: an access line would carry the query string, and ``?access_token=`` with it.
CAPTURED_LOGGERS = ("", "umbra", "uvicorn", "uvicorn.error", "psycopg")


class Capture(logging.Handler):
    """Every record, rendered every way it could be written: message, JSON line, raw attributes."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []
        self._seen: set[int] = set()
        from umbra.logs import JsonFormatter

        self._json = JsonFormatter()

    def emit(self, record: logging.LogRecord) -> None:
        if id(record) in self._seen:
            return
        self._seen.add(id(record))
        self.lines.append(f"{record.name} {record.getMessage()} {self._json.format(record)} {record.__dict__!r}")

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


class ServeThread:
    """The app under ``api.server.Server`` with the production uvicorn config, logging at debug."""

    def __init__(self, db_url: str) -> None:
        from umbra.api.app import create_app
        from umbra.api.server import Server, config
        from umbra.settings import load_settings

        settings = load_settings({"UMBRA_DATABASE_URL": db_url, "UMBRA_LOG_LEVEL": "DEBUG",
                                  "UMBRA_SWEEP_INTERVAL_SECONDS": "0.2"})  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = Server(config(create_app(settings, db_url), host="127.0.0.1", port=self.port, log_level="debug"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ServeThread":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


@contextlib.contextmanager
def capture_logs():
    """Capture every logger that matters; attach after uvicorn's config is built (it installs its own handlers)."""
    capture = Capture()
    levels = {}
    for name in CAPTURED_LOGGERS:
        logger = logging.getLogger(name)
        levels[name] = logger.level
        logger.addHandler(capture)
        if name:
            logger.setLevel(logging.DEBUG)
    try:
        yield capture
    finally:
        for name in CAPTURED_LOGGERS:
            logging.getLogger(name).removeHandler(capture)
            logging.getLogger(name).setLevel(levels[name])


def secret_forms(token: str) -> list[str]:
    """The token and its secret half (the prefix before it is stored in clear and may be shown)."""
    return [token, token.split("_", 2)[2]]


async def _agent_completes_one_job(url: str, credential: str, api: httpx.AsyncClient) -> str:
    from umbra.agent.client import AgentClient
    from umbra.agent.handlers import HandlerRegistry
    from umbra.agent.runner import Agent, AgentConfig
    from umbra.events.types import Device

    job = (await api.post("/v1/jobs", json={"kind": "echo", "payload": {"hello": "world"}})).json()
    device = Device(kind="cpu", label="cpu0", ram_total_mb=8192, ram_free_mb=8000)
    async with AgentClient(url, credential) as client:
        agent = Agent(client, HandlerRegistry.default(), lambda: [device],
                      AgentConfig(agent_version="test", heartbeat_seconds=0.5, claim_wait_seconds=1))  # fmt: skip
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent.run)

            async def done():
                answer = (await api.get(f"/v1/jobs/{job['id']}")).json()
                return answer if answer["status"] == "complete" else None

            await eventually(done, timeout=20)
            agent.stop(immediately=True)
    return job["id"]


async def test_no_secret_is_ever_logged_through_a_full_cycle(db_url, conn):
    from umbra.compute.accounts import create_organization

    _, key = await create_organization(conn, "secrets")
    serving = ServeThread(db_url)  # builds uvicorn's config, which installs uvicorn's handlers
    access = logging.getLogger("uvicorn.access")
    assert not access.hasHandlers() and not access.propagate, "uvicorn's access log (query strings included) is on"
    with capture_logs() as captured, serving as server:
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {key}"}) as api, \
                httpx.AsyncClient(base_url=server.url) as anonymous:  # fmt: skip
            code = (await api.post("/v1/pairings", json={"name": "quiet"})).json()["code"]
            wrong = f"{(int(code) + 1) % 1_000_000:06d}"
            assert (await anonymous.post("/v1/pairings/redeem", json={"code": wrong, "name": "quiet"})).status_code == 401
            redeemed = (await anonymous.post("/v1/pairings/redeem", json={"code": code, "name": "quiet"})).json()
            credential = redeemed["credential"]
            assert (await anonymous.post("/v1/pairings/redeem", json={"code": code, "name": "quiet"})).status_code == 401
            node = {"Authorization": f"Bearer {credential}"}
            assert (await anonymous.post("/v1/agent/heartbeat", json={"devices": []}, headers=node)).status_code == 200
            # Near misses of real tokens are refused without being echoed anywhere.
            near_misses = [key[:-1] + ("A" if key[-1] != "A" else "B"), credential[:-2] + "zz"]
            for bad in near_misses:
                answer = await anonymous.get("/v1/nodes", headers={"Authorization": f"Bearer {bad}"})
                assert answer.status_code == 401 and bad not in answer.text
            # An EventSource-style stream carries the key in the query string.
            async with anonymous.stream("GET", f"/v1/events/stream?access_token={key}") as stream:
                assert stream.status_code == 200
                with anyio.move_on_after(0.5):
                    async for _ in stream.aiter_bytes():
                        pass
            job_id = await _agent_completes_one_job(server.url, credential, api)
            events = (await api.get(f"/v1/jobs/{job_id}/events")).json()["events"]
            assert [e["type"] for e in events][-1] == "job.completed"
            assert (await api.post(f"/v1/nodes/{redeemed['node_id']}/revoke")).status_code == 200
            assert (await anonymous.post("/v1/agent/heartbeat", json={}, headers=node)).status_code == 401
    text = captured.text
    assert "http_request" in text and "job_claimed" in text, "the capture saw the service's own records"
    assert len(captured.lines) > 20
    for secret in [*secret_forms(key), *secret_forms(credential), *(s for bad in near_misses for s in secret_forms(bad))]:
        assert secret not in text, "a token (or its secret half) reached the logs"
    for digits in (code, wrong):
        assert not re.search(rf"(?<![0-9]){digits}(?![0-9])", text), "a pairing code reached the logs"
    assert "$argon2" not in text, "a hash reached the logs"


def _params(encoded: str) -> argon2.Parameters:
    return argon2.extract_parameters(encoded)


@pytest.mark.parametrize("profile", [security.PROFILE, security.CHEAP_TEST_PROFILE], ids=["real", "cheap"])
async def test_every_stored_secret_is_argon2id_with_the_one_profile(db_url, conn, monkeypatch, profile):
    from umbra.compute.accounts import create_api_key, create_organization

    monkeypatch.setattr(security, "PASSWORD_HASHER", profile)

    from .queue_support import CPU8, add_node

    org_id, _ = await create_organization(conn, "hashes")
    await create_api_key(conn, org_id, ["jobs:read"])
    await add_node(conn, org_id, "hashed", [CPU8])
    from umbra.compute.pairing import issue_pairing_code

    await issue_pairing_code(conn, org_id, "pending")
    rows = await (await conn.execute(
        "SELECT 'api_keys', secret_hash FROM api_keys UNION ALL SELECT 'node_credentials', secret_hash FROM node_credentials"
        " UNION ALL SELECT 'pairing_codes', code_hash FROM pairing_codes")).fetchall()  # fmt: skip
    assert {table for table, _ in rows} == {"api_keys", "node_credentials", "pairing_codes"}
    for table, encoded in rows:
        assert encoded.startswith("$argon2id$"), table
        params = _params(encoded)
        assert (params.type, params.time_cost, params.memory_cost, params.parallelism, params.hash_len, params.salt_len) == (
            argon2.Type.ID, profile.time_cost, profile.memory_cost, profile.parallelism, profile.hash_len, profile.salt_len
        ), table
        assert not profile.check_needs_rehash(encoded), table


def test_a_process_hashes_on_the_real_profile_unless_the_tests_variable_is_exactly_1():
    """The cheap profile is the test suite's (its conftest sets the variable); anything else is the real one."""
    assert security.PROFILE.time_cost == 3 and security.PROFILE.memory_cost == 19 * 1024 and security.PROFILE.type is argon2.Type.ID
    for value in ("0", "", "true", "yes", " 1"):
        assert not cheap_hashing({CHEAP_HASHING_VARIABLE: value}), value
    assert not cheap_hashing({}) and cheap_hashing({CHEAP_HASHING_VARIABLE: "1"})
    # What a process picks up at import: a hash made there carries the parameters of the profile it chose.
    script = "from umbra.security import hash_secret; print(hash_secret('s'))"
    for value, profile in ((None, security.PROFILE), ("0", security.PROFILE), ("1", security.CHEAP_TEST_PROFILE)):
        environment = {k: v for k, v in os.environ.items() if k != CHEAP_HASHING_VARIABLE}
        if value is not None:
            environment[CHEAP_HASHING_VARIABLE] = value
        made = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=environment, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
        params = _params(made)
        assert (params.type, params.time_cost, params.memory_cost) == (argon2.Type.ID, profile.time_cost, profile.memory_cost), value


def test_argon2_is_configured_in_one_module_only():
    importers = []
    for path in ROOT.rglob("*.py"):
        relative = path.relative_to(ROOT)
        if relative.parts[0] in {".venv", "tests", "build"} or "site-packages" in relative.parts:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(name == "argon2" or name.startswith("argon2.") for name in names):
                importers.append(str(relative))
    assert sorted(set(importers)) == ["umbra/security.py"]


async def test_request_connections_run_as_the_service_role_and_cannot_rewrite_the_log(db_url, conn, org):
    from umbra.db import open_pool

    from .queue_support import submit

    await submit(conn, org[0])
    async with open_pool(db_url, size=2) as pool, pool.connection() as pooled:
        assert (await (await pooled.execute("SELECT current_user")).fetchone())[0] == "umbra_service"
        for statement in ("UPDATE events SET data = '{}'", "DELETE FROM events", "TRUNCATE events"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                await pooled.execute(statement)
    assert (await (await conn.execute("SELECT count(*) FROM events")).fetchone())[0] > 0
