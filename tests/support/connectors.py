"""Shared pieces for the connector tests: scratch databases on the test server, a
transfer context, and a transfer driven the way the runner drives it."""

from __future__ import annotations

import contextlib
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
    """A fresh database for one test (the body of a fixture), dropped afterwards. Its name
    carries the test database's, so two checkouts testing on one server never share it."""
    name = f"{name}_{connection.settings_dict['NAME']}"[:63]
    recreate_database(name)
    yield ScratchDB(name)
    drop_database(name)


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
