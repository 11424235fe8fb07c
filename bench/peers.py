"""Umbra next to PgQueuer and Procrastinate: the same no-op drain, in the same run.

    python -m bench.peers [--jobs 2000] [--concurrency 1,4,16]

The peers are installed from PyPI into ``bench/.venv-peers`` (created on first
use, pinned versions below, gitignored) and run by :mod:`bench.peer_worker`
in that interpreter, each on its own empty scratch database. Umbra drains the
same number of jobs with the same number of agents, over HTTP and in-process
(:mod:`bench.drain`). Prints jobs/s and Umbra's ratio to each peer per
concurrency, and writes ``bench/results/peers.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator
from urllib.parse import quote

import psycopg
from psycopg import conninfo, sql

from . import drain
from .common import print_table, server_url, steady_rate, write_json

VENV = Path(__file__).parent / ".venv-peers"
PEERS = ("pgqueuer==1.6.0", "asyncpg==0.32.0", "procrastinate==3.10.0", "psycopg[binary,pool]>=3.2")
SYSTEMS = ("pgqueuer", "procrastinate")


def ensure_venv() -> Path:
    python = VENV / "bin" / "python"
    marker = VENV / "installed.txt"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    if not marker.exists() or marker.read_text() != "\n".join(PEERS):
        subprocess.run([str(python), "-m", "pip", "install", "-q", *PEERS], check=True)
        marker.write_text("\n".join(PEERS))
    return python


@contextmanager
def empty_database() -> Iterator[str]:
    base = server_url()
    name = f"umbra_bench_peer_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(base, autocommit=True) as c:
        c.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield _as_url(base, name)
    finally:
        with psycopg.connect(base, autocommit=True) as c:
            c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _as_url(base: str, dbname: str) -> str:
    """A ``postgresql://`` URL for ``dbname`` on ``base``'s server (asyncpg takes URLs only)."""
    parts = conninfo.conninfo_to_dict(base)
    user = parts.get("user", "postgres")
    password = f":{quote(str(parts['password']))}" if parts.get("password") else ""
    return f"postgresql://{quote(str(user))}{password}@{parts.get('host', '127.0.0.1')}:{parts.get('port', 5432)}/{dbname}"


def run_peer(python: Path, system: str, jobs: int, concurrency: int) -> dict:
    with empty_database() as url:
        out = subprocess.run([str(python), str(Path(__file__).parent / "peer_worker.py"), system, url, str(jobs), str(concurrency)],
                             check=True, capture_output=True, text=True, timeout=600)  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    steady = steady_rate(result.pop("completed_at"))  # the figure is kept, not the 10,000 timestamps
    return {**result, "steady_jobs_per_s": steady}


def run(jobs: int, concurrencies: list[int], modes: list[str]) -> dict:
    python = ensure_venv()
    peers = []
    for system in SYSTEMS:
        for c in concurrencies:
            peers.append(run_peer(python, system, jobs, c))
            print(f"  {system} x{c}: {peers[-1]['jobs_per_s']:,.0f} jobs/s (steady {peers[-1]['steady_jobs_per_s']:,.0f})", flush=True)
    umbra = drain.run(jobs, concurrencies, modes)
    rate = {(r["mode"], r["agents"]): r for r in umbra}
    peer_rate = {(p["system"], p["concurrency"]): p for p in peers}
    ratios = [
        {"concurrency": c, "umbra_mode": mode, "peer": system, **{
            key: rate[mode, c][figure] / peer_rate[system, c][figure]
            for key, figure in (("ratio", "jobs_per_s"), ("steady_ratio", "steady_jobs_per_s"))}}
        for c in concurrencies for mode in modes for system in SYSTEMS
    ]  # fmt: skip
    return {"jobs": jobs, "peers": peers, "umbra": umbra, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--modes", default="http-batch10,http-chained,http,inproc-grouped")
    args = parser.parse_args()
    result = run(args.jobs, [int(c) for c in args.concurrency.split(",")], args.modes.split(","))
    table = {}
    for p in result["peers"]:
        table.setdefault(p["system"], {})[p["concurrency"]] = p["jobs_per_s"]
    for u in result["umbra"]:
        table.setdefault(f"umbra {u['mode']}", {})[u["agents"]] = u["jobs_per_s"]
    concurrencies = sorted({p["concurrency"] for p in result["peers"]})
    print_table(f"Drain {result['jobs']} no-op jobs, jobs/s", ["system", *[f"c={c}" for c in concurrencies]],
                [[name, *[row.get(c, float("nan")) for c in concurrencies]] for name, row in table.items()])  # fmt: skip
    print_table("Umbra / peer", ["c", "umbra", "peer", "ratio", "steady ratio"],
                [[r["concurrency"], r["umbra_mode"], r["peer"], r["ratio"], r["steady_ratio"]] for r in result["ratios"]])  # fmt: skip
    print(f"\nwrote {write_json('peers', result)}")


if __name__ == "__main__":
    main()
