"""Shared pieces for the connector tests: scratch databases on the test server, a
transfer context, and a transfer driven the way the runner drives it."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
from django.db import connection

from dispatch.connectors import incremental
from dispatch.connectors.base import (
    Column,
    Connector,
    LeaseLost,
    PermanentError,
    SimpleReader,
    Stopped,
    TransferContext,
    WriteResult,
    check_unknown,
    require_object,
)
from dispatch.worker.runner import Runner


def server_config(dbname: str, **extra: Any) -> dict[str, Any]:
    """A `postgresql` datasource config for `dbname` on the test database's server."""
    s = connection.settings_dict
    config: dict[str, Any] = {
        "host": s["HOST"] or "127.0.0.1",
        "port": int(s["PORT"] or 5432),
        "dbname": dbname,
        "user": s["USER"],
    }
    if s.get("PASSWORD"):
        config["password"] = s["PASSWORD"]
    config.update(extra)
    return config


def connect(dbname: str, *, autocommit: bool = True) -> psycopg.Connection[Any]:
    c = server_config(dbname)
    return psycopg.connect(
        host=c["host"],
        port=c["port"],
        dbname=dbname,
        user=c["user"],
        password=c.get("password"),
        autocommit=autocommit,
    )


def no_commit_wait(name: str) -> None:
    """Sessions of database `name` commit without waiting for the WAL flush
    (`synchronous_commit = off`): what a commit makes visible, and when, is unchanged; only
    a crash of the server itself could lose the last commits, and no test crashes the
    shared server. Most of the suite's transactions write, and on a busy disk each flush
    costs milliseconds."""
    admin = connect("postgres")
    try:
        admin.execute(
            psycopg.sql.SQL("ALTER DATABASE {} SET synchronous_commit = off").format(
                psycopg.sql.Identifier(name)
            )
        )
    finally:
        admin.close()


def recreate_database(name: str) -> None:
    admin = connect("postgres")
    try:
        admin.execute(
            psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                psycopg.sql.Identifier(name)
            )
        )
        admin.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
    finally:
        admin.close()
    no_commit_wait(name)


# Whatever CREATE DATABASE (from template1) makes, beyond the public schema, that a reset
# would have to undo: when a test left any of these, the database is dropped and made again.
_RESET_OBSTACLES = """
SELECT (SELECT count(*) FROM pg_extension WHERE extname <> 'plpgsql')
     + (SELECT count(*) FROM pg_event_trigger)
     + (SELECT count(*) FROM pg_publication)
     + (SELECT count(*) FROM pg_largeobject_metadata)
     + (SELECT count(*) FROM pg_foreign_server)
     + (SELECT count(*) FROM pg_foreign_data_wrapper)
     + (SELECT count(*) FROM pg_default_acl)
     + (SELECT count(*) FROM pg_prepared_xacts)
     + (SELECT count(*) FROM pg_database
        WHERE datname = current_database()
          AND (datacl IS NOT NULL OR datdba <> (SELECT datdba FROM pg_database
                                                WHERE datname = 'template1')))
"""

# Scratch databases made in this session. A test asking for a name made before gets that
# database emptied (`reset_database`), not dropped and made again: a DROP DATABASE makes the
# server checkpoint at once (every dirty buffer of every database written and synced),
# seconds on a busy disk, hundreds of times a suite. All are dropped at the session's end
# (`drop_scratch_databases`, from tests/conftest.py).
_scratch: set[str] = set()


def end_sessions(name: str) -> None:
    """Terminate every session on database `name` (a test's leftovers: a killed worker's,
    a lock holder's) and wait until they are gone."""
    admin = connect("postgres")
    try:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = %s AND pid <> pg_backend_pid()",
            [name],
        )
        deadline = time.monotonic() + 30
        while admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", [name]
        ).fetchone() != (0,):
            if time.monotonic() > deadline:
                raise AssertionError(f"sessions on {name} outlived their termination")
            time.sleep(0.02)
    finally:
        admin.close()


def reset_database(name: str) -> None:
    """Scratch database `name` as CREATE DATABASE made it: no session on it (a killed
    worker's is terminated), no database or per-role setting, no schema but an empty
    `public` as template1 has it (owner, privileges, comment), fresh statistics. Anything
    else a test may have added (see _RESET_OBSTACLES) makes it drop and create instead."""
    end_sessions(name)
    admin = connect("postgres")
    try:
        db = psycopg.sql.Identifier(name)
        admin.execute(psycopg.sql.SQL("ALTER DATABASE {} RESET ALL").format(db))
        roles = admin.execute(
            "SELECT r.rolname FROM pg_db_role_setting s JOIN pg_roles r ON r.oid = s.setrole"
            " JOIN pg_database d ON d.oid = s.setdatabase WHERE d.datname = %s",
            [name],
        ).fetchall()
        for (role,) in roles:
            admin.execute(
                psycopg.sql.SQL("ALTER ROLE {} IN DATABASE {} RESET ALL").format(
                    psycopg.sql.Identifier(role), db
                )
            )
    finally:
        admin.close()
    no_commit_wait(name)
    with connect(name) as conn:
        if conn.execute(_RESET_OBSTACLES).fetchone() != (0,):
            conn.close()
            recreate_database(name)
            return
        schemas = [
            psycopg.sql.Identifier(row[0])
            for row in conn.execute(
                "SELECT nspname FROM pg_namespace"
                " WHERE nspname !~ '^pg_' AND nspname <> 'information_schema'"
            )
        ]
        with conn.transaction():
            if schemas:
                conn.execute(
                    psycopg.sql.SQL("DROP SCHEMA {} CASCADE").format(
                        psycopg.sql.SQL(", ").join(schemas)
                    )
                )
            conn.execute("CREATE SCHEMA public AUTHORIZATION pg_database_owner")
            conn.execute("GRANT USAGE ON SCHEMA public TO PUBLIC")
            conn.execute("COMMENT ON SCHEMA public IS 'standard public schema'")
        conn.execute("SELECT pg_stat_reset()")


def drop_scratch_databases() -> None:
    """The end of the session: every scratch database it made, dropped."""
    while _scratch:
        drop_database(_scratch.pop())


def drop_database(name: str) -> None:
    admin = connect("postgres")
    try:
        admin.execute(
            psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                psycopg.sql.Identifier(name)
            )
        )
    finally:
        admin.close()


@dataclass
class ScratchDB:
    name: str

    @property
    def config(self) -> dict[str, Any]:
        return server_config(self.name)

    def execute(self, query: Any, params: Any = None) -> list[tuple[Any, ...]]:
        with connect(self.name) as conn:
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description else []


def scratch_db(name: str) -> Iterator[ScratchDB]:
    """A fresh database for one test (the body of a fixture): made, or emptied if this
    session made it before (`reset_database`); its sessions are ended afterwards. Its name
    carries the test database's, so two checkouts testing on one server never share it."""
    name = f"{name}_{connection.settings_dict['NAME']}"[:63]
    if name in _scratch:
        reset_database(name)
    else:
        recreate_database(name)
        _scratch.add(name)
    yield ScratchDB(name)
    end_sessions(name)


@dataclass
class Fence:
    run_id: uuid.UUID = field(default_factory=uuid.uuid4)
    binding_id: uuid.UUID = field(default_factory=uuid.uuid4)
    attempt_id: uuid.UUID = field(default_factory=uuid.uuid4)
    token: int = 1
    lost: bool = False
    checks: int = 0

    def check(self) -> None:
        self.checks += 1
        if self.lost:
            raise LeaseLost("the attempt is no longer this worker's")


@dataclass
class Ctx:
    """A TransferContext for driving connectors directly (the runner's own is tied to a
    claimed attempt)."""

    fence: Fence = field(default_factory=Fence)
    rows_read: int = 0
    rows_written: int = 0
    stop: bool = False
    interrupts: list[Callable[[], None]] = field(default_factory=list)
    estimates: list[int] = field(default_factory=list)
    # The binding's key for a source's `columns.hash` (the runner's context carries it).
    hash_key: bytes | None = None

    def progress(self, *, rows_read: int = 0, rows_written: int = 0) -> None:
        self.rows_read += rows_read
        self.rows_written += rows_written
        if self.stop:
            raise Stopped("stop")

    def estimate(self, rows: int) -> None:
        self.estimates.append(rows)

    def should_stop(self) -> bool:
        return self.stop

    def on_stop(self, interrupt: Callable[[], None]) -> Callable[[], None]:
        self.interrupts.append(interrupt)
        return lambda: self.interrupts.remove(interrupt)

    def wait(self, seconds: float) -> None:
        if self.stop:
            raise Stopped("stop")


def run_transfer(
    source: Any,
    source_config: dict[str, Any],
    source_spec: dict[str, Any],
    sink: Any,
    sink_config: dict[str, Any],
    sink_spec: dict[str, Any],
    ctx: Ctx | None = None,
    *,
    rows_only: bool = False,
) -> WriteResult:
    """Open, transfer and commit as the runner does (its own transfer loop), or force the
    decoded-rows path with `rows_only`."""
    ctx = ctx or Ctx()
    source.validate_source_spec(source_spec)
    sink.validate_sink_spec(sink_spec)
    with source.open_reader(source_config, source_spec, ctx) as reader:
        columns: list[Column] = reader.columns
        with sink.open_writer(sink_config, sink_spec, ctx, columns) as writer:
            incremental.prepare(reader, writer)
            if rows_only:
                if not getattr(writer, "already_committed", False):
                    for batch in reader.batches():
                        ctx.progress(rows_read=len(batch), rows_written=writer.write(batch))
            else:
                Runner._transfer(ctx, reader, writer)  # type: ignore[arg-type]
            return writer.commit()


class FailingSource(Connector):
    """A source (kind `test_failing`, for worker subprocesses: DISPATCH_CONNECTORS=
    tests.support.connectors.FailingSource) that reads `rows` rows of the `expect` it
    announces, waits `wait` seconds, then fails for good with `error` (which may span
    lines)."""

    kind = "test_failing"
    roles = frozenset({"source"})

    @classmethod
    def validate_source_spec(cls, spec: dict[str, Any]) -> dict[str, Any]:
        spec = require_object(spec, "source_spec")
        check_unknown(spec, {"rows", "expect", "wait", "error"})
        return spec

    @classmethod
    @contextlib.contextmanager
    def open_reader(
        cls, config: dict[str, Any], spec: dict[str, Any], ctx: TransferContext
    ) -> Iterator[Any]:
        def batches() -> Iterator[list[Any]]:
            ctx.estimate(int(spec.get("expect", 0)))
            yield [(i,) for i in range(int(spec.get("rows", 0)))]
            ctx.wait(float(spec.get("wait", 0)))
            raise PermanentError(str(spec.get("error", "failed")))

        yield SimpleReader([Column("n", "integer")], batches())
