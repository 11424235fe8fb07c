"""Rebuild throughput: fold a log of 1,000,000 events into the queue projection.

    python -m bench.rebuild [--events 1000000]

Generates job histories (``job.submitted`` → ``job.claimed`` →
``job.completed``, three events per job) with ``append_many`` in large
batches, writes the queue rows they fold to (so the live table matches, as in
production), then measures:

* ``rebuild (fold only)``: :func:`umbra.projections.jobs.rebuild`, reading
  the log in pages and folding every event in memory;
* ``verify``: :func:`umbra.projections.verify.verify`, what ``umbra verify``
  and ``POST /v1/projections/verify`` run — rebuild both views in one snapshot,
  read the live tables, compare row by row.

Writes ``bench/results/rebuild.json``.
"""

from __future__ import annotations

import argparse
import time
import uuid
from datetime import datetime, timedelta, timezone

import anyio
import psycopg

from umbra.events import store
from umbra.events.types import JobClaimed, JobCompleted, JobSubmitted, Placement
from umbra.projections import jobs as queue
from umbra.projections.verify import verify

from . import fleet
from .common import print_table, scratch_database, write_json

#: Events per append statement while generating.
GENERATE_BATCH = 30_000


async def generate(url: str, events: int) -> tuple[uuid.UUID, float]:
    org, _ = await fleet.new_organization(url)
    node = uuid.uuid4()
    placement = Placement(node_id=node, device_id="cpu", device_kind="cpu", reason="placed:cpu")
    lease = datetime(2030, 1, 1, tzinfo=timezone.utc)
    per_batch = GENERATE_BATCH // 3
    started = time.perf_counter()
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute("SET synchronous_commit = off")  # generating, not measuring
        made = 0
        while made < events:
            batch = []
            for _ in range(min(per_batch, (events - made + 2) // 3)):
                stream = store.job_stream(uuid.uuid4())
                batch.append(store.PendingAppend(stream, 0, [
                    JobSubmitted(kind="noop", priority=100, max_attempts=3, payload={"n": made}),
                    JobClaimed(attempt=1, node_id=node, placement=placement, lease_expires_at=lease + timedelta(seconds=made)),
                    JobCompleted(attempt=1, result={"ok": True}),
                ], org, {"actor": "bench"}))  # fmt: skip
                made += 3
            async with conn.transaction():
                await store.append_many(conn, batch)
        rows = list((await queue.rebuild(conn)).values())
        for start in range(0, len(rows), 10_000):
            async with conn.transaction():
                await queue.write_rows(conn, rows[start : start + 10_000])
        await conn.execute("VACUUM ANALYZE events")
        await conn.execute("VACUUM ANALYZE jobs")
    return org, time.perf_counter() - started


async def measure(url: str) -> dict:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        count = (await (await conn.execute("SELECT count(*) FROM events")).fetchone())[0]
        started = time.perf_counter()
        rebuilt = await queue.rebuild(conn)
        fold_seconds = time.perf_counter() - started
        started = time.perf_counter()
        differences = await verify(conn)
        verify_seconds = time.perf_counter() - started
    return {"events": count, "jobs": len(rebuilt), "rebuild_seconds": fold_seconds, "rebuild_events_per_s": count / fold_seconds,
            "verify_seconds": verify_seconds, "verify_events_per_s": count / verify_seconds, "differences": len(differences)}  # fmt: skip


def run(events: int) -> dict:
    with scratch_database("umbra_bench_rebuild") as url:
        _, generate_seconds = anyio.run(generate, url, events)
        print(f"  generated {events:,} events in {generate_seconds:.1f} s", flush=True)
        result = anyio.run(measure, url)
    result["generate_seconds"] = generate_seconds
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    args = parser.parse_args()
    r = run(args.events)
    rows = [["rebuild (fold only)", r["events"], r["rebuild_seconds"], r["rebuild_events_per_s"]],
            ["verify (rebuild + compare)", r["events"], r["verify_seconds"], r["verify_events_per_s"]]]  # fmt: skip
    print_table(f"Rebuild the queue projection ({r['jobs']:,} jobs)", ["operation", "events", "seconds", "events/s"], rows)
    print(f"differences: {r['differences']}")
    print(f"\nwrote {write_json('rebuild', r)}")


if __name__ == "__main__":
    main()
