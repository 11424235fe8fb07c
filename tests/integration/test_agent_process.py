"""``umbra agent`` as a real process: pairing once into a private credential
file, reusing it, SIGTERM and SIGHUP (finish the current job, or give it back
after the grace period; exit 0 either way), devices the server would
refuse (refused at start, before any heartbeat), and ``kill -9``, which takes
its job's program with it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import anyio
import httpx
import psutil
import pytest

from tests.conftest import LiveServer
from tests.helpers import eventually, sighup_at_default, until
from umbra.agent.client import AgentClient
from umbra.agent.credentials import CredentialFile, StoredCredential
from umbra.agent.devices import parse_device_spec

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
DEVICE = json.dumps({"kind": "cpu", "label": "cpu0", "ram_total_mb": 8192, "ram_free_mb": 8000})


@pytest.fixture
def server(db_url):
    env = {"UMBRA_LEASE_SECONDS": "3", "UMBRA_HEARTBEAT_INTERVAL_SECONDS": "1", "UMBRA_SWEEP_INTERVAL_SECONDS": "0.2"}
    with LiveServer(db_url, **env) as live:
        yield live


@pytest.fixture
async def api(server, org):
    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {org[1]}"}) as client:
        yield client


class AgentProcess:
    """``python -m umbra.cli agent ...`` with its output drained into memory."""

    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        self.stdout = b""
        self.stderr = b""

    async def _drain(self, stream, name: str) -> None:
        async for chunk in stream:
            setattr(self, name, getattr(self, name) + chunk)

    async def wait(self, timeout: float = 30) -> int:
        with anyio.fail_after(timeout):
            return await self.process.wait()


@contextlib.asynccontextmanager
async def agent_process(*args: str, pythonpath: Path | None = None):
    """The agent, killed at the end if still running; ``pythonpath``: where its handler modules are."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "umbra.cli", "agent", "--claim-wait", "2", "--device", DEVICE, *args]
    with sighup_at_default():  # the agent takes SIGHUP as from a closed terminal
        process = await anyio.open_process(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env)
    wrapper = AgentProcess(process)
    async with process, anyio.create_task_group() as tg:
        tg.start_soon(wrapper._drain, process.stdout, "stdout")
        tg.start_soon(wrapper._drain, process.stderr, "stderr")
        try:
            yield wrapper
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()


async def _code(api, name: str) -> str:
    return (await api.post("/v1/pairings", json={"name": name})).json()["code"]


async def _job(api, job_id: str, *statuses: str):
    job = (await api.get(f"/v1/jobs/{job_id}")).json()
    return job if job["status"] in statuses else None


async def _claimed_by(agent: AgentProcess, api, job_id: str):
    """The job is running and the agent has logged receiving it.

    The server shows a claim as running once committed, a moment before the
    agent reads the answer; a SIGTERM in between abandons the claim, which then
    waits out its lease (a lost claim answer), so the stop would test that.
    """
    return await _job(api, job_id, "running") if job_id in agent.stderr.decode() else None


async def _online_node(api, name: str):
    nodes = (await api.get("/v1/nodes")).json()["nodes"]
    return next((n for n in nodes if n["name"] == name and n["status"] == "online"), None)


async def _submit(api, kind: str, payload: dict) -> str:
    response = await api.post("/v1/jobs", json={"kind": kind, "payload": payload})
    assert response.status_code == 201, response.text
    return response.json()["id"]


async def test_pairs_into_a_private_file_and_sigterm_finishes_the_current_job(server, api, tmp_path):
    credential_file = tmp_path / "agent" / "credential.json"
    code = await _code(api, "proc-1")
    async with agent_process("--server", server.url, "--code", code, "--name", "proc-1",
                             "--credential-file", str(credential_file), "--grace", "20") as agent:
        node = await eventually(lambda: _online_node(api, "proc-1"), timeout=20)
        running = await _submit(api, "sleep", {"seconds": 2})
        await eventually(lambda: _claimed_by(agent, api, running), timeout=10)
        waiting = await _submit(api, "echo", {"left": "behind"})
        agent.process.send_signal(signal.SIGTERM)
        assert await agent.wait() == 0, agent.stderr.decode()
    assert (await _job(api, running, "complete"))["result"] == {"slept": 2}
    assert await _job(api, waiting, "queued"), "a stopping agent takes no new work"
    assert f"paired as proc-1 (node {node['id']})" in agent.stdout.decode()
    assert stat.S_IMODE(credential_file.stat().st_mode) == 0o600
    stored = json.loads(credential_file.read_text())
    assert stored["node_id"] == node["id"] and stored["server"] == server.url
    assert stored["credential"] not in agent.stderr.decode() + agent.stdout.decode(), "the credential is never logged"
    assert code not in agent.stderr.decode()


async def test_the_credential_and_the_pairing_code_never_reach_the_agents_output_even_at_debug(server, api, tmp_path):
    """An agent's output goes to terminals and log collectors: pairing, running a job and stopping at DEBUG,
    neither the credential (kept in its 0600 file alone) nor the pairing code it redeemed is ever printed."""
    credential_file = tmp_path / "credential.json"
    code = await _code(api, "quiet-box")
    job_id = await _submit(api, "echo", {"hello": 1})
    async with agent_process("--server", server.url, "--code", code, "--name", "quiet-box",
                             "--credential-file", str(credential_file), "--log-level", "debug") as agent:
        await eventually(lambda: _job(api, job_id, "complete"), timeout=30)
        agent.process.send_signal(signal.SIGTERM)
        assert await agent.wait() == 0, agent.stderr.decode()[-500:]
    credential = json.loads(credential_file.read_text())["credential"]
    assert stat.S_IMODE(credential_file.stat().st_mode) == 0o600
    text = (agent.stdout + agent.stderr).decode()
    assert "job_finished" in text and "paired as quiet-box" in text
    assert credential.split("_", 2)[2] not in text and credential not in text
    assert not re.search(rf"(?<![0-9]){code}(?![0-9])", text), "the pairing code reached the agent's output"


async def test_a_restart_reuses_the_credential_and_gives_a_job_back_after_the_grace_period(server, api, tmp_path):
    credential_file = tmp_path / "credential.json"
    code = await _code(api, "proc-2")
    async with agent_process("--server", server.url, "--code", code, "--name", "proc-2",
                             "--credential-file", str(credential_file)) as first:
        first_node = await eventually(lambda: _online_node(api, "proc-2"), timeout=20)
        first.process.send_signal(signal.SIGTERM)
        assert await first.wait() == 0

    async with agent_process("--credential-file", str(credential_file), "--grace", "0.5") as second:
        await eventually(lambda: _restarted(api, first_node), timeout=20)
        stuck = await _submit(api, "sleep", {"seconds": 600})
        await eventually(lambda: _claimed_by(agent=second, api=api, job_id=stuck), timeout=10)
        second.process.send_signal(signal.SIGTERM)
        assert await second.wait(timeout=15) == 0, second.stderr.decode()
    given_back = await _job(api, stuck, "queued")
    assert given_back and given_back["error"] == "The agent stopped before the job finished."
    events = (await api.get(f"/v1/jobs/{stuck}/events")).json()["events"]
    assert [e["type"] for e in events] == ["job.submitted", "job.claimed", "job.released"]
    assert events[-1]["data"]["reason"] == "agent_stopping" and given_back["not_before"] is None
    assert "paired as" not in second.stdout.decode()


async def _paired_file(server, api, tmp_path, name: str) -> tuple[Path, str]:
    """A credential file as a first ``umbra agent --code`` run leaves it, and the node's id."""
    code = await _code(api, name)
    async with AgentClient(server.url) as client:
        answer = await client.redeem(code=code, name=name, agent_version="t", devices=[parse_device_spec(DEVICE)])
    store = CredentialFile(tmp_path / "credential.json")
    store.save(StoredCredential(server=server.url, node_id=answer["node_id"], name=name, credential=answer["credential"]))
    return store.path, answer["node_id"]


async def test_sighup_finishes_the_current_job_as_sigterm_does(server, api, tmp_path):
    """The terminal or SSH session the agent was started from closing: killed outright, the running
    job would be neither finished nor given back (it waits out its lease) and the node never signed
    off. ``umbra serve`` treats SIGHUP the same way."""
    credential_file, node_id = await _paired_file(server, api, tmp_path, "hup-1")
    async with agent_process("--credential-file", str(credential_file), "--grace", "20") as agent:
        await eventually(lambda: _online_node(api, "hup-1"), timeout=20)
        running = await _submit(api, "sleep", {"seconds": 2})
        await eventually(lambda: _claimed_by(agent, api, running), timeout=10)
        agent.process.send_signal(signal.SIGHUP)
        assert await agent.wait() == 0, agent.stderr.decode()[-500:]
    assert (await _job(api, running, "complete"))["result"] == {"slept": 2}
    assert (await api.get(f"/v1/nodes/{node_id}")).json()["status"] == "offline", "the node signed off"


@pytest.mark.parametrize(
    "devices, says",
    [
        ([{"kind": "cpu", "label": "cpu0", "ram_total_mb": 8192, "ram_free_mb": 4000}], "'cpu0' is given twice"),
        ([{"kind": "cpu", "label": "cpu1", "ram_total_mb": 8192, "ram_free_mb": -1}], "$.ram_free_mb"),
        ([{"kind": "gpu_discrete", "label": "gpu0", "vram_totl_mb": 24576}], "unknown field `vram_totl_mb`"),
    ],
    ids=["duplicate-label", "negative-free-ram", "unknown-field"],
)
async def test_devices_the_server_would_refuse_stop_the_agent_at_start(server, api, tmp_path, devices, says):
    """Started with them, a paired agent's every heartbeat would be refused (422); it is refused
    before any heartbeat instead, saying what is wrong (``agent_process`` passes a cpu0 already)."""
    credential_file, node_id = await _paired_file(server, api, tmp_path, "bad-dev-1")
    flags = [arg for device in devices for arg in ("--device", json.dumps(device))]
    async with agent_process("--credential-file", str(credential_file), *flags) as agent:
        status = await agent.wait(timeout=20)
    err = agent.stderr.decode()
    assert status == 2 and err.startswith("umbra: invalid_request: umbra agent: argument --device:"), err
    assert says in err and err.count("\n") == 1, err
    assert (await api.get(f"/v1/nodes/{node_id}")).json()["status"] == "provisioning", "no heartbeat was sent"


async def _restarted(api, before: dict):
    node = (await api.get(f"/v1/nodes/{before['id']}")).json()
    return node["status"] == "online" and node["agent_started_at"] != before["agent_started_at"]


async def run_cli(*argv: str) -> tuple[int, str]:
    """``umbra ARGV`` as a process (it configures logging, which must not leak into this one)."""
    done = await anyio.run_process([sys.executable, "-m", "umbra.cli", *argv], cwd=ROOT, check=False)
    return done.returncode, done.stderr.decode()


async def test_refusals_are_one_line_and_never_overwrite_a_credential(tmp_path):
    missing = tmp_path / "none.json"
    status, err = await run_cli("agent", "--credential-file", str(missing), "--server", "http://127.0.0.1:9")
    assert status == 1 and err.startswith("umbra: credential_file: No credential at") and err.count("\n") == 1
    existing = tmp_path / "cred.json"
    existing.write_text("{}")
    existing.chmod(0o600)
    status, err = await run_cli("agent", "--credential-file", str(existing), "--code", "123456", "--name", "x")
    assert status == 1 and "already holds a credential" in err and err.count("\n") == 1
    assert existing.read_text() == "{}"


async def test_a_wrong_pairing_code_is_refused_with_the_servers_code(server, tmp_path):
    target = tmp_path / "cred.json"
    status, err = await run_cli("agent", "--server", server.url, "--code", "000000", "--name", "nobody",
                                "--credential-file", str(target), "--device", DEVICE)
    assert status == 1 and err.startswith("umbra: pairing_code_invalid:") and err.count("\n") == 1
    assert not target.exists()


async def test_sigterm_then_sighup_as_systemd_sends_them_still_finishes_the_job(server, api, tmp_path):
    """systemd (``SendSIGHUP=yes``) sends SIGTERM and then SIGHUP at once: one stop, and the running job still
    gets its grace; only a second SIGTERM or SIGINT gives it up."""
    credential_file, _ = await _paired_file(server, api, tmp_path, "hup-2")
    async with agent_process("--credential-file", str(credential_file), "--grace", "20") as agent:
        await eventually(lambda: _online_node(api, "hup-2"), timeout=20)
        running = await _submit(api, "sleep", {"seconds": 2})
        await eventually(lambda: _claimed_by(agent, api, running), timeout=10)
        agent.process.send_signal(signal.SIGTERM)
        await anyio.sleep(0.2)
        agent.process.send_signal(signal.SIGHUP)
        assert await agent.wait() == 0, agent.stderr.decode()[-500:]
    job = await eventually(lambda: _job(api, running, "complete", "queued"), timeout=10)
    assert job["status"] == "complete", f"the job was given back without its grace: {job['status']}, {job['error']!r}"


def _ended(pid: int) -> bool:
    """No process ``pid`` runs: none is left, or one that ended waits to be reaped (by init, once orphaned)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
async def test_a_command_s_program_ends_with_its_agent_killed_by_sigkill(server, api, tmp_path):
    """``kill -9`` of the agent (an OOM kill, a supervisor's last resort) gives it no say: its job's program,
    orphaned, ran on, holding the device, while the job's lease ran out and it ran again on another node,
    two copies at once. The program gets SIGKILL when its agent dies."""
    credential_file, _ = await _paired_file(server, api, tmp_path, "kill-9")
    pid_file = tmp_path / "pid"
    script = tmp_path / "job.py"
    script.write_text(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(300)\n")
    async with agent_process("--credential-file", str(credential_file),
                             "--command", f"work={sys.executable} {script}") as agent:
        job = await _submit(api, "work", {})
        await eventually(lambda: _job(api, job, "running"), timeout=20)
        await eventually(lambda: _has_text(pid_file), timeout=20)
        program = int(pid_file.read_text())
        try:
            assert psutil.Process(program).ppid() == agent.process.pid, "the program is the agent's child"
            agent.process.kill()
            assert await agent.wait() == -signal.SIGKILL
            await until(lambda: _ended(program), timeout=10)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(program, signal.SIGKILL)


async def _has_text(path: Path) -> bool:
    return path.exists() and path.read_text() != ""
