"""The `mysql` kind's type mapping, both ways (docs/connectors.md, "mysql: types").

MySQL -> PostgreSQL: a column's MySQL type (information_schema's COLUMN_TYPE for a
table, the wire metadata for a query) becomes the PostgreSQL type the source reports
(`Column.type`), and each value is decoded into the Python value that type takes. A
value no PostgreSQL type can hold (a zero date) fails the read with its column named.

PostgreSQL -> MySQL: a source's PostgreSQL type becomes the MySQL type of a created sink
column, and every value is checked against the sink column's MySQL type before it is
sent (`Check`): one that does not fit fails the write with its column named, before the
transaction commits, so no row of the run is kept.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import uuid
from collections.abc import Callable
from decimal import Context, Decimal, InvalidOperation
from typing import Any

from dispatch.connectors.base import PermanentError

Convert = Callable[[Any], Any]

_INT_PG = {
    ("tinyint", False): "smallint",
    ("tinyint", True): "smallint",
    ("smallint", False): "smallint",
    ("smallint", True): "integer",
    ("mediumint", False): "integer",
    ("mediumint", True): "integer",
    ("int", False): "integer",
    ("int", True): "bigint",
    ("bigint", False): "bigint",
    ("bigint", True): "numeric(20,0)",
}
_INT_RANGE = {
    "tinyint": (-(2**7), 2**7 - 1, 2**8 - 1),
    "smallint": (-(2**15), 2**15 - 1, 2**16 - 1),
    "mediumint": (-(2**23), 2**23 - 1, 2**24 - 1),
    "int": (-(2**31), 2**31 - 1, 2**32 - 1),
    "bigint": (-(2**63), 2**63 - 1, 2**64 - 1),
}
_TEXT = {"tinytext", "text", "mediumtext", "longtext"}
_BLOB = {"tinyblob", "blob", "mediumblob", "longblob"}
_TEXT_BYTES = {"tinytext": 255, "text": 65535, "mediumtext": 2**24 - 1, "longtext": 2**32 - 1}
# TIMESTAMP's range, [start, end).
_TIMESTAMP_START = dt.datetime(1970, 1, 1, 0, 0, 1)
_TIMESTAMP_END = dt.datetime(2038, 1, 19, 3, 14, 8)
# A lone surrogate (no UTF-8 form): found by the regex engine, not a loop per character.
_SURROGATE = re.compile("[\ud800-\udfff]")
_SPATIAL = {
    "geometry",
    "point",
    "linestring",
    "polygon",
    "multipoint",
    "multilinestring",
    "multipolygon",
    "geometrycollection",
}


class MySQLType:
    """One column's MySQL type, parsed from COLUMN_TYPE text (`bigint(20) unsigned`,
    `decimal(65,30)`, `enum('a','b')`, `datetime(6)`, ...)."""

    def __init__(self, text: str) -> None:
        self.text = text.strip()
        lowered = self.text.lower()
        m = re.match(r"([a-z]+)\s*(?:\((.*)\))?\s*(.*)$", lowered, re.S)
        if m is None:
            raise PermanentError(f"unknown MySQL type {text!r}")
        self.base = m.group(1)
        self.args = m.group(2) or ""
        self.unsigned = "unsigned" in m.group(3)
        if self.base in ("integer",):
            self.base = "int"
        if self.base in ("dec", "numeric", "fixed"):
            self.base = "decimal"
        if self.base in ("bool", "boolean"):
            self.base, self.args = "tinyint", "1"
        if self.base == "real":
            self.base = "double"

    def numbers(self) -> list[int]:
        return [int(x) for x in re.findall(r"\d+", self.args)] if self.base != "enum" else []

    def labels(self) -> list[str]:
        """The values of an ENUM or SET, unquoted."""
        return [v.replace("''", "'") for v in re.findall(r"'((?:[^']|'')*)'", self.text)]

    # -- MySQL -> PostgreSQL -----------------------------------------------------------
    def pg_type(self) -> str:
        b, n = self.base, self.numbers()
        if b in _INT_RANGE:
            return _INT_PG[(b, self.unsigned)]
        if b == "decimal":
            p, s = (n + [10, 0])[:2] if n else (10, 0)
            if len(n) == 1:
                s = 0
            return f"numeric({p},{s})"
        if b == "float":
            return "real"
        if b == "double":
            return "double precision"
        if b == "bit":
            return f"bit({n[0] if n else 1})"
        if b == "char":
            return f"character({n[0] if n else 1})"
        if b == "varchar":
            return f"character varying({n[0]})"
        if b in _TEXT or b == "enum":
            return "text"
        if b == "set":
            return "text[]"
        if b in ("binary", "varbinary") or b in _BLOB or b in _SPATIAL:
            return "bytea"
        if b == "json":
            return "jsonb"
        if b == "date":
            return "date"
        if b == "datetime":
            return f"timestamp({n[0] if n else 0}) without time zone"
        if b == "timestamp":
            return f"timestamp({n[0] if n else 0}) with time zone"
        if b == "time":
            return "interval"
        if b == "year":
            return "smallint"
        if b in ("uuid", "inet4", "inet6"):  # MariaDB 10.7+/10.10+
            return {"uuid": "uuid", "inet4": "inet", "inet6": "inet"}[b]
        raise PermanentError(f"the MySQL type {self.text!r} has no PostgreSQL mapping")

    def reader(self, column: str) -> Convert | None:
        """The decoder of this column's values as the driver returns them, or None."""
        b = self.base
        if b == "bit":
            width = (self.numbers() or [1])[0]
            return lambda v: None if v is None else format(int.from_bytes(v, "big"), f"0{width}b")
        if b == "set":
            return lambda v: (
                None
                if v is None
                else sorted(v)
                if isinstance(v, set)
                else ([x for x in str(v).split(",") if x] if v != "" else [])
            )
        if b in ("date", "datetime", "timestamp"):
            utc = b == "timestamp"

            def date(v: Any) -> Any:
                if type(v) is dt.datetime:  # the common case first
                    return v.replace(tzinfo=dt.UTC) if utc else v
                if isinstance(v, str | bytes):
                    text = v.decode() if isinstance(v, bytes) else v
                    raise PermanentError(
                        f"source column {column!r}: the value {text!r} (a zero or invalid "
                        "date) has no PostgreSQL value; select it as NULL (NULLIF) or fix it"
                    )
                if utc and isinstance(v, dt.datetime):
                    return v.replace(tzinfo=dt.UTC)
                return v

            return date
        if b == "json":
            return lambda v: v.decode() if isinstance(v, bytes) else v
        if b in _TEXT or b in ("char", "varchar", "enum"):
            return lambda v: v.decode() if isinstance(v, bytes) else v
        if b == "year":
            return lambda v: None if v is None else int(v)
        return None

    # -- PostgreSQL values -> this MySQL column -----------------------------------------
    def check(self, column: str) -> Convert:
        """A function that returns the value to send for this column, or raises
        PermanentError naming the column when the column cannot hold it."""
        b, n = self.base, self.numbers()

        def refuse(v: Any, why: str) -> PermanentError:
            shown = repr(v) if len(repr(v)) <= 60 else repr(v)[:57] + "..."
            return PermanentError(f"sink column {column!r} ({self.text}): {shown} {why}")

        if b in _INT_RANGE:
            lo, hi, uhi = _INT_RANGE[b]
            if self.unsigned:
                lo, hi = 0, uhi

            def integer(v: Any) -> Any:
                if v is None:
                    return None
                if isinstance(v, bool):
                    return int(v)
                try:
                    i = int(v) if not isinstance(v, float | Decimal) or v == int(v) else None
                except (ValueError, TypeError, OverflowError, InvalidOperation):
                    i = None
                if i is None:
                    raise refuse(v, "is not an integer")
                if not lo <= i <= hi:
                    raise refuse(v, f"is out of range ({lo}..{hi})")
                return i

            return integer
        if b == "decimal":
            p, s = (n + [10, 0])[:2] if n else (10, 0)
            if len(n) == 1:
                s = 0

            exact = Context(prec=200)
            quantum = Decimal(1).scaleb(-s)

            def decimal(v: Any) -> Any:
                if v is None:
                    return None
                try:
                    d = v if type(v) is Decimal else Decimal(str(v))
                except InvalidOperation:
                    raise refuse(v, "is not a number") from None
                if not d.is_finite():
                    raise refuse(v, "is not finite")
                q = d.quantize(quantum, context=exact)
                if q.compare(d, context=exact) != 0:
                    raise refuse(v, f"has more than {s} decimal places")
                if q.adjusted() >= p - s:
                    raise refuse(v, f"has more than {p - s} integer digits")
                if self.unsigned and q < 0:
                    raise refuse(v, "is negative")
                return q

            return decimal
        if b in ("float", "double"):

            def floating(v: Any) -> Any:
                if v is None:
                    return None
                f = float(v)
                if f != f or f in (float("inf"), float("-inf")):
                    raise refuse(v, "is not finite (MySQL has no NaN or infinity)")
                return f

            return floating
        if b == "bit":
            width = n[0] if n else 1

            def bits(v: Any) -> Any:
                if v is None:
                    return None
                if isinstance(v, bool):
                    v = int(v)
                if isinstance(v, int):
                    value = v
                else:
                    text = str(v)
                    if not re.fullmatch(r"[01]*", text):
                        raise refuse(v, "is not a bit string")
                    value = int(text or "0", 2)
                if value.bit_length() > width:
                    raise refuse(v, f"has more than {width} bits")
                return value.to_bytes((width + 7) // 8, "big")

            return bits
        if b in ("char", "varchar") or b in _TEXT or b in ("enum", "set"):
            limit = n[0] if n and b in ("char", "varchar") else None
            labels = set(self.labels()) if b in ("enum", "set") else None
            is_set = b == "set"
            no_nul = b not in _TEXT and b not in ("char", "varchar")
            max_bytes = _TEXT_BYTES[b] if b in _TEXT else None

            def text(v: Any) -> Any:
                if v is None:
                    return None
                if is_set and isinstance(v, list | tuple | set):
                    parts = [str(x) for x in v]
                    s = ",".join(parts)
                else:
                    s = v if type(v) is str else _text(v)
                    parts = [x for x in s.split(",") if x] if is_set else [s]
                if no_nul and "\x00" in s:
                    raise refuse(v, "holds a NUL character")
                if limit is not None and len(s) > limit:
                    raise refuse(v, f"is longer than {limit} characters")
                # A character is at most 4 bytes in UTF-8: only a long text is encoded.
                if (
                    max_bytes is not None
                    and len(s) * 4 > max_bytes
                    and len(s.encode("utf-8", "surrogatepass")) > max_bytes
                ):
                    raise refuse(v, f"is longer than {max_bytes} bytes")
                if labels is not None and any(x not in labels for x in parts):
                    raise refuse(v, "is not one of the column's values")
                if _SURROGATE.search(s) is not None:
                    raise refuse(v, "is not valid Unicode")
                return s

            return text
        if b in ("binary", "varbinary") or b in _BLOB:
            limit = n[0] if n and b in ("binary", "varbinary") else None

            def binary(v: Any) -> Any:
                if v is None:
                    return None
                data = (
                    bytes(v) if isinstance(v, bytes | bytearray | memoryview) else _text(v).encode()
                )
                if limit is not None and len(data) > limit:
                    raise refuse(v, f"is longer than {limit} bytes")
                return data

            return binary
        if b == "json":

            def as_json(v: Any) -> Any:
                if v is None:
                    return None
                if isinstance(v, str):
                    try:
                        json.loads(v)
                    except ValueError:
                        raise refuse(v, "is not JSON") from None
                    return v
                # An array's numbers (Decimal), dates and UUIDs as their text.
                return json.dumps(v, ensure_ascii=False, default=str)

            return as_json
        if b in ("date", "datetime", "timestamp"):
            is_date, is_timestamp = b == "date", b == "timestamp"
            lowest = 1970 if is_timestamp else 1000
            highest = 2038 if is_timestamp else 9999

            def moment(v: Any) -> Any:
                if v is None:
                    return None
                if isinstance(v, str):
                    try:
                        v = (
                            dt.datetime.fromisoformat(v)
                            if b != "date"
                            else dt.date.fromisoformat(v)
                        )
                    except ValueError:
                        raise refuse(v, "is not a date/time") from None
                if not isinstance(v, dt.date):
                    raise refuse(v, "is not a date/time")
                if isinstance(v, dt.datetime) and v.tzinfo is not None:
                    # UTC, naive: the offset taken off (astimezone's work, without its
                    # time-zone object).
                    offset = v.utcoffset()
                    v = (v - offset if offset is not None else v.astimezone(dt.UTC)).replace(
                        tzinfo=None
                    )
                if is_date and isinstance(v, dt.datetime):
                    if v.time() != dt.time(0):
                        raise refuse(v, "has a time of day (the column is a DATE)")
                    v = v.date()
                year = v.year
                if not lowest <= year <= highest:
                    raise refuse(v, f"is outside the years {lowest}..{highest}")
                if (
                    is_timestamp
                    and isinstance(v, dt.datetime)
                    and (v >= _TIMESTAMP_END or v < _TIMESTAMP_START)
                ):
                    raise refuse(v, "is outside TIMESTAMP's range")
                return v

            return moment
        if b == "time":

            def duration(v: Any) -> Any:
                if v is None:
                    return None
                if isinstance(v, dt.time):
                    if v.tzinfo is not None:
                        raise refuse(v, "has a time zone (MySQL TIME has none)")
                    v = dt.timedelta(
                        hours=v.hour, minutes=v.minute, seconds=v.second, microseconds=v.microsecond
                    )
                if not isinstance(v, dt.timedelta):
                    raise refuse(v, "is not a time or a duration of days, hours and seconds")
                if abs(v) > dt.timedelta(hours=838, minutes=59, seconds=59):
                    raise refuse(v, "is outside TIME's range (-838:59:59..838:59:59)")
                return v

            return duration
        if b == "year":

            def year(v: Any) -> Any:
                if v is None:
                    return None
                i = int(v)
                if not (1901 <= i <= 2155 or i == 0):
                    raise refuse(v, "is outside YEAR's range (1901..2155)")
                return i

            return year
        if b in _SPATIAL:
            return lambda v: None if v is None else bytes(v)
        return lambda v: None if v is None else _text(v)


# Columns LOAD DATA cannot take from text (the sink inserts those rows instead). `json` is
# MySQL's native type (MariaDB's JSON is a LONGTEXT, and its COLUMN_TYPE says so): MySQL
# refuses a JSON value in the load's CHARACTER SET binary (error 3144).
NO_LOAD = frozenset({"bit", "json", *_SPATIAL})
_ESCAPES = {0: b"\\0", 9: b"\\t", 10: b"\\n", 13: b"\\r", 92: b"\\\\", 26: b"\\Z"}
_NEEDS_ESCAPE = re.compile(rb"[\x00\t\n\r\\\x1a]")


def _escape(data: bytes) -> bytes:
    if _NEEDS_ESCAPE.search(data) is None:
        return data
    return _NEEDS_ESCAPE.sub(lambda m: _ESCAPES[m.group()[0]], data)


def _time(v: dt.timedelta) -> str:
    sign = "-" if v < dt.timedelta(0) else ""
    v = abs(v)
    seconds = v.days * 86400 + v.seconds
    return (
        f"{sign}{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
        f".{v.microseconds:06d}"
    )


def _field(v: Any) -> bytes:
    """One value (already checked for its column) in LOAD DATA's default text format."""
    if v is None:
        return b"\\N"
    if isinstance(v, bool):
        return b"1" if v else b"0"
    if isinstance(v, int):
        return str(v).encode()
    if isinstance(v, float):
        return repr(v).encode()
    if isinstance(v, Decimal):
        return format(v, "f").encode()
    if isinstance(v, dt.datetime | dt.date):
        return (
            v.isoformat(sep=" ").encode() if isinstance(v, dt.datetime) else v.isoformat().encode()
        )
    if isinstance(v, dt.timedelta):
        return _time(v).encode()
    if isinstance(v, bytes | bytearray | memoryview):
        return _escape(bytes(v))
    return _escape(str(v).encode("utf-8"))


def _load_int(v: Any) -> bytes:
    return b"%d" % v


def _load_decimal(v: Any) -> bytes:
    return format(v, "f").encode()


def _load_float(v: Any) -> bytes:
    return repr(v).encode()


def _load_text(v: Any) -> bytes:
    return _escape(v.encode("utf-8"))


def _load_moment(v: Any) -> bytes:
    return (v.isoformat(sep=" ") if isinstance(v, dt.datetime) else v.isoformat()).encode()


# What `check` returns for a column of each base type is of one Python type (an int for
# the integers, a str for the texts, ...), so its LOAD DATA text is made without asking;
# any other base goes through `_field`.
_LOADERS: dict[str, Callable[[Any], bytes]] = {
    **dict.fromkeys(_INT_RANGE, _load_int),
    "year": _load_int,
    "decimal": _load_decimal,
    "float": _load_float,
    "double": _load_float,
    **dict.fromkeys(("char", "varchar", "enum", "set", *_TEXT), _load_text),
    **dict.fromkeys(("date", "datetime", "timestamp"), _load_moment),
}


def loader(mysql_type: MySQLType, column: str) -> Callable[[Any], bytes]:
    """The column's `check` and the checked value's LOAD DATA text (`_field`'s) in one
    function: what a loaded batch does per value."""
    check = mysql_type.check(column)
    encode = _LOADERS.get(mysql_type.base, _field)

    def load(v: Any) -> bytes:
        if v is None:
            return b"\\N"
        checked = check(v)
        return b"\\N" if checked is None else encode(checked)

    return load


def load_rows(loaders: list[Callable[[Any], bytes]], rows: list[Any]) -> bytes:
    """`rows` checked, in LOAD DATA's default format: tab-separated, newline-terminated,
    backslash escapes, \\N for NULL."""
    return b"".join(
        [b"\t".join([f(v) for f, v in zip(loaders, row, strict=True)]) + b"\n" for row in rows]
    )


def _text(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, bytes | bytearray | memoryview):
        return bytes(v).decode("utf-8", "surrogateescape")
    if isinstance(v, dict | list):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, uuid.UUID):
        return str(v)
    return str(v)


# --- PostgreSQL -> MySQL (a created sink table's columns) -------------------------------------
_PG_SIMPLE = {
    "smallint": "SMALLINT",
    "integer": "INT",
    "bigint": "BIGINT",
    "real": "FLOAT",
    "double precision": "DOUBLE",
    "boolean": "TINYINT(1)",
    "text": "LONGTEXT",
    "bytea": "LONGBLOB",
    "date": "DATE",
    "time without time zone": "TIME(6)",
    "interval": "TIME(6)",
    "uuid": "CHAR(36)",
    "json": "JSON",
    "jsonb": "JSON",
    "money": "VARCHAR(32)",  # its text, in the source server's lc_monetary format
    "numeric": "DECIMAL(65,30)",
    "inet": "VARCHAR(43)",
    "cidr": "VARCHAR(43)",
    "macaddr": "VARCHAR(17)",
    "macaddr8": "VARCHAR(23)",
    "xml": "LONGTEXT",
    "oid": "INT UNSIGNED",
    "text[]": "SET_OR_JSON",
}


def mysql_type(pg: str) -> str:
    """The MySQL type of a created sink column for a source column of PostgreSQL type
    `pg` ("" for an untyped source: LONGTEXT). Fixed words only: the source's text never
    reaches the statement, only numbers parsed out of it."""
    t = pg.strip().lower()
    if not t:
        return "LONGTEXT"
    if t.endswith("[]"):
        return "JSON"  # arrays as JSON arrays
    if t in _PG_SIMPLE and _PG_SIMPLE[t] != "SET_OR_JSON":
        return _PG_SIMPLE[t]
    m = re.fullmatch(r"numeric\((\d+),(\d+)\)", t.replace(" ", ""))
    if m:
        p, s = int(m.group(1)), int(m.group(2))
        if p <= 65 and s <= 30:
            return f"DECIMAL({p},{s})"
        return "DECIMAL(65,30)"  # values are checked against it
    m = re.fullmatch(r"character varying\((\d+)\)", t)
    if m:
        n = int(m.group(1))
        return f"VARCHAR({n})" if n <= 16383 else "LONGTEXT"
    if t == "character varying":
        return "LONGTEXT"
    m = re.fullmatch(r"character\((\d+)\)", t)
    if m:
        n = int(m.group(1))
        return f"CHAR({n})" if n <= 255 else f"VARCHAR({n})" if n <= 16383 else "LONGTEXT"
    m = re.fullmatch(r"bit(?: varying)?\((\d+)\)", t)
    if m:
        n = int(m.group(1))
        return f"BIT({n})" if n <= 64 else f"VARCHAR({min(n, 16383)})"
    m = re.fullmatch(r"timestamp(?:\((\d)\))? with(out)? time zone", t)
    if m:
        return f"DATETIME({m.group(1) or 6})"
    m = re.fullmatch(r"time(?:\((\d)\))? without time zone", t)
    if m:
        return f"TIME({m.group(1) or 6})"
    if t.startswith("interval"):
        return "TIME(6)"
    return "LONGTEXT"  # every other type (ranges, geometric, enums, tsvector...): its text
