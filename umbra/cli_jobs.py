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
import contextlib
import math
import sys
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Sequence

import anyio

from umbra.events import documents
from umbra.events.types import TERMINAL_JOB_STATUSES

from .cli_events import PAGE_SIZE, SERVER_HELP, _client, _get_json, printable, to_json_text


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
    dependencies = body.get("dependencies") or []
    if dependencies:
        lines.append("depends on:")
        lines += [f"  {d['job_id']}  {d['status']}" for d in dependencies]
        lines.append("")
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


async def _listed(client, *, statuses: str | None, kind: str | None, limit: int | None = None) -> list[dict[str, Any]]:
    """``GET /v1/jobs``, page after page: the jobs of ``statuses`` (comma-separated; None: any) and ``kind``
    (None: any), in submission order, the first ``limit`` of them (None: all)."""
    listed: list[dict[str, Any]] = []
    after = 0
    while limit is None or len(listed) < limit:
        filters = {"status": statuses} if statuses else {}
        if kind is not None:
            filters["kind"] = kind
        size = PAGE_SIZE if limit is None else min(PAGE_SIZE, limit - len(listed))
        page = await _get_json(client, "/v1/jobs", limit=size, after=after, **filters)
        listed += page["jobs"]
        if page["next"] is None:
            break
        after = int(page["next"])
    return listed


def _json_object(text: str) -> dict[str, Any]:
    """A ``--payload`` or ``--requires`` argument: a JSON object, its numbers kept as written
    (:mod:`umbra.events.documents`: no digit lost to a float, none past a double's range refused)."""
    try:
        value = documents.decode(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"seconds\": 3}'")
    return value


#: The headers of a body encoded here (:mod:`umbra.events.documents`, exact numbers), not by httpx.
_JSON = {"Content-Type": "application/json"}


def _batches(job: dict[str, Any], count: int) -> list[int]:
    """How many of ``count`` copies of ``job`` each ``POST /v1/jobs/batch`` carries: as many as fit in a body
    (the server's limit for every body, less room for the envelope; and in a batch, 10,000), in order."""
    from umbra.api.http import MAX_BODY_BYTES

    size = len(documents.encode(job)) + 1
    per_batch = max(1, min(10_000, (MAX_BODY_BYTES - 1024) // size))
    return [min(per_batch, count - start) for start in range(0, count, per_batch)]


def _moment(text: str) -> datetime:
    """An ISO 8601 time for ``--not-before``; one without an offset is this machine's local time."""
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00") if text.endswith("Z") else text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r} (e.g. 2026-12-24T18:00:00Z)") from None
    return moment if moment.tzinfo is not None else moment.astimezone()


def cmd_submit(args) -> int:
    """Submit ``--count`` jobs of one kind: one ``POST /v1/jobs``, or ``POST /v1/jobs/batch`` of as many as a
    body holds, batch after batch (each all or nothing; those sent before a refusal stand, their ids printed).
    Prints each job's id, a line each (or the jobs as JSON)."""
    from umbra.agent.client import raise_for_error
    from umbra.errors import InvalidRequest

    if args.count > 1 and args.idempotency_key is not None:
        raise InvalidRequest("--idempotency-key names one job: it cannot go with --count.")
    job: dict[str, Any] = {"kind": args.kind, "payload": args.payload or {}, "requires": args.requires or {}}
    not_before = args.not_before
    if args.delay is not None:
        not_before = datetime.now(timezone.utc) + timedelta(seconds=args.delay)
    for field, value in (("priority", args.priority), ("max_attempts", args.max_attempts),
                         ("idempotency_key", args.idempotency_key), ("depends_on", args.depends_on),
                         ("not_before", not_before and not_before.isoformat())):  # fmt: skip
        if value is not None:
            job[field] = value

    async def main() -> int:
        jobs: list[dict[str, Any]] = []
        try:
            async with _client(args, scope="jobs:write") as client:
                if args.count == 1:
                    answer = await client.post("/v1/jobs", content=documents.encode(job), headers=_JSON)
                    raise_for_error(answer)
                    jobs.append(documents.decode(answer.content))
                for size in _batches(job, args.count) if args.count > 1 else []:
                    answer = await client.post("/v1/jobs/batch", content=documents.encode({"jobs": [job] * size}),
                                               headers=_JSON)  # fmt: skip
                    raise_for_error(answer)
                    jobs += documents.decode(answer.content)["jobs"]
        except BaseException:
            if jobs and not args.json:  # the batches sent before the refusal stand: say which
                print("\n".join(j["id"] for j in jobs))
            raise
        print(to_json_text(jobs if args.count > 1 else jobs[0]) if args.json else "\n".join(j["id"] for j in jobs))
        return 0

    return anyio.run(main)


def cmd_list(args) -> int:
    async def main() -> int:
        async with _client(args, scope="jobs:read") as client:
            jobs = await _listed(client, statuses=args.status, kind=args.kind, limit=args.limit)
        if args.json:
            print(to_json_text(jobs))
        else:
            for job in jobs:
                print(printable(f"{job['kind']:<16} {format_job(job)}"))
        return 0

    return anyio.run(main)


def format_details(job: dict[str, Any]) -> list[str]:
    """The lines ``umbra jobs show`` prints for one job: what it is, where it stands, where it runs."""
    lines = [f"{job['id']}  {job['kind']}  {job['status']}  priority {job['priority']}",
             f"attempt {job['attempt']} of at most {job['max_attempts']} runs"]  # fmt: skip
    placement = job.get("placement")
    if placement:
        lines.append(f"on {placement['node_id']}/{placement['device_id']} ({placement['reason']}), "
                     f"lease until {job.get('lease_expires_at') or '-'}")  # fmt: skip
    progress = job.get("progress") or {}
    if progress:
        done = f"{round(progress['fraction'] * 100)}%" if progress.get("fraction") is not None else ""
        lines.append("progress: " + " ".join(part for part in (done, progress.get("message") or "") if part))
    if job.get("depends_on"):
        lines.append("depends on: " + ", ".join(job["depends_on"]))
    for name in ("blocked_reason", "error"):
        if job.get(name):
            lines.append(f"{name.replace('_', ' ')}: {job[name]}")
    if job.get("result") is not None:
        lines.append(f"result: {documents.encode(job['result']).decode()}")
    lines.append(f"submitted {job['created_at']}, started {job.get('started_at') or '-'}, "
                 f"finished {job.get('finished_at') or '-'}")  # fmt: skip
    return lines


def cmd_show(args) -> int:
    async def main() -> int:
        async with _client(args, scope="jobs:read") as client:
            job = await _get_json(client, f"/v1/jobs/{args.job_id}")
        print(to_json_text(job) if args.json else "\n".join(printable(line) for line in format_details(job)))
        return 0

    return anyio.run(main)


#: ``umbra jobs wait``'s exit status when the job ended otherwise than complete (failed, cancelled, partial): not
#: 1, which every ``umbra`` command exits with when it could not do what it was asked (a refusal, no server).
ENDED_OTHERWISE_EXIT = 3
#: ``umbra jobs wait``'s exit status when the job had not ended by ``--timeout`` (as ``timeout(1)``'s).
STILL_OPEN_EXIT = 124
#: How long ``umbra jobs wait`` goes on asking a server it cannot reach, or that answers 5xx or 429 (restarting,
#: its database away), before it gives up (exit 1).
UNREACHABLE_SECONDS = 60.0


async def wait_for_end(client, job_id: Any, timeout: float | None, *, limiter: anyio.CapacityLimiter | None = None,
                       looks: anyio.CapacityLimiter | None = None, round_seconds: int | None = None,
                       look_first: bool = False) -> dict[str, Any]:
    """The job once it ended (``GET /v1/jobs/{id}?wait=``, round after round), or as it stands after ``timeout``
    seconds (None: no limit).

    Each round asks for whole seconds no further than the deadline (nor than
    ``round_seconds``), each such read holding a turn of ``limiter`` while it
    waits; ``look_first`` reads the job at once (``wait=0``, no turn of
    ``limiter`` needed) before the first round. Reads that do not wait (that
    first look, and the look at the deadline of a read that found no turn)
    hold a turn of ``looks``, when given: a thousand jobs looked at all at
    once queued a thousand requests on the client's pool, whose hand-out is
    quadratic in the queue, and the deadline passed by half a minute. A
    round answered early with the job still open (a server stopping, or one
    without ``?wait=``) is followed by a pause, not asked again at once; a
    server restarting is asked again, backing off, for up to
    :data:`UNREACHABLE_SECONDS`.
    """
    import httpx

    from umbra.agent.client import ServiceError
    from umbra.agent.runner import backoff_delay
    from umbra.api.jobs import MAX_JOB_WAIT_SECONDS

    deadline = None if timeout is None else time.monotonic() + timeout
    unreachable_since: float | None = None
    failures = 0
    longest = MAX_JOB_WAIT_SECONDS if round_seconds is None else min(round_seconds, MAX_JOB_WAIT_SECONDS)
    path = f"/v1/jobs/{job_id}"

    def remaining() -> tuple[float | None, int]:
        """The seconds left, and the whole seconds a read may wait for."""
        left = None if deadline is None else deadline - time.monotonic()
        return left, longest if left is None else max(0, min(longest, int(left)))

    async def look() -> dict[str, Any]:
        """The job as it stands (``wait=0``), read in a turn of ``looks``."""
        async with looks or contextlib.nullcontext():
            return await _get_json(client, path, wait=0)

    async def ask(first: bool) -> tuple[dict[str, Any], float | None, int]:
        """One read, with the seconds that were left and the wait asked for. A read that waits takes a turn of
        ``limiter`` first, no later than the deadline (none by then: the job as it stands)."""
        if first:
            left, _ = remaining()
            return await look(), left, 0
        if limiter is None:
            left, seconds = remaining()
            return await _get_json(client, path, wait=seconds), left, seconds
        with anyio.move_on_after(math.inf if deadline is None else max(0.0, deadline - time.monotonic())):
            async with limiter:
                left, seconds = remaining()
                return await _get_json(client, path, wait=seconds), left, seconds
        return await look(), 0.0, 0

    while True:
        asked = time.monotonic()
        try:
            job, left, seconds = await ask(look_first)
            look_first = False
        except (httpx.TransportError, ServiceError) as exc:
            # The server or its database restarting (no connection, a 5xx, a 429), as ``events tail --follow``
            # takes them; a refusal of the request itself (401, 404, 422) is final.
            if isinstance(exc, ServiceError) and exc.status < 500 and exc.status != 429:
                raise
            unreachable_since = asked if unreachable_since is None else unreachable_since
            left, _ = remaining()
            if time.monotonic() - unreachable_since >= UNREACHABLE_SECONDS or (left is not None and left <= 0):
                raise
            failures += 1
            pause = max(backoff_delay(failures, 0.5, 5.0), getattr(exc, "retry_after", None) or 0.0)
        else:
            unreachable_since, failures = None, 0
            if job["status"] in TERMINAL_JOB_STATUSES or (left is not None and left < 1):
                if job["status"] in TERMINAL_JOB_STATUSES or left <= 0:
                    return job
                pause = left  # under a second left: the last read comes at the deadline
            else:
                pause = 1.0 if seconds and time.monotonic() - asked < seconds - 0.5 else 0.0
        if deadline is not None:
            pause = min(pause, max(0.0, deadline - time.monotonic()))
        await anyio.sleep(pause)


#: Reads ``umbra jobs wait`` has waiting at once (one connection each); with more jobs than this, they take
#: turns, each read then waiting at most :data:`TURN_SECONDS`.
WAITS_AT_ONCE = 32
TURN_SECONDS = 5


async def wait_for_all(client, job_ids: Sequence[Any], timeout: float | None, *, fail_fast: bool = False) -> list[dict[str, Any]]:
    """Each job once it ended, in the order given, waited for together, or as it stands at ``timeout`` (for all
    of them together). ``fail_fast``: as soon as one ends otherwise than complete, the others are read as they
    stand and no longer waited for. The first error (no such job, no server) ends every wait and is raised as
    it is.

    Every job is read once at once (``wait=0``, :data:`WAITS_AT_ONCE` at a time, beside the reads that wait),
    so a job that does not exist, or already ended, is told before any read waits. At most
    :data:`WAITS_AT_ONCE` reads wait at a time; with more jobs than that, each read waits at most
    :data:`TURN_SECONDS` and they take turns (first come, first served), so a job behind the others is still
    asked about every few seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    ended: dict[str, dict[str, Any]] = {}
    errors: list[BaseException] = []
    limiter, looks = anyio.CapacityLimiter(WAITS_AT_ONCE), anyio.CapacityLimiter(WAITS_AT_ONCE)
    distinct = list(dict.fromkeys(job_ids))  # a job named twice is waited for once
    turn = TURN_SECONDS if len(distinct) > WAITS_AT_ONCE else None

    async with anyio.create_task_group() as tg:
        async def wait_one(job_id: str) -> None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                job = await wait_for_end(client, job_id, left, limiter=limiter, looks=looks, round_seconds=turn,
                                         look_first=True)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - raised below, the others' waits ended
                errors.append(exc)
                tg.cancel_scope.cancel()
                return
            ended[job_id] = job
            if fail_fast and job["status"] in TERMINAL_JOB_STATUSES and job["status"] != "complete":
                tg.cancel_scope.cancel()

        for job_id in distinct:
            tg.start_soon(wait_one, job_id)
    if errors:
        raise errors[0]
    for job_id in job_ids:  # those still waited for when one failed: as they stand
        if job_id not in ended:
            ended[job_id] = await _get_json(client, f"/v1/jobs/{job_id}")
    return [ended[job_id] for job_id in job_ids]


def cmd_wait(args) -> int:
    """Wait for jobs to end and print them: exit 0 when every one completed, :data:`ENDED_OTHERWISE_EXIT` when
    one ended otherwise (failed, cancelled, partial), :data:`STILL_OPEN_EXIT` when ``--timeout`` passed first,
    1 when it could not tell (no such job, no server); so ``umbra jobs wait ID && next-step`` runs the next
    step only after a success, and ``umbra jobs wait $(umbra jobs submit ... --count 20)`` after twenty.

    The jobs are waited for together (:func:`wait_for_all`), ``--timeout`` counting for all of them: the run
    ends with the last of them, or, with ``--fail-fast``, with the first that ends otherwise than complete."""

    async def main() -> int:
        async with _client(args, scope="jobs:read") as client:
            jobs = await wait_for_all(client, args.job_ids, args.timeout, fail_fast=args.fail_fast)
        if args.json:
            print(to_json_text(jobs[0] if len(jobs) == 1 else jobs))
        elif len(jobs) == 1:
            print("\n".join(printable(line) for line in format_details(jobs[0])))
        else:
            print("\n".join(printable(format_job(job)) for job in jobs))
        if any(job["status"] in TERMINAL_JOB_STATUSES and job["status"] != "complete" for job in jobs):
            return ENDED_OTHERWISE_EXIT
        open_ = [job for job in jobs if job["status"] not in TERMINAL_JOB_STATUSES]
        if open_:
            print(f"umbra: {len(open_)} of {len(jobs)} job(s) still open after {args.timeout:g} s "
                  f"({', '.join(sorted({job['status'] for job in open_}))})", file=sys.stderr)  # fmt: skip
            return STILL_OPEN_EXIT
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
            listed = [job["id"] for job in await _listed(client, statuses=statuses, kind=args.kind)]
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
        group = sub.add_parser("jobs", help="jobs: submit, list, show, wait, explain, retry, reprioritize, cancel")
        return group.add_subparsers(dest="jobs_command", required=True)
    for action in sub.choices["jobs"]._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    raise RuntimeError("the jobs command group has no subcommands")


def _through_the_api(p: argparse.ArgumentParser, func, *, scope: str, json_help: str) -> None:
    """The options every ``jobs`` subcommand takes: where the service is, the API key (holding ``scope``),
    ``--json``; and what runs it."""
    p.add_argument("--server", default=None, help=SERVER_HELP)
    p.add_argument("--api-key", default=None, help=f"API key with {scope} (default UMBRA_API_KEY)")
    p.add_argument("--json", action="store_true", help=json_help)
    p.set_defaults(func=func)


def _job_command(sub: argparse._SubParsersAction, name: str, *, func, scope: str, json_help: str, **texts: str):
    """A ``jobs`` subcommand about one job, through the API with an API key holding ``scope``."""
    from umbra.cli import _uuid

    p = _jobs_subparsers(sub).add_parser(name, **texts)
    p.add_argument("job_id", type=_uuid)
    _through_the_api(p, func, scope=scope, json_help=json_help)
    return p


def register(sub: argparse._SubParsersAction) -> None:
    from umbra.cli import _uuid, _within

    p = _jobs_subparsers(sub).add_parser(
        "submit", help="submit jobs of one kind",
        description="Submit a job (POST /v1/jobs), or --count of the same at once (POST /v1/jobs/batch); prints "
        "each job's id.")  # fmt: skip
    p.add_argument("kind")
    p.add_argument("--payload", type=_json_object, default=None, help="the job's payload, a JSON object")
    p.add_argument("--requires", type=_json_object, default=None,
                   help='its requirements, a JSON object, e.g. \'{"vram_min_mb": 16000, "models": ["llama"]}\'')  # fmt: skip
    p.add_argument("--priority", type=int, default=None, help="lower runs first (default 100)")
    p.add_argument("--max-attempts", type=_within(1, 100), default=None, help="runs it may take, 1..100 (default 3)")
    p.add_argument("--idempotency-key", default=None, help="submitted again with it, the first job is answered")
    p.add_argument("--depends-on", type=_uuid, action="append", default=None, metavar="ID",
                   help="a job this one runs after (it waits until that one completes); repeat for several")  # fmt: skip
    p.add_argument("--count", type=_within(1, 100_000), default=1,
                   help="how many of it, 1 to 100000 (in batches of as many as a request body holds)")
    later = p.add_mutually_exclusive_group()
    later.add_argument("--not-before", type=_moment, default=None, metavar="TIME",
                       help="run it no sooner than this ISO 8601 time (without an offset: this machine's local time); "
                       "until then it waits, blocked")  # fmt: skip
    later.add_argument("--delay", type=_within(0, 366 * 86_400, number=float, unit=" seconds"), default=None,
                       metavar="SECONDS", help="run it no sooner than this many seconds from now (by this machine's clock)")
    _through_the_api(p, cmd_submit, scope="jobs:write", json_help="print the job (or the list of jobs) as JSON")

    p = _jobs_subparsers(sub).add_parser("list", help="list jobs, in submission order",
                                         description="List jobs (GET /v1/jobs) in submission order, filtered.")
    p.add_argument("--status", default=None, help="comma-separated statuses, e.g. queued,running")
    p.add_argument("--kind", default=None, help="only jobs of this kind")
    p.add_argument("--limit", type=_within(1), default=100, help="at most this many (default 100)")
    _through_the_api(p, cmd_list, scope="jobs:read", json_help="print the jobs as JSON")

    _job_command(sub, "show", func=cmd_show, scope="jobs:read", json_help="print the Job object as JSON",
                 help="a job: where it stands, where it runs, how far it is",
                 description="Show a job (GET /v1/jobs/{id}): its status and attempts, its placement and lease, its "
                 "progress, its error or result.")  # fmt: skip
    wait = _jobs_subparsers(sub).add_parser(
        "wait", help="wait for jobs to end, then show them",
        description="Wait until each job ends (GET /v1/jobs/{id}?wait=, no polling; several waited for together), then "
        "show it as `show` does (several: a line each, as `list`, in the order given). "
        f"Exit 0 if every one completed, {ENDED_OTHERWISE_EXIT} if one failed, was cancelled or settled partial, "
        f"{STILL_OPEN_EXIT} if --timeout passed first, 1 if it could not tell (no such job; no server for "
        f"{UNREACHABLE_SECONDS:g} s).")  # fmt: skip
    wait.add_argument("job_ids", type=_uuid, nargs="+", metavar="JOB_ID")
    _through_the_api(wait, cmd_wait, scope="jobs:read", json_help="print the Job object (several: a list) as JSON")
    wait.add_argument("--timeout", type=_within(0, 10**7, number=float, unit=" seconds"), default=None,
                      help="give up after this many seconds, for all the jobs together (default: as long as it takes)")
    wait.add_argument("--fail-fast", action="store_true",
                      help=f"stop waiting as soon as one job fails, is cancelled or settles partial (exit {ENDED_OTHERWISE_EXIT}), "
                      "showing the others as they stand")  # fmt: skip
    _job_command(sub, "explain", func=cmd_explain, scope="jobs:read", json_help="print the explain answer as JSON",
                 help="why a job is or is not running",
                 description="Explain a job: a summary, the devices that could run it ranked best first, and every other "
                 "device with the first rule it fails (GET /v1/jobs/{id}/explain).")  # fmt: skip
    retry = _job_command(sub, "retry", func=cmd_retry, scope="jobs:write", json_help="print the retried job as JSON",
                         help="send a failed job back to the queue",
                         description="Retry a failed job: the same job queued again in its place, with more runs, its "
                         "history going on (POST /v1/jobs/{id}/retry). Refused for a job that did not fail or belongs "
                         "to a tree.")  # fmt: skip
    retry.add_argument("--max-attempts", type=_within(1, 100), default=None,
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
    retry_failed.add_argument("--max-attempts", type=_within(1, 100), default=None,
                              help="runs each retry grants, 1..100 (default: as many as each job was submitted with)")  # fmt: skip
    _every_job_command(
        sub, "cancel-waiting", func=cmd_cancel_waiting, done_key="cancelled",
        help="cancel every queued or blocked job (of one kind)",
        description="Cancel every job not yet running, or those of --kind: each as `umbra jobs cancel` would, in "
        "submission order. Running jobs are left to finish (a job split into children, though, settles once its "
        "last open child is cancelled). Jobs that started or ended meanwhile are listed and left as they are.")  # fmt: skip


def _every_job_command(sub: argparse._SubParsersAction, name: str, *, func, done_key: str, **texts: str):
    """A ``jobs`` subcommand sent for every job of a status (:func:`_every_job`), of ``--kind`` if given."""
    p = _jobs_subparsers(sub).add_parser(name, **texts)
    p.add_argument("--kind", default=None, help="only jobs of this kind")
    _through_the_api(p, func, scope="jobs:read and jobs:write",
                     json_help=f'print {{"{done_key}": [id, ...], "refused": [...]}} as JSON')  # fmt: skip
    return p


__all__ = ["cmd_cancel", "cmd_cancel_waiting", "cmd_explain", "cmd_list", "cmd_priority", "cmd_retry", "cmd_retry_failed",
           "cmd_show", "cmd_submit", "cmd_wait", "wait_for_all", "wait_for_end", "format_details", "format_explanation", "format_job", "register"]
