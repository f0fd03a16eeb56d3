"""The `mysql` sink: batched multi-row INSERTs into one InnoDB transaction that ends with
the sink-side fence (and an incremental read's cursor), as the `postgresql` sink does."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import pymysql

from dispatch.connectors import incremental
from dispatch.connectors.base import (
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
from dispatch.connectors.mysql import localinfile, types
from dispatch.connectors.mysql.connect import (
    Interrupter,
    _secrets,
    connect,
    errors,
    session,
)
from dispatch.connectors.mysql.spec import ident, parse_table, table_sql

# The server refuses LOAD DATA LOCAL INFILE: MySQL 8's `local_infile` is OFF by default
# (3948), MariaDB's can be turned off (4166), older servers' 1148.
LOCAL_INFILE_REFUSED = frozenset({1148, 3948, 4166})

# Rows per INSERT statement (pymysql's executemany joins them into one multi-row INSERT,
# cut below max_allowed_packet).
INSERT_ROWS = 1000

FENCE_DDL = (
    "CREATE TABLE IF NOT EXISTS {t} (run_id CHAR(36) NOT NULL PRIMARY KEY,"
    " binding_id CHAR(36), token BIGINT NOT NULL, attempt_id CHAR(36),"
    " committed_at DATETIME(6) NULL) ENGINE=InnoDB"
)
CURSOR_DDL = (
    "CREATE TABLE IF NOT EXISTS {t} (binding_id CHAR(36) NOT NULL PRIMARY KEY,"
    " columns LONGTEXT, cursor_value LONGTEXT, version BIGINT NOT NULL DEFAULT 0,"
    " run_id CHAR(36), attempt_id CHAR(36), committed_at DATETIME(6) NULL) ENGINE=InnoDB"
)


def _id(value: Any) -> str | None:
    return None if value is None else str(value)


class Writer:
    """One sink connection. The fence is raised in a short transaction of its own; the rows
    then go in one transaction (READ COMMITTED) that ends with the guarded fence update,
    the cursor's compare-and-set, `fence.check()` and COMMIT."""

    # JSON goes as text (a JSON column's value is checked as JSON text): a source that can
    # hand it as its text need not parse it (base.py).
    json_text = True

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
        self.source_columns = columns
        self.secrets = _secrets(config)
        self.mode = spec.get("mode", "append")
        self.conn: Any = None
        self.database = ""
        self.name = ""
        self.already_committed = False
        self.rows = 0
        self._prepared = False
        self._insert = ""
        self._load = ""
        # LOAD DATA LOCAL INFILE where it applies (the benchmark turns it off to compare).
        self.use_load = True
        self._checks: list[types.Convert] = []
        self._loaders: list[Callable[[Any], bytes]] = []
        self._interrupter = Interrupter(ctx, config)
        self._cursor_read: incremental.CommittedCursor | None = None
        self._cursor_new: tuple[tuple[str, ...], list[str] | None] | None = None
        self.cursor_committed: incremental.CommittedCursor | None = None

    @property
    def server_version(self) -> str | None:
        """The server's version, for the attempt's event log."""
        conn = getattr(self, "conn", None)
        return None if conn is None else str(conn.get_server_info())

    def _t(self, name: str) -> str:
        return table_sql(self.database, name)

    def _cur(self) -> Any:
        return self.conn.cursor(pymysql.cursors.Cursor)

    # -- set-up ----------------------------------------------------------------------------
    def open(self) -> None:
        self.conn = connect(self.config, what="sink connect", spec=self.spec, local_stream=True)
        note_event(self.ctx, "connected", "", side="sink", server_version=self.server_version)
        with errors(self.secrets, "sink"):
            info = session(self.conn, self.spec, read_only=False)
            self._interrupter.attach(info["thread_id"], self.conn)
            database, self.name = parse_table(self.spec["table"])
            if database is None:
                with self._cur() as cur:
                    cur.execute("SELECT DATABASE()")
                    row = cur.fetchone()
                if not row or not row[0]:
                    raise PermanentError(
                        "sink: no database: give the datasource's database or "
                        "table as database.name"
                    )
                database = str(row[0])
            self.database = database
            self._raise_fence()

    def _raise_fence(self) -> None:
        """Raise the run's fence to this attempt's token in a short transaction (the
        fence and cursor tables are made first: DDL commits on its own in MySQL)."""
        fence = self.ctx.fence
        with self._cur() as cur:
            cur.execute(FENCE_DDL.format(t=self._t("dispatch_fence")))
            cur.execute(CURSOR_DDL.format(t=self._t("dispatch_cursor")))
            self.conn.commit()
            cur.execute("START TRANSACTION")
            # A locking read sees the newest committed fence (and holds it to COMMIT); how
            # long it waited for a rival's commit goes to the attempt's event log.
            started = time.monotonic()
            cur.execute(
                f"SELECT token, committed_at FROM {self._t('dispatch_fence')}"  # noqa: S608
                " WHERE run_id = %s FOR UPDATE",
                [str(fence.run_id)],
            )
            row = cur.fetchone()
            note_event(
                self.ctx, "lock_wait", "the sink's fence row", seconds=time.monotonic() - started
            )
            if row is None:
                cur.execute(
                    f"INSERT INTO {self._t('dispatch_fence')} (run_id, binding_id, token)"  # noqa: S608
                    " VALUES (%s, %s, %s)",
                    [str(fence.run_id), _id(fence.binding_id), fence.token],
                )
            elif row[1] is not None:
                self.conn.rollback()
                self.already_committed = True
                return
            elif int(row[0]) > fence.token:
                self.conn.rollback()
                raise FenceRejected(
                    f"sink fence of run {fence.run_id} is at token {row[0]}, above this "
                    f"attempt's {fence.token}"
                )
            else:
                cur.execute(
                    f"UPDATE {self._t('dispatch_fence')} SET token = %s, binding_id = %s"  # noqa: S608
                    " WHERE run_id = %s",
                    [fence.token, _id(fence.binding_id), str(fence.run_id)],
                )
            self.conn.commit()
            note_event(self.ctx, "fence_raised", f"the sink's fence raised to token {fence.token}")

    def _target_columns(self) -> dict[str, str] | None:
        with self._cur() as cur:
            cur.execute(
                "SELECT COLUMN_NAME, COLUMN_TYPE, TABLE_TYPE FROM information_schema.COLUMNS"
                " JOIN information_schema.TABLES USING (TABLE_SCHEMA, TABLE_NAME)"
                " WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION",
                [self.database, self.name],
            )
            rows = cur.fetchall()
        if not rows:
            return None
        if rows[0][2] != "BASE TABLE":
            raise PermanentError(f"sink {self.database}.{self.name} is not a table")
        return {str(r[0]): str(r[1]) for r in rows}

    def _create_table(self) -> None:
        """`create: true`: the table with the source's columns, types mapped (types.py).
        DDL commits on its own in MySQL, so it is made before the data transaction (a
        failed load leaves it empty)."""
        key = self.spec.get("key") if self.mode == "upsert" else None
        cols = [f"{ident(c.name)} {types.mysql_type(c.type)}" for c in self.source_columns]
        if key:
            cols.append(f"PRIMARY KEY ({', '.join(ident(k) for k in key)})")
        with self._cur() as cur:
            cur.execute(
                f"CREATE TABLE IF NOT EXISTS {self._t(self.name)} ({', '.join(cols)})"
                " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
            )
        self.conn.commit()

    def _ready(self) -> None:
        if self._prepared or self.already_committed:
            return
        self._prepared = True
        with errors(self.secrets, "sink"):
            self._prepare()

    def _prepare(self) -> None:
        names = [c.name for c in self.source_columns]
        target = self._target_columns()
        if target is None:
            if not self.spec.get("create"):
                raise PermanentError(
                    f"sink table {self.database}.{self.name} does not exist (set create: true "
                    "to create it)"
                )
            if not self.source_columns:
                raise PermanentError("cannot create the sink table: the source has no columns")
            self._create_table()
            target = self._target_columns()
            assert target is not None
        missing = [n for n in names if n not in target]
        if missing:
            raise PermanentError(
                f"sink table {self.database}.{self.name} has no column(s) {', '.join(missing)}"
            )
        self._checks = [types.MySQLType(target[n]).check(n) for n in names]
        self._loaders = [types.loader(types.MySQLType(target[n]), n) for n in names]
        cols = ", ".join(ident(n) for n in names)
        marks = ", ".join(["%s"] * len(names))
        self._insert = f"INSERT INTO {self._t(self.name)} ({cols}) VALUES ({marks})"  # noqa: S608
        # append and replace load each batch with LOAD DATA LOCAL INFILE from the batch's
        # own bytes (2.3-2.9 x faster than the INSERTs: docs/benchmarks.md); upsert needs
        # ON DUPLICATE KEY UPDATE, which LOAD DATA has not, and BIT and spatial columns have
        # no text form it reads, so those go as INSERTs.
        bases = {types.MySQLType(target[n]).base for n in names}
        if self.use_load and self.mode != "upsert" and not bases & types.NO_LOAD:
            self._load = (
                f"LOAD DATA LOCAL INFILE '{localinfile.STREAM_NAME}' INTO TABLE"
                f" {self._t(self.name)} CHARACTER SET binary ({cols})"
            )
        if self.mode == "upsert":
            key = list(self.spec["key"])
            absent = [k for k in key if k not in names]
            if absent:
                raise PermanentError(f"key column(s) {', '.join(absent)} not in the source")
            self._check_unique(key)
            others = [n for n in names if n not in key]
            update = ", ".join(f"{ident(n)} = VALUES({ident(n)})" for n in others) or (
                f"{ident(key[0])} = {ident(key[0])}"
            )
            self._insert += f" ON DUPLICATE KEY UPDATE {update}"
        with self._cur() as cur:
            cur.execute("START TRANSACTION")
            if self.mode == "replace":
                # DELETE, not TRUNCATE (which commits at once in MySQL): readers keep the
                # old rows until this transaction commits, then see only the new ones.
                cur.execute(f"DELETE FROM {self._t(self.name)}")  # noqa: S608

    def _check_unique(self, key: list[str]) -> None:
        """ON DUPLICATE KEY UPDATE matches on any unique index: the sink must have one on
        exactly the key's columns (more unique indexes are documented as matching too)."""
        with self._cur() as cur:
            cur.execute(
                "SELECT INDEX_NAME, GROUP_CONCAT(COLUMN_NAME ORDER BY SEQ_IN_INDEX SEPARATOR 0x00)"
                " FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s"
                " AND NON_UNIQUE = 0 GROUP BY INDEX_NAME",
                [self.database, self.name],
            )
            uniques = [set(str(r[1]).split("\x00")) for r in cur.fetchall()]
        if set(key) not in uniques:
            raise PermanentError(
                f"upsert: {self.database}.{self.name} has no primary key or unique index on "
                f"exactly ({', '.join(key)})"
            )

    # -- incremental ------------------------------------------------------------------------
    def cursor_state(self, inc: incremental.IncrementalSpec) -> incremental.CommittedCursor:
        self._ready()
        if self.mode == "replace":
            raise PermanentError(
                "incremental reads need an append or upsert sink: replace would keep only "
                "the latest increment"
            )
        if inc.lookback_seconds is not None and self.mode != "upsert":
            raise PermanentError(
                "incremental.lookback_seconds re-reads rows, so it needs an upsert sink"
            )
        binding = self.ctx.fence.binding_id
        with errors(self.secrets, "sink cursor"), self._cur() as cur:
            cur.execute(
                "SELECT columns, cursor_value, version, run_id, attempt_id, committed_at"
                f" FROM {self._t('dispatch_cursor')} WHERE binding_id = %s",  # noqa: S608
                [str(binding)],
            )
            row = cur.fetchone()
        self._cursor_read = _committed(binding, row)
        return self._cursor_read

    def stage_cursor(self, columns: tuple[str, ...], cursor: list[str] | None) -> None:
        self._cursor_new = (columns, cursor)

    def _commit_cursor(self, cur: Any) -> None:
        assert self._cursor_new is not None and self._cursor_read is not None
        fence = self.ctx.fence
        columns, cursor = self._cursor_new
        read = self._cursor_read
        values = [json.dumps(list(columns)), None if cursor is None else json.dumps(cursor)]
        ids = [str(fence.run_id), str(fence.attempt_id)]
        table = self._t("dispatch_cursor")
        if read.version == 0:
            cur.execute(
                f"INSERT IGNORE INTO {table} (binding_id, columns, cursor_value, version,"  # noqa: S608
                " run_id, attempt_id, committed_at) VALUES (%s, %s, %s, 1, %s, %s, NOW(6))",
                [str(fence.binding_id), *values, *ids],
            )
        else:
            cur.execute(
                f"UPDATE {table} SET columns = %s, cursor_value = %s, version = version + 1,"  # noqa: S608
                " run_id = %s, attempt_id = %s, committed_at = NOW(6)"
                " WHERE binding_id = %s AND version = %s",
                [*values, *ids, str(fence.binding_id), read.version],
            )
        if cur.rowcount != 1:
            self.conn.rollback()
            raise TransientError(
                "the binding's committed cursor moved while this attempt ran (a concurrent "
                "run or an operator's reset); the retry starts from the new cursor"
            )
        self.cursor_committed = incremental.CommittedCursor(
            fence.binding_id, tuple(columns), cursor, read.version + 1, fence.run_id,
            fence.attempt_id,
        )  # fmt: skip

    # -- rows -------------------------------------------------------------------------------
    def write(self, batch: Batch) -> int:
        if self.already_committed:
            return 0
        self._ready()
        # Every value checked against its column before it is sent: one that does not fit
        # fails the run with the column named, and nothing of the transaction commits. A
        # loaded batch is checked and made LOAD DATA's text in one pass per value.
        with errors(self.secrets, "sink write"), self._cur() as cur:
            if self._load:
                data = types.load_rows(self._loaders, batch)
                try:
                    loaded = self.conn.load(cur, self._load, data)
                except pymysql.MySQLError as exc:
                    if not exc.args or exc.args[0] not in LOCAL_INFILE_REFUSED:
                        raise
                    # Refused before any row is read (the statement fails alone, the
                    # transaction goes on): this batch and the next ones go as INSERTs.
                    self._load = ""
                else:
                    if loaded != len(batch):
                        raise PermanentError(
                            f"sink write: LOAD DATA took {loaded} of {len(batch)} rows"
                        )
            if not self._load:
                checks = self._checks
                rows = [[f(v) for f, v in zip(checks, row, strict=True)] for row in batch]
                for i in range(0, len(rows), INSERT_ROWS):
                    cur.executemany(self._insert, rows[i : i + INSERT_ROWS])
        self.rows += len(batch)
        return len(batch)

    def commit(self) -> WriteResult:
        if self.already_committed:
            return WriteResult(rows_written=0, already_committed=True)
        self._ready()
        fence = self.ctx.fence
        with errors(self.secrets, "sink commit"), self._cur() as cur:
            if self._cursor_new is not None and self._cursor_read is not None:
                self._commit_cursor(cur)
            # The fence, last: row-locked from here to COMMIT. A newer attempt that raised
            # the token, or a commit that beat us, leaves no row to update.
            cur.execute(
                f"UPDATE {self._t('dispatch_fence')} SET attempt_id = %s,"  # noqa: S608
                " committed_at = NOW(6) WHERE run_id = %s AND token = %s"
                " AND committed_at IS NULL",
                [str(fence.attempt_id), str(fence.run_id), fence.token],
            )
            if cur.rowcount != 1:
                self.conn.rollback()
                raise FenceRejected(
                    f"sink fence of run {fence.run_id} no longer at token {fence.token}: "
                    "a newer attempt started or the run's data is already committed"
                )
            try:
                fence.check()
            except LeaseLost as exc:
                self.conn.rollback()
                raise FenceRejected(f"attempt no longer this worker's at commit: {exc}") from None
            self.conn.commit()
        return WriteResult(rows_written=self.rows)

    def close(self) -> None:
        self._interrupter.close()
        if self.conn is not None:
            conn, self.conn = self.conn, None
            try:
                conn.rollback()
                conn.close()
            except (pymysql.Error, OSError):
                conn._force_close()


def _committed(binding: Any, row: Any) -> incremental.CommittedCursor:
    if row is None:
        return incremental.CommittedCursor(binding, None, None, 0)
    columns = tuple(json.loads(row[0])) if row[0] else None
    cursor = json.loads(row[1]) if row[1] else None
    return incremental.CommittedCursor(
        binding,
        columns,
        cursor,
        int(row[2]),
        uuid.UUID(row[3]) if row[3] else None,
        uuid.UUID(row[4]) if row[4] else None,
        row[5],
    )


def set_committed(
    conn: Any,
    database: str,
    binding_id: uuid.UUID,
    *,
    columns: tuple[str, ...] | None,
    cursor: list[str] | None,
    after_version: int = 0,
) -> incremental.CommittedCursor:
    """An operator's reset or set of the committed cursor (incremental.set_committed's
    MySQL twin): the version moves above both the sink's and `after_version`."""
    table = table_sql(database, "dispatch_cursor")
    with conn.cursor(pymysql.cursors.Cursor) as cur:
        cur.execute(CURSOR_DDL.format(t=table))
        conn.commit()
        cur.execute(
            f"INSERT INTO {table} (binding_id, columns, cursor_value, version, committed_at)"  # noqa: S608
            " VALUES (%s, %s, %s, %s + 1, NOW(6)) ON DUPLICATE KEY UPDATE"
            " columns = VALUES(columns), cursor_value = VALUES(cursor_value),"
            " version = GREATEST(version + 1, VALUES(version)), run_id = NULL,"
            " attempt_id = NULL, committed_at = NOW(6)",
            [
                str(binding_id),
                json.dumps(list(columns)) if columns is not None else None,
                json.dumps(cursor) if cursor is not None else None,
                after_version,
            ],
        )
        cur.execute(
            "SELECT columns, cursor_value, version, run_id, attempt_id, committed_at"
            f" FROM {table} WHERE binding_id = %s",  # noqa: S608
            [str(binding_id)],
        )
        row = cur.fetchone()
    conn.commit()
    return _committed(binding_id, row)
