"""Planner statistics that follow the queue when it grows faster than autovacuum looks.

PostgreSQL plans the claim's statements from ``jobs``' statistics, and every
connection keeps the plans it made until the table is analysed again. A table
that grew from nothing (a fresh service, or a burst onto an idle one) is
planned as if it still held a handful of rows: reading a shape's first rows by
walking the whole queue in claim order looks as cheap as seeking them by
shape. Autovacuum analyses it, but only when it next visits the database (once
a minute by default), and until then a burst of 30,000 jobs behind 15,000 that
a node cannot run cost 1,300 pages per claim instead of a few dozen.

The leading sweeper checks every tick, with one query, whether the live row
count has outgrown what the statistics were made from
(:func:`statistics_outgrown`), and then analyses ``jobs`` itself
(``umbra_analyze_jobs()``, migrations/0026). PostgreSQL invalidates every
connection's cached plans of the table when its statistics change. Ordinary
churn (claims and completions update rows, they do not add them) never
triggers it: that is autovacuum's.
"""

from __future__ import annotations

import logging
import time

import psycopg

log = logging.getLogger(__name__)

#: Fewer live rows than this are never worth analysing for.
MIN_ROWS = 1_000
#: The statistics are outgrown when the table holds this many times the rows they were made from.
GROWTH = 2.0

_SIZES = """
SELECT s.n_live_tup, c.reltuples FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
WHERE s.relid = 'public.jobs'::regclass
"""


def statistics_outgrown(live_rows: int, analysed_rows: float) -> bool:
    """Whether ``live_rows`` (the table now) has outgrown ``analysed_rows`` (``pg_class.reltuples``: -1 if never analysed)."""
    return live_rows >= max(MIN_ROWS, GROWTH * max(analysed_rows, 0.0))


async def refresh_if_outgrown(conn: psycopg.AsyncConnection) -> bool:
    """Analyse ``jobs`` when the queue has outgrown its statistics; returns whether it did."""
    row = await (await conn.execute(_SIZES)).fetchone()
    if row is None or not statistics_outgrown(row[0], row[1]):
        return False
    started = time.perf_counter()
    await conn.execute("SELECT umbra_analyze_jobs()")
    log.info("queue statistics refreshed", extra={"action": "jobs_analysed", "live_rows": row[0],
                                                  "analysed_rows": max(row[1], 0),
                                                  "ms": round(1000 * (time.perf_counter() - started), 1)})  # fmt: skip
    return True
