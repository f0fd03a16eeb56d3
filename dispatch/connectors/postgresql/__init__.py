"""The `postgresql` kind: a source read with COPY in one REPEATABLE READ snapshot, and a
sink written with COPY in one transaction that ends with the sink-side fence.

See docs/connectors.md for the spec fields, the fencing protocol and the choices made
(why `replace` deletes inside the load transaction instead of swapping tables).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
from django.core.exceptions import ValidationError
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from dispatch.connectors import columns, incremental
from dispatch.connectors.base import (
    Column,
    ConfigField,
    Connector,
    PermanentError,
    SpecField,
    TransferContext,
    check_unknown,
    require_object,
    server_config,
)
from dispatch.connectors.postgresql import schema_policy, slices
from dispatch.connectors.postgresql.cancel import _Canceller
from dispatch.connectors.postgresql.connect import (
    AUTH_METHODS,
    DEFAULT_LOCK_TIMEOUT_SECONDS,
    DEFAULT_STATEMENT_TIMEOUT_SECONDS,
    URL_EXCLUSIVE,
    _errors,
    _secrets,
    _set_timeouts,
    _table_sql,
    _timeouts,
    classify,
    connect,
    parse_table,
    policy_errors,
)
from dispatch.connectors.postgresql.reader import _Reader, _strip_query
from dispatch.connectors.postgresql.writer import KEYED_MODES, SINK_KEY_SQL, SINK_MODES, _Writer
from dispatch.core.conf import SSLMODES

__all__ = [
    "PostgreSQLConnector",
    "_Canceller",
    "_Reader",
    "_Writer",
    "classify",
    "connect",
    "parse_table",
    "policy_errors",
]


def _own_config_errors(config: dict[str, Any], errors: dict[str, list[str]]) -> None:
    """A URL, or a host and a database; never both a URL and the separate fields."""
    if config.get("url"):
        url = str(config["url"])
        if not url.startswith(("postgres://", "postgresql://")):
            errors["url"] = ["must start with postgresql:// or postgres://"]
        else:
            try:
                conninfo_to_dict(url)
            except psycopg.ProgrammingError:
                errors["url"] = ["is not a valid PostgreSQL URL"]
        mixed = [k for k in URL_EXCLUSIVE if config.get(k) not in (None, "")]
        if mixed:
            errors.setdefault("url", []).append(
                f"give either url or the separate fields, not both ({', '.join(mixed)} set as well)"
            )
    elif not config.get("host"):
        errors["host"] = ["this field is required (or give url)"]
    if not config.get("url") and not config.get("dbname"):
        errors["dbname"] = ["this field is required (or give url)"]


class PostgreSQLConnector(Connector):
    kind = "postgresql"
    label = "PostgreSQL"
    roles = frozenset({"source", "sink"})
    # Its writer commits each slice of a sliced run on its own, fenced by the slice's run
    # (and stages `replace` until the last slice): docs/connectors.md, "Slices".
    sliced_writes = True
    # The writer connects and raises its fence without the source's columns, and reads
    # them at its first use: the runner opens it while the source is opened (base.py).
    open_before_columns = True
    config_fields = (
        ConfigField("host", destination=True, help="Host name or address (or use url)."),
        ConfigField("port", kind=int, destination=True, help="Port, default 5432."),
        ConfigField("dbname", destination=True, help="Database name."),
        ConfigField("user", destination=True, help="Role to connect as."),
        ConfigField("password", secret=True, help="The role's password."),
        ConfigField(
            "sslmode",
            destination=True,
            choices=SSLMODES,
            help="libpq's sslmode; empty: prefer (TLS if the server offers it, unverified).",
        ),
        ConfigField(
            "require_auth",
            destination=True,
            help="Authentication methods the connection accepts (libpq's require_auth), "
            "e.g. scram-sha-256. Default with a password: !password (never sent in clear).",
        ),
        ConfigField(
            "url",
            secret=True,
            help="postgresql://user:password@host:port/dbname — instead of the fields above, "
            "never together with them.",
        ),
    )
    source_fields = (
        SpecField("table", "name or schema.name to read (or query)"),
        SpecField(
            "query",
            "one SQL query to read instead of a table (needs the write_source_query permission)",
        ),
        SpecField(
            "incremental",
            "read only the rows past the committed cursor: an object with "
            + ", ".join(sorted(incremental.SPEC_FIELDS))
            + " (cursor required: a list of columns)",
        ),
        SpecField(
            "columns",
            "table sources: {select: [...]} or {exclude: [...]}, rename: {source: sink}, "
            "hash: [...] (a keyed HMAC-SHA256 of the value's text, hex, delivered as text; "
            "the key is the binding's hash key); names only, checked against the table",
        ),
        SpecField(
            "slices",
            "split each run into slices copied in parallel: {key: column, count: N} or "
            "{key: column, rows_per_slice: M}, on an integer, timestamp or uuid column "
            "(table sources only)",
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
        SpecField("table", "name or schema.name to write (required)"),
        SpecField("mode", f"{', '.join(SINK_MODES)} (default {SINK_MODES[0]})"),
        SpecField(
            "key",
            "the key columns of upsert and mirror, a list (the sink must enforce it: a unique "
            "index or constraint on exactly them); with create, the created table's primary "
            "key (instead of the source's)",
        ),
        SpecField(
            "deleted_column",
            "mirror only: a source column marking a row deleted (true, or any non-NULL "
            "value of a non-boolean column); such rows are deleted from the sink",
        ),
        SpecField(
            "on_new_column",
            "a source column the sink table lacks: fail (default), add (ALTER TABLE ADD "
            "COLUMN in the data transaction), ignore (leave it out)",
        ),
        SpecField(
            "on_missing_column",
            "a sink column the source lacks: null (default: it takes its default), fail",
        ),
        SpecField(
            "on_type_change",
            "a source column wider than the sink's (varchar(10) -> varchar(20), integer -> "
            "bigint): fail (default), widen (ALTER COLUMN TYPE in the data transaction)",
        ),
        SpecField(
            "create",
            "true: create a missing table like the source's: columns with their exact "
            "types, NOT NULLs and (except in append) primary key",
        ),
        SpecField(
            "create_unique",
            "with create, true: the created table also gets the source table's unique "
            "constraints (those whose every column is delivered)",
        ),
        SpecField(
            "truncate",
            "replace only, true: TRUNCATE instead of DELETE (faster; readers wait for the "
            "whole load, and an older snapshot sees the table empty)",
        ),
        SpecField(
            "receipt",
            "true: the delivery's receipt also carries a digest of its rows, hashed as "
            "they stream in text COPY (costs about a fifth of the copy's speed); false "
            "(default): the receipt holds the row count only, and a PostgreSQL source may "
            "send binary COPY",
        ),
        SpecField(
            "attempt_column",
            "true: a _dispatch_attempt uuid column (added if missing) names the attempt "
            "that wrote each row, so an append's receipt can be verified",
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

    @classmethod
    def validate_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        # The declared fields' checks (types, sslmode's choices), `_own_config_errors`, the
        # port's and the target policy are reported together (base.server_config).
        config, errors = server_config(
            cls,
            config,
            own=_own_config_errors,
            policy=policy_errors,
            policy_field="url" if isinstance(config, dict) and config.get("url") else "host",
        )
        if config.get("require_auth"):
            methods = [m.strip() for m in str(config["require_auth"]).split(",")]
            negated = {m.startswith("!") for m in methods}
            names = {m.lstrip("!") for m in methods}
            if len(negated) != 1 or not names <= AUTH_METHODS:
                errors["require_auth"] = [
                    f"must be a comma-separated list of {', '.join(sorted(AUTH_METHODS))}, "
                    "all or none of them negated with !"
                ]
        if errors:
            raise ValidationError(errors)
        return config

    @classmethod
    def validate_source_spec(cls, spec: dict[str, Any]) -> dict[str, Any]:
        spec = require_object(spec, "source_spec")
        check_unknown(spec, cls.spec_field_names("source"))
        has_table, has_query = bool(spec.get("table")), bool(spec.get("query"))
        if has_table == has_query:
            raise ValidationError("give exactly one of table or query")
        if has_table:
            parse_table(spec["table"])
        else:
            query = spec["query"]
            if not isinstance(query, str) or not _strip_query(query):
                raise ValidationError("query: must be a non-empty SQL query text")
            if ";" in _strip_query(query):
                raise ValidationError("query: must be one statement (no ';')")
        incremental.validate(spec)
        slices.validate(spec)
        columns.validate(spec)
        _timeouts(spec)
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
        if mode in KEYED_MODES:
            if (
                not isinstance(key, list)
                or not key
                or not all(isinstance(k, str) and k for k in key)
            ):
                raise ValidationError(f"key: {mode} needs a non-empty list of column names")
        elif key is not None:
            if not spec.get("create"):
                raise ValidationError(
                    "key: only used with mode upsert or mirror, or with create (the created "
                    "table's primary key)"
                )
            if (
                not isinstance(key, list)
                or not key
                or not all(isinstance(k, str) and k for k in key)
            ):
                raise ValidationError("key: must be a non-empty list of column names")
        if isinstance(key, list) and len(set(key)) != len(key):
            raise ValidationError("key: a column is named more than once")
        deleted = spec.get("deleted_column")
        if deleted is not None:
            if mode != "mirror":
                raise ValidationError("deleted_column: only used with mode mirror")
            if not isinstance(deleted, str) or not deleted:
                raise ValidationError("deleted_column: must be a column name")
            if deleted in (key or []):
                raise ValidationError("deleted_column: must not be a key column")
        schema_policy.validate(spec)
        if not isinstance(spec.get("create", False), bool):
            raise ValidationError("create: must be true or false")
        if not isinstance(spec.get("create_unique", False), bool):
            raise ValidationError("create_unique: must be true or false")
        if spec.get("create_unique") and not spec.get("create"):
            raise ValidationError("create_unique: only used with create")
        if not isinstance(spec.get("truncate", False), bool):
            raise ValidationError("truncate: must be true or false")
        if spec.get("truncate") and mode != "replace":
            raise ValidationError("truncate: only used with mode replace")
        for flag in ("receipt", "attempt_column"):
            if not isinstance(spec.get(flag, False), bool):
                raise ValidationError(f"{flag}: must be true or false")
        _timeouts(spec)
        return spec

    @classmethod
    def sink_spec_errors_with_source(
        cls, sink_spec: dict[str, Any], source_spec: dict[str, Any]
    ) -> list[str]:
        errors: list[str] = []
        mode = sink_spec.get("mode", "append")
        if source_spec.get("slices") is not None:
            if mode == "mirror":
                errors.append(
                    "mode: mirror cannot take a sliced source (each slice commits on its "
                    "own, and none sees the whole snapshot to delete the rest)"
                )
            errors += [
                f"{p} cannot take a sliced source (each slice commits on its own): leave "
                "the sink table's columns as they are"
                for p in schema_policy.sliced_refusals(sink_spec)
            ]
        if (
            source_spec.get("incremental") is not None
            and mode == "mirror"
            and not sink_spec.get("deleted_column")
        ):
            errors.append(
                "deleted_column: mirror with incremental reads needs it (a cursor sees only "
                "the rows that changed: a row deleted from the source is invisible to it)"
            )
        return errors

    @classmethod
    def test_connection(cls, config: dict[str, Any]) -> None:
        conn = connect(config, what="test connection")
        try:
            with _errors(_secrets(config), "test connection"):
                conn.execute("SELECT 1")
        finally:
            conn.close()

    @classmethod
    def cursor_index_needed(cls, config: dict[str, Any], spec: dict[str, Any]) -> str | None:
        """For an incremental read of a table: the `CREATE INDEX` its cursor needs, or None
        when the table has one (or the read is not of a table). Connects to the source
        (a ConnectorError when it cannot)."""
        reader = _Reader(config, spec, None)
        try:
            reader.open()
            return reader.index_needed
        finally:
            reader.close()

    @classmethod
    def columns_problem(cls, config: dict[str, Any], spec: dict[str, Any]) -> str | None:
        """For a table source with `columns`: what the table lacks of it, or None. Opens
        the reader as a run does (its open checks the names against the table);
        connecting may fail (a ConnectorError)."""
        if columns.parse(spec) is None:
            return None
        reader = _Reader(config, spec, None)
        try:
            reader.open()
        except PermanentError as exc:
            if str(exc).startswith("columns"):
                return str(exc)
            raise
        finally:
            reader.close()
        return None

    @classmethod
    def sink_key_problem(cls, config: dict[str, Any], spec: dict[str, Any]) -> str | None:
        """For an upsert: None when the sink table enforces `key` (or is missing and
        `create` will make it with key as its primary key), else what is wrong.
        Connecting may fail (a ConnectorError)."""
        if spec.get("mode") != "upsert" or not spec.get("key"):
            return None
        conn = connect(config, what="sink connect")
        try:
            with _errors(_secrets(config), "sink"):
                _set_timeouts(conn, spec)
                schema, name = parse_table(spec["table"])
                if not schema:
                    row = conn.execute("SELECT pg_catalog.current_schema()").fetchone()
                    schema = row[0] if row else "public"
                exists = conn.execute(
                    "SELECT pg_catalog.to_regclass(%s) IS NOT NULL",
                    [str(sql.Identifier(schema, name).as_string(conn))],
                ).fetchone()
                if not (exists and exists[0]):
                    if spec.get("create"):
                        return None
                    return f"sink table {schema}.{name} does not exist (set create: true)"
                row = conn.execute(SINK_KEY_SQL, [schema, name, list(spec["key"])]).fetchone()
                if row is None or not row[0]:
                    return (
                        f"upsert: {schema}.{name} has no unique index or constraint on "
                        f"({', '.join(spec['key'])}); every run will fail until it has one"
                    )
                return None
        finally:
            conn.close()

    @classmethod
    @contextlib.contextmanager
    def open_reader(
        cls, config: dict[str, Any], spec: dict[str, Any], ctx: TransferContext
    ) -> Iterator[Any]:
        reader = _Reader(config, spec, ctx)
        try:
            reader.open()
            yield reader
        finally:
            reader.close()

    @classmethod
    def plan_slices(
        cls, config: dict[str, Any], spec: dict[str, Any], ctx: TransferContext
    ) -> slices.Plan:
        """The ranges of a sliced run (`slices.plan`), on a connection of its own in one
        read-only transaction; the run's slices then read one range each."""
        sliced = slices.parse(spec)
        assert sliced is not None
        secrets = _secrets(config)
        canceller = _Canceller(ctx, config, "source")
        conn = connect(config, what="source connect")
        canceller.attach(conn)
        try:
            with _errors(secrets, "source slices", canceller):
                canceller.watch(_set_timeouts(conn, spec))
                conn.read_only = True
                schema, name = parse_table(spec["table"])
                relation = _table_sql(schema, name) if schema else sql.Identifier(name)
                return slices.plan(conn, str(spec["table"]), relation, sliced)
        finally:
            canceller.close(conn)

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
        """An operator's reset (None) or set of a binding's committed cursor, in the sink
        database beside the fence (`incremental.set_committed`)."""
        secrets = _secrets(config)
        conn = connect(config, what="sink connect")
        try:
            with _errors(secrets, "sink cursor"):
                _set_timeouts(conn, spec)
                schema, _name = parse_table(spec["table"])
                if not schema:
                    row = conn.execute("SELECT pg_catalog.current_schema()").fetchone()
                    schema = row[0] if row else "public"
                conn.commit()
                return incremental.set_committed(
                    conn,
                    schema,
                    binding_id,
                    columns=columns,
                    cursor=cursor,
                    after_version=after_version,
                )
        finally:
            conn.close()

    @classmethod
    @contextlib.contextmanager
    def open_writer(
        cls,
        config: dict[str, Any],
        spec: dict[str, Any],
        ctx: TransferContext,
        columns: list[Column],
    ) -> Iterator[Any]:
        writer = _Writer(config, spec, ctx, columns)
        try:
            writer.open()
            yield writer
        finally:
            writer.close()
