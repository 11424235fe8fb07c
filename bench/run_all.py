"""Run every benchmark and write ``bench/results/latest.md`` and ``latest.json``.

    python -m bench.run_all [--quick] [--only drain,submit,...]

Workloads, in order: peers + drain (PgQueuer and Procrastinate next to Umbra
over HTTP, in-process one transaction per command, and in-process through the
group commit), submit, wake latency, NOTIFY cost, idle long-polls, rebuild, claim latency.
``--quick`` shrinks every size (for a smoke run; its figures are not the
targets' sizes). Figures move between runs on a shared 2-core machine: compare
within one run. The targets are reported, met or not, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from typing import Any, Callable

from . import claim_latency, idle_longpolls, notify_cost, peers, rebuild, submit, wake_latency
from .common import RESULTS

FULL = {"drain_jobs": 10_000, "submit_jobs": 2000, "submit_batch": 10_000, "submit_batches": 5, "wake_samples": 1000,
        "idle_polls": 10_000, "idle_nodes": 100, "idle_jobs": 200, "rebuild_events": 1_000_000,
        "claim_shallow": 1000, "claim_deep": 1_000_000, "claim_samples": 300, "notify_seconds": 3}  # fmt: skip
QUICK = {"drain_jobs": 500, "submit_jobs": 300, "submit_batch": 2000, "submit_batches": 2, "wake_samples": 100,
         "idle_polls": 2000, "idle_nodes": 40, "idle_jobs": 50, "rebuild_events": 100_000,
         "claim_shallow": 1000, "claim_deep": 100_000, "claim_samples": 100, "notify_seconds": 1}  # fmt: skip
#: ``http-chained`` is the agent protocol as ``umbra agent`` speaks it (each completion claims the
#: next job); ``http`` the same agents with claim and complete as separate requests;
#: ``http-batch10`` agents that run ten jobs at a time (claim ten, report ten and claim the next
#: ten per request), as PgQueuer's workers fetch ten per query.
DRAIN_MODES = ["http-batch10", "http-chained", "http", "inproc", "inproc-grouped"]
CONCURRENCY = [1, 4, 16]


def _workloads(size: dict[str, int]) -> dict[str, Callable[[], Any]]:
    return {
        "drain": lambda: peers.run(size["drain_jobs"], CONCURRENCY, DRAIN_MODES),
        "submit": lambda: submit.run(size["submit_jobs"], size["submit_batch"], size["submit_batches"]),
        "wake": lambda: wake_latency.run(size["wake_samples"]),
        "notify": lambda: notify_cost.run(size["notify_seconds"]),
        "idle": lambda: idle_longpolls.run(size["idle_polls"], size["idle_nodes"], size["idle_jobs"]),
        "rebuild": lambda: rebuild.run(size["rebuild_events"]),
        "claim_latency": lambda: claim_latency.run([size["claim_shallow"], size["claim_deep"]], size["claim_samples"],
                                                   ["uniform", "mixed", "kinds"]),
    }  # fmt: skip


def _rates(drain: dict[str, Any]) -> str:
    return f"{drain['jobs_per_s']:,.0f} ({drain['steady_jobs_per_s']:,.0f})"


def _targets(r: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) for every target the results cover."""
    out: list[tuple[str, str, bool | None]] = []
    if "drain" in r:
        # Judged on the steady rates (bench.common.steady_rate): the whole-drain rate charges each
        # system's start and finish to throughput, and PgQueuer's 16 queue managers start slowly.
        umbra = {(u["mode"], u["agents"]): u["steady_jobs_per_s"] for u in r["drain"]["umbra"]}
        whole = {(u["mode"], u["agents"]): u["jobs_per_s"] for u in r["drain"]["umbra"]}
        peer = {(p["system"], p["concurrency"]): p for p in r["drain"]["peers"]}
        http_modes = [m for m in ("http-batch10", "http-chained", "http") if any(mode == m for mode, _ in umbra)]

        def measured(agents: int) -> tuple[str, float] | None:
            """The first HTTP mode measured (the fastest protocol), and the others' figures beside it."""
            figures = [(m, umbra[m, agents]) for m in http_modes if (m, agents) in umbra]
            return figures[0] if figures else None

        def beside(agents: int, mode: str) -> str:
            others = [f"{m} {umbra[m, agents]:,.0f}" for m in http_modes if m != mode and (m, agents) in umbra]
            return f"; {', '.join(others)}" if others else ""

        pgq16 = peer.get(("pgqueuer", 16))
        if (best := measured(16)) and pgq16:
            mode, rate = best
            steady = pgq16["steady_jobs_per_s"]
            out.append((f"drain over HTTP ({mode}), 16 agents ≥ 2× PgQueuer (c=16), steady rates",
                        f"{rate:,.0f} vs {steady:,.0f} jobs/s = {rate / steady:.2f}× (whole drain {whole[mode, 16]:,.0f} "
                        f"vs {pgq16['jobs_per_s']:,.0f} = {whole[mode, 16] / pgq16['jobs_per_s']:.2f}×{beside(16, mode)})",
                        rate >= 2 * steady))  # fmt: skip
        if best := measured(1):
            mode, rate = best
            out.append((f"drain over HTTP ({mode}), 1 agent ≥ 300 jobs/s, steady rate",
                        f"{rate:,.0f} jobs/s (whole drain {whole[mode, 1]:,.0f}{beside(1, mode)})", rate >= 300))  # fmt: skip
    if "submit" in r:
        batched = [s for s in r["submit"] if s["jobs_per_request"] > 1]
        for s in batched:
            out.append((f"batched submit ({s['mode']}) ≥ 25,000 jobs/s", f"{s['jobs_per_s']:,.0f} jobs/s",
                        s["jobs_per_s"] >= 25_000))  # fmt: skip
    if "wake" in r:
        row = next(x for x in r["wake"]["results"] if x["measurement"] == "long-poll, outside commit")
        out.append(("wake p50 ≤ 5 ms, p99 ≤ 25 ms", f"p50 {row['p50_ms']:.2f} ms, p99 {row['p99_ms']:.2f} ms",
                    row["p50_ms"] <= 5 and row["p99_ms"] <= 25))  # fmt: skip
    if "idle" in r:
        i = r["idle"]
        waiting_connections = 1 + i["server_db_connections_busy"]  # the LISTEN connection + any busy while parked
        out.append((f"{i['polls']:,} idle long-polls: ≤ 2 DB connections for waiting",
                    f"{waiting_connections} (LISTEN + {i['server_db_connections_busy']} busy; "
                    f"{i['server_db_connections']} open in all, the idle pool included)", waiting_connections <= 2))  # fmt: skip
        out.append(("≤ 2 claim attempts per job", f"{i['claim_attempts_per_job']:.2f}", i["claim_attempts_per_job"] <= 2))
    if "rebuild" in r:
        b = r["rebuild"]
        out.append((f"rebuild ≥ 16,000 events/s ({b['events']:,} events)", f"{b['rebuild_events_per_s']:,.0f} events/s",
                    b["rebuild_events_per_s"] >= 16_000))  # fmt: skip
    if "claim_latency" in r:
        for shape, ratio in claim_latency.ratios(r["claim_latency"]).items():
            deep = max(x["depth"] for x in r["claim_latency"])
            out.append((f"claim p50 at {deep:,} queued ≤ 2× at 1,000 ({shape} queue)", f"{ratio:.2f}×", ratio <= 2))
    return out


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.2f}" if v < 100 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def render(r: dict[str, Any]) -> str:
    meta = r["meta"]
    parts = [
        "# Benchmark results (latest run)",
        "",
        f"Run {meta['when']} on {meta['cpus']} CPUs, Python {meta['python']}, PostgreSQL {meta['postgres']}, "
        f"mode {'quick' if meta['quick'] else 'full'}. "
        "Produced by `python -m bench.run_all`; see `docs/PERFORMANCE.md` for what the figures mean. The machine is "
        "shared: figures move between runs; ratios within this run are what count.",
        "",
        "Each workload's run (start time, commit): " + "; ".join(
            f"{name} {p['when']} {p['commit']}" for name, p in r.get("provenance", {}).items()) + ".",
        "",
        "## Targets",
        "",
        _table(["target", "measured", "met"], [[t, m, {True: "yes", False: "**no**", None: "-"}[ok]] for t, m, ok in _targets(r)]),
    ]
    if r.get("failed"):
        parts += ["", "## Failed workloads", "", _table(["workload", "error"], [[k, v] for k, v in r["failed"].items()])]
    if "drain" in r:
        d = r["drain"]
        table: dict[str, dict[int, str]] = {}
        for p in d["peers"]:
            table.setdefault(p["system"], {})[p["concurrency"]] = _rates(p)
        for u in d["umbra"]:
            table.setdefault(f"umbra {u['mode']}", {})[u["agents"]] = _rates(u)
        parts += ["", f"## Drain {d['jobs']:,} no-op jobs (jobs/s; claim + complete per job)", "",
                  "Each cell: the whole drain's rate, then the steady rate in brackets: jobs per second between the "
                  "10th and the 90th percentile of completions (`bench.common.steady_rate`), which leaves out each "
                  "system's start (PgQueuer's queue managers check their schema and set up listeners before their "
                  "first job) and its last jobs. The targets are judged on the steady rates.", "",
                  "`umbra http-batch10`: agents (one keep-alive connection each, `bench/wire.py`) against a "
                  "`umbra serve` subprocess, each running ten jobs at a time: `claim?max=10`, then "
                  "`POST /v1/agent/complete?claim_next=10` reporting ten and claiming the next ten (PgQueuer's "
                  "workers fetch ten per query); `umbra http-chained`: one job at a time, each completion claiming "
                  "the next (`complete?claim_next=true`, as `umbra agent` does); `umbra http`: claim and complete as "
                  "two requests; `inproc`: "
                  "`compute.claims` one transaction per command; `inproc-grouped`: through `compute.group_commit`.", "",
                  _table(["system", *[f"c={c}" for c in CONCURRENCY]],
                         [[name, *[row.get(c, "-") for c in CONCURRENCY]] for name, row in table.items()]),
                  "", _table(["c", "umbra", "peer", "umbra / peer", "steady"],
                             [[x["concurrency"], x["umbra_mode"], x["peer"], x["ratio"], x["steady_ratio"]]
                              for x in d["ratios"]])]  # fmt: skip
        served = [u for u in d["umbra"] if "server_cpu_ms_per_job" in u]
        if served:
            parts += ["", "The HTTP server during those drains (CPU from `/proc`, batches from its `/metrics`):", "",
                      _table(["mode", "agents", "server CPU ms/job", "commands/batch", "ms/batch"],
                             [[u["mode"], u["agents"], u["server_cpu_ms_per_job"], u.get("commands_per_batch", float("nan")),
                               u.get("ms_per_batch", float("nan"))] for u in served])]  # fmt: skip
    if "submit" in r:
        parts += ["", "## Submit (jobs/s)", "", _table(["mode", "clients", "jobs/request", "jobs", "jobs/s"],
                  [[s["mode"], s["clients"], s["jobs_per_request"], s["jobs"], s["jobs_per_s"]] for s in r["submit"]])]  # fmt: skip
    if "wake" in r:
        parts += ["", "## Wake latency (commit → parked long-poll returns, ms)", "",
                  _table(["measurement", "samples", "p50", "p95", "p99", "max"],
                         [[w["measurement"], w["samples"], w["p50_ms"], w["p95_ms"], w["p99_ms"], w["max_ms"]]
                          for w in r["wake"]["results"]])]  # fmt: skip
    if "notify" in r:
        parts += ["", "## NOTIFY in the committing transaction (append one event + commit)", "",
                  _table(["writers", "tx/s", "tx/s with NOTIFY", "with / without"],
                         [[n["writers"], n["commits_per_s"], n["with_notify_per_s"], n["ratio"]] for n in r["notify"]])]  # fmt: skip
    if "idle" in r:
        i = r["idle"]
        parts += ["", f"## {i['polls']:,} idle long-polls on one server process", "", _table(["measure", "value"], [
            ["seconds to park them", i["park_seconds"]],
            ["server DB connections open / busy while parked", f"{i['server_db_connections']} / {i['server_db_connections_busy']}"],
            ["server RSS before / after parking, MB", f"{i['rss_before_mb']:.0f} / {i['rss_after_mb']:.0f}"],
            ["RSS per parked long-poll, KB", i["rss_per_poll_kb"]],
            ["jobs submitted one by one while parked", i["jobs"]],
            ["claim attempts per job", i["claim_attempts_per_job"]],
            ["long-polls answered with a job", i["jobs_claimed"]],
        ])]  # fmt: skip
    if "rebuild" in r:
        b = r["rebuild"]
        parts += ["", f"## Rebuild ({b['events']:,} events, {b['jobs']:,} jobs)", "", _table(["operation", "seconds", "events/s"], [
            ["rebuild the queue projection (fold only)", b["rebuild_seconds"], b["rebuild_events_per_s"]],
            ["verify (rebuild both views + compare with live)", b["verify_seconds"], b["verify_events_per_s"]],
        ])]  # fmt: skip
    if "claim_latency" in r:
        parts += ["", "## Claim latency vs queue depth (in-process `claims.claim`, ms)", "",
                  _table(["queue", "jobs submitted", "p50", "p95", "p99", "mean"],
                         [[c["queue"], c["depth"], c["p50_ms"], c["p95_ms"], c["p99_ms"], c["mean_ms"]] for c in r["claim_latency"]])]  # fmt: skip
    return "\n".join(parts) + "\n"


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "?"


def _meta(quick: bool, seconds: float) -> dict[str, Any]:
    import psycopg

    from .common import server_url

    with psycopg.connect(server_url()) as c:
        postgres = c.execute("SHOW server_version").fetchone()[0]
    commit = _commit()
    return {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
            "python": platform.python_version(), "postgres": postgres, "commit": commit, "quick": quick,
            "seconds": seconds}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--only", default="", help="comma-separated subset of: drain,submit,wake,notify,idle,rebuild,claim_latency")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    run_all(parser.parse_args(argv))


def run_all(args: argparse.Namespace) -> None:
    """Run the chosen workloads (``args.quick``, ``args.only``) and write latest.md / latest.json."""
    workloads = _workloads(QUICK if args.quick else FULL)
    chosen = [w for w in (args.only.split(",") if args.only else workloads) if w]
    unknown = [w for w in chosen if w not in workloads]
    if unknown:
        raise SystemExit(f"unknown workload(s): {', '.join(unknown)}; choose from {', '.join(workloads)}")
    latest = RESULTS / "latest.json"
    # A partial run (--only) replaces its workloads in the latest results and keeps the others.
    results: dict[str, Any] = json.loads(latest.read_text()) if args.only and latest.exists() else {}
    started = time.perf_counter()
    for name in chosen:
        print(f"== {name}", flush=True)
        results.setdefault("provenance", {})[name] = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                                      "commit": _commit()}  # fmt: skip
        try:
            results[name] = workloads[name]()
            results.get("failed", {}).pop(name, None)
        except Exception as exc:  # one failing workload must not lose the others' figures
            print(f"!! {name} failed: {type(exc).__name__}: {exc}", flush=True)
            results.pop(name, None)
            results.setdefault("failed", {})[name] = f"{type(exc).__name__}: {exc}"
        meta = _meta(args.quick, time.perf_counter() - started)
        meta["workloads"] = chosen
        results["meta"] = meta
        _write(results)  # after every workload, so an interrupted run keeps what it measured
    print()
    print(render(results))
    print(f"wrote {RESULTS / 'latest.md'} and latest.json")


def _write(results: dict[str, Any]) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "latest.json").write_text(json.dumps(results, indent=2, default=str))
    (RESULTS / "latest.md").write_text(render(results))


if __name__ == "__main__":
    main()
