"""Receipts verified on their sinks (`check_invariants --receipts`): each delivery's
receipt (rows and digest, committed with its rows in the sink's `dispatch_receipt`) is
recomputed from what the sink holds now, by the same definition
(dispatch/connectors/receipt.py), and a difference is a violation.

What can be recomputed: a `replace` (and a sliced `replace`, whose receipt is the sum of
its slices') is the whole table, so only the table's latest delivery can be; an
`append` is the rows of its attempt, found by the `_dispatch_attempt` column when the
binding turned it on (`attempt_column: true`). An `upsert`'s rows may be changed by
every later delivery, and an append without the column cannot be told apart: both are
counted as unverifiable, never as a match. The last verification of each receipt is
recorded on its attempt (the run page shows it): that write is the only one the
checker makes.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db.models.functions import Now
from psycopg import sql

from dispatch.connectors import postgresql, receipt
from dispatch.connectors.postgresql.writer import ATTEMPT_COLUMN, RECEIPT_TABLE
from dispatch.models import Attempt
from dispatch.verify import sinks as sink_access
from dispatch.verify.state import State, Violation

EMPTY = receipt.to_hex(0)


@dataclass(frozen=True)
class ReceiptRow:
    run_id: uuid.UUID
    binding_id: uuid.UUID
    attempt_id: uuid.UUID
    parent_id: uuid.UUID | None
    table_name: str
    mode: str
    columns: list[str]
    attempt_column: bool
    rows: int
    digest: str | None
    committed_at: datetime


@dataclass
class Outcome:
    violations: list[Violation] = field(default_factory=list)
    verified: int = 0
    unverifiable: int = 0
    superseded: int = 0
    # attempt id -> what its last verification found ("match" or what differs).
    results: dict[uuid.UUID, str] = field(default_factory=dict)


def _relation(table_name: str) -> sql.Composable:
    schema, name = table_name.split(".", 1)
    return sql.Identifier(schema, name)


def _differs(expected_rows: int, expected: str | None, rows: int, digest: str) -> str | None:
    if rows != expected_rows:
        return f"the receipt says {expected_rows} rows, the sink holds {rows}"
    if expected is not None and digest != expected:
        return f"the receipt's digest is {expected}, the sink's rows give {digest}"
    return None


def _verify_table(
    conn: Any, receipts: list[ReceiptRow], in_scope: set[uuid.UUID], outcome: Outcome
) -> None:
    """One sink table's receipts of the bindings in scope."""
    by_delivery: dict[uuid.UUID, list[ReceiptRow]] = defaultdict(list)
    for r in receipts:
        by_delivery[r.parent_id or r.run_id].append(r)
    mode = receipts[0].mode
    table = receipts[0].table_name
    if mode in ("replace", "mirror"):
        latest = max(by_delivery.values(), key=lambda rs: max(r.committed_at for r in rs))
        for delivery, rs in by_delivery.items():
            if rs is not latest and delivery in in_scope:
                outcome.superseded += len(rs)
        if not ({r.run_id for r in latest} | {r.parent_id for r in latest}) & in_scope:
            return
        columns = latest[0].columns
        found = conn.execute(receipt.digest_sql(_relation(table), columns)).fetchone()
        rows, digest = (int(found[1]), str(found[2])) if found else (0, EMPTY)
        digests = [r.digest for r in latest]
        expected = None if None in digests else receipt.combine([d for d in digests if d])
        problem = _differs(sum(r.rows for r in latest), expected, rows, digest)
        _record(outcome, latest, table, problem)
        return
    verifiable = [r for r in receipts if r.run_id in in_scope or r.parent_id in in_scope]
    if mode != "append":
        outcome.unverifiable += len(verifiable)
        return
    with_column = [r for r in verifiable if r.attempt_column]
    outcome.unverifiable += len(verifiable) - len(with_column)
    if not with_column:
        return
    columns = with_column[0].columns
    held = {
        row[0]: (int(row[1]), str(row[2]))
        for row in conn.execute(
            receipt.digest_sql(
                _relation(table),
                columns,
                sql.SQL("{} = ANY(%s::uuid[])").format(sql.Identifier(ATTEMPT_COLUMN)),
                group=ATTEMPT_COLUMN,
            ),
            [[r.attempt_id for r in with_column]],
        )
    }
    for r in with_column:
        rows, digest = held.get(r.attempt_id, (0, EMPTY))
        _record(outcome, [r], table, _differs(r.rows, r.digest, rows, digest))


def _record(outcome: Outcome, receipts: list[ReceiptRow], table: str, problem: str | None) -> None:
    outcome.verified += len(receipts)
    for r in receipts:
        outcome.results[r.attempt_id] = problem or "match"
    if problem is not None:
        subject = receipts[0].parent_id or receipts[0].run_id
        outcome.violations.append(Violation("receipt", f"{subject} ({table})", problem))


def verify(state: State, *, record: bool = True) -> Outcome:
    """Recompute the receipts of the runs in scope on their PostgreSQL sinks; with
    `record`, store each result on its attempt."""
    outcome = Outcome()
    in_scope = set(state.runs)
    by_sink: dict[uuid.UUID, set[uuid.UUID]] = defaultdict(set)
    for b in state.bindings.values():
        if b.sink_kind == "postgresql":
            by_sink[b.sink_id].add(b.id)
    for sink_id, binding_ids in sorted(by_sink.items(), key=lambda kv: str(kv[0])):
        try:
            with sink_access.connect(sink_id) as conn:
                conn.autocommit = True
                conn.execute(receipt.OUTPUT_SETTINGS_SQL)
                schemas = [
                    row[0]
                    for row in conn.execute(
                        "SELECT n.nspname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace"
                        " n ON n.oid = c.relnamespace WHERE c.relname = %s AND c.relkind = 'r'",
                        [RECEIPT_TABLE],
                    )
                ]
                tables: dict[str, list[ReceiptRow]] = defaultdict(list)
                for schema in schemas:
                    for row in conn.execute(
                        sql.SQL(
                            "SELECT run_id, binding_id, attempt_id, parent_id, table_name, mode,"
                            " columns, attempt_column, rows, digest, committed_at FROM {}"
                            " WHERE binding_id = ANY(%s::uuid[])"
                        ).format(sql.Identifier(schema, RECEIPT_TABLE)),
                        [list(binding_ids)],
                    ):
                        r = ReceiptRow(*row)
                        tables[r.table_name].append(r)
                for table_name, receipts in sorted(tables.items()):
                    postgresql.parse_table(table_name)  # a stored name that no longer parses
                    _verify_table(conn, receipts, in_scope, outcome)
        except sink_access.SINK_ERRORS as exc:
            outcome.violations.append(
                Violation(
                    "receipt", str(sink_id), f"sink unreadable: {sink_access.error_text(exc)}"
                )
            )
    if record:
        for attempt_id, result in outcome.results.items():
            Attempt.objects.filter(pk=attempt_id).update(
                receipt_verified_at=Now(), receipt_verification=result
            )
    return outcome
