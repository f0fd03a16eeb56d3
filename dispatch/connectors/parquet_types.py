"""PostgreSQL <-> Arrow types for the `parquet` kind (docs/connectors.md, "Parquet types").

A sink maps each source column by its exact PostgreSQL type text (`Column.type`, what
`format_type()` prints) and keeps that text in the Arrow field's metadata
(`dispatch.postgresql_type`), so a Parquet source gives a PostgreSQL sink the very type
the data came from. A file written elsewhere is mapped from its Arrow types.

Where Parquet has no exact type the value goes as text a PostgreSQL sink parses back:
unconstrained `numeric` (any precision, and NaN and Infinity), `interval` (Parquet's
INTERVAL is not written by Arrow; the driver hands over a timedelta, in which a month is
30 days and a year 365), `time with time zone`, and every type not in the table
(domains, enums, ranges, network and geometric types: the value's text).
"""

from __future__ import annotations

import datetime as dt
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import pyarrow as pa

from dispatch.connectors.base import Column, PermanentError

# The field metadata key that carries a column's PostgreSQL type.
PG_TYPE_KEY = b"dispatch.postgresql_type"
# Parquet decimals of up to 38 digits are what every reader takes (DuckDB and Spark
# read no wider decimal exactly: DuckDB turns one into a double).
DECIMAL_DIGITS = 38

Convert = Callable[[Any], Any]


@dataclass(frozen=True)
class Mapped:
    """One column's Arrow type, and the function that makes each non-null value fit it
    (None: the driver's value fits as it is)."""

    arrow: pa.DataType
    convert: Convert | None = None


def _numeric_text(value: Any) -> str:
    if isinstance(value, Decimal) and value.is_finite():
        return format(value, "f")
    return str(value)  # NaN, Infinity, -Infinity as PostgreSQL spells them


def _interval_text(value: Any) -> str:
    """A timedelta as PostgreSQL interval input (`3 days 00:00:01.5`)."""
    if not isinstance(value, dt.timedelta):
        return str(value)
    micros = value.days * 86_400_000_000 + value.seconds * 1_000_000 + value.microseconds
    sign = "-" if micros < 0 else ""
    days, rest = divmod(abs(micros), 86_400_000_000)
    hours, rest = divmod(rest, 3_600_000_000)
    minutes, rest = divmod(rest, 60_000_000)
    seconds, micro = divmod(rest, 1_000_000)
    clock = f"{hours:02d}:{minutes:02d}:{seconds:02d}" + (f".{micro:06d}" if micro else "")
    return f"{sign}{days} days {sign}{clock}" if days else f"{sign}{clock}"


def _json_text(value: Any) -> str:
    # The driver parses json/jsonb into Python objects; their JSON text again (jsonb's
    # own spacing: `{"a": 1}`).
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _uuid_bytes(value: Any) -> bytes:
    return value.bytes if isinstance(value, uuid.UUID) else uuid.UUID(str(value)).bytes


def _time_text(value: Any) -> str:
    return value.isoformat() if isinstance(value, dt.time) else str(value)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else str(value)


_NUMERIC = re.compile(r"numeric\((\d+)(?:,(-?\d+))?\)")
_SCALARS: dict[str, Mapped] = {
    "boolean": Mapped(pa.bool_()),
    "smallint": Mapped(pa.int16()),
    "integer": Mapped(pa.int32()),
    "bigint": Mapped(pa.int64()),
    "real": Mapped(pa.float32()),
    "double precision": Mapped(pa.float64()),
    "numeric": Mapped(pa.string(), _numeric_text),
    "text": Mapped(pa.string()),
    "name": Mapped(pa.string()),
    '"char"': Mapped(pa.string()),
    "citext": Mapped(pa.string(), _text),
    "xml": Mapped(pa.string(), _text),
    "bytea": Mapped(pa.binary()),
    "date": Mapped(pa.date32()),
    "time without time zone": Mapped(pa.time64("us")),
    "time with time zone": Mapped(pa.string(), _time_text),
    "timestamp without time zone": Mapped(pa.timestamp("us")),
    "timestamp with time zone": Mapped(pa.timestamp("us", tz="UTC")),
    "interval": Mapped(pa.string(), _interval_text),
    "json": Mapped(pa.json_(), _json_text),
    "jsonb": Mapped(pa.json_(), _json_text),
    "uuid": Mapped(pa.uuid(), _uuid_bytes),
}
# Type modifiers that do not change the Arrow type: `character varying(20)`,
# `timestamp(3) with time zone`, `interval day to second`, `bit(3)`.
_MODIFIER = re.compile(r"\(\d+\)")


def _base(pg_type: str) -> str:
    t = pg_type.strip()
    if t.startswith(("character varying", "character", "bpchar")):
        return "text"
    if t.startswith("interval"):
        return "interval"
    if _NUMERIC.fullmatch(t):
        return t
    return _MODIFIER.sub("", t).replace("  ", " ").strip()


def _scalar(pg_type: str) -> Mapped:
    base = _base(pg_type)
    m = _NUMERIC.fullmatch(base)
    if m:
        precision, scale = int(m.group(1)), int(m.group(2) or 0)
        if 0 <= scale <= precision <= DECIMAL_DIGITS:
            return Mapped(pa.decimal128(precision, scale))
        return _SCALARS["numeric"]  # wider (or a negative scale): exact text
    return _SCALARS.get(base, Mapped(pa.string(), _text))


def _each(convert: Convert) -> Convert:
    def items(values: Any) -> Any:
        if not isinstance(values, list):
            raise PermanentError(f"an array value is not a list: {type(values).__name__}")
        return [None if v is None else convert(v) for v in values]

    return items


def to_arrow(pg_type: str) -> Mapped:
    """The Arrow type (and value conversion) of a column of PostgreSQL type `pg_type`;
    an empty type (a CSV source) is text. Arrays become lists of their element's type
    (one dimension)."""
    if not pg_type:
        return Mapped(pa.string(), _text)
    if pg_type.endswith("[]"):
        element = to_arrow(pg_type[:-2])
        if isinstance(element.arrow, pa.BaseExtensionType):
            # Arrow builds no list of an extension type from Python values: uuid and json
            # elements go as their text.
            element = Mapped(pa.string(), _json_text if element.convert is _json_text else _text)
        return Mapped(pa.list_(element.arrow), _each(element.convert) if element.convert else None)
    return _scalar(pg_type)


def schema(columns: list[Column]) -> tuple[pa.Schema, list[Convert | None]]:
    """The Arrow schema of rows with these columns, each field carrying its PostgreSQL
    type, and the value conversion per column."""
    fields, converts = [], []
    for c in columns:
        mapped = to_arrow(c.type)
        meta = {PG_TYPE_KEY: c.type.encode()} if c.type else None
        fields.append(pa.field(c.name, mapped.arrow, metadata=meta))
        converts.append(mapped.convert)
    return pa.schema(fields), converts


def record_batch(
    rows: list[Any], arrow_schema: pa.Schema, converts: list[Convert | None]
) -> pa.RecordBatch:
    """The rows as one Arrow record batch; a value that does not fit its column is a
    permanent error naming the column."""
    arrays = []
    for i, (field, convert) in enumerate(zip(arrow_schema, converts, strict=True)):
        values = [row[i] for row in rows]
        if convert is not None:
            values = [None if v is None else convert(v) for v in values]
        try:
            arrays.append(pa.array(values, type=field.type))
        except (
            pa.ArrowInvalid,
            pa.ArrowTypeError,
            pa.ArrowNotImplementedError,
            TypeError,
            ValueError,
            OverflowError,
        ) as exc:
            raise PermanentError(
                f"column {field.name!r} ({_pg_type(field) or field.type}): a value does not "
                f"fit Parquet's {field.type}: {exc}"
            ) from None
    return pa.RecordBatch.from_arrays(arrays, schema=arrow_schema)


def _pg_type(field: pa.Field) -> str:
    meta = field.metadata or {}
    return meta.get(PG_TYPE_KEY, b"").decode("utf-8", "replace")


# --- Arrow -> PostgreSQL (the source's columns) ---------------------------------------------
_FROM_ARROW: list[tuple[Callable[[pa.DataType], bool], str]] = [
    (pa.types.is_boolean, "boolean"),
    (pa.types.is_int8, "smallint"),
    (pa.types.is_int16, "smallint"),
    (pa.types.is_int32, "integer"),
    (pa.types.is_int64, "bigint"),
    (pa.types.is_uint8, "smallint"),
    (pa.types.is_uint16, "integer"),
    (pa.types.is_uint32, "bigint"),
    (pa.types.is_uint64, "numeric(20,0)"),
    (pa.types.is_float16, "real"),
    (pa.types.is_float32, "real"),
    (pa.types.is_float64, "double precision"),
    (pa.types.is_string, "text"),
    (pa.types.is_large_string, "text"),
    (pa.types.is_string_view, "text"),
    (pa.types.is_binary, "bytea"),
    (pa.types.is_large_binary, "bytea"),
    (pa.types.is_fixed_size_binary, "bytea"),
    (pa.types.is_date, "date"),
    (pa.types.is_time, "time without time zone"),
    (pa.types.is_duration, "interval"),
]


def from_arrow(field: pa.Field) -> str:
    """The PostgreSQL type of an Arrow field: the type a dispatch sink recorded in the
    field's metadata, else the nearest type for its Arrow type (text for the rest)."""
    recorded = _pg_type(field)
    if recorded:
        return recorded
    return _pg_of(field.type)


def _pg_of(t: pa.DataType) -> str:
    if isinstance(t, pa.BaseExtensionType):
        name = t.extension_name
        if name == "arrow.uuid":
            return "uuid"
        if name == "arrow.json":
            return "jsonb"
        return _pg_of(t.storage_type)
    if pa.types.is_dictionary(t):
        return _pg_of(t.value_type)
    if pa.types.is_decimal(t):
        return f"numeric({t.precision},{t.scale})"
    if pa.types.is_timestamp(t):
        return "timestamp with time zone" if t.tz else "timestamp without time zone"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        element = _pg_of(t.value_type)
        # A list of lists, structs or maps is one jsonb value (`python_values`).
        return "jsonb" if _nested_list(t) else element + "[]"
    if pa.types.is_struct(t) or pa.types.is_map(t):
        return "jsonb"
    for test, pg in _FROM_ARROW:
        if test(t):
            return pg
    return "text"


def python_values(column: pa.Array | pa.ChunkedArray) -> list[Any]:
    """A column's values as the Python objects a PostgreSQL sink writes: structs and maps
    (jsonb) as JSON text, uuids as UUID, durations as timedeltas."""
    t = column.type
    values = column.to_pylist()
    if isinstance(t, pa.BaseExtensionType):
        t = t.storage_type if t.extension_name not in ("arrow.uuid",) else t
    if pa.types.is_struct(t) or pa.types.is_map(t) or _nested_list(t):
        return [None if v is None else json.dumps(_jsonable(v), ensure_ascii=False) for v in values]
    return values


def _nested_list(t: pa.DataType) -> bool:
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        inner = t.value_type
        return (
            pa.types.is_list(inner)
            or pa.types.is_large_list(inner)
            or pa.types.is_struct(inner)
            or pa.types.is_map(inner)
        )
    return False


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        # A map arrives as a list of (key, value) pairs.
        if value and all(isinstance(p, tuple) and len(p) == 2 for p in value):
            return {str(k): _jsonable(v) for k, v in value}
        return [_jsonable(v) for v in value]
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, dt.date | dt.time | dt.datetime):
        return value.isoformat()
    if isinstance(value, bytes):
        return "\\x" + value.hex()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value
