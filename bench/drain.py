"""Drain N pre-queued no-op jobs with 1, 4 and 16 agents: over HTTP and in-process.

    python -m bench.drain [--jobs 2000] [--agents 1,4,16] [--modes http-chained,http,inproc]

* ``http``: a real ``umbra serve`` subprocess on a scratch database; nodes are
  paired through the API (pairing code, redeem, heartbeat) and each agent is an
  client in this process (one keep-alive connection each, :mod:`bench.wire`)
  looping ``POST /v1/agent/claim?wait=1`` → ``POST /v1/agent/jobs/{id}/complete``,
  exactly the agent protocol.
* ``http-chained``: the same, but each completion asks for the node's next job
  (``complete?claim_next=true``, what ``umbra agent`` does): one request and one
  transaction per job while work is queued, the long-poll only when it runs out.
* ``http-batch10``: agents that run ten jobs at a time, as PgQueuer's workers
  fetch ten per query: ``claim?max=10``, then ``POST /v1/agent/complete?claim_next=10``
  reporting all ten and claiming the next ten in one request.
* ``inproc``: the same loop calling the compute layer directly on a pool of 10
  connections (the server's default), no HTTP: ``claims.claim`` and
  ``claims.complete``, each its own transaction. The difference between the two
  is the HTTP stack (client and server) plus the long-poll hub.
* ``inproc-grouped`` and ``inproc-chained``: the in-process loop through
  :mod:`umbra.compute.group_commit`, claim then complete, or chained.

The clock starts when the agents start and stops when the N-th completion has
returned; the steady rate is taken over the middle 80 % of the completions
(:func:`bench.common.steady_rate`). Prints jobs/s per mode and agent count and
writes ``bench/results/drain.json``.
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from typing import Awaitable, Callable
import uuid

import anyio
import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families
from psycopg_pool import AsyncConnectionPool

from umbra.compute import claims
from umbra.compute.group_commit import GroupCommit, HintNotifier

from . import fleet, wire
from .common import print_table, scratch_database, steady_rate, write_json

#: Lease the in-process agents ask for (the server's default).
LEASE_SECONDS = 60


class Tally:
    def __init__(self, target: int) -> None:
        self.target = target
        self.done = 0
        self.finished = anyio.Event()
        self.ended_at = 0.0
        self.completed_at: list[float] = []

    def one(self) -> None:
        self.done += 1
        self.completed_at.append(time.perf_counter())
        if self.done >= self.target and not self.finished.is_set():
            self.ended_at = time.perf_counter()
            self.finished.set()

    def figures(self, started: float) -> dict:
        """The whole drain's rate (from ``started``) and the steady rate (see :func:`bench.common.steady_rate`)."""
        seconds = self.ended_at - started
        return {"jobs": self.target, "seconds": seconds, "jobs_per_s": self.target / seconds,
                "steady_jobs_per_s": steady_rate(self.completed_at)}  # fmt: skip


async def _http_agent(base: str, credential: str, tally: Tally, *, chained: bool = False) -> None:
    connection = wire.Connection.to(base, {"Authorization": f"Bearer {credential}"})
    complete = "/complete?claim_next=true" if chained else "/complete"
    try:
        while not tally.finished.is_set():
            response = await connection.post("/v1/agent/claim?wait=1")
            if response.status == 204:
                continue
            response.raise_for_status()
            claimed = response.json()
            while claimed is not None:  # chained: each completion brings the next job, until none is left
                job = claimed["job"]
                done = await connection.post(f"/v1/agent/jobs/{job['id']}{complete}", {"attempt": job["attempt"], "result": None})
                done.raise_for_status()
                tally.one()
                claimed = done.json().get("next_claim")
    finally:
        await connection.aclose()


async def _http_batch_agent(base: str, credential: str, tally: Tally, *, per_request: int = 10) -> None:
    """An agent that runs ``per_request`` jobs at a time: claims that many, reports them together with the next claim."""
    connection = wire.Connection.to(base, {"Authorization": f"Bearer {credential}"})
    try:
        while not tally.finished.is_set():
            response = await connection.post(f"/v1/agent/claim?wait=1&max={per_request}")
            if response.status == 204:
                continue
            response.raise_for_status()
            held = response.json()["claims"]
            while held:
                results = [{"job_id": c["job"]["id"], "attempt": c["job"]["attempt"], "result": None} for c in held]
                done = await connection.post(f"/v1/agent/complete?claim_next={per_request}", {"results": results})
                done.raise_for_status()
                answer = done.json()
                for _ in (r for r in answer["results"] if r["status"] == 200):
                    tally.one()
                held = answer["next_claims"]
    finally:
        await connection.aclose()


async def _heartbeats(beat: Callable[[], Awaitable[None]], tally: Tally) -> None:
    """Every 10 s until the drain ends: a node silent for 45 s reads offline and is given no work."""
    while not tally.finished.is_set():
        with anyio.move_on_after(10):
            await tally.finished.wait()
        await beat()


async def _beat_over_http(client: httpx.AsyncClient, credentials: list[str]) -> None:
    for credential in credentials:
        await fleet.beat(client, credential)


async def drain_http(url: str, jobs: int, agents: int, *, chained: bool = False, per_request: int = 1) -> dict:
    org, api_key = await fleet.new_organization(url)
    with fleet.serve(url) as server:
        # Idle connections are dropped before uvicorn's 5-second keep-alive timeout closes them: reusing
        # one as the server closes it fails the request (the /metrics read after a long drain did).
        limits = httpx.Limits(max_connections=agents + 4, max_keepalive_connections=agents + 4, keepalive_expiry=2)
        async with httpx.AsyncClient(base_url=server.base, timeout=60, limits=limits) as client:
            nodes = await fleet.pair_over_http(client, api_key, [f"agent-{i}" for i in range(agents)])
            await fleet.submit_noops(url, org, jobs)
            tally = Tally(jobs)
            server_process = psutil.Process(server.pid)
            cpu_before = _cpu_seconds(server_process)
            started = time.perf_counter()
            async with anyio.create_task_group() as tg:
                tg.start_soon(_heartbeats, partial(_beat_over_http, client, [c for _, c in nodes]), tally)
                for _, credential in nodes:
                    agent = partial(_http_batch_agent, per_request=per_request) if per_request > 1 else partial(_http_agent, chained=chained)
                    tg.start_soon(agent, server.base, credential, tally)
                await tally.finished.wait()
                tg.cancel_scope.cancel()
            server_cpu_ms_per_job = 1000 * (_cpu_seconds(server_process) - cpu_before) / jobs
            batches = await _batch_figures(client, api_key)
    mode = f"http-batch{per_request}" if per_request > 1 else "http-chained" if chained else "http"
    return {"mode": mode, "agents": agents, **tally.figures(started), "server_cpu_ms_per_job": server_cpu_ms_per_job, **batches}  # fmt: skip


def _cpu_seconds(process: psutil.Process) -> float:
    """User + system CPU of the server process: unlike jobs/s, barely moved by other work on the machine."""
    times = process.cpu_times()
    return times.user + times.system


async def _batch_figures(client: httpx.AsyncClient, api_key: str) -> dict:
    """The server's group-commit figures from ``/metrics``: batches, commands per batch, time per batch."""
    response = await client.get("/metrics", headers={"Authorization": f"Bearer {api_key}"})
    response.raise_for_status()
    samples = {s.name: s.value for family in text_string_to_metric_families(response.text) for s in family.samples}
    count = samples.get("umbra_group_commit_batch_commands_count", 0.0)
    if not count:
        return {}
    return {"batches": int(count), "commands_per_batch": samples["umbra_group_commit_batch_commands_sum"] / count,
            "ms_per_batch": 1000 * samples["umbra_group_commit_batch_seconds_sum"] / count}  # fmt: skip


async def _inproc_agent(pool: AsyncConnectionPool, org: uuid.UUID, node_id: uuid.UUID, tally: Tally) -> None:
    while not tally.finished.is_set():
        async with pool.connection() as conn:
            claimed = await claims.claim(conn, node_id=node_id, organization_id=org, lease_seconds=LEASE_SECONDS)
        if claimed is None:
            await anyio.sleep(0.01)
            continue
        async with pool.connection() as conn:
            await claims.complete(conn, organization_id=org, node_id=node_id, job_id=claimed.job_id,
                                  attempt=claimed.attempt, result=None)  # fmt: skip
        tally.one()


async def drain_inproc(url: str, jobs: int, agents: int) -> dict:
    org, _ = await fleet.new_organization(url)
    nodes = await fleet.pair_in_process(url, org, [f"agent-{i}" for i in range(agents)])
    await fleet.submit_noops(url, org, jobs)
    tally = Tally(jobs)
    async with AsyncConnectionPool(url, min_size=10, max_size=10, kwargs={"autocommit": True}, open=False) as pool:
        await pool.wait()
        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_heartbeats, partial(fleet.beat_in_process, url, org, [n for n, _ in nodes]), tally)
            for node_id, _ in nodes:
                tg.start_soon(_inproc_agent, pool, org, node_id, tally)
            await tally.finished.wait()
            tg.cancel_scope.cancel()
    return {"mode": "inproc", "agents": agents, **tally.figures(started)}


async def _grouped_agent(group: GroupCommit, org: uuid.UUID, node_id: uuid.UUID, tally: Tally, *,
                         chained: bool = False) -> None:  # fmt: skip
    while not tally.finished.is_set():
        claimed = await group.claim(node_id=node_id, organization_id=org, lease_seconds=LEASE_SECONDS, stale_seconds=45)
        if claimed is None:
            await anyio.sleep(0.01)
            continue
        while claimed is not None:
            if not chained:
                await group.complete(organization_id=org, node_id=node_id, job_id=claimed.job_id, attempt=claimed.attempt,
                                     result=None)  # fmt: skip
                claimed = None
            else:
                _, claimed = await group.complete_and_claim(
                    organization_id=org, node_id=node_id, job_id=claimed.job_id, attempt=claimed.attempt, result=None,
                    lease_seconds=LEASE_SECONDS, stale_seconds=45,
                )  # fmt: skip
            tally.one()


async def _grouped_batch_agent(group: GroupCommit, org: uuid.UUID, node_id: uuid.UUID, tally: Tally, *,
                               per_request: int = 10) -> None:  # fmt: skip
    args = {"organization_id": org, "node_id": node_id, "lease_seconds": LEASE_SECONDS, "stale_seconds": 45}
    while not tally.finished.is_set():
        held = await group.claim_many(count=per_request, **args)
        if held is None:
            await anyio.sleep(0.01)
            continue
        while held:
            answers, held = await group.complete_many(
                results=[(c.job_id, c.attempt, None) for c in held], claim_next=per_request, **args)  # fmt: skip
            for _ in answers:
                tally.one()


async def drain_grouped(url: str, jobs: int, agents: int, *, chained: bool = False, per_request: int = 1) -> dict:
    org, _ = await fleet.new_organization(url)
    nodes = await fleet.pair_in_process(url, org, [f"agent-{i}" for i in range(agents)])
    await fleet.submit_noops(url, org, jobs)
    tally = Tally(jobs)
    async with AsyncConnectionPool(url, min_size=10, max_size=10, kwargs={"autocommit": True}, open=False) as pool:
        await pool.wait()
        notifier = HintNotifier(pool)
        group = GroupCommit(pool, notifier)
        async with anyio.create_task_group() as tg:
            await tg.start(notifier.run)
            await tg.start(group.run)
            started = time.perf_counter()
            tg.start_soon(_heartbeats, partial(fleet.beat_in_process, url, org, [n for n, _ in nodes]), tally)
            for node_id, _ in nodes:
                agent = partial(_grouped_batch_agent, per_request=per_request) if per_request > 1 else partial(_grouped_agent, chained=chained)
                tg.start_soon(agent, group, org, node_id, tally)
            await tally.finished.wait()
            tg.cancel_scope.cancel()
    mode = f"inproc-batch{per_request}" if per_request > 1 else "inproc-chained" if chained else "inproc-grouped"
    return {"mode": mode, "agents": agents, **tally.figures(started),
            "batches": group.batches, "fallbacks": group.fallbacks, "notify_ticks": notifier.ticks,
            "commands_per_batch": group.commands / max(1, group.batches)}


RUNNERS = {
    "http": drain_http,
    "http-chained": partial(drain_http, chained=True),
    "http-batch10": partial(drain_http, per_request=10),
    "inproc": drain_inproc,
    "inproc-grouped": drain_grouped,
    "inproc-chained": partial(drain_grouped, chained=True),
    "inproc-batch10": partial(drain_grouped, per_request=10),
}


def run(jobs: int, agent_counts: list[int], modes: list[str]) -> list[dict]:
    results = []
    for mode in modes:
        for agents in agent_counts:
            with scratch_database("umbra_bench_drain") as url:
                results.append(anyio.run(RUNNERS[mode], url, jobs, agents))
            extra = results[-1]
            batches = f" ({extra['commands_per_batch']:.1f} commands/batch" if "commands_per_batch" in extra else ""
            batches += f", {extra['ms_per_batch']:.1f} ms/batch)" if "ms_per_batch" in extra else (")" if batches else "")
            cpu = f", server CPU {extra['server_cpu_ms_per_job']:.2f} ms/job" if "server_cpu_ms_per_job" in extra else ""
            print(f"  {mode} x{agents}: {extra['jobs_per_s']:,.0f} jobs/s (steady {extra['steady_jobs_per_s']:,.0f}){batches}{cpu}",
                  flush=True)  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--agents", default="1,4,16")
    parser.add_argument("--modes", default="http-chained,http,inproc")
    args = parser.parse_args()
    results = run(args.jobs, [int(a) for a in args.agents.split(",")], args.modes.split(","))
    rows = [[r["mode"], r["agents"], r["jobs"], r["seconds"], r["jobs_per_s"]] for r in results]
    print_table("Drain no-op jobs (claim + complete per job)", ["mode", "agents", "jobs", "seconds", "jobs/s"], rows)
    print(f"\nwrote {write_json('drain', {'results': results})}")


if __name__ == "__main__":
    main()
