"""The `mysql` source: one consistent, read-only snapshot streamed with an unbuffered
(server-side) cursor in bounded batches."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pymysql
from pymysql.constants import FIELD_TYPE, FLAG

from dispatch.connectors import incremental
from dispatch.connectors.base import Batch, Column, PermanentError, TransferContext, note_event
from dispatch.connectors.mysql import types
from dispatch.connectors.mysql.connect import (
    Interrupter,
    _secrets,
    connect,
    errors,
    session,
)
from dispatch.connectors.mysql.spec import ident, parse_table, strip_query, table_sql
from dispatch.security import targets

BATCH_ROWS = 5000
# The privileges a `query` source's user may hold: reading, nothing else.
READ_PRIVILEGES = {"SELECT", "USAGE"}


def check_least_privilege(conn: Any) -> None:
    """A `query` source runs the job author's SQL: refuse a user that may do more than
    SELECT (FILE, SUPER, PROCESS, any write or administration privilege, a grant
    option), globally or on any database, table or column (docs/security.md)."""
    found: set[str] = set()
    with conn.cursor() as cur:
        for table in ("USER_PRIVILEGES", "SCHEMA_PRIVILEGES", "TABLE_PRIVILEGES"):
            cur.execute(
                f"SELECT PRIVILEGE_TYPE, IS_GRANTABLE FROM information_schema.{table}"  # noqa: S608 - fixed names
            )
            for privilege, grantable in cur.fetchall():
                if str(privilege).upper() not in READ_PRIVILEGES:
                    found.add(str(privilege).upper())
                if str(grantable).upper() == "YES":
                    found.add("GRANT OPTION")
        cur.execute("SELECT CURRENT_USER()")
        row = cur.fetchone()
    if found:
        raise PermanentError(
            f"source: the user {row[0] if row else '?'!r} holds {', '.join(sorted(found))}; a "
            "query source needs a least-privilege user (SELECT only; "
            "DISPATCH_QUERY_SOURCE_LEAST_PRIVILEGE)"
        )


def _wire_type(field: Any) -> str:
    """A result column's MySQL type, as COLUMN_TYPE would spell it, from the wire metadata
    (a query's columns have no table to look up)."""
    t, flags, length, scale = field.type_code, field.flags, field.length, field.scale
    unsigned = " unsigned" if flags & FLAG.UNSIGNED else ""
    binary = field.charsetnr == 63
    if flags & FLAG.ENUM:
        return "enum"
    if flags & FLAG.SET:
        return "set"
    ints = {
        FIELD_TYPE.TINY: "tinyint",
        FIELD_TYPE.SHORT: "smallint",
        FIELD_TYPE.INT24: "mediumint",
        FIELD_TYPE.LONG: "int",
        FIELD_TYPE.LONGLONG: "bigint",
    }
    if t in ints:
        return ints[t] + unsigned
    if t in (FIELD_TYPE.DECIMAL, FIELD_TYPE.NEWDECIMAL):
        precision = length - (1 if scale else 0) - (0 if unsigned else 1)
        return f"decimal({max(precision, 1)},{scale}){unsigned}"
    simple = {
        FIELD_TYPE.FLOAT: "float",
        FIELD_TYPE.DOUBLE: "double",
        FIELD_TYPE.DATE: "date",
        FIELD_TYPE.NEWDATE: "date",
        FIELD_TYPE.YEAR: "year",
        FIELD_TYPE.JSON: "json",
        FIELD_TYPE.GEOMETRY: "geometry",
        FIELD_TYPE.NULL: "text",
    }
    if t in simple:
        return simple[t]
    if t == FIELD_TYPE.BIT:
        return f"bit({length})"
    if t in (FIELD_TYPE.DATETIME, FIELD_TYPE.TIMESTAMP, FIELD_TYPE.TIME):
        name = {FIELD_TYPE.DATETIME: "datetime", FIELD_TYPE.TIMESTAMP: "timestamp"}.get(t, "time")
        return f"{name}({scale})" if 0 < scale <= 6 else name
    if t in (
        FIELD_TYPE.BLOB,
        FIELD_TYPE.TINY_BLOB,
        FIELD_TYPE.MEDIUM_BLOB,
        FIELD_TYPE.LONG_BLOB,
    ):
        return "longblob" if binary else "longtext"
    if t in (FIELD_TYPE.VAR_STRING, FIELD_TYPE.VARCHAR, FIELD_TYPE.STRING):
        return "varbinary" if binary else "longtext"
    return "longtext"


class Reader:
    """One connection, one `START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY`: every
    row (and the incremental bound) comes from the same snapshot; a query that writes
    fails."""

    def __init__(
        self, config: dict[str, Any], spec: dict[str, Any], ctx: TransferContext | None = None
    ) -> None:
        self.config = config
        self.spec = spec
        self.ctx = ctx
        self.secrets = _secrets(config)
        self.conn: Any = None
        self.columns: list[Column] = []
        self.mysql_types: list[types.MySQLType] = []
        self._convert: list[types.Convert | None] = []
        self._interrupter = Interrupter(ctx, config)
        self.incremental = incremental.parse(spec)
        self.bounds: incremental.Bounds | None = None
        self._where: list[str] = []
        self._params: list[Any] = []
        self._order = ""
        self._stream: Any = None

    @property
    def server_version(self) -> str | None:
        """The server's version, for the attempt's event log."""
        conn = getattr(self, "conn", None)
        return None if conn is None else str(conn.get_server_info())

    def _relation(self, escaped: bool = False) -> str:
        """The table's or query's SELECT; `escaped` doubles its % signs, for a statement
        that also takes parameters."""
        text = self._relation_text()
        return text.replace("%", "%%") if escaped else text

    def _relation_text(self) -> str:
        if self.spec.get("table"):
            database, name = parse_table(self.spec["table"])
            return f"SELECT * FROM {table_sql(database, name)}"  # noqa: S608 - quoted names
        # The query is SQL by design (the job's author wrote it, under the permission that
        # allows it); it runs in a READ ONLY transaction as a least-privilege user.
        return strip_query(self.spec["query"])

    def open(self) -> None:
        self.conn = connect(self.config, what="source connect", spec=self.spec)
        note_event(self.ctx, "connected", "", side="source", server_version=self.server_version)
        with errors(self.secrets, "source"):
            info = session(self.conn, self.spec, read_only=True)
            self._interrupter.attach(info["thread_id"], self.conn)
            if self.spec.get("query") and targets.query_sources_least_privilege():
                check_least_privilege(self.conn)
                self.conn.commit()
            with self.conn.cursor(pymysql.cursors.Cursor) as cur:
                cur.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY")
                if self.spec.get("table"):
                    declared = self._declared(cur, mariadb=info["mariadb"])
                if self.incremental is not None:
                    # Described without its rows (a derived table the server may still
                    # evaluate: a slow query runs twice).
                    cur.execute(f"SELECT * FROM ({self._relation()}) AS q LIMIT 0")  # noqa: S608
                    fields = list(cur._result.fields) if cur._result else []
            if self.incremental is None:
                # The read itself starts here: its result's columns come before its rows.
                self._stream = self.conn.cursor(pymysql.cursors.SSCursor)
                self._stream.execute(self._relation())
                fields = list(self._stream._result.fields) if self._stream._result else []
            names = [f.name for f in fields]
            column_types = [_wire_type(f) for f in fields]
            if self.spec.get("table"):
                column_types = [
                    declared.get(n, w) for n, w in zip(names, column_types, strict=True)
                ]
        self.mysql_types = [types.MySQLType(t) for t in column_types]
        self.columns = [
            Column(n, t.pg_type()) for n, t in zip(names, self.mysql_types, strict=True)
        ]
        self._convert = [t.reader(n) for n, t in zip(names, self.mysql_types, strict=True)]

    def _declared(self, cur: Any, *, mariadb: bool) -> dict[str, str]:
        """A table's columns as declared (COLUMN_TYPE), with MariaDB's JSON (a LONGTEXT
        with a json_valid() check) named json. MySQL's JSON is a type of its own (and its
        CHECK_CONSTRAINTS has no TABLE_NAME)."""
        database, name = parse_table(self.spec["table"])
        cur.execute(
            "SELECT COLUMN_NAME, COLUMN_TYPE FROM information_schema.COLUMNS"
            " WHERE TABLE_SCHEMA = COALESCE(%s, DATABASE()) AND TABLE_NAME = %s",
            [database, name],
        )
        declared = {str(r[0]): str(r[1]) for r in cur.fetchall()}
        if not mariadb:
            return declared
        cur.execute(
            "SELECT CHECK_CLAUSE FROM information_schema.CHECK_CONSTRAINTS"
            " WHERE CONSTRAINT_SCHEMA = COALESCE(%s, DATABASE()) AND TABLE_NAME = %s",
            [database, name],
        )
        for (clause,) in cur.fetchall():
            for found in _JSON_CHECK.findall(str(clause)):
                if declared.get(found, "").lower() == "longtext":
                    declared[found] = "json"
        return declared

    # -- incremental ----------------------------------------------------------------------
    def _cast(self, i: int) -> str:
        """The typed parameter a cursor value (text) is compared as: fixed words only."""
        t = self.mysql_types[self._cursor_at[i]]
        if t.base in ("tinyint", "smallint", "mediumint", "int", "bigint", "year"):
            return "CAST(%s AS UNSIGNED)" if t.unsigned else "CAST(%s AS SIGNED)"
        if t.base == "decimal":
            return "CAST(%s AS DECIMAL(65,30))"
        if t.base in ("datetime", "timestamp"):
            return "CAST(%s AS DATETIME(6))"
        if t.base == "date":
            return "CAST(%s AS DATE)"
        if t.base in ("float", "double"):
            return "CAST(%s AS DOUBLE)"
        return "%s"

    def bound(self, start: list[str] | None) -> incremental.Bounds:
        assert self.conn is not None and self.incremental is not None
        inc = self.incremental
        names = [c.name for c in self.columns]
        missing = [c for c in inc.cursor if c not in names]
        if missing:
            raise PermanentError(
                f"incremental.cursor: the source has no column(s) {', '.join(missing)}"
            )
        self._cursor_at = [names.index(c) for c in inc.cursor]
        if inc.lookback_seconds is not None and self.mysql_types[self._cursor_at[0]].base not in (
            "datetime",
            "timestamp",
            "date",
        ):
            raise PermanentError(
                f"incremental.lookback_seconds: the first cursor column {inc.cursor[0]} is "
                "not a DATETIME, TIMESTAMP or DATE column"
            )
        if start is not None and len(start) != len(inc.cursor):
            raise PermanentError(
                f"incremental: the committed cursor has {len(start)} value(s) for "
                f"{len(inc.cursor)} cursor column(s); reset the binding's cursor"
            )
        cols = ", ".join(f"q.{ident(c)}" for c in inc.cursor)
        row_of = f"({cols})"
        not_null = " AND ".join(f"q.{ident(c)} IS NOT NULL" for c in inc.cursor)
        values = "(" + ", ".join(self._cast(i) for i in range(len(inc.cursor))) + ")"
        where, params = [not_null], []
        if start is not None:
            where.append(f"{row_of} > {values}")
            params += list(start)
        texts = ", ".join(self._text(c) for c in inc.cursor)
        desc = ", ".join(f"q.{ident(c)} DESC" for c in inc.cursor)
        with errors(self.secrets, "source cursor"), self.conn.cursor(pymysql.cursors.Cursor) as cur:
            cur.execute(
                f"SELECT {texts} FROM ({self._relation(escaped=True)}) AS q WHERE {' AND '.join(where)}"  # noqa: S608
                f" ORDER BY {desc} LIMIT 1",
                params,
            )
            row = cur.fetchone()
        end = (
            [None if v is None else (v.decode() if isinstance(v, bytes) else str(v)) for v in row]
            if row
            else None
        )
        self.bounds = incremental.Bounds(start, end, inc.lookback_seconds)  # type: ignore[arg-type]
        cursor = self.bounds.cursor
        if cursor is None or (self.bounds.end is None and inc.lookback_seconds is None):
            self._where, self._params = ["FALSE"], []
        else:
            self._where = [not_null, f"{row_of} <= {values}"]
            self._params = list(cursor)
            if start is not None and inc.lookback_seconds is not None:
                first = inc.cursor[0]
                self._where.append(f"q.{ident(first)} > {self._cast(0)} - INTERVAL %s SECOND")
                self._params += [start[0], inc.lookback_seconds]
            elif start is not None:
                self._where.append(f"{row_of} > {values}")
                self._params += list(start)
        self._order = cols
        return self.bounds

    def _text(self, column: str) -> str:
        """A cursor column's text form: what CAST(... AS CHAR) prints (full microseconds
        for fractional datetimes, every digit of a decimal)."""
        return f"CAST(q.{ident(column)} AS CHAR)"

    # -- the read -------------------------------------------------------------------------
    def _select(self) -> tuple[str, list[Any]]:
        if self.incremental is not None:
            if self.bounds is None:
                raise PermanentError("incremental read started without its cursor bounds")
            return (
                f"SELECT * FROM ({self._relation(escaped=True)}) AS q"
                f" WHERE {' AND '.join(self._where)}"  # noqa: S608
                f" ORDER BY {self._order}",
                self._params,
            )
        return self._relation(), []

    def batches(self) -> Iterator[Batch]:
        assert self.conn is not None
        statement, params = self._select()
        convert: list[tuple[int, types.Convert]] = [
            (i, f) for i, f in enumerate(self._convert) if f is not None
        ]
        with errors(self.secrets, "source read"):
            # Unbuffered: the server streams the result as it is fetched, BATCH_ROWS at a
            # time, so memory stays flat whatever the table's size.
            finished = False
            if self._stream is not None:
                cur, self._stream = self._stream, None
            else:
                cur = self.conn.cursor(pymysql.cursors.SSCursor)
                cur.execute(statement, params or None)
            try:
                while True:
                    rows = cur.fetchmany(BATCH_ROWS)
                    if not rows:
                        finished = True
                        break
                    if convert:
                        out: Batch = []
                        for row in rows:
                            values = list(row)
                            for i, f in convert:
                                values[i] = f(values[i])
                            out.append(values)
                        yield out
                    else:
                        yield list(rows)
            finally:
                if finished:
                    cur.close()
                else:
                    self._abandon(cur)

    def _abandon(self, cur: Any) -> None:
        """A read left before its end (a stop, the sink's failure): the rest of the
        result is not drained (that would read the whole table); the statement is killed
        and the connection dropped."""
        result = getattr(cur, "_result", None)
        if result is not None:
            result.unbuffered_active = False
        cur._result = None
        if self.conn is not None:
            self._interrupter.interrupt()
            conn, self.conn = self.conn, None
            conn._force_close()

    def interrupt(self) -> None:
        self._interrupter.interrupt()

    def close(self) -> None:
        if self._stream is not None:  # opened, never read (the run was already committed)
            stream, self._stream = self._stream, None
            self._abandon(stream)
        self._interrupter.close()
        if self.conn is not None:
            conn, self.conn = self.conn, None
            try:
                conn.close()
            except (pymysql.Error, OSError):
                conn._force_close()


_JSON_CHECK = re.compile(r"json_valid\(`([^`]+)`\)", re.I)
