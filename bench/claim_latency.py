"""Claim latency with a short and a deep queue: 1,000 vs 1,000,000 queued jobs.

    python -m bench.claim_latency [--deep 1000000] [--shallow 1000] [--samples 300]

For each depth, a scratch database gets that many queued no-op jobs (submitted
in batches of 10,000 through :func:`umbra.compute.jobs.submit`, then
``VACUUM ANALYZE``), one online node, and ``--samples`` sequential claims:
each :func:`umbra.compute.claims.claim` call is timed (one transaction: read
the node and model registry, scan, lock one row, append, write), then the job
is completed untimed. Two queue shapes:

* ``uniform``: every job is one the claiming CPU node can run;
* ``mixed``: half of the jobs need a GPU the node lacks and sit ahead of the
  CPU work (priority 50 vs 100), so every claim has to get past them, as a CPU
  node does in a mixed fleet whose GPU nodes are all busy;
* ``kinds``: half of the jobs are of a kind the claim does not name (it names
  ``noop``, as an agent names the kinds it has handlers for) and sit ahead of
  the rest, so every claim has to get past them.

Writes ``bench/results/claim_latency.json``.
"""

from __future__ import annotations

import argparse
import time

import anyio
import psycopg

from umbra.compute import claims
from umbra.compute.jobs import JobRequest, RequiresRequest, submit

from . import fleet
from .common import percentile, print_table, scratch_database, write_json

BATCH = 10_000


async def _fill(url: str, org, depth: int, queue: str) -> float:
    started = time.perf_counter()
    gpu = RequiresRequest(vram_min_mb=8000, accelerators=["cuda"])
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute("SET synchronous_commit = off")  # filling, not measuring
        for start in range(0, depth, BATCH):
            count = min(BATCH, depth - start)
            # GPU work (or another kind) first, at priority 50, ahead of the work at 100: the claimer skips it.
            ahead = {"mixed": {"kind": "noop", "requires": gpu}, "kinds": {"kind": "other"}}.get(queue)
            specs = [JobRequest(payload={"i": start + i}, priority=50, **ahead) if ahead and (start + i) % 2 == 0
                     else JobRequest(kind="noop", payload={"i": start + i}) for i in range(count)]  # fmt: skip
            await submit(conn, org, specs, actor="bench", batch=True)
        await conn.execute("VACUUM ANALYZE jobs")
    return time.perf_counter() - started


async def _measure(url: str, depth: int, samples: int, queue: str) -> dict:
    org, _ = await fleet.new_organization(url)
    # A GPU node exists, so GPU jobs are queued (not blocked); it never claims here.
    await fleet.pair_in_process(url, org, ["gpu-box"], device=fleet.GPU)
    fill_seconds = await _fill(url, org, depth, queue)
    kinds = frozenset({"noop"}) if queue == "kinds" else None
    nodes = await fleet.pair_in_process(url, org, ["claimer"])
    node_id = nodes[0][0]
    timings: list[float] = []
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        beaten = time.monotonic()
        for _ in range(samples):
            if time.monotonic() - beaten > 10:  # stay online through slow samples (untimed)
                await fleet.beat_in_process(url, org, [node_id])
                beaten = time.monotonic()
            started = time.perf_counter()
            claimed = await claims.claim(conn, node_id=node_id, organization_id=org, lease_seconds=60, kinds=kinds)
            timings.append(time.perf_counter() - started)
            assert claimed is not None
            await claims.complete(conn, organization_id=org, node_id=node_id, job_id=claimed.job_id,
                                  attempt=claimed.attempt, result=None)  # fmt: skip
        queued = (await (await conn.execute("SELECT count(*) FROM jobs WHERE status IN ('queued', 'blocked')")).fetchone())[0]
    ms = [t * 1000 for t in timings]
    return {"queue": queue, "queued": queued, "depth": depth, "samples": samples, "fill_seconds": fill_seconds,
            "p50_ms": percentile(ms, 50), "p95_ms": percentile(ms, 95), "p99_ms": percentile(ms, 99), "mean_ms": sum(ms) / len(ms)}  # fmt: skip


def run(depths: list[int], samples: int, shapes: list[str]) -> list[dict]:
    results = []
    for shape in shapes:
        for depth in depths:
            with scratch_database("umbra_bench_claimlat") as url:
                results.append(anyio.run(_measure, url, depth, samples, shape))
            print(f"  {shape} depth {depth:,}: p50 {results[-1]['p50_ms']:.2f} ms", flush=True)
    return results


def ratios(results: list[dict]) -> dict[str, float]:
    """p50 at the deepest queue over p50 at the shallowest, per queue shape."""
    out = {}
    for shape in dict.fromkeys(r["queue"] for r in results):
        mine = sorted((r for r in results if r["queue"] == shape), key=lambda r: r["depth"])
        out[shape] = mine[-1]["p50_ms"] / mine[0]["p50_ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shallow", type=int, default=1000)
    parser.add_argument("--deep", type=int, default=1_000_000)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--shapes", default="uniform,mixed,kinds")
    args = parser.parse_args()
    results = run([args.shallow, args.deep], args.samples, args.shapes.split(","))
    rows = [[r["queue"], r["depth"], r["queued"], r["p50_ms"], r["p95_ms"], r["p99_ms"], r["mean_ms"]] for r in results]
    print_table("Claim latency vs queue depth (in-process claims.claim)", ["queue", "jobs submitted", "queued at end", "p50 ms", "p95 ms",
                "p99 ms", "mean ms"], rows)  # fmt: skip
    ratio = ratios(results)
    print("\np50 ratio deep/shallow: " + ", ".join(f"{shape} {value:.2f}" for shape, value in ratio.items()))
    print(f"\nwrote {write_json('claim_latency', {'results': results, 'p50_ratio': ratio})}")


if __name__ == "__main__":
    main()
