"""The incremental bindings' proof (docs/reliability.md, "Incremental bindings").

For every binding in scope that reads a PostgreSQL table incrementally into a PostgreSQL
sink, this reads the sink's committed cursor (`dispatch_cursor`), the committed attempts'
recorded cursors (`cursor_from`, `cursor_to`), the sink table's rows and the source's row
versions, and checks:

- **the cursor chain**: the committed attempts' ranges `(cursor_from, cursor_to]` follow
  one another from the spec's start to the sink's committed cursor, no range taken twice
  and none skipped (when every committed attempt recorded its cursors);
- **append**: no row version is in the sink twice, none that the source never had, none
  above the committed cursor, and every version a committed attempt's snapshot held in its
  range is there;
- **upsert**: the sink equals the source as it was at the committed cursor, row for row.

"The source as it was" needs every version the source ever held: a *history* relation in
the source database (same column names as the source table, one row per version, e.g.
written by a trigger in the writer's own transaction), given per source table. It also
assumes the versions became visible in cursor order (one writer, one version per
transaction), as a timestamp cursor needs anyway (docs/connectors.md, the commit-order
trap). Without a history only the current rows can be compared: the rows at or below the
committed cursor must be in the sink once (append) or equal (upsert).

Everything is compared in the source database, as PostgreSQL's own text of each row
(`ROW(...)::text`): the sink's rows are copied into a temporary table of the source's
column types first, so both sides are printed by one session with one set of settings.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import connection
from psycopg import sql

from dispatch.connectors import incremental, postgresql
from dispatch.verify import sinks as sink_access
from dispatch.verify.state import BindingRow, State

# Findings listed per binding at most (the rest are counted).
SAMPLES = 3


@dataclass
class IncrementalSink:
    binding_id: uuid.UUID
    source: str
    sink: str
    mode: str
    history: str | None = None
    committed: list[str] | None = None
    committed_attempts: int = 0
    # The recorded cursor_to of each committed attempt: the snapshots to check rows at.
    points: list[list[str]] = field(default_factory=list)
    recorded: int = 0
    versions: int = 0
    snapshots: int = 0  # distinct committed cursors the rows were checked at
    sink_rows: int = 0
    findings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def subject(self) -> str:
        return f"{self.source} -> {self.sink} ({self.mode})"


def incremental_bindings(state: State) -> list[BindingRow]:
    return sorted(
        (
            b
            for b in state.bindings.values()
            if b.source_kind == "postgresql"
            and b.sink_kind == "postgresql"
            and isinstance(b.source_spec.get("incremental"), dict)
            and isinstance(b.source_spec.get("table"), str)
            and isinstance(b.sink_spec.get("table"), str)
            and b.source_id is not None
        ),
        key=lambda b: str(b.id),
    )


def _attempt_cursors(attempt_ids: list[uuid.UUID]) -> dict[uuid.UUID, tuple[Any, Any]]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT id, cursor_from, cursor_to FROM dispatch_attempt"
            " WHERE id = ANY(%(ids)s::uuid[])",
            {"ids": attempt_ids},
        )
        return {
            row[0]: tuple(json.loads(v) if isinstance(v, str) else v for v in row[1:])
            for row in cursor.fetchall()
        }


def load(state: State, history: Mapping[str, str] | None = None) -> list[IncrementalSink]:
    """Check every incremental binding in scope (see the module's doc); a sink or source
    that cannot be read becomes `IncrementalSink.error` (a violation)."""
    found = []
    for b in incremental_bindings(state):
        inc = incremental.parse(b.source_spec)
        assert inc is not None
        item = IncrementalSink(
            b.id,
            b.source_spec["table"],
            b.sink_spec["table"],
            str(b.sink_spec.get("mode", "append")),
            (history or {}).get(b.source_spec["table"]),
        )
        found.append(item)
        try:
            _check_one(state, b, inc, item)
        except sink_access.SINK_ERRORS as exc:  # an unreadable side is reported
            item.error = sink_access.error_text(exc)
    return found


def _check_one(state: State, b: BindingRow, inc: Any, item: IncrementalSink) -> None:
    run_ids = [r.id for r in state.runs.values() if r.binding_id == b.id]
    sink_schema, sink_name = postgresql.parse_table(b.sink_spec["table"])
    with sink_access.connect(b.sink_id) as sink:
        schema = sink_schema or sink.execute("SELECT current_schema()").fetchone()[0]
        target = sql.Identifier(schema, sink_name)
        fence_ok, cursor_ok, table_ok = sink.execute(
            "SELECT to_regclass(%s) IS NOT NULL, to_regclass(%s) IS NOT NULL,"
            " to_regclass(%s) IS NOT NULL",
            [
                sql.Identifier(schema, "dispatch_fence").as_string(sink),
                sql.Identifier(schema, "dispatch_cursor").as_string(sink),
                target.as_string(sink),
            ],
        ).fetchone()
        committed_attempts: list[uuid.UUID] = []
        if fence_ok:
            committed_attempts = [
                r[0]
                for r in sink.execute(
                    sql.SQL(
                        "SELECT attempt_id FROM {} WHERE run_id = ANY(%s::uuid[])"
                        " AND committed_at IS NOT NULL AND attempt_id IS NOT NULL"
                    ).format(sql.Identifier(schema, "dispatch_fence")),
                    [run_ids],
                )
            ]
        if cursor_ok:
            row = sink.execute(
                sql.SQL("SELECT columns, cursor FROM {} WHERE binding_id = %s").format(
                    sql.Identifier(schema, "dispatch_cursor")
                ),
                [b.id],
            ).fetchone()
            if row is not None and row[1] is not None:
                if tuple(row[0] or ()) != inc.cursor:
                    item.findings.append(
                        f"the sink's cursor is over {row[0]}, the spec's over {list(inc.cursor)}"
                    )
                    return
                item.committed = list(row[1])
        item.committed_attempts = len(committed_attempts)
        if not committed_attempts and item.committed is None:
            return  # nothing committed: nothing to compare
        if item.committed is None:
            item.findings.append(
                f"{len(committed_attempts)} committed attempt(s) but no committed cursor"
            )
            return
        if not table_ok:
            item.findings.append("a cursor is committed but the sink table does not exist")
            return
        _check_chain(inc, item, _attempt_cursors(committed_attempts))
        src_schema, src_name = postgresql.parse_table(b.source_spec["table"])
        with sink_access.connect(b.source_id) as source:  # type: ignore[arg-type]
            src_schema = src_schema or source.execute("SELECT current_schema()").fetchone()[0]
            _compare(source, sink, target, sql.Identifier(src_schema, src_name), inc, b, item)


def _check_chain(
    inc: Any, item: IncrementalSink, cursors: dict[uuid.UUID, tuple[Any, Any]]
) -> None:
    """The committed ranges follow one another: from the start, each committed attempt
    starts where another ended, no two start at the same place (unless one read nothing),
    and the last one ends at the sink's committed cursor."""
    recorded = [(f, t) for f, t in cursors.values() if t is not None]
    item.recorded = len(recorded)
    item.points = [t for _, t in recorded]
    if item.recorded < item.committed_attempts:
        item.notes.append(
            f"{item.subject}: {item.committed_attempts - item.recorded} of "
            f"{item.committed_attempts} committed attempt(s) did not record their cursors "
            "(a lost write, logged by the worker): the chain is not checked, and their "
            "snapshots are not among the points the rows are checked at"
        )
        return
    start = list(inc.start) if inc.start else None
    moved = [(f, t) for f, t in recorded if f != t]
    starts = [f for f, _ in moved]
    ends = [t for _, t in moved]
    twice = [f for f in starts if starts.count(f) > 1]
    if twice:
        item.findings.append(
            f"{starts.count(twice[0])} committed attempts read from the same cursor {twice[0]}"
        )
    orphans = [f for f in starts if f != start and f not in ends]
    if orphans:
        item.findings.append(
            f"a committed attempt read from {orphans[0]}, which no committed attempt ended at"
        )
    if moved and item.committed not in ends:
        item.findings.append(
            f"the sink's cursor {item.committed} is no committed attempt's cursor_to"
        )


def _compare(
    source: Any,
    sink: Any,
    target: Any,
    relation: Any,
    inc: Any,
    b: BindingRow,
    item: IncrementalSink,
) -> None:
    names = [
        d.name
        for d in source.execute(sql.SQL("SELECT * FROM {} LIMIT 0").format(relation)).description
    ]
    cols = sql.SQL(", ").join(sql.Identifier(n) for n in names)
    cur = sql.SQL(", ").join(sql.Identifier(n) for n in inc.cursor)
    key_names = _identity(source, relation, b)
    # The sink's rows, and the cursors to check at, in tables of the source's own types.
    source.execute(
        sql.SQL("CREATE TEMP TABLE dispatch_check_sink AS SELECT {} FROM {} LIMIT 0").format(
            cols, relation
        )
    )
    source.execute(
        sql.SQL("CREATE TEMP TABLE dispatch_check_point AS SELECT {} FROM {} LIMIT 0").format(
            cur, relation
        )
    )
    with (
        source.cursor().copy(
            sql.SQL("COPY pg_temp.dispatch_check_sink ({}) FROM STDIN").format(cols)
        ) as into,
        sink.cursor().copy(
            sql.SQL("COPY (SELECT {} FROM {}) TO STDOUT").format(cols, target)
        ) as out,
    ):
        for block in out:
            into.write(block)
    places = sql.SQL(", ").join(sql.Placeholder() for _ in inc.cursor)
    insert = sql.SQL("INSERT INTO pg_temp.dispatch_check_point ({}) VALUES ({})").format(
        cur, places
    )
    source.execute(insert, item.committed)
    points = [item.committed]
    # Every committed attempt's snapshot is a point to check the append sink at.
    if item.mode == "append":
        for to in item.points:
            if to not in points:
                source.execute(insert, to)
                points.append(to)
    item.snapshots = len(points)
    versions = relation
    if item.history:
        h_schema, h_name = postgresql.parse_table(item.history)
        versions = sql.Identifier(h_schema, h_name) if h_schema else sql.Identifier(h_name)
    key = sql.SQL(", ").join(sql.Identifier(k) for k in key_names) if key_names else None
    row_text = sql.SQL("ROW({})::text").format(
        sql.SQL(", ").join(sql.SQL("v.{}").format(sql.Identifier(n)) for n in names)
    )
    v_cur = sql.SQL("ROW({})").format(
        sql.SQL(", ").join(sql.SQL("v.{}").format(sql.Identifier(n)) for n in inc.cursor)
    )
    p_cur = sql.SQL("ROW({})").format(
        sql.SQL(", ").join(sql.SQL("p.{}").format(sql.Identifier(n)) for n in inc.cursor)
    )
    # Each version's successor (the next version of the same row), by cursor order.
    window = (
        sql.SQL(" OVER (PARTITION BY {} ORDER BY {})").format(key, cur) if key is not None else None
    )
    nxt = sql.SQL(", ").join(
        [
            (
                sql.SQL("lead({}){}").format(sql.Identifier(n), window)
                if window is not None
                else sql.SQL("NULL")
            )
            + sql.SQL(" AS {}").format(sql.Identifier(f"dispatch_next_{i}"))
            for i, n in enumerate(inc.cursor)
        ]
        + [
            (sql.SQL("lead(true){}").format(window) if window is not None else sql.SQL("NULL"))
            + sql.SQL(" AS dispatch_has_next")
        ]
    )
    source.execute(
        sql.SQL(
            "CREATE TEMP TABLE dispatch_check_version AS"
            " SELECT {cols}, {nxt} FROM {versions} WHERE {not_null}"
        ).format(
            cols=cols,
            nxt=nxt,
            versions=versions,
            not_null=sql.SQL(" AND ").join(
                sql.SQL("{} IS NOT NULL").format(sql.Identifier(n)) for n in inc.cursor
            ),
        )
    )
    item.versions = source.execute(
        "SELECT count(*) FROM pg_temp.dispatch_check_version"
    ).fetchone()[0]
    item.sink_rows = source.execute("SELECT count(*) FROM pg_temp.dispatch_check_sink").fetchone()[
        0
    ]
    v_next = sql.SQL("ROW({})").format(
        sql.SQL(", ").join(
            sql.SQL("v.{}").format(sql.Identifier(f"dispatch_next_{i}"))
            for i in range(len(inc.cursor))
        )
    )
    alive = sql.SQL("{v} <= {p} AND (v.dispatch_has_next IS NULL OR {n} > {p})").format(
        v=v_cur, n=v_next, p=p_cur
    )
    at_committed = sql.SQL(
        "SELECT {text} FROM pg_temp.dispatch_check_version v, pg_temp.dispatch_check_point p"
        " WHERE {alive} AND ROW({pc}) = ROW({committed})"
    ).format(
        text=row_text,
        alive=alive,
        pc=sql.SQL(", ").join(sql.SQL("p.{}").format(sql.Identifier(n)) for n in inc.cursor),
        committed=places,
    )
    sink_text = sql.SQL("SELECT {} FROM pg_temp.dispatch_check_sink v").format(row_text)

    def texts(query: Any, params: Any = None) -> list[str]:
        return [r[0] for r in source.execute(query, params).fetchall()]

    def sample(values: list[str]) -> str:
        return "; ".join(v[:120] for v in values[:SAMPLES])

    sink_rows = texts(sink_text)
    if item.mode == "upsert":
        expected = texts(at_committed, item.committed)
        if not item.history:
            above = source.execute(
                sql.SQL("SELECT count(*) FROM {} v WHERE {} > ROW({})").format(
                    relation, v_cur, places
                ),
                item.committed,
            ).fetchone()[0]
            if above:
                item.notes.append(
                    f"{item.subject}: {above} source row(s) are above the committed cursor "
                    "and no history was given: only the rows at or below it are compared"
                )
                have = set(sink_rows)
                missing = [t for t in expected if t not in have]
                if missing:
                    item.findings.append(
                        f"{len(missing)} source row(s) at or below the committed cursor are "
                        f"not in the sink as the source holds them (e.g. {sample(missing)})"
                    )
                return
        _compare_multisets(item, expected, sink_rows, "the source at the committed cursor")
        return
    # append
    counts: dict[str, int] = {}
    for t in sink_rows:
        counts[t] = counts.get(t, 0) + 1
    twice = [t for t, n in counts.items() if n > 1]
    if twice:
        item.findings.append(
            f"{len(twice)} row version(s) are in the sink more than once (e.g. {sample(twice)})"
        )
    known = set(texts(sql.SQL("SELECT {} FROM pg_temp.dispatch_check_version v").format(row_text)))
    below = set(
        texts(
            sql.SQL("SELECT {} FROM pg_temp.dispatch_check_version v WHERE {} <= ROW({})").format(
                row_text, v_cur, places
            ),
            item.committed,
        )
    )
    if item.history:
        invented = [t for t in counts if t not in known]
        if invented:
            item.findings.append(
                f"{len(invented)} sink row(s) are no version the source ever held "
                f"(e.g. {sample(invented)})"
            )
        above = [t for t in counts if t in known and t not in below]
        if above:
            item.findings.append(
                f"{len(above)} sink row(s) are above the committed cursor (e.g. {sample(above)})"
            )
    seen = set(
        texts(
            sql.SQL(
                "SELECT DISTINCT {text} FROM pg_temp.dispatch_check_version v,"
                " pg_temp.dispatch_check_point p WHERE {alive}"
            ).format(text=row_text, alive=alive)
        )
    )
    lost = sorted(t for t in seen if t not in counts)
    if lost:
        item.findings.append(
            f"{len(lost)} row version(s) a committed snapshot held ({len(points)} checked) are "
            f"not in the sink (e.g. {sample(lost)})"
        )


def _identity(source: Any, relation: Any, b: BindingRow) -> list[str]:
    """The columns that name one row across its versions: an upsert's key, else the
    source table's primary key (none: every version is a row of its own)."""
    key = b.sink_spec.get("key")
    if b.sink_spec.get("mode") == "upsert" and isinstance(key, list) and key:
        return [str(k) for k in key]
    return [
        r[0]
        for r in source.execute(
            "SELECT a.attname FROM pg_catalog.pg_index i"
            " JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid"
            "  AND a.attnum = ANY(i.indkey)"
            " WHERE i.indrelid = %s::regclass AND i.indisprimary"
            " ORDER BY array_position(i.indkey::int2[], a.attnum)",
            [relation.as_string(source)],
        ).fetchall()
    ]


def _compare_multisets(
    item: IncrementalSink, expected: list[str], actual: list[str], what: str
) -> None:
    want, have = Counter(expected), Counter(actual)
    if want == have:
        return
    missing, extra = want - have, have - want
    example = next(iter(extra or missing))
    item.findings.append(
        f"the sink differs from {what}: {sum(missing.values())} row(s) missing, "
        f"{sum(extra.values())} row(s) too many (e.g. {example[:120]!r})"
    )
