"""Drain no-op jobs with a peer queue library; run by the peers' own interpreter.

    bench/.venv-peers/bin/python bench/peer_worker.py SYSTEM DATABASE_URL JOBS CONCURRENCY

``SYSTEM`` is ``pgqueuer`` (CONCURRENCY queue managers, each on its own
asyncpg connection with the default dequeue batch of 10) or ``procrastinate``
(psycopg connector, one worker with ``concurrency`` = CONCURRENCY). The schema is
installed into the (empty) database, JOBS no-op jobs are enqueued in batches,
then a worker drains them; only the drain is timed. Prints one JSON object,
with the moment each job ran (``completed_at``, ``time.perf_counter``
seconds) for the steady rate: PgQueuer and Procrastinate record a job's end
in buffered writes, so a job's run stands for its completion there.

This file imports neither umbra nor the rest of ``bench``: it runs in a
separate virtual environment holding the peers (``bench/peers.py`` makes it).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from datetime import timedelta

ENQUEUE_BATCH = 5000


async def pgqueuer(url: str, jobs: int, concurrency: int) -> dict:
    import asyncpg
    from pgqueuer.qm import QueueManager
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries
    from pgqueuer.types import QueueExecutionMode

    setup = await asyncpg.connect(url)
    await Queries(AsyncpgDriver(setup)).install()
    queries = Queries(AsyncpgDriver(setup))
    for start in range(0, jobs, ENQUEUE_BATCH):
        count = min(ENQUEUE_BATCH, jobs - start)
        await queries.enqueue(["noop"] * count, [None] * count, [0] * count)
    await setup.close()

    done = 0
    completed_at: list[float] = []

    async def worker() -> None:
        connection = await asyncpg.connect(url)
        manager = QueueManager(Queries(AsyncpgDriver(connection)))

        @manager.entrypoint("noop")
        async def noop(job) -> None:
            nonlocal done
            done += 1
            completed_at.append(time.perf_counter())

        await manager.run(mode=QueueExecutionMode.drain, dequeue_timeout=timedelta(seconds=1))
        await connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - started
    return {"system": "pgqueuer", "concurrency": concurrency, "jobs": done, "seconds": seconds, "jobs_per_s": done / seconds,
            "completed_at": completed_at}  # fmt: skip


async def procrastinate(url: str, jobs: int, concurrency: int) -> dict:
    import procrastinate as p

    app = p.App(connector=p.PsycopgConnector(conninfo=url))
    done = 0
    completed_at: list[float] = []

    @app.task(name="noop")
    async def noop() -> None:
        nonlocal done
        done += 1
        completed_at.append(time.perf_counter())

    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        for start in range(0, jobs, ENQUEUE_BATCH):
            await noop.batch_defer_async(*({} for _ in range(min(ENQUEUE_BATCH, jobs - start))))
        started = time.perf_counter()
        await app.run_worker_async(concurrency=concurrency, wait=False, install_signal_handlers=False)
        seconds = time.perf_counter() - started
    return {"system": "procrastinate", "concurrency": concurrency, "jobs": done, "seconds": seconds, "jobs_per_s": done / seconds,
            "completed_at": completed_at}  # fmt: skip


def main() -> None:
    system, url, jobs, concurrency = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    runner = {"pgqueuer": pgqueuer, "procrastinate": procrastinate}[system]
    print(json.dumps(asyncio.run(runner(url, jobs, concurrency))))


if __name__ == "__main__":
    main()
