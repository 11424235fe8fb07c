"""What NOTIFY inside a write transaction costs: commits/s with and without it.

    python -m bench.notify_cost [--seconds 3]

1 and 16 writers, each looping one transaction that appends one event through
:func:`umbra.events.store.append` (the ordering lock, the insert) and commits;
variant ``notify`` also calls :func:`umbra.events.store.publish` in the
transaction, as every command did before hints moved out of the hot
transactions (``umbra.compute.group_commit.HintNotifier``). PostgreSQL takes a
cluster-wide lock at commit for a transaction that notified and holds it
across the commit flush, so notifying transactions cannot share a flush.
Writes ``bench/results/notify_cost.json``.
"""

from __future__ import annotations

import argparse
import time
import uuid

import anyio
import psycopg

from umbra.events import store
from umbra.events.types import JobSubmitted

from . import fleet
from .common import print_table, scratch_database, write_json


async def _run(url: str, writers: int, seconds: float, notify: bool) -> float:
    org, _ = await fleet.new_organization(url)
    event = JobSubmitted(kind="noop", priority=100, max_attempts=3)
    count = 0
    deadline = time.perf_counter() + seconds

    async def writer() -> None:
        nonlocal count
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            while time.perf_counter() < deadline:
                async with conn.transaction():
                    [recorded] = await store.append(conn, store.job_stream(uuid.uuid4()), 0, [event], organization_id=org)
                    if notify:
                        await store.publish(conn, [(org, recorded.position, 0)])
                count += 1

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(writers):
            tg.start_soon(writer)
    return count / (time.perf_counter() - started)


def run(seconds: float) -> list[dict]:
    results = []
    for writers in (1, 16):
        rates = {}
        for notify in (False, True):
            with scratch_database("umbra_bench_notify") as url:
                rates[notify] = anyio.run(_run, url, writers, seconds, notify)
        results.append({"writers": writers, "commits_per_s": rates[False], "with_notify_per_s": rates[True],
                        "ratio": rates[True] / rates[False]})  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    results = run(args.seconds)
    rows = [[r["writers"], r["commits_per_s"], r["with_notify_per_s"], r["ratio"]] for r in results]
    print_table("Append + commit, with and without NOTIFY in the transaction", ["writers", "tx/s", "tx/s with NOTIFY",
                "with / without"], rows)  # fmt: skip
    print(f"\nwrote {write_json('notify_cost', {'results': results})}")


if __name__ == "__main__":
    main()
