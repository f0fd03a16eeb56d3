"""The console at a million runs: counts that stop at a cap instead of reading a whole
table (docs/console.md, "At scale").

A list page of Django's admin counts its (filtered) rows for the paginator and, unless
`show_full_result_count = False`, counts the unfiltered table as well: `count(*)` over a
million runs reads them all. Here the paginator counts at most COUNT_CAP + 1 rows through
the same index the page is read with, and says "more than COUNT_CAP" beyond.
"""

from __future__ import annotations

import contextlib
from functools import cached_property
from typing import Any

from django.core.paginator import Paginator
from django.db import connections, transaction
from django.db.models import QuerySet

# Beyond this many rows a list says "more than 10,000": exact counts there cost a scan.
COUNT_CAP = 10_000
HISTORY_TABLES = frozenset({"dispatch_run", "dispatch_attempt"})


def capped_count(queryset: QuerySet[Any], cap: int | None = None) -> int:
    """min(count, cap + 1) in one query that reads at most cap + 1 index entries."""
    cap = COUNT_CAP if cap is None else cap
    inner = queryset.order_by().values("pk")[: cap + 1]
    sql, params = inner.query.sql_with_params()
    # Joined to another history table (attempts filtered through their run's binding).
    tables = {a.table_name for a in inner.query.alias_map.values()}
    joined = len(tables & HISTORY_TABLES) > 1
    scope = transaction.atomic(using=queryset.db) if joined else contextlib.nullcontext()
    with scope, connections[queryset.db].cursor() as cursor:
        if joined:
            # A join filter (attempts of one binding): a hash join would read both tables
            # whole before the LIMIT; a nested loop stops at the cap.
            cursor.execute("SET LOCAL enable_hashjoin = off")
            cursor.execute("SET LOCAL enable_mergejoin = off")
        cursor.execute(f"SELECT count(*) FROM ({sql}) AS capped", params)
        (n,) = cursor.fetchone()
    return int(n)


class CappedPaginator(Paginator):
    """A paginator whose count stops at COUNT_CAP + 1 (pages beyond the cap are still
    reachable by URL: each page is a LIMIT/OFFSET read)."""

    @cached_property
    def count(self) -> int:
        if isinstance(self.object_list, QuerySet):
            return capped_count(self.object_list)
        return len(self.object_list)

    @property
    def capped(self) -> bool:
        return self.count > COUNT_CAP


def capped_counts(querysets: dict[str, QuerySet[Any]], cap: int | None = None) -> dict[str, int]:
    """capped_count of each queryset, all in one query (one capped subquery each)."""
    cap = COUNT_CAP if cap is None else cap
    parts: list[str] = []
    params: list[Any] = []
    keys = list(querysets)
    db = "default"
    for i, key in enumerate(keys):
        qs = querysets[key]
        db = qs.db
        sql, p = qs.order_by().values("pk")[: cap + 1].query.sql_with_params()
        parts.append(f"SELECT {i} AS k, count(*) AS n FROM ({sql}) AS capped_{i}")
        params.extend(p)
    if not parts:
        return {}
    with connections[db].cursor() as cursor:
        cursor.execute(" UNION ALL ".join(parts), params)
        found = {int(k): int(n) for k, n in cursor.fetchall()}
    return {key: found.get(i, 0) for i, key in enumerate(keys)}
