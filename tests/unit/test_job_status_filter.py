"""The ``status`` filter of ``GET /v1/jobs``: absent or blank is no filter, an empty item is refused."""

from __future__ import annotations

import pytest

from umbra.compute.jobs import parse_statuses
from umbra.errors import InvalidRequest


@pytest.mark.parametrize("raw", [None, "", " "])
def test_an_absent_or_blank_status_is_no_filter(raw):
    assert parse_statuses(raw) is None


def test_statuses_are_split_on_commas_and_trimmed():
    assert parse_statuses(" queued , blocked") == ["queued", "blocked"]


@pytest.mark.parametrize("raw", [",", " , ", "queued,", ",queued", "queued,,blocked", "done", "queued,done"])
def test_an_empty_or_unknown_item_is_refused_naming_the_field(raw):
    with pytest.raises(InvalidRequest) as refused:
        parse_statuses(raw)
    assert refused.value.extra == {"field": "status"}
