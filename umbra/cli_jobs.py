"""``umbra jobs explain ID``: why a job is (not) running, read as a person would ask it.

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


def _jobs_subparsers(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """The ``jobs`` command group's subcommands, created here unless another registrar already did."""
    if "jobs" not in sub.choices:
        group = sub.add_parser("jobs", help="read jobs: why one is or is not running")
        return group.add_subparsers(dest="jobs_command", required=True)
    for action in sub.choices["jobs"]._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    raise RuntimeError("the jobs command group has no subcommands")


def register(sub: argparse._SubParsersAction) -> None:
    from umbra.cli import _uuid

    p = _jobs_subparsers(sub).add_parser(
        "explain",
        help="why a job is or is not running",
        description="Explain a job: a summary, the devices that could run it ranked best first, and every other "
        "device with the first rule it fails (GET /v1/jobs/{id}/explain).",
    )
    p.add_argument("job_id", type=_uuid)
    p.add_argument("--server", default=None, help=SERVER_HELP)
    p.add_argument("--api-key", default=None, help="API key with jobs:read (default UMBRA_API_KEY)")
    p.add_argument("--json", action="store_true", help="print the explain answer as JSON")
    p.set_defaults(func=cmd_explain)


__all__ = ["cmd_explain", "format_explanation", "register"]
