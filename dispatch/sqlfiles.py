"""Load the SQL that carries dispatch's concurrency.

`dispatch/sql/functions/*.sql` are versioned PL/pgSQL functions installed by
migrations (`install`); `dispatch/sql/queries.sql` holds named statements, each under a
`-- name: NAME` header, fetched with `query(NAME)`.
"""

from __future__ import annotations

import re
from functools import cache
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


@cache
def _queries() -> dict[str, str]:
    text = (SQL_DIR / "queries.sql").read_text()
    parts = _NAME.split(text)
    return {
        name: body.strip().rstrip(";") for name, body in zip(parts[1::2], parts[2::2], strict=True)
    }


def query(name: str) -> str:
    try:
        return _queries()[name]
    except KeyError:
        raise KeyError(f"no statement named {name!r} in dispatch/sql/queries.sql") from None


def query_names() -> list[str]:
    return sorted(_queries())
