"""``umbra jobs explain ID``: why a job is (not) running, read as a person would ask it; ``umbra jobs
retry ID`` and ``retry-failed``: send failed jobs back to the queue; ``umbra jobs priority ID N``: move
a job to another priority; ``umbra jobs cancel ID`` and ``cancel-waiting``: withdraw work.

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


async def _send(client, job_id, verb: str, body: dict[str, Any], params: dict[str, str] | None = None) -> dict[str, Any]:
    """``POST /v1/jobs/{id}/{verb}``: the job as it now stands; a refusal raises ``ServiceError``."""
    from umbra.agent.client import raise_for_error

    answer = await client.post(f"/v1/jobs/{job_id}/{verb}", json=body, params=params)
    raise_for_error(answer)
    return answer.json()


def _one_job(args, verb: str, body: dict[str, Any], line) -> int:
    """Send ``verb`` for ``args.job_id`` and print the job as it then stands (``line(job)``, or JSON)."""

    async def main() -> int:
        async with _client(args, scope="jobs:write") as client:
            job = await _send(client, args.job_id, verb, body)
        print(to_json_text(job) if args.json else printable(line(job)))
        return 0

    return anyio.run(main)


def cmd_retry(args) -> int:
    return _one_job(args, "retry", {} if args.max_attempts is None else {"max_attempts": args.max_attempts}, format_job)


def cmd_priority(args) -> int:
    return _one_job(args, "priority", {"priority": args.priority},
                    lambda job: f"{job['id']}  {job['status']}  priority {job['priority']}")  # fmt: skip


def cmd_cancel(args) -> int:
    return _one_job(args, "cancel", {}, format_job)


def _every_job(args, *, statuses: str, verb: str, body: dict[str, Any], done_key: str,
               params: dict[str, str] | None = None) -> int:  # fmt: skip
    """Send ``verb`` (with ``params``) for every job of ``statuses`` (of ``args.kind``, if given): listed
    first, in submission order, then one by one. Those the server refuses for the job's own sake (404, 409:
    ended, retried, claimed or moved meanwhile, or not a job the verb applies to) are counted with the
    reason and left as they are; any other refusal (the key, the request, the server) stops the run, the
    rest untouched."""

    async def main() -> int:
        from umbra.agent.client import ServiceError

        async with _client(args, scope="jobs:write") as client:
            listed, after = [], 0
            while True:
                kinds = {} if args.kind is None else {"kind": args.kind}
                page = await _get_json(client, "/v1/jobs", status=statuses, limit=1000, after=after, **kinds)
                listed += [job["id"] for job in page["jobs"]]
                if page["next"] is None:
                    break
                after = int(page["next"])
            done: list[str] = []
            refused: list[dict[str, str]] = []
            for job_id in listed:
                try:
                    job = await _send(client, job_id, verb, body, params)
                except ServiceError as exc:
                    if exc.status not in (404, 409):
                        raise
                    refused.append({"id": job_id, "error": exc.code, "message": exc.message})
                    continue
                done.append(job_id)
                if not args.json:
                    print(printable(format_job(job)))
        if args.json:
            print(to_json_text({done_key: done, "refused": refused}))
        else:
            for refusal in refused:
                print(printable(f"{refusal['id']}  not {done_key}: {refusal['error']}: {refusal['message']}"))
            print(f"{done_key} {len(done)} of {len(listed)} {statuses.replace(',', ' or ')} job(s)")
        return 0

    return anyio.run(main)


def cmd_retry_failed(args) -> int:
    """Retry every failed job (of ``--kind``, if given): after an outage that failed a thousand jobs (a driver
    rolled out broken, a registry entry fixed since), what one ``retry`` does for one. Children and jobs
    that made children are refused by the server and left as they are."""
    return _every_job(args, statuses="failed", verb="retry", done_key="retried",
                      body={} if args.max_attempts is None else {"max_attempts": args.max_attempts})  # fmt: skip


def cmd_cancel_waiting(args) -> int:
    """Cancel every queued or blocked job (of ``--kind``, if given): a batch submitted by mistake, or work no
    longer wanted, withdrawn before it runs. Running jobs are left to finish (``umbra jobs cancel ID`` stops
    one): each cancel asks ``if_waiting``, so a job claimed after the listing is refused, not stopped."""
    return _every_job(args, statuses="queued,blocked", verb="cancel", body={}, done_key="cancelled",
                      params={"if_waiting": "true"})  # fmt: skip


def _jobs_subparsers(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """The ``jobs`` command group's subcommands, created here unless another registrar already did."""
    if "jobs" not in sub.choices:
        group = sub.add_parser("jobs", help="jobs: explain, retry, reprioritize, cancel")
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
                            help="move a waiting job to another priority",
                            description="Give a queued or blocked job another priority (lower runs first): it takes "
                            "its place among the jobs of that priority by submission (POST /v1/jobs/{id}/priority). "
                            "Refused for a job running, ended or that made children.")  # fmt: skip
    priority.add_argument("priority", type=int, help="the new priority (lower runs first; submissions default to 100)")

    _job_command(sub, "cancel", func=cmd_cancel, scope="jobs:write", json_help="print the cancelled job as JSON",
                 help="cancel a job",
                 description="Cancel a job (POST /v1/jobs/{id}/cancel): a queued or blocked one ends at once; a running "
                 "one ends, and its agent learns so at its next renewal and stops it. A job that made children "
                 "cancels its open children too. Refused for a job that already ended.")  # fmt: skip

    retry_failed = _every_job_command(
        sub, "retry-failed", func=cmd_retry_failed, done_key="retried",
        help="send every failed job (of one kind) back to the queue",
        description="Retry every failed job, or those of --kind: each as `umbra jobs retry` would, in submission "
        "order. Jobs the server will not retry (children, jobs that made children) are listed and left as they are.")  # fmt: skip
    retry_failed.add_argument("--max-attempts", type=int, default=None,
                              help="runs each retry grants, 1..100 (default: as many as each job was submitted with)")  # fmt: skip
    _every_job_command(
        sub, "cancel-waiting", func=cmd_cancel_waiting, done_key="cancelled",
        help="cancel every queued or blocked job (of one kind)",
        description="Cancel every job not yet running, or those of --kind: each as `umbra jobs cancel` would, in "
        "submission order. Running jobs are left to finish. Jobs that started or ended meanwhile are listed and "
        "left as they are.")  # fmt: skip


def _every_job_command(sub: argparse._SubParsersAction, name: str, *, func, done_key: str, **texts: str):
    """A ``jobs`` subcommand sent for every job of a status (:func:`_every_job`), of ``--kind`` if given."""
    p = _jobs_subparsers(sub).add_parser(name, **texts)
    p.add_argument("--kind", default=None, help="only jobs of this kind")
    p.add_argument("--server", default=None, help=SERVER_HELP)
    p.add_argument("--api-key", default=None, help="API key with jobs:read and jobs:write (default UMBRA_API_KEY)")
    p.add_argument("--json", action="store_true", help=f'print {{"{done_key}": [id, ...], "refused": [...]}} as JSON')
    p.set_defaults(func=func)
    return p


__all__ = ["cmd_cancel", "cmd_cancel_waiting", "cmd_explain", "cmd_priority", "cmd_retry", "cmd_retry_failed", "format_explanation", "format_job", "register"]
