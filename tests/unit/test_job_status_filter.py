"""The ``status`` filter of ``GET /v1/jobs`` and ``GET /v1/nodes``: absent or blank is no filter, an empty or
unknown item is refused."""

from __future__ import annotations

import pytest

from umbra.api.params import parse_statuses as parse
from umbra.events.types import JOB_STATUSES, NODE_STATUSES
from umbra.errors import InvalidRequest


@pytest.mark.parametrize("raw", [None, "", " "])
def test_an_absent_or_blank_status_is_no_filter(raw):
    assert parse(raw, JOB_STATUSES) is None


def test_statuses_are_split_on_commas_and_trimmed():
    assert parse(" queued , blocked", JOB_STATUSES) == ["queued", "blocked"]
    assert parse("online,retired", NODE_STATUSES) == ["online", "retired"]


@pytest.mark.parametrize("raw", [",", " , ", "queued,", ",queued", "queued,,blocked", "done", "queued,done"])
def test_an_empty_or_unknown_item_is_refused_naming_the_field(raw):
    with pytest.raises(InvalidRequest) as refused:
        parse(raw, JOB_STATUSES)
    assert refused.value.extra == {"field": "status"}


def test_a_node_status_filter_knows_only_node_statuses():
    with pytest.raises(InvalidRequest):
        parse("queued", NODE_STATUSES)
