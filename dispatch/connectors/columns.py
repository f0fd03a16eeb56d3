"""A table source's `columns` option: which columns to read, under which sink names, and
which to pseudonymise with a keyed hash. Identifiers only, never SQL: the reader quotes
every name (`psycopg.sql.Identifier`) and checks them against the source's own column
list when it opens (docs/connectors.md, "Columns")."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ValidationError

from dispatch.connectors.base import Column, PermanentError

SPEC_FIELDS = frozenset({"select", "exclude", "rename", "hash"})
# PostgreSQL's NAMEDATALEN - 1: a longer identifier is silently truncated by the server,
# so two different names in a spec could name the same column.
MAX_IDENTIFIER_BYTES = 63
# A hashed column's sink type: the hex text of an HMAC-SHA256.
HASH_TYPE = "text"


@dataclass(frozen=True)
class ColumnsSpec:
    select: tuple[str, ...] | None
    exclude: tuple[str, ...]
    rename: dict[str, str]
    hash: tuple[str, ...]


@dataclass(frozen=True)
class Projected:
    """One column the read delivers: its name in the source, in the sink, and whether its
    values are replaced by their keyed hash."""

    source: str
    sink: str
    hashed: bool


def _identifier(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValidationError(f"{what}: must be a non-empty column name")
    if "\x00" in value:
        raise ValidationError(f"{what}: a column name cannot hold a NUL character")
    if len(value.encode("utf-8")) > MAX_IDENTIFIER_BYTES:
        raise ValidationError(
            f"{what}: {value[:20]!r}... is longer than {MAX_IDENTIFIER_BYTES} bytes"
        )
    return value


def _names(value: Any, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ValidationError(f"{what}: must be a non-empty list of column names")
    names = tuple(_identifier(v, what) for v in value)
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValidationError(f"{what}: {', '.join(dup)} named more than once")
    return names


def parse(spec: dict[str, Any]) -> ColumnsSpec | None:
    """The spec's `columns`, checked for shape (ValidationError naming the field), or
    None when the spec has none."""
    raw = spec.get("columns")
    if raw is None:
        return None
    if not isinstance(raw, dict) or not raw:
        raise ValidationError(
            "columns: must be an object with select or exclude, rename, hash (e.g. "
            '{"exclude": ["notes"], "rename": {"id": "order_id"}})'
        )
    unknown = sorted(set(raw) - SPEC_FIELDS)
    if unknown:
        raise ValidationError(
            f"columns: unknown field(s) {', '.join(unknown)}; allowed: "
            f"{', '.join(sorted(SPEC_FIELDS))}"
        )
    if "select" in raw and "exclude" in raw:
        raise ValidationError("columns: give select or exclude, not both")
    select = _names(raw["select"], "columns.select") if "select" in raw else None
    exclude = _names(raw["exclude"], "columns.exclude") if "exclude" in raw else ()
    rename: dict[str, str] = {}
    if "rename" in raw:
        if not isinstance(raw["rename"], dict) or not raw["rename"]:
            raise ValidationError("columns.rename: must be an object of source name to sink name")
        for src, dst in raw["rename"].items():
            rename[_identifier(src, "columns.rename")] = _identifier(dst, "columns.rename")
    hashed = _names(raw["hash"], "columns.hash") if "hash" in raw else ()
    for what, names in (("columns.rename", tuple(rename)), ("columns.hash", hashed)):
        gone = [n for n in names if n in exclude or (select is not None and n not in select)]
        if gone:
            raise ValidationError(f"{what}: {', '.join(gone)} not among the columns read")
    return ColumnsSpec(select, exclude, rename, hashed)


def hashes(spec: Any) -> bool:
    """Whether a (source) spec asks for keyed hashes: its run needs the binding's key."""
    raw = spec.get("columns") if isinstance(spec, dict) else None
    return isinstance(raw, dict) and bool(raw.get("hash"))


def validate(spec: dict[str, Any]) -> None:
    """Save-time checks that need no connection: the shape, and that a query source (whose
    columns its author writes) does not take the option."""
    parsed = parse(spec)
    if parsed is not None and not spec.get("table"):
        raise ValidationError(
            "columns: for table sources only (a query chooses and names its own columns)"
        )


def project(parsed: ColumnsSpec, available: list[str]) -> list[Projected]:
    """The columns the read delivers, from the source's own column list (in its order,
    or in `select`'s): a name the source does not have is a PermanentError naming it, as
    is a sink name given twice."""
    have = set(available)
    named = [
        *(parsed.select or ()),
        *parsed.exclude,
        *parsed.rename,
        *parsed.hash,
    ]
    missing = sorted({n for n in named if n not in have})
    if missing:
        raise PermanentError(
            f"columns: the source has no column(s) {', '.join(missing)} (it has "
            f"{', '.join(available[:20])}{', ...' if len(available) > 20 else ''})"
        )
    if parsed.select is not None:
        chosen = list(parsed.select)
    else:
        chosen = [n for n in available if n not in parsed.exclude]
    if not chosen:
        raise PermanentError("columns: every column of the source is excluded")
    out = [Projected(n, parsed.rename.get(n, n), n in parsed.hash) for n in chosen]
    sinks = [p.sink for p in out]
    twice = sorted({s for s in sinks if sinks.count(s) > 1})
    if twice:
        raise PermanentError(f"columns.rename: the sink would get {', '.join(twice)} twice")
    return out


def sink_columns(projected: list[Projected], source: list[Column]) -> list[Column]:
    """The delivered columns as the sink sees them: renamed, exact source types, a hashed
    column `text`."""
    by_name = {c.name: c for c in source}
    return [Column(p.sink, HASH_TYPE if p.hashed else by_name[p.source].type) for p in projected]


def keyed_hash(key: bytes, text: str) -> str:
    """HMAC-SHA256 of a value's text form (UTF-8), as 64 hexadecimal digits."""
    return hmac.new(key, text.encode("utf-8"), hashlib.sha256).hexdigest()
