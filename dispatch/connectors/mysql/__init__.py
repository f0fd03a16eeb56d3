"""The `mysql` kind (MySQL 8, MariaDB 10.6+): a source read from one consistent, read-only
snapshot with an unbuffered cursor, and a sink written with batched INSERTs in one InnoDB
transaction that ends with the sink-side fence. Driver: PyMySQL (docs/dependencies.md).

See docs/connectors.md ("mysql") for the spec fields, the type mapping and the choices.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ValidationError

from dispatch.connectors import incremental
from dispatch.connectors.base import (
    Column,
    ConfigField,
    Connector,
    SpecField,
    TransferContext,
    check_unknown,
    require_object,
    server_config,
)
from dispatch.connectors.mysql.spec import (
    DEFAULT_LOCK_TIMEOUT_SECONDS,
    DEFAULT_STATEMENT_TIMEOUT_SECONDS,
    TLS_MODES,
    parse_table,
    policy_errors,
    strip_query,
    timeouts,
)

# The same modes as the `postgresql` sink, with the same meanings.
from dispatch.connectors.postgresql.writer import SINK_MODES

if TYPE_CHECKING:
    from dispatch.connectors.mysql.reader import Reader
    from dispatch.connectors.mysql.writer import Writer

__all__ = ["MySQLConnector", "Reader", "Writer"]


def __getattr__(name: str) -> Any:
    # The driver's modules load on first use (a connection, `Reader`, `Writer`), not when
    # the registry lists the kind: a worker that never moves MySQL data never imports
    # PyMySQL.
    if name == "Reader":
        from dispatch.connectors.mysql.reader import Reader

        return Reader
    if name == "Writer":
        from dispatch.connectors.mysql.writer import Writer

        return Writer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class MySQLConnector(Connector):
    kind = "mysql"
    label = "MySQL / MariaDB"
    roles = frozenset({"source", "sink"})
    config_fields = (
        ConfigField(
            "host",
            required=True,
            destination=True,
            help="Host name or address (or an allowed Unix-socket path).",
        ),
        ConfigField("port", kind=int, destination=True, help="Port, default 3306."),
        ConfigField(
            "database",
            destination=True,
            help="Default database (tables without a database. prefix are in it).",
        ),
        ConfigField("user", required=True, destination=True, help="User to connect as."),
        ConfigField("password", secret=True, help="The user's password."),
        ConfigField(
            "tls",
            destination=True,
            choices=TLS_MODES,
            help="preferred (default: TLS when the server offers it, unverified), required "
            "(unverified), verify_identity (the system's CAs and the host name), disabled.",
        ),
    )
    source_fields = (
        SpecField("table", "name or database.name to read (or query)"),
        SpecField(
            "query",
            "one SELECT to read instead of a table (needs the write_source_query permission "
            "and a user with SELECT only)",
        ),
        SpecField(
            "incremental",
            "read only the rows past the committed cursor: an object with "
            + ", ".join(sorted(incremental.SPEC_FIELDS))
            + " (cursor required: a list of columns)",
        ),
        SpecField(
            "statement_timeout_seconds",
            f"bound on each statement (default {DEFAULT_STATEMENT_TIMEOUT_SECONDS})",
        ),
        SpecField(
            "lock_timeout_seconds",
            f"bound on each lock wait (default {DEFAULT_LOCK_TIMEOUT_SECONDS})",
        ),
    )
    sink_fields = (
        SpecField("table", "name or database.name to write (required)"),
        SpecField("mode", f"{', '.join(SINK_MODES)} (default {SINK_MODES[0]})"),
        SpecField("key", "the key columns of upsert, a list (a primary key or unique index)"),
        SpecField("create", "true: create a missing table with the source's columns"),
        SpecField(
            "statement_timeout_seconds",
            f"bound on each statement (default {DEFAULT_STATEMENT_TIMEOUT_SECONDS})",
        ),
        SpecField(
            "lock_timeout_seconds",
            f"bound on each lock wait (default {DEFAULT_LOCK_TIMEOUT_SECONDS})",
        ),
    )

    @classmethod
    def validate_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        config, errors_ = server_config(cls, config, policy=policy_errors)
        if errors_:
            raise ValidationError(errors_)
        return config

    @classmethod
    def validate_source_spec(cls, spec: dict[str, Any]) -> dict[str, Any]:
        spec = require_object(spec, "source_spec")
        check_unknown(spec, cls.spec_field_names("source"))
        if bool(spec.get("table")) == bool(spec.get("query")):
            raise ValidationError("give exactly one of table or query")
        if spec.get("table"):
            parse_table(spec["table"])
        else:
            query = spec["query"]
            if not isinstance(query, str) or not strip_query(query):
                raise ValidationError("query: must be a non-empty SQL query text")
            if ";" in strip_query(query):
                raise ValidationError("query: must be one statement (no ';')")
        incremental.validate(spec)
        timeouts(spec)
        return spec

    @classmethod
    def validate_sink_spec(cls, spec: dict[str, Any]) -> dict[str, Any]:
        spec = require_object(spec, "sink_spec")
        check_unknown(spec, cls.spec_field_names("sink"))
        if not spec.get("table"):
            raise ValidationError("table: this field is required")
        parse_table(spec["table"])
        mode = spec.get("mode", "append")
        if mode not in SINK_MODES:
            raise ValidationError(f"mode: must be one of {', '.join(SINK_MODES)}")
        key = spec.get("key")
        if mode == "upsert":
            if (
                not isinstance(key, list)
                or not key
                or not all(isinstance(k, str) and k and "`" not in k for k in key)
            ):
                raise ValidationError("key: upsert needs a non-empty list of column names")
        elif key is not None:
            raise ValidationError("key: only used with mode upsert")
        if not isinstance(spec.get("create", False), bool):
            raise ValidationError("create: must be true or false")
        timeouts(spec)
        return spec

    @classmethod
    def test_connection(cls, config: dict[str, Any]) -> None:
        from dispatch.connectors.mysql.connect import _secrets, connect, errors

        conn = connect(config, what="test connection")
        try:
            with errors(_secrets(config), "test connection"), conn.cursor() as cur:
                cur.execute("SELECT 1")
        finally:
            conn.close()

    @classmethod
    def set_cursor(
        cls,
        config: dict[str, Any],
        spec: dict[str, Any],
        binding_id: uuid.UUID,
        columns: tuple[str, ...],
        cursor: list[str] | None,
        *,
        after_version: int = 0,
    ) -> incremental.CommittedCursor:
        from dispatch.connectors.mysql.connect import _secrets, connect, errors, session
        from dispatch.connectors.mysql.writer import set_committed

        conn = connect(config, what="sink connect")
        try:
            with errors(_secrets(config), "sink cursor"):
                session(conn, spec, read_only=False)
                database, _name = parse_table(spec["table"])
                if database is None:
                    with conn.cursor() as cur:
                        cur.execute("SELECT DATABASE()")
                        database = str(cur.fetchone()[0])
                return set_committed(
                    conn,
                    database,
                    binding_id,
                    columns=columns,
                    cursor=cursor,
                    after_version=after_version,
                )
        finally:
            conn.close()

    @classmethod
    @contextlib.contextmanager
    def open_reader(
        cls, config: dict[str, Any], spec: dict[str, Any], ctx: TransferContext
    ) -> Iterator[Any]:
        from dispatch.connectors.mysql.reader import Reader

        reader = Reader(config, spec, ctx)
        try:
            reader.open()
            yield reader
        finally:
            reader.close()

    @classmethod
    @contextlib.contextmanager
    def open_writer(
        cls,
        config: dict[str, Any],
        spec: dict[str, Any],
        ctx: TransferContext,
        columns: list[Column],
    ) -> Iterator[Any]:
        from dispatch.connectors.mysql.writer import Writer

        writer = Writer(config, spec, ctx, columns)
        try:
            writer.open()
            yield writer
        finally:
            writer.close()
