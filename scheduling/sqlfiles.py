"""Named statements of the scheduling app (`scheduling/sql/queries.sql`).

Same format as dispatch's: each statement under a `-- name: NAME` header, `%(param)s`
placeholders, fetched with `query(NAME)`.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

SQL_DIR = Path(__file__).resolve().parent / "sql"
_NAME = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


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
        raise KeyError(f"no statement named {name!r} in scheduling/sql/queries.sql") from None


def query_names() -> list[str]:
    return sorted(_queries())
