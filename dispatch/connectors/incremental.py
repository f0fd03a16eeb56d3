"""Incremental reads: a cursor over a tuple of source columns, committed with the data.

The source spec's `incremental: {cursor: [column, ...], start: [value, ...],
lookback_seconds: n}` makes a `postgresql` source read only the rows whose whole cursor
tuple is strictly greater than the committed cursor. The committed cursor lives in the
sink (`dispatch_cursor` beside `dispatch_fence` for a PostgreSQL sink) and is written in
the same transaction as the rows and the fence, so a run's rows and the cursor that says
they were read commit together or not at all. See docs/connectors.md ("Incremental
reads") for the guarantees of each mode.

Column names always reach SQL as identifiers (`psycopg.sql.Identifier`) and cursor values
as parameters (their PostgreSQL text form, typed by the server from the column they are
compared with): nothing from the spec is SQL text.

Each cursor value is bounded (`limits.MAX_CURSOR_VALUE_BYTES` of its text form): the
spec's `start`, an operator's set and the committed cursor a read starts from are
checked, and `prepare` refuses a read whose new cursor holds a larger value before any
row moves, so no sink, attempt or page ever holds one.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from django.core.exceptions import ValidationError
from psycopg import sql

from dispatch.connectors import sqlsafety
from dispatch.connectors.base import PermanentError, TransientError
from dispatch.security import limits

# Cursor values are stored and passed as PostgreSQL text (what `column::text` prints).
CursorValue = list[str]
# The first cursor column of a lookback read must be one of these (the bound is computed
# in SQL as `CAST(%s AS <type>) - interval`; the type names here are fixed words, never
# the source's text).
LOOKBACK_TYPES = {
    "timestamp with time zone": "timestamptz",
    "timestamp without time zone": "timestamp",
    "date": "date",
}
MAX_LOOKBACK_SECONDS = 7 * 24 * 3600
SPEC_FIELDS = {"cursor", "start", "lookback_seconds"}


@dataclass(frozen=True)
class IncrementalSpec:
    cursor: tuple[str, ...]
    start: tuple[str, ...] | None = None
    lookback_seconds: int | None = None


def _scalar_text(value: Any) -> str | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, str | int | float):
        return str(value)
    return None


def oversized(columns: tuple[str, ...], values: list[Any]) -> tuple[str, int] | None:
    """The first cursor column whose value's text form is over the bound, with its size
    in bytes; None when every value fits. Messages name the column, never the value."""
    for column, value in zip(columns, values, strict=False):
        size = len(str(value).encode("utf-8", "surrogatepass"))
        if size > limits.MAX_CURSOR_VALUE_BYTES:
            return column, size
    return None


def too_large(column: str, size: int) -> str:
    return (
        f"cursor column {column!r}: value is {size} bytes, more than the "
        f"{limits.MAX_CURSOR_VALUE_BYTES} allowed"
    )


def parse(spec: dict[str, Any]) -> IncrementalSpec | None:
    """The source spec's `incremental` block, validated; None when the read is full.
    Messages name the field (`incremental.cursor`, ...)."""
    if "incremental" not in spec or spec["incremental"] is None:
        return None
    block = spec["incremental"]
    if not isinstance(block, dict):
        raise ValidationError("incremental: must be an object {cursor: [column, ...]}")
    unknown = sorted(set(block) - SPEC_FIELDS)
    if unknown:
        raise ValidationError(
            f"incremental: unknown field(s) {', '.join(unknown)}; allowed: "
            f"{', '.join(sorted(SPEC_FIELDS))}"
        )
    cursor = block.get("cursor")
    if (
        not isinstance(cursor, list)
        or not cursor
        or not all(isinstance(c, str) and c.strip() and "\x00" not in c for c in cursor)
    ):
        raise ValidationError("incremental.cursor: must be a non-empty list of column names")
    if len(set(cursor)) != len(cursor):
        raise ValidationError("incremental.cursor: a column is named twice")
    if len(cursor) > limits.MAX_CURSOR_COLUMNS:
        raise ValidationError(
            f"incremental.cursor: at most {limits.MAX_CURSOR_COLUMNS} columns, not {len(cursor)}"
        )
    start = block.get("start")
    start_text: tuple[str, ...] | None = None
    if start is not None:
        if not isinstance(start, list) or len(start) != len(cursor):
            raise ValidationError(
                f"incremental.start: must be a list of {len(cursor)} value(s), one per cursor "
                "column"
            )
        texts = [_scalar_text(v) for v in start]
        if any(t is None for t in texts):
            raise ValidationError(
                "incremental.start: each value must be a string or a number (not null)"
            )
        start_text = tuple(t for t in texts if t is not None)
        if (big := oversized(tuple(cursor), list(start_text))) is not None:
            raise ValidationError(f"incremental.start: {too_large(*big)}")
    lookback = block.get("lookback_seconds")
    if lookback is not None and (
        not isinstance(lookback, int)
        or isinstance(lookback, bool)
        or not 1 <= lookback <= MAX_LOOKBACK_SECONDS
    ):
        raise ValidationError(
            f"incremental.lookback_seconds: must be an integer from 1 to {MAX_LOOKBACK_SECONDS}"
        )
    return IncrementalSpec(tuple(cursor), start_text, lookback)


def validate(spec: dict[str, Any]) -> None:
    parse(spec)


# --- the reader's side ----------------------------------------------------------------------
def _cols(names: tuple[str, ...]) -> sql.Composable:
    return sql.SQL(", ").join(sql.Identifier(n) for n in names)


def _row(names: tuple[str, ...]) -> sql.Composable:
    # ROW(...) even for one column, so one and many columns compare the same way.
    return sql.SQL("ROW({})").format(_cols(names))


@dataclass
class Bounds:
    """What one incremental read covers, decided in the reader's snapshot."""

    start: CursorValue | None  # read rows whose cursor tuple is > start (None: every row)
    end: CursorValue | None  # the greatest cursor tuple in the snapshot (None: no row)
    lookback_seconds: int | None = None

    @property
    def cursor(self) -> CursorValue | None:
        """The cursor to commit with this read's rows."""
        return self.end if self.end is not None else self.start


def _guc(kind: str, i: int) -> sql.Composable:
    # Fixed names of our own; the values go in through set_config() parameters.
    return sql.Literal(f"dispatch.cursor_{kind}_{i}")


# For the rest of the read's transaction: the planner serves the read's ORDER BY (and the
# bound's ORDER BY ... DESC LIMIT 1) from a btree on the cursor columns, whatever its
# statistics say of the increment's size. Left to itself, it plans a large increment as a
# bitmap heap scan (or a sequential scan) followed by a sort of the whole increment:
# nothing reaches the sink until every row is read and sorted, in memory or temporary
# files that grow with the increment. Disabled only adds a large cost, so a source with
# no such index is still read (and sorted).
INDEX_ORDER_SQL = (
    "SELECT pg_catalog.set_config('enable_sort', 'off', true),"
    " pg_catalog.set_config('enable_bitmapscan', 'off', true)"
)

# The btree indexes of a table, by the table's oid: the attribute numbers of each index's
# columns and their options (DESC, NULLS FIRST), with the table's qualified name and the
# cursor's column names as the server quotes them (for the message).
TABLE_INDEXES_SQL = (
    "SELECT pg_catalog.quote_ident(n.nspname) OPERATOR(pg_catalog.||) '.'"
    " OPERATOR(pg_catalog.||) pg_catalog.quote_ident(c.relname),"
    " i.indkey::pg_catalog.text, i.indoption::pg_catalog.text,"
    " (SELECT pg_catalog.string_agg(pg_catalog.quote_ident(x.name), ', ' ORDER BY x.n)"
    "  FROM pg_catalog.unnest(%s::pg_catalog.text[]) WITH ORDINALITY AS x(name, n))"
    " FROM pg_catalog.pg_class c"
    " JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace"
    " LEFT JOIN pg_catalog.pg_index i ON i.indrelid OPERATOR(pg_catalog.=) c.oid"
    "  AND i.indisvalid AND i.indpred IS NULL"
    "  AND EXISTS (SELECT 1 FROM pg_catalog.pg_class ic JOIN pg_catalog.pg_am am"
    "   ON am.oid OPERATOR(pg_catalog.=) ic.relam"
    "   WHERE ic.oid OPERATOR(pg_catalog.=) i.indexrelid"
    "   AND am.amname OPERATOR(pg_catalog.=) 'btree')"
    " WHERE c.oid OPERATOR(pg_catalog.=) %s::pg_catalog.oid"
)


def missing_index(
    conn: psycopg.Connection[Any], table_oid: int, attnums: list[int], names: tuple[str, ...]
) -> str | None:
    """None when a btree index of the table `table_oid` starts with the cursor columns
    (`attnums`, in the cursor's order, all ascending or all descending: a scan of it
    either way yields the cursor's order); else the statement that creates one."""
    rows = conn.execute(TABLE_INDEXES_SQL, [list(names), table_oid]).fetchall()
    if not rows:
        return None  # not a table (a view, a function): nothing to check
    for _table, indkey, indoption, _columns in rows:
        if indkey is None:
            continue
        keys = [int(k) for k in str(indkey).split()]
        options = [int(o) for o in str(indoption).split()]
        # Every column ascending with NULLS LAST (0), or every one DESC NULLS FIRST (3),
        # which a backward scan reads as the former: the order of `ORDER BY cursor`.
        directions = set(options[: len(attnums)])
        if keys[: len(attnums)] == attnums and directions in ({0}, {3}):
            return None
    return f"CREATE INDEX ON {rows[0][0]} ({rows[0][3]})"


class CursorReadPlan:
    """The SQL of an incremental read over `relation` (a SELECT), in the reader's one
    REPEATABLE READ transaction.

    COPY takes no bind parameters, so the bounds travel as transaction-local settings
    (`set_config(name, %s, true)`, a parameter) and the query reads them back with
    `current_setting()`, cast to the column's type as the source server itself reported
    it (`format_type()` of the result description, never the spec's text). The cast of a
    column's own text form back to its type is exact (fixed DateStyle, extra_float_digits
    3), and `current_setting()` is stable, so an index on the cursor columns serves the
    comparison."""

    def __init__(self, inc: IncrementalSpec, relation: sql.Composable, columns: list[Any]) -> None:
        self.inc = inc
        self.relation = relation
        by_name = {c.name: c for c in columns}
        missing = [c for c in inc.cursor if c not in by_name]
        if missing:
            raise PermanentError(
                f"incremental.cursor: the source has no column(s) {', '.join(missing)}"
            )
        self.types = [by_name[c].type for c in inc.cursor]
        if any(not t for t in self.types):
            raise PermanentError("incremental.cursor: the source did not report column types")
        if inc.lookback_seconds is not None and self.types[0] not in LOOKBACK_TYPES:
            raise PermanentError(
                f"incremental.lookback_seconds: the first cursor column {inc.cursor[0]} is "
                f"{self.types[0]}; a lookback needs a timestamp or date column"
            )

    def _values(self, kind: str) -> sql.Composable:
        return sql.SQL("ROW({})").format(
            sql.SQL(", ").join(
                # The type text comes from format_type() on the source server.
                sql.SQL("CAST(pg_catalog.current_setting({}) AS {})").format(
                    _guc(kind, i),
                    sql.SQL(t),  # type: ignore[arg-type]
                )
                for i, t in enumerate(self.types)
            )
        )

    def _not_null(self) -> sql.Composable:
        # Rows with a NULL cursor column are never part of an incremental read: a tuple
        # comparison with NULL is never true.
        return sql.SQL(" AND ").join(
            sql.SQL("{} IS NOT NULL").format(sql.Identifier(n)) for n in self.inc.cursor
        )

    def _set(self, conn: psycopg.Connection[Any], kind: str, values: CursorValue) -> None:
        conn.execute(
            sql.SQL("SELECT {}").format(
                sql.SQL(", ").join(
                    sql.SQL("pg_catalog.set_config({}, %s, true)").format(_guc(kind, i))
                    for i in range(len(values))
                )
            ),
            list(values),
        )

    def bound(self, conn: psycopg.Connection[Any], start: CursorValue | None) -> Bounds:
        """Decide the read in the current snapshot: the greatest cursor tuple above
        `start` becomes `end`; later statements of the transaction see the same rows."""
        if start is not None and len(start) != len(self.inc.cursor):
            raise PermanentError(
                f"incremental: the committed cursor has {len(start)} value(s) for "
                f"{len(self.inc.cursor)} cursor column(s); reset the binding's cursor"
            )
        conn.execute(INDEX_ORDER_SQL)
        names = self.inc.cursor
        where = [self._not_null()]
        if start is not None:
            self._set(conn, "start", start)
            where.append(sql.SQL("{} > {}").format(_row(names), self._values("start")))
        row = conn.execute(
            sql.SQL("SELECT {} FROM ({}) AS q WHERE {} ORDER BY {} LIMIT 1").format(
                sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(n)) for n in names),
                self.relation,
                sql.SQL(" AND ").join(where),
                # Qualified: a bare name would sort on the ::text output column.
                sql.SQL(", ").join(sql.SQL("q.{} DESC").format(sql.Identifier(n)) for n in names),
            )
        ).fetchone()
        bounds = Bounds(start, list(row) if row is not None else None, self.inc.lookback_seconds)
        if bounds.cursor is not None:
            # The upper bound: the greatest tuple in the snapshot, or (nothing above the
            # start) the start itself, below which a lookback still re-reads.
            self._set(conn, "end", bounds.cursor)
        if start is not None and bounds.lookback_seconds is not None:
            conn.execute(
                "SELECT pg_catalog.set_config('dispatch.cursor_lookback', %s, true)",
                [str(bounds.lookback_seconds)],
            )
        return bounds

    def select(self, bounds: Bounds) -> sql.Composable:
        """The rows of this read, ordered on the cursor tuple, up to `end`: above `start`,
        or with a lookback, every row whose first cursor column is above start minus the
        lookback (the commit-order trap: a row whose transaction committed after the last
        read passed its timestamp is below the cursor; an upsert sink merges the rows it
        already has to the same values)."""
        names = self.inc.cursor
        if bounds.cursor is None or (bounds.end is None and bounds.lookback_seconds is None):
            return sql.SQL("SELECT * FROM ({}) AS q WHERE false").format(self.relation)
        where = [
            self._not_null(),
            sql.SQL("{} <= {}").format(_row(names), self._values("end")),
        ]
        if bounds.start is not None and bounds.lookback_seconds is not None:
            where.append(
                sql.SQL(
                    "{} > CAST(pg_catalog.current_setting({}) AS {}) OPERATOR(pg_catalog.-)"
                    " pg_catalog.make_interval(secs =>"
                    " pg_catalog.current_setting('dispatch.cursor_lookback')::pg_catalog.int4)"
                ).format(
                    sql.Identifier(names[0]),
                    _guc("start", 0),
                    sql.SQL(LOOKBACK_TYPES[self.types[0]]),  # type: ignore[arg-type]
                )
            )
        elif bounds.start is not None:
            where.append(sql.SQL("{} > {}").format(_row(names), self._values("start")))
        return sql.SQL("SELECT * FROM ({}) AS q WHERE {} ORDER BY {}").format(
            self.relation, sql.SQL(" AND ").join(where), _cols(names)
        )


# --- the sink's side: the committed cursor, in the sink database ---------------------------
@dataclass(frozen=True)
class CommittedCursor:
    """One binding's row of `dispatch_cursor` as the sink holds it."""

    binding_id: uuid.UUID
    columns: tuple[str, ...] | None
    cursor: CursorValue | None
    version: int
    run_id: uuid.UUID | None = None
    attempt_id: uuid.UUID | None = None
    committed_at: Any = None
    # After an operator's reset or set: what it replaced that could not be read (a CSV
    # file's state), for the operator; empty when nothing was.
    replaced: str = ""


def cursor_table(schema: str) -> sql.Composed:
    return sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier("dispatch_cursor"))


def ensure_table(conn: psycopg.Connection[Any], schema: str) -> None:
    """Create `dispatch_cursor` if missing (in a transaction of its own; two first
    writers at once are serialised, see sqlsafety.create_once)."""
    sqlsafety.create_once(
        conn,
        "dispatch_cursor",
        schema,
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (binding_id uuid PRIMARY KEY,"
            " columns text[], cursor text[], version bigint NOT NULL DEFAULT 0,"
            " run_id uuid, attempt_id uuid, committed_at timestamptz)"
        ).format(cursor_table(schema)),
    )


_SELECT = (
    "SELECT binding_id, columns, cursor, version, run_id, attempt_id, committed_at FROM {}"
    " WHERE binding_id = %s"
)


def _committed(row: Any) -> CommittedCursor:
    return CommittedCursor(
        row[0],
        tuple(row[1]) if row[1] is not None else None,
        list(row[2]) if row[2] is not None else None,
        int(row[3]),
        row[4],
        row[5],
        row[6],
    )


def read_committed(
    conn: psycopg.Connection[Any], schema: str, binding_id: uuid.UUID
) -> CommittedCursor:
    """The binding's committed cursor (version 0 and no cursor when none was ever
    committed). Inside the data transaction (a savepoint): the compare-and-set at commit
    catches any move after this read. The table exists (the fence's set-up made it)."""
    with conn.transaction():
        row = conn.execute(sql.SQL(_SELECT).format(cursor_table(schema)), [binding_id]).fetchone()
    if row is None:
        return CommittedCursor(binding_id, None, None, 0)
    return _committed(row)


def commit_cursor(
    conn: psycopg.Connection[Any],
    schema: str,
    *,
    binding_id: uuid.UUID,
    read: CommittedCursor,
    columns: tuple[str, ...],
    cursor: CursorValue | None,
    run_id: uuid.UUID,
    attempt_id: uuid.UUID,
) -> CommittedCursor:
    """Inside the data transaction: move the cursor from what this attempt read (`read`)
    to `cursor`, as a compare-and-set on `version`. Returns the new committed row.

    A concurrent run of the binding, or an operator's reset, that committed meanwhile
    leaves no row to update: the data transaction must roll back (raises TransientError,
    so the retry starts from the new committed cursor)."""
    table = cursor_table(schema)
    if read.version == 0:
        row = conn.execute(
            sql.SQL(
                "INSERT INTO {} (binding_id, columns, cursor, version, run_id, attempt_id,"
                " committed_at) VALUES (%s, %s, %s, 1, %s, %s, pg_catalog.now())"
                " ON CONFLICT (binding_id) DO NOTHING RETURNING version, committed_at"
            ).format(table),
            [binding_id, list(columns), cursor, run_id, attempt_id],
        ).fetchone()
    else:
        row = conn.execute(
            sql.SQL(
                "UPDATE {} SET columns = %s, cursor = %s, version = version + 1, run_id = %s,"
                " attempt_id = %s, committed_at = pg_catalog.now()"
                " WHERE binding_id = %s AND version = %s RETURNING version, committed_at"
            ).format(table),
            [list(columns), cursor, run_id, attempt_id, binding_id, read.version],
        ).fetchone()
    if row is None:
        raise TransientError(
            "the binding's committed cursor moved while this attempt ran (a concurrent run "
            "or an operator's reset); the retry starts from the new cursor"
        )
    return CommittedCursor(
        binding_id, tuple(columns), cursor, int(row[0]), run_id, attempt_id, row[1]
    )


def set_committed(
    conn: psycopg.Connection[Any],
    schema: str,
    binding_id: uuid.UUID,
    *,
    columns: tuple[str, ...] | None,
    cursor: CursorValue | None,
    after_version: int = 0,
) -> CommittedCursor:
    """An operator's reset (cursor None: the next run reads everything) or backfill point,
    written to the sink in one transaction. It bumps the version above both the sink's
    and `after_version` (the highest the caller has seen: a sink table dropped and made
    again restarts at 1, and the console's copy moves only forward), so an attempt that
    read the old cursor cannot commit over it (its compare-and-set fails and it retries)."""
    ensure_table(conn, schema)
    with conn.transaction():
        row = conn.execute(
            sql.SQL(
                "INSERT INTO {t} AS c (binding_id, columns, cursor, version, committed_at)"
                " VALUES (%s, %s, %s, %s::bigint + 1, pg_catalog.now())"
                " ON CONFLICT (binding_id) DO UPDATE SET"
                " columns = EXCLUDED.columns, cursor = EXCLUDED.cursor,"
                " version = GREATEST(c.version + 1, EXCLUDED.version), run_id = NULL,"
                " attempt_id = NULL, committed_at = pg_catalog.now()"
                " RETURNING binding_id, columns, cursor, version, run_id, attempt_id,"
                " committed_at"
            ).format(t=cursor_table(schema)),
            [binding_id, list(columns) if columns is not None else None, cursor, after_version],
        ).fetchone()
    assert row is not None
    return _committed(row)


@contextlib.contextmanager
def errors_as_permanent(what: str) -> Iterator[None]:
    try:
        yield
    except psycopg.errors.UndefinedColumn as exc:
        raise PermanentError(f"{what}: {exc}") from None


# --- the transfer: reader and writer agree on the cursor ------------------------------------
@dataclass(frozen=True)
class Prepared:
    """What an incremental transfer starts from and will commit."""

    spec: IncrementalSpec
    committed: CommittedCursor  # the sink's committed cursor when the attempt started
    start: CursorValue | None  # what the read is above (committed, else the spec's start)
    bounds: Bounds | None  # None when the run's data was already committed


def prepare(reader: Any, writer: Any) -> Prepared | None:
    """Before any row moves: read the sink's committed cursor, bound the source's read in
    its snapshot, and stage the new cursor on the writer. None for a full read.

    A sink that cannot keep a cursor is a permanent error, as is a cursor committed for
    other columns (the operator resets it after changing `cursor`)."""
    inc: IncrementalSpec | None = getattr(reader, "incremental", None)
    if inc is None:
        return None
    if not hasattr(writer, "cursor_state"):
        raise PermanentError(
            f"incremental reads need a sink that commits the cursor with the rows; "
            f"{type(writer).__module__.rsplit('.', 1)[-1]} does not"
        )
    committed: CommittedCursor = writer.cursor_state(inc)
    if committed.cursor is not None and committed.columns not in (None, inc.cursor):
        raise PermanentError(
            f"incremental.cursor: the sink's committed cursor is over "
            f"({', '.join(committed.columns or ())}), the spec's over ({', '.join(inc.cursor)}); "
            "reset the binding's cursor to start again"
        )
    if committed.cursor is not None and (big := oversized(inc.cursor, committed.cursor)):
        # Committed before the bound existed, or written into the sink by hand.
        raise PermanentError(
            f"the sink's committed cursor: {too_large(*big)}; reset or set the binding's cursor"
        )
    start = committed.cursor if committed.cursor is not None else _spec_start(inc)
    if getattr(writer, "already_committed", False):
        return Prepared(inc, committed, start, None)
    bounds: Bounds = reader.bound(start)
    # Here, before the writer stages it and before any row moves: a source row whose
    # cursor value is over the bound fails the run for good (every retry reads it again).
    if bounds.cursor is not None and (big := oversized(inc.cursor, bounds.cursor)):
        raise PermanentError(too_large(*big))
    writer.stage_cursor(inc.cursor, bounds.cursor)
    return Prepared(inc, committed, start, bounds)


def _spec_start(inc: IncrementalSpec) -> CursorValue | None:
    return list(inc.start) if inc.start is not None else None
