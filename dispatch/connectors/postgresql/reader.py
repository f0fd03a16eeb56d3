"""The `postgresql` source: COPY out of one REPEATABLE READ READ ONLY snapshot."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import select
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import pq, sql
from psycopg.adapt import Buffer, Loader
from psycopg.types.string import TextBinaryLoader, TextLoader

from dispatch.connectors import columns as column_spec
from dispatch.connectors import incremental, sqlsafety
from dispatch.connectors.base import (
    SLICE_RANGE,
    Batch,
    Column,
    PermanentError,
    TransferContext,
    note_event,
)
from dispatch.connectors.postgresql import slices
from dispatch.connectors.postgresql.cancel import _Canceller
from dispatch.connectors.postgresql.connect import (
    _errors,
    _secrets,
    _table_sql,
    open_session,
    parse_table,
)
from dispatch.security import targets

log = logging.getLogger("dispatch.connectors")

# Rows per batch on the decoded (row by row) path.
BATCH_ROWS = 5000
# The COPY fast path hands the sink blocks of about this size: large enough that the
# per-block Python work vanishes, small enough that memory stays flat.
COPY_BLOCK_BYTES = 1 << 20
# A whole table the planner puts below this many rows is counted exactly before it is
# read (in the read's own snapshot, so the count is the rows the read yields): a scan of
# at most about this many rows, cheap beside the copy. Larger tables and queries keep the
# planner's estimate (a query would run twice to be counted).
EXACT_COUNT_BELOW = 100_000


def _check_least_privilege(conn: psycopg.Connection[Any]) -> None:
    """A `query` source runs arbitrary SQL: refuse a role that can do more than read
    tables (docs/security.md, "Source queries")."""
    # Under catalog_only() as well as schema-qualified: the role owns its schemas on the
    # session's path and may define functions there that would answer for the catalog's.
    with conn.transaction():
        sqlsafety.catalog_only(conn)
        row = conn.execute(targets.PRIVILEGED_ROLE_SQL, [list(targets.PRIVILEGED_ROLES)]).fetchone()
    if row is None:
        return
    role, powers = row[0], [p for p in row[1] or [] if p]
    if powers:
        raise PermanentError(
            f"source: the role {role!r} has {', '.join(powers)}; a query source needs a "
            "least-privilege role (SELECT on its tables only; DISPATCH_QUERY_SOURCE_LEAST_PRIVILEGE)"
        )


class _JsonbTextBinaryLoader(Loader):
    """A binary jsonb value as its text (the format's version byte, then the text)."""

    format = pq.Format.BINARY

    def load(self, data: Buffer) -> str:
        if data and data[0] != 1:
            raise psycopg.DataError(f"unknown jsonb binary format: {data[0]}")
        return str(data[1:], "utf-8")


def _json_as_text(adapters: Any) -> None:
    """json and jsonb values loaded as PostgreSQL's own text of them, not parsed."""
    for name in ("json", "jsonb"):
        adapters.register_loader(name, TextLoader)
    adapters.register_loader("json", TextBinaryLoader)
    adapters.register_loader("jsonb", _JsonbTextBinaryLoader)


def _strip_query(query: str) -> str:
    return query.strip().rstrip(";").strip()


class _Reader:
    """One connection, one REPEATABLE READ READ ONLY transaction: every row comes from the
    same snapshot, and a query that tries to write fails (permanently)."""

    # Set by the runner when the sink takes JSON as text (base.py, `json_text`): json and
    # jsonb values come as PostgreSQL's text of them instead of parsed objects.
    json_text = False

    def __init__(
        self, config: dict[str, Any], spec: dict[str, Any], ctx: TransferContext | None = None
    ) -> None:
        self.config = config
        self.spec = spec
        self.secrets = _secrets(config)
        self.conn: psycopg.Connection[Any] | None = None
        self._ctx = ctx
        self._canceller = _Canceller(ctx, config, "source")
        self.columns: list[Column] = []
        self.oids: list[int] = []
        # An incremental read (dispatch/connectors/incremental.py): `bound()` decides the
        # rows in this reader's snapshot before any is read.
        self.incremental = incremental.parse(spec)
        self._plan: incremental.CursorReadPlan | None = None
        # An incremental read of a table with no index on its cursor: the statement that
        # creates one (logged as a warning when the reader opens).
        self.index_needed: str | None = None
        self.bounds: incremental.Bounds | None = None
        # A table source's `columns` (dispatch/connectors/columns.py): the read delivers
        # these, projected in SQL around whatever it copies. Cursor and slice keys stay
        # the table's own columns, delivered or not.
        self.column_spec = column_spec.parse(spec)
        self.projected: list[column_spec.Projected] | None = None
        # `columns.hash`: the binding's key (the runner's context carries it) and the
        # delivered columns it applies to. The hash is computed here, in the worker: the
        # key is never sent to a server (COPY takes no parameters, and statements and
        # their parameters may be logged).
        self._hash_key: bytes | None = getattr(ctx, "hash_key", None)
        self._hashed: list[int] = []

    def _relation(self) -> sql.Composable:
        if self.spec.get("table"):
            schema, name = parse_table(self.spec["table"])
            ident = _table_sql(schema, name) if schema else sql.Identifier(name)
            bounds = self.spec.get(SLICE_RANGE)
            if bounds is not None:
                # One slice of a sliced run: its range of the key, in this reader's own
                # snapshot (docs/connectors.md, "Slices").
                return sql.SQL("SELECT * FROM {} WHERE {}").format(
                    ident, slices.where(bounds["key"], bounds["lower"], bounds["upper"])
                )
            return sql.SQL("SELECT * FROM {}").format(ident)
        # The query is SQL by design (the job's author wrote it); it runs inside a READ ONLY
        # transaction, so it cannot change anything.
        return sql.SQL(_strip_query(self.spec["query"]))  # type: ignore[arg-type]

    @property
    def server_version(self) -> str | None:
        """The source server's version, for the attempt's event log."""
        return None if self.conn is None else self.conn.info.parameter_status("server_version")

    def open(self) -> None:
        session = open_session(self.config, self.spec, what="source connect")
        self.conn = session.conn
        self._canceller.attach(self.conn)
        self._canceller.watch(session.pid)
        note_event(self._ctx, "connected", "", side="source", server_version=self.server_version)
        with _errors(self.secrets, "source", self._canceller):
            if self.spec.get("query") and targets.query_sources_least_privilege():
                _check_least_privilege(self.conn)
            self.conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            self.conn.read_only = True
            # The first statement takes the snapshot; describing the relation inside the
            # same transaction means the column list and the rows agree.
            cur = self.conn.execute(
                sql.SQL("SELECT * FROM ({}) AS q LIMIT 0").format(self._relation())
            )
            result = cur.pgresult
            assert result is not None and cur.description is not None
            names = [d.name for d in cur.description]
            self.oids = [result.ftype(i) for i in range(result.nfields)]
            mods = [result.fmod(i) for i in range(result.nfields)]
            # A result column that is a table's column takes that column's declared type
            # (a domain stays the domain, not its base type; enums, arrays and typmods as
            # declared); any other its result type. format_type(oid, typmod) is what the
            # catalog says: numeric(12,2), character varying(20), posint, integer[] ...
            tables = [result.ftable(i) for i in range(result.nfields)]
            attnums = [result.ftablecol(i) for i in range(result.nfields)]
            described = self.conn.execute(
                "SELECT coalesce(pg_catalog.format_type(a.atttypid, a.atttypmod),"
                "                pg_catalog.format_type(t.oid, t.mod)),"
                "       coalesce(a.attnotnull, false)"
                # ROWS FROM: the multi-argument unnest() shorthand takes no schema.
                "  FROM ROWS FROM (pg_catalog.unnest(%s::pg_catalog.oid[]),"
                "                  pg_catalog.unnest(%s::pg_catalog.int4[]),"
                "                  pg_catalog.unnest(%s::pg_catalog.oid[]),"
                "                  pg_catalog.unnest(%s::pg_catalog.int4[]))"
                "       WITH ORDINALITY AS t(oid, mod, rel, att, n)"
                "  LEFT JOIN pg_catalog.pg_attribute a"
                "    ON t.rel OPERATOR(pg_catalog.<>) 0"
                "   AND a.attrelid OPERATOR(pg_catalog.=) t.rel"
                "   AND a.attnum OPERATOR(pg_catalog.=) t.att"
                "   AND NOT a.attisdropped"
                " ORDER BY t.n",
                [self.oids, mods, tables, attnums],
            ).fetchall()
            types = [row[0] for row in described]
            table_columns = [Column(n, t) for n, t in zip(names, types, strict=True)]
            self.columns = table_columns
            if self.incremental is not None:
                self._plan = incremental.CursorReadPlan(
                    self.incremental, self._relation(), table_columns
                )
                self._check_cursor_index(names, tables, attnums)
            if self.column_spec is not None:
                # Checked again here, against the snapshot the rows come from: a column
                # dropped or renamed since the spec was saved fails the run for good.
                self.projected = column_spec.project(self.column_spec, names)
                self.columns = column_spec.sink_columns(self.projected, table_columns)
                self.oids = [self.oids[names.index(p.source)] for p in self.projected]
                self._hashed = [i for i, p in enumerate(self.projected) if p.hashed]
            if self.spec.get("table"):
                delivered = (
                    [names.index(p.source) for p in self.projected]
                    if self.projected is not None
                    else list(range(len(names)))
                )
                self.columns = _declared(
                    self.conn,
                    self.columns,
                    [bool(described[i][1]) for i in delivered],
                    tables[0] if tables else 0,
                    [attnums[i] for i in delivered],
                )

    def _check_cursor_index(self, names: list[str], tables: list[int], attnums: list[int]) -> None:
        """An incremental read of a table streams in the cursor's order only from a btree
        index on the cursor columns: without one, the read still runs (sorting the whole
        increment first) and the worker log names the index to create. A query source's
        tables are not checked (docs/connectors.md)."""
        assert self.conn is not None and self.incremental is not None
        if not self.spec.get("table"):
            return
        cursor = self.incremental.cursor
        at = [names.index(c) for c in cursor]
        table_oids = {tables[i] for i in at}
        if len(table_oids) != 1 or 0 in table_oids:
            return
        create = incremental.missing_index(
            self.conn, table_oids.pop(), [attnums[i] for i in at], cursor
        )
        self.index_needed = create
        if create is not None:
            log.warning(
                "incremental read of %s without an index on its cursor (%s): every run sorts "
                "its whole increment before the first row moves; create one: %s",
                self.spec["table"],
                ", ".join(cursor),
                create,
            )

    def bound(self, start: list[str] | None) -> incremental.Bounds:
        """Incremental reads: the rows above `start` (the sink's committed cursor), decided
        in this reader's snapshot; `end` is the greatest cursor tuple among them."""
        assert self.conn is not None and self._plan is not None
        with _errors(self.secrets, "source cursor", self._canceller):
            self.bounds = self._plan.bound(self.conn, start)
        return self.bounds

    def close(self) -> None:
        if self.conn is not None:
            conn, self.conn = self.conn, None
            self._canceller.close(conn)

    def _read_relation(self) -> sql.Composable:
        """What the read copies: the table or query, or an incremental read's bounded
        select of it; with `columns`, a select list of identifiers around it (the bounded
        select's ORDER BY makes its subquery a scan of its own, so the order stays)."""
        if self._plan is not None and self.bounds is None:
            raise PermanentError("incremental read started without its cursor bounds")
        if self._plan is not None and self.bounds is not None:
            relation = self._plan.select(self.bounds)
        else:
            relation = self._relation()
        if self.projected is None:
            return relation
        return sql.SQL("SELECT {} FROM ({}) AS q").format(
            sql.SQL(", ").join(
                sql.SQL("q.{} AS {}").format(sql.Identifier(p.source), sql.Identifier(p.sink))
                if p.source != p.sink
                else sql.SQL("q.{}").format(sql.Identifier(p.source))
                for p in self.projected
            ),
            relation,
        )

    def _report_estimate(self) -> None:
        """Tell the context how many rows the read will yield, before the first: the
        planner's estimate of the relation it copies (EXPLAIN plans, it runs nothing), or,
        for a whole table the planner puts under EXACT_COUNT_BELOW rows, an exact count
        in this read's snapshot. Both run in the read's transaction, so an error here is
        the read's error (the copy that follows would fail the same way)."""
        if self._ctx is None:
            return
        assert self.conn is not None
        relation = self._read_relation()
        with _errors(self.secrets, "source read", self._canceller):
            row = self.conn.execute(sql.SQL("EXPLAIN (FORMAT JSON) {}").format(relation)).fetchone()
            plan = row[0] if row else None
            if isinstance(plan, str):  # a server or adapter that returns the JSON as text
                plan = json.loads(plan)
            try:
                rows = int(plan[0]["Plan"]["Plan Rows"])  # type: ignore[index]
            except (TypeError, KeyError, IndexError, ValueError):
                return  # an answer of another shape: no estimate rather than a wrong one
            if self.spec.get("table") and self._plan is None and rows < EXACT_COUNT_BELOW:
                counted = self.conn.execute(
                    sql.SQL("SELECT pg_catalog.count(*) FROM ({}) AS q").format(relation)
                ).fetchone()
                rows = int(counted[0]) if counted else rows
        self._ctx.estimate(max(0, rows))

    def _copy_sql(self, fmt: str, options: dict[str, str] | None = None) -> sql.Composed:
        relation = self._read_relation()
        if fmt == "csv":
            # PostgreSQL's own CSV text of every value (intervals, json as written,
            # ranges, infinity, BC dates, 24:00), in UTF-8 whatever the client encoding.
            # The delimiter and null string are the sink's (validated by its spec), as
            # literals.
            opts = options or {}
            return sql.SQL(
                "COPY ({}) TO STDOUT (FORMAT CSV, DELIMITER {}, NULL {}, ENCODING 'UTF8')"
            ).format(
                relation,
                sql.Literal(opts.get("delimiter", ",")),
                sql.Literal(opts.get("null", "")),
            )
        return sql.SQL("COPY ({}) TO STDOUT (FORMAT {})").format(
            relation, sql.SQL("BINARY" if fmt == "binary" else "TEXT")
        )

    @property
    def copy_formats(self) -> tuple[str, ...] | None:
        """The COPY formats this read can hand out (None: any). Keyed hashes are
        computed on the text format's values."""
        return ("text",) if self._hashed else None

    def _key(self) -> bytes:
        if self._hash_key is None:
            raise PermanentError("columns.hash: the read was given no hash key")
        return self._hash_key

    def batches(self) -> Iterator[Batch]:
        """Decoded rows, streamed. Binary when psycopg can load every column in binary;
        text with keyed hashes (a hashed column is loaded as its text form and hashed)."""
        assert self.conn is not None
        self._report_estimate()
        hashed = self._hashed
        key = self._key() if hashed else b""
        binary = not hashed and all(
            self.conn.adapters.get_loader(oid, pq.Format.BINARY) is not None for oid in self.oids
        )
        oids = [TEXT_OID if i in hashed else oid for i, oid in enumerate(self.oids)]
        keyed_hash = column_spec.keyed_hash
        with _errors(self.secrets, "source read", self._canceller):
            cur = self.conn.cursor()
            if self.json_text:
                _json_as_text(cur.adapters)  # the cursor's own map: the connection's stays
            with cur.copy(self._copy_sql("binary" if binary else "text")) as copy:
                copy.set_types(oids)
                batch: Batch = []
                for row in copy.rows():
                    if hashed:
                        values = list(row)
                        for i in hashed:
                            if values[i] is not None:
                                values[i] = keyed_hash(key, values[i])
                        row = tuple(values)
                    batch.append(row)
                    if len(batch) >= BATCH_ROWS:
                        with self._canceller.suspended():
                            yield batch
                        batch = []
                if batch:
                    with self._canceller.suspended():
                        yield batch

    def copy_chunks(
        self, fmt: str, options: dict[str, str] | None = None
    ) -> Iterator[tuple[bytes, int]]:
        """Raw COPY data in blocks of about COPY_BLOCK_BYTES, with the rows in each block.

        Reads libpq's buffer directly (non-blocking `get_copy_data`, waiting on the socket
        with select, which releases the GIL): psycopg's per-message generator costs more
        than the copy itself. PostgreSQL sends one CopyData message per row; in binary the
        header rides with the first row and the trailer is a message of its own, so the
        trailer (and only it) is not counted.
        """
        assert self.conn is not None
        if self._hashed:
            if fmt != "text":
                raise PermanentError(f"columns.hash: a {fmt} COPY cannot carry keyed hashes")
            yield from self._hashed_chunks()
            return
        yield from self._raw_chunks(fmt, options)

    def _hashed_chunks(self) -> Iterator[tuple[bytes, int]]:
        """Text COPY blocks with the hashed columns' values replaced by their keyed hash
        (64 hex digits, which need no escaping; NULL stays NULL). Each block holds whole
        lines, and a newline inside a value is escaped, so splitting on it is exact."""
        assert self.conn is not None
        key = self._key()
        codec = self.conn.info.encoding
        recode = codec.replace("_", "-").lower() not in ("utf-8", "utf8")
        hashed = self._hashed
        for block, rows in self._raw_chunks("text", None):
            lines = block.split(b"\n")
            tail = lines.pop()  # the empty remainder after the last newline
            out = []
            for line in lines:
                fields = line.split(b"\t")
                for i in hashed:
                    value = fields[i]
                    if value != b"\\N":
                        text = _UNESCAPE.sub(_unescape, value)
                        if recode:
                            text = text.decode(codec).encode("utf-8")
                        fields[i] = hmac.new(key, text, hashlib.sha256).hexdigest().encode()
                out.append(b"\t".join(fields))
            out.append(tail)
            yield b"\n".join(out), rows

    def _raw_chunks(self, fmt: str, options: dict[str, str] | None) -> Iterator[tuple[bytes, int]]:
        assert self.conn is not None
        self._report_estimate()
        conn, pgconn = self.conn, self.conn.pgconn
        with _errors(self.secrets, "source read", self._canceller):
            # Sent on the connection whose transaction (and snapshot) open() began; psycopg
            # sees the transaction status through libpq, so its state stays consistent.
            pgconn.send_query(self._copy_sql(fmt, options).as_bytes(conn))
            _wait(pgconn)
            result = pgconn.get_result()
            if result is None or result.status != pq.ExecStatus.COPY_OUT:
                _raise_result(pgconn, result)
            # The loop below runs once per row: kept to the fewest Python operations (bound
            # methods in locals). Each message is copied into one growing buffer at once,
            # which frees libpq's copy of it while it is still in the cache: keeping the
            # messages in a list and joining them costs more than twice as much.
            get_copy_data = pgconn.get_copy_data
            block = bytearray()
            extend = block.extend
            size = rows = 0
            while True:
                nbytes, data = get_copy_data(1)
                if nbytes > 0:
                    # Flush before appending, so the last message (the binary trailer)
                    # is always in the final block.
                    if size >= COPY_BLOCK_BYTES:
                        with self._canceller.suspended():
                            yield bytes(block), rows
                        block = bytearray()
                        extend = block.extend
                        size = rows = 0
                    extend(data)
                    size += nbytes
                    rows += 1
                    continue
                if nbytes == 0:  # libpq's buffer is empty: wait for the socket
                    select.select([pgconn.socket], [], [])
                    pgconn.consume_input()
                    continue
                break  # -1: the COPY is complete (-2, an error, is raised below)
            if fmt == "binary" and rows:
                rows -= 1  # the trailer message
            _wait(pgconn)
            _raise_result(pgconn, pgconn.get_result())
            if size:
                with self._canceller.suspended():
                    yield bytes(block), rows

    def interrupt(self) -> None:
        """Cancel the statement (or COPY) running on the connection, from another thread
        (the runner's, when the sink side of a copy has stopped)."""
        self._canceller.interrupt()


# The `text` type's OID: a hashed column is loaded as its text form.
TEXT_OID = 25
# Text COPY's escapes (what COPY TO writes for a backslash and the control characters).
_UNESCAPE = re.compile(rb"\\(.)", re.DOTALL)
_ESCAPED = {
    b"\\": b"\\",
    b"b": b"\b",
    b"f": b"\f",
    b"n": b"\n",
    b"r": b"\r",
    b"t": b"\t",
    b"v": b"\v",
}


def _unescape(match: re.Match[bytes]) -> bytes:
    char = match.group(1)
    return _ESCAPED.get(char, char)


# A table's primary key and plain unique constraints (unique indexes included): valid,
# without a predicate or an expression; key columns only (not INCLUDE columns).
_KEYS_SQL = (
    "SELECT i.indisprimary, pg_catalog.array_agg(k.att ORDER BY k.n)::pg_catalog.int4[]"
    "  FROM pg_catalog.pg_index i,"
    "       pg_catalog.unnest(i.indkey::pg_catalog.int2[]) WITH ORDINALITY AS k(att, n)"
    " WHERE i.indrelid OPERATOR(pg_catalog.=) %s AND i.indisunique AND i.indisvalid"
    "   AND i.indpred IS NULL AND i.indexprs IS NULL"
    "   AND k.n OPERATOR(pg_catalog.<=) i.indnkeyatts"
    " GROUP BY i.indexrelid, i.indisprimary"
    " ORDER BY i.indisprimary DESC, i.indexrelid"
)


def _declared(
    conn: psycopg.Connection[Any],
    columns: list[Column],
    not_null: list[bool],
    table: int,
    attnums: list[int],
) -> list[Column]:
    """The delivered columns of a table source with what the table declares of them: NOT
    NULL, the primary key and the unique constraints whose every column is delivered
    (`Column`), for a sink that creates its table like the source's."""
    key: dict[int, int] = {}
    unique: dict[int, list[tuple[int, int]]] = {}
    if table:
        number = 0
        for primary, atts in conn.execute(_KEYS_SQL, [table]).fetchall():
            if not all(a in attnums for a in atts):
                continue  # a column of it is not delivered: it constrains nothing here
            if primary:
                key = {a: n for n, a in enumerate(atts, 1)}
                continue
            number += 1
            for n, a in enumerate(atts, 1):
                unique.setdefault(a, []).append((number, n))
    return [
        Column(c.name, c.type, nn, key.get(att, 0), tuple(unique.get(att, ())))
        for c, nn, att in zip(columns, not_null, attnums, strict=True)
    ]


def _wait(pgconn: Any) -> None:
    """Block (in select, which releases the GIL) until libpq has a whole result."""
    pgconn.consume_input()
    while pgconn.is_busy():
        select.select([pgconn.socket], [], [])
        pgconn.consume_input()


def _raise_result(pgconn: Any, result: Any) -> None:
    """Drain the remaining results; raise the psycopg error of a failed one."""
    error = None
    while result is not None:
        if result.status == pq.ExecStatus.FATAL_ERROR and error is None:
            state = result.error_field(pq.DiagnosticField.SQLSTATE)
            cls = psycopg.errors.lookup(state.decode()) if state else psycopg.OperationalError
            error = cls(result.error_message.decode(errors="replace").strip())
        _wait(pgconn)
        result = pgconn.get_result()
    if error is not None:
        raise error
