"""The nodes that hold queued jobs' models: model affinity across nodes.

With ``UMBRA_MODEL_AFFINITY_SECONDS`` above 0, a claimer that would have to
load a job's models leaves the job alone, even with nothing else to take,
while another node holds them and the job has not waited the affinity
(:func:`umbra.domain.placement.passes_over`). Claims read those other nodes
here: only when affinity is on and a claimer would load a queued shape's
models, and only the organization's online nodes whose last report names one
of those models resident, as reported (what they run does not make them hold
a model any less).
"""

from __future__ import annotations

from typing import Mapping, Sequence
from uuid import UUID

import psycopg

from umbra.domain.models import RegisteredModel
from umbra.domain.placement import NO_HOLDERS, ModelHolders

from .blocked import NODE_COLUMNS, node_as_read

#: The organization's online nodes whose devices last reported one of ``slugs`` resident (``n`` the node's row,
#: ``l`` its liveness row, as the claims' own reads of their nodes).
_HOLDING = f"""
SELECT {NODE_COLUMNS}, n.kinds
FROM nodes n LEFT JOIN node_liveness l ON l.node_id = n.id
WHERE n.organization_id = %(org)s AND n.status = 'online'
  AND EXISTS (SELECT FROM jsonb_array_elements(coalesce(l.devices, n.devices)) AS d,
                          jsonb_array_elements(d -> 'resident_models') AS m
              WHERE m ->> 'slug' = ANY(%(slugs)s::text[]))
ORDER BY n.name
"""


async def read_model_holders(conn: psycopg.AsyncConnection, organization_id: UUID, slugs: Sequence[str],
                             models: Mapping[str, RegisteredModel], *, stale_seconds: int) -> ModelHolders:  # fmt: skip
    """The organization's nodes that report one of ``slugs`` resident, as :class:`ModelHolders` (with none, no query)."""
    if not slugs:
        return NO_HOLDERS
    cursor = await conn.execute(_HOLDING, {"org": organization_id, "slugs": sorted(set(slugs))})
    rows = await cursor.fetchall()
    nodes = [node_as_read(*row[:-1], stale_seconds=stale_seconds) for row in rows]
    # The kinds each holder's agent takes (NULL: every kind): a holder that never takes a job's kind is no
    # node to leave the job to.
    return ModelHolders(nodes, models, {row[0]: row[-1] for row in rows})
