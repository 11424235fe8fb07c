"""Pages of reads bounded by their bytes as well as by their count.

A page of ``GET /v1/jobs``, ``GET /v1/events`` or the queue view may list up to
1,000 items, and each item may carry documents near the 1 MiB body limit (a
job's payload and result; an event's data): a page of them was read, decoded
and encoded whole, near 1 GB of this process's memory per request, for any
holder of a read scope. A page is therefore also cut short once the documents
of the rows before the next one pass :data:`PAGE_BYTES`, measured in the
database on the text it returns (nothing is encoded twice, and the rows past
the budget never reach this process). The first row is always listed, so a
cursor always moves.
"""

from __future__ import annotations

from typing import Any, Sequence

#: Most bytes of documents (JSON and free text, as the database returns them) a page gathers before it
#: stops, in bytes: 8 MiB. The page may pass it by its last row (at most a couple of MiB: the body limit's
#: payload, and a result). Read at each call, so a test may set a smaller one.
PAGE_BYTES = 8 * 1024 * 1024


def bounded(page: str, *, sizes: str, order: str) -> str:
    """``page`` (a query of at most a page of rows, in ``order``) without the rows that come once the
    ``sizes`` (an SQL expression over its columns: the row's bytes) of the rows before them reach
    ``%(page_bytes)s``. Its columns come first, then ``row_bytes``, ``bytes_before`` and ``followed``
    (whether ``page`` had a row after this one: on the last row listed, that the page was cut short)."""
    return (
        f"SELECT * FROM (SELECT *, sum(row_bytes) OVER w - row_bytes AS bytes_before,"
        f" lead(true, 1, false) OVER w AS followed"
        f" FROM (SELECT *, {sizes} AS row_bytes FROM ({page}) AS page) AS sized WINDOW w AS (ORDER BY {order})) AS summed"
        f" WHERE bytes_before < %(page_bytes)s ORDER BY {order}"
    )


def cut_short(rows: Sequence[Sequence[Any]]) -> bool:
    """Whether rows read by a :func:`bounded` query left some of their page's rows out."""
    return bool(rows) and rows[-1][-1]
