"""10,000 idle long-polls on one server process: connections, memory, claim attempts per job.

    python -m bench.idle_longpolls [--polls 10000] [--nodes 100] [--jobs 200]

A real ``umbra serve`` subprocess; ``--nodes`` nodes paired in-process, each
credential verified once (a ``wait=0`` claim) so the token cache is warm. Then
``--polls`` HTTP connections, each a raw socket sending one ``POST
/v1/agent/claim?wait=60`` (plain asyncio streams: an HTTP client object per
connection would cost the client more than the server), opened in waves of
500 so the listen backlog and the pool's queue never overflow. Measured:

* the server's PostgreSQL connections (``pg_stat_activity`` on the scratch
  database, less this script's own) while everything is parked, and how many
  of them are doing something;
* the server's RSS before and after parking;
* ``--jobs`` jobs submitted one at a time while the long-polls wait: claim
  attempts (``umbra_claim_attempts_total``) per job, and how many long-polls
  answered with a job.

The open-file limit is raised to the hard limit (each connection is a file on
both sides). Writes ``bench/results/idle_longpolls.json``.
"""

from __future__ import annotations

import argparse
import time

import anyio
import httpx
import psutil
import psycopg

from umbra.compute.jobs import JobRequest, submit

from . import fleet
from .common import print_table, scratch_database, write_json

WAVE = 500


async def _park(host: str, port: int, credential: str, answered: list[int], ready: list[int]) -> None:
    stream = await anyio.connect_tcp(host, port)
    request = (f"POST /v1/agent/claim?wait=60 HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {credential}\r\n"
               "Content-Length: 0\r\n\r\n").encode()  # fmt: skip
    async with stream:
        await stream.send(request)
        ready.append(1)
        head = await stream.receive(65536)
        answered.append(int(head.split(b" ", 2)[1]))


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


async def _server_connections(url: str) -> tuple[int, int]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        row = await (await conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE state NOT IN ('idle') AND query NOT ILIKE 'LISTEN%%') "
            "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )).fetchone()  # fmt: skip
    return row[0], row[1]


async def run_async(url: str, polls: int, node_count: int, jobs: int) -> dict:
    org, _ = await fleet.new_organization(url)
    nodes = await fleet.pair_in_process(url, org, [f"idle-{i}" for i in range(node_count)])
    with fleet.serve(url) as server:
        process = psutil.Process(server.pid)
        host, port = "127.0.0.1", int(server.base.rsplit(":", 1)[1])
        async with httpx.AsyncClient(base_url=server.base, timeout=60) as client:
            for _, credential in nodes:  # warm the token cache: one argon2 verification per credential
                r = await client.post("/v1/agent/claim", params={"wait": 0}, headers={"Authorization": f"Bearer {credential}"})
                assert r.status_code == 204, r.status_code
            rss_before = process.memory_info().rss
            answered: list[int] = []
            ready: list[int] = []
            started = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for wave in range(0, polls, WAVE):
                    for i in range(wave, min(polls, wave + WAVE)):
                        tg.start_soon(_park, host, port, nodes[i % node_count][1], answered, ready)
                    await fleet.sleep_until(lambda: _parked_at_least(client, min(polls, wave + WAVE)), timeout=120)
                park_seconds = time.perf_counter() - started
                # A long-poll counts as waiting from its arrival, before its first claim attempt has run:
                # wait for every first attempt (one per long-poll, plus the warm-up claims) to finish.
                await fleet.sleep_until(lambda: _attempts_at_least(client, polls + node_count), timeout=300)
                await anyio.sleep(2)  # settle: let any safety poll round pass
                total, busy = await _server_connections(url)
                rss_after = process.memory_info().rss
                attempts_before = _metric((await client.get("/metrics")).text, "umbra_claim_attempts_total")
                async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                    submit_started = time.perf_counter()
                    for i in range(jobs):
                        await submit(conn, org, [JobRequest(kind="noop", payload={"i": i})], actor="bench", batch=False)
                await fleet.sleep_until(lambda: _true(answered.count(200) >= jobs), timeout=60)
                claim_seconds = time.perf_counter() - submit_started
                attempts_after = _metric((await client.get("/metrics")).text, "umbra_claim_attempts_total")
                waiting = _metric((await client.get("/metrics")).text, "umbra_long_polls_waiting")
                tg.cancel_scope.cancel()
    return {
        "polls": polls, "nodes": node_count, "jobs": jobs, "park_seconds": park_seconds,
        "server_db_connections": total, "server_db_connections_busy": busy,
        "rss_before_mb": rss_before / 2**20, "rss_after_mb": rss_after / 2**20,
        "rss_per_poll_kb": (rss_after - rss_before) / polls / 1024,
        "claim_attempts": attempts_after - attempts_before,
        "claim_attempts_per_job": (attempts_after - attempts_before) / jobs,
        "jobs_claimed": answered.count(200), "still_waiting": waiting, "claim_seconds": claim_seconds,
    }  # fmt: skip


async def _true(value: bool) -> bool:
    return value


async def _attempts_at_least(client: httpx.AsyncClient, count: int) -> bool:
    return _metric((await client.get("/metrics")).text, "umbra_claim_attempts_total") >= count


async def _parked_at_least(client: httpx.AsyncClient, count: int) -> bool:
    return _metric((await client.get("/metrics")).text, "umbra_long_polls_waiting") >= count


def run(polls: int, nodes: int, jobs: int) -> dict:
    limit = fleet.raise_open_files(polls * 2 + 1000)
    if limit < polls + 200:
        raise SystemExit(f"open-file limit {limit} is too low for {polls} connections (raise the hard limit: ulimit -Hn)")
    with scratch_database("umbra_bench_idle") as url:
        return anyio.run(run_async, url, polls, nodes, jobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--polls", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--jobs", type=int, default=200)
    args = parser.parse_args()
    r = run(args.polls, args.nodes, args.jobs)
    rows = [
        ["long-polls parked", r["polls"]],
        ["seconds to park them", r["park_seconds"]],
        ["server DB connections (all)", r["server_db_connections"]],
        ["server DB connections busy while parked", r["server_db_connections_busy"]],
        ["server RSS before / after, MB", f"{r['rss_before_mb']:.0f} / {r['rss_after_mb']:.0f}"],
        ["RSS per parked long-poll, KB", r["rss_per_poll_kb"]],
        ["jobs submitted one by one", r["jobs"]],
        ["claim attempts per job", r["claim_attempts_per_job"]],
        ["long-polls answered with a job", r["jobs_claimed"]],
    ]
    print_table("Idle long-polls on one server process", ["measure", "value"], rows)
    print(f"\nwrote {write_json('idle_longpolls', r)}")


if __name__ == "__main__":
    main()
