"""Chaos: real processes killed at random while jobs flow; then prove nothing was lost or done twice.

    python -m bench.chaos [--jobs 10000] [--agents 8] [--server-kills 2] [--time-limit 900]

Everything runs on this machine (loopback only) against a scratch database:

* one ``umbra serve`` process (short leases, a fast sweeper), ``kill -9``'d
  and restarted ``--server-kills`` times as the work progresses;
* ``--agents`` ``umbra agent`` processes with the built-in ``echo`` and
  ``sleep`` handlers, ``kill -9``'d at random (about every
  ``--agent-kill-interval`` seconds) and restarted, reusing their credential;
* the server's LISTEN connection terminated once with ``pg_terminate_backend``
  (found in ``pg_stat_activity`` by its application name);
* a submitter posting batches with idempotency keys, retrying through the
  server's deaths, and a tailer paging ``/v1/events`` while all this happens.

At the end every acknowledged job must exist and be terminal, no job may be
claimed while held or completed twice, attempts must follow one another
(:func:`bench.double_claims.audit_log`), ``umbra verify`` must exit 0, and the
event log read over HTTP — both by the tailer during the run and afresh from 0
— must equal a direct read of the table, positions strictly increasing. One
summary line is printed; the exit status is 1 on any violation.
"""

from __future__ import annotations

import abc

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import UUID

import anyio
import httpx
import psycopg

from umbra.compute.accounts import create_organization
from umbra.compute.pairing import issue_pairing_code
from umbra.events.listener import APPLICATION_NAME as LISTENER_NAME
from umbra.events.types import TERMINAL_JOB_STATUSES
from umbra.settings import CHEAP_HASHING_VARIABLE

from .double_claims import audit_log

ROOT = Path(__file__).resolve().parents[1]
DEVICE = json.dumps({"kind": "cpu", "label": "cpu0", "ram_total_mb": 16384, "ram_free_mb": 16000})


@dataclass
class ChaosConfig:
    jobs: int = 10_000
    agents: int = 8
    server_kills: int = 2
    #: Mean seconds between two agent kills (exponentially distributed).
    agent_kill_interval: float = 1.5
    lease_seconds: int = 5
    #: Attempts per job: enough that jobs survive their agents being killed.
    max_attempts: int = 10
    #: Share of ``sleep`` jobs (10..100 ms); the rest are ``echo``.
    sleep_share: float = 0.2
    batch: int = 500
    time_limit: float = 900.0
    seed: int = 1
    work_dir: Path | None = None


@dataclass
class ChaosReport:
    jobs: int = 0
    acknowledged: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    claims: int = 0
    completions: int = 0
    agent_kills: int = 0
    server_kills: int = 0
    listener_kills: int = 0
    listener_reconnected: bool = False
    events: int = 0
    seconds: float = 0.0
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def line(self) -> str:
        states = ", ".join(f"{s} {n}" for s, n in sorted(self.statuses.items()))
        verdict = "OK" if self.ok else f"{len(self.violations)} VIOLATION(S)"
        return (f"chaos: {self.acknowledged} jobs acknowledged, {self.jobs} stored ({states}); {self.claims} claims, "
                f"{self.completions} completions; agents killed {self.agent_kills}x, server killed {self.server_kills}x, "
                f"listener terminated {self.listener_kills}x; {self.events} events read gap-free; "
                f"{self.seconds:.0f} s: {verdict}")  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _base_env(work: Path) -> dict[str, str]:
    """The caller's environment without its UMBRA_ settings, but with its hashing profile: a pairing code is
    found by its hash, so the processes issuing and redeeming it must hash with the same one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UMBRA_") or k == CHEAP_HASHING_VARIABLE}
    env["UMBRA_DATA_DIR"] = str(work / "data")
    return env


class Process(abc.ABC):
    """A child process we start, kill with SIGKILL by its pid, and start again; output to a file."""

    def __init__(self, name: str, work: Path, env: dict[str, str]) -> None:
        self.name = name
        self.env = env
        self.log_path = work / f"{name}.log"
        self.popen: subprocess.Popen | None = None
        self.starts = 0

    @abc.abstractmethod
    def argv(self) -> list[str]:
        """The command line that starts this process."""

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(self.argv(), env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                          stdin=subprocess.DEVNULL)  # fmt: skip
        self.starts += 1

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    async def kill9(self) -> None:
        if self.alive:
            os.kill(self.popen.pid, signal.SIGKILL)
        await self.wait(10)

    async def stop(self, timeout: float = 15) -> None:
        if self.alive:
            self.popen.send_signal(signal.SIGTERM)
            with anyio.move_on_after(timeout):
                await self.wait(timeout)
        if self.alive:
            await self.kill9()

    async def wait(self, timeout: float) -> None:
        with anyio.fail_after(timeout):
            while self.popen is not None and self.popen.poll() is None:
                await anyio.sleep(0.02)


class Server(Process):
    def __init__(self, work: Path, url: str, config: ChaosConfig) -> None:
        env = {**_base_env(work), "UMBRA_DATABASE_URL": url, "UMBRA_LEASE_SECONDS": str(config.lease_seconds),
               "UMBRA_SWEEP_INTERVAL_SECONDS": "0.2", "UMBRA_LEASE_EXPIRED_DELAY_SECONDS": "1",
               "UMBRA_HEARTBEAT_INTERVAL_SECONDS": "1", "UMBRA_POLL_FALLBACK_SECONDS": "0.5",
               "UMBRA_LOG_LEVEL": "WARNING"}  # fmt: skip
        super().__init__("server", work, env)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "umbra.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)]

    async def ready(self, timeout: float = 60) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=2) as client:
            with anyio.fail_after(timeout):
                while True:
                    if not self.alive:
                        raise RuntimeError(f"umbra serve exited; see {self.log_path}")
                    try:
                        if (await client.get("/readyz")).status_code == 200:
                            return
                    except httpx.HTTPError:
                        pass
                    await anyio.sleep(0.1)


class Agent(Process):
    def __init__(self, work: Path, index: int, server: Server, code: str) -> None:
        super().__init__(f"agent-{index}", work, _base_env(work))
        self.server = server
        self.code = code
        self.credential = work / f"agent-{index}.credential.json"

    def argv(self) -> list[str]:
        pairing = [] if self.credential.exists() else ["--code", self.code, "--name", self.name]
        return [sys.executable, "-m", "umbra.cli", "agent", "--server", self.server.url, *pairing,
                "--credential-file", str(self.credential), "--device", DEVICE, "--claim-wait", "2",
                "--grace", "0", "--heartbeat", "1", "--log-level", "WARNING"]  # fmt: skip

    @property
    def paired(self) -> bool:
        return self.credential.exists()


class Run:
    """One chaos run's shared state."""

    def __init__(self, url: str, config: ChaosConfig, work: Path) -> None:
        self.url = url
        self.config = config
        self.work = work
        self.rng = random.Random(config.seed)
        self.report = ChaosReport()
        self.server = Server(work, url, config)
        self.agents: list[Agent] = []
        self.api_key = ""
        self.organization: UUID | None = None
        self.acknowledged: dict[str, str] = {}
        self.submitted = anyio.Event()
        self.done = anyio.Event()
        self.quiet = anyio.Event()
        self.tailed: list[int] = []

    async def db(self) -> psycopg.AsyncConnection:
        return await psycopg.AsyncConnection.connect(self.url, autocommit=True)

    def violation(self, text: str) -> None:
        self.report.violations.append(text)

    # -- actors ----------------------------------------------------------------------

    async def submit(self) -> None:
        """Submit every job in batches with idempotency keys, retrying through server deaths."""
        cfg = self.config
        headers = {"Authorization": f"Bearer {self.api_key}"}
        async with httpx.AsyncClient(base_url=self.server.url, headers=headers, timeout=30) as client:
            for start in range(0, cfg.jobs, cfg.batch):
                keys = [f"chaos-{i}" for i in range(start, min(cfg.jobs, start + cfg.batch))]
                body = {"jobs": [self._job(key) for key in keys]}
                while not self.done.is_set():
                    try:
                        answer = await client.post("/v1/jobs/batch", json=body)
                    except httpx.HTTPError:
                        await anyio.sleep(0.2)
                        continue
                    if answer.status_code in (200, 201):
                        for key, job in zip(keys, answer.json()["jobs"]):
                            if self.acknowledged.setdefault(key, job["id"]) != job["id"]:
                                self.violation(f"{key} acknowledged as two jobs: {self.acknowledged[key]} and {job['id']}")
                        break
                    if answer.status_code < 500 and answer.status_code != 429:
                        self.violation(f"batch from {start} refused: {answer.status_code} {answer.text[:200]}")
                        break
                    await anyio.sleep(0.2)
        self.report.acknowledged = len(self.acknowledged)
        self.submitted.set()

    def _job(self, key: str) -> dict[str, Any]:
        if self.rng.random() < self.config.sleep_share:
            kind, payload = "sleep", {"seconds": round(self.rng.uniform(0.01, 0.1), 3)}
        else:
            kind, payload = "echo", {"key": key}
        return {"kind": kind, "payload": payload, "idempotency_key": key, "max_attempts": self.config.max_attempts}

    async def tail(self) -> None:
        """Page the organization's events as they are appended; positions must only ever grow."""
        after = 0
        headers = {"Authorization": f"Bearer {self.api_key}"}
        async with httpx.AsyncClient(base_url=self.server.url, headers=headers, timeout=10) as client:
            while True:
                quiet = self.quiet.is_set()
                try:
                    answer = await client.get("/v1/events", params={"after": after, "limit": 1000})
                except httpx.HTTPError:
                    await anyio.sleep(0.1)
                    continue
                if answer.status_code != 200:
                    await anyio.sleep(0.1)
                    continue
                page = [event["position"] for event in answer.json()["events"]]
                for position in page:
                    if position <= after:
                        self.violation(f"tailer read position {position} after {after}")
                    after = position
                self.tailed += page
                if not page:
                    if quiet:
                        return
                    await anyio.sleep(0.05)

    async def kill_agents(self) -> None:
        """Kill a random paired agent every so often (SIGKILL), and start it again shortly after."""
        while not self.done.is_set():
            with anyio.move_on_after(self.rng.expovariate(1 / self.config.agent_kill_interval)):
                await self.done.wait()
            if self.done.is_set():
                return
            victims = [a for a in self.agents if a.alive and a.paired]
            if not victims:
                continue
            agent = self.rng.choice(victims)
            await agent.kill9()
            self.report.agent_kills += 1
            await anyio.sleep(self.rng.uniform(0.05, 0.8))
            agent.start()

    async def conduct(self) -> None:
        """Kill the server as the work passes set fractions, the listener once, and end when all is terminal."""
        cfg = self.config
        kills = [(i + 1) / (cfg.server_kills + 1) for i in range(cfg.server_kills)]
        listener_at = (kills[0] + (kills[1] if len(kills) > 1 else 1.0)) / 2 if kills else 0.5
        deadline = time.monotonic() + cfg.time_limit
        async with await self.db() as conn:
            while time.monotonic() < deadline:
                terminal = (await (await conn.execute(
                    "SELECT count(*) FROM jobs WHERE organization_id = %s AND status = ANY(%s)",
                    (self.organization, list(TERMINAL_JOB_STATUSES)))).fetchone())[0]  # fmt: skip
                progress = terminal / cfg.jobs
                if kills and progress >= kills[0]:
                    kills.pop(0)
                    await self.server.kill9()
                    self.report.server_kills += 1
                    await anyio.sleep(self.rng.uniform(0.2, 1.0))
                    self.server.start()
                    await self.server.ready()
                elif self.report.listener_kills == 0 and progress >= listener_at:
                    await self._terminate_listener(conn)
                if self.submitted.is_set() and terminal >= self.report.acknowledged:
                    break
                await anyio.sleep(0.25)
            else:
                self.violation(f"not every job was terminal within {cfg.time_limit:.0f} s")
        self.done.set()

    async def _terminate_listener(self, conn: psycopg.AsyncConnection) -> None:
        find = ("SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name = %s"
                " AND pid <> pg_backend_pid()")  # fmt: skip
        pids = [pid for (pid,) in await (await conn.execute(find, (LISTENER_NAME,))).fetchall()]
        if len(pids) != 1:
            return  # the server is (re)starting; try on the next tick
        await conn.execute("SELECT pg_terminate_backend(%s)", (pids[0],))
        self.report.listener_kills += 1
        with anyio.move_on_after(30):
            while True:
                again = [pid for (pid,) in await (await conn.execute(find, (LISTENER_NAME,))).fetchall()]
                if again and pids[0] not in again:
                    self.report.listener_reconnected = True
                    return
                await anyio.sleep(0.1)

    # -- the run ---------------------------------------------------------------------

    async def setup(self) -> None:
        async with await self.db() as conn:
            self.organization, self.api_key = await create_organization(conn, "chaos")
            for i in range(self.config.agents):
                issued = await issue_pairing_code(conn, self.organization, f"agent-{i}", ttl_seconds=1800)
                self.agents.append(Agent(self.work, i, self.server, issued.code))
        self.server.start()
        await self.server.ready()
        for agent in self.agents:
            agent.start()
        async with await self.db() as conn:
            with anyio.fail_after(60):
                while (await (await conn.execute(
                        "SELECT count(*) FROM nodes WHERE organization_id = %s AND status = 'online'",
                        (self.organization,))).fetchone())[0] < len(self.agents):  # fmt: skip
                    await anyio.sleep(0.1)

    async def execute(self) -> None:
        started = time.monotonic()
        await self.setup()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.tail)
                tg.start_soon(self.kill_agents)
                tg.start_soon(self.submit)
                await self.conduct()
                for agent in self.agents:
                    await agent.stop()
                if not self.server.alive:
                    self.server.start()
                    await self.server.ready()
                self.quiet.set()
            await self.check()
        finally:
            for agent in self.agents:
                await agent.stop(5)
            await self.server.stop()
        self.report.seconds = time.monotonic() - started

    async def check(self) -> None:
        report = self.report
        async with await self.db() as conn:
            rows = await (await conn.execute(
                "SELECT id::text, idempotency_key, status FROM jobs WHERE organization_id = %s",
                (self.organization,))).fetchall()  # fmt: skip
            stored = {key: (job_id, status) for job_id, key, status in rows}
            report.jobs = len(rows)
            report.statuses = dict(sorted(Counter(status for *_, status in rows).items()))
            lost = [key for key, job_id in self.acknowledged.items() if stored.get(key, (None,))[0] != job_id]
            if lost:
                self.violation(f"{len(lost)} acknowledged job(s) lost, e.g. {lost[:3]}")
            if len(self.acknowledged) != self.config.jobs:
                self.violation(f"only {len(self.acknowledged)} of {self.config.jobs} jobs were acknowledged")
            unfinished = [key for key, (_, status) in stored.items() if status not in TERMINAL_JOB_STATUSES]
            if unfinished:
                self.violation(f"{len(unfinished)} job(s) not terminal, e.g. {unfinished[:3]}")
            audit = await audit_log(conn)
            report.claims, report.completions = audit.claims, audit.completions
            self.report.violations += audit.violations[:50]
            direct = await self._positions(conn)
        # The tailer stopped at its first empty page after the run went quiet; anything the
        # still-running server appended after that is beyond its end, never in the middle.
        if direct[: len(self.tailed)] != self.tailed:
            missing = sorted(set(direct[: len(self.tailed)]) - set(self.tailed))[:5]
            self.violation(f"the tailer read {len(self.tailed)} events, the table holds {len(direct)}; missing e.g. {missing}")
        fresh = await self._read_all()
        async with await self.db() as conn:
            later = await self._positions(conn)
        # The server still runs while we read (its sweeper may record a node going offline),
        # so the log may grow between the reads: the API's answer must lie between the two.
        if fresh[: len(direct)] != direct or later[: len(fresh)] != fresh:
            self.violation(f"a fresh read of /v1/events gave {len(fresh)} events, the table holds {len(direct)} then {len(later)}")
        if any(b <= a for a, b in zip(fresh, fresh[1:])):
            self.violation("positions from /v1/events are not strictly increasing")
        report.events = len(direct)
        verify = await anyio.run_process([sys.executable, "-m", "umbra.cli", "verify"], check=False, cwd=ROOT,
                                         env={**_base_env(self.work), "UMBRA_DATABASE_URL": self.url})  # fmt: skip
        if verify.returncode != 0:
            self.violation(f"umbra verify exited {verify.returncode}: {verify.stdout.decode()[-500:]}")
        if report.listener_kills and not report.listener_reconnected:
            self.violation("the listener did not reconnect after pg_terminate_backend")

    async def _positions(self, conn) -> list[int]:
        rows = await (await conn.execute(
            "SELECT position FROM events WHERE organization_id = %s ORDER BY position", (self.organization,))).fetchall()  # fmt: skip
        return [position for (position,) in rows]

    async def _read_all(self) -> list[int]:
        positions, after = [], 0
        async with httpx.AsyncClient(base_url=self.server.url, headers={"Authorization": f"Bearer {self.api_key}"},
                                     timeout=30) as client:  # fmt: skip
            while True:
                page = (await client.get("/v1/events", params={"after": after, "limit": 1000})).json()
                if not page["events"]:
                    return positions
                positions += [event["position"] for event in page["events"]]
                after = page["next"]


async def run(url: str, config: ChaosConfig) -> ChaosReport:
    """One chaos run against the migrated database at ``url``."""
    work = config.work_dir or Path(tempfile.mkdtemp(prefix="umbra-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    chaos = Run(url, config, work)
    await chaos.execute()
    return chaos.report


def main(argv: list[str] | None = None) -> int:
    from .common import scratch_database, write_json

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--server-kills", type=int, default=2)
    parser.add_argument("--agent-kill-interval", type=float, default=1.5, help="mean seconds between agent kills")
    parser.add_argument("--lease-seconds", type=int, default=5)
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds for every job to end")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--work-dir", type=Path, default=None, help="process logs and credentials (default: a temp dir)")
    args = parser.parse_args(argv)
    config = ChaosConfig(jobs=args.jobs, agents=args.agents, server_kills=args.server_kills,
                         agent_kill_interval=args.agent_kill_interval, lease_seconds=args.lease_seconds,
                         time_limit=args.time_limit, seed=args.seed, work_dir=args.work_dir)  # fmt: skip
    with scratch_database("umbra_chaos") as url:
        report = anyio.run(run, url, config)
    print(report.line())
    for violation in report.violations[:30]:
        print(f"  {violation}", file=sys.stderr)
    write_json("chaos", {"config": {k: v for k, v in vars(config).items() if k != "work_dir"},
                         "report": {k: v for k, v in vars(report).items() if k != "violations"},
                         "violations": report.violations[:30]})  # fmt: skip
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
