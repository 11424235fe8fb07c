"""Several agents' claims, renewals and completions as commands of one transaction.

:mod:`umbra.compute.group_commit` gathers commands that arrive while the
previous batch commits and runs them here, in the caller's transaction. Each
command is still a command: it loads (its row, its node), decides with the same
pure rules as :mod:`umbra.compute.claims` (``check_holder`` for fencing,
``best_placement`` for eligibility), and its events go to its own stream and
are folded onto its own row. What the batch shares is the statements: one
``FOR UPDATE`` of every held row, one read of the claiming nodes (after
sharing their claim guards: :func:`umbra.compute.nodes.guard_against_claims`), one scan per
organization (the single claim's :class:`~umbra.compute.claims.ClaimableScan`),
one ``append_many``, one multi-row write, one commit.

A refusal (not the holder, cancelled, no such job) is decided before anything
is written and answers only its own command: :func:`stage` returns it as that
command's outcome, and the others go on. Two commands naming the same job are
not decided against each other here: the second is handed back for the next
batch, where it sees the first one's result.

Claims follow :func:`umbra.compute.claims.claim`: the organization's queued,
due jobs in (priority, seq) order, each requirement shape judged once per node,
only rows of shapes some waiting claimer can run are read, and only rows the
node is eligible for are locked (``FOR UPDATE SKIP LOCKED``, re-checking
queued and due in the locking statement). Claimers are served in
arrival order, each the first locked row it is eligible for, which is what the
same claims run one after another would have taken.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Collection, Mapping, Sequence
from uuid import UUID

import psycopg

from umbra.db import PreparedStatement, begin_with, commit_with, run_together, text_array, uuid_array
from umbra.domain.eligibility import NodeView, in_service, takes_kind
from umbra.domain.jobs import check_holder, repeats_completion
from umbra.domain.placement import after_placement, best_placement, takes_memory
from umbra.errors import NotFound, UmbraError
from umbra.events import store
from umbra.events.types import Event, JobClaimed, JobCompleted, JobLeaseRenewed, Placement, Progress
from umbra.projections import jobs as queue
from umbra.projections.jobs import JobRow

from .abandoned_claims import ABANDONED_COLUMN, ClaimAbandoned
from .auth import live_node_credentials, revoked
from .blocked import CORDONED, LATEST_DEVICES, RUNNING_TAKING_MEMORY, node_as_read, running_jobs, with_running_jobs_read
from .claims import (
    claim_rank,
    MAX_SHAPES, QUEUED_SHAPES, SCAN_PAGE, SHAPE_PAGE, ClaimableScan, ClaimResult, decode_shape, lock_first_of_shape, lock_queued,
    frees_room, model_holders, models_for_shapes, node_metadata, passed_over, shapes_take_memory,
)  # fmt: skip
from .jobs import ancestors_held_elsewhere, settle_parents
from .nodes import SHARE_CLAIM_GUARDS, TRY_NODE_MEMORY, guard_key, node_memory_key


@dataclass(eq=False)
class Command:
    """One agent's request. ``kind`` is ``claim``, ``renew`` or ``complete``."""

    kind: str
    organization_id: UUID
    node_id: UUID
    job_id: UUID | None = None
    attempt: int = 0
    lease_seconds: int = 60
    stale_seconds: int = 45
    result: Any = None
    #: What a renewal says of the job's progress, if anything.
    progress: Progress | None = None
    #: The node credential the request authenticated with, if the caller left its revocation check to
    #: the batch: the batch reads it in its own transaction, so a revoked credential is refused at its
    #: next command without a query of its own per request (``None``: already checked by the caller).
    credential_id: UUID | None = None
    #: Set by the batch: the command's answer (a ClaimResult, None, a JobRow) or the refusal to raise.
    outcome: Any = None
    error: BaseException | None = None
    #: Set on a claim that got nothing although nothing stood in its way but other claimers: its
    #: organization had no queued, due job, or every one it could run was just taken by others.
    nothing_left: bool = False
    #: Set on a claim left out because a change of its node or organization held the claim guard
    #: (:func:`umbra.compute.nodes.guard_against_claims`), or another claim for its node held the node's
    #: memory lock (:func:`umbra.compute.nodes.hold_node_memory`): that is committing, so the claimer
    #: should look again in a moment rather than wait for the next wake.
    guard_held: bool = False
    #: Set on a claim that took nothing but passed over jobs left to nodes that hold their models (model
    #: affinity across nodes: :func:`umbra.domain.placement.passes_over`): the seconds until the first of
    #: them has waited the affinity, when the claimer may take it. Nothing will notify it then.
    look_again_in: float | None = None
    #: A claim for the same node to run in the same transaction once this command succeeds (a completion
    #: that asks for the node's next job): staged after it, never when it is refused, deferred or repeated.
    then: Command | None = None
    #: Set on a completion sent again (its answer was lost): answered with the first result, recording
    #: nothing. Its chained claim is not made: a second job would be leased to an agent that never hears
    #: of the first (see :func:`umbra.compute.claims.claimed_with`).
    repeated: bool = False
    #: Set on a renewal or completion whose row the batch did not get: another transaction holds its lock
    #: (or its organization has no such job). It is run alone, beside the batches (``GroupCommit``), and
    #: waits for that lock there, for at most the pool's ``lock_timeout``: one row locked elsewhere (an
    #: operator's open transaction, a cancel of a large tree) never stalls every agent's batch behind it.
    locked_elsewhere: bool = False
    #: Jobs a claim takes at most (an agent that runs several at once); it gets fewer when fewer are free.
    count: int = 1
    #: Set by the batch on a claim: every job it took, in claim order (``outcome`` is the first).
    claims: list[ClaimResult] = field(default_factory=list)
    #: The HTTP request the command came in (``X-Request-ID``), recorded with its events.
    request_id: str | None = None
    #: The job kinds a claim takes (the agent's handlers); ``None``: every kind.
    kinds: frozenset[str] | None = None
    #: On the claim of a report of several results (``POST /v1/agent/complete?claim_next=N``): the
    #: completions it came with. It is made in their batch, and the event of the first of them that
    #: records names the jobs it took (``next_claims``). It is not made when one of them repeats a
    #: recorded completion (that report's answer was lost: it is answered with the claims the first
    #: made, :func:`umbra.compute.claims.claimed_with_report`) or had to run alone (its transaction could
    #: not name them); it waits with them when one of them waits for the next batch.
    reporting: tuple[Command, ...] = ()
    #: When the command was queued (``time.monotonic``): before its transaction began, so a lease it is
    #: granted is measured from here (``claims.ClaimResult.asked_at``).
    asked_at: float | None = None

    @property
    def metadata(self) -> dict[str, str]:
        return node_metadata(self.node_id, self.request_id)


@dataclass
class _Staged:
    command: Command
    state: JobRow
    event: Event
    #: The transaction's clock (``umbra_now()``, read with the row); once :func:`write` has sent the events,
    #: the time they are recorded at (later, when a row it read was changed later than that clock).
    at: datetime
    placement: Placement | None = None
    row: JobRow | None = field(default=None)


#: The batch's live credentials (of those its commands authenticated with), as one more column
#: of its first reads: the revocation check costs no statement of its own.
_LIVE_COLUMN = "(SELECT array_agg(id) FROM node_credentials WHERE id = ANY(%(credentials)s) AND revoked_at IS NULL)"
#: The held rows, locked; a row another transaction holds is skipped and its command run alone, outside the
#: batch (see ``Command.locked_elsewhere``). Only a row of the organization of a command naming it
#: (``ids`` and ``orgs`` are the commands' jobs and organizations, pair by pair): the batch mixes
#: organizations' commands, and a command naming another organization's job locked that job until the
#: batch committed, so that its own organization's claims skipped it meanwhile. Such a command finds no
#: row, as for a job that does not exist, and is refused alone (``job_not_found``).
_LOCK_HELD = f"""
SELECT {queue.SELECT_LIST}, umbra_now(), {_LIVE_COLUMN} FROM jobs
WHERE id = ANY(%(ids)s) AND (id, organization_id) IN (SELECT * FROM unnest(%(ids)s::uuid[], %(orgs)s::uuid[]))
ORDER BY id FOR UPDATE SKIP LOCKED
"""
_NODES_QUERY = f"""
SELECT n.id, n.organization_id, n.name, n.status, n.trust_domain, {LATEST_DEVICES}, l.last_seen_at, umbra_now(),
       {CORDONED}, {RUNNING_TAKING_MEMORY}, {ABANDONED_COLUMN}, {_LIVE_COLUMN}
FROM nodes n LEFT JOIN node_liveness l ON l.node_id = n.id
WHERE n.id = ANY(%(ids)s)
"""
#: The batch's independent reads, sent with its BEGIN in one round trip (``db.begin_with``). Every
#: statement of a batch is an index lookup whose best plan does not depend on the values, so the
#: batch uses generic plans: planned for each call's values, the shape scan alone cost 0.29 ms of
#: the server's time per claim.
_HELD = PreparedStatement("umbra_batch_held", _LOCK_HELD)
_GUARDS = PreparedStatement("umbra_batch_claim_guards", SHARE_CLAIM_GUARDS)
_NODES = PreparedStatement("umbra_batch_nodes", _NODES_QUERY)
_SHAPES = PreparedStatement("umbra_batch_shapes", QUEUED_SHAPES)
#: For an organization whose queue holds jobs that take memory: the claiming nodes' memory locks (those
#: free now), then, in the next statement (a snapshot taken once they are held), the nodes' running jobs.
_NODE_MEMORY = PreparedStatement("umbra_batch_node_memory", TRY_NODE_MEMORY)
_RUNNING = PreparedStatement("umbra_batch_running", f"SELECT n.id, {RUNNING_TAKING_MEMORY} FROM nodes n WHERE n.id = ANY(%(ids)s::uuid[])")
#: Every prepared statement a batch may run, prepared together on each connection (see ``db.begin_with``).
_FAMILY = (_HELD, _GUARDS, _NODES, _SHAPES, _NODE_MEMORY, _RUNNING, store.APPEND_AT, queue.TRANSITIONS)


async def stage(conn: psycopg.AsyncConnection, commands: Sequence[Command], *,
                affinity_seconds: int = 0) -> tuple[list[_Staged], list[Command]]:  # fmt: skip
    """Begin the batch's transaction, load and decide every command; returns the staged changes and the commands deferred to the next batch.

    The reads that do not depend on each other (the held rows, the claiming
    nodes, each organization's list of queued requirement shapes) travel with
    the transaction's ``BEGIN`` in one round trip; the commands' credentials
    are checked in the same statements (a last column of the held rows' and
    the nodes' reads).
    """
    credentials = list({c.credential_id for c in commands if c.credential_id is not None})
    held = [c for c in commands if c.kind != "claim"]
    # In arrival order, each chained claim right after the command it follows.
    claimers = [c for command in commands for c in (command, command.then) if c is not None and c.kind == "claim"]
    node_ids = list({c.node_id for c in claimers})
    orgs = list(dict.fromkeys(c.organization_id for c in claimers))
    credential_ids = uuid_array(credentials)
    reads = [(_HELD, {"ids": uuid_array(c.job_id for c in held), "orgs": uuid_array(c.organization_id for c in held),
                      "credentials": credential_ids})] if held else []  # fmt: skip
    if claimers:
        # The guards first: the nodes' and registries' reads then start after any change holding
        # one has committed (see nodes.guard_against_claims).
        keys = {key for c in claimers for key in (guard_key(c.organization_id, c.node_id), guard_key(c.organization_id))}
        reads.append((_GUARDS, {"keys": "{" + ",".join(map(str, sorted(keys))) + "}"}))
        requests = list({c.request_id for c in claimers if c.request_id is not None})
        reads.append((_NODES, {"ids": uuid_array(node_ids), "requests": text_array(requests), "credentials": credential_ids}))
        reads += [(_SHAPES, {"org": org, "limit": MAX_SHAPES + 1}) for org in orgs]
    results = await begin_with(conn, reads, generic_plans=True, family=_FAMILY)
    held_records = results.pop(0) if held else []
    guarded = set(results.pop(0)[0][0]) if claimers else set()
    for claimer in claimers:
        claimer.guard_held = not {guard_key(claimer.organization_id, claimer.node_id), guard_key(claimer.organization_id)} <= guarded
    node_records = results.pop(0) if claimers else []
    if credentials:
        live = await _live_credentials(conn, credentials, held_records or node_records)
        held, claimers = _refuse_revoked(held, live), _refuse_revoked(claimers, live)
    claimers = _refuse_abandoned(claimers, node_records)
    staged: list[_Staged] = []
    deferred: list[Command] = []
    if held:
        staged += _stage_held([r[:-1] for r in held_records], held, deferred)
        staged = await _ancestors_free(conn, staged)
        unstaged = {id(c.then) for c in held
                    if c.then is not None and (c.error is not None or c in deferred or c.repeated or c.locked_elsewhere)}
        for claimer in claimers:
            if any(r in deferred for r in claimer.reporting):
                deferred.append(claimer)
                unstaged.add(id(claimer))
            elif any(r.repeated or r.locked_elsewhere for r in claimer.reporting):
                unstaged.add(id(claimer))
        claimers = [c for c in claimers if id(c) not in unstaged]
    if claimers:
        # A node (or organization) whose guard a change holds is left out: its claimers take nothing this time.
        waiting, running = _waiting_claimers([r[:-2] for r in node_records
                                              if guard_key(r[1], r[0]) in guarded and guard_key(r[1]) in guarded], claimers)
        # The jobs this batch completes end their hold before its claims: their memory is not promised any more.
        ending = {item.state.id for item in staged if isinstance(item.event, JobCompleted)}
        for org, shape_records in zip(orgs, results):
            shapes = [shape for (shape,) in shape_records]
            if not shapes or waiting.get(org):
                registry = await models_for_shapes(conn, org, shapes)
                org_waiting = waiting.get(org, [])
                if org_waiting:
                    org_waiting = await _bounded_by_running_jobs(conn, org, org_waiting, running, ending, shapes, registry)
                staged += await _claim_for_org(conn, org, org_waiting, shapes, registry, claimers, affinity_seconds)
    return staged, deferred


async def _live_credentials(conn: psycopg.AsyncConnection, credentials: list[UUID], records: Sequence[Any]) -> set[UUID]:
    """The live ones among ``credentials``: from the first reads' last column, or (when they found no row) asked alone."""
    if records:
        return set(records[0][-1] or ())
    return await live_node_credentials(conn, credentials)


def _refuse_abandoned(claimers: list[Command], node_records: Sequence[Any]) -> list[Command]:
    """Answer :class:`ClaimAbandoned` to every claim whose request its agent gave up on (the nodes' read's
    next-to-last column: :data:`~umbra.compute.abandoned_claims.ABANDONED_COLUMN`); returns the others."""
    abandoned = {(record[0], request) for record in node_records for request in record[-2] or ()}
    if not abandoned:
        return claimers
    for claimer in claimers:
        if (claimer.node_id, claimer.request_id) in abandoned:
            claimer.error = ClaimAbandoned(claimer.request_id)
    return [c for c in claimers if c.error is None]


def _refuse_revoked(commands: list[Command], live: set[UUID]) -> list[Command]:
    """Answer 401 to every command whose credential is no longer live (revoked or removed); returns the others.

    Their rows may have been read (and locked) with the rest of the batch; nothing is written for them.
    """
    kept = []
    for command in commands:
        if command.credential_id is None or command.credential_id in live:
            kept.append(command)
        else:
            command.error = revoked()
    return kept


async def write(conn: psycopg.AsyncConnection, staged: Sequence[_Staged]) -> list[tuple[UUID, int, int]]:
    """Append every staged event, fold each onto its own row, write the rows, settle parents, commit; returns hints.

    The events are folded before they are appended (they are recorded at
    the transaction's clock, read with the rows; only their positions come
    later), so the append and the rows' write go in one round trip, and
    without parents to settle the ``COMMIT`` goes with them. The log's
    ordering lock, which the append takes and the commit releases, is then
    held only while PostgreSQL runs them: holding it across two round trips
    and the fold between them, the other batch in flight waited for this
    one's Python.
    """
    if not staged:
        await conn.execute("COMMIT")  # only reads (and refusals): ends the transaction, releases the locks
        return []
    links = _claims_named(staged)
    batch = [store.PendingAppend(store.job_stream(s.state.id), s.state.version, [s.event], s.state.organization_id,
                                 s.command.metadata if id(s.command) not in links else {**s.command.metadata, **links[id(s.command)]})
             for s in staged]  # fmt: skip
    last: dict[UUID, int] = {}
    children = [item for item in staged if item.state.parent_job_id]
    # The transaction's clock, or later: a job read after its last change committed, in a batch begun before
    # that change's transaction, would otherwise have its event recorded before the one it follows.
    at = max(staged[0].at, max(item.state.updated_at for item in staged))
    for item in staged:  # the time each row will carry: how a broken batch's clean-up knows its claims
        item.at = at
    append, recorded = store.append_statement(batch, recorded_at=at)
    rows = [queue.fold(item.state, event_record, job_id=item.state.id) for item, event_record in zip(staged, recorded)]
    writes = [append, (queue.TRANSITIONS, queue.transition_params(rows))]
    positions, _ = await (run_together(conn, writes) if children else commit_with(conn, writes))
    for item, row, position in zip(staged, rows, store.appended(recorded, positions)):
        item.row = queue.positioned(row, position)
    if children:
        # Parents are locked after their children and in id order, as in every other command.
        for item in sorted(children, key=lambda s: str(s.row.parent_job_id)):  # type: ignore[union-attr]
            for settled in await settle_parents(conn, [item.row], metadata=item.command.metadata):  # type: ignore[list-item]
                last[settled.organization_id] = max(last.get(settled.organization_id, 0), settled.position)
        await conn.execute("COMMIT")
    freed: dict[UUID, int] = {}  # by organization: completions that freed memory on their node
    for item in staged:
        row = item.row
        assert row is not None
        last[row.organization_id] = max(last.get(row.organization_id, 0), row.position)
        if isinstance(item.event, JobCompleted):
            freed[row.organization_id] = freed.get(row.organization_id, 0) + frees_room(item.state)
    return [(org, position, freed.get(org, 0)) for org, position in last.items()]


def _claims_named(staged: Sequence[_Staged]) -> dict[int, dict[str, Any]]:
    """What a completion's event says of the claims made with it, by completion command.

    A completion that chains a claim (``complete?claim_next=true``) names the job it took
    (``next_claim``); of a report of several results, the first completion recorded names every job
    the report's claim took (``next_claims``, in claim order). A completion or report sent again is
    answered with those jobs (:func:`umbra.compute.claims.claimed_with`, ``claimed_with_report``), and
    an auditor sees what one request did.
    """
    taken: dict[int, list[str]] = {}
    claims: list[Command] = []
    for item in staged:
        if item.command.kind == "claim":
            if id(item.command) not in taken:
                claims.append(item.command)
            taken.setdefault(id(item.command), []).append(str(item.state.id))
    if not claims:
        return {}
    links: dict[int, dict[str, Any]] = {}
    recorded = {id(item.command): item.command for item in staged if item.command.kind == "complete"}
    for command in recorded.values():
        if command.then is not None and id(command.then) in taken:
            links[id(command)] = {"next_claim": taken[id(command.then)][0]}
    for claim in claims:
        carrier = next((r for r in claim.reporting if id(r) in recorded), None)
        if carrier is not None:
            links[id(carrier)] = {"next_claims": taken[id(claim)]}
    return links


def answer(staged: Sequence[_Staged]) -> None:
    """After commit: each staged command's outcome."""
    for item in staged:
        row = item.row
        assert row is not None
        if item.command.kind == "claim":
            item.command.claims.append(ClaimResult(row, item.placement, asked_at=item.command.asked_at))  # type: ignore[arg-type]
            item.command.outcome = item.command.claims[0]
        else:
            item.command.outcome = row


# -- renew and complete ----------------------------------------------------------------


def decide_held(command: Command, row: JobRow | None, now: datetime) -> Event:
    """The event a renew or complete appends, or the refusal it raises (before anything is written)."""
    if row is None or row.organization_id != command.organization_id:
        raise NotFound("job_not_found", f"No job {command.job_id}.")
    check_holder(status=row.status, lease_owner=row.lease_owner, attempt=row.attempt, node_id=command.node_id,
                 claimed_attempt=command.attempt)  # fmt: skip
    if command.kind == "renew":
        return JobLeaseRenewed(attempt=command.attempt, lease_expires_at=now + timedelta(seconds=command.lease_seconds),
                               progress=command.progress)  # fmt: skip
    return JobCompleted(attempt=command.attempt, result=command.result)


def _stage_held(records: Sequence[Any], held: Sequence[Command], deferred: list[Command]) -> list[_Staged]:
    rows: dict[UUID, JobRow] = {r[0]: queue.from_db(r) for r in records}
    now = records[0][-1] if records else None
    staged: list[_Staged] = []
    seen: set[UUID] = set()
    for command in held:
        assert command.job_id is not None
        if command.job_id in seen:
            deferred.append(command)
            continue
        seen.add(command.job_id)
        row = rows.get(command.job_id)
        if row is None:
            command.locked_elsewhere = True
            continue
        if command.kind == "complete" and row is not None and row.organization_id == command.organization_id and \
                repeats_completion(status=row.status, lease_owner=row.lease_owner, attempt=row.attempt,
                                   node_id=command.node_id, claimed_attempt=command.attempt):  # fmt: skip
            command.outcome, command.repeated = row, True
            continue
        try:
            event = decide_held(command, row, now)  # type: ignore[arg-type]
        except UmbraError as refusal:
            command.error = refusal
            continue
        staged.append(_Staged(command, row, event, now))  # type: ignore[arg-type]
    return staged


async def _ancestors_free(conn: psycopg.AsyncConnection, staged: list[_Staged]) -> list[_Staged]:
    """Lock the ancestors of the children this batch completes, before its append; a completion one of
    whose ancestors another transaction holds is set aside (``locked_elsewhere``) and run alone beside the
    batches.

    Settling a parent (and its parent, up the chain) locks it after the
    append, which holds the log's ordering lock until commit: waiting there
    for an ancestor held elsewhere, the batch held up every writer of the log.
    """
    settling = [item for item in staged if item.state.parent_job_id is not None and isinstance(item.event, JobCompleted)]
    if not settling:
        return staged
    held_elsewhere = await ancestors_held_elsewhere(conn, [item.state.id for item in settling])
    kept = []
    for item in staged:
        if item.state.id in held_elsewhere and isinstance(item.event, JobCompleted):
            item.command.locked_elsewhere = True
        else:
            kept.append(item)
    return kept


# -- claims ------------------------------------------------------------------------------


def _waiting_claimers(records: Sequence[Any], claimers: Sequence[Command]) -> tuple[dict[UUID, list[tuple[Command, NodeView]]], dict[UUID, str | None]]:
    """Claimers whose node is in their organization, effectively online and not wholly busy, by organization;
    and each node's running jobs that take memory (the :data:`RUNNING_TAKING_MEMORY` column)."""
    stale = {c.node_id: c.stale_seconds for c in claimers}
    nodes = {
        nid: (org, node_as_read(nid, *rest, stale_seconds=stale[nid]))
        for nid, org, *rest, _running in records
        if nid in stale  # a refused claimer's node was read with the others
    }  # fmt: skip
    by_org: dict[UUID, list[tuple[Command, NodeView]]] = {}
    for command in claimers:
        org, node = nodes.get(command.node_id, (None, None))
        if node is None or org != command.organization_id or node.status != "online" or not in_service(node):
            continue  # outcome stays None: nothing this node may take
        by_org.setdefault(command.organization_id, []).append((command, node))
    return by_org, {record[0]: record[-1] for record in records}


async def _bounded_by_running_jobs(
    conn: psycopg.AsyncConnection, org: UUID, waiting: list[tuple[Command, NodeView]], running: Mapping[UUID, str | None],
    ending: Collection[UUID], shapes: Sequence[str], models: Mapping[str, Any],
) -> list[tuple[Command, NodeView]]:
    """The waiting claimers of one organization, each node bounded by the jobs it runs
    (:func:`umbra.domain.placement.with_running_jobs`), less those of a node left wholly busy.

    When a queued job a claimer may take takes memory, its node must be
    judged against what the claims before it committed: the batch takes those
    nodes' memory locks (:func:`umbra.compute.nodes.hold_node_memory`), never waiting, and
    reads their running jobs again once it holds them. A claimer whose node's
    lock another transaction holds takes nothing this time and looks again in
    a moment, as when a change holds its claim guard.
    """
    node_ids = list(dict.fromkeys(node.id for _, node in waiting))
    judging = list(dict.fromkeys(node.id for command, node in waiting if shapes_take_memory(shapes, command.kinds)))
    if judging:
        keys = "{" + ",".join(str(node_memory_key(org, node_id)) for node_id in judging) + "}"
        [[(held,)], fresh] = await run_together(conn, [(_NODE_MEMORY, {"ids": uuid_array(judging), "keys": keys}),
                                                       (_RUNNING, {"ids": uuid_array(judging)})])  # fmt: skip
        for command, node in waiting:
            if node.id in judging and node.id not in held:
                command.guard_held = True
        node_ids = [node_id for node_id in node_ids if node_id not in judging or node_id in held]
        running = {**running, **dict(fresh)}
    nodes = {node.id: node for _, node in waiting}
    bounded = await with_running_jobs_read(conn, org, [(nodes[n], running_jobs(running[n], ending)) for n in node_ids], models)
    views = dict(zip(node_ids, bounded))
    return [
        (command, views[node.id]) for command, node in waiting
        if node.id in views and in_service(views[node.id])
    ]


async def _claim_for_org(conn: psycopg.AsyncConnection, org: UUID, waiting: list[tuple[Command, NodeView]],
                         shapes: Sequence[str], models: Mapping[str, Any], claimers: Sequence[Command],
                         affinity_seconds: int = 0) -> list[_Staged]:  # fmt: skip
    judged: dict[int, dict[str, Placement | None]] = {id(command): {} for command, _ in waiting}  # by command, shape
    # Each claimer's node as its next job finds it: shared by the claimers of one node (two agents on one
    # node), so what one's job takes, the other's next job finds taken.
    node_views = {node.id: node for _, node in waiting}
    node_of = {id(command): node.id for command, node in waiting}
    claimers_of: dict[UUID, list[Command]] = {}
    for command, node in waiting:
        claimers_of.setdefault(node.id, []).append(command)
    full: set[int] = set()  # claimers whose node has room for no queued shape any more
    every_shape_judged = len(shapes) <= MAX_SHAPES

    def placement_for(command: Command, shape: str) -> Placement | None:
        mine = judged[id(command)]
        if shape not in mine:
            kind, requires = decode_shape(shape)
            mine[shape] = best_placement(node_views[node_of[id(command)]], requires, models) if takes_kind(command.kinds, kind) else None
        return mine[shape]

    def runnable(shape: str) -> bool:
        """Judged for every waiting claimer; a shape none of them may take is never read."""
        return any([placement_for(command, shape) is not None for command, _ in waiting])

    def room(node_id: UUID, shape: str, wanted: int) -> int:
        """How many more jobs of ``shape`` the node has room for, up to ``wanted``."""
        _, requires = decode_shape(shape)
        if not takes_memory(requires):
            return wanted  # no memory taken: every one fits, and nothing to judge again
        view, fits = node_views[node_id], 0
        while fits < wanted and (placed := best_placement(view, requires, models)) is not None:
            after = after_placement(view, placed, requires, models)
            if after is view:
                return wanted  # takes nothing: every one fits
            view, fits = after, fits + 1
        return fits

    def fitting(view: NodeView, ids: list[UUID], shape_of: Mapping[UUID, str], most: int) -> tuple[list[UUID], NodeView]:
        """Of ``ids`` (in claim order), the first ``most`` the node (as ``view`` finds it) has room for together,
        each placed before the next; and the node as they leave it."""
        fit: list[UUID] = []
        for job_id in ids:
            if len(fit) == most:
                break
            _, requires = decode_shape(shape_of[job_id])
            placed = best_placement(view, requires, models)
            if placed is not None:
                view = after_placement(view, placed, requires, models)
                fit.append(job_id)
        return fit, view

    def claimed(command: Command, node: NodeView, row: JobRow, now: datetime, placement: Placement, shape: str) -> None:
        """Stage the claim; the memory the job takes on its device is not there for the command's next job."""
        staged.append(_claimed(command, node, row, now, placement))
        before = node_views[node.id]
        after = after_placement(before, placement, row.requires, models)
        if after is not before:
            node_views[node.id] = after
            for claimer in claimers_of[node.id]:
                judged[id(claimer)] = {}  # judged again, against what is left
                if every_shape_judged and not any(placement_for(claimer, other) is not None for other in shapes):
                    full.add(id(claimer))  # it stops reading the queue: nothing queued fits any more

    staged: list[_Staged] = []
    saw_eligible: set[int] = set()  # claimers that saw a row they could run
    holders = await model_holders(conn, org, shapes, lambda shape: [placement_for(command, shape) for command, _ in waiting],
                                  models, affinity_seconds=affinity_seconds,
                                  stale_seconds=waiting[0][0].stale_seconds if waiting else 0)  # fmt: skip
    passing_over: dict[int, float] = {}  # by claimer: the seconds until the first row it left to a holder is its to take
    # Each waiting claimer wants its first `want` eligible rows: enough for it even if earlier claimers take theirs.
    want = sum(command.count for command, _ in waiting)
    left = {id(command): command.count for command, _ in waiting}
    named = [command.kinds for command, _ in waiting]
    any_kind_of = None if not named or None in named else frozenset().union(*named)  # type: ignore[arg-type]
    scan = ClaimableScan(conn, org, shapes, runnable, per_shape=min(max(SHAPE_PAGE, want), SCAN_PAGE), kinds=any_kind_of,
                         waited=affinity_seconds > 0)  # fmt: skip
    locked_here: set[UUID] = set()  # rows this transaction has locked for a claimer: it could lock them again
    only = scan.only_shape()
    if only is not None and not holders.any and all(placement_for(command, only) is not None for command, _ in waiting):
        # Every waiting claimer can run the one shape any of them can: the claim order is that shape's own,
        # and its first rows are found and locked in one statement, then handed out in arrival order.
        # Only as many rows as the claimers' nodes have room for: a row locked and not handed out would be
        # skipped, until this commit, by a claimer of the other batch in flight, which might then say
        # nothing is left when it is.
        wanted_of = {node_id: sum(left[id(c)] for c in of) for node_id, of in claimers_of.items()}
        locked = await lock_first_of_shape(conn, org, only, count=min(sum(room(n, only, w) for n, w in wanted_of.items()), SCAN_PAGE))
        handed = 0
        for command, node in list(waiting):
            while handed < len(locked) and (placement := placement_for(command, only)) is not None:
                record = locked[handed]
                handed += 1
                claimed(command, node, queue.from_db(record), record[-1], placement, only)
                locked_here.add(record[0])
                left[id(command)] -= 1
                if not left[id(command)]:
                    break
            if not left[id(command)] or placement_for(command, only) is None:
                waiting.remove((command, node))  # served, or its node has no room for another of the one shape
        if not waiting:
            return staged
        # Rows ran out among the shape's first ones (held by other claimers, or none left): read on page by page.
    async for page in scan.pages():
        shape_of: dict[UUID, str] = {}
        by_shape: dict[str, list[UUID]] = {}  # each shape's rows, in queue order
        for job_id, _priority, _seq, shape, *_ in page:
            shape_of[job_id] = shape
            by_shape.setdefault(shape, []).append(job_id)
        row_of = {row[0]: row for row in page} if holders.any else {}

        def its_to_take(command: Command, job_id: UUID) -> bool:
            """Not a row the claimer leaves to a node that holds its models (noted, with when it may take it)."""
            placement = placement_for(command, shape_of[job_id])
            wait = passed_over(row_of[job_id], placement, node_of[id(command)], holders, affinity_seconds)
            if wait is None:
                return True
            passing_over[id(command)] = min(wait, passing_over.get(id(command), wait))
            return False

        order = {job_id: index for index, job_id in enumerate(shape_of)}
        rank = claim_rank(page, affinity_seconds) if affinity_seconds else None
        taking_memory = {shape for shape in by_shape if takes_memory(decode_shape(shape)[1])}
        tried = set(locked_here)  # rows of this page no claimer may be promised: taken, or held elsewhere
        ready: dict[UUID, tuple[JobRow, datetime]] = {}  # rows this batch has locked and not handed out yet
        # Only rows a claimer is promised are locked: in arrival order, each claimer is promised its first
        # untried eligible rows no earlier claimer was promised, as many as it still wants (and its node has
        # room for). Locking every claimer's first rows left rows locked that no claimer took, and until this
        # commit the other batch in flight skipped them: it took a later job, or said nothing was left, while
        # they stayed queued. When a promised row turns out to be held by another transaction, the promises
        # are made again without it (the rows locked meanwhile kept), so each claimer gets the rows it would
        # have got alone, in arrival order; once every promised row is locked, each takes its own.
        while waiting:
            promised: dict[int, list[UUID]] = {}
            taken_by_promise: set[UUID] = set()
            # Each node as the rows promised to its claimers so far leave it: two claimers of one node are
            # promised no more than it has room for together.
            promised_views: dict[UUID, NodeView] = {}
            for command, node in waiting:
                shapes_here = [shape for shape in by_shape if placement_for(command, shape) is not None]
                if shapes_here:
                    saw_eligible.add(id(command))
                unpromised = [[j for j in by_shape[shape]
                               if j not in tried and j not in taken_by_promise and (not row_of or its_to_take(command, j))][:want]
                              for shape in shapes_here]  # fmt: skip
                in_rank = order.__getitem__ if rank is None else rank(lambda shape, command=command: placement_for(command, shape))
                ids = (unpromised[0] if len(unpromised) == 1
                       else sorted((j for ids in unpromised for j in ids), key=in_rank)[:want])  # fmt: skip
                if taking_memory.intersection(shapes_here):
                    view = promised_views.get(node.id, node_views[node.id])
                    ids, promised_views[node.id] = fitting(view, ids, shape_of, left[id(command)])
                promised[id(command)] = ids[:left[id(command)]]
                taken_by_promise.update(promised[id(command)])
            if not taken_by_promise:
                break
            to_lock = [job_id for job_id in taken_by_promise if job_id not in ready]
            if to_lock:
                for record in await lock_queued(conn, org, to_lock):
                    ready[record[0]] = (queue.from_db(record), record[-1])
                held_elsewhere = {job_id for job_id in to_lock if job_id not in ready}
                if held_elsewhere:
                    tried.update(held_elsewhere)
                    continue  # promise again without them
            handed = False
            for command, node in list(waiting):
                for job_id in promised[id(command)]:
                    row, now = ready[job_id]
                    placement = placement_for(command, shape_of[job_id])
                    if placement is None:
                        continue  # no room once an earlier row of its node was placed: left for another claimer
                    del ready[job_id]
                    claimed(command, node, row, now, placement, shape_of[job_id])
                    locked_here.add(job_id)
                    tried.add(job_id)
                    handed = True
                    left[id(command)] -= 1
                    if not left[id(command)] or id(command) in full:
                        waiting.remove((command, node))
                        break
            waiting[:] = [(command, node) for command, node in waiting if id(command) not in full]  # filled by another
            if not handed:
                break  # the rows promised fit no claimer as they were placed: the next page, or nothing
        if not waiting:
            break
    if scan.nothing_due:
        for command in claimers:
            if command.organization_id == org:
                command.nothing_left = True
    for command, node in waiting:
        if left[id(command)] == command.count:  # a claim that took some jobs got what there was
            # Beaten to the rows it could run, it may say nothing is left only when nothing queued is
            # for anyone else: every queued shape is one it can run. Otherwise its wake token must go on
            # to a waiter that can run the rest.
            runs_all = every_shape_judged and all(judged[id(command)].get(shape) is not None for shape in shapes)
            command.nothing_left = scan.nothing_due or (id(command) in saw_eligible and runs_all)
            if id(command) in passing_over:  # left to holders: its wake goes on to them, and it looks again later
                command.nothing_left, command.look_again_in = False, max(0.0, passing_over[id(command)])
    return staged


def _claimed(command: Command, node: NodeView, row: JobRow, now: datetime, placement: Placement) -> _Staged:
    event = JobClaimed(attempt=row.attempt + 1, node_id=node.id, placement=placement,
                       lease_expires_at=now + timedelta(seconds=command.lease_seconds))  # fmt: skip
    return _Staged(command, row, event, now, placement)
