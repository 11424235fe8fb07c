"""``umbra jobs explain ID``: why a job is (not) running, read as a person would ask it; ``umbra jobs
retry ID`` and ``retry-failed``: send failed jobs back to the queue; ``umbra jobs priority ID N``: move
a job to another priority.

An HTTP client like ``umbra events tail|replay``: it sees what an API key of
one organization may see (``jobs:read``) and prints the service's own answer
(``GET /v1/jobs/{id}/explain``): the summary sentence first, then the devices
that could take the job ranked best first, then every other device with the
first rule it fails.
"""

from __future__ import annotations

import argparse
from typing import Any

import anyio

from .cli_events import SERVER_HELP, _client, _get_json, printable, to_json_text


def _where(entry: dict[str, Any]) -> str:
    label = entry.get("device_label")
    return f"{entry['node_name']}/{label}" if label is not None else f"{entry['node_name']} (no devices)"


def _mb(entry: dict[str, Any]) -> str:
    if entry.get("needed_mb") is None:
        return ""
    return f" (needs {entry['needed_mb']} MB, has {entry['available_mb']} MB)"


def format_explanation(body: dict[str, Any]) -> list[str]:
    """The lines ``umbra jobs explain`` prints for one explain answer."""
    lines = [body["summary"], ""]
    placement = body.get("placement")
    if placement:
        where = f"{body.get('placement_node_name') or placement['node_id']}/{placement['device_id']}"
        lines += [f"placement: {where} via {placement['via']} ({placement['reason']})", ""]
    eligible = body.get("eligible") or []
    if eligible:
        width = max(len(_where(e)) for e in eligible)
        lines.append("eligible, best first:")
        for rank, e in enumerate(eligible, 1):
            marks = (" resident" if e["resident"] else "") + (
                f" evicts {','.join(e['would_evict'])}" if e["would_evict"] else ""
            )
            lines.append(f"  {rank:>2}. {_where(e):<{width}}  via {e['via']:<4}  score {float(e['score']):<8g} "
                         f"{e['placement_reason']}{marks}")  # fmt: skip
    ineligible = body.get("ineligible") or []
    if ineligible:
        width = max(len(_where(r)) for r in ineligible)
        lines.append("ineligible:")
        for r in ineligible:
            lines.append(f"      {_where(r):<{width}}  {r['reason'] or 'no reason: reports no devices'}{_mb(r)}")
    if not eligible and not ineligible and not placement:
        lines.append("no devices to judge")
    return lines[:-1] if lines[-1] == "" else lines


def cmd_explain(args) -> int:
    async def main() -> int:
        async with _client(args, scope="jobs:read") as client:
            body = await _get_json(client, f"/v1/jobs/{args.job_id}/explain")
        if args.json:
            print(to_json_text(body))
        else:
            print("\n".join(printable(line) for line in format_explanation(body)))
        return 0

    return anyio.run(main)


def format_job(job: dict[str, Any]) -> str:
    """One line for a job: its id, status, and where its runs stand."""
    line = f"{job['id']}  {job['status']}  attempt {job['attempt']} of at most {job['max_attempts']} runs"
    return line + (f"  (last error: {job['error']})" if job.get("error") else "")


async def _retry(client, job_id, max_attempts: int | None) -> dict[str, Any]:
    """``POST /v1/jobs/{id}/retry``: the job as it now stands; a refusal raises ``ServiceError``."""
    from umbra.agent.client import raise_for_error

    answer = await client.post(f"/v1/jobs/{job_id}/retry", json={} if max_attempts is None else {"max_attempts": max_attempts})
    raise_for_error(answer)
    return answer.json()


def cmd_retry(args) -> int:
    async def main() -> int:
        async with _client(args, scope="jobs:write") as client:
            job = await _retry(client, args.job_id, args.max_attempts)
        print(to_json_text(job) if args.json else printable(format_job(job)))
        return 0

    return anyio.run(main)


def cmd_priority(args) -> int:
    async def main() -> int:
        from umbra.agent.client import raise_for_error

        async with _client(args, scope="jobs:write") as client:
            answer = await client.post(f"/v1/jobs/{args.job_id}/priority", json={"priority": args.priority})
            raise_for_error(answer)
        job = answer.json()
        print(to_json_text(job) if args.json else printable(f"{job['id']}  {job['status']}  priority {job['priority']}"))
        return 0

    return anyio.run(main)


def cmd_retry_failed(args) -> int:
    """Retry every failed job (of ``--kind``, if given): after an outage that failed a thousand jobs (a driver
    rolled out broken, a registry entry fixed since), what one ``retry`` does for one. Failed jobs are listed
    first, in submission order, then retried one by one; those the server refuses (a child, a job that made
    children, one retried or cancelled meanwhile) are counted with the reason and left as they are."""

    async def main() -> int:
        from umbra.agent.client import ServiceError

        async with _client(args, scope="jobs:write") as client:
            failed, after = [], 0
            while True:
                kinds = {} if args.kind is None else {"kind": args.kind}
                page = await _get_json(client, "/v1/jobs", status="failed", limit=1000, after=after, **kinds)
                failed += [job["id"] for job in page["jobs"]]
                if page["next"] is None:
                    break
                after = int(page["next"])
            retried: list[str] = []
            refused: list[dict[str, str]] = []
            for job_id in failed:
                try:
                    job = await _retry(client, job_id, args.max_attempts)
                except ServiceError as exc:
                    if exc.status not in (404, 409):
                        raise  # the request, the key or the server, not this job: stop here, the rest untouched
                    refused.append({"id": job_id, "error": exc.code, "message": exc.message})
                    continue
                retried.append(job_id)
                if not args.json:
                    print(printable(format_job(job)))
        if args.json:
            print(to_json_text({"retried": retried, "refused": refused}))
        else:
            for refusal in refused:
                print(printable(f"{refusal['id']}  not retried: {refusal['error']}: {refusal['message']}"))
            print(f"retried {len(retried)} of {len(failed)} failed job(s)")
        return 0

    return anyio.run(main)


def _jobs_subparsers(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """The ``jobs`` command group's subcommands, created here unless another registrar already did."""
    if "jobs" not in sub.choices:
        group = sub.add_parser("jobs", help="jobs: why one is or is not running; retry a failed one; reprioritize")
        return group.add_subparsers(dest="jobs_command", required=True)
    for action in sub.choices["jobs"]._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    raise RuntimeError("the jobs command group has no subcommands")


def _job_command(sub: argparse._SubParsersAction, name: str, *, func, scope: str, json_help: str, **texts: str):
    """A ``jobs`` subcommand about one job, through the API with an API key holding ``scope``."""
    from umbra.cli import _uuid

    p = _jobs_subparsers(sub).add_parser(name, **texts)
    p.add_argument("job_id", type=_uuid)
    p.add_argument("--server", default=None, help=SERVER_HELP)
    p.add_argument("--api-key", default=None, help=f"API key with {scope} (default UMBRA_API_KEY)")
    p.add_argument("--json", action="store_true", help=json_help)
    p.set_defaults(func=func)
    return p


def register(sub: argparse._SubParsersAction) -> None:
    _job_command(sub, "explain", func=cmd_explain, scope="jobs:read", json_help="print the explain answer as JSON",
                 help="why a job is or is not running",
                 description="Explain a job: a summary, the devices that could run it ranked best first, and every other "
                 "device with the first rule it fails (GET /v1/jobs/{id}/explain).")  # fmt: skip
    retry = _job_command(sub, "retry", func=cmd_retry, scope="jobs:write", json_help="print the retried job as JSON",
                         help="send a failed job back to the queue",
                         description="Retry a failed job: the same job queued again in its place, with more runs, its "
                         "history going on (POST /v1/jobs/{id}/retry). Refused for a job that did not fail or belongs "
                         "to a tree.")  # fmt: skip
    retry.add_argument("--max-attempts", type=int, default=None,
                       help="runs the retry grants, 1..100 (default: as many as the job was submitted with)")  # fmt: skip

    priority = _job_command(sub, "priority", func=cmd_priority, scope="jobs:write", json_help="print the job as JSON",
                            help="move a job that has not ended to another priority",
                            description="Give a queued, blocked or running job another priority (lower runs first): "
                            "it takes its place among the jobs of that priority by submission (POST "
                            "/v1/jobs/{id}/priority). Refused for a job that ended or made children.")  # fmt: skip
    priority.add_argument("priority", type=int, help="the new priority (lower runs first; submissions default to 100)")

    p = _jobs_subparsers(sub).add_parser(
        "retry-failed", help="send every failed job (of one kind) back to the queue",
        description="Retry every failed job, or those of --kind: each as `umbra jobs retry` would, in submission "
        "order. Jobs the server will not retry (children, jobs that made children) are listed and left as they are.")  # fmt: skip
    p.add_argument("--kind", default=None, help="only jobs of this kind")
    p.add_argument("--max-attempts", type=int, default=None,
                   help="runs each retry grants, 1..100 (default: as many as each job was submitted with)")  # fmt: skip
    p.add_argument("--server", default=None, help=SERVER_HELP)
    p.add_argument("--api-key", default=None, help="API key with jobs:read and jobs:write (default UMBRA_API_KEY)")
    p.add_argument("--json", action="store_true", help='print {"retried": [id, ...], "refused": [...]} as JSON')
    p.set_defaults(func=cmd_retry_failed)


__all__ = ["cmd_explain", "cmd_priority", "cmd_retry", "cmd_retry_failed", "format_explanation", "format_job", "register"]
