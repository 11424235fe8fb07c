"""Double claims under load: many agents claiming in-process, with the sweeper racing them.

    python -m bench.double_claims [--claims 100000] [--agents 16] [--nodes 16]

Agents call :mod:`umbra.compute.claims` directly (in-process, one database
connection each, no HTTP), so the claim statement and the sweeper are what is
measured. Each claimed job is, by chance: completed at once (most); failed as
retryable (requeued with backoff); abandoned (never reported, so the sweeper
expires its lease and another agent claims it again); or completed *late*,
after its lease ran out, racing the sweeper for the fenced answer.

The run ends when every job is terminal. It then audits the log
(:func:`audit_log`): no job is ever claimed while another claim of it is
held, attempts grow by one per claim, every renew/complete/fail names the
attempt held, no job completes twice, and ``verify`` finds the views equal to
the log. It prints one summary line and exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable
from uuid import UUID

import anyio
import msgspec
import psycopg

from umbra.compute import claims, jobs
from umbra.compute.accounts import create_organization
from umbra.compute.heartbeat import heartbeat
from umbra.compute.jobs import JobRequest
from umbra.compute.pairing import issue_pairing_code, redeem_pairing_code
from umbra.compute.sweeper import sweep_once
from umbra.domain.heartbeat import HeartbeatReport
from umbra.errors import Conflict
from umbra.events.types import TERMINAL_JOB_STATUSES, Device
from umbra.projections.verify import verify
from umbra.settings import load_settings

#: Lease granted per claim: short, so abandoned and late jobs exercise the sweeper.
LEASE_SECONDS = 2
#: Attempts per job: a second failure or abandonment ends it, which bounds the run's tail.
MAX_ATTEMPTS = 2
CPU = Device(kind="cpu", label="cpu0", ram_total_mb=65536, ram_free_mb=60000)

# -- the audit -----------------------------------------------------------------------

#: Events that end the holder's claim, and whether they must name the held attempt.
_ENDS_HOLD = {"job.completed", "job.requeued", "job.lease_expired", "job.released", "job.decomposed"}


@dataclass
class Audit:
    """What the log says happened to every job, and every rule it broke."""

    jobs: int = 0
    claims: int = 0
    completions: int = 0
    statuses: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def line(self) -> str:
        states = ", ".join(f"{status} {n}" for status, n in sorted(self.statuses.items()))
        verdict = "OK" if self.ok else f"{len(self.violations)} VIOLATION(S)"
        return f"{self.jobs} jobs, {self.claims} claims, {self.completions} completions ({states}): {verdict}"


_JOB_EVENTS = """
SELECT stream, type, (data->>'attempt')::int, coalesce(data->>'outcome', data->>'reason'), (data->>'requeued')::boolean
FROM events WHERE stream LIKE 'job:%%' ORDER BY stream, version
"""


def audit_streams(rows: Iterable[tuple[str, str, int | None, str | None, bool | None]]) -> Audit:
    """Walk each job stream (rows in stream, version order) and check the holding rules."""
    audit = Audit()
    stream: str | None = None
    held: int | None = None
    attempt = completed = 0
    status = "queued"

    def close() -> None:
        if stream is None:
            return
        audit.jobs += 1
        audit.statuses[status] += 1
        if completed > 1:
            audit.violations.append(f"{stream}: completed {completed} times")

    for name, kind, n, reason, requeued in rows:
        if name != stream:
            close()
            stream, held, attempt, completed, status = name, None, 0, 0, "queued"
        problem = None
        if kind == "job.claimed":
            audit.claims += 1
            if held is not None:
                problem = f"claimed at attempt {n} while attempt {held} was held (double claim)"
            elif status in TERMINAL_JOB_STATUSES:
                problem = f"claimed after it ended {status}"
            elif n != attempt + 1:
                problem = f"claim attempt {n} does not follow {attempt}"
            held, attempt, status = n, n, "running"
        elif kind == "job.lease_renewed":
            if held != n:
                problem = f"renewed attempt {n} while holding {held}"
        elif kind in _ENDS_HOLD or (kind == "job.failed" and reason != "blocked_timeout"):
            if held != n:
                problem = f"{kind} names attempt {n} but {held} was held"
            held = None
            if kind == "job.completed":
                completed += 1
                audit.completions += 1
                status = "complete"
            elif kind == "job.failed" or (kind == "job.lease_expired" and requeued is False):
                status = "failed"
            elif kind == "job.decomposed":
                status = "running"  # a container until its children settle it
            else:
                status = "queued"
        elif kind == "job.failed":  # blocked past its timeout: nobody held it
            held, status = None, "failed"
        elif kind == "job.cancelled":
            held, status = None, "cancelled"
        elif kind == "job.settled":
            status = reason or "complete"
        elif kind == "job.blocked":
            status = "blocked"
        elif kind == "job.unblocked":
            status = "queued"
        if problem:
            audit.violations.append(f"{stream}: {problem}")
    close()
    return audit


async def audit_log(conn: psycopg.AsyncConnection) -> Audit:
    """Audit every job stream in the database, then ``verify`` the views against the log."""
    rows = await (await conn.execute(_JOB_EVENTS)).fetchall()
    audit = audit_streams(rows)
    live = dict(await (await conn.execute("SELECT status, count(*) FROM jobs GROUP BY status")).fetchall())
    if live != dict(audit.statuses):
        audit.violations.append(f"job statuses in the table {live} differ from the log's {dict(audit.statuses)}")
    for difference in await verify(conn):
        audit.violations.append(f"verify: {difference}")
    return audit


# -- the load --------------------------------------------------------------------------


@dataclass
class Mix:
    """Chances for what an agent does with a claimed job (the rest complete at once)."""

    fail: float = 0.02
    abandon: float = 0.03
    late: float = 0.02


@dataclass
class Tally:
    claims: int = 0
    completed: int = 0
    refused_late: int = 0
    #: (job id, attempt) of every claim this process received.
    seen: set = field(default_factory=set)
    doubles: list[str] = field(default_factory=list)


async def _setup(url: str, node_count: int, job_count: int) -> tuple[UUID, list[UUID]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        org, _ = await create_organization(conn, "double-claims")
        nodes = []
        for i in range(node_count):
            issued = await issue_pairing_code(conn, org, f"agent-{i}")
            node = (await redeem_pairing_code(conn, code=issued.code, name=f"agent-{i}", source="bench", devices=[CPU])).node_id
            await heartbeat(conn, org, node, HeartbeatReport(devices=(CPU,)), event_interval_seconds=3600)
            nodes.append(node)
        spec = msgspec.convert({"kind": "echo", "max_attempts": MAX_ATTEMPTS}, JobRequest)
        for start in range(0, job_count, 5000):
            await jobs.submit(conn, org, [spec] * min(5000, job_count - start), actor="bench", batch=True)
    return org, nodes


async def _agent(url: str, org: UUID, node: UUID, mix: Mix, tally: Tally, done: anyio.Event, seed: int) -> None:
    rng = random.Random(seed)
    late: list[tuple[float, claims.ClaimResult]] = []
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        while not done.is_set() or late:
            now = time.monotonic()
            for due, held in [item for item in late if item[0] <= now]:
                late.remove((due, held))
                await _report(conn, org, node, held, tally, late=True)
            got = None if done.is_set() else await claims.claim(
                conn, node_id=node, organization_id=org, lease_seconds=LEASE_SECONDS, stale_seconds=86_400)
            if got is None:
                await anyio.sleep(0.05)
                continue
            tally.claims += 1
            if (got.job_id, got.attempt) in tally.seen:
                tally.doubles.append(f"{got.job_id} attempt {got.attempt} handed out twice")
            tally.seen.add((got.job_id, got.attempt))
            roll = rng.random()
            if roll < mix.fail:
                await claims.fail(conn, organization_id=org, node_id=node, job_id=got.job_id, attempt=got.attempt,
                                  error="transient", retry=True)  # fmt: skip
            elif roll < mix.fail + mix.abandon:
                pass  # the holder "dies": only the sweeper can give the job back
            elif roll < mix.fail + mix.abandon + mix.late:
                late.append((time.monotonic() + LEASE_SECONDS + rng.uniform(0.0, 0.4), got))
            else:
                await _report(conn, org, node, got, tally, late=False)


async def _report(conn, org: UUID, node: UUID, held: claims.ClaimResult, tally: Tally, *, late: bool) -> None:
    try:
        await claims.complete(conn, organization_id=org, node_id=node, job_id=held.job_id, attempt=held.attempt,
                              result={"ok": True})  # fmt: skip
        tally.completed += 1
    except Conflict as exc:
        if not late or exc.code != "job_not_claimed_by_this_node":
            raise
        tally.refused_late += 1


async def _sweeper(url: str, done: anyio.Event) -> None:
    settings = load_settings({"UMBRA_LEASE_EXPIRED_DELAY_SECONDS": "0", "UMBRA_HEARTBEAT_STALE_SECONDS": "86400"})
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        while not done.is_set():
            await sweep_once(conn, settings)
            await anyio.sleep(0.2)


async def _until_all_terminal(url: str, done: anyio.Event, deadline: float) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        while True:
            open_jobs = (await (await conn.execute(
                "SELECT count(*) FROM jobs WHERE status <> ALL(%s)", (sorted(TERMINAL_JOB_STATUSES),))).fetchone())[0]  # fmt: skip
            if open_jobs == 0 or time.monotonic() > deadline:
                done.set()
                return
            await anyio.sleep(0.25)


async def run(url: str, *, claims_wanted: int, agents: int, nodes: int, mix: Mix, seed: int = 1,
              time_limit: float = 900.0) -> tuple[Audit, Tally, float]:  # fmt: skip
    """Drive the load on a migrated database at ``url``; returns the audit, the tally and the seconds taken."""
    # Failed and abandoned first attempts are claimed again; a late one only when the sweep wins,
    # so it is not counted on: the run makes at least about ``claims_wanted`` claims.
    expected_per_job = 1 + mix.fail + mix.abandon
    org, node_ids = await _setup(url, nodes, max(1, math.ceil(claims_wanted / expected_per_job)))
    tally = Tally()
    done = anyio.Event()
    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_sweeper, url, done)
        tg.start_soon(_until_all_terminal, url, done, started + time_limit)
        for i in range(agents):
            tg.start_soon(_agent, url, org, node_ids[i % len(node_ids)], mix, tally, done, seed * 1000 + i)
    elapsed = time.monotonic() - started
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        audit = await audit_log(conn)
    audit.violations[:0] = tally.doubles
    if audit.claims != tally.claims:
        audit.violations.append(f"agents received {tally.claims} claims but the log records {audit.claims}")
    if audit.completions != tally.completed:
        audit.violations.append(f"{tally.completed} completions acknowledged but the log records {audit.completions}")
    unfinished = sum(n for s, n in audit.statuses.items() if s not in TERMINAL_JOB_STATUSES)
    if unfinished:
        audit.violations.append(f"{unfinished} job(s) not terminal within {time_limit:.0f} s")
    return audit, tally, elapsed


def main(argv: list[str] | None = None) -> int:
    from .common import scratch_database, write_json

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--claims", type=int, default=100_000, help="claims to make, at least about (default 100,000)")
    parser.add_argument("--agents", type=int, default=16, help="concurrent claimers (default 16)")
    parser.add_argument("--nodes", type=int, default=16, help="nodes they claim as (default 16)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    with scratch_database("umbra_claims") as url:
        audit, tally, elapsed = anyio.run(lambda: run(url, claims_wanted=args.claims, agents=args.agents,
                                                      nodes=args.nodes, mix=Mix(), seed=args.seed))  # fmt: skip
    doubles = sum(1 for v in audit.violations if "double claim" in v or "handed out twice" in v)
    print(f"double_claims (in-process compute.claims, {args.agents} agents, {args.nodes} nodes): {audit.line()}; "
          f"{doubles} double claims, {tally.refused_late} late completions refused, "
          f"{tally.claims / elapsed:,.0f} claims/s over {elapsed:.1f} s")  # fmt: skip
    for violation in audit.violations[:20]:
        print(f"  {violation}", file=sys.stderr)
    write_json("double_claims", {"agents": args.agents, "nodes": args.nodes, "claims": audit.claims, "jobs": audit.jobs,
                                 "completions": audit.completions, "double_claims": doubles,
                                 "late_refused": tally.refused_late, "seconds": round(elapsed, 1),
                                 "violations": len(audit.violations)})  # fmt: skip
    return 0 if audit.ok else 1


if __name__ == "__main__":
    sys.exit(main())
