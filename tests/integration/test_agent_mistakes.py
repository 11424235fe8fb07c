"""``umbra agent`` with handlers that go wrong, and the command-line tools' refusals.

Real server (LiveServer), real database, real ``umbra`` processes; every process
started here is killed in a ``finally``.
"""

from __future__ import annotations

import socket
import uuid
import os
import signal
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

from tests.helpers import eventually

from .test_agent_process import DEVICE, ROOT, AgentProcess, _code, _job, agent_process, api, server  # noqa: F401  (fixtures)

pytestmark = pytest.mark.anyio

UMBRA_SCRIPT = ROOT / ".venv" / "bin" / "umbra"

HANDLERS = textwrap.dedent(
    '''
    import time

    from umbra.agent.handlers import Child, Decompose


    def hang(claim):
        """A plain (sync) handler that blocks, e.g. on a stuck device call."""
        time.sleep(3600)


    class Opaque:
        pass


    async def bad_children(claim):
        """Decomposes into a child whose payload cannot be encoded as JSON."""
        return Decompose([Child("echo", payload={"thing": Opaque()})])


    async def dict_children(claim):
        """Decomposes with plain dicts instead of Child objects."""
        return Decompose([{"kind": "echo", "payload": {}}])


    async def ok(claim):
        return {"ok": True}


    async def nan(claim):
        return {"ratio": float("nan"), "big": float("inf")}


    def exits(claim):
        """A plain handler whose library calls sys.exit() (or exit()) on a bad input."""
        raise SystemExit(3)
    '''
)


@pytest.fixture
def handler_dir(tmp_path):
    directory = tmp_path / "handlers"
    directory.mkdir()
    (directory / "site_handlers.py").write_text(HANDLERS)
    return directory


async def _submit(api, kind: str, payload: dict | None = None, **fields) -> str:
    response = await api.post("/v1/jobs", json={"kind": kind, "payload": payload or {}, **fields})
    assert response.status_code == 201, response.text
    return response.json()["id"]


async def _online_node(api, name: str):
    nodes = (await api.get("/v1/nodes")).json()["nodes"]
    return next((n for n in nodes if n["name"] == name and n["status"] == "online"), None)


async def _claimed_by(agent: AgentProcess, api, job_id: str):
    return await _job(api, job_id, "running") if job_id in agent.stderr.decode() else None


async def run_cli(*argv: str, env: dict | None = None, cwd: Path = ROOT, script: bool = False) -> tuple[int, str, str]:
    full_env = dict(os.environ)
    full_env.pop("UMBRA_API_KEY", None)
    full_env.update(env or {})
    command = [str(UMBRA_SCRIPT), *argv] if script else [sys.executable, "-m", "umbra.cli", *argv]
    with anyio.fail_after(60):
        done = await anyio.run_process(command, cwd=cwd, env=full_env, check=False)
    return done.returncode, done.stdout.decode(), done.stderr.decode()


# -- agent: stopping -------------------------------------------------------------------------------


async def test_sigterm_with_a_blocked_sync_handler_exits_after_the_grace_period(server, api, tmp_path, handler_dir):
    """README: "Ctrl-C or SIGTERM lets the running jobs finish (--grace, default 30 s) and exits 0."

    Even with a plain handler stuck in its worker thread: the thread cannot be stopped, and the
    interpreter would wait for it at exit, so the agent exits past it.
    """
    credential_file = tmp_path / "cred.json"
    code = await _code(api, "hang-1")
    async with agent_process("--server", server.url, "--code", code, "--name", "hang-1",
                             "--credential-file", str(credential_file), "--grace", "1",
                             "--handler", "hang=site_handlers:hang", pythonpath=handler_dir) as agent:
        await eventually(lambda: _online_node(api, "hang-1"), timeout=20)
        job = await _submit(api, "hang")
        await eventually(lambda: _claimed_by(agent, api, job), timeout=10)
        agent.process.send_signal(signal.SIGTERM)
        # The job is given back after the 1 s grace (the agent's own log says it stopped) ...
        await eventually(lambda: _job(api, job, "queued"), timeout=15)
        # ... but the process is still there long after: it waits for the blocked thread.
        try:
            status = await agent.wait(timeout=15)
        except TimeoutError:
            status = None
        stopped_logged = "agent_stopped" in agent.stderr.decode() or "agent stopped" in agent.stderr.decode()
        assert status == 0, f"agent did not exit 15 s after SIGTERM with --grace 1 (logged stop: {stopped_logged})"


# -- agent: handler results it cannot encode -------------------------------------------------------


@pytest.mark.parametrize("handler", ["bad_children", "dict_children", "exits"])
async def test_a_handler_mistake_fails_the_job_instead_of_killing_the_agent(
        server, api, tmp_path, handler_dir, handler):
    """handlers.py: "a handler that raises fails the job"; jobrun.py refuses a result it cannot encode.

    Children that cannot be sent as returned (not JSON, not Child objects) and a handler raising
    SystemExit fail the job for good, saying why; the agent goes on with the next job.
    """
    name = f"dec-{handler.replace('_', '-')}"
    code = await _code(api, name)
    async with agent_process("--server", server.url, "--code", code, "--name", name,
                             "--credential-file", str(tmp_path / "cred.json"),
                             "--handler", f"split={'site_handlers:' + handler}",
                             "--handler", "fine=site_handlers:ok", pythonpath=handler_dir) as agent:
        await eventually(lambda: _online_node(api, name), timeout=20)
        job = await _submit(api, "split")
        failed = await eventually(lambda: _job(api, job, "failed"), timeout=10)
        assert failed["error"]
        assert agent.process.returncode is None, (
            f"agent exited {agent.process.returncode} running one job: {agent.stderr.decode()[-600:]}")
        after = await _submit(api, "fine")
        await eventually(lambda: _job(api, after, "complete"), timeout=10)


# -- agent: --handler as the README runs it ---------------------------------------------------------


async def test_handler_module_in_the_working_directory_is_found_by_the_umbra_command(tmp_path, handler_dir):
    """``--handler KIND=module:function`` finds a module in the working directory through the ``umbra``
    console script (whose own sys.path holds .venv/bin, not the working directory) as through
    ``python -m umbra.cli``."""
    missing = tmp_path / "none.json"
    argv = ("agent", "--credential-file", str(missing), "--handler", "hang=site_handlers:hang")
    status, _, err_module = await run_cli(*argv, cwd=handler_dir)
    assert status == 1 and err_module.startswith("umbra: credential_file:"), err_module  # handler loaded
    status, _, err_script = await run_cli(*argv, cwd=handler_dir, script=True)
    assert status == 1 and err_script.startswith("umbra: credential_file:"), err_script


# -- CLI: one-line errors -------------------------------------------------------------------------------


async def test_admin_and_verify_with_the_database_down_print_one_line(tmp_path):
    """cli.py: "Errors are one line on stderr with a non-zero exit, never a traceback", even where
    libpq's message goes on with a hint on a second line ("Is the server running ...")."""
    env = {"UMBRA_DATABASE_URL": "postgresql://postgres@127.0.0.1:1/nothing"}
    for argv in (("admin", "create-org", "acme", "--json"), ("verify",)):
        status, out, err = await run_cli(*argv, env=env)
        assert status != 0 and out == ""
        assert "Traceback" not in err
        assert err.startswith("umbra: ") and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv", [
    ("events", "replay", "not-a-uuid"),
    ("jobs", "explain", "not-a-uuid"),
    ("admin", "drain", "--org", "not-a-uuid", "00000000-0000-0000-0000-000000000000"),
])
async def test_a_bad_uuid_is_a_one_line_umbra_error(argv):
    """A refused argument is one ``umbra: invalid_request: ...`` line (exit 2), not argparse's usage block."""
    status, out, err = await run_cli(*argv, env={"UMBRA_API_KEY": "uk_x_y"})
    assert status != 0 and out == ""
    assert len(err.strip().splitlines()) == 1, err


async def test_verify_of_an_organization_that_does_not_exist_is_refused(db_url, org):
    """``umbra verify --org`` of a mistyped id answers ``organization_not_found``, as every other ``--org``
    command: "views match the log" would read as a clean audit of nothing."""
    status, out, err = await run_cli("verify", "--org", "00000000-0000-0000-0000-000000000001",
                                     env={"UMBRA_DATABASE_URL": db_url})
    assert status != 0 and "organization_not_found" in err, (status, out, err)


async def test_a_non_finite_float_in_a_result_is_not_silently_stored_as_null(server, api, tmp_path, handler_dir):
    """msgspec writes NaN and Infinity as ``null``: a result holding one fails the job for good, saying
    why, rather than complete it with a result other than the handler's."""
    code = await _code(api, "nan-1")
    async with agent_process("--server", server.url, "--code", code, "--name", "nan-1",
                             "--credential-file", str(tmp_path / "cred.json"),
                             "--handler", "nan=site_handlers:nan", pythonpath=handler_dir):
        await eventually(lambda: _online_node(api, "nan-1"), timeout=20)
        job_id = await _submit(api, "nan")
        job = await eventually(lambda: _job(api, job_id, "complete", "failed"), timeout=10)
    assert job["result"] != {"ratio": None, "big": None}, "NaN/Infinity were rewritten to null and stored"


async def test_a_saved_credential_is_never_sent_to_another_server_than_its_own(tmp_path):
    """The credential file names the server that issued it; ``--server`` naming another is refused
    before any request, rather than hand the node's secret to whatever answers there."""
    from umbra.agent.credentials import CredentialFile, StoredCredential

    path = tmp_path / "cred.json"
    CredentialFile(path).save(StoredCredential(server="http://127.0.0.1:8080/", node_id=str(uuid.uuid4()), name="box",
                                               credential="un_0123456789_secret", scopes=()))  # fmt: skip
    with socket.socket() as trap:  # a server that would see the credential, if it were sent
        trap.bind(("127.0.0.1", 0))
        trap.listen(1)
        other = f"http://127.0.0.1:{trap.getsockname()[1]}"
        status, _, err = await run_cli("agent", "--credential-file", str(path), "--server", other)
        trap.setblocking(False)
        with pytest.raises(BlockingIOError):
            trap.accept()  # nobody called
    assert status == 1 and err.startswith("umbra: invalid_request:") and "http://127.0.0.1:8080/" in err, err
    assert "un_0123456789_secret" not in err


async def test_an_agent_whose_credential_is_revoked_exits_past_a_stuck_plain_handler(server, api, tmp_path, handler_dir):
    """README: a revoked agent exits 1 with ``unauthenticated``, even with a plain handler stuck in its
    thread."""
    credential_file = tmp_path / "cred.json"
    code = await _code(api, "hang-r")
    async with agent_process("--server", server.url, "--code", code, "--name", "hang-r",
                             "--credential-file", str(credential_file), "--grace", "1",
                             "--handler", "hang=site_handlers:hang", pythonpath=handler_dir) as agent:
        node = await eventually(lambda: _online_node(api, "hang-r"), timeout=20)
        job = await _submit(api, "hang")
        await eventually(lambda: _claimed_by(agent, api, job), timeout=10)
        revoked = await api.post(f"/v1/nodes/{node['id']}/revoke")
        assert revoked.status_code == 200, revoked.text
        try:
            status = await agent.wait(timeout=20)
        except TimeoutError:
            status = None
        rejected = "agent_unauthenticated" in agent.stderr.decode() or "credential rejected" in agent.stderr.decode()
        assert status == 1, f"agent still running 20 s after its credential was revoked (logged rejection: {rejected})"
        assert "umbra: unauthenticated:" in agent.stderr.decode()


async def test_an_agent_started_on_a_refused_credential_says_how_to_pair_again(server, tmp_path):
    from umbra.agent.credentials import CredentialFile, StoredCredential

    path = tmp_path / "cred.json"
    CredentialFile(path).save(StoredCredential(server=server.url, node_id=str(uuid.uuid4()), name="gone",
                                               credential="un_0123456789_no-longer-valid", scopes=()))  # fmt: skip
    status, _, err = await run_cli("agent", "--credential-file", str(path), "--device", DEVICE)
    assert status == 1 and "umbra: unauthenticated:" in err, err
    assert f"the credential in {path} was revoked" in err and "pair again with --code" in err
    assert "no-longer-valid" not in err
