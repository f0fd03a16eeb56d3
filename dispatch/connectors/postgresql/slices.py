"""Slices of a `postgresql` table source: the spec's `slices`, the ranges a run is split
into (planned once, at the run's start, on the source), and the WHERE of one slice.

Ranges are over one key column of an integer, timestamp or uuid type. Every row belongs
to exactly one slice: the first range is open below (and holds the rows whose key is
NULL), the last open above, so rows outside the minimum and maximum seen at planning time
(inserted later) still belong to one. `count` splits [min, max] into equal widths;
`rows_per_slice` takes the number of slices from the table's row estimate
(`pg_class.reltuples`, or an exact count of a table never analysed) and the bounds from
the key's histogram (`pg_stats.histogram_bounds`: about equal rows per slice), falling
back to equal widths without one. docs/connectors.md, "Slices".
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from django.core.exceptions import ValidationError
from psycopg import sql

from dispatch.connectors.base import PermanentError
from dispatch.security import limits

SPEC_FIELDS = frozenset({"key", "count", "rows_per_slice"})

# The type families a key may have: ordered, with a distance between two values.
INTEGER_TYPES = frozenset({"smallint", "integer", "bigint"})
TIMESTAMP_TYPES = frozenset({"timestamp without time zone", "timestamp with time zone", "date"})
UUID_TYPES = frozenset({"uuid"})


@dataclass(frozen=True)
class SliceSpec:
    key: str
    count: int | None = None
    rows_per_slice: int | None = None


@dataclass
class Plan:
    """The ranges of one run: bounds[i] = (lower inclusive, upper exclusive), as the key's
    text; None is open. `basis` says how they were chosen, for the record."""

    key: str
    key_type: str
    method: str
    basis: str
    bounds: list[tuple[str | None, str | None]] = field(default_factory=list)


def _positive(value: Any, name: str, most: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        raise ValidationError(f"slices.{name}: must be a whole number from 1 to {most:,}")
    return value


def parse(spec: dict[str, Any]) -> SliceSpec | None:
    """The spec's `slices` (None without one); a ValidationError naming the field."""
    raw = spec.get("slices")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValidationError(
            "slices: must be an object: {key: column, count: N} or {key: column, rows_per_slice: M}"
        )
    unknown = sorted(set(raw) - SPEC_FIELDS)
    if unknown:
        raise ValidationError(
            f"slices: unknown field(s) {', '.join(unknown)} (allowed: key, count, rows_per_slice)"
        )
    key = raw.get("key")
    if not isinstance(key, str) or not key.strip() or "\x00" in key:
        raise ValidationError("slices.key: the name of one column of the table")
    has_count, has_rows = "count" in raw, "rows_per_slice" in raw
    if has_count == has_rows:
        raise ValidationError("slices: give exactly one of count or rows_per_slice")
    if has_count:
        return SliceSpec(key, count=_positive(raw["count"], "count", limits.MAX_SLICES))
    return SliceSpec(key, rows_per_slice=_positive(raw["rows_per_slice"], "rows_per_slice", 2**62))


def validate(spec: dict[str, Any]) -> None:
    """Save-time rules: a `table` source only, not with `incremental`."""
    sliced = parse(spec)
    if sliced is None:
        return
    if not spec.get("table"):
        raise ValidationError("slices: only a table source can be sliced (not a query)")
    if spec.get("incremental") is not None:
        raise ValidationError(
            "slices: not supported with incremental (an incremental read copies one window "
            "in one snapshot; slice the table or read it incrementally, not both)"
        )


# --- planning ---------------------------------------------------------------------------
def family(type_name: str) -> str | None:
    if type_name in INTEGER_TYPES:
        return "integer"
    if type_name in TIMESTAMP_TYPES:
        return "timestamp"
    if type_name in UUID_TYPES:
        return "uuid"
    return None


def key_type(conn: psycopg.Connection[Any], table: str, relation: sql.Composable, key: str) -> str:
    """The key column's type (format_type), or a permanent error naming the column."""
    row = conn.execute(
        sql.SQL(
            "SELECT pg_catalog.format_type(a.atttypid, NULL) FROM pg_catalog.pg_attribute a"
            " WHERE a.attrelid OPERATOR(pg_catalog.=) {}::pg_catalog.regclass"
            " AND a.attname OPERATOR(pg_catalog.=) %s AND a.attnum OPERATOR(pg_catalog.>) 0"
            " AND NOT a.attisdropped"
        ).format(sql.Literal(relation.as_string(conn))),
        [key],
    ).fetchone()
    if row is None:
        raise PermanentError(f"slices.key: the table {table} has no column {key!r}")
    type_name = str(row[0])
    if family(type_name) is None:
        raise PermanentError(
            f"slices.key: column {key!r} of {table} is of type {type_name}; slices need an "
            "integer (smallint, integer, bigint), timestamp (timestamp, timestamptz, date) "
            "or uuid key"
        )
    return type_name


def _to_number(value: Any, kind: str) -> int:
    """A key value as an integer on a line where distance is meaningful."""
    if kind == "integer":
        return int(value)
    if kind == "uuid":
        return int(uuid.UUID(str(value)))
    if isinstance(value, datetime):
        # Absolute time for an aware value (UTC: no wall-clock arithmetic across DST).
        epoch = datetime(1970, 1, 1, tzinfo=UTC if value.tzinfo else None)
        return (value - epoch) // timedelta(microseconds=1)
    # a date: days
    return int(value.toordinal())


def _from_number(n: int, kind: str, like: Any) -> str:
    if kind == "integer":
        return str(n)
    if kind == "uuid":
        return str(uuid.UUID(int=n))
    if isinstance(like, datetime):
        epoch = datetime(1970, 1, 1, tzinfo=UTC if like.tzinfo else None)
        return (epoch + timedelta(microseconds=n)).isoformat()
    return type(like).fromordinal(n).isoformat()


def equal_bounds(low: int, high: int, count: int) -> list[int]:
    """The inner bounds that split [low, high] into at most `count` ranges of equal
    width, strictly increasing (fewer ranges when there are fewer distinct values)."""
    width = high - low + 1
    count = max(1, min(count, width))
    return [low + -(-(i * width) // count) for i in range(1, count)]


def ranges(inner: list[str]) -> list[tuple[str | None, str | None]]:
    """Inner bounds b1 < ... < bk -> k + 1 ranges, the first and last open."""
    edges: list[str | None] = [None, *inner, None]
    return [(edges[i], edges[i + 1]) for i in range(len(edges) - 1)]


def plan(
    conn: psycopg.Connection[Any],
    table: str,
    relation: sql.Composable,
    sliced: SliceSpec,
) -> Plan:
    """The ranges of a run, computed on the source (one short read-only transaction)."""
    type_name = key_type(conn, table, relation, sliced.key)
    kind = family(type_name)
    assert kind is not None
    col = sql.Identifier(sliced.key)
    # ORDER BY ... LIMIT 1 rather than min()/max(): every ordered type has it (uuid has no
    # min() before PostgreSQL 16), and an index on the key answers it at once.
    low, high = conn.execute(
        sql.SQL(
            "SELECT (SELECT {k} FROM {t} WHERE {k} IS NOT NULL ORDER BY {k} LIMIT 1),"
            " (SELECT {k} FROM {t} WHERE {k} IS NOT NULL ORDER BY {k} DESC LIMIT 1)"
        ).format(k=col, t=relation)
    ).fetchone()  # type: ignore[misc]
    method = "count" if sliced.count is not None else "rows_per_slice"
    if low is None:  # no row, or every key NULL: one slice holds everything
        return Plan(sliced.key, type_name, method, "no key values: one slice", [(None, None)])
    lo, hi = _to_number(low, kind), _to_number(high, kind)
    if sliced.count is not None:
        inner = equal_bounds(lo, hi, sliced.count)
        basis = f"count {sliced.count}: equal widths of [{low}, {high}]"
        return Plan(
            sliced.key, type_name, method, basis,
            ranges([_from_number(b, kind, low) for b in inner]),
        )  # fmt: skip
    assert sliced.rows_per_slice is not None
    estimate = conn.execute(
        sql.SQL(
            "SELECT c.reltuples::pg_catalog.int8 FROM pg_catalog.pg_class c"
            " WHERE c.oid OPERATOR(pg_catalog.=) {}::pg_catalog.regclass"
        ).format(sql.Literal(relation.as_string(conn)))
    ).fetchone()
    rows = int(estimate[0]) if estimate else -1
    counted = rows < 0  # never analysed (PostgreSQL 14+ says -1): count
    if counted:
        got = conn.execute(
            sql.SQL("SELECT pg_catalog.count(*) FROM {}").format(relation)
        ).fetchone()
        rows = int(got[0]) if got else 0
    count = max(1, math.ceil(rows / sliced.rows_per_slice))
    if count > limits.MAX_SLICES:
        raise PermanentError(
            f"slices.rows_per_slice: {rows:,} rows in slices of {sliced.rows_per_slice:,} "
            f"would be {count:,} slices, more than {limits.MAX_SLICES:,}"
        )
    source = "counted" if counted else "estimated"
    histogram = _histogram(conn, relation, sliced.key)
    if histogram and count <= len(histogram) - 1:
        picks = [histogram[round(i * (len(histogram) - 1) / count)] for i in range(1, count)]
        inner_text: list[str] = []
        last: int | None = None
        for value in picks:
            n = _to_number(_parse(conn, value, type_name), kind)
            if n > lo and (last is None or n > last):  # strictly increasing, inside
                inner_text.append(_from_number(n, kind, low))
                last = n
        basis = (
            f"rows_per_slice {sliced.rows_per_slice}: {rows:,} rows {source}, bounds from "
            "the key's histogram"
        )
        return Plan(sliced.key, type_name, method, basis, ranges(inner_text))
    inner = equal_bounds(lo, hi, count)
    basis = (
        f"rows_per_slice {sliced.rows_per_slice}: {rows:,} rows {source}, equal widths of "
        f"[{low}, {high}] (no histogram fine enough)"
    )
    return Plan(
        sliced.key, type_name, method, basis,
        ranges([_from_number(b, kind, low) for b in inner]),
    )  # fmt: skip


def _histogram(conn: psycopg.Connection[Any], relation: sql.Composable, key: str) -> list[str]:
    """The key's histogram bounds from pg_stats (text), or [] without statistics."""
    row = conn.execute(
        sql.SQL(
            "SELECT s.histogram_bounds::pg_catalog.text::pg_catalog.text[]"
            " FROM pg_catalog.pg_stats s"
            " JOIN pg_catalog.pg_class c ON c.relname OPERATOR(pg_catalog.=) s.tablename"
            " JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace"
            "  AND n.nspname OPERATOR(pg_catalog.=) s.schemaname"
            " WHERE c.oid OPERATOR(pg_catalog.=) {}::pg_catalog.regclass"
            "   AND s.attname OPERATOR(pg_catalog.=) %s AND NOT s.inherited"
        ).format(sql.Literal(relation.as_string(conn))),
        [key],
    ).fetchone()
    return list(row[0]) if row and row[0] else []


def _parse(conn: psycopg.Connection[Any], text: str, type_name: str) -> Any:
    """A histogram bound (text) as the key's Python value, parsed by the server."""
    row = conn.execute(
        sql.SQL("SELECT CAST(%s AS {})").format(
            sql.SQL(_CASTS[family(type_name) or ""][type_name])
        ),
        [text],
    ).fetchone()
    return row[0] if row else None


# The casts _parse may use, by family and type: fixed text, never the catalog's.
_CASTS: dict[str, dict[str, str]] = {
    "integer": {t: "pg_catalog.int8" for t in INTEGER_TYPES},
    "uuid": {"uuid": "pg_catalog.uuid"},
    "timestamp": {
        "timestamp without time zone": "pg_catalog.timestamp",
        "timestamp with time zone": "pg_catalog.timestamptz",
        "date": "pg_catalog.date",
    },
}


# --- reading one slice ------------------------------------------------------------------
def where(key: str, lower: str | None, upper: str | None) -> sql.Composable:
    """The condition of one range: the key's name as an Identifier, the bounds as
    literals (a COPY takes no parameters); untyped literals take the key's type."""
    col = sql.Identifier(key)
    if lower is None and upper is None:
        return sql.SQL("TRUE")
    if lower is None:
        return sql.SQL("({k} < {u} OR {k} IS NULL)").format(k=col, u=sql.Literal(upper))
    if upper is None:
        return sql.SQL("{k} >= {lo}").format(k=col, lo=sql.Literal(lower))
    return sql.SQL("{k} >= {lo} AND {k} < {u}").format(
        k=col, lo=sql.Literal(lower), u=sql.Literal(upper)
    )
