"""Shared benchmark plumbing: a scratch database, timing, and result tables."""

from __future__ import annotations

import json
import os
import platform
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import anyio
import psycopg
from psycopg import conninfo, sql

from umbra.migrate import migrate

RESULTS = Path(__file__).parent / "results"


def server_url() -> str:
    """``UMBRA_BENCH_DATABASE_URL``, else the local server, else an embedded one."""
    return os.environ.get("UMBRA_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


@contextmanager
def scratch_database(prefix: str = "umbra_bench") -> Iterator[str]:
    """A freshly migrated database, dropped afterwards."""
    base = server_url()
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(base, autocommit=True) as c:
        c.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = conninfo.make_conninfo(base, dbname=name)
    try:
        anyio.run(migrate, url)
        yield url
    finally:
        with psycopg.connect(base, autocommit=True) as c:
            c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def percentile(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def steady_rate(completed_at: list[float], edge: float = 0.1) -> float:
    """Jobs per second between the first and the last ``edge`` of completions.

    A drain's whole-run rate charges its ramp (workers starting, connecting,
    checking their schema) and its tail (the last few jobs, workers seeing an
    empty queue) to throughput. On a short drain those dominate and differ by
    system: PgQueuer's 16 queue managers took 0.27-0.45 s to run their first
    job here, a quarter of a 2,000-job drain. The rate over the middle of the
    completions is the throughput a busy queue keeps up.
    """
    times = sorted(completed_at)
    first, last = int(len(times) * edge), int(len(times) * (1 - edge)) - 1
    if last <= first or times[last] <= times[first]:
        return float("nan")
    return (last - first) / (times[last] - times[first])


def print_table(title: str, headers: list[str], rows: list[list]) -> None:
    widths = [max(len(str(h)), *(len(_fmt(r[i])) for r in rows)) for i, h in enumerate(headers)]
    print(f"\n{title}")
    print("| " + " | ".join(str(h).ljust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(_fmt(v).rjust(w) for v, w in zip(r, widths)) + " |")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.2f}" if v < 100 else f"{v:,.0f}"
    return str(v)


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    payload = {"benchmark": name, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}, **payload}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path
