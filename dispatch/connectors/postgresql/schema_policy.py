"""What a PostgreSQL sink does when the source's columns differ from its table's
(docs/connectors.md, "Schema changes").

Three policies of the job's sink spec, checked on save:

- `on_new_column` (`fail` default, `add`, `ignore`): a source column the sink table lacks.
- `on_missing_column` (`null` default, `fail`): a sink column the source does not send.
- `on_type_change` (`fail` default, `widen`): a source column of the sink column's type
  family but wider (`character varying(10)` -> `(20)`, `integer` -> `bigint`).

The writer applies what they say inside its data transaction (DDL and rows commit
together or not at all) and reports each change as a `Change`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ValidationError

POLICIES: dict[str, tuple[str, ...]] = {
    "on_new_column": ("fail", "add", "ignore"),
    "on_missing_column": ("null", "fail"),
    "on_type_change": ("fail", "widen"),
}
# What a sliced source refuses (its slices each commit a data transaction of their own,
# and stage a `replace` in a table made from the sink's columns): any policy but fail.
SLICED_REFUSED = {"on_new_column": ("add", "ignore"), "on_type_change": ("widen",)}


@dataclass(frozen=True)
class Change:
    """One difference between the source's columns and the sink table, and what was done:
    `added` (ALTER TABLE ADD COLUMN), `widened` (ALTER COLUMN TYPE), `ignored` (a new
    source column left out of the load), `missing` (a column the binding's previous
    delivery wrote, absent from the source: it takes its default)."""

    column: str
    change: str
    type: str | None = None
    previous: str | None = None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"column": self.column, "change": self.change}
        if self.type is not None:
            out["type"] = self.type
        if self.previous is not None:
            out["from"] = self.previous
        return out


# Changes an operator is alerted of: the ones that changed the table or its rows' shape.
ALERTED = ("added", "widened", "missing")


def describe_changes(changes: list[dict[str, Any]]) -> str:
    """Schema changes as one line: `code widened character varying(10) -> character
    varying(20); extra added numeric(8,2)`."""
    parts = []
    for c in changes:
        if c.get("from"):
            parts.append(f"{c['column']} {c['change']} {c['from']} -> {c.get('type')}")
        else:
            parts.append(" ".join(str(p) for p in (c["column"], c["change"], c.get("type")) if p))
    return "; ".join(parts)


def validate(spec: dict[str, Any]) -> None:
    for name, choices in POLICIES.items():
        value = spec.get(name, choices[0])
        if value not in choices:
            raise ValidationError(f"{name}: must be one of {', '.join(choices)}")


def policy(spec: dict[str, Any], name: str) -> str:
    return str(spec.get(name, POLICIES[name][0]))


def sliced_refusals(spec: dict[str, Any]) -> list[str]:
    """The policies of `spec` a sliced source cannot have."""
    return [f"{k}: {spec[k]}" for k, refused in SLICED_REFUSED.items() if spec.get(k) in refused]


# -- type families --------------------------------------------------------------------------
# Types as format_type() prints them. Within a family a type holds another when every
# value of the other is one of its values.
_INTEGERS = {"smallint": 1, "integer": 2, "bigint": 3}
_FLOATS = {"real": 1, "double precision": 2}
_VARCHAR = re.compile(r"^character varying(?:\((\d+)\))?$")
_NUMERIC = re.compile(r"^numeric(?:\((\d+)(?:,(\d+))?\))?$")


def _rank(type_text: str) -> tuple[str, tuple[int, int] | None] | None:
    """(family, size) of a type of a known family; size None: unbounded."""
    t = type_text.strip()
    if t in _INTEGERS:
        return "int", (_INTEGERS[t], 0)
    if t in _FLOATS:
        return "float", (_FLOATS[t], 0)
    if t == "text":
        return "string", None
    m = _VARCHAR.match(t)
    if m:
        return "string", None if m.group(1) is None else (int(m.group(1)), 0)
    m = _NUMERIC.match(t)
    if m:
        if m.group(1) is None:
            return "numeric", None
        precision, scale = int(m.group(1)), int(m.group(2) or 0)
        # (digits before the point, digits after it)
        return "numeric", (precision - scale, scale)
    return None


def _holds(outer: tuple[int, int] | None, inner: tuple[int, int] | None) -> bool:
    if outer is None:
        return True
    if inner is None:
        return False
    return outer[0] >= inner[0] and outer[1] >= inner[1]


def is_wider(sink_type: str, source_type: str) -> bool:
    """Whether the source's type is of the sink column's family and holds values the sink
    type cannot (the change `on_type_change: widen` applies). Types of different families
    (`text` into `integer`, `integer` into `numeric`) are not a widening: the sink's
    server parses each value, as it always does with text COPY."""
    if sink_type == source_type:
        return False
    sink, source = _rank(sink_type), _rank(source_type)
    if sink is None or source is None or sink[0] != source[0]:
        return False
    return not _holds(sink[1], source[1])
