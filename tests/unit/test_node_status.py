from datetime import datetime, timedelta, timezone

import pytest

from umbra.domain.node_status import effective_status, stored_statuses_for

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


@pytest.mark.parametrize(
    "stored,age,expected",
    [
        ("online", 0, "online"),
        ("online", 45, "online"),
        ("online", 46, "offline"),
        ("online", None, "offline"),
        ("provisioning", None, "provisioning"),
        ("draining", 3600, "draining"),
        ("retired", 3600, "retired"),
        ("offline", 0, "offline"),
    ],
)
def test_only_online_is_derived_away(stored, age, expected):
    seen = None if age is None else NOW - timedelta(seconds=age)
    assert effective_status(stored, seen, NOW) == expected


def test_threshold_is_configurable():
    assert effective_status("online", NOW - timedelta(seconds=10), NOW, stale_seconds=5) == "offline"


@pytest.mark.parametrize("stored", ["provisioning", "online", "offline", "draining", "retired"])
@pytest.mark.parametrize("seen", [None, NOW, NOW - timedelta(hours=1)])
def test_a_filter_reads_every_stored_status_that_can_read_as_one_it_wants(stored, seen):
    """Whatever a node's silence, its effective status is wanted only if its stored one is read."""
    for wanted in (["online"], ["offline"], ["retired"], ["offline", "draining"], ["provisioning", "online"]):
        if effective_status(stored, seen, NOW) in wanted:
            assert stored in stored_statuses_for(wanted), (stored, seen, wanted)
