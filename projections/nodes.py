"""The ``nodes`` projection: a pure fold of each node's event stream.

``fold`` is the only code that turns node events into a row; commands apply it
to the events they just appended and ``rebuild`` applies it to the whole log,
so a live row and a rebuilt one are equal or ``verify`` says where they differ.

``last_heartbeat_at`` here is when the last ``node.heartbeat`` *event* was
recorded (coalescing reads it); when the node was last *heard from* is
``node_liveness.last_seen_at``, a measurement deliberately outside the fold.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

import msgspec
import psycopg

from umbra.domain.nodes import after_draining, after_heartbeat, after_revoked, after_went_offline
from umbra.events.store import LOG_COLUMNS, RecordedEvent, recorded_from_row
from umbra.events.types import (
    Device,
    NodeCreated,
    NodeCredentialRevoked,
    NodeDeviceCordoned,
    NodeDeviceUncordoned,
    NodeDraining,
    NodeHeartbeat,
    NodePaired,
    NodeRetired,
    NodeWentOffline,
    UnknownEvent,
)

from .long_folds import FOLD_PAGE, long_fold


@dataclass(frozen=True, slots=True)
class NodeState:
    id: UUID
    organization_id: UUID
    name: str
    status: str
    trust_domain: str
    locality: str | None
    transport: str | None
    agent_version: str | None
    agent_started_at: datetime | None
    last_heartbeat_at: datetime | None
    devices: tuple[Device, ...]
    version: int
    position: int
    created_at: datetime
    updated_at: datetime
    #: The job kinds its agent takes, as last reported (sorted); None: not reported (every kind).
    kinds: tuple[str, ...] | None = None
    #: Devices an operator took out of service, by label, each with the reason given (None: none given),
    #: sorted by label.
    cordoned: tuple[tuple[str, str | None], ...] = ()

    def as_row(self) -> dict[str, Any]:
        """The comparable row shape shared by :func:`rebuild` and :func:`live`."""
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        row["devices"] = msgspec.to_builtins(self.devices)
        row["cordoned"] = dict(self.cordoned)
        return row

    @property
    def cordoned_labels(self) -> frozenset[str]:
        return frozenset(label for label, _ in self.cordoned)


def fold(state: NodeState | None, recorded: RecordedEvent) -> NodeState:
    """Apply one recorded node event. Pure: the same inputs give the same row."""
    event = recorded.event
    if state is None:
        if not isinstance(event, NodeCreated):
            raise ValueError(f"{recorded.stream} v{recorded.version}: a node stream must open with node.created")
        return NodeState(
            id=UUID(recorded.stream.split(":", 1)[1]),
            organization_id=recorded.organization_id,
            name=event.name,
            status="provisioning",
            trust_domain=event.trust_domain,
            locality=event.locality,
            transport=event.transport,
            agent_version=None,
            agent_started_at=None,
            last_heartbeat_at=None,
            devices=(),
            version=recorded.version,
            position=recorded.position,
            created_at=recorded.recorded_at,
            updated_at=recorded.recorded_at,
        )
    stamp = {"version": recorded.version, "position": recorded.position, "updated_at": recorded.recorded_at}
    if isinstance(event, NodePaired):
        return dataclasses.replace(state, agent_version=event.agent_version, devices=event.devices, **stamp)
    if isinstance(event, NodeHeartbeat):
        return dataclasses.replace(
            state,
            status=after_heartbeat(state.status),
            devices=event.devices,
            agent_version=event.agent_version if event.agent_version is not None else state.agent_version,
            agent_started_at=event.agent_started_at if event.agent_started_at is not None else state.agent_started_at,
            kinds=state.kinds if event.kinds is None else (event.kinds or None),  # () names none: every kind
            last_heartbeat_at=recorded.recorded_at,
            **stamp,
        )
    if isinstance(event, NodeWentOffline):
        return dataclasses.replace(state, status=after_went_offline(state.status), **stamp)
    if isinstance(event, NodeDraining):
        return dataclasses.replace(state, status=after_draining(state.status), **stamp)
    if isinstance(event, NodeRetired):
        return dataclasses.replace(state, status="retired", **stamp)
    if isinstance(event, NodeCredentialRevoked):
        return dataclasses.replace(state, status=after_revoked(state.status), **stamp)
    if isinstance(event, NodeDeviceCordoned):
        others = tuple(pair for pair in state.cordoned if pair[0] != event.device)
        return dataclasses.replace(state, cordoned=tuple(sorted((*others, (event.device, event.reason)))), **stamp)
    if isinstance(event, NodeDeviceUncordoned):
        return dataclasses.replace(state, cordoned=tuple(pair for pair in state.cordoned if pair[0] != event.device), **stamp)
    if isinstance(event, UnknownEvent):  # a newer writer's: skipped, the stream's version still advances
        return dataclasses.replace(state, **stamp)
    raise ValueError(f"{recorded.stream} v{recorded.version}: {recorded.type} is not a node event")


_COLUMNS = (
    "id, organization_id, name, status, trust_domain, locality, transport, agent_version, agent_started_at, "
    "last_heartbeat_at, devices, version, position, created_at, updated_at, kinds, cordoned"
)

_WRITE = f"""
INSERT INTO nodes ({_COLUMNS})
VALUES (%(id)s, %(organization_id)s, %(name)s, %(status)s, %(trust_domain)s, %(locality)s, %(transport)s,
        %(agent_version)s, %(agent_started_at)s, %(last_heartbeat_at)s, %(devices)s::jsonb, %(version)s,
        %(position)s, %(created_at)s, %(updated_at)s, %(kinds)s, %(cordoned)s::jsonb)
ON CONFLICT (id) DO UPDATE SET
    name = EXCLUDED.name, status = EXCLUDED.status, trust_domain = EXCLUDED.trust_domain,
    locality = EXCLUDED.locality, transport = EXCLUDED.transport, agent_version = EXCLUDED.agent_version,
    agent_started_at = EXCLUDED.agent_started_at, last_heartbeat_at = EXCLUDED.last_heartbeat_at,
    devices = EXCLUDED.devices, version = EXCLUDED.version, position = EXCLUDED.position,
    updated_at = EXCLUDED.updated_at, kinds = EXCLUDED.kinds, cordoned = EXCLUDED.cordoned
"""


async def write(conn: psycopg.AsyncConnection, state: NodeState) -> None:
    """Upsert the row for ``state`` on the caller's connection (and transaction)."""
    params = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    params["devices"] = msgspec.json.encode(state.devices).decode()
    params["kinds"] = None if state.kinds is None else list(state.kinds)
    params["cordoned"] = msgspec.json.encode(dict(state.cordoned)).decode()
    await conn.execute(_WRITE, params)


_devices_type = tuple[Device, ...]


def from_row(row: tuple) -> NodeState:
    """A ``nodes`` row (selected as :data:`COLUMNS`) as a :class:`NodeState`."""
    values = list(row[:WIDTH])
    values[10] = msgspec.convert(values[10], _devices_type)
    values[15] = None if values[15] is None else tuple(values[15])
    values[16] = tuple(sorted(values[16].items())) if values[16] else ()
    return NodeState(*values)


#: The column list :func:`from_row` expects, for readers that join other tables.
COLUMNS = ", ".join(f"n.{c.strip()}" for c in _COLUMNS.split(","))
#: How many they are: a reader's own columns follow, from ``row[WIDTH]`` on.
WIDTH = len(_COLUMNS.split(","))


async def load(
    conn: psycopg.AsyncConnection,
    node_id: UUID,
    *,
    organization_id: UUID | None = None,
    for_update: bool = False,
) -> NodeState | None:
    """One node row; ``organization_id`` scopes it, ``for_update`` locks it."""
    query = f"SELECT {COLUMNS} FROM nodes n WHERE n.id = %s AND (%s::uuid IS NULL OR n.organization_id = %s)"
    if for_update:
        query += " FOR UPDATE"
    row = await (await conn.execute(query, (node_id, organization_id, organization_id))).fetchone()
    return None if row is None else from_row(row)


async def live(conn: psycopg.AsyncConnection, organization_id: UUID | None = None) -> list[dict[str, Any]]:
    """The stored rows, ordered by id, in :meth:`NodeState.as_row` shape."""
    cursor = await conn.execute(
        f"SELECT {COLUMNS} FROM nodes n WHERE %s::uuid IS NULL OR n.organization_id = %s ORDER BY n.id",
        (organization_id, organization_id),
    )
    return [from_row(row).as_row() for row in await cursor.fetchall()]


_NODE_EVENTS = f"""
SELECT {LOG_COLUMNS}
FROM events
WHERE stream LIKE 'node:%%' AND (%(organization)s::uuid IS NULL OR organization_id = %(organization)s)
  AND position > %(after)s
ORDER BY position
LIMIT %(page)s
"""


async def rebuild(conn: psycopg.AsyncConnection, organization_id: UUID | None = None, *, page: int = FOLD_PAGE) -> list[dict[str, Any]]:
    """Fold every node stream from the log in memory; the rows ``live`` should equal.

    Read a page at a time, as the queue's rebuild reads the log: a fleet's heartbeats add up (a node's
    devices, recorded when they change and every few minutes), and read at once they were all held in
    memory, and decoded while the server's event loop waited.
    """
    states: dict[str, NodeState] = {}
    unreadable: set[str] = set()  # streams opened by a newer writer's creation event: skipped whole, as the queue's
    after = 0
    with long_fold() as set_aside:
        while True:
            cursor = await conn.execute(_NODE_EVENTS, {"organization": organization_id, "after": after, "page": page})
            rows = await cursor.fetchall()
            for recorded in map(recorded_from_row, rows):
                state = states.get(recorded.stream)
                if state is None and (recorded.stream in unreadable or isinstance(recorded.event, UnknownEvent)):
                    unreadable.add(recorded.stream)  # nothing here can start a row from it: verify names the node
                    continue
                states[recorded.stream] = fold(state, recorded)
            if len(rows) < page:
                break
            after = rows[-1][0]
            del rows, recorded  # not set aside: the page is garbage once folded
            set_aside()
    return [state.as_row() for state in sorted(states.values(), key=lambda s: s.id)]
