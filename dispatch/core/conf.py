"""The app's settings, read lazily so that `override_settings` works in tests.

Every tunable has a typed default here; only `project/settings.py` reads the
environment.
"""

from __future__ import annotations

from django.conf import settings


def encryption_keys() -> list[str]:
    """Fernet keys, newest first (the first one encrypts, all of them decrypt)."""
    keys = getattr(settings, "DISPATCH_ENCRYPTION_KEYS", [])
    if isinstance(keys, str):
        keys = [k for k in keys.split(",")]
    return [k.strip() for k in keys if k.strip()]


def channel() -> str:
    """The LISTEN/NOTIFY channel that carries run ids."""
    return str(getattr(settings, "DISPATCH_CHANNEL", "dispatch_runs"))


def poll_interval() -> float:
    """Seconds between generic claim passes while notifications are absent (no LISTEN
    connection, or one whose self-probe has not come back). While they arrive, the
    worker's heartbeat looks at the queue instead (`idle_heartbeat_seconds`)."""
    return float(getattr(settings, "DISPATCH_POLL_INTERVAL", 2.0))


def idle_heartbeat_seconds() -> float:
    """Seconds between the heartbeats of a worker that holds no attempt. Each heartbeat
    also reads, in its transaction, whether eligible work is due, when the next attempt
    falls due and when the earliest lease runs out: with LISTEN working that look is the
    poll, and the expiry it reads times the next recovery pass."""
    return float(getattr(settings, "DISPATCH_IDLE_HEARTBEAT_SECONDS", 10.0))


def recovery_interval() -> float:
    """The longest a worker goes between recovery passes. A pass also runs as soon as
    the earliest lease its last heartbeat saw has run out."""
    return float(getattr(settings, "DISPATCH_RECOVERY_INTERVAL", 60.0))


def coordination_timeout() -> float:
    """The longest a worker waits for the database to answer one coordination call
    (claim, settlement, heartbeat, recovery, refresh, timer): past it, the connection is
    dropped and made again with backoff (dispatch.core.deadline). A heartbeat waits at most a
    third of the shortest lease it extends, whichever is less. Also the worker's
    `connect_timeout` cap and its sessions' `statement_timeout` (0: no deadline)."""
    return float(getattr(settings, "DISPATCH_COORDINATION_TIMEOUT", 10.0))


def connector_probe_seconds() -> float:
    """How long a PostgreSQL source or sink connection may wait on its server before
    the worker asks the server, on a connection of its own, whether that session is still
    working: no answer twice in a row (a silent partition), the session gone, or the
    server idle while the client waits (an answer lost on the way) drops the connection,
    and the attempt fails as a transient error (retried). A slow statement the server
    reports as running is left alone. 0: never ask."""
    return float(getattr(settings, "DISPATCH_CONNECTOR_PROBE_SECONDS", 15.0))


def shutdown_grace_seconds() -> float:
    """How long a draining worker lets executions finish before releasing them."""
    return float(getattr(settings, "DISPATCH_SHUTDOWN_GRACE_SECONDS", 10.0))


def misfire_grace_seconds() -> float:
    """A schedule slot later than this is a misfire (see the scheduling app)."""
    return float(getattr(settings, "DISPATCH_MISFIRE_GRACE_SECONDS", 60.0))


def extra_connectors() -> list[str]:
    """Dotted paths of connector classes a site adds to the built-in kinds."""
    return list(getattr(settings, "DISPATCH_CONNECTORS", []))


def csv_base_dirs() -> list[str]:
    """Directories a csv datasource's base_dir must lie in; empty (the default): CSV
    datasources are disabled (docs/security.md, "CSV files")."""
    dirs = getattr(settings, "DISPATCH_CSV_BASE_DIRS", [])
    if isinstance(dirs, str):
        dirs = dirs.split(",")
    return [d.strip() for d in dirs if d.strip()]


def parquet_base_dirs() -> list[str]:
    """Directories a parquet datasource's base_dir must lie in; empty (the default):
    Parquet datasources are disabled (docs/security.md, "CSV and Parquet files")."""
    dirs = getattr(settings, "DISPATCH_PARQUET_BASE_DIRS", [])
    if isinstance(dirs, str):
        dirs = dirs.split(",")
    return [d.strip() for d in dirs if d.strip()]


def apply_env_prefix() -> str:
    """The prefix every `env:` secret reference of definition files must start with
    (dispatch.ascode): an apply reads no other environment variable."""
    return str(getattr(settings, "DISPATCH_APPLY_ENV_PREFIX", "DISPATCH_SECRET_"))


def apply_secret_dirs() -> list[str]:
    """Directories a `file:` secret reference must resolve into; empty: file references
    are refused."""
    dirs = getattr(settings, "DISPATCH_APPLY_SECRET_DIRS", [])
    if isinstance(dirs, str):
        dirs = dirs.split(",")
    return [d.strip() for d in dirs if d.strip()]


def listen_url() -> str:
    """Where LISTEN connections go (direct to PostgreSQL, never a transaction pooler);
    empty: the default database's settings."""
    return str(getattr(settings, "DISPATCH_LISTEN_URL", "") or "")


# libpq's sslmode values: a LISTEN URL's and a `postgresql` datasource's choices.
SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")


def parse_listen_url(url: str) -> dict[str, str]:
    """The libpq parameters of a LISTEN URL. Raises ValueError saying what is wrong, never
    quoting the URL: libpq's own parse errors quote the part that failed, which may be the
    password (a bad percent-escape in it)."""
    from psycopg import ProgrammingError
    from psycopg.conninfo import conninfo_to_dict

    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise ValueError("it holds whitespace or control characters")
    scheme, sep, _ = url.partition("://")
    if not sep or scheme.lower() not in ("postgres", "postgresql"):
        raise ValueError("it must be a postgres:// or postgresql:// URL")
    try:
        parsed = conninfo_to_dict(url)
    except ProgrammingError:
        raise ValueError(
            "it does not parse (a bad percent-escape, e.g. in the password, or an unknown "
            "parameter)"
        ) from None
    params = {k: str(v) for k, v in parsed.items() if v is not None}
    if not (params.get("host") or params.get("hostaddr")):
        raise ValueError("it names no host")
    for port in params.get("port", "").split(","):  # one per host; empty: the default
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise ValueError("its port is not a number from 1 to 65535")
    if params.get("sslmode", "prefer") not in SSLMODES:
        raise ValueError(f"its sslmode must be one of {', '.join(SSLMODES)}")
    return params


def listen_probe_interval() -> float:
    """Seconds of silence on the LISTEN connection after which a worker probes it."""
    return float(getattr(settings, "DISPATCH_LISTEN_PROBE_INTERVAL", 60.0))


def listen_probe_timeout() -> float:
    """Seconds a probe may take to come back before the LISTEN connection is reported."""
    return float(getattr(settings, "DISPATCH_LISTEN_PROBE_TIMEOUT", 5.0))


# --- operations: retention (docs/operations.md) ----------------------------------------

RETENTION_DEFAULT_DAYS: dict[str, float | None] = {
    "SUCCEEDED": 14.0,
    "FAILED": 90.0,
    "CANCELLED": 90.0,
}


def retention_days() -> dict[str, float | None]:
    """Days a finished run is kept, per final status (None: forever)."""
    configured = getattr(settings, "DISPATCH_RETENTION_DAYS", {}) or {}
    days = {**RETENTION_DEFAULT_DAYS, **configured}
    return {k: (None if v is None else float(v)) for k, v in days.items()}


def retention_batch() -> int:
    """Runs deleted per transaction (each batch holds its locks for milliseconds)."""
    return int(getattr(settings, "DISPATCH_RETENTION_BATCH", 500))


def retention_interval() -> float:
    """Seconds between retention passes across all workers (the first worker whose
    maintenance loop finds the last pass older than this runs the next one)."""
    return float(getattr(settings, "DISPATCH_RETENTION_INTERVAL", 300.0))


def retention_max_batches() -> int:
    """Batches one pass deletes at most (the rest waits for the next pass)."""
    return int(getattr(settings, "DISPATCH_RETENTION_MAX_BATCHES", 100))


def worker_retention_days() -> float:
    """Days a stopped worker's row is kept."""
    return float(getattr(settings, "DISPATCH_WORKER_RETENTION_DAYS", 7.0))


def alert_retention_days() -> float:
    """Days a sent, failed or suppressed alert is kept."""
    return float(getattr(settings, "DISPATCH_ALERT_RETENTION_DAYS", 90.0))


def bulk_retention_days() -> float:
    """Days a finished bulk operation (and its skipped rows) is kept."""
    return float(getattr(settings, "DISPATCH_BULK_RETENTION_DAYS", 90.0))


def bulk_batch() -> int:
    """Rows one batch of a bulk operation handles, in one transaction (their row locks
    are held to its commit)."""
    return int(getattr(settings, "DISPATCH_BULK_BATCH", 200))


def bulk_budget() -> float:
    """Seconds of bulk batches one maintenance tick works at most (a batch started runs to
    its commit); then the other tasks have their turn."""
    return float(getattr(settings, "DISPATCH_BULK_BUDGET", 5.0))


def bulk_interval() -> float:
    """Seconds between an idle worker's looks for bulk operations to work (one transaction
    each); a worker that worked batches looks again at its next maintenance tick."""
    return float(getattr(settings, "DISPATCH_BULK_INTERVAL", 30.0))


# --- operations: alerts and auto-disable (docs/operations.md) ------------------------------


def health_interval() -> float:
    """Seconds between health scans (alerts, auto-disable) and alert drains, across all
    workers."""
    return float(getattr(settings, "DISPATCH_HEALTH_INTERVAL", 60.0))


def health_scan_lag() -> float:
    """Seconds the health scan and the metrics fold stay behind now: a settlement stamps
    `finished_at` before its commit, which comes at most the coordination timeout later
    (system check dispatch.W001 warns below that)."""
    return float(getattr(settings, "DISPATCH_HEALTH_SCAN_LAG", 15.0))


def warn_failures() -> int:
    """Consecutive failed runs at which a binding is warned about (0: never)."""
    return int(getattr(settings, "DISPATCH_WARN_FAILURES", 20))


def warn_days() -> float:
    """Days without a successful run, while failing, at which a binding is warned about."""
    return float(getattr(settings, "DISPATCH_WARN_DAYS", 4.0))


def auto_disable_failures() -> int:
    """Consecutive failed runs at which a binding is disabled (0: never)."""
    return int(getattr(settings, "DISPATCH_AUTO_DISABLE_FAILURES", 30))


def auto_disable_days() -> float:
    """Days without a successful run, while failing, at which a binding is disabled."""
    return float(getattr(settings, "DISPATCH_AUTO_DISABLE_DAYS", 7.0))


def alert_webhook_url() -> str:
    return str(getattr(settings, "DISPATCH_ALERT_WEBHOOK_URL", "") or "")


def alert_webhook_secret() -> str:
    """The HMAC key the webhook's signature is made with ("": unsigned)."""
    return str(getattr(settings, "DISPATCH_ALERT_WEBHOOK_SECRET", "") or "")


def alert_webhook_timeout() -> float:
    return float(getattr(settings, "DISPATCH_ALERT_WEBHOOK_TIMEOUT", 5.0))


def alert_webhooks() -> dict[str, dict[str, str]]:
    """Named webhooks a binding may send its alerts to instead of the site's default:
    `{"name": {"url": "https://...", "secret": "..."}}`. Only the site's settings name
    hosts: a binding picks one of these by name, never a URL of its own."""
    configured = getattr(settings, "DISPATCH_ALERT_WEBHOOKS", None) or {}
    return {
        str(name): {"url": str(v.get("url", "") or ""), "secret": str(v.get("secret", "") or "")}
        for name, v in dict(configured).items()
        if isinstance(v, dict)
    }


ANY_DOMAIN = "*"


def alert_email_domains() -> frozenset[str]:
    """Domains a binding's own alert addresses may be at, lower case: empty (the default)
    allows none, so a binding's alerts go to the site's ADMINS; `ANY_DOMAIN` ("*") allows
    every domain. The site's ADMINS are never restricted."""
    domains = getattr(settings, "DISPATCH_ALERT_EMAIL_DOMAINS", ()) or ()
    if isinstance(domains, str):
        domains = domains.split(",")
    return frozenset(str(d).strip().lower() for d in domains if str(d).strip())


def alert_notifiers() -> list[str]:
    """The notifiers alerts go through: `email` and `webhook` (a webhook alert is written
    only for a binding with a webhook: its own named one, else the site's default URL)."""
    configured = getattr(settings, "DISPATCH_ALERT_NOTIFIERS", None)
    if configured is not None:
        return [str(n) for n in configured]
    return ["email", "webhook"]


def alert_rate_limit() -> int:
    """Alerts of one binding, kind and notifier per hour; more are SUPPRESSED (0: none)."""
    return int(getattr(settings, "DISPATCH_ALERT_RATE_LIMIT", 10))


def alert_max_attempts() -> int:
    return int(getattr(settings, "DISPATCH_ALERT_MAX_ATTEMPTS", 8))


def alert_backoff() -> float:
    """Seconds before an alert's second attempt; doubled each time, at most an hour."""
    return float(getattr(settings, "DISPATCH_ALERT_BACKOFF", 30.0))


def maintenance_enabled() -> bool:
    """Whether `runworker` runs the maintenance loop (retention, health scan, alerts)."""
    return bool(getattr(settings, "DISPATCH_MAINTENANCE", True))


def metrics_path() -> str:
    """Where the site serves Prometheus metrics, relative to where `dispatch.urls` is
    included ("": not served)."""
    return str(getattr(settings, "DISPATCH_METRICS_PATH", "metrics"))


def metrics_token() -> str:
    """A bearer token that may read the metrics besides staff users ("": staff only)."""
    return str(getattr(settings, "DISPATCH_METRICS_TOKEN", ""))


def worker_metrics_port() -> int:
    """The port each `runworker` serves its own Prometheus metrics on (0: none)."""
    return int(getattr(settings, "DISPATCH_WORKER_METRICS_PORT", 0) or 0)


def worker_metrics_addr() -> str:
    """The address the worker's metrics port binds to (loopback unless told otherwise:
    the port has no access control of its own)."""
    return str(getattr(settings, "DISPATCH_WORKER_METRICS_ADDR", "127.0.0.1") or "127.0.0.1")


def api_max_body_bytes() -> int:
    """The largest request body the HTTP API reads (bytes); a larger one is refused with
    413 before it is read."""
    return int(getattr(settings, "DISPATCH_API_MAX_BODY_BYTES", 1024 * 1024))


def api_token_max_days() -> int:
    """The longest an API token may live: the console refuses a later expiry."""
    return int(getattr(settings, "DISPATCH_API_TOKEN_MAX_DAYS", 365))


def api_wait_max_seconds() -> float:
    """The longest one long-poll (`GET runs/{id}/wait`) holds its request."""
    return float(getattr(settings, "DISPATCH_API_WAIT_MAX_SECONDS", 60.0))


def events_per_attempt() -> int:
    """The most events an attempt's log keeps (the cap, enforced in SQL); the events
    beyond it are counted on the attempt (`events_dropped`)."""
    return max(0, int(getattr(settings, "DISPATCH_EVENTS_PER_ATTEMPT", 200)))


def event_progress_seconds() -> float:
    """How often a running attempt logs a progress event (rows and bytes so far)."""
    return float(getattr(settings, "DISPATCH_EVENT_PROGRESS_SECONDS", 30.0))


def event_lock_wait_seconds() -> float:
    """A wait for a lock at least this long is logged as an event (the sink's fence)."""
    return float(getattr(settings, "DISPATCH_EVENT_LOCK_WAIT_SECONDS", 1.0))


def external_log_url() -> str:
    """A template with `{run_id}` linking the run page to an external log system
    ("": no link)."""
    return str(getattr(settings, "DISPATCH_EXTERNAL_LOG_URL", "") or "")
