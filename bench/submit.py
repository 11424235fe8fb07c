"""Submit throughput: one job per request vs batches, over HTTP and in-process.

    python -m bench.submit [--jobs 2000] [--batch 10000] [--batches 5] [--no-node]

* ``http 1-by-1``: ``POST /v1/jobs`` from 1 and from 16 concurrent async httpx
  clients against a real ``umbra serve`` subprocess;
* ``http batched``: ``POST /v1/jobs/batch`` with ``--batch`` jobs per request
  (the response carries every created Job object);
* ``inproc 1-by-1`` / ``inproc batched``: :func:`umbra.compute.jobs.submit`
  directly, one transaction per call.

Every submission is one transaction that appends, writes the queue rows and
sends one hint. The organization has one paired CPU node, so a no-op job is
one ``job.submitted`` event and one queued row; with ``--no-node`` nothing
could run the jobs and each is also blocked (a second event). Writes
``bench/results/submit.json``.
"""

from __future__ import annotations

import argparse
import json
import time

import anyio
import httpx
import psycopg

from umbra.compute.jobs import JobRequest, submit

from . import fleet
from .common import print_table, scratch_database, write_json


async def _http_one_by_one(base: str, api_key: str, jobs: int, clients: int) -> float:
    headers = {"Authorization": f"Bearer {api_key}"}
    per_client = jobs // clients
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients, keepalive_expiry=2)  # see bench.drain
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:

        async def one_client(offset: int) -> None:
            for i in range(per_client):
                response = await client.post("/v1/jobs", json={"kind": "noop", "payload": {"i": offset + i}}, headers=headers)
                assert response.status_code == 201, response.text

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for c in range(clients):
                tg.start_soon(one_client, c * per_client)
        return per_client * clients / (time.perf_counter() - started)


async def _http_batched(base: str, api_key: str, batch: int, batches: int) -> float:
    headers = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        # Encoded before the clock starts: the client's JSON encoder is not what is measured.
        bodies = [
            json.dumps({"jobs": [{"kind": "noop", "payload": {"i": b * batch + i}} for i in range(batch)]}).encode()
            for b in range(batches)
        ]
        headers["Content-Type"] = "application/json"
        started = time.perf_counter()
        for body in bodies:
            response = await client.post("/v1/jobs/batch", content=body, headers=headers)
            assert response.status_code == 201, response.text[:200]
        return batch * batches / (time.perf_counter() - started)


async def _inproc(url: str, org, jobs: int, batch: int) -> float:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        specs = [JobRequest(kind="noop", payload={"i": i}) for i in range(jobs)]
        started = time.perf_counter()
        for start in range(0, jobs, batch):
            await submit(conn, org, specs[start : start + batch], actor="bench", batch=batch > 1)
        return jobs / (time.perf_counter() - started)


def run(jobs: int, batch: int, batches: int, *, node: bool = True) -> list[dict]:
    results = []

    def record(mode: str, clients: int, per_request: int, total: int, rate: float) -> None:
        results.append({"mode": mode, "clients": clients, "jobs_per_request": per_request, "jobs": total, "jobs_per_s": rate})
        print(f"  {mode} clients={clients} per_request={per_request}: {rate:,.0f} jobs/s", flush=True)

    with scratch_database("umbra_bench_submit") as url:
        org, api_key = anyio.run(fleet.new_organization, url)
        if node:
            anyio.run(fleet.pair_in_process, url, org, ["bench-node"])
        with fleet.serve(url) as server:
            for clients in (1, 16):
                record("http", clients, 1, jobs, anyio.run(_http_one_by_one, server.base, api_key, jobs, clients))
            record("http", 1, batch, batch * batches, anyio.run(_http_batched, server.base, api_key, batch, batches))
        record("inproc", 1, 1, jobs, anyio.run(_inproc, url, org, jobs, 1))
        record("inproc", 1, batch, batch * batches, anyio.run(_inproc, url, org, batch * batches, batch))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2000, help="jobs submitted one by one per measurement")
    parser.add_argument("--batch", type=int, default=10_000, help="jobs per batch request (max 10,000)")
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--no-node", action="store_true", help="submit to an organization without nodes (every job blocked)")
    args = parser.parse_args()
    results = run(args.jobs, args.batch, args.batches, node=not args.no_node)
    rows = [[r["mode"], r["clients"], r["jobs_per_request"], r["jobs"], r["jobs_per_s"]] for r in results]
    print_table("Submit throughput", ["mode", "clients", "jobs/request", "jobs", "jobs/s"], rows)
    print(f"\nwrote {write_json('submit', {'results': results})}")


if __name__ == "__main__":
    main()
