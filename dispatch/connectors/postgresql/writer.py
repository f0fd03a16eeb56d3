"""The `postgresql` sink: COPY into one transaction that ends with the sink-side fence."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from dispatch.connectors import incremental, receipt, sqlsafety
from dispatch.connectors.base import (
    SLICE_OF,
    Batch,
    Column,
    FenceRejected,
    LeaseLost,
    PermanentError,
    TransferContext,
    TransientError,
    WriteResult,
    note_event,
)
from dispatch.connectors.postgresql.cancel import _Canceller
from dispatch.connectors.postgresql.connect import (
    _errors,
    _secrets,
    _table_sql,
    open_session,
    parse_table,
)
from dispatch.connectors.postgresql.schema_policy import Change, is_wider, policy

SINK_MODES = ("append", "replace", "upsert", "mirror")
# The modes that stage the rows and merge them on a key.
KEYED_MODES = ("upsert", "mirror")
# The temporary table rows are copied into when they are not copied into the target.
STAGE = "dispatch_stage"
# The sink-side record of the slices of a sliced `replace` that have committed their rows
# to its staging table, beside dispatch_fence.
SLICE_COMMIT_TABLE = "dispatch_slice_commit"
# The receipt of every delivery, beside dispatch_fence: written in the data transaction,
# so it commits with the rows or not at all (docs/connectors.md, "Receipts").
RECEIPT_TABLE = "dispatch_receipt"
RECEIPT_INDEX = "dispatch_receipt_binding_idx"
# What `_raise_fence` makes when missing, beside the sink's table.
FENCE_RELATIONS = ("dispatch_fence", "dispatch_cursor", RECEIPT_TABLE, RECEIPT_INDEX)
# The column a binding may turn on (`attempt_column: true`) that names the attempt which
# wrote each row: its default reads the data transaction's setting, so COPY fills it at
# no cost per row, and rows written by anything else hold NULL.
ATTEMPT_COLUMN = "_dispatch_attempt"
ATTEMPT_SETTING = "dispatch.attempt_id"


def staging_name(parent: str) -> str:
    """The staging table of a sliced `replace`, named from the sliced run's id (47
    characters, under PostgreSQL's 63)."""
    return "dispatch_slices_" + uuid.UUID(str(parent)).hex


class _Writer:
    """One sink connection. The fence is raised in a short transaction of its own; the
    data then goes in one transaction that ends with the guarded fence update."""

    def __init__(
        self,
        config: dict[str, Any],
        spec: dict[str, Any],
        ctx: TransferContext,
        columns: list[Column],
    ) -> None:
        self.config = config
        self.spec = spec
        self.ctx = ctx
        self._canceller = _Canceller(ctx, config, "sink")
        self.source_columns = columns
        self.secrets = _secrets(config)
        self.mode = spec.get("mode", "append")
        self.conn: psycopg.Connection[Any] | None = None
        self.schema = ""
        self.name = ""
        self.already_committed = False
        self._prepared = False
        self.rows = 0
        self._copy: Any = None
        self._copy_cm: Any = None
        self._copy_cursor: Any = None
        self._copy_fmt: str | None = None
        self._copy_options: dict[str, Any] = {}
        self._target_types: dict[str, str] = {}
        self._convert: list[Callable[[Any], Any] | None] = []
        # Incremental reads: the committed cursor this attempt read, and the one to commit.
        self._cursor_read: incremental.CommittedCursor | None = None
        self._cursor_new: tuple[tuple[str, ...], list[str] | None] | None = None
        # After commit(): the cursor it committed (for the dispatch database's copy).
        self.cursor_committed: incremental.CommittedCursor | None = None
        # A slice of a sliced run: {"parent", "number", "total"}; `replace` then stages.
        self.slice_of: dict[str, Any] | None = spec.get(SLICE_OF)
        self.staged = self.slice_of is not None and self.mode == "replace"
        # After commit(): whether this slice's commit swapped the staged rows in.
        self.swapped = False
        # The receipt: the digest of the rows as they stream (text COPY only; None when
        # the rows arrive another way), and after commit() what was committed.
        self.digest: receipt.Digest | None = None
        self.receipt_committed: tuple[int, str | None] | None = None
        self.attempt_column = bool(spec.get("attempt_column"))
        # Schema changes (schema_policy.py): what `_prepare` found and did, the columns
        # loaded into the target (the source's less the ignored ones), and whether the
        # rows go through the temporary staging table first.
        self.schema_changes: list[dict[str, Any]] = []  # Change.as_json() of each
        self._load: list[str] = []
        self._via_stage = self.mode in KEYED_MODES
        # mirror: the `deleted_column` (a soft delete); after commit(), the sink rows it
        # deleted (absent from the snapshot or marked).
        self.deleted_column: str | None = spec.get("deleted_column")
        self.mirror_deleted = 0
        self._marked = 0  # staged rows marked deleted

    @property
    def server_version(self) -> str | None:
        """The sink server's version, for the attempt's event log."""
        return None if self.conn is None else self.conn.info.parameter_status("server_version")

    # -- set-up --------------------------------------------------------------------------
    def open(self) -> None:
        session = open_session(self.config, self.spec, what="sink connect")
        self.conn = session.conn
        self._canceller.attach(self.conn)
        self._canceller.watch(session.pid)
        note_event(self.ctx, "connected", "", side="sink", server_version=self.server_version)
        with _errors(self.secrets, "sink", self._canceller):
            schema, self.name = parse_table(self.spec["table"])
            self.schema = schema or session.schema
            self._raise_fence()
        # The data transaction begins at the writer's first use (`_ready`), not here: the
        # runner may open this writer while the source is still being described, and
        # the source's columns (which `_prepare` and `_prepare_slices` need) arrive only
        # then.

    def _ready(self) -> None:
        """Begin the data transaction (`_prepare`) on the writer's first use; a slice's
        short set-up transactions (`_prepare_slices`) come first."""
        if self._prepared or self.already_committed:
            return
        self._prepared = True
        with _errors(self.secrets, "sink", self._canceller):
            if self.slice_of is not None:
                self._prepare_slices()
            self._prepare()

    @property
    def _fence_table(self) -> sql.Composed:
        return _table_sql(self.schema, "dispatch_fence")

    def _raise_fence(self) -> None:
        """Raise the run's fence to this attempt's token, in a short transaction of its own
        (contract section 4). It is never held during the bulk copy."""
        assert self.conn is not None
        fence = self.ctx.fence
        conn = self.conn
        if not self._fence_tables_exist():
            sqlsafety.create_once(
                conn,
                "dispatch_fence",
                self.schema,
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (run_id uuid PRIMARY KEY,"
                    " binding_id uuid, token bigint NOT NULL, attempt_id uuid,"
                    " committed_at timestamptz)"
                ).format(self._fence_table),
            )
            # The committed cursors of incremental reads live beside the fence; made here,
            # in a transaction of its own, so no data transaction ever holds its creation.
            incremental.ensure_table(conn, self.schema)
            sqlsafety.create_once(
                conn,
                RECEIPT_TABLE,
                self.schema,
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (run_id uuid PRIMARY KEY,"
                    " binding_id uuid NOT NULL, attempt_id uuid NOT NULL, parent_id uuid,"
                    " table_name text NOT NULL, mode text NOT NULL,"
                    " columns text[] NOT NULL, attempt_column boolean NOT NULL,"
                    " rows bigint NOT NULL, digest text, committed_at timestamptz NOT NULL)"
                ).format(_table_sql(self.schema, RECEIPT_TABLE)),
            )
            # For a binding's latest delivery into a table (`_previous_columns`).
            sqlsafety.create_once(
                conn,
                RECEIPT_INDEX,
                self.schema,
                sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (binding_id, committed_at)").format(
                    sql.Identifier(RECEIPT_INDEX), _table_sql(self.schema, RECEIPT_TABLE)
                ),
            )
        # How long the fence's row lock was waited for (a rival attempt's data transaction
        # holds it until its COMMIT), for the attempt's event log.
        started = time.monotonic()
        with conn.transaction():
            # ON CONFLICT DO UPDATE re-evaluates its WHERE on the newest committed version
            # of the row (after waiting for a concurrent commit that holds it), so a commit
            # that lands first is always seen: a committed fence is never raised again.
            raised = conn.execute(
                sql.SQL(
                    "INSERT INTO {f} AS f (run_id, binding_id, token) VALUES (%s, %s, %s)"
                    " ON CONFLICT (run_id) DO UPDATE SET token = EXCLUDED.token,"
                    " binding_id = EXCLUDED.binding_id"
                    " WHERE f.token <= EXCLUDED.token AND f.committed_at IS NULL"
                    " RETURNING f.token"
                ).format(f=self._fence_table),
                [fence.run_id, fence.binding_id, fence.token],
            ).fetchone()
            note_event(
                self.ctx, "lock_wait", "the sink's fence row", seconds=time.monotonic() - started
            )
            if raised is not None:
                note_event(
                    self.ctx, "fence_raised", f"the sink's fence raised to token {fence.token}"
                )
                return
            token, committed_at = conn.execute(
                sql.SQL("SELECT token, committed_at FROM {} WHERE run_id = %s").format(
                    self._fence_table
                ),
                [fence.run_id],
            ).fetchone()  # type: ignore[misc]
        if committed_at is not None:
            self.already_committed = True
            return
        raise FenceRejected(
            f"sink fence of run {fence.run_id} is at token {token}, above this attempt's "
            f"{fence.token}"
        )

    def _fence_tables_exist(self) -> bool:
        """Whether `dispatch_fence` and `dispatch_cursor` are there (one catalog read, in
        place of two creations that find them): a table dropped after this read makes
        the fence's statements fail, and the attempt with them (transient)."""
        assert self.conn is not None
        row = self.conn.execute(
            "SELECT pg_catalog.count(*) FROM pg_catalog.pg_class c"
            " JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace"
            " WHERE n.nspname OPERATOR(pg_catalog.=) %s"
            " AND c.relname OPERATOR(pg_catalog.=) ANY (%s::pg_catalog.text[])",
            [self.schema, list(FENCE_RELATIONS)],
        ).fetchone()
        self.conn.commit()
        return bool(row and row[0] == len(FENCE_RELATIONS))

    # -- the committed cursor of an incremental read (dispatch/connectors/incremental.py) --
    def cursor_state(self, inc: incremental.IncrementalSpec) -> incremental.CommittedCursor:
        """The binding's committed cursor, as this sink holds it (the truth). Read inside
        the data transaction; `commit()` moves it with a compare-and-set on its version."""
        assert self.conn is not None
        self._ready()
        if self.mode == "replace":
            raise PermanentError(
                "incremental reads need an append or upsert sink (or mirror with "
                "deleted_column): replace would keep only the latest increment"
            )
        if inc.lookback_seconds is not None and self.mode not in KEYED_MODES:
            raise PermanentError(
                "incremental.lookback_seconds re-reads rows, so it needs an upsert sink"
            )
        if self.mode == "mirror" and self.deleted_column is None:
            raise PermanentError(
                "mirror with incremental reads needs deleted_column: a cursor sees only the "
                "rows that changed, so a row deleted from the source (a hard delete) is "
                "invisible to it"
            )
        with _errors(self.secrets, "sink cursor", self._canceller):
            self._cursor_read = incremental.read_committed(
                self.conn, self.schema, self.ctx.fence.binding_id
            )
        return self._cursor_read

    def stage_cursor(self, columns: tuple[str, ...], cursor: list[str] | None) -> None:
        """The cursor to commit with the rows (in the same transaction as the fence)."""
        self._cursor_new = (columns, cursor)

    def _target_columns(self) -> dict[str, tuple[str, int]] | None:
        """The sink table's columns: name -> (exact type, type oid); None if missing."""
        assert self.conn is not None
        rows = self.conn.execute(
            "SELECT a.attname, pg_catalog.format_type(a.atttypid, a.atttypmod),"
            " a.atttypid::pg_catalog.int4, c.relkind"
            " FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n"
            "   ON n.oid OPERATOR(pg_catalog.=) c.relnamespace"
            " LEFT JOIN pg_catalog.pg_attribute a ON a.attrelid OPERATOR(pg_catalog.=) c.oid"
            "  AND a.attnum OPERATOR(pg_catalog.>) 0 AND NOT a.attisdropped"
            " WHERE n.nspname OPERATOR(pg_catalog.=) %s AND c.relname OPERATOR(pg_catalog.=) %s"
            " ORDER BY a.attnum",
            [self.schema, self.name],
        ).fetchall()
        if not rows:
            return None
        if rows[0][3] not in ("r", "p"):
            raise PermanentError(f"sink {self.schema}.{self.name} is not a table")
        return {r[0]: (r[1], r[2]) for r in rows if r[0] is not None}

    def _create_table(self, table: sql.Composed, key: list[str] | None) -> None:
        """The sink table like the source's: its columns' names, order and exact types,
        their NOT NULLs, its primary key unless appending (the spec's `key` instead, in
        any mode) and, with `create_unique`, its unique constraints (docs/connectors.md)."""
        assert self.conn is not None
        conn = self.conn
        columns = self.source_columns
        # Type text comes from the source server: accepted only as one plain type name the
        # sink resolves itself (see sqlsafety). Untyped columns (a CSV source) become text.
        types = [
            sqlsafety.check_type_name(conn, c.name, c.type) if c.type else "text" for c in columns
        ]
        if not key and self.mode != "append":
            # Not for append: appending a source row again (an incremental read of its
            # update, a lookback, a second full read) is what append is for.
            key = [c.name for c in sorted(columns, key=lambda c: c.key) if c.key]
        parts: list[sql.Composable] = [
            sql.SQL("{} {}{}").format(
                sql.Identifier(c.name),
                sql.SQL(t),  # type: ignore[arg-type]
                sql.SQL(" NOT NULL") if c.not_null else sql.SQL(""),
            )
            for c, t in zip(columns, types, strict=True)
        ]
        if key:
            parts.append(
                sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(map(sql.Identifier, key)))
            )
        if self.spec.get("create_unique"):
            for unique in _unique_constraints(columns):
                if unique != key:
                    parts.append(
                        sql.SQL("UNIQUE ({})").format(
                            sql.SQL(", ").join(map(sql.Identifier, unique))
                        )
                    )
        conn.execute(
            sql.SQL("CREATE TABLE {} ({})").format(table, sql.SQL(", ").join(parts)),
            # The extended protocol: one statement, never several.
            binary=True,
        )

    def _check_upsert_key(self) -> None:
        """An upsert's `key` must be one the sink enforces (a valid unique index or
        constraint on exactly those columns, without a predicate): checked before any row
        is copied, so the run fails at once, for good, naming the table and the key."""
        assert self.conn is not None
        key = list(self.spec["key"])
        row = self.conn.execute(SINK_KEY_SQL, [self.schema, self.name, key]).fetchone()
        if row is None or not row[0]:
            raise PermanentError(
                f"upsert: {self.schema}.{self.name} has no unique index or constraint on "
                f"({', '.join(key)}); create one, or let create: true make the table with "
                "key as its primary key"
            )

    def _prepare(self) -> None:
        """Begin the data transaction: create the table if asked, lock and clear for
        replace, stage for upsert."""
        assert self.conn is not None
        conn = self.conn
        table = _table_sql(self.schema, self.name)
        names = [c.name for c in self.source_columns]
        target = self._target_columns()
        if target is None:
            if not self.spec.get("create"):
                raise PermanentError(
                    f"sink table {self.schema}.{self.name} does not exist (set create: true "
                    "to create it)"
                )
            if not self.source_columns:
                raise PermanentError("cannot create the sink table: the source has no columns")
            key = self.spec.get("key")
            # Inside the data transaction: a failed load leaves no half-made table behind.
            # Two first runs may create it at once: the second waits on a transaction lock
            # for this table name until the first commits (or rolls back), then looks
            # again. A creator that does not take the lock makes the loser's CREATE fail
            # (duplicate table, duplicate type or a unique violation on the catalog) in a
            # savepoint; the loser then uses the winner's table.
            conn.execute(
                "SELECT pg_catalog.pg_advisory_xact_lock("
                "pg_catalog.hashtext(%s), pg_catalog.hashtext(%s))",
                [self.schema, self.name],
            )
            target = self._target_columns()
            if target is None:
                try:
                    with conn.transaction():
                        self._create_table(table, key)
                except (
                    psycopg.errors.UniqueViolation,
                    psycopg.errors.DuplicateTable,
                    psycopg.errors.DuplicateObject,
                ):
                    pass
                target = self._target_columns()
            assert target is not None
        if self.attempt_column:
            self._ensure_attempt_column(table, target)
        target = self._schema_policy(table, target)
        self._load = [n for n in names if n in target]
        ignored = [n for n in names if n not in target]
        self._via_stage = self.mode in KEYED_MODES or bool(ignored)
        if self.mode in KEYED_MODES:
            absent = [k for k in self.spec["key"] if k not in self._load]
            if absent:
                raise PermanentError(f"key column(s) {', '.join(absent)} not in the source")
            self._check_upsert_key()
        if self.deleted_column is not None and self.deleted_column not in self._load:
            raise PermanentError(
                f"deleted_column {self.deleted_column} is not a column of both the source "
                f"and {self.schema}.{self.name}"
            )
        # An ignored column has no sink type: it is staged as text, and never loaded.
        self._target_types = {n: target[n][0] if n in target else "text" for n in names}
        # Values bound for json/jsonb columns are serialised here: psycopg would dump a
        # Python list as a PostgreSQL array.
        self._convert = [
            _json_text if self._target_types[n] in ("json", "jsonb") else None for n in names
        ]
        if self.mode == "mirror":
            # Like replace: other writers wait until we commit, so the table ends up
            # holding exactly the source's rows; readers (ACCESS SHARE) never wait.
            conn.execute(sql.SQL("LOCK TABLE {} IN SHARE ROW EXCLUSIVE MODE").format(table))
        if self._via_stage:
            # The staging table has exactly the sink's column types (text for an ignored
            # column); it vanishes at commit.
            conn.execute(
                sql.SQL(
                    "CREATE TEMPORARY TABLE {} ON COMMIT DROP AS SELECT {} FROM {} WITH NO DATA"
                ).format(
                    sql.Identifier(STAGE),
                    sql.SQL(", ").join(
                        [
                            *map(sql.Identifier, self._load),
                            *(
                                sql.SQL("NULL::pg_catalog.text AS {}").format(sql.Identifier(n))
                                for n in ignored
                            ),
                        ]
                    ),
                    table,
                )
            )
        if self.staged:
            pass  # the rows go to the staging table; the last slice replaces the target
        elif self.mode == "replace" and self.spec.get("truncate"):
            # Asked for (docs/connectors.md): ACCESS EXCLUSIVE until COMMIT, so every
            # reader of the table waits for the whole load, and a REPEATABLE READ reader
            # whose snapshot predates the commit sees the table empty afterwards. In
            # exchange no old row is deleted one by one (nor left for vacuum), and the
            # COPY into a table truncated in its own transaction writes no WAL when
            # wal_level is minimal.
            conn.execute(sql.SQL("TRUNCATE {}").format(table))
        elif self.mode == "replace":
            # SHARE ROW EXCLUSIVE: other writers wait until we commit (so the table ends
            # up holding exactly the source's rows), readers (ACCESS SHARE) never wait.
            conn.execute(sql.SQL("LOCK TABLE {} IN SHARE ROW EXCLUSIVE MODE").format(table))
            # DELETE, not TRUNCATE or a table swap: both of those are not MVCC-safe (a
            # REPEATABLE READ reader whose snapshot predates our commit would see an empty
            # table) and both take ACCESS EXCLUSIVE. Readers see the old rows until COMMIT.
            conn.execute(sql.SQL("DELETE FROM {}").format(table))

    def _schema_policy(
        self, table: sql.Composed, target: dict[str, tuple[str, int]]
    ) -> dict[str, tuple[str, int]]:
        """Compare the source's columns with the sink table's and apply the spec's
        policies (schema_policy.py), in the data transaction: an added column or a widened
        type commits with the rows or not at all. ALTER TABLE takes ACCESS EXCLUSIVE on
        the table until COMMIT (every reader waits for the rest of the load), and waits at
        most `lock_timeout` for the readers already there. Returns the target's columns
        after the changes."""
        assert self.conn is not None
        conn = self.conn
        where = f"{self.schema}.{self.name}"
        names = {c.name for c in self.source_columns}
        new = [c for c in self.source_columns if c.name not in target]
        wider = [
            c
            for c in self.source_columns
            if c.name in target and c.type and is_wider(target[c.name][0], c.type)
        ]
        on_new, on_type = policy(self.spec, "on_new_column"), policy(self.spec, "on_type_change")
        if self.slice_of is not None and ((new and on_new != "fail") or wider):
            raise PermanentError(
                "a sliced run cannot change the sink table's columns (each slice commits on "
                f"its own): {where} differs from the source"
            )
        if new and on_new == "fail":
            raise PermanentError(
                f"sink table {where} has no column(s) {', '.join(c.name for c in new)} "
                "(on_new_column: add to add them, ignore to leave them out)"
            )
        for c in wider:
            if on_type != "widen":
                raise PermanentError(
                    f"column {c.name}: the source's type {c.type} does not fit the sink's "
                    f"{target[c.name][0]} (on_type_change: widen to alter the sink column)"
                )
        outside = [n for n in target if n not in names and n != ATTEMPT_COLUMN]
        if outside and policy(self.spec, "on_missing_column") == "fail":
            raise PermanentError(
                f"the source has no column(s) {', '.join(outside)} of sink table {where} "
                "(on_missing_column: null to leave them to their default)"
            )
        changes: list[Change] = []
        for c in wider:
            assert c.type is not None
            # Type text comes from the source server: one plain type name the sink knows.
            type_text = sqlsafety.check_type_name(conn, c.name, c.type)
            conn.execute(
                sql.SQL("ALTER TABLE {} ALTER COLUMN {} TYPE {}").format(
                    table,
                    sql.Identifier(c.name),
                    sql.SQL(type_text),  # type: ignore[arg-type]
                ),
                binary=True,  # the extended protocol: one statement, never several
            )
            changes.append(Change(c.name, "widened", type_text, target[c.name][0]))
        for c in new:
            if on_new == "ignore":
                changes.append(Change(c.name, "ignored", c.type))
                continue
            type_text = sqlsafety.check_type_name(conn, c.name, c.type) if c.type else "text"
            # IF NOT EXISTS: a writer of another binding that added it first (its lock
            # made us wait) leaves it to us as it made it.
            conn.execute(
                sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {}").format(
                    table,
                    sql.Identifier(c.name),
                    sql.SQL(type_text),  # type: ignore[arg-type]
                ),
                binary=True,
            )
            changes.append(Change(c.name, "added", type_text))
        if outside:
            previous = set(self._previous_columns())
            changes += [Change(n, "missing", target[n][0]) for n in outside if n in previous]
        self.schema_changes = [ch.as_json() for ch in changes]
        if any(ch.change in ("added", "widened") for ch in changes):
            found = self._target_columns()
            assert found is not None
            return found
        return target

    def _previous_columns(self) -> list[str]:
        """The columns the binding's latest delivery into this table wrote (its receipt),
        for telling a column the source dropped from one the sink alone has."""
        assert self.conn is not None
        row = self.conn.execute(
            sql.SQL(
                "SELECT columns FROM {} WHERE binding_id = %s AND table_name = %s"
                " ORDER BY committed_at DESC LIMIT 1"
            ).format(_table_sql(self.schema, RECEIPT_TABLE)),
            [self.ctx.fence.binding_id, f"{self.schema}.{self.name}"],
        ).fetchone()
        return list(row[0]) if row else []

    def _ensure_attempt_column(self, table: sql.Composed, target: dict[str, Any]) -> None:
        """`attempt_column: true`: the sink's `_dispatch_attempt` column (made if missing,
        in the data transaction), filled by its default from this transaction's setting."""
        assert self.conn is not None
        if ATTEMPT_COLUMN not in target:
            self.conn.execute(
                sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} uuid DEFAULT {}").format(
                    table,
                    sql.Identifier(ATTEMPT_COLUMN),
                    sql.SQL("NULLIF(pg_catalog.current_setting({}, true), '')::uuid").format(
                        sql.Literal(ATTEMPT_SETTING)
                    ),
                )
            )
        # Parameters, not text: a transaction-local setting the column's default reads.
        self.conn.execute(
            "SELECT pg_catalog.set_config(%s, %s, true)",
            [ATTEMPT_SETTING, str(self.ctx.fence.attempt_id)],
        )

    # -- copy ----------------------------------------------------------------------------
    def copy_format(self, columns: list[Column]) -> str | None:
        """The COPY format a PostgreSQL source should send: text when the receipt's digest
        is computed (its rows are hashed in their text form as they pass); otherwise
        binary when every column has the same exact type on both sides (binary data is
        type-specific), else text (the sink parses it, so compatible types such as
        integer -> bigint work)."""
        if self.already_committed:
            return None
        self._ready()
        if self.spec.get("receipt", False):
            self._copy_fmt = "text"
            self.digest = receipt.Digest()
        elif all(c.type and self._target_types.get(c.name) == c.type for c in columns):
            self._copy_fmt = "binary"
        else:
            self._copy_fmt = "text"
        return self._copy_fmt

    def use_copy_format(self, fmt: str) -> None:
        """The source sends `fmt` instead of the binary asked for (a reader that hashes
        columns sends text), which this sink reads as well."""
        self._copy_fmt = fmt

    def accept_copy(self, fmt: str, options: dict[str, Any]) -> bool:
        """Take a source's own COPY format as it is: CSV (a file) with its delimiter, null
        marker (None: none, every field is a string) and header line; the server parses
        it, in UTF-8."""
        if self.already_committed or fmt != "csv":
            return False
        self._ready()
        self._copy_fmt = "csv"
        self._copy_options = dict(options)
        return True

    def _copy_sql_options(self, fmt: str) -> sql.Composable:
        if fmt != "csv":
            return sql.SQL("BINARY" if fmt == "binary" else "TEXT")
        opts = self._copy_options
        parts = [
            sql.SQL("CSV, DELIMITER {}, HEADER {}, ENCODING 'UTF8'").format(
                sql.Literal(opts.get("delimiter", ",")),
                sql.SQL("true" if opts.get("header") else "false"),
            )
        ]
        if opts.get("null") is None:
            # No null marker: an unquoted empty field is an empty string, as on the rows path.
            parts.append(
                sql.SQL("FORCE_NOT_NULL ({})").format(
                    sql.SQL(", ").join(sql.Identifier(c.name) for c in self.source_columns)
                )
            )
        else:
            parts.append(sql.SQL("NULL {}").format(sql.Literal(opts["null"])))
        return sql.SQL(", ").join(parts)

    def _start_copy(self, fmt: str) -> Any:
        assert self.conn is not None
        if self._copy is not None:
            return self._copy
        target: sql.Composable
        if self._via_stage:
            target = sql.Identifier(STAGE)
        elif self.staged:
            assert self.slice_of is not None
            target = _table_sql(self.schema, staging_name(self.slice_of["parent"]))
        else:
            target = _table_sql(self.schema, self.name)
        stmt = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT {})").format(
            target,
            sql.SQL(", ").join(sql.Identifier(c.name) for c in self.source_columns),
            self._copy_sql_options(fmt),
        )
        self._copy_cursor = self.conn.cursor()
        self._copy_cm = self._copy_cursor.copy(stmt)
        self._copy = self._copy_cm.__enter__()
        self._copy_fmt = fmt
        return self._copy

    def write_copy(self, data: bytes, rows: int) -> int:
        if self.already_committed:
            return 0
        self._ready()
        with _errors(self.secrets, "sink write", self._canceller):
            self._start_copy(self._copy_fmt or "text")
            self._copy.write(data)
        if self.digest is not None and self._copy_fmt == "text":
            self.digest.add_text_block(data)
        self.rows += rows
        return rows

    def write(self, batch: Batch) -> int:
        if self.already_committed:
            return 0
        self._ready()
        with _errors(self.secrets, "sink write", self._canceller):
            # Text COPY: the server parses each value into the column's type, so rows from
            # any source (strings from a CSV, Python values from a generator) fit.
            copy = self._start_copy("text")
            convert = self._convert if any(self._convert) else None
            for row in batch:
                if convert is not None:
                    row = [f(v) if f else v for f, v in zip(convert, row, strict=False)]
                copy.write_row(row)
        self.rows += len(batch)
        return len(batch)

    def _end_copy(self) -> int | None:
        if self._copy_cm is None:
            return None
        cm, self._copy_cm, self._copy = self._copy_cm, None, None
        cm.__exit__(None, None, None)
        count = self._copy_cursor.rowcount
        return count if count is not None and count >= 0 else None

    def commit(self) -> WriteResult:
        if self.already_committed:
            return WriteResult(rows_written=0, already_committed=True)
        self._ready()
        assert self.conn is not None
        conn = self.conn
        fence = self.ctx.fence
        with _errors(self.secrets, "sink commit", self._canceller):
            copied = self._end_copy()
            if copied is not None:
                self.rows = copied  # the server's own count ("COPY n")
            if self.mode == "upsert" and self.rows:
                self._merge()
            elif self.mode == "mirror":
                self._mirror()
            elif self._via_stage and self.rows:
                self._insert_staged()
            if self._cursor_new is not None and self._cursor_read is not None:
                try:
                    self.cursor_committed = incremental.commit_cursor(
                        conn,
                        self.schema,
                        binding_id=fence.binding_id,
                        read=self._cursor_read,
                        columns=self._cursor_new[0],
                        cursor=self._cursor_new[1],
                        run_id=fence.run_id,
                        attempt_id=fence.attempt_id,
                    )
                except TransientError:
                    conn.rollback()
                    raise
            if self.staged:
                self._commit_slice()
            self._commit_receipt()
            # The fence, last: row-locked only from here to COMMIT (milliseconds). A newer
            # attempt that raised the token, or a commit that beat us, leaves no row.
            updated = conn.execute(
                sql.SQL(
                    "UPDATE {} SET attempt_id = %s, committed_at = pg_catalog.now()"
                    " WHERE run_id = %s AND token = %s AND committed_at IS NULL"
                ).format(self._fence_table),
                [fence.attempt_id, fence.run_id, fence.token],
            ).rowcount
            if updated != 1:
                conn.rollback()
                raise FenceRejected(
                    f"sink fence of run {fence.run_id} no longer at token {fence.token}: "
                    "a newer attempt started or the run's data is already committed"
                )
            # The fence stops a *newer* attempt's rival; an attempt that recovery or an
            # operator ended without a successor (FAILED, CANCELLED) raises no fence. So,
            # holding the fence row, re-check that the attempt is still ours (status +
            # token, and a heartbeat within the lease by our own clock) just before
            # COMMIT. What is left is the milliseconds between this check and COMMIT.
            try:
                fence.check()
            except LeaseLost as exc:
                conn.rollback()
                raise FenceRejected(f"attempt no longer this worker's at commit: {exc}") from None
            conn.commit()
        if self.swapped:
            self._drop_staging()
        return WriteResult(rows_written=self.rows)

    def _commit_receipt(self) -> None:
        """The delivery's receipt, in the data transaction before the fence: the rows
        committed and, when they streamed as text, their digest (dispatch/connectors/
        receipt.py). The digest's rows must be the server's: a difference is a fault of
        the copy, and fails it rather than commit a receipt that is wrong."""
        assert self.conn is not None
        fence = self.ctx.fence
        digest = None
        if self.digest is not None and self._copy_fmt == "text":
            if self.digest.rows != self.rows:
                self.conn.rollback()
                raise TransientError(
                    f"the receipt counted {self.digest.rows} rows, the sink {self.rows}"
                )
            digest = self.digest.hex()
        # The digest hashes the rows as they streamed: it is the sink's only when every
        # streamed column and row is loaded (no ignored column, no row marked deleted).
        if len(self._load) != len(self.source_columns) or self.deleted_column is not None:
            digest = None
        rows = self.rows - self._marked
        mode = self.mode
        if mode == "mirror" and self._cursor_read is not None:
            mode = "mirror incremental"  # not the whole table: not verifiable as one
        self.conn.execute(
            sql.SQL(
                "INSERT INTO {} (run_id, binding_id, attempt_id, parent_id, table_name, mode,"
                " columns, attempt_column, rows, digest, committed_at)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, pg_catalog.now())"
                " ON CONFLICT (run_id) DO UPDATE SET attempt_id = EXCLUDED.attempt_id,"
                " rows = EXCLUDED.rows, digest = EXCLUDED.digest, columns = EXCLUDED.columns,"
                " attempt_column = EXCLUDED.attempt_column,"
                " committed_at = EXCLUDED.committed_at"
            ).format(_table_sql(self.schema, RECEIPT_TABLE)),
            [
                fence.run_id,
                fence.binding_id,
                fence.attempt_id,
                self.slice_of["parent"] if self.slice_of is not None else None,
                f"{self.schema}.{self.name}",
                mode,
                self._load,
                self.attempt_column,
                rows,
                digest,
            ],
        )
        self.receipt_committed = (rows, digest)

    # -- slices ------------------------------------------------------------------------------
    def _prepare_slices(self) -> None:
        """Before a slice's data transaction, each in a short transaction of its own: a
        missing target made (`create`; an empty new table is no worse than none, and made
        inside the data transaction it would hold every other slice back until this one
        commits), and for `replace` the record of committed slices and the staging table
        (the target's columns, named from the sliced run)."""
        assert self.conn is not None and self.slice_of is not None
        conn = self.conn
        table = _table_sql(self.schema, self.name)
        target = self._target_columns()
        conn.commit()
        if target is None and self.spec.get("create") and self.source_columns:
            key = self.spec.get("key")
            with conn.transaction():
                conn.execute(
                    "SELECT pg_catalog.pg_advisory_xact_lock("
                    "pg_catalog.hashtext(%s), pg_catalog.hashtext(%s))",
                    [self.schema, self.name],
                )
                if self._target_columns() is None:
                    self._create_table(table, key)
            target = self._target_columns()
            conn.commit()
        if not self.staged or target is None:
            return  # a missing target is reported by _prepare
        sqlsafety.create_once(
            conn,
            SLICE_COMMIT_TABLE,
            self.schema,
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (parent_id uuid NOT NULL, number integer NOT NULL,"
                " run_id uuid NOT NULL, rows bigint NOT NULL, committed_at timestamptz NOT NULL,"
                " PRIMARY KEY (parent_id, number))"
            ).format(_table_sql(self.schema, SLICE_COMMIT_TABLE)),
        )
        stage = staging_name(self.slice_of["parent"])
        names = [c.name for c in self.source_columns if c.name in target]
        sqlsafety.create_once(
            conn,
            stage,
            self.schema,
            sql.SQL("CREATE TABLE IF NOT EXISTS {} AS SELECT {} FROM {} WITH NO DATA").format(
                _table_sql(self.schema, stage),
                sql.SQL(", ").join(map(sql.Identifier, names)),
                table,
            ),
        )

    def _commit_slice(self) -> None:
        """A staged `replace` slice, in its data transaction before the fence: record the
        slice as committed, and if every slice of the run now has, replace the target's
        rows with the staged ones. Slices of one run take a transaction lock on the run
        first, and count in a statement after it (READ COMMITTED: a fresh snapshot), so
        exactly the last one to commit sees them all. DELETE + INSERT, as the single
        `replace` does: readers see the old rows until this COMMIT, then all new ones."""
        assert self.conn is not None and self.slice_of is not None
        conn = self.conn
        parent = str(self.slice_of["parent"])
        records = _table_sql(self.schema, SLICE_COMMIT_TABLE)
        conn.execute(
            "SELECT pg_catalog.pg_advisory_xact_lock("
            "pg_catalog.hashtext(%s), pg_catalog.hashtext(%s))",
            [SLICE_COMMIT_TABLE, parent],
        )
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (parent_id, number, run_id, rows, committed_at)"
                " VALUES (%s, %s, %s, %s, pg_catalog.now())"
            ).format(records),
            [parent, int(self.slice_of["number"]), self.ctx.fence.run_id, self.rows],
        )
        row = conn.execute(
            sql.SQL("SELECT pg_catalog.count(*) FROM {} WHERE parent_id = %s").format(records),
            [parent],
        ).fetchone()
        if row is None or int(row[0]) < int(self.slice_of["total"]):
            return
        table = _table_sql(self.schema, self.name)
        stage = _table_sql(self.schema, staging_name(parent))
        cols = sql.SQL(", ").join(sql.Identifier(c.name) for c in self.source_columns)
        conn.execute(sql.SQL("LOCK TABLE {} IN SHARE ROW EXCLUSIVE MODE").format(table))
        conn.execute(sql.SQL("DELETE FROM {}").format(table))
        conn.execute(
            sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {}").format(table, cols, cols, stage)
        )
        # Emptied here; dropped after the commit (DROP takes an ACCESS EXCLUSIVE lock,
        # which a stale slice still copying into it would make this commit wait for).
        conn.execute(sql.SQL("DELETE FROM {}").format(stage))
        self.swapped = True

    def _drop_staging(self) -> None:
        """After the swap committed: drop the empty staging table and the run's records,
        best effort (a stale slice still holding the table makes the drop give up after a
        second; the table is empty and a later sliced run of another id never uses it)."""
        assert self.conn is not None and self.slice_of is not None
        conn = self.conn
        parent = str(self.slice_of["parent"])
        with contextlib.suppress(psycopg.Error), conn.transaction():
            conn.execute("SELECT pg_catalog.set_config('lock_timeout', '1s', true)")
            conn.execute(
                sql.SQL("DROP TABLE IF EXISTS {}").format(
                    _table_sql(self.schema, staging_name(parent))
                )
            )
            conn.execute(
                sql.SQL("DELETE FROM {} WHERE parent_id = %s").format(
                    _table_sql(self.schema, SLICE_COMMIT_TABLE)
                ),
                [parent],
            )

    def _insert_staged(self) -> None:
        """The staged rows into the target, less the ignored columns (append, replace)."""
        assert self.conn is not None
        cols = sql.SQL(", ").join(map(sql.Identifier, self._load))
        self.conn.execute(
            sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {}").format(
                _table_sql(self.schema, self.name), cols, cols, sql.Identifier(STAGE)
            )
        )

    def _deleted(self, alias: str) -> sql.Composable:
        """The condition of a staged row marked deleted (`deleted_column`): true for a
        boolean column, set (not NULL) for any other type."""
        assert self.deleted_column is not None
        column = sql.Identifier(alias, self.deleted_column)
        if self._target_types.get(self.deleted_column) == "boolean":
            return sql.SQL("{} IS TRUE").format(column)
        return sql.SQL("{} IS NOT NULL").format(column)

    def _mirror(self) -> None:
        """`mirror`, in the data transaction before the fence: the target becomes the
        source's snapshot. The staged rows (a temporary table on the sink's server, so the
        worker's memory stays flat whatever the row count) are upserted, less those marked
        deleted; then the target's rows whose key is not among the staged live rows are
        deleted (an anti-join). An incremental read holds only the rows that changed, so
        there only the rows marked deleted are deleted (hard deletes are invisible to a
        cursor). The table is locked SHARE ROW EXCLUSIVE since `_prepare`."""
        assert self.conn is not None
        conn = self.conn
        key = list(self.spec["key"])
        stage = sql.Identifier(STAGE)
        table = _table_sql(self.schema, self.name)
        # A NULL key matches nothing: its row would be inserted, then deleted as absent.
        null_key = conn.execute(
            sql.SQL("SELECT 1 FROM {} WHERE {} LIMIT 1").format(
                stage,
                sql.SQL(" OR ").join(sql.SQL("{} IS NULL").format(sql.Identifier(k)) for k in key),
            )
        ).fetchone()
        if null_key is not None:
            raise PermanentError(f"mirror: a source row has a NULL key ({', '.join(key)})")
        # Temporary tables are never analyzed by autovacuum: without statistics the
        # planner may pick a nested loop for the joins below.
        conn.execute(sql.SQL("ANALYZE {}").format(stage))
        match = sql.SQL(" AND ").join(
            sql.SQL("{} = {}").format(sql.Identifier("t", k), sql.Identifier("s", k)) for k in key
        )
        incremental_read = self._cursor_read is not None
        deleted = 0
        if self.deleted_column is not None:
            row = conn.execute(
                sql.SQL("SELECT pg_catalog.count(*) FROM {} AS s WHERE {}").format(
                    stage, self._deleted("s")
                )
            ).fetchone()
            self._marked = int(row[0]) if row else 0
        if self.deleted_column is not None and incremental_read:
            deleted += conn.execute(
                sql.SQL("DELETE FROM {} AS t USING {} AS s WHERE {} AND {}").format(
                    table, stage, match, self._deleted("s")
                )
            ).rowcount
        live = (
            sql.SQL("NOT ({})").format(self._deleted("s"))
            if self.deleted_column is not None
            else None
        )
        if self.rows:
            self._merge(live)
        if not incremental_read:
            deleted += conn.execute(
                sql.SQL(
                    "DELETE FROM {} AS t WHERE NOT EXISTS (SELECT FROM {} AS s WHERE {}{})"
                ).format(
                    table,
                    stage,
                    match,
                    sql.SQL(" AND {}").format(live) if live is not None else sql.SQL(""),
                )
            ).rowcount
        self.mirror_deleted = deleted

    def _merge(self, where: sql.Composable | None = None) -> None:
        assert self.conn is not None
        names = self._load
        key = list(self.spec["key"])
        others = [n for n in names if n not in key]
        action = (
            sql.SQL("DO UPDATE SET {}").format(
                sql.SQL(", ").join(
                    sql.SQL("{} = EXCLUDED.{}").format(sql.Identifier(n), sql.Identifier(n))
                    for n in others
                )
            )
            if others
            else sql.SQL("DO NOTHING")
        )
        cols = sql.SQL(", ").join(map(sql.Identifier, names))
        try:
            self.conn.execute(
                sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {} AS s{} ON CONFLICT ({}) {}").format(
                    _table_sql(self.schema, self.name),
                    cols,
                    cols,
                    sql.Identifier(STAGE),
                    sql.SQL(" WHERE {}").format(where) if where is not None else sql.SQL(""),
                    sql.SQL(", ").join(map(sql.Identifier, key)),
                    action,
                )
            )
        except psycopg.errors.CardinalityViolation:
            raise PermanentError(
                f"{self.mode}: the source holds the same key ({', '.join(key)}) more than once"
            ) from None
        except psycopg.errors.InvalidColumnReference:
            raise PermanentError(
                f"{self.mode}: {self.schema}.{self.name} has no unique index or constraint on "
                f"({', '.join(key)})"
            ) from None

    def close(self) -> None:
        if self.conn is None:
            return
        conn, self.conn = self.conn, None
        self._canceller.close(conn)


# Whether a table has a valid unique index (a constraint's included) on exactly the given
# columns, in any order and without a predicate: what ON CONFLICT (columns) infers.
SINK_KEY_SQL = (
    "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_index i"
    "  JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) i.indrelid"
    "  JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace"
    " WHERE n.nspname OPERATOR(pg_catalog.=) %s AND c.relname OPERATOR(pg_catalog.=) %s"
    "   AND i.indisunique AND i.indisvalid AND i.indpred IS NULL AND i.indexprs IS NULL"
    "   AND (SELECT pg_catalog.array_agg(a.attname::pg_catalog.text ORDER BY a.attname)"
    "          FROM pg_catalog.unnest(i.indkey::pg_catalog.int2[]) WITH ORDINALITY AS k(att, o)"
    "          JOIN pg_catalog.pg_attribute a ON a.attrelid OPERATOR(pg_catalog.=) c.oid"
    "           AND a.attnum OPERATOR(pg_catalog.=) k.att"
    "         WHERE k.o OPERATOR(pg_catalog.<=) i.indnkeyatts)"
    "       OPERATOR(pg_catalog.=) (SELECT pg_catalog.array_agg(x ORDER BY x)"
    "          FROM pg_catalog.unnest(%s::pg_catalog.text[]) AS x))"
)


def _unique_constraints(columns: list[Column]) -> list[list[str]]:
    """The source's unique constraints among the delivered columns (`Column.unique`), each
    as its column names in order."""
    groups: dict[int, list[tuple[int, str]]] = {}
    for c in columns:
        for number, place in c.unique:
            groups.setdefault(number, []).append((place, c.name))
    return [[name for _, name in sorted(groups[n])] for n in sorted(groups)]


def _json_text(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value)
