"""The receipt of a delivery: how many rows a sink's fenced transaction committed, and an
order-independent digest of them, computed the same way by the worker while the rows
stream (`Digest`) and by SQL on the sink afterwards (`digest_sql`).

The digest, precisely (docs/connectors.md, "Receipts"): each row's canonical text is its
line of PostgreSQL's text COPY format, without the newline, in UTF-8: every column's
output text (the type's output function, under the fixed output settings every dispatch
session sets: DateStyle ISO, IntervalStyle postgres, extra_float_digits 3, bytea_output
hex, TimeZone UTC), backslash, backspace, form feed, newline, carriage return, tab and
vertical tab escaped as `\\\\ \\b \\f \\n \\r \\t \\v`, NULL as `\\N`, the columns joined
by a tab. A row's hash is the first 8 bytes of the MD5 of that text, read as an unsigned
big-endian integer; the digest is the sum of the rows' hashes modulo 2^64, written as 16
hexadecimal digits. A sum is order-independent and combines: the digest of a sliced run
is the sum of its slices' digests.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from psycopg import sql

MODULUS = 1 << 64
_first_8 = struct.Struct(">Q").unpack_from
_md5 = hashlib.md5


def to_hex(value: int) -> str:
    return f"{value % MODULUS:016x}"


def combine(digests: Sequence[str]) -> str:
    """The digest of the union of rows whose digests are given (slices of one run)."""
    return to_hex(sum(int(d, 16) for d in digests))


class Digest:
    """The running count and digest of the rows written so far."""

    __slots__ = ("rows", "value")

    def __init__(self) -> None:
        self.rows = 0
        self.value = 0

    def add_text_block(self, data: bytes) -> int:
        """Add a block of text COPY data (whole lines, each ending with a newline; a
        newline inside a value is escaped, so splitting on it is exact). Returns the lines
        it held."""
        lines = data.split(b"\n")
        lines.pop()  # the empty remainder after the last newline
        md5, first_8 = _md5, _first_8
        self.value = (self.value + sum([first_8(md5(line).digest())[0] for line in lines])) % (
            MODULUS
        )
        self.rows += len(lines)
        return len(lines)

    def hex(self) -> str:
        return to_hex(self.value)


def _column_text(name: str) -> sql.Composable:
    # concat() formats with the type's output function, as COPY does (a cast to text may
    # not: boolean::text is 'true', COPY writes 't'; inet::text adds the netmask).
    value = sql.SQL("pg_catalog.concat({})").format(sql.Identifier(name))
    for char, escaped in (
        ("\\", "\\\\"),
        ("\b", "\\b"),
        ("\f", "\\f"),
        ("\n", "\\n"),
        ("\r", "\\r"),
        ("\t", "\\t"),
        ("\v", "\\v"),
    ):
        value = sql.SQL("pg_catalog.replace({}, {}, {})").format(
            value, sql.Literal(char), sql.Literal(escaped)
        )
    return sql.SQL("CASE WHEN {} IS NULL THEN {} ELSE {} END").format(
        sql.Identifier(name), sql.Literal("\\N"), value
    )


def digest_sql(
    relation: sql.Composable,
    columns: Sequence[str],
    where: sql.Composable | None = None,
    group: str | None = None,
) -> sql.Composed:
    """Rows (group value, count, digest as 16 hex digits) over `relation`'s rows (those
    matching `where`), the columns in the given order; one row (NULL, count, digest)
    without `group`. Run it in a session with dispatch's output settings
    (`OUTPUT_SETTINGS_SQL`)."""
    line = sql.Composed(
        [
            part
            for i, c in enumerate(columns)
            for part in (
                [sql.SQL(" OPERATOR(pg_catalog.||) E'\\t' OPERATOR(pg_catalog.||) ")] if i else []
            )
            + [_column_text(c)]
        ]
    )
    key = sql.Identifier(group) if group is not None else sql.SQL("NULL::uuid")
    # The first 16 hex digits of the MD5 as a signed bigint, made unsigned in numeric; the
    # sum modulo 2^64 (mod(), not %: the statement may take parameters) back to a signed bigint, whose to_hex is its two's complement.
    return sql.SQL(
        "SELECT g, n, pg_catalog.lpad(pg_catalog.to_hex((CASE WHEN s >= 9223372036854775808"
        " THEN s - 18446744073709551616 ELSE s END)::bigint), 16, '0')"
        " FROM (SELECT g, pg_catalog.count(*) AS n,"
        "  pg_catalog.mod(coalesce(pg_catalog.sum(h), 0), 18446744073709551616) AS s"
        "  FROM (SELECT {} AS g, pg_catalog.mod((('x' OPERATOR(pg_catalog.||) pg_catalog.left(pg_catalog.md5("
        "pg_catalog.convert_to({}, 'UTF8')), 16))::bit(64)::bigint)::numeric"
        " + 18446744073709551616, 18446744073709551616) AS h FROM {} AS t{}) AS hashes"
        "  GROUP BY g) AS total"
    ).format(
        key,
        line,
        relation,
        sql.SQL(" WHERE {}").format(where) if where is not None else sql.SQL(""),
    )


# The output settings every dispatch session sets (connect.open_session): the text of
# the rows, and so their digest, depends on them.
OUTPUT_SETTINGS_SQL = (
    "SELECT pg_catalog.set_config('DateStyle', 'ISO, MDY', false),"
    " pg_catalog.set_config('IntervalStyle', 'postgres', false),"
    " pg_catalog.set_config('extra_float_digits', '3', false),"
    " pg_catalog.set_config('bytea_output', 'hex', false),"
    " pg_catalog.set_config('TimeZone', 'UTC', false)"
)
