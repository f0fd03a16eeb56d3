"""Connecting to a `postgresql` datasource: the conninfo, the site's target policy, the
session's timeouts, and errors classified (permanent or transient) and scrubbed of
secrets."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import Any, Protocol

import psycopg
from django.core.exceptions import ValidationError
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from dispatch.connectors import sqlsafety
from dispatch.connectors.base import (
    ConnectorError,
    PermanentError,
    TransientError,
    int_field,
)
from dispatch.core import deadline
from dispatch.security import limits, targets

CONNECT_TIMEOUT_SECONDS = 10
DEFAULT_STATEMENT_TIMEOUT_SECONDS = 3600
DEFAULT_LOCK_TIMEOUT_SECONDS = 10

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


class _Watch(Protocol):
    """What `_errors` needs of a connection's watcher (`cancel._Canceller`): it counts the
    calls waiting on the server, and says why it dropped the connection on purpose."""

    dropped: str | None

    def enter(self) -> None: ...

    def leave(self) -> None: ...


@contextlib.contextmanager
def _errors(secrets: list[str], what: str, watch: _Watch | None = None) -> Iterator[None]:
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
        # A URL libpq cannot parse has no password to pick out (the URL is one already).
        with contextlib.suppress(psycopg.ProgrammingError, UnicodeError):
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
        with contextlib.suppress(psycopg.ProgrammingError, UnicodeError):
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
                # The rollback ends catalog_only() with the transaction.
                sqlsafety.catalog_only(conn)
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


class Session:
    """A connection `open_session` set up: its server process id (None behind a pooler)
    and its current schema."""

    def __init__(self, conn: psycopg.Connection[Any], pid: int | None, schema: str) -> None:
        self.conn = conn
        self.pid = pid
        self.schema = schema


def open_session(config: dict[str, Any], spec: dict[str, Any], *, what: str) -> Session:
    """`connect()` then `_set_timeouts()`, the same checks and settings in two round trips
    after the connection's start-up: the session's search_path is read, then everything
    else goes in one pipeline (the safe search_path, the timeouts and output formats, the
    current schema, and the site fingerprint under `catalog_only`)."""
    secrets = _secrets(config)
    problems = policy_errors(config)
    if problems:
        raise PermanentError(f"{what}: refused by the site's target policy: {'; '.join(problems)}")
    check_site = not targets.site_database_allowed()
    with _errors(secrets, what):
        conn = psycopg.connect(_conninfo(config), autocommit=True)
    try:
        with _errors(secrets, what), deadline.guarded(conn, what, CONNECT_TIMEOUT_SECONDS):
            row = conn.execute(sqlsafety.CURRENT_SEARCH_PATH_SQL).fetchone()
            path = sqlsafety.safe_search_path(str(row[0]) if row else "")
            with conn.pipeline():
                conn.execute(sqlsafety.SET_SEARCH_PATH_SQL, [path])
                settings = conn.execute(_TIMEOUTS_SQL, _timeout_values(spec))
                schema = conn.execute("SELECT pg_catalog.current_schema()")
                site = None
                if check_site:
                    # The pipeline's statements run in one implicit transaction, which
                    # commits at its end: catalog_only's transaction-local search_path
                    # ends there, the session's settings above stay. (No BEGIN/ROLLBACK
                    # here: they would take the statements before them along.)
                    sqlsafety.catalog_only(conn)
                    site = conn.execute(targets.SITE_FINGERPRINT_SQL)
            pid_row, schema_row = settings.fetchone(), schema.fetchone()
            site_row = site.fetchone() if site is not None else None
            conn.autocommit = False
    except BaseException:
        conn.close()
        raise
    if site_row is not None and tuple(str(v) for v in site_row) == targets.site_fingerprint():
        conn.close()
        raise PermanentError(
            f"{what}: refused by the site's target policy: {SITE_DATABASE_REFUSED}"
        )
    pid = int(pid_row[0]) if pid_row else None
    return Session(
        conn,
        pid if pid == conn.info.backend_pid else None,
        str(schema_row[0]) if schema_row and schema_row[0] else "public",
    )


_TIMEOUTS_SQL = (
    "SELECT pg_catalog.pg_backend_pid(),"
    " pg_catalog.set_config('statement_timeout', %s, false),"
    " pg_catalog.set_config('lock_timeout', %s, false),"
    " pg_catalog.set_config('idle_in_transaction_session_timeout', %s, false),"
    # Fixed output formats: the text COPY data of one session is read by another.
    " pg_catalog.set_config('DateStyle', 'ISO, MDY', false),"
    " pg_catalog.set_config('IntervalStyle', 'postgres', false),"
    " pg_catalog.set_config('extra_float_digits', '3', false),"
    " pg_catalog.set_config('bytea_output', 'hex', false),"
    " pg_catalog.set_config('TimeZone', 'UTC', false)"
)


def _timeout_values(spec: dict[str, Any]) -> list[str]:
    statement = int(spec.get("statement_timeout_seconds", DEFAULT_STATEMENT_TIMEOUT_SECONDS))
    lock = int(spec.get("lock_timeout_seconds", DEFAULT_LOCK_TIMEOUT_SECONDS))
    return [f"{statement}s", f"{lock}s", f"{statement}s"]


def _set_timeouts(conn: psycopg.Connection[Any], spec: dict[str, Any]) -> int | None:
    """Bound every statement and lock wait of this session, so a hung query cannot hold
    a lease (or a lock on someone else's table) forever. Returns the session's server
    process id, or None behind a pooler (whose process id is its own)."""
    row = conn.execute(_TIMEOUTS_SQL, _timeout_values(spec)).fetchone()
    conn.commit()
    pid = int(row[0]) if row else None
    return pid if pid == conn.info.backend_pid else None


def _timeouts(spec: dict[str, Any]) -> None:
    for name, maximum in (
        ("statement_timeout_seconds", limits.MAX_STATEMENT_TIMEOUT_SECONDS),
        ("lock_timeout_seconds", limits.MAX_LOCK_TIMEOUT_SECONDS),
    ):
        int_field(spec, name, default=None, minimum=1, maximum=maximum)
