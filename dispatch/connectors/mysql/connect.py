"""Connecting to a `mysql` datasource: the site's target policy, the session's settings
and timeouts, errors classified (permanent or transient) and scrubbed of secrets, and
the interrupt that stops a running statement (`KILL QUERY` from a second connection)."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import re
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pymysql
from pymysql import converters
from pymysql.constants import FIELD_TYPE

from dispatch.connectors.base import (
    ConnectorError,
    PermanentError,
    Stopped,
    TransferContext,
    TransientError,
)
from dispatch.connectors.mysql import localinfile
from dispatch.connectors.mysql.spec import (
    CONNECT_TIMEOUT_SECONDS,
    DEFAULT_PORT,
    policy_errors,
    timeouts,
)

log = logging.getLogger("dispatch.connectors")

# Server error numbers whose retry cannot help: access (1044, 1045, 1142, 1143, 1227,
# 1370), unknown database/table/column (1049, 1146, 1054), syntax (1064, 1149), data that
# does not fit (1264, 1292, 1366, 1406, 1265, 1048, 1452), duplicates (1062), a write in a
# READ ONLY transaction (1792), too many rows of a subquery (1242), unknown function (1305).
_PERMANENT = {
    1044, 1045, 1048, 1049, 1054, 1062, 1064, 1142, 1143, 1146, 1149, 1227, 1242, 1264,
    1265, 1292, 1305, 1366, 1370, 1406, 1452, 1792, 3140, 4025,
}  # fmt: skip


def _datetime(text: str) -> Any:
    """A DATETIME or TIMESTAMP value's text as a datetime, by the C parser; what it cannot
    read (a zero or invalid date) as PyMySQL's own converter answers (the text)."""
    try:
        return dt.datetime.fromisoformat(text)
    except ValueError:
        return converters.convert_datetime(text)


def _date(text: str) -> Any:
    try:
        return dt.date.fromisoformat(text)
    except ValueError:
        return converters.convert_date(text)


# PyMySQL's conversions, its dates' regex-based parsing replaced (a fifth of a table
# read's time went to it: docs/benchmarks.md).
CONVERSIONS = {
    **converters.conversions,
    FIELD_TYPE.DATETIME: _datetime,
    FIELD_TYPE.TIMESTAMP: _datetime,
    FIELD_TYPE.DATE: _date,
    FIELD_TYPE.NEWDATE: _date,
}


def _secrets(config: dict[str, Any]) -> list[str]:
    return [str(config["password"])] if config.get("password") else []


def _scrub(text: str, secrets: list[str]) -> str:
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, "********")
    return re.sub(r"(?i)\b(mysql|mariadb)://[^/\s@]*@", r"\1://********@", text)


def classify(exc: BaseException, secrets: list[str], what: str) -> ConnectorError:
    if isinstance(exc, ConnectorError):
        return exc
    code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
    message = exc.args[1] if len(exc.args) > 1 else str(exc)
    text = f"{what}: {_scrub(' '.join(str(message).split()), secrets)[:2000]}"
    if code is not None:
        text += f" (MySQL error {code})"
    if code in _PERMANENT or isinstance(exc, pymysql.err.ProgrammingError):
        return PermanentError(text)
    return TransientError(text)


@contextlib.contextmanager
def errors(secrets: list[str], what: str) -> Iterator[None]:
    try:
        yield
    except pymysql.Error as exc:
        raise classify(exc, secrets, what) from None
    except OSError as exc:
        raise TransientError(f"{what}: {type(exc).__name__}: {exc.strerror or exc}") from None
    except localinfile.RefusedRequest as exc:
        raise PermanentError(f"{what}: {exc}") from None


# --- connections -----------------------------------------------------------------------------
def _ssl(config: dict[str, Any]) -> dict[str, Any] | None:
    mode = config.get("tls") or "preferred"
    if mode == "disabled":
        return None
    if mode == "verify_identity":
        return {"check_hostname": True, "verify_mode": True}
    return {"check_hostname": False, "verify_mode": False}


def connect(
    config: dict[str, Any],
    *,
    what: str,
    spec: dict[str, Any] | None = None,
    local_stream: bool = False,
) -> pymysql.connections.Connection[Any]:
    """A connection under the site's target policy: no option file is read (pymysql reads
    one only when asked), TLS as the config says, and `LOCAL INFILE` only with
    `local_stream` (the sink's connection): a `StreamConnection`, which answers the
    server's request with the writer's own rows alone (localinfile.py). Every read and write
    on its socket is bounded: by the spec's statement timeout and a minute (the server
    ends a statement at its timeout; this catches a server that stopped answering), or
    by CONNECT_TIMEOUT_SECONDS for a connection without a spec (a test, a cancel)."""
    socket_timeout = timeouts(spec)[0] + 60 if spec is not None else CONNECT_TIMEOUT_SECONDS
    problems = policy_errors(config)
    if problems:
        raise PermanentError(f"{what}: refused by the site's target policy: {'; '.join(problems)}")
    host = str(config["host"])
    kwargs: dict[str, Any] = {
        "user": config.get("user") or "",
        "password": config.get("password") or "",
        "database": config.get("database") or None,
        "charset": "utf8mb4",
        "connect_timeout": CONNECT_TIMEOUT_SECONDS,
        "autocommit": False,
        "local_infile": local_stream,
        "read_timeout": socket_timeout,
        "write_timeout": socket_timeout,
        "binary_prefix": True,
        "cursorclass": pymysql.cursors.Cursor,
        "conv": CONVERSIONS,
    }
    if host.startswith("/"):
        kwargs["unix_socket"] = host
    else:
        kwargs["host"] = host
        kwargs["port"] = int(config.get("port") or DEFAULT_PORT)
        ssl = _ssl(config)
        if ssl is not None:
            kwargs["ssl"] = ssl
    secrets = _secrets(config)
    make = localinfile.StreamConnection if local_stream else pymysql.connections.Connection
    with errors(secrets, what):
        try:
            return make(**kwargs)
        except pymysql.err.OperationalError as exc:
            # "preferred": a server without TLS is spoken to in clear, as libpq's prefer.
            if config.get("tls") in (None, "", "preferred") and "ssl" in kwargs and _no_tls(exc):
                del kwargs["ssl"]
                return make(**kwargs)
            raise


def _no_tls(exc: BaseException) -> bool:
    return "SSL" in str(exc) or "TLS" in str(exc)


def session(conn: Any, spec: dict[str, Any], *, read_only: bool) -> dict[str, Any]:
    """Set the session up: strict modes (a value that does not fit is an error, never
    truncated), UTC, utf8mb4, the statement and lock timeouts, the isolation level. Returns
    what the server says of itself: {"mariadb": bool, "thread_id": int}."""
    statement, lock = timeouts(spec)
    with conn.cursor() as cur:
        cur.execute("SELECT VERSION(), CONNECTION_ID()")
        version, thread_id = cur.fetchone()
        mariadb = "mariadb" in str(version).lower()
        cur.execute(
            "SET SESSION sql_mode = 'STRICT_ALL_TABLES,NO_ZERO_DATE,NO_ZERO_IN_DATE,"
            "ERROR_FOR_DIVISION_BY_ZERO,NO_ENGINE_SUBSTITUTION,NO_AUTO_VALUE_ON_ZERO',"
            " time_zone = '+00:00', innodb_lock_wait_timeout = %s, lock_wait_timeout = %s,"
            " net_write_timeout = %s, net_read_timeout = %s",
            [lock, lock, statement, statement],
        )
        if mariadb:
            cur.execute("SET SESSION max_statement_time = %s", [statement])
        else:
            cur.execute("SET SESSION max_execution_time = %s", [statement * 1000])
        cur.execute(
            "SET SESSION TRANSACTION ISOLATION LEVEL "
            + ("REPEATABLE READ" if read_only else "READ COMMITTED")
        )
    conn.commit()
    return {"mariadb": mariadb, "thread_id": int(thread_id), "version": str(version)}


class Interrupter:
    """Stops the statement running on a connection when the transfer must stop (a
    timeout, a cancel, a lost lease): `KILL QUERY <id>` sent from a second connection of
    the same user; the blocked call then fails (MySQL error 1317) and the transaction
    rolls back."""

    def __init__(self, ctx: TransferContext | None, config: dict[str, Any]) -> None:
        self.ctx = ctx
        self.config = config
        self.thread_id: int | None = None
        self._conn: Any = None
        self._lock = threading.Lock()
        self._unregister: Callable[[], None] | None = None
        self.killed = False

    def attach(self, thread_id: int, conn: Any) -> None:
        self.thread_id = thread_id
        self._conn = conn
        if self.ctx is not None:
            self._unregister = self.ctx.on_stop(self.interrupt)
            if self.ctx.should_stop():
                raise Stopped("stop requested while connecting")

    def interrupt(self) -> None:
        with self._lock:
            if self.thread_id is None:
                return
            try:
                conn = connect(self.config, what="cancel")
                try:
                    with conn.cursor() as cur:
                        cur.execute("KILL QUERY %s", [self.thread_id])
                    self.killed = True
                finally:
                    conn.close()
            except (ConnectorError, pymysql.Error, OSError) as exc:  # logged, not raised
                # The server cannot be reached to kill the statement: shut the
                # connection's socket down, so the blocked call fails at once (the server
                # rolls the transaction back when it notices).
                log.warning("mysql: could not interrupt the running statement: %s", exc)
                sock = getattr(self._conn, "_sock", None)
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        if self._unregister is not None:
            self._unregister()
            self._unregister = None
        with self._lock:
            self.thread_id = None
            self._conn = None
