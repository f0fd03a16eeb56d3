"""Settings of the runnable dispatch site.

This is the only module that reads the environment (through django-environ). A
`.env` file at the project root, written by `make run`, is read first; real
environment variables win over it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import environ
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)


def _float(name: str, default: float) -> float:
    raw = env.str(name, default=str(default))
    try:
        return float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number, got {raw!r}") from None


def _json(name: str, default: Any) -> Any:
    raw = env.str(name, default="")
    if not raw.strip():
        return default
    try:
        return json.loads(raw)
    except ValueError as exc:
        # The position only: the value may hold a secret.
        raise ImproperlyConfigured(
            f"{name} must be JSON (line {getattr(exc, 'lineno', '?')}, "
            f"column {getattr(exc, 'colno', '?')})"
        ) from None


DEBUG = env.bool("DEBUG", default=False)
SECRET_KEY = env.str("SECRET_KEY", default="")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured(
            "SECRET_KEY is not set. Set it in the environment or in .env "
            "(`make run` writes a .env with a fresh one)."
        )
    SECRET_KEY = "insecure-development-only-key"
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["127.0.0.1", "localhost"])

# --- HTTPS deployment (`manage.py check --deploy`) --------------------------------------
# HTTPS=true turns on everything a site served over HTTPS wants; each setting can still be
# set on its own. Off by default: `make run` serves plain HTTP on 127.0.0.1.
HTTPS = env.bool("HTTPS", default=False)
SECURE_SSL_REDIRECT = env.bool("SECURE_SSL_REDIRECT", default=HTTPS)
SECURE_HSTS_SECONDS = env.int("SECURE_HSTS_SECONDS", default=31_536_000 if HTTPS else 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", default=HTTPS)
SECURE_HSTS_PRELOAD = env.bool("SECURE_HSTS_PRELOAD", default=False)
SESSION_COOKIE_SECURE = env.bool("SESSION_COOKIE_SECURE", default=HTTPS)
CSRF_COOKIE_SECURE = env.bool("CSRF_COOKIE_SECURE", default=HTTPS)
# e.g. https://dispatch.example.com (scheme included), comma-separated.
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])
# Behind a TLS-terminating proxy: the header it sets and the value that means HTTPS,
# e.g. SECURE_PROXY_SSL_HEADER=HTTP_X_FORWARDED_PROTO,https. Only set it when the proxy
# always sets (and overwrites) that header.
_proxy_header = env.list("SECURE_PROXY_SSL_HEADER", default=[])
if _proxy_header:
    if len(_proxy_header) != 2 or not _proxy_header[0].startswith("HTTP_"):
        raise ImproperlyConfigured(
            "SECURE_PROXY_SSL_HEADER must be HEADER,VALUE with a META name, "
            "e.g. HTTP_X_FORWARDED_PROTO,https"
        )
    SECURE_PROXY_SSL_HEADER = (_proxy_header[0], _proxy_header[1])

if "DATABASE_URL" not in env:
    raise ImproperlyConfigured(
        "DATABASE_URL is not set, e.g. postgres://user:password@127.0.0.1:5432/dispatch. "
        "`make run` and `make test` set it (to an embedded PostgreSQL when unset)."
    )
DATABASES = {"default": env.db_url("DATABASE_URL")}
if not DATABASES["default"]["ENGINE"].endswith("postgresql"):
    raise ImproperlyConfigured("dispatch needs PostgreSQL: DATABASE_URL must be a postgres:// URL.")
DATABASES["default"].setdefault("OPTIONS", {})
DATABASES["default"]["OPTIONS"].setdefault("application_name", "dispatch")
# A worker must notice a dead network in seconds, not at the kernel's TCP timeout (hours):
# bounded connects, TCP keepalives, and a cap on unacknowledged sends.
for _option, _value in {
    "connect_timeout": env.int("DATABASE_CONNECT_TIMEOUT", default=10),
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
    "tcp_user_timeout": 60_000,
}.items():
    DATABASES["default"]["OPTIONS"].setdefault(_option, _value)
DATABASES["default"]["CONN_MAX_AGE"] = env.int("CONN_MAX_AGE", default=0)

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "dispatch",
    "scheduling",
    # This site's own app: the demo and test commands (seed_demo, chaos), which a host
    # site installing the package never gets.
    "project",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "project.urls"
WSGI_APPLICATION = "project.wsgi.application"
ASGI_APPLICATION = "project.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / ".data" / "static"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- dispatch -------------------------------------------------------------------------
# Comma-separated Fernet keys, newest first. Checked at start-up (dispatch.E001/E002).
DISPATCH_ENCRYPTION_KEYS = env.list("DISPATCH_ENCRYPTION_KEYS", default=[])
DISPATCH_CHANNEL = env.str("DISPATCH_CHANNEL", default="dispatch_runs")
DISPATCH_POLL_INTERVAL = _float("DISPATCH_POLL_INTERVAL", 2.0)
DISPATCH_IDLE_HEARTBEAT_SECONDS = _float("DISPATCH_IDLE_HEARTBEAT_SECONDS", 10.0)
DISPATCH_RECOVERY_INTERVAL = _float("DISPATCH_RECOVERY_INTERVAL", 60.0)
DISPATCH_SHUTDOWN_GRACE_SECONDS = _float("DISPATCH_SHUTDOWN_GRACE_SECONDS", 10.0)
DISPATCH_COORDINATION_TIMEOUT = _float("DISPATCH_COORDINATION_TIMEOUT", 10.0)
DISPATCH_CONNECTOR_PROBE_SECONDS = _float("DISPATCH_CONNECTOR_PROBE_SECONDS", 15.0)
DISPATCH_MISFIRE_GRACE_SECONDS = _float("DISPATCH_MISFIRE_GRACE_SECONDS", 60.0)
DISPATCH_SCHEDULE_CHANNEL = env.str("DISPATCH_SCHEDULE_CHANNEL", default="dispatch_schedules")
DISPATCH_CONNECTORS = env.list("DISPATCH_CONNECTORS", default=[])
# LISTEN connections direct to PostgreSQL when DATABASE_URL goes through a
# transaction-pooling proxy (docs/deployment.md); unset: the DATABASE_URL server.
DISPATCH_LISTEN_URL = env.str("DISPATCH_LISTEN_URL", default="")
if DISPATCH_LISTEN_URL:
    if not DISPATCH_LISTEN_URL.startswith(("postgres://", "postgresql://")):
        raise ImproperlyConfigured(
            "DISPATCH_LISTEN_URL must be a postgres:// URL of the PostgreSQL server itself."
        )
    # The working connections may be pooled per transaction: Django's server-side cursors
    # (WITH HOLD in autocommit) would outlive their transaction there.
    DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True
DISPATCH_LISTEN_PROBE_INTERVAL = _float("DISPATCH_LISTEN_PROBE_INTERVAL", 60.0)
DISPATCH_LISTEN_PROBE_TIMEOUT = _float("DISPATCH_LISTEN_PROBE_TIMEOUT", 5.0)
# Directories csv datasources' base_dir must lie in (comma-separated); empty: CSV
# datasources are disabled (docs/security.md).
DISPATCH_CSV_BASE_DIRS = env.list("DISPATCH_CSV_BASE_DIRS", default=[])
# The same for parquet datasources; empty: Parquet datasources are disabled.
DISPATCH_PARQUET_BASE_DIRS = env.list("DISPATCH_PARQUET_BASE_DIRS", default=[])
# Definition files (docs/as-code.md): the environment variables and directories their
# secret references may name.
DISPATCH_APPLY_ENV_PREFIX = env.str("DISPATCH_APPLY_ENV_PREFIX", default="DISPATCH_SECRET_")
DISPATCH_APPLY_SECRET_DIRS = env.list("DISPATCH_APPLY_SECRET_DIRS", default=[])
# Hosts database datasources may connect to (comma-separated): * (any TCP host),
# names, *.domain, addresses, networks (10.0.0.0/8), socket directories (/run/postgresql).
# Default *: any TCP host, no Unix sockets (docs/security.md).
DISPATCH_DATASOURCE_HOSTS = env.list("DISPATCH_DATASOURCE_HOSTS", default=["*"])
# The site's own database as a datasource: refused unless true.
DISPATCH_ALLOW_SITE_DATABASE = env.bool("DISPATCH_ALLOW_SITE_DATABASE", default=False)
# `query` sources refuse a superuser or otherwise privileged role unless false.
DISPATCH_QUERY_SOURCE_LEAST_PRIVILEGE = env.bool(
    "DISPATCH_QUERY_SOURCE_LEAST_PRIVILEGE", default=True
)


# Operations (docs/operations.md): retention.
def _days(name: str, default: float) -> float | None:
    """Days, or None for "never" (an empty value or the word never)."""
    raw = env.str(name, default=str(default)).strip()
    if raw.lower() in ("", "never"):
        return None
    value = _float(name, default)
    if value < 0:
        raise ImproperlyConfigured(f"{name} must be zero or more days, got {raw!r}")
    return value


DISPATCH_RETENTION_DAYS = {
    "SUCCEEDED": _days("DISPATCH_RETENTION_SUCCEEDED_DAYS", 14),
    "FAILED": _days("DISPATCH_RETENTION_FAILED_DAYS", 90),
    "CANCELLED": _days("DISPATCH_RETENTION_CANCELLED_DAYS", 90),
}
DISPATCH_RETENTION_BATCH = env.int("DISPATCH_RETENTION_BATCH", default=500)
DISPATCH_RETENTION_INTERVAL = _float("DISPATCH_RETENTION_INTERVAL", 300.0)
DISPATCH_MAINTENANCE = env.bool("DISPATCH_MAINTENANCE", default=True)
DISPATCH_BULK_BATCH = env.int("DISPATCH_BULK_BATCH", default=200)
DISPATCH_BULK_RETENTION_DAYS = _float("DISPATCH_BULK_RETENTION_DAYS", 90.0)
DISPATCH_BULK_BUDGET = _float("DISPATCH_BULK_BUDGET", 5.0)
DISPATCH_BULK_INTERVAL = _float("DISPATCH_BULK_INTERVAL", 30.0)
# Alerts and auto-disable (docs/operations.md). The webhook's secret is read from the
# environment only, never from a file in the repository.
DISPATCH_HEALTH_INTERVAL = _float("DISPATCH_HEALTH_INTERVAL", 60.0)
DISPATCH_WARN_FAILURES = env.int("DISPATCH_WARN_FAILURES", default=20)
DISPATCH_WARN_DAYS = _float("DISPATCH_WARN_DAYS", 4.0)
DISPATCH_AUTO_DISABLE_FAILURES = env.int("DISPATCH_AUTO_DISABLE_FAILURES", default=30)
DISPATCH_AUTO_DISABLE_DAYS = _float("DISPATCH_AUTO_DISABLE_DAYS", 7.0)
DISPATCH_ALERT_WEBHOOK_URL = env.str("DISPATCH_ALERT_WEBHOOK_URL", default="")
DISPATCH_ALERT_WEBHOOK_SECRET = env.str("DISPATCH_ALERT_WEBHOOK_SECRET", default="")
DISPATCH_ALERT_RATE_LIMIT = env.int("DISPATCH_ALERT_RATE_LIMIT", default=10)
# Named webhooks a binding may pick for its alerts, as JSON:
# {"team-a": {"url": "https://...", "secret": "..."}} (system check dispatch.E014).
DISPATCH_ALERT_WEBHOOKS = _json("DISPATCH_ALERT_WEBHOOKS", {})
# Domains a binding's own alert addresses may be at; "*": any; empty: none (ADMINS only).
DISPATCH_ALERT_EMAIL_DOMAINS = env.list("DISPATCH_ALERT_EMAIL_DOMAINS", default=[])
# The attempts' event logs (docs/settings.md): the cap, the progress interval, the lock
# waits worth an event, and a link from the run page to an external log system.
DISPATCH_EVENTS_PER_ATTEMPT = env.int("DISPATCH_EVENTS_PER_ATTEMPT", default=200)
DISPATCH_EVENT_PROGRESS_SECONDS = _float("DISPATCH_EVENT_PROGRESS_SECONDS", 30.0)
DISPATCH_EVENT_LOCK_WAIT_SECONDS = _float("DISPATCH_EVENT_LOCK_WAIT_SECONDS", 1.0)
DISPATCH_EXTERNAL_LOG_URL = env.str("DISPATCH_EXTERNAL_LOG_URL", default="")
ADMINS = [("", a.strip()) for a in env.str("DISPATCH_ADMINS", default="").split(",") if a.strip()]
DISPATCH_METRICS_PATH = env.str("DISPATCH_METRICS_PATH", default="metrics")
DISPATCH_METRICS_TOKEN = env.str("DISPATCH_METRICS_TOKEN", default="")
# Each runworker's own metrics port (0: none); loopback unless told otherwise.
DISPATCH_WORKER_METRICS_PORT = env.int("DISPATCH_WORKER_METRICS_PORT", default=0)
DISPATCH_WORKER_METRICS_ADDR = env.str("DISPATCH_WORKER_METRICS_ADDR", default="127.0.0.1")

LOG_LEVEL = env.str("LOG_LEVEL", default="INFO")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "dispatch": {"handlers": ["console"], "level": LOG_LEVEL, "propagate": False},
        "scheduling": {"handlers": ["console"], "level": LOG_LEVEL, "propagate": False},
    },
}
