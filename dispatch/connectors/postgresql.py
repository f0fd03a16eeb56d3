"""The `postgresql` kind: a source read with COPY in one REPEATABLE READ snapshot, and a
sink written with COPY in one transaction that ends with the sink-side fence.

See docs/connectors.md for the spec fields, the fencing protocol and the choices made
(why `replace` deletes inside the load transaction instead of swapping tables).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import select
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
from django.core.exceptions import ValidationError
from psycopg import pq, sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from dispatch import conf, deadline
from dispatch.connectors import incremental, sqlsafety
from dispatch.connectors.base import (
    Batch,
    Column,
    ConfigField,
    Connector,
    ConnectorError,
    FenceRejected,
    LeaseLost,
    PermanentError,
    Stopped,
    TransferContext,
    TransientError,
    WriteResult,
    check_unknown,
    int_field,
    require_object,
)
from dispatch.security import limits, targets

SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
SINK_MODES = ("append", "replace", "upsert")
# Rows per batch on the decoded (row by row) path.
BATCH_ROWS = 5000
# The COPY fast path hands the sink blocks of about this size: large enough that the
# per-block Python work vanishes, small enough that memory stays flat.
COPY_BLOCK_BYTES = 1 << 20
CONNECT_TIMEOUT_SECONDS = 10
DEFAULT_STATEMENT_TIMEOUT_SECONDS = 3600
DEFAULT_LOCK_TIMEOUT_SECONDS = 10
# How long a cancel request may take to reach the server (it runs on the worker's
# heartbeat thread, which must not hang on an unreachable host).
CANCEL_TIMEOUT_SECONDS = 5.0

log = logging.getLogger("dispatch.connectors")

# SQLSTATE classes (first two characters) and codes whose retry cannot help.
_PERMANENT_CLASSES = {"28", "3D", "3F", "42", "22", "23", "0A", "2B", "44"}
_PERMANENT_CODES = {"25006", "21000", "42P10"}  # read-only txn, cardinality, no ON CONFLICT index
# Everything else is transient: connection exceptions (08), serialization failures and
# deadlocks (40), resources (53), lock_timeout (55P03), statement_timeout and admin
# shutdown (57), system errors (58).
# libpq reports connection-time failures without a SQLSTATE; these texts mean a retry
# would meet the same refusal.
_PERMANENT_CONNECT = re.compile(
    r"password authentication failed|authentication failed|no pg_hba\.conf entry|"
    r"no password supplied|"
    r"database \"[^\"]*\" does not exist|role \"[^\"]*\" does not exist|"
    r"invalid sslmode|certificate verify failed|server does not support SSL|"
    r"invalid connection option|invalid URI|missing \"=\"",
    re.IGNORECASE,
)


# --- table names ----------------------------------------------------------------------------
def parse_table(value: Any, field: str = "table") -> tuple[str | None, str]:
    """`name` or `schema.name` -> (schema or None, name). Each part becomes an Identifier."""
    if not isinstance(value, str) or not value.strip():
        raise ValidationError(f"{field}: must be a table name, 'name' or 'schema.name'")
    parts = value.strip().split(".")
    if len(parts) > 2 or any(not p.strip() for p in parts):
        raise ValidationError(
            f"{field}: {value!r} is not 'name' or 'schema.name' (exactly one optional dot, "
            "no empty parts)"
        )
    if any('"' in p or "\x00" in p for p in parts):
        raise ValidationError(f"{field}: write names without quotes; each part is quoted for you")
    if len(parts) == 1:
        return None, parts[0].strip()
    return parts[0].strip(), parts[1].strip()


def _table_sql(schema: str, name: str) -> sql.Composed:
    return sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(name))


# --- errors ---------------------------------------------------------------------------------
def _scrub(text: str, secrets: list[str]) -> str:
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, "********")
    # Any URL with credentials that reached an error text.
    return re.sub(r"(?i)\b(postgres(?:ql)?://)[^/\s@]*@", r"\1********@", text)


def classify(exc: BaseException, secrets: list[str], what: str) -> ConnectorError:
    """Map a psycopg error to a permanent or transient ConnectorError without secrets."""
    if isinstance(exc, ConnectorError):
        return exc
    message = _scrub(" ".join(str(exc).split()), secrets)[:2000]
    text = f"{what}: {message}" if message else f"{what}: {type(exc).__name__}"
    state = getattr(exc, "sqlstate", None)
    if state:
        if state in _PERMANENT_CODES or state[:2] in _PERMANENT_CLASSES:
            return PermanentError(f"{text} (SQLSTATE {state})")
        return TransientError(f"{text} (SQLSTATE {state})")
    if isinstance(exc, psycopg.OperationalError) and _PERMANENT_CONNECT.search(str(exc)):
        return PermanentError(text)
    if isinstance(exc, psycopg.ProgrammingError | psycopg.DataError | psycopg.NotSupportedError):
        return PermanentError(text)
    return TransientError(text)


@contextlib.contextmanager
def _errors(secrets: list[str], what: str, watch: _Canceller | None = None) -> Iterator[None]:
    if watch is not None:
        watch.enter()
    try:
        yield
    except psycopg.Error as exc:
        if watch is not None and watch.dropped:
            # The connection was dropped on purpose: say why, not what the socket said.
            raise TransientError(f"{what}: {watch.dropped}") from None
        raise classify(exc, secrets, what) from None
    except deadline.DeadlineExceeded as exc:  # the session's set-up got no answer in time
        raise TransientError(f"{what}: {exc}") from None
    finally:
        if watch is not None:
            watch.leave()


# --- connections ----------------------------------------------------------------------------
def _secrets(config: dict[str, Any]) -> list[str]:
    values = [str(config[k]) for k in ("password", "url") if config.get(k)]
    if config.get("url"):
        with contextlib.suppress(Exception):
            password = conninfo_to_dict(config["url"]).get("password")
            if password:
                values.append(str(password))
    return values


# The fields a URL replaces: a config has either a URL or these, never both (a URL to one
# server with a host field to another would send the URL's password to the host).
URL_EXCLUSIVE = ("host", "port", "dbname", "user", "password", "sslmode")
AUTH_METHODS = {"password", "md5", "gss", "sspi", "scram-sha-256", "oauth", "none"}
# libpq learned require_auth in version 16.
REQUIRE_AUTH_LIBPQ = 160000


def _has_password(config: dict[str, Any]) -> bool:
    if config.get("password"):
        return True
    if config.get("url"):
        with contextlib.suppress(Exception):
            return bool(conninfo_to_dict(config["url"]).get("password"))
    return False


def _require_auth(config: dict[str, Any]) -> str | None:
    """The require_auth to connect with: the configured one, or `!password` (the password
    never goes out in clear text) when a password is configured; None where libpq is too
    old to know the option."""
    if psycopg.pq.version() < REQUIRE_AUTH_LIBPQ:
        return None
    if config.get("require_auth"):
        return str(config["require_auth"])
    return "!password" if _has_password(config) else None


def _conninfo(config: dict[str, Any]) -> str:
    params = {
        k: config[k]
        for k in ("host", "port", "dbname", "user", "password", "sslmode")
        if config.get(k) not in (None, "")
    }
    require_auth = _require_auth(config)
    if require_auth:
        params["require_auth"] = require_auth
    if psycopg.pq.version() >= REQUIRE_AUTH_LIBPQ:
        # The worker's own client certificate is never offered to a datasource's server.
        params["sslcertmode"] = "disable"
    return make_conninfo(
        config.get("url") or "",
        connect_timeout=CONNECT_TIMEOUT_SECONDS,
        application_name="dispatch",
        # Never the worker's ~/.pgpass: a datasource gets only the password it was given.
        # (a path that cannot exist: libpq skips a missing file silently).
        passfile=NO_PASSFILE,
        **params,
    )


NO_PASSFILE = os.path.join(os.devnull, "no-passfile")


def _target_params(config: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    if config.get("url"):
        try:
            return dict(conninfo_to_dict(str(config["url"]))), True
        except psycopg.ProgrammingError:
            return {}, True
    return {k: v for k, v in config.items() if v not in (None, "")}, False


def _same_as_site_settings(params: dict[str, Any]) -> bool:
    """The static half of the site-database check: the same dbname, port and (loopback
    or literal) host as the site's own DATABASES entry."""
    from django.db import connection as site

    s = site.settings_dict
    loopback = {"", "localhost", "127.0.0.1", "::1"}

    def host(value: Any) -> str:
        text = str(value or "").lower()
        return "localhost" if text in loopback else text

    return (
        str(params.get("dbname") or "") == str(s.get("NAME") or "")
        and str(params.get("port") or 5432) == str(s.get("PORT") or 5432)
        and host(params.get("host")) == host(s.get("HOST"))
    )


def policy_errors(config: dict[str, Any]) -> list[str]:
    params, from_url = _target_params(config)
    problems = targets.conninfo_refusals(params, from_url=from_url)
    if not targets.site_database_allowed() and _same_as_site_settings(params):
        problems.append(SITE_DATABASE_REFUSED)
    return problems


SITE_DATABASE_REFUSED = (
    "this is the site's own database; a datasource may not read or write it "
    "(DISPATCH_ALLOW_SITE_DATABASE)"
)


def connect(config: dict[str, Any], *, what: str = "connect") -> psycopg.Connection[Any]:
    secrets = _secrets(config)
    problems = policy_errors(config)
    if problems:
        raise PermanentError(f"{what}: refused by the site's target policy: {'; '.join(problems)}")
    # The session's set-up is bounded like the connecting (a server that accepted the
    # connection and then went silent must not hold the worker here).
    with _errors(secrets, what):
        conn = psycopg.connect(_conninfo(config))
        try:
            with deadline.guarded(conn, what, CONNECT_TIMEOUT_SECONDS):
                sqlsafety.set_safe_search_path(conn)
        except BaseException:
            conn.close()
            raise
    if not targets.site_database_allowed():
        try:
            with _errors(secrets, what), deadline.guarded(conn, what, CONNECT_TIMEOUT_SECONDS):
                row = conn.execute(targets.SITE_FINGERPRINT_SQL).fetchone()
                conn.rollback()
            if row is not None and tuple(str(v) for v in row) == targets.site_fingerprint():
                raise PermanentError(
                    f"{what}: refused by the site's target policy: {SITE_DATABASE_REFUSED}"
                )
        except BaseException:
            conn.close()
            raise
    return conn


def _set_timeouts(conn: psycopg.Connection[Any], spec: dict[str, Any]) -> int | None:
    """Bound every statement and lock wait of this session, so a hung query cannot hold
    a lease (or a lock on someone else's table) forever. Returns the session's server
    process id, or None behind a pooler (whose process id is its own)."""
    statement = int(spec.get("statement_timeout_seconds", DEFAULT_STATEMENT_TIMEOUT_SECONDS))
    lock = int(spec.get("lock_timeout_seconds", DEFAULT_LOCK_TIMEOUT_SECONDS))
    row = conn.execute(
        "SELECT pg_catalog.pg_backend_pid(),"
        " set_config('statement_timeout', %s, false), set_config('lock_timeout', %s, false),"
        " set_config('idle_in_transaction_session_timeout', %s, false),"
        # Fixed output formats: the text COPY data of one session is read by another.
        " set_config('DateStyle', 'ISO, MDY', false), set_config('IntervalStyle', 'postgres', false),"
        " set_config('extra_float_digits', '3', false), set_config('bytea_output', 'hex', false)",
        [f"{statement}s", f"{lock}s", f"{statement}s"],
    ).fetchone()
    conn.commit()
    pid = int(row[0]) if row else None
    return pid if pid == conn.info.backend_pid else None


def _timeouts(spec: dict[str, Any]) -> None:
    for name, maximum in (
        ("statement_timeout_seconds", limits.MAX_STATEMENT_TIMEOUT_SECONDS),
        ("lock_timeout_seconds", limits.MAX_LOCK_TIMEOUT_SECONDS),
    ):
        int_field(spec, name, default=None, minimum=1, maximum=maximum)


# --- the connector --------------------------------------------------------------------------
class PostgreSQLConnector(Connector):
    kind = "postgresql"
    label = "PostgreSQL"
    roles = frozenset({"source", "sink"})
    config_fields = (
        ConfigField("host", destination=True, help="Host name or address (or use url)."),
        ConfigField("port", kind=int, destination=True, help="Port, default 5432."),
        ConfigField("dbname", destination=True, help="Database name."),
        ConfigField("user", destination=True, help="Role to connect as."),
        ConfigField("password", secret=True, help="The role's password."),
        ConfigField(
            "sslmode",
            destination=True,
            help="disable, allow, prefer, require, verify-ca or verify-full.",
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
    SOURCE_FIELDS = {
        "table",
        "query",
        "incremental",
        "statement_timeout_seconds",
        "lock_timeout_seconds",
    }
    SINK_FIELDS = {
        "table",
        "mode",
        "key",
        "create",
        "statement_timeout_seconds",
        "lock_timeout_seconds",
    }

    @classmethod
    def validate_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = super().validate_config(config)
        errors: dict[str, list[str]] = {}
        if config.get("url"):
            url = str(config["url"])
            if not url.startswith(("postgres://", "postgresql://")):
                errors["url"] = ["must start with postgresql:// or postgres://"]
            else:
                try:
                    conninfo_to_dict(url)
                except psycopg.ProgrammingError:
                    errors["url"] = ["is not a valid PostgreSQL URL"]
        elif not config.get("host"):
            errors["host"] = ["this field is required (or give url)"]
        if not config.get("url") and not config.get("dbname"):
            errors["dbname"] = ["this field is required (or give url)"]
        port = config.get("port")
        if isinstance(port, int) and not 0 < port < 65536:
            errors["port"] = ["must be between 1 and 65535"]
        if config.get("sslmode") and config["sslmode"] not in SSLMODES:
            errors["sslmode"] = [f"must be one of {', '.join(SSLMODES)}"]
        if config.get("url"):
            mixed = [k for k in URL_EXCLUSIVE if config.get(k) not in (None, "")]
            if mixed:
                errors.setdefault("url", []).append(
                    f"give either url or the separate fields, not both ({', '.join(mixed)} "
                    "set as well)"
                )
        if not errors:
            problems = policy_errors(config)
            if problems:
                errors["url" if config.get("url") else "host"] = problems
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
        check_unknown(spec, cls.SOURCE_FIELDS)
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
        _timeouts(spec)
        return spec

    @classmethod
    def validate_sink_spec(cls, spec: dict[str, Any]) -> dict[str, Any]:
        spec = require_object(spec, "sink_spec")
        check_unknown(spec, cls.SINK_FIELDS)
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
                or not all(isinstance(k, str) and k for k in key)
            ):
                raise ValidationError("key: upsert needs a non-empty list of column names")
        elif key is not None:
            raise ValidationError("key: only used with mode upsert")
        if not isinstance(spec.get("create", False), bool):
            raise ValidationError("create: must be true or false")
        _timeouts(spec)
        return spec

    @classmethod
    def test_connection(cls, config: dict[str, Any]) -> None:
        conn = connect(config, what="test connection")
        try:
            with _errors(_secrets(config), "test connection"):
                conn.execute("SELECT 1")
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
    def set_cursor(
        cls,
        config: dict[str, Any],
        spec: dict[str, Any],
        binding_id: uuid.UUID,
        columns: tuple[str, ...],
        cursor: list[str] | None,
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
                    conn, schema, binding_id, columns=columns, cursor=cursor
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


def _check_least_privilege(conn: psycopg.Connection[Any]) -> None:
    """A `query` source runs arbitrary SQL: refuse a role that can do more than read
    tables (docs/security.md, "Source queries")."""
    row = conn.execute(targets.PRIVILEGED_ROLE_SQL, [list(targets.PRIVILEGED_ROLES)]).fetchone()
    conn.commit()
    if row is None:
        return
    role, powers = row[0], [p for p in row[1] or [] if p]
    if powers:
        raise PermanentError(
            f"source: the role {role!r} has {', '.join(powers)}; a query source needs a "
            "least-privilege role (SELECT on its tables only; DISPATCH_QUERY_SOURCE_LEAST_PRIVILEGE)"
        )


def _strip_query(query: str) -> str:
    return query.strip().rstrip(";").strip()


class _Canceller:
    """Cancels the statement (or COPY) running on a connector's connection when the
    execution is told to stop: a timeout, an operator's cancel, a lost lease, a release;
    and watches the connection while it waits on its server.

    Stopping works when the server does not answer too: a cancel request that gets no
    answer, or a statement still running CANCEL_TIMEOUT_SECONDS after the first
    interrupt, shuts the connection's socket down (the blocked call fails at once and the
    server rolls the transaction back when it notices).

    A wait on a server that stopped answering without closing the connection (a silent
    partition, a hung middlebox) is found by asking the server, on a connection of its
    own, what the session is doing (`DISPATCH_CONNECTOR_PROBE_SECONDS`): no answer twice
    in a row, the session gone, or the session idle twice in a row while the client waits
    for an answer (one lost on the way) drops the connection, and the attempt fails as a
    transient error naming why. A statement the server reports as running is slow, not
    lost, and is left alone (its own `statement_timeout` bounds it).

    The interrupt and the watcher run on other threads than the transfer. The lock keeps
    them from using the connection while the transfer thread closes it.
    """

    def __init__(
        self, ctx: TransferContext | None, config: dict[str, Any] | None = None, what: str = ""
    ) -> None:
        self._ctx = ctx
        self._config = config
        self._what = what
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None
        self._unregister: Callable[[], None] | None = None
        self._interrupted_at: float | None = None
        self._closed = threading.Event()
        # Calls in progress on the connection (the transfer thread's), and since when.
        self._depth = 0
        self.busy_since: float | None = None
        self._pid: int | None = None
        # Why the connection was dropped on purpose (for the attempt's error).
        self.dropped: str | None = None

    def attach(self, conn: psycopg.Connection[Any]) -> None:
        with self._lock:
            self._conn = conn
        every = conf.connector_probe_seconds()
        if every > 0 and self._config is not None and self._ctx is not None:
            threading.Thread(
                target=self._watch, args=(every,), name=f"dispatch-{self._what}-probe", daemon=True
            ).start()
        if self._ctx is not None:
            self._unregister = self._ctx.on_stop(self._interrupt)
            if self._ctx.should_stop():
                raise Stopped("stop requested while connecting")

    def enter(self) -> None:
        self._depth += 1
        if self._depth == 1:
            self.busy_since = time.monotonic()

    def leave(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.busy_since = None

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """A generator handing out what it read is not waiting on its server."""
        depth, self._depth, self.busy_since = self._depth, 0, None
        try:
            yield
        finally:
            self._depth = depth
            if depth:
                self.busy_since = time.monotonic()

    def watch(self, pid: int | None) -> None:
        """The attached connection's server process (None behind a pooler, whose process
        id is its own: then only an unanswered probe counts)."""
        self._pid = pid

    def _interrupt(self) -> None:
        with self._lock:
            conn = self._conn
            if conn is None or conn.closed:
                return
            now = time.monotonic()
            if self._interrupted_at is None:
                self._interrupted_at = now
            elif now - self._interrupted_at >= CANCEL_TIMEOUT_SECONDS:
                if _waiting(conn):
                    self._drop(conn, "the statement did not end after a cancel request")
                return
            try:
                conn.cancel_safe(timeout=CANCEL_TIMEOUT_SECONDS)
            except psycopg.Error:  # the cancel request got no answer in time
                if _waiting(conn):
                    self._drop(conn, "the server did not answer a cancel request")

    def _drop(self, conn: psycopg.Connection[Any], why: str) -> None:
        """Shut the socket down (under the lock: the descriptor is still the connection's)."""
        if self.dropped is None:
            self.dropped = f"connection dropped: {why}"
        log.warning("%s connection dropped: %s", self._what, why)
        deadline.shutdown_socket(conn.fileno())

    def _watch(self, every: float) -> None:
        misses = 0
        waited: tuple[float, str] | None = None  # (busy since, server's stamp) last seen
        while not self._closed.wait(every):
            conn, since = self._conn, self.busy_since
            if conn is None or conn.closed:
                return
            if since is None or time.monotonic() - since < every:
                misses, waited = 0, None  # not waiting on the server (long enough)
                continue
            state, stamp = self._probe(every, self._pid)
            misses = misses + 1 if state is None else 0
            why = None
            if misses >= 2:
                why = f"no answer from the server for {misses} probes {every:g}s apart"
            elif state == "gone":
                why = "the server ended the session without the client hearing of it"
            elif state == "waits for the client":
                # Twice, in one wait of ours, with nothing done by the server in between:
                # what the client waits for never reached the server (or its answer never
                # came back).
                if waited == (since, stamp):
                    why = "the server waits for the client while the client waits for an answer"
                waited = (since, stamp)
            else:
                waited = None
            if why is None:
                continue
            with self._lock:
                if self._conn is conn and not conn.closed and self.busy_since == since:
                    self._drop(conn, why)
            return

    def _probe(self, timeout: float, pid: int | None) -> tuple[str | None, str]:
        """What the server says of the watched session: ("gone", ""), ("waits for the
        client", when it started to), ("working", ""), ("", "") for an answer that does
        not say; (None, "") if the server did not answer within `timeout`."""
        assert self._config is not None
        try:
            probe = psycopg.connect(
                _conninfo(self._config),
                connect_timeout=max(2, math.ceil(timeout)),
                autocommit=True,
                application_name="dispatch probe",
            )
        except psycopg.OperationalError as exc:
            # A refusal is an answer (the server is there); only silence counts.
            return (None, "") if "timeout" in str(exc).lower() else ("", "")
        try:
            with probe, deadline.guarded(probe, f"{self._what} probe", timeout):
                if pid is None:
                    probe.execute("SELECT 1")
                    return "", ""
                row = probe.execute(
                    "SELECT state, wait_event, state_change::text, query_start::text"
                    " FROM pg_catalog.pg_stat_activity WHERE pid = %s",
                    [pid],
                ).fetchone()
        except deadline.DeadlineExceeded:
            return None, ""
        except psycopg.Error:
            return "", ""
        if row is None:
            return "gone", ""
        state, wait_event, state_change, query_start = row
        if state is None:
            return "", ""  # not allowed to see it
        if str(state).startswith("idle"):
            return "waits for the client", f"{state} {state_change}"
        if state == "active" and wait_event == "ClientRead":
            return "waits for the client", f"reading {query_start}"
        return "working", ""

    def close(self, conn: psycopg.Connection[Any]) -> None:
        self._closed.set()
        if self._unregister is not None:
            self._unregister()
            self._unregister = None
        with self._lock:
            self._conn = None
            # An unfinished COPY or transaction is abandoned: closing rolls back.
            with contextlib.suppress(Exception):
                conn.close()


def _waiting(conn: psycopg.Connection[Any]) -> bool:
    """A statement (or COPY) is in flight: the client waits on the server."""
    return bool(conn.info.transaction_status == pq.TransactionStatus.ACTIVE)


# --- reader ---------------------------------------------------------------------------------
class _Reader:
    """One connection, one REPEATABLE READ READ ONLY transaction: every row comes from the
    same snapshot, and a query that tries to write fails (permanently)."""

    def __init__(
        self, config: dict[str, Any], spec: dict[str, Any], ctx: TransferContext | None = None
    ) -> None:
        self.config = config
        self.spec = spec
        self.secrets = _secrets(config)
        self.conn: psycopg.Connection[Any] | None = None
        self._canceller = _Canceller(ctx, config, "source")
        self.columns: list[Column] = []
        self.oids: list[int] = []
        # An incremental read (dispatch/connectors/incremental.py): `bound()` decides the
        # rows in this reader's snapshot before any is read.
        self.incremental = incremental.parse(spec)
        self._plan: incremental.CursorReadPlan | None = None
        self.bounds: incremental.Bounds | None = None

    def _relation(self) -> sql.Composable:
        if self.spec.get("table"):
            schema, name = parse_table(self.spec["table"])
            ident = _table_sql(schema, name) if schema else sql.Identifier(name)
            return sql.SQL("SELECT * FROM {}").format(ident)
        # The query is SQL by design (the job's author wrote it); it runs inside a READ ONLY
        # transaction, so it cannot change anything.
        return sql.SQL(_strip_query(self.spec["query"]))  # type: ignore[arg-type]

    def open(self) -> None:
        self.conn = connect(self.config, what="source connect")
        self._canceller.attach(self.conn)
        with _errors(self.secrets, "source", self._canceller):
            self._canceller.watch(_set_timeouts(self.conn, self.spec))
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
            types = [
                row[0]
                for row in self.conn.execute(
                    "SELECT coalesce(pg_catalog.format_type(a.atttypid, a.atttypmod),"
                    "                pg_catalog.format_type(t.oid, t.mod))"
                    "  FROM unnest(%s::oid[], %s::int[], %s::oid[], %s::int[])"
                    "       WITH ORDINALITY AS t(oid, mod, rel, att, n)"
                    "  LEFT JOIN pg_catalog.pg_attribute a"
                    "    ON t.rel <> 0 AND a.attrelid = t.rel AND a.attnum = t.att"
                    "   AND NOT a.attisdropped"
                    " ORDER BY t.n",
                    [self.oids, mods, tables, attnums],
                )
            ]
            self.columns = [Column(n, t) for n, t in zip(names, types, strict=True)]
            if self.incremental is not None:
                self._plan = incremental.CursorReadPlan(
                    self.incremental, self._relation(), self.columns
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

    def _copy_sql(self, fmt: str, options: dict[str, str] | None = None) -> sql.Composed:
        if self._plan is not None and self.bounds is None:
            raise PermanentError("incremental read started without its cursor bounds")
        relation = (
            self._plan.select(self.bounds)
            if self._plan is not None and self.bounds is not None
            else self._relation()
        )
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

    def batches(self) -> Iterator[Batch]:
        """Decoded rows, streamed. Binary when psycopg can load every column in binary."""
        assert self.conn is not None
        binary = all(
            self.conn.adapters.get_loader(oid, pq.Format.BINARY) is not None for oid in self.oids
        )
        with _errors(self.secrets, "source read", self._canceller):
            cur = self.conn.cursor()
            with cur.copy(self._copy_sql("binary" if binary else "text")) as copy:
                copy.set_types(self.oids)
                batch: Batch = []
                for row in copy.rows():
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
        conn, pgconn = self.conn, self.conn.pgconn
        with _errors(self.secrets, "source read", self._canceller):
            # Sent on the connection whose transaction (and snapshot) open() began; psycopg
            # sees the transaction status through libpq, so its state stays consistent.
            pgconn.send_query(self._copy_sql(fmt, options).as_bytes(conn))
            _wait(pgconn)
            result = pgconn.get_result()
            if result is None or result.status != pq.ExecStatus.COPY_OUT:
                _raise_result(pgconn, result)
            parts: list[bytes | memoryview] = []
            size = rows = 0
            while True:
                nbytes, data = pgconn.get_copy_data(1)
                if nbytes > 0:
                    # Flush before appending, so the last message (the binary trailer)
                    # is always in the final block.
                    if size >= COPY_BLOCK_BYTES:
                        with self._canceller.suspended():
                            yield b"".join(parts), rows
                        parts, size, rows = [], 0, 0
                    parts.append(data)
                    size += nbytes
                    rows += 1
                    continue
                if nbytes == 0:  # libpq's buffer is empty: wait for the socket
                    select.select([pgconn.socket], [], [])
                    pgconn.consume_input()
                    continue
                break  # -1: the COPY is complete (-2, an error, is raised below)
            if fmt == "binary" and parts:
                rows -= 1  # the trailer message
            _wait(pgconn)
            _raise_result(pgconn, pgconn.get_result())
            if parts:
                with self._canceller.suspended():
                    yield b"".join(parts), rows


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


# --- writer ---------------------------------------------------------------------------------
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
        self.rows = 0
        self._copy: Any = None
        self._copy_cm: Any = None
        self._copy_cursor: Any = None
        self._copy_fmt: str | None = None
        self._target_types: dict[str, str] = {}
        self._convert: list[Callable[[Any], Any] | None] = []
        # Incremental reads: the committed cursor this attempt read, and the one to commit.
        self._cursor_read: incremental.CommittedCursor | None = None
        self._cursor_new: tuple[tuple[str, ...], list[str] | None] | None = None
        # After commit(): the cursor it committed (for the dispatch database's copy).
        self.cursor_committed: incremental.CommittedCursor | None = None

    # -- set-up --------------------------------------------------------------------------
    def open(self) -> None:
        self.conn = connect(self.config, what="sink connect")
        self._canceller.attach(self.conn)
        with _errors(self.secrets, "sink", self._canceller):
            self._canceller.watch(_set_timeouts(self.conn, self.spec))
            schema, self.name = parse_table(self.spec["table"])
            current = self.conn.execute("SELECT pg_catalog.current_schema()").fetchone()
            self.schema = schema or (current[0] if current else "public")
            self.conn.commit()
            self._raise_fence()
            if self.already_committed:
                return
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
        # The committed cursors of incremental reads live beside the fence; made here, in
        # a transaction of its own, so no data transaction ever holds its creation.
        incremental.ensure_table(conn, self.schema)
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
            if raised is not None:
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

    # -- the committed cursor of an incremental read (dispatch/connectors/incremental.py) --
    def cursor_state(self, inc: incremental.IncrementalSpec) -> incremental.CommittedCursor:
        """The binding's committed cursor, as this sink holds it (the truth). Read inside
        the data transaction; `commit()` moves it with a compare-and-set on its version."""
        assert self.conn is not None
        if self.mode == "replace":
            raise PermanentError(
                "incremental reads need an append or upsert sink: replace would keep only "
                "the latest increment"
            )
        if inc.lookback_seconds is not None and self.mode != "upsert":
            raise PermanentError(
                "incremental.lookback_seconds re-reads rows, so it needs an upsert sink"
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
            "SELECT a.attname, pg_catalog.format_type(a.atttypid, a.atttypmod), a.atttypid::int,"
            " c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0"
            "  AND NOT a.attisdropped"
            " WHERE n.nspname = %s AND c.relname = %s ORDER BY a.attnum",
            [self.schema, self.name],
        ).fetchall()
        if not rows:
            return None
        if rows[0][3] not in ("r", "p"):
            raise PermanentError(f"sink {self.schema}.{self.name} is not a table")
        return {r[0]: (r[1], r[2]) for r in rows if r[0] is not None}

    def _create_table(self, table: sql.Composed, key: list[str] | None) -> None:
        assert self.conn is not None
        conn = self.conn
        # Type text comes from the source server: accepted only as one plain type name the
        # sink resolves itself (see sqlsafety). Untyped columns (a CSV source) become text.
        types = [
            sqlsafety.check_type_name(conn, c.name, c.type) if c.type else "text"
            for c in self.source_columns
        ]
        conn.execute(
            sql.SQL("CREATE TABLE {} ({}{})").format(
                table,
                sql.SQL(", ").join(
                    sql.SQL("{} {}").format(sql.Identifier(c.name), sql.SQL(t))  # type: ignore[arg-type]
                    for c, t in zip(self.source_columns, types, strict=True)
                ),
                sql.SQL(", PRIMARY KEY ({})").format(sql.SQL(", ").join(map(sql.Identifier, key)))
                if key
                else sql.SQL(""),
            ),
            # The extended protocol: one statement, never several.
            binary=True,
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
            key = self.spec.get("key") if self.mode == "upsert" else None
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
        missing = [n for n in names if n not in target]
        if missing:
            raise PermanentError(
                f"sink table {self.schema}.{self.name} has no column(s) {', '.join(missing)}"
            )
        if self.mode == "upsert":
            absent = [k for k in self.spec["key"] if k not in names]
            if absent:
                raise PermanentError(f"key column(s) {', '.join(absent)} not in the source")
        self._target_types = {n: target[n][0] for n in names}
        # Values bound for json/jsonb columns are serialised here: psycopg would dump a
        # Python list as a PostgreSQL array.
        self._convert = [_json_text if target[n][0] in ("json", "jsonb") else None for n in names]
        if self.mode == "replace":
            # SHARE ROW EXCLUSIVE: other writers wait until we commit (so the table ends
            # up holding exactly the source's rows), readers (ACCESS SHARE) never wait.
            conn.execute(sql.SQL("LOCK TABLE {} IN SHARE ROW EXCLUSIVE MODE").format(table))
            # DELETE, not TRUNCATE or a table swap: both of those are not MVCC-safe (a
            # REPEATABLE READ reader whose snapshot predates our commit would see an empty
            # table) and both take ACCESS EXCLUSIVE. Readers see the old rows until COMMIT.
            conn.execute(sql.SQL("DELETE FROM {}").format(table))
        elif self.mode == "upsert":
            # The staging table has exactly the sink's column types; it vanishes at commit.
            conn.execute(
                sql.SQL(
                    "CREATE TEMPORARY TABLE {} ON COMMIT DROP AS SELECT {} FROM {} WITH NO DATA"
                ).format(
                    sql.Identifier("dispatch_stage"),
                    sql.SQL(", ").join(map(sql.Identifier, names)),
                    table,
                )
            )

    # -- copy ----------------------------------------------------------------------------
    def copy_format(self, columns: list[Column]) -> str | None:
        """The COPY format a PostgreSQL source should send: binary when every column has
        the same exact type on both sides (binary data is type-specific), else text (the
        sink parses it, so compatible types such as integer -> bigint work)."""
        if self.already_committed:
            return None
        if all(c.type and self._target_types.get(c.name) == c.type for c in columns):
            self._copy_fmt = "binary"
        else:
            self._copy_fmt = "text"
        return self._copy_fmt

    def _start_copy(self, fmt: str) -> Any:
        assert self.conn is not None
        if self._copy is not None:
            return self._copy
        target = (
            sql.Identifier("dispatch_stage")
            if self.mode == "upsert"
            else _table_sql(self.schema, self.name)
        )
        stmt = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT {})").format(
            target,
            sql.SQL(", ").join(sql.Identifier(c.name) for c in self.source_columns),
            sql.SQL("BINARY" if fmt == "binary" else "TEXT"),
        )
        self._copy_cursor = self.conn.cursor()
        self._copy_cm = self._copy_cursor.copy(stmt)
        self._copy = self._copy_cm.__enter__()
        self._copy_fmt = fmt
        return self._copy

    def write_copy(self, data: bytes, rows: int) -> int:
        if self.already_committed:
            return 0
        with _errors(self.secrets, "sink write", self._canceller):
            self._start_copy(self._copy_fmt or "text")
            self._copy.write(data)
        self.rows += rows
        return rows

    def write(self, batch: Batch) -> int:
        if self.already_committed:
            return 0
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
        assert self.conn is not None
        conn = self.conn
        fence = self.ctx.fence
        with _errors(self.secrets, "sink commit", self._canceller):
            copied = self._end_copy()
            if copied is not None:
                self.rows = copied  # the server's own count ("COPY n")
            if self.mode == "upsert" and self.rows:
                self._merge()
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
            # The fence, last: row-locked only from here to COMMIT (milliseconds). A newer
            # attempt that raised the token, or a commit that beat us, leaves no row.
            updated = conn.execute(
                sql.SQL(
                    "UPDATE {} SET attempt_id = %s, committed_at = now()"
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
        return WriteResult(rows_written=self.rows)

    def _merge(self) -> None:
        assert self.conn is not None
        names = [c.name for c in self.source_columns]
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
                sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {} ON CONFLICT ({}) {}").format(
                    _table_sql(self.schema, self.name),
                    cols,
                    cols,
                    sql.Identifier("dispatch_stage"),
                    sql.SQL(", ").join(map(sql.Identifier, key)),
                    action,
                )
            )
        except psycopg.errors.CardinalityViolation:
            raise PermanentError(
                f"upsert: the source holds the same key ({', '.join(key)}) more than once"
            ) from None
        except psycopg.errors.InvalidColumnReference:
            raise PermanentError(
                f"upsert: {self.schema}.{self.name} has no unique index or constraint on "
                f"({', '.join(key)})"
            ) from None

    def close(self) -> None:
        if self.conn is None:
            return
        conn, self.conn = self.conn, None
        self._canceller.close(conn)


def _json_text(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value)
