"""Load the SQL that carries dispatch's concurrency.

`dispatch/sql/functions/*.sql` are versioned PL/pgSQL functions installed by
migrations (`install`); `dispatch/sql/queries.sql` holds named statements, each under a
`-- name: NAME` header, fetched with `query(NAME)`.
"""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path
from typing import Any

SQL_DIR = Path(__file__).resolve().parent / "sql"
_NAME = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


def function_file(name: str) -> str:
    return (SQL_DIR / "functions" / name).read_text()


def install(name: str) -> Any:
    """A `RunSQL` operation that installs one functions file (for migrations)."""
    from django.db import migrations

    return migrations.RunSQL(function_file(name), reverse_sql=migrations.RunSQL.noop)


class NamedQueries:
    """The statements of one `.sql` file, each under a `-- name: NAME` header."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @cached_property
    def _statements(self) -> dict[str, str]:
        parts = _NAME.split(self.path.read_text())
        return {
            name: body.strip().rstrip(";")
            for name, body in zip(parts[1::2], parts[2::2], strict=True)
        }

    def query(self, name: str) -> str:
        try:
            return self._statements[name]
        except KeyError:
            raise KeyError(f"no statement named {name!r} in {self.path.name}") from None

    def names(self) -> list[str]:
        return sorted(self._statements)


_DISPATCH = NamedQueries(SQL_DIR / "queries.sql")


def query(name: str) -> str:
    """A named statement of `dispatch/sql/queries.sql`."""
    return _DISPATCH.query(name)


def query_names() -> list[str]:
    return _DISPATCH.names()


_OPS = NamedQueries(SQL_DIR / "ops.sql")


def ops_query(name: str) -> str:
    """A named statement of `dispatch/sql/ops.sql` (retention, health, alerts, metrics)."""
    return _OPS.query(name)


def ops_query_names() -> list[str]:
    return _OPS.names()
