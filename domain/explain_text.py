"""Explain's one-sentence summaries: what a person reads first, and can act on.

Each sentence is built from the same verdicts the explain lists carry (and, for
a blocked job, from the blocking reason :func:`blocking_reason` computes), so
the summary can never say something the lists contradict. Numbers come from
the rules' own arithmetic (``needed_mb``/``available_mb`` of a verdict), never
recomputed here.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Collection, Mapping, Sequence
from uuid import UUID

from umbra.events.types import Placement, Requirements

from .eligibility import NodeView, missing_models, required_accelerators, takes_kind
from .explain import EligibleDevice, IneligibleDevice, QueueStanding
from .jobs import dependencies_of
from .models import RegisteredModel

#: How a blocking reason's code reads in a sentence.
_BLOCKING_CODES = {
    "no_eligible_device": "no registered device could ever run it",
    "model_not_registered": "it names a model that is not registered",
}
#: Node-level reasons, in the order their clauses are written.
_NODE_STATES = {
    "node_offline": "offline",
    "node_provisioning": "still provisioning (paired, never heard from)",
    "node_draining": "draining",
    "node_retired": "retired",
}


def _count(n: int, noun: str, plural: str | None = None) -> str:
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def _be(n: int) -> str:
    return "is" if n == 1 else "are"


def moment(value: datetime) -> str:
    return value.astimezone(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _where(node_name: str | None, placement: Placement) -> str:
    return f"{node_name or str(placement.node_id)[:8]}/{placement.device_id}"


def _largest(refused: Sequence[IneligibleDevice], reason: str, memory: str) -> str | None:
    matching = [r for r in refused if r.reason == reason]
    if not matching:
        return None
    best = max(matching, key=lambda r: r.available_mb or 0)  # max keeps the first of equals
    return (
        f"needs {best.needed_mb} MB {memory}, the largest free is {best.available_mb} MB "
        f"on {best.node_name}/{best.device_label}"
    )


def refusal_clauses(
    refused: Sequence[IneligibleDevice], requires: Requirements, models: Mapping[str, RegisteredModel],
    nodes: Sequence[NodeView] = (),
) -> list[str]:
    """Why no device can take the job now, most actionable first (memory, then capabilities, then nodes)."""
    memory = (_largest(refused, "vram_insufficient", "VRAM"), _largest(refused, "ram_insufficient", "RAM"))
    clauses = [clause for clause in memory if clause]
    busy = sum(1 for r in refused if r.reason == "device_busy")
    if busy:
        clauses.append(f"{_count(busy, 'GPU')} {_be(busy)} busy (no free VRAM)")
    lacking = sum(1 for r in refused if r.reason == "accelerator_missing")
    if lacking:
        wanted = ", ".join(sorted(required_accelerators(requires, models)))
        clauses.append(f"{_count(lacking, 'device')} {'lacks' if lacking == 1 else 'lack'} {wanted}")
    cordoned = sum(1 for r in refused if r.reason == "device_cordoned")
    if cordoned:
        clauses.append(f"{_count(cordoned, 'device')} {_be(cordoned)} cordoned")
    if any(r.reason == "model_not_registered" for r in refused):
        clauses.append(f"model {', '.join(missing_models(requires, models))} is not registered")
    outside = len({r.node_id for r in refused if r.reason == "trust_domain"})
    if outside:
        domains = ", ".join(requires.trust_domains)
        clauses.append(f"{_count(outside, 'node')} {_be(outside)} outside trust domain {domains}")
    for reason, state in _NODE_STATES.items():
        count = len({r.node_id for r in refused if r.reason == reason})
        if count:
            clauses.append(f"{_count(count, 'node')} {_be(count)} {state}")
    listed = {r.node_id for r in refused}
    bare = sum(1 for node in nodes if not node.devices and node.id not in listed)  # no device, no rule failed
    if bare:
        clauses.append(f"{_count(bare, 'node')} {'reports' if bare == 1 else 'report'} no devices")
    return clauses


def queued_summary(
    eligible: Sequence[EligibleDevice],
    refused: Sequence[IneligibleDevice],
    *,
    nodes: Sequence[NodeView],
    requires: Requirements,
    models: Mapping[str, RegisteredModel],
    standing: QueueStanding,
    not_before: datetime | None,
    kind: str | None = None,
    kinds_taken: Mapping[UUID, Collection[str] | None] | None = None,
) -> str:
    """Where a queued job would run and what keeps it waiting, or why nothing can take it now.

    ``kinds_taken`` holds the job kinds each node's agent takes, as its
    heartbeat reported them (absent or None: every kind). An eligible device
    whose agent has no handler for ``kind`` never claims the job, so the best
    device named is one whose agent takes it, and when there is none that is
    what the job waits for.
    """
    not_due = (
        f"it is not due until {moment(not_before)} ({standing.due_in_seconds:.0f} s from now, a retry backoff)"
        if not_before is not None and standing.due_in_seconds > 0
        else None
    )
    if not eligible:
        clauses = refusal_clauses(refused, requires, models, nodes) if nodes else ["no nodes are paired in this organization"]
        return "No device can take it now: " + "; ".join([*clauses, *([not_due] if not_due else [])]) + "."
    takes = kinds_taken or {}
    takers = [e for e in eligible if kind is None or takes_kind(takes.get(e.node_id), kind)]
    if not takers:
        handled = sorted({k for e in eligible for k in (takes.get(e.node_id) or ())})
        names = list(dict.fromkeys(e.node_name for e in eligible))
        one = len(names) == 1
        where = names[0] if one else _count(len(names), "node")
        whose = f"{'its agent does' if one else 'their agents do'} not take kind {kind!r}"
        taken = f" ({'it takes' if one else 'they take'} {', '.join(handled)})" if handled else ""
        waits = [f"{whose}{taken}: it waits for an agent with a handler for it", *([not_due] if not_due else [])]
        return f"Can run on {_count(len(eligible), 'device')} of {where}, but " + "; ".join(waits) + "."
    best = takers[0]
    head = (
        f"Can run on {_count(len(takers), 'device')}; the best is {best.node_name}/{best.device_label} "
        f"via {best.via} (score {best.score:g}, {best.placement_reason})"
    )
    waits = [w for w in (not_due,) if w]
    if standing.ahead:
        ahead = _count(standing.ahead, "job")
        waits.append(f"{ahead} ahead of it in the queue would be claimed first by the same nodes")
    if standing.left_to:
        one = len(standing.left_to) == 1
        waits.append(f"nodes that would load {', '.join(requires.models)} leave it to {', '.join(standing.left_to)}, "
                     f"which {'holds' if one else 'hold'} {'it' if len(requires.models) == 1 else 'them'}, "
                     f"for {standing.left_for_seconds:.0f} s more (model affinity)")  # fmt: skip
    if not waits:
        waits.append("nothing holds it back: the next claim by an eligible node takes it")
    return head + "; " + " and ".join(waits) + "."


def describe_blocking(reason: str) -> str:
    code, _, detail = reason.partition(": ")
    phrase = _BLOCKING_CODES.get(code, code)
    return f"{phrase}: {detail}" if detail else phrase


def blocked_summary(*, stored: str | None, current: str | None, fails_at: datetime | None) -> str:
    """A blocked job's sentence from the reason judged now (the function the queue stores it with)."""
    if current is None:
        return (
            f"Blocked ({stored}), but a device could run it now; it returns to the queue at the next "
            "re-examination (a pairing, a heartbeat with changed devices, or a model update)."
        )
    deadline = f"; it fails at {moment(fails_at)} unless a node or model change lets it run" if fails_at else ""
    return f"Blocked because {describe_blocking(current)}{deadline}."


def delayed_summary(*, not_before: datetime, now: datetime, eligible: int) -> str:
    """A job submitted to run later, waiting for its ``not_before`` (``eligible``: the devices that could run it
    now)."""
    left = (not_before - now).total_seconds()
    when = (f"it is not due until {moment(not_before)} ({left:.0f} s from now)" if left > 0
            else f"it fell due at {moment(not_before)}: it is released at the sweeper's next tick")  # fmt: skip
    could = (f"{_count(eligible, 'device')} could run it now" if eligible
             else "no device could run it now, so it would be blocked for that")  # fmt: skip
    return f"Submitted to run later: {when}. Then it is judged and queued as a new job ({could})."


def waiting_summary(statuses: Sequence[tuple[UUID, str]], *, not_due: datetime | None = None) -> str:
    """A job waiting for the jobs it depends on (``statuses``: each, in order, with its status now); ``not_due``:
    the ``not_before`` it was submitted with, when that is still to come (it waits for it next)."""
    by_id = dict(statuses)
    state = dependencies_of([job_id for job_id, _ in statuses], by_id)
    if state.ended_otherwise is not None:
        job_id, ended = state.ended_otherwise
        return f"Waiting for the jobs it depends on, but job {job_id} ended {ended}: it fails at the sweeper's next tick."
    then = (f"it then waits until {moment(not_due)}, when it was submitted to run, and is judged and queued as a new job"
            if not_due is not None else "it is then judged and queued as a new job")  # fmt: skip
    if not state.open:
        if not_due is not None:
            return (f"The jobs it depends on have all completed: at the sweeper's next look it goes on waiting, until "
                    f"{moment(not_due)}, when it was submitted to run, then is judged and queued as a new job.")
        return "The jobs it depends on have all completed: it is released at the sweeper's next tick."
    listed = ", ".join(f"{job_id} ({by_id[job_id]})" for job_id in state.open)
    return (f"Waiting for {len(state.open)} of the {len(statuses)} jobs it depends on to complete: {listed}. "
            f"{then[0].upper()}{then[1:]}; it fails if one of them fails or is cancelled.")


def placed_summary(
    *,
    status: str,
    placement: Placement | None,
    node_name: str | None,
    attempt: int,
    max_attempts: int,
    lease_seconds_left: float | None,
    error: str | None,
    result: Any,
    children: tuple[int, int] | None,
    uncharged: int = 0,
) -> str:
    """A running or finished job: where it ran and how it ended.

    ``children`` is ``(total, finished)`` for a job that was split into
    children (a container), None otherwise. ``uncharged`` counts its claims
    not charged against its attempts (given back unheard, or ended by its
    node's revocation): they are attempts (fencing tokens) but not charged
    runs, so "attempt 4 of 3" is said as attempt 4, the second run of three.
    """
    where = _where(node_name, placement) if placement else None
    runs = attempt - uncharged
    of_max = (f"{attempt} (run {runs} of {max_attempts}; {_count(uncharged, 'earlier claim')} not charged)"
              if uncharged else f"{attempt} of {max_attempts}")  # fmt: skip
    if status == "running":
        if children is not None:
            total, finished = children
            of = _count(total, "child", "children")
            return f"Running as a container: {finished} of {of} finished; it settles when all have."
        if placement is None:
            return f"Running, attempt {of_max}."
        head = f"Running on {where} via {placement.via} ({placement.reason}), attempt {of_max}"
        if lease_seconds_left is None:
            return head + "."
        if lease_seconds_left >= 0:
            return head + f"; its lease expires in {lease_seconds_left:.0f} s."
        return head + f"; its lease expired {-lease_seconds_left:.0f} s ago and the sweeper will requeue or fail it."
    if status == "complete":
        if children is not None and isinstance(result, dict) and result.get("detail"):
            return f"Complete: {result['detail']}."
        return f"Complete on {where} after attempt {attempt}." if where else f"Complete after attempt {attempt}."
    said = _sentence(error)
    if status == "partial":
        return f"Partial: {said}"
    if status == "failed":
        if attempt == 0:
            return f"Failed without running: {said}"
        on = f" on {where}" if where else ""
        if runs < max_attempts:  # not "attempt 1 of 3": no attempt is left, the failure was final
            ran = f"run {runs}, attempt {attempt}" if uncharged else f"attempt {attempt}"
            return f"Failed for good after {ran} (of up to {max_attempts}){on}: {said}"
        return f"Failed after attempt {of_max}{on}: {said}"
    if status == "cancelled":
        if children is not None:  # its open children were cancelled with it: all have ended now
            return f"Cancelled as a container of {_count(children[0], 'child', 'children')}; those still open were cancelled with it."
        if where:
            return f"Cancelled while running on {where}."
        if attempt:
            return f"Cancelled while waiting, after {_count(attempt, 'attempt')}."
        return "Cancelled before it ran."
    raise ValueError(f"not a placed or finished status: {status}")


def _sentence(text: str | None) -> str:
    """``text`` ending in one full stop: an agent's error message may bring its own."""
    text = (text or "").rstrip()
    return text if text.endswith((".", "!", "?")) else text + "."
