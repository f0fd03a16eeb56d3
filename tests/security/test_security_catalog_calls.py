"""A source cannot answer the product's catalog checks with functions of its own.

A role owns the schemas on its session's search_path and may define functions there; one
whose signature matches a call more closely than the catalog's (`pg_has_role(name,
regrole, text)` against the catalog's `(name, oid, text)`) wins whatever the path's order.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.test import override_settings

from dispatch.connectors.base import PermanentError
from dispatch.connectors.postgresql import PostgreSQLConnector as PG
from tests.support.connectors import Ctx, ScratchDB, connect, scratch_db, server_config

ROOT = Path(__file__).resolve().parents[2]

# What the least-privilege check calls, each planted with the signature that fits the
# call and an answer that would hide the role's membership of pg_signal_backend. The
# planted to_regrole(text) has the catalog's own signature: it cannot win even today,
# and must not after.
PLANTED = {
    "pg_has_role": [
        "CREATE FUNCTION {s}.pg_has_role(name, regrole, text) RETURNS boolean"
        " LANGUAGE sql AS 'SELECT false'"
    ],
    "to_regrole": [
        "CREATE FUNCTION {s}.to_regrole(text) RETURNS regrole"
        " LANGUAGE sql AS 'SELECT NULL::regrole'"
    ],
    "unnest": [
        "CREATE FUNCTION {s}.unnest(text[]) RETURNS SETOF text"
        " LANGUAGE sql AS 'SELECT NULL::text WHERE false'"
    ],
    "array_remove": [
        "CREATE FUNCTION {s}.array_remove(text[], text) RETURNS text[]"
        " LANGUAGE sql AS 'SELECT ARRAY[]::text[]'"
    ],
    "||": [
        "CREATE FUNCTION {s}.nothing(text[], text[]) RETURNS text[]"
        " LANGUAGE sql AS 'SELECT ARRAY[]::text[]'",
        "CREATE OPERATOR {s}.|| (FUNCTION = {s}.nothing, LEFTARG = text[], RIGHTARG = text[])",
    ],
}


@pytest.fixture
def signaller() -> Iterator[tuple[ScratchDB, str]]:
    """A scratch database and a role in pg_signal_backend that may read table `t`, with a
    schema of its own first on its search_path."""
    for db in scratch_db("catcalls"):
        role = f"sig_{db.name}"[:63]
        with connect(db.name) as conn:
            conn.execute(f'DROP ROLE IF EXISTS "{role}"')
            conn.execute(f'CREATE ROLE "{role}" LOGIN NOSUPERUSER IN ROLE pg_signal_backend')
            conn.execute(f'CREATE SCHEMA "{role}" AUTHORIZATION "{role}"')
            conn.execute(
                f'ALTER ROLE "{role}" IN DATABASE "{db.name}" SET search_path = "{role}", public'
            )
            conn.execute("CREATE TABLE public.t (a int)")
            conn.execute("INSERT INTO public.t VALUES (1)")
            conn.execute(f'GRANT SELECT ON public.t TO "{role}"')
        try:
            yield db, role
        finally:
            with connect(db.name) as conn:
                conn.execute(f'DROP SCHEMA "{role}" CASCADE')
                conn.execute("DROP TABLE public.t")
            with connect("postgres") as conn:
                conn.execute(f'DROP ROLE "{role}"')


def as_role(db: ScratchDB, role: str) -> psycopg.Connection[Any]:
    c = server_config(db.name, user=role)
    return psycopg.connect(
        host=c["host"],
        port=c["port"],
        dbname=db.name,
        user=role,
        password=c.get("password"),
        autocommit=True,
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("name", sorted(PLANTED))
def test_query_source__a_planted_catalog_function_does_not_change_the_verdict(
    signaller: tuple[ScratchDB, str], name: str
) -> None:
    db, role = signaller
    with as_role(db, role) as conn:
        for statement in PLANTED[name]:
            conn.execute(statement.format(s=f'"{role}"'))
        # The role's own schema comes first on its path (pg_catalog is implicit).
        assert conn.execute("SELECT (pg_catalog.current_schemas(false))[1]").fetchone() == (role,)
    spec = {"query": "select a from t"}
    with (
        override_settings(DISPATCH_QUERY_SOURCE_LEAST_PRIVILEGE=True),
        pytest.raises(PermanentError, match="pg_signal_backend"),
        PG.open_reader(server_config(db.name, user=role), spec, Ctx()),
    ):
        pass


# --- the SQL text the connectors send ---------------------------------------------------------
# The SQL PostgreSQL connections are sent. Not the `mysql` connector's: its SQL goes to a
# MySQL server, which has no pg_catalog and resolves a built-in function's name before any
# stored function of that name (one that shadows a built-in is called only schema-qualified).
SCANNED = [
    *sorted(
        p
        for p in (ROOT / "dispatch/connectors").rglob("*.py")
        if (ROOT / "dispatch/connectors/mysql") not in p.parents
    ),
    ROOT / "dispatch/security/targets.py",
]
NAME = re.compile(r'(?<![\w.$"])([A-Za-z_][A-Za-z0-9_$]*)\s*(\()?')


def _catalog_names() -> set[str]:
    """Functions and relations of pg_catalog, less the names of types (`numeric(12,2)`
    is a type with its modifier, not a call)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT proname::text FROM pg_catalog.pg_proc"
            " WHERE pronamespace = 'pg_catalog'::regnamespace"
            " UNION SELECT relname::text FROM pg_catalog.pg_class"
            " WHERE relnamespace = 'pg_catalog'::regnamespace"
            " EXCEPT SELECT typname::text FROM pg_catalog.pg_type WHERE typrelid = 0"
        )
        return {row[0] for row in cursor.fetchall()}


def _strings(path: Path) -> Iterator[tuple[int, str]]:
    """Every string constant of a module but its docstrings (f-strings are messages)."""
    tree = ast.parse(path.read_text())
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node.lineno, node.value


def unqualified(text: str, names: set[str]) -> list[str]:
    found = [
        m.group(0).strip()
        for m in NAME.finditer(text)
        if m.group(1).lower() in names and (m.group(2) or m.group(1).lower().startswith("pg_"))
    ]
    if "||" in text.replace("OPERATOR(pg_catalog.||)", ""):
        found.append("||")
    return found


@pytest.mark.django_db
def test_scan__finds_what_it_looks_for() -> None:
    names = _catalog_names()
    assert unqualified("SELECT set_config('a', %s, true), now()", names) == ["set_config(", "now("]
    assert unqualified("SELECT a || b FROM pg_roles", names) == ["pg_roles", "||"]
    assert unqualified("SELECT pg_catalog.now() FROM pg_catalog.pg_roles", names) == []
    assert unqualified("numeric(12,2)", names) == []


@pytest.mark.django_db
def test_connectors__send_no_unqualified_catalog_call() -> None:
    names = _catalog_names()
    found = [
        f"{path.relative_to(ROOT)}:{line}: {call}"
        for path in SCANNED
        for line, text in _strings(path)
        for call in unqualified(text, names)
    ]
    assert found == []


@pytest.mark.django_db(transaction=True)
def test_query_source__a_call_left_unqualified_still_resolves_in_the_catalog(
    signaller: tuple[ScratchDB, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second layer alone: the check runs under `search_path = pg_catalog, pg_temp`."""
    from dispatch.security import targets

    unqualified_sql = targets.PRIVILEGED_ROLE_SQL.replace("pg_catalog.pg_has_role", "pg_has_role")
    assert unqualified_sql != targets.PRIVILEGED_ROLE_SQL
    monkeypatch.setattr(targets, "PRIVILEGED_ROLE_SQL", unqualified_sql)
    db, role = signaller
    with as_role(db, role) as conn:
        conn.execute(PLANTED["pg_has_role"][0].format(s=f'"{role}"'))
    spec = {"query": "select a from t"}
    with (
        override_settings(DISPATCH_QUERY_SOURCE_LEAST_PRIVILEGE=True),
        pytest.raises(PermanentError, match="pg_signal_backend"),
        PG.open_reader(server_config(db.name, user=role), spec, Ctx()),
    ):
        pass
