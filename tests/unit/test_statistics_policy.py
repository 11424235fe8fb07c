"""When the queue's planner statistics count as outgrown (pure: no database)."""

from umbra.compute.statistics import MIN_ROWS, statistics_outgrown


def test_a_small_table_is_never_analysed_for():
    assert not statistics_outgrown(MIN_ROWS - 1, -1)
    assert not statistics_outgrown(10, 0)


def test_a_table_never_analysed_is_once_it_holds_enough_rows():
    assert statistics_outgrown(MIN_ROWS, -1)
    assert statistics_outgrown(30_000, 0)


def test_statistics_are_outgrown_when_the_table_has_doubled_since():
    assert not statistics_outgrown(19_999, 10_000)
    assert statistics_outgrown(20_000, 10_000)
    assert not statistics_outgrown(1_000_000, 900_000)  # churn and slow growth are autovacuum's
