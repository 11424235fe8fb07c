"""Append throughput of the event store: 1 and 16 writers, with and without the ordering guard.

    python -m bench.append [--seconds 3]

The unguarded variant is *incorrect* (readers can skip late commits); it is
here only to show what the guard costs.
"""

from __future__ import annotations

import argparse
import time
import uuid

import anyio
import psycopg

from umbra.compute.accounts import create_organization
from umbra.events import store
from umbra.events.types import JobSubmitted

from .common import print_table, scratch_database, write_json


async def _run(url: str, writers: int, seconds: float, batch: int) -> float:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as c:
        org, _ = await create_organization(c, "bench")
    count = 0
    deadline = time.perf_counter() + seconds
    event = JobSubmitted(kind="noop", priority=100, max_attempts=3)

    async def writer():
        nonlocal count
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as c:
            while time.perf_counter() < deadline:
                async with c.transaction():
                    await store.append_many(
                        c, [store.PendingAppend(store.job_stream(uuid.uuid4()), 0, [event], org) for _ in range(batch)]
                    )
                count += batch

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(writers):
            tg.start_soon(writer)
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    rows, results = [], []
    for guard in (True, False):
        store.ORDERING_GUARD = guard
        for writers in (1, 16):
            for batch in (1, 100):
                with scratch_database() as url:
                    rate = anyio.run(_run, url, writers, args.seconds, batch)
                rows.append(["lock" if guard else "none (unsafe)", writers, batch, rate])
                results.append({"guard": guard, "writers": writers, "events_per_tx": batch, "events_per_s": rate})
    store.ORDERING_GUARD = True
    print_table("Event append throughput (events/s)", ["ordering guard", "writers", "events/tx", "events/s"], rows)
    print(f"\nwrote {write_json('append', {'results': results})}")


if __name__ == "__main__":
    main()
