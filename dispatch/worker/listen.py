"""The LISTEN connection and its self-probe.

Working connections (claims, settlements, heartbeats, the site) may go through a
transaction-pooling proxy such as PgBouncer; LISTEN cannot: the proxy hands the server
connection that ran LISTEN to other clients, and the notifications never reach the
listener. So a LISTEN connection is opened from `DISPATCH_LISTEN_URL` (direct to
PostgreSQL) when it is set, else from the default database's settings, and it is
checked: the worker NOTIFYs its own probe channel through its *working* connection (the
path a trigger's wake-up takes) and expects the notification on its LISTEN connection.

`ListenProbe` is a small state machine the worker's main thread drives; it does no I/O
of its own except the probe NOTIFY. Its counters and gauges go into the worker row's
`stats` (all integers), which `probe_report()` reads back for the console and metrics.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import psycopg
from django.db import connection

from dispatch.core import conf, deadline
from dispatch.core.sqlfiles import query

log = logging.getLogger("dispatch.worker")

# Connection options that tune the transport, copied from the default database's
# settings onto a LISTEN connection opened from DISPATCH_LISTEN_URL. Identity (host, port,
# database, user, password) comes from that URL alone.
TRANSPORT_OPTIONS = (
    "connect_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
    "client_encoding",
)

# TLS and authentication options the LISTEN URL inherits from the default database's
# settings unless it sets them itself: a URL that only names the server must not open in
# plaintext (its password with it) what the site's own connections open over verified TLS.
TLS_OPTIONS = (
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "sslpassword",
    "sslcrl",
    "sslcrldir",
    "require_auth",
)


def connection_params(application_name: str, site: dict[str, Any] | None = None) -> dict[str, Any]:
    """The libpq parameters of a LISTEN connection: `DISPATCH_LISTEN_URL`'s, with the
    transport options of `site` (the default database's connection parameters) and its
    TLS options where the URL has none; without a LISTEN URL, `site` itself. Raises
    psycopg.ProgrammingError naming what is wrong with the URL, never quoting it."""
    if site is None:
        site = connection.get_connection_params()
    params = dict(site)
    for key in ("cursor_factory", "context", "prepare_threshold", "server_side_binding"):
        params.pop(key, None)
    params["application_name"] = application_name[:63]
    url = conf.listen_url()
    if not url:
        return params
    try:
        own = conf.parse_listen_url(url)
    except ValueError as exc:
        raise psycopg.ProgrammingError(f"DISPATCH_LISTEN_URL cannot be used: {exc}") from None
    for key in TRANSPORT_OPTIONS:
        if key in params:
            own[key] = params[key]
    for key in TLS_OPTIONS:
        if key not in own and params.get(key) not in (None, ""):
            own[key] = params[key]
    own["application_name"] = params["application_name"]
    return own


def connect(application_name: str) -> psycopg.Connection[Any]:
    """A LISTEN connection of its own, in autocommit, never shared with other work."""
    return psycopg.connect(autocommit=True, **connection_params(application_name))


def through_proxy(conn: psycopg.Connection[Any]) -> bool:
    """True if the connection ends at a proxy rather than a PostgreSQL backend: the backend
    pid announced at connect (BackendKeyData) is not the pid of the session that answers.
    PgBouncer announces a cancel key of its own."""
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    return row is None or int(row[0]) != conn.info.backend_pid


def probe_channel(worker_id: str) -> str:
    """The worker's own probe channel (short and safe whatever the worker id)."""
    return "dispatch_probe_" + hashlib.sha256(worker_id.encode()).hexdigest()[:24]


class ListenState(enum.Enum):
    # Connected; the first probe since connecting has not come back yet.
    STARTING = "starting"
    # The last probe (or a wake-up) arrived.
    OK = "ok"
    # A probe did not come back on a direct connection: the worker dropped it and
    # reconnects, polling meanwhile; it stays so until a new connection is up.
    SILENT = "silent"
    # The LISTEN URL is a transaction-pooling proxy: no LISTEN, polling only.
    POOLED = "pooled"
    # No LISTEN connection at the moment (reconnecting with backoff).
    DISCONNECTED = "disconnected"


class ProbeAction(enum.Enum):
    NONE = "none"
    RECONNECT = "reconnect"  # close the LISTEN connection and open a new one
    STOP_LISTENING = "stop"  # polling only from now on


class ListenProbe:
    """Driven by the main thread: `connected()` after LISTEN, `received()`/`traffic()`
    for what the LISTEN connection reads, `tick()` on every iteration."""

    def __init__(self, worker_id: str, *, interval: float, timeout: float) -> None:
        self.worker_id = worker_id
        self.channel = probe_channel(worker_id)
        self.interval = interval
        self.timeout = timeout
        self.state = ListenState.DISCONNECTED
        self.proxy = False
        self.sent = 0
        self.received_count = 0
        self.missed = 0
        self._seq = 0
        self._sent_at: float | None = None  # the probe in flight (monotonic)
        self._quiet_since = time.monotonic()

    # --- events -----------------------------------------------------------------------
    def connected(self, conn: psycopg.Connection[Any]) -> None:
        """The LISTEN connection is up: listen on the probe channel, look for a proxy, and
        send the start-up probe at the next tick."""
        self.adopted(self.listen_on(conn))

    def listen_on(self, conn: psycopg.Connection[Any]) -> bool:
        """The I/O of `connected` (any thread; it touches no state of the probe): listen
        on the probe channel; True if the connection ends at a proxy."""
        from psycopg import sql

        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
        return through_proxy(conn)

    def adopted(self, proxied: bool) -> None:
        """The state side of `connected` (the worker's main thread)."""
        self.proxy = proxied
        self.state = ListenState.STARTING
        self._sent_at = None
        self._quiet_since = -float("inf")  # probe at once: the start-up self-check

    def disconnected(self) -> None:
        # A missed probe's verdict outlives the connection it judged: the worker closes
        # that connection right after `tick()` says SILENT, and overwriting it here would
        # report a silently broken path (wake-ups swallowed, nothing erroring) as a mere
        # "disconnected" on every heartbeat, console and health check.
        if self.state not in (ListenState.POOLED, ListenState.SILENT):
            self.state = ListenState.DISCONNECTED
        self._sent_at = None

    def traffic(self) -> None:
        """A wake-up arrived on the LISTEN connection: it delivers, no probe needed now."""
        self._quiet_since = time.monotonic()
        if self.state in (ListenState.STARTING, ListenState.SILENT) and self._sent_at is None:
            self.state = ListenState.OK

    def received(self, payload: str) -> None:
        if self._sent_at is None or payload != str(self._seq):
            return  # a late answer to an earlier probe
        self.received_count += 1
        self._sent_at = None
        self._quiet_since = time.monotonic()
        if self.state is not ListenState.OK:
            log.info(
                "LISTEN self-probe answered worker=%s%s",
                self.worker_id,
                " (through a session-pooling proxy)" if self.proxy else "",
            )
        self.state = ListenState.OK

    # --- time -------------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        if self.state in (ListenState.POOLED, ListenState.DISCONNECTED):
            return None
        if self._sent_at is not None:
            return self._sent_at + self.timeout
        return self._quiet_since + self.interval

    def tick(self, now: float, poll_interval: float) -> ProbeAction:
        """Send a probe when the connection has been quiet for `interval`; judge one that
        has been out for `timeout`. Raises the working connection's database errors."""
        if self.state in (ListenState.POOLED, ListenState.DISCONNECTED):
            return ProbeAction.NONE
        if self._sent_at is None:
            if now - self._quiet_since >= self.interval:
                self._send(now)
            return ProbeAction.NONE
        if now - self._sent_at < self.timeout:
            return ProbeAction.NONE
        self.missed += 1
        self._sent_at = None
        if self.proxy:
            self.state = ListenState.POOLED
            log.error(
                "LISTEN connection goes through a transaction-pooling proxy: its "
                "notifications never arrive (self-probe unanswered after %.1fs). Falling back "
                "to polling every %.1fs. Point DISPATCH_LISTEN_URL at PostgreSQL itself "
                "worker=%s",
                self.timeout,
                poll_interval,
                self.worker_id,
            )
            return ProbeAction.STOP_LISTENING
        self.state = ListenState.SILENT
        log.warning(
            "LISTEN wake-ups stopped arriving (self-probe unanswered after %.1fs); "
            "reconnecting, polling every %.1fs meanwhile worker=%s",
            self.timeout,
            poll_interval,
            self.worker_id,
        )
        return ProbeAction.RECONNECT

    def _send(self, now: float) -> None:
        self._seq += 1
        with deadline.bounded("listen_probe"), connection.cursor() as cursor:
            cursor.execute(query("notify"), {"channel": self.channel, "payload": str(self._seq)})
        self._sent_at = now
        self.sent += 1

    # --- reporting --------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Integers for the worker row's `stats` (see `probe_report`)."""
        return {
            "listen_probes_sent": self.sent,
            "listen_probes_received": self.received_count,
            "listen_probes_missed": self.missed,
            "listen_healthy": int(self.state is ListenState.OK),
            "listen_polling_only": int(self.state is ListenState.POOLED),
            "listen_state": list(ListenState).index(self.state),
        }


# States that mean wake-ups stopped arriving (workerhealth --require-listen, the metrics'
# unhealthy-LISTEN gauge); a worker still starting, or polling behind a pooler by design,
# is not in them.
UNHEALTHY_STATES = (ListenState.SILENT.value, ListenState.DISCONNECTED.value)


@dataclass(frozen=True)
class ProbeReport:
    state: str  # a ListenState value, or "unknown" for a worker that reports none
    healthy: bool
    polling_only: bool
    sent: int
    received: int
    missed: int


def probe_report(stats: dict[str, Any] | None) -> ProbeReport:
    """What a worker row's `stats` say about its LISTEN connection (console, metrics)."""
    stats = stats or {}
    index = stats.get("listen_state")
    states = list(ListenState)
    state = (
        states[index].value if isinstance(index, int) and 0 <= index < len(states) else "unknown"
    )
    return ProbeReport(
        state=state,
        healthy=bool(stats.get("listen_healthy", 0)),
        polling_only=bool(stats.get("listen_polling_only", 0)),
        sent=int(stats.get("listen_probes_sent", 0)),
        received=int(stats.get("listen_probes_received", 0)),
        missed=int(stats.get("listen_probes_missed", 0)),
    )


class ListenOpening:
    """What the thread that opens a LISTEN connection hands the main thread: `done` is
    set once the connection (or the error) is in place, so the main thread never takes a
    half-made hand-over, and a connection finished after the worker gave up on it (at
    shutdown) is closed by the thread itself."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.conn: psycopg.Connection[Any] | None = None
        self.proxied = False
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._abandoned = False

    def finish(
        self,
        *,
        conn: psycopg.Connection[Any] | None = None,
        proxied: bool = False,
        error: BaseException | None = None,
    ) -> bool:
        """Hand the connection (or the error) over; False if nobody takes it any more
        (the connection is closed here)."""
        with self._lock:
            if self._abandoned:
                if conn is not None:
                    conn.close()
                return False
            self.conn, self.proxied, self.error = conn, proxied, error
            self.done.set()
            return True

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error, OSError):
                conn.close()
