"""``umbra agent --command``: jobs run as programs by a real agent against a live server: the result, the
progress and the failures reach the job; a cancelled job's program is stopped."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from decimal import Decimal

import pytest

from tests.helpers import eventually
from tests.unit.test_command_handler import _alive
from umbra.agent.commands import CommandHandler

from .test_agent import api, event_types, job_events, job_in, pair, running_agent, server, submit  # noqa: F401

pytestmark = pytest.mark.anyio

SCRIPT = """
import json, sys, time
job = json.load(sys.stdin)
for step in range(job["steps"]):
    print(f"umbra-progress {(step + 1) / job['steps']} step {step + 1} of {job['steps']}", file=sys.stderr, flush=True)
    time.sleep(job["pause"])
if job.get("fail"):
    print("out of memory", file=sys.stderr)
    sys.exit(job["fail"])
print(json.dumps({"squares": [n * n for n in range(job["steps"])]}))
"""


async def test_a_program_s_result_and_progress_reach_the_job_and_its_exit_status_decides_the_outcome(server, api):
    """Exit 0: complete, its JSON output the result, its progress in the lease renewals' history; 75: retried
    (the run counted, the job queued again); 3: failed for good, the error quoting the program."""
    paired = await pair(server, api, "scripts")
    handler = CommandHandler([sys.executable, "-c", SCRIPT])
    async with running_agent(server, paired["credential"], handlers={"script": handler}, progress_seconds=0.5):
        good = await submit(api, "script", {"steps": 3, "pause": 0.6})
        done = await eventually(lambda: job_in(api, good["id"], "complete", "failed"), timeout=20)
        assert (done["status"], done["result"]) == ("complete", {"squares": [0, 1, 4]})
        progress = [e["data"].get("progress") for e in await job_events(api, good["id"]) if e["type"] == "job.lease_renewed"]
        assert {"fraction": 1 / 3, "message": "step 1 of 3"} in progress or {"fraction": 2 / 3, "message": "step 2 of 3"} in progress, progress
        again = await submit(api, "script", {"steps": 1, "pause": 0, "fail": 75}, max_attempts=2)
        bad = await submit(api, "script", {"steps": 1, "pause": 0, "fail": 3})
        ended = await eventually(lambda: job_in(api, bad["id"], "failed"), timeout=20)
        assert ended["error"].endswith("exited with status 3: out of memory"), ended["error"]
        retried = await eventually(lambda: job_in(api, again["id"], "failed"), timeout=30)
        assert retried["attempt"] == 2 and "exited with status 75" in retried["error"]
        assert "job.requeued" in await event_types(api, again["id"])


async def test_a_cancelled_job_s_program_is_stopped(server, api, tmp_path):
    """The job cancelled while its program runs: the agent learns at its next renewal and the program is gone
    (SIGTERM) before the slot takes other work."""
    paired = await pair(server, api, "scripts-2")
    pid_file = tmp_path / "pid"
    handler = CommandHandler([sys.executable, "-c", f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                              "time.sleep(120)"])  # fmt: skip
    async with running_agent(server, paired["credential"], handlers={"script": handler}) as agent:
        job = await submit(api, "script")
        await eventually(lambda: _exists(pid_file), timeout=15)
        assert (await api.post(f"/v1/jobs/{job['id']}/cancel")).status_code == 200
        pid = int(pid_file.read_text())
        await eventually(lambda: _gone(pid), timeout=15)
        await eventually(lambda: _outcome(agent), timeout=15)


SLEEPER = "import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(120)"


@contextlib.asynccontextmanager
async def _sleeping(server, api, tmp_path, name: str, *, max_attempts: int):
    """An agent on a node ``name`` whose job's program has started and sleeps: ``(agent, job, program's pid)``."""
    paired = await pair(server, api, name)
    pid_file = tmp_path / "pid"
    handler = CommandHandler([sys.executable, "-c", SLEEPER, str(pid_file)])
    async with running_agent(server, paired["credential"], handlers={"script": handler}) as agent:
        job = await submit(api, "script", max_attempts=max_attempts)
        await eventually(lambda: _exists(pid_file), timeout=15)
        yield agent, job, int(pid_file.read_text())


async def test_a_program_stopped_with_its_agent_by_a_service_manager_is_given_back(server, api, tmp_path):
    """A service manager stopping the agent's service (systemd's default) signals every process of it at
    once: the program ends by that SIGTERM as the agent begins to stop. The job was interrupted, not failed:
    it is given back, uncharged, as one past the stop's grace is, rather than failed for good."""
    async with _sleeping(server, api, tmp_path, "scripts-managed", max_attempts=1) as (agent, job, pid):
        os.killpg(pid, signal.SIGTERM)
        agent.stop()
        await eventually(lambda: _outcome(agent), timeout=15)
    assert [o.status for o in agent.outcomes] == ["released"], agent.outcomes
    back = (await api.get(f"/v1/jobs/{job['id']}")).json()
    assert back["status"] == "queued", back
    assert [(e["type"], e["data"].get("reason")) for e in await job_events(api, job["id"])][-1] == ("job.released", "agent_stopping")


async def test_a_program_stopped_from_outside_is_retried_not_failed_for_good(server, api, tmp_path):
    """Someone else's SIGTERM (an operator, a service manager) says nothing of the job: it is retried."""
    async with _sleeping(server, api, tmp_path, "scripts-interrupted", max_attempts=2) as (agent, job, pid):
        os.killpg(pid, signal.SIGTERM)
        await eventually(lambda: _outcome(agent), timeout=15)
        assert agent.outcomes[0].status == "retrying", agent.outcomes
    assert "job.requeued" in await event_types(api, job["id"])


async def _exists(path) -> bool:
    return path.exists() and path.read_text() != ""


async def _gone(pid: int) -> bool:
    return not _alive(pid)


async def _outcome(agent) -> bool:
    return bool(agent.outcomes)


async def test_ctrl_c_in_the_agent_s_terminal_lets_the_running_program_finish(server, api, tmp_path):
    """A terminal's Ctrl-C signals its foreground process group: the agent's. The program, in a session of its
    own, runs on; the agent stops gracefully (``--grace``) and the job completes with the program's result."""
    import signal
    import subprocess

    import anyio

    from tests.helpers import sighup_at_default

    from .test_agent_process import DEVICE, ROOT, _paired_file

    credential_file, _ = await _paired_file(server, api, tmp_path, "scripts-ctrl-c")
    script = tmp_path / "job.py"
    script.write_text("import json, sys, time\njson.load(sys.stdin)\ntime.sleep(3)\nprint(json.dumps({'done': True}))\n")
    command = [sys.executable, "-m", "umbra.cli", "agent", "--claim-wait", "1", "--device", DEVICE,
               "--credential-file", str(credential_file), "--grace", "20", "--command", f"work={sys.executable} {script}"]
    with sighup_at_default():
        agent = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                                 start_new_session=True)  # its own process group, as a shell's job is
    try:
        job = await submit(api, "work")
        await eventually(lambda: job_in(api, job["id"], "running"), timeout=15)
        await anyio.sleep(1.0)  # the program runs
        os.killpg(agent.pid, signal.SIGINT)
        with anyio.fail_after(20):
            while agent.poll() is None:
                await anyio.sleep(0.1)
        ended = await eventually(lambda: job_in(api, job["id"], "complete", "failed", "queued"), timeout=10)
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.wait()
    assert (ended["status"], ended.get("result")) == ("complete", {"done": True}), (ended["status"], ended.get("error"))


async def test_an_immediate_stop_gives_the_job_back_within_the_program_s_short_grace(server, api):
    """A second SIGTERM gives the running jobs up at once: a program ignoring SIGTERM is killed after
    ``TERMINATE_GRACE_SECONDS`` (3 s), and the job is given back then, not after a lease."""
    import time

    import anyio

    from umbra.agent.commands import TERMINATE_GRACE_SECONDS

    paired = await pair(server, api, "scripts-stop")
    handler = CommandHandler([sys.executable, "-c", "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                              "time.sleep(60)"])  # fmt: skip
    async with running_agent(server, paired["credential"], handlers={"stubborn": handler}, grace_seconds=0.5) as agent:
        job = await submit(api, "stubborn")
        await eventually(lambda: job_in(api, job["id"], "running"), timeout=10)
        await anyio.sleep(0.5)
        stopped_at = time.monotonic()
        agent.stop(immediately=True)
        await eventually(lambda: _outcome(agent), timeout=TERMINATE_GRACE_SECONDS + 8)
        took = time.monotonic() - stopped_at
    assert agent.outcomes[0].status == "released" and took < TERMINATE_GRACE_SECONDS + 2, (agent.outcomes, took)


async def test_a_program_s_numbers_reach_its_result_as_the_numbers_it_wrote(server, api):
    """Its JSON output is read exactly (decimals): those must be sent as JSON numbers, not as the strings
    msgspec writes of a ``Decimal`` by default (``{"loss": "0.5"}`` was stored)."""
    paired = await pair(server, api, "scripts-numbers")
    handler = CommandHandler([sys.executable, "-c", "print('{\"loss\": 0.5, \"exact\": 0.10000000000000000001, \"n\": 3}')"])
    async with running_agent(server, paired["credential"], handlers={"script": handler}):
        job = await submit(api, "script")
        await eventually(lambda: job_in(api, job["id"], "complete", "failed"), timeout=20)
    done = json.loads((await api.get(f"/v1/jobs/{job['id']}")).text, parse_float=Decimal)
    assert done["status"] == "complete", done
    assert done["result"] == {"loss": Decimal("0.5"), "exact": Decimal("0.10000000000000000001"), "n": 3}, done["result"]


async def test_a_program_reads_the_payload_s_numbers_as_the_submitter_wrote_them(server, api):
    """Its standard input is the payload as the submitter wrote it: read as Python's floats on the way, a number
    of more than 17 digits reached the program rounded (``0.1``)."""
    paired = await pair(server, api, "scripts-payload")
    handler = CommandHandler([sys.executable, "-c", "import sys; sys.stdout.write(sys.stdin.read())"])
    async with running_agent(server, paired["credential"], handlers={"script": handler}):
        job = (await api.post("/v1/jobs", content=b'{"kind": "script", "payload": {"x": 0.10000000000000000001, "big": 1e400}}',
                              headers={"Content-Type": "application/json"})).json()
        await eventually(lambda: job_in(api, job["id"], "complete", "failed"), timeout=20)
    done = json.loads((await api.get(f"/v1/jobs/{job['id']}")).text, parse_float=Decimal)
    assert done["result"] == {"x": Decimal("0.10000000000000000001"), "big": Decimal("1e400")}, done["result"]
