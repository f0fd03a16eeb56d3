"""dispatch's SQL files: the frozen snapshots stay as they were installed, every statement
the code names exists, and what the current functions promise beyond the old ones."""

from __future__ import annotations

import ast
import hashlib
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from django.db import IntegrityError, connection, transaction

from dispatch.core import sqlfiles
from scheduling import sqlfiles as scheduling_sqlfiles
from tests.support.factories import BindingFactory

ROOT = Path(__file__).resolve().parent.parent

# Every file of dispatch/sql/migrations/ as a migration installed it. A snapshot is
# never edited (a database that ran its migration keeps what it installed, and a fresh
# `migrate` must install the same); a change is a new snapshot with a new migration,
# whose checksum is added here (docs/sql.md).
SNAPSHOT_SHA256 = {
    "0002_dispatch_v1.sql": "54589787d9a5f45db0e3fd72696a74a99f11d13a215962e7cfc8e9b1b272b4b8",
    "0010_dispatch_v2.sql": "8f14807eb8e5589cd740f6df4fc5c0e77c9d6dc6e990f8d531c2e958f1a0c35a",
    "0013_dispatch_v3.sql": "881cda2245236782707d0165988f200b5b9b96ad83720a2f2e23e098b9b6104c",
    "0014_dispatch_v4.sql": "4f6391bd88baa2b352055c0a1fc6c00b85d734793225ff205702be710ccd6098",
    "0016_dispatch_v5.sql": "c365a4c05a3c59c0b46d7af53f3d81f7b966bf8b92803e23bfda837cbf1d3715",
    "0017_dispatch_v6.sql": "ac5947519df4ade946faffd4f601b96f4113374834b7c70331b7ae8742a499fd",
    "0020_functions.sql": "418fc1f1d75aec0e21947e00ecefbc69f82b9d5d9ffb7651a6aa40ffd8350b5b",
    "0022_functions.sql": "7ed6e6d7b5ec0066118785ede8a28dadafb550c7bc9acf9aa454b6764634afc9",
    "0026_functions.sql": "e39461e6518a4a318b9ad4f1da3b60630ef5ec524af35c8f440b0e94a76d3ad3",
    "0031_functions.sql": "4a9a7778de1ea5e39330f4de8922e4d2bba549da81abaf0ad91868a350273d4c",
    "0033_functions.sql": "ef4ebca783da3f6c18f23c196fcc347071c76a655cfb9db9c55a72abee689815",
}


def test_snapshots__none_is_edited_and_none_is_unlisted():
    found = {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sqlfiles.MIGRATIONS_DIR.glob("*.sql")
    }
    edited = sorted(
        n for n in found.keys() & SNAPSHOT_SHA256.keys() if found[n] != SNAPSHOT_SHA256[n]
    )
    assert edited == [], "frozen snapshots were edited (add a new snapshot instead)"
    assert sorted(found.keys() - SNAPSHOT_SHA256.keys()) == [], "snapshots without a checksum"
    assert sorted(SNAPSHOT_SHA256.keys() - found.keys()) == [], "snapshots missing"


# --- every named statement the code uses exists -----------------------------------------
# The three lookups, by the dotted name a call resolves to, and the statements of each.
LOOKUPS: dict[str, tuple[str, Callable[[], list[str]]]] = {
    "dispatch.core.sqlfiles.query": ("dispatch/sql/queries.sql", sqlfiles.query_names),
    "dispatch.core.sqlfiles.ops_query": ("dispatch/sql/ops.sql", sqlfiles.ops_query_names),
    "scheduling.sqlfiles.query": ("scheduling/sql/queries.sql", scheduling_sqlfiles.query_names),
}
# The modules that define the lookups (their own calls forward a caller's name).
DEFINERS = {"dispatch/core/sqlfiles.py", "scheduling/sqlfiles.py"}
LOOKUP_NAMES = {"query", "ops_query"}
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


class Unresolved(Exception):
    """A statement name the check cannot follow back to string literals."""


class Module:
    """One source file: its imports, and the string literals a name can hold."""

    def __init__(self, source: str, path: str) -> None:
        self.path = path
        self.tree = ast.parse(source, path)
        self.parents: dict[ast.AST, ast.AST] = {
            child: node for node in ast.walk(self.tree) for child in ast.iter_child_nodes(node)
        }
        package = path.removesuffix(".py").replace("/", ".").rsplit(".", 1)[0]
        self.aliases: dict[str, str] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.aliases[a.asname or a.name.split(".")[0]] = (
                        a.name if a.asname else a.name.split(".")[0]
                    )
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + [base]).strip(".")
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{base}.{a.name}"

    def dotted(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            value = self.dotted(node.value)
            return None if value is None else f"{value}.{node.attr}"
        return None

    def lookups(self) -> Iterator[tuple[int, str | None, ast.Call]]:
        """(line, the lookup it resolves to or None, the call) of every call named like a
        statement lookup, in source order."""
        calls = [node for node in ast.walk(self.tree) if isinstance(node, ast.Call)]
        for node in sorted(calls, key=lambda c: (c.lineno, c.col_offset)):
            name = self.dotted(node.func)
            last = name.rsplit(".", 1)[-1] if name else None
            if name in LOOKUPS:
                yield node.lineno, name, node
            elif last in LOOKUP_NAMES:
                yield node.lineno, None, node

    def scope(self, node: ast.AST) -> ast.AST:
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, SCOPES):
                return node
        return self.tree

    def own_nodes(self, scope: ast.AST) -> Iterator[ast.AST]:
        """The nodes of one scope, not of the functions and classes inside it."""
        stack = list(ast.iter_child_nodes(scope))
        while stack:
            node = stack.pop()
            yield node
            if not isinstance(node, (*SCOPES, ast.ClassDef)):
                stack.extend(ast.iter_child_nodes(node))

    def values(self, node: ast.expr, depth: int = 0) -> set[str]:
        """Every string a statement-name expression can evaluate to: literals, both arms
        of a conditional, the values assigned to or looped over by a name in its scope
        (or the module's), and, for a parameter, the arguments of every call of its
        function in this module."""
        if depth > 20:
            raise Unresolved(ast.unparse(node))
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.IfExp):
            return self.values(node.body, depth + 1) | self.values(node.orelse, depth + 1)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return set().union(*(self.values(e, depth + 1) for e in node.elts))
        if not isinstance(node, ast.Name):
            raise Unresolved(ast.unparse(node))
        scope = self.scope(node)
        found = self._bound(node.id, scope, depth)
        if found is None and isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found = self._passed(node.id, scope, depth)
        if found is None and scope is not self.tree:
            found = self._bound(node.id, self.tree, depth)
        if found is None:
            raise Unresolved(node.id)
        return found

    def _bound(self, name: str, scope: ast.AST, depth: int) -> set[str] | None:
        found: set[str] | None = None
        for node in self.own_nodes(scope):
            value: ast.expr | None = None
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets
            ):
                value = node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                value = node.value if node.target.id == name else None
            elif isinstance(node, ast.For) and isinstance(node.target, ast.Name):
                value = node.iter if node.target.id == name else None
            if value is not None:
                found = (found or set()) | self.values(value, depth + 1)
        return found

    def _passed(
        self, name: str, function: ast.FunctionDef | ast.AsyncFunctionDef, depth: int
    ) -> set[str] | None:
        params = [a.arg for a in function.args.posonlyargs + function.args.args]
        if name not in params:
            return None
        index = params.index(name)
        found: set[str] = set()
        calls = 0
        for node in ast.walk(self.tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name) and func.id == function.name:
                position = index
            elif isinstance(func, ast.Attribute) and func.attr == function.name:
                position = index - 1 if params[:1] in (["self"], ["cls"]) else index
            else:
                continue
            argument = next((k.value for k in node.keywords if k.arg == name), None)
            if argument is None and position < len(node.args):
                argument = node.args[position]
            if argument is None:
                raise Unresolved(f"{function.name}(...) at line {node.lineno}")
            found |= self.values(argument, depth + 1)
            calls += 1
        return found if calls else None


def statement_problems(
    modules: list[Module], unused: dict[str, set[str]] | None = None
) -> tuple[Counter[str], list[str]]:
    """(how many calls of each lookup were checked, what is wrong with them)."""
    checked: Counter[str] = Counter()
    problems: list[str] = []
    names = {lookup: set(names()) for lookup, (_, names) in LOOKUPS.items()}
    if unused is not None:  # filled with what no lookup asks for
        unused.update({lookup: set(n) for lookup, n in names.items()})
    for module in modules:
        for line, lookup, call in module.lookups():
            where = f"{module.path}:{line}"
            if lookup is None:
                problems.append(f"{where}: {ast.unparse(call.func)} is not a known lookup")
                continue
            if not call.args:
                problems.append(f"{where}: no statement name")
                continue
            try:
                used = module.values(call.args[0])
            except Unresolved as exc:
                problems.append(f"{where}: cannot follow the statement name back ({exc})")
                continue
            checked[lookup] += 1
            if unused is not None:
                unused[lookup] -= used
            sql_file = LOOKUPS[lookup][0]
            problems += [
                f"{where}: no statement {name!r} in {sql_file}"
                for name in sorted(used - names[lookup])
            ]
    return checked, problems


def source_modules() -> list[Module]:
    paths = sorted(
        p
        for top in ("dispatch", "scheduling", "tools")
        for p in (ROOT / top).rglob("*.py")
        if p.relative_to(ROOT).as_posix() not in DEFINERS
    )
    return [Module(p.read_text(), p.relative_to(ROOT).as_posix()) for p in paths]


def test_statements__every_name_the_code_looks_up_is_a_statement_of_its_file():
    checked, problems = statement_problems(source_modules())
    assert set(checked) == set(LOOKUPS), "the check found no call of some lookup"
    assert problems == [], "\n".join(problems)


def test_statements__every_statement_of_a_file_is_looked_up_by_the_code():
    """No dead statements: each one in a `.sql` file is asked for by dispatch, scheduling
    or the tools."""
    unused: dict[str, set[str]] = {}
    statement_problems(source_modules(), unused)
    dead = {LOOKUPS[lookup][0]: sorted(n) for lookup, n in unused.items() if n}
    assert dead == {}, dead


def test_statements__the_check_follows_helpers_and_conditionals_and_flags_what_is_missing():
    source = """
from dispatch.core import sqlfiles as dispatch_sqlfiles
from dispatch.core.sqlfiles import ops_query, query
from scheduling import sqlfiles

def run(name):
    return query(name)

def guarded(name):
    return run(name)

class Loop:
    def rows(self, statement):
        return ops_query(statement)

    def all(self):
        for name in ("prune_workers", "no_such_ops_statement"):
            self.rows(name)

def wake(inside):
    statement = "notify_nowhere" if inside else "notify"
    dispatch_sqlfiles.query(statement)
    sqlfiles.query("due_schedule")
    sqlfiles.query("claim")

guarded("claim")
run("settle")
mystery.query("claim")
query(compute())
"""
    checked, problems = statement_problems([Module(source, "example.py")])
    assert checked == {
        "dispatch.core.sqlfiles.query": 2,
        "dispatch.core.sqlfiles.ops_query": 1,
        "scheduling.sqlfiles.query": 2,
    }
    assert problems == [
        "example.py:14: no statement 'no_such_ops_statement' in dispatch/sql/ops.sql",
        "example.py:22: no statement 'notify_nowhere' in dispatch/sql/queries.sql",
        "example.py:24: no statement 'claim' in scheduling/sql/queries.sql",
        "example.py:28: mystery.query is not a known lookup",
        "example.py:29: cannot follow the statement name back (compute())",
    ]


# --- the attempt insert trigger -----------------------------------------------------------
# A bulk import's shape: runs and their attempts in one statement, the runs in a
# data-modifying WITH. PostgreSQL runs a WITH part whose rows nothing reads after the main
# statement, so here the attempt is inserted before its run exists.
ATTEMPT_BEFORE_ITS_RUN = """
WITH run AS (
    INSERT INTO dispatch_run (id, binding_id, trigger, status, created_at, requested_by)
    VALUES (%(run)s, %(binding)s, 'API', 'PENDING', clock_timestamp(), 'import')
)
INSERT INTO dispatch_attempt (id, run_id, number, origin, status, created_at, available_at,
                              error, rows_read, rows_written)
VALUES (gen_random_uuid(), %(run)s, 1, 'TRIGGER', 'PENDING', clock_timestamp(),
        clock_timestamp(), '', 0, 0)
"""
# The same rows, the attempts reading the runs' RETURNING: each run is inserted first.
ATTEMPT_AFTER_ITS_RUN = """
WITH run AS (
    INSERT INTO dispatch_run (id, binding_id, trigger, status, created_at, requested_by)
    VALUES (%(run)s, %(binding)s, 'API', 'PENDING', clock_timestamp(), 'import')
    RETURNING id
)
INSERT INTO dispatch_attempt (id, run_id, number, origin, status, created_at, available_at,
                              error, rows_read, rows_written)
SELECT gen_random_uuid(), run.id, 1, 'TRIGGER', 'PENDING', clock_timestamp(),
       clock_timestamp(), '', 0, 0
  FROM run
"""


@pytest.mark.django_db
def test_attempt_insert__an_attempt_inserted_before_its_run_in_one_statement_raises():
    binding = BindingFactory()
    run_id = uuid.uuid4()
    with (
        pytest.raises(IntegrityError) as raised,
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        cursor.execute(ATTEMPT_BEFORE_ITS_RUN, {"run": run_id, "binding": binding.pk})
    # foreign_key_violation, naming the run (docs/sql.md).
    assert getattr(raised.value.__cause__, "sqlstate", None) == "23503"
    assert str(run_id) in str(raised.value)
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM dispatch_run WHERE id = %s", [run_id])
        assert cursor.fetchone() == (0,)  # nothing of the statement stays


@pytest.mark.django_db
def test_attempt_insert__an_attempt_inserted_after_its_run_gets_the_run_s_binding():
    binding = BindingFactory()
    run_id = uuid.uuid4()
    with connection.cursor() as cursor:
        cursor.execute(ATTEMPT_AFTER_ITS_RUN, {"run": run_id, "binding": binding.pk})
        cursor.execute(
            "SELECT binding_id, blocked_reason FROM dispatch_attempt WHERE run_id = %s", [run_id]
        )
        assert cursor.fetchone() == (binding.pk, None)
