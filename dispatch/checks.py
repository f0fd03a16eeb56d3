"""Every system check of dispatch, and the table of their ids (`CHECK_IDS`; docs/settings.md
lists the same, a test keeps the three in step).

The site and every worker refuse to start without a usable encryption key; a host site is
told when its database is not PostgreSQL (or too old), a connector path does not import,
or (before a worker starts) the migrations are not applied.
"""

from __future__ import annotations

import re
from typing import Any

from django.conf import settings
from django.core.checks import Error, Tags, Warning, register
from django.db import DatabaseError, connections, transaction

from dispatch.core import conf

# Every check id, with what it means. A check that is added gets its row here first.
CHECK_IDS: dict[str, str] = {
    "dispatch.E001": "DISPATCH_ENCRYPTION_KEYS is empty",
    "dispatch.E002": "an entry of DISPATCH_ENCRYPTION_KEYS is not a valid Fernet key",
    "dispatch.E003": "none of the keys decrypts the sampled stored datasource configs",
    "dispatch.E004": "some sampled stored configs stay closed (a key still in use was dropped)",
    "dispatch.E005": "an interval setting is not a number within its bounds",
    "dispatch.E010": "a database the apps use is not PostgreSQL",
    "dispatch.E011": "the PostgreSQL server is older than MIN_POSTGRES",
    "dispatch.E012": "a DISPATCH_CONNECTORS entry does not import or is not a Connector",
    "dispatch.E013": "the dispatch/scheduling migrations are not all applied (runworker refuses)",
    "dispatch.E014": "DISPATCH_ALERT_WEBHOOKS or DISPATCH_ALERT_WEBHOOK_URL cannot be used",
    "dispatch.E015": "DISPATCH_LISTEN_URL cannot be used (scheme, parse, host, port, sslmode)",
    "dispatch.E016": "a DISPATCH_CSV_BASE_DIRS entry is refused itself (not absolute, or a "
    "system, Python, PATH or home directory, in one or containing one)",
    "dispatch.E017": "an entry of DISPATCH_ALERT_EMAIL_DOMAINS is neither a domain nor '*'",
    "dispatch.E018": "DISPATCH_APPLY_ENV_PREFIX or DISPATCH_APPLY_SECRET_DIRS cannot be used",
    "dispatch.E019": "DISPATCH_API_MAX_BODY_BYTES or DISPATCH_API_TOKEN_MAX_DAYS is not a whole "
    "number within its bounds",
    "dispatch.E020": "a DISPATCH_PARQUET_BASE_DIRS entry is refused itself (not absolute, or a "
    "system, Python, PATH or home directory, in one or containing one)",
    "dispatch.E021": "DISPATCH_EXTERNAL_LOG_URL is not an http(s) URL template whose only "
    "placeholder is {run_id}, or DISPATCH_EVENTS_PER_ATTEMPT is not a whole number within its "
    "bounds",
    "dispatch.E022": "a bulk operation setting is not a number within its bounds",
    "dispatch.W001": "DISPATCH_HEALTH_SCAN_LAG is shorter than DISPATCH_COORDINATION_TIMEOUT",
    "dispatch.W002": "stored alert addresses of bindings are outside DISPATCH_ALERT_EMAIL_DOMAINS",
    "dispatch.W003": "another app's command of the same name wins over runworker, trigger, ...",
}

# Django 5.2 itself needs PostgreSQL 14; the SQL functions need nothing newer.
MIN_POSTGRES = (14, 0)
APPS = ("dispatch", "scheduling")


@register()
def check_encryption_keys(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    from cryptography.fernet import Fernet

    keys = conf.encryption_keys()
    if not keys:
        return [
            Error(
                "DISPATCH_ENCRYPTION_KEYS is empty: datasource credentials cannot be encrypted.",
                hint="Set DISPATCH_ENCRYPTION_KEYS to one or more comma-separated Fernet keys "
                "(newest first). Generate one with: python -c "
                "'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())'",
                id="dispatch.E001",
            )
        ]
    errors = []
    for position, key in enumerate(keys, start=1):
        try:
            Fernet(key)
        except (ValueError, TypeError):
            errors.append(
                Error(
                    f"DISPATCH_ENCRYPTION_KEYS entry {position} is not a valid Fernet key.",
                    hint="A Fernet key is 32 url-safe base64-encoded bytes (44 characters).",
                    id="dispatch.E002",
                )
            )
    return errors


@register()
def check_keys_open_stored_configs(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """dispatch.E003: well-formed keys that open none of the sampled stored configs (a
    wrong key); dispatch.E004: some sampled configs stay closed (a key still in use was
    dropped from the list). Both stop `runworker` and the site at start-up."""
    from dispatch.security import keycheck

    if check_encryption_keys():
        return []  # E001/E002 already say what is wrong
    report = keycheck.sample()
    if report is None or report.sampled == 0 or report.unreadable == 0:
        return []
    hint = (
        "Set DISPATCH_ENCRYPTION_KEYS to the keys the datasources were encrypted with "
        "(during a rotation, keep the old key at the end of the list until rotate_keys ran)."
    )
    if report.none_open:
        return [
            Error(
                f"None of the DISPATCH_ENCRYPTION_KEYS decrypts the stored datasource configs "
                f"({report.sampled} sampled).",
                hint=hint,
                id="dispatch.E003",
            )
        ]
    return [
        Error(
            f"{report.unreadable} of {report.sampled} sampled datasource configs cannot be "
            "decrypted with DISPATCH_ENCRYPTION_KEYS.",
            hint=hint,
            id="dispatch.E004",
        )
    ]


# Interval settings that reach time arithmetic (sleeps, SQL intervals): (name, minimum,
# maximum, default). Past the maximum, a typo (1e300) would overflow a timestamp.
TIME_SETTINGS = (
    ("DISPATCH_POLL_INTERVAL", 0.01, 3_600.0, 2.0),
    ("DISPATCH_RECOVERY_INTERVAL", 0.01, 3_600.0, 5.0),
    ("DISPATCH_SHUTDOWN_GRACE_SECONDS", 0.0, 86_400.0, 10.0),
    ("DISPATCH_MISFIRE_GRACE_SECONDS", 0.0, 7 * 86_400.0, 60.0),
    ("DISPATCH_LISTEN_PROBE_INTERVAL", 0.1, 86_400.0, 30.0),
    ("DISPATCH_LISTEN_PROBE_TIMEOUT", 0.1, 3_600.0, 5.0),
    ("DISPATCH_API_WAIT_MAX_SECONDS", 0.0, 3_600.0, 60.0),
    ("DISPATCH_EVENT_PROGRESS_SECONDS", 1.0, 86_400.0, 30.0),
    ("DISPATCH_EVENT_LOCK_WAIT_SECONDS", 0.0, 3_600.0, 1.0),
)

# The bulk operations' settings: (name, minimum, maximum, default, whole number).
BULK_SETTINGS = (
    ("DISPATCH_BULK_BATCH", 1, 10_000, 200, True),
    ("DISPATCH_BULK_BUDGET", 0.1, 3_600.0, 5.0, False),
    ("DISPATCH_BULK_INTERVAL", 0.1, 86_400.0, 30.0, False),
    ("DISPATCH_BULK_RETENTION_DAYS", 1.0, 36_500.0, 90.0, False),
)


@register()
def check_bulk_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """dispatch.E022: a bulk operation setting that is not a number within its bounds (a
    batch of 0 rows would never end its operation)."""
    errors = []
    for name, low, high, default, whole in BULK_SETTINGS:
        value = getattr(settings, name, default)
        number = (
            value
            if isinstance(value, int | float) and not isinstance(value, bool)
            else float("nan")
        )
        if (whole and not isinstance(value, int)) or not low <= number <= high:
            kind = "a whole number" if whole else "a number"
            errors.append(
                Error(
                    f"{name} is {value!r}; it must be {kind} from {low:g} to {high:g}.",
                    id="dispatch.E022",
                )
            )
    return errors


# The HTTP API's whole-number settings: (name, minimum, maximum, default).
API_SETTINGS = (
    ("DISPATCH_API_MAX_BODY_BYTES", 1_024, 1 << 30, 1 << 20),
    ("DISPATCH_API_TOKEN_MAX_DAYS", 1, 3_650, 365),
)


@register()
def check_api_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """dispatch.E019: an HTTP API setting that is not a whole number within its bounds."""
    errors = []
    for name, low, high, default in API_SETTINGS:
        value = getattr(settings, name, default)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            errors.append(
                Error(
                    f"{name} is {value!r}; it must be a whole number from {low} to {high}.",
                    id="dispatch.E019",
                )
            )
    return errors


@register()
def check_time_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """dispatch.E005: an interval setting that is not a number within its bounds."""
    import math

    errors = []
    for name, low, high, default in TIME_SETTINGS:
        value = getattr(settings, name, default)
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not (low <= number <= high):
            errors.append(
                Error(
                    f"{name} is {value!r}; it must be a number of seconds from {low:g} "
                    f"to {high:g}.",
                    id="dispatch.E005",
                )
            )
    return errors


# The most events an attempt may keep (DISPATCH_EVENTS_PER_ATTEMPT): a run page shows
# them all.
MAX_EVENTS_PER_ATTEMPT = 10_000


def external_log_url_problem(template: Any) -> str:
    """Why `template` cannot be DISPATCH_EXTERNAL_LOG_URL ("" if it can): an http(s) URL
    whose only placeholder is `{run_id}` (a stray brace, another name, a format spec or
    an attribute would fail or leak at render time)."""
    import string
    from urllib.parse import urlsplit

    if not isinstance(template, str):
        return "it is not a string"
    try:
        fields = [
            (name, spec, conversion)
            for _, name, spec, conversion in string.Formatter().parse(template)
            if name is not None
        ]
    except ValueError as exc:
        return f"it is not a valid template ({exc})"
    if not fields:
        return "it has no {run_id} placeholder"
    if any(f != ("run_id", "", None) for f in fields):
        return "its only placeholder may be {run_id} (no other name, format or conversion)"
    parts = urlsplit(template.replace("{run_id}", "0"))
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return "it is not an http:// or https:// URL with a host"
    return ""


@register()
def check_event_log_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """dispatch.E021: the event log's link to an external log system and its cap."""
    errors = []
    template = getattr(settings, "DISPATCH_EXTERNAL_LOG_URL", "")
    if template:
        problem = external_log_url_problem(template)
        if problem:
            errors.append(
                Error(
                    f"DISPATCH_EXTERNAL_LOG_URL cannot be used: {problem}.",
                    hint="Set it to a URL such as https://logs.example.com/search?q={run_id}, "
                    "or leave it empty for no link.",
                    id="dispatch.E021",
                )
            )
    cap = getattr(settings, "DISPATCH_EVENTS_PER_ATTEMPT", 200)
    if isinstance(cap, bool) or not isinstance(cap, int) or not 0 <= cap <= MAX_EVENTS_PER_ATTEMPT:
        errors.append(
            Error(
                f"DISPATCH_EVENTS_PER_ATTEMPT is {cap!r}; it must be a whole number from 0 to "
                f"{MAX_EVENTS_PER_ATTEMPT}.",
                id="dispatch.E021",
            )
        )
    return errors


def webhook_url_problem(url: Any) -> str:
    """Why `url` cannot be a webhook's ("" if it can), never quoting it."""
    from urllib.parse import urlsplit

    text = str(url or "")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in text):
        return "its url holds whitespace or control characters"
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises for a malformed port
    except ValueError:
        return "its url does not parse"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "its url must be an http(s) URL with a host"
    if parts.username is not None or parts.password is not None:
        return "its url must not hold a user or password (send a token in the path or sign)"
    return ""


@register()
def check_alert_webhooks(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """dispatch.E014: DISPATCH_ALERT_WEBHOOKS is not a mapping of names to
    {"url": "http(s)://...", "secret": "..."}, or a webhook URL (those, or
    DISPATCH_ALERT_WEBHOOK_URL) cannot be used. Messages name the setting, never the URL:
    it may hold a token."""
    hint = 'Set it to {"name": {"url": "https://...", "secret": "..."}, ...}.'
    errors = []
    default = getattr(settings, "DISPATCH_ALERT_WEBHOOK_URL", "") or ""
    if default and (problem := webhook_url_problem(default)):
        errors.append(
            Error(f"DISPATCH_ALERT_WEBHOOK_URL: {problem}.", id="dispatch.E014"),
        )
    configured = getattr(settings, "DISPATCH_ALERT_WEBHOOKS", None) or {}
    if not isinstance(configured, dict):
        return [
            *errors,
            Error("DISPATCH_ALERT_WEBHOOKS must be a dict.", hint=hint, id="dispatch.E014"),
        ]
    for name, hook in configured.items():
        problem = ""
        if not isinstance(name, str) or not name or len(name) > 40 or ":" in name:
            problem = "its name must be 1 to 40 characters without ':'"
        elif not isinstance(hook, dict) or set(hook) - {"url", "secret"}:
            problem = 'it must be a dict with the keys "url" and (optionally) "secret"'
        else:
            problem = webhook_url_problem(hook.get("url"))
        if problem:
            errors.append(
                Error(
                    f"DISPATCH_ALERT_WEBHOOKS[{str(name)[:40]!r}]: {problem}.",
                    hint=hint,
                    id="dispatch.E014",
                )
            )
    return errors


@register()
def check_listen_url(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """dispatch.E015: DISPATCH_LISTEN_URL is not a postgres:// URL libpq can use (it does
    not parse, e.g. a bad percent-escape in the password; no host; a bad port or sslmode).
    Workers and reconcilers would otherwise retry it, and log libpq's error, for ever. The
    message names the setting and the problem, never the URL: it holds a password."""
    url = conf.listen_url()
    if not url:
        return []
    try:
        conf.parse_listen_url(url)
    except ValueError as exc:
        return [
            Error(
                f"DISPATCH_LISTEN_URL cannot be used: {exc}.",
                hint="Set it to postgres://USER:PASSWORD@HOST:PORT/NAME of the PostgreSQL "
                "server itself, with special characters of the password percent-encoded "
                "(%40 for @, %25 for %).",
                id="dispatch.E015",
            )
        ]
    return []


# A domain as it follows an address's @: dot-separated labels of letters, digits and
# hyphens (any script: an address may be internationalised), none starting or ending with
# a hyphen.
_LABEL = r"(?!-)[^\W_](?:[\w-]{0,61}[^\W_])?"
DOMAIN = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")


@register()
def check_alert_email_domains(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """dispatch.E017: an entry of DISPATCH_ALERT_EMAIL_DOMAINS that is neither a domain
    nor "*" (`@example.com`, `*.example.com`): no address is ever at it, so the bindings
    the site meant to allow would get none of their alerts."""
    errors = []
    for entry in sorted(conf.alert_email_domains()):
        if entry == conf.ANY_DOMAIN or DOMAIN.fullmatch(entry):
            continue
        errors.append(
            Error(
                f"DISPATCH_ALERT_EMAIL_DOMAINS entry {entry[:100]!r} is not a domain: no "
                "address is at it.",
                hint="List domains as they follow the @ (example.com; a subdomain is an "
                'entry of its own), or "*" alone for any domain.',
                id="dispatch.E017",
            )
        )
    return errors


# Health rows with addresses the stored-addresses check reads at most.
STORED_ADDRESSES_CHECKED = 10_000


@register(Tags.database)
def check_stored_alert_addresses(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[Warning]:
    """dispatch.W002: bindings whose stored alert addresses DISPATCH_ALERT_EMAIL_DOMAINS
    does not allow (stored before it narrowed, or written past the form). Those addresses
    get no alert; the binding's alerts go to its other addresses, else the site's ADMINS.
    A database check (`check --database default`, `migrate`): it reads the health rows."""
    from dispatch.models.ops import BindingHealth, alert_addresses, domain_allowed

    if "default" not in (databases or []):
        return []
    domains = conf.alert_email_domains()
    rows = BindingHealth.objects.exclude(alert_emails="").values_list("alert_emails", flat=True)
    try:
        # A savepoint inside a caller's transaction: a missing table must not abort it.
        with transaction.atomic():
            stored = list(rows[:STORED_ADDRESSES_CHECKED])
    except DatabaseError:
        return []  # not migrated yet: nothing stored to judge
    refused = sum(
        1
        for text in stored
        if any(not domain_allowed(address, domains) for address in alert_addresses(text))
    )
    if not refused:
        return []
    allowed = ", ".join(sorted(domains)) or "none, it is empty"
    return [
        Warning(
            f"{refused} binding(s) have alert addresses outside DISPATCH_ALERT_EMAIL_DOMAINS "
            f"({allowed}): those addresses get none of the alerts, which go to the "
            "binding's other addresses, else the site's ADMINS.",
            hint='List the domains the site trusts in DISPATCH_ALERT_EMAIL_DOMAINS ("*": any), '
            "or change the addresses on the bindings' pages.",
            id="dispatch.W002",
        )
    ]


@register()
def check_csv_base_dirs(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """dispatch.E016: a DISPATCH_CSV_BASE_DIRS entry the CSV connector refuses anyway (not
    absolute; a system tree, a directory Python imports from, a PATH directory or the
    home directory, inside one or containing one). It allows no CSV datasource, and the
    operator learns it at start-up rather than from the first refused datasource."""
    from dispatch.connectors import csv
    from dispatch.security import paths

    places = paths.protected()
    errors = []
    for root in conf.csv_base_dirs():
        problem = csv.root_problem(root, places)
        if problem:
            errors.append(
                Error(
                    f"DISPATCH_CSV_BASE_DIRS entry {root!r} {problem}: it allows no CSV "
                    "datasource.",
                    hint="List absolute directories that hold only data files, outside the "
                    "system's trees, the Python installation and the project, PATH and the "
                    "home directory of the user the site and its workers run as (e.g. "
                    '/srv/dispatch/csv); see docs/security.md, "CSV files".',
                    id="dispatch.E016",
                )
            )
    return errors


@register()
def check_parquet_base_dirs(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """dispatch.E020: a DISPATCH_PARQUET_BASE_DIRS entry the parquet connector refuses
    anyway (the rules of dispatch.E016)."""
    from dispatch.connectors import csv
    from dispatch.security import paths

    places = paths.protected()
    errors = []
    for root in conf.parquet_base_dirs():
        problem = csv.root_problem(root, places)
        if problem:
            errors.append(
                Error(
                    f"DISPATCH_PARQUET_BASE_DIRS entry {root!r} {problem}: it allows no "
                    "Parquet datasource.",
                    hint="List absolute directories that hold only data files, outside the "
                    "system's trees, the Python installation and the project, PATH and the "
                    "home directory of the user the site and its workers run as (e.g. "
                    '/srv/dispatch/parquet); see docs/security.md, "CSV files".',
                    id="dispatch.E020",
                )
            )
    return errors


@register()
def check_apply_secret_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """dispatch.E018: where definition files may take secrets from is unsafe: an env
    prefix that covers the site's own secret variables (or is no name), or a secrets
    directory that is relative or a system directory. Definition files can be applied
    over HTTP, and a datasource sends its secrets to the host its config names."""
    from dispatch.security import secretrefs

    errors = []
    problem = secretrefs.prefix_problem(conf.apply_env_prefix())
    if problem:
        errors.append(
            Error(
                f"DISPATCH_APPLY_ENV_PREFIX cannot be used: {problem}.",
                hint="Use a prefix only datasource secrets carry, e.g. DISPATCH_SECRET_ "
                "(empty: env: references are off).",
                id="dispatch.E018",
            )
        )
    for path in conf.apply_secret_dirs():
        problem = secretrefs.dir_problem(path)
        if problem:
            errors.append(
                Error(
                    f"DISPATCH_APPLY_SECRET_DIRS cannot be used: {problem}.",
                    hint="List only directories that hold secrets for datasources, e.g. "
                    "/run/secrets/dispatch.",
                    id="dispatch.E018",
                )
            )
    return errors


@register()
def check_scan_lag(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    """dispatch.W001: the health scan's lag is shorter than the coordination timeout, so a
    settlement that commits late can fall behind the scan's cursor (no alert, no count)."""
    lag, timeout = conf.health_scan_lag(), conf.coordination_timeout()
    if timeout > 0 and lag < timeout:
        return [
            Warning(
                f"DISPATCH_HEALTH_SCAN_LAG ({lag:g} s) is shorter than "
                f"DISPATCH_COORDINATION_TIMEOUT ({timeout:g} s): a run whose settlement "
                "commits later than the lag is never seen by the health scan (no failure "
                "alert) nor counted in the metrics.",
                hint="Set DISPATCH_HEALTH_SCAN_LAG to at least the coordination timeout.",
                id="dispatch.W001",
            )
        ]
    return []


@register()
def check_command_names(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    """dispatch.W003: a command of dispatch (or of an app built on it) is taken by another
    app listed before it in INSTALLED_APPS (Django runs the first app's; Channels has a
    `runworker`). `manage.py dispatch SUBCOMMAND` always reaches dispatch's."""
    from django.core.management import get_commands

    from dispatch.core import commands

    winners = get_commands()
    warnings = []
    for name, (app, command) in commands.subcommands().items():
        winner = winners.get(command)
        if winner is None or winner == app:
            continue
        warnings.append(
            Warning(
                f"`manage.py {command}` runs the command of the app {winner}, not the "
                f"one of {app}: {winner} is listed before {app} in INSTALLED_APPS.",
                hint=f"Run `manage.py dispatch {name}` instead: it always runs the one of {app}.",
                id="dispatch.W003",
            )
        )
    return warnings


@register(Tags.database)
def check_postgresql_version(app_configs: Any = None, databases: Any = None, **kwargs: Any):  # type: ignore[no-untyped-def]
    errors: list[Error] = []
    for alias in databases or []:
        conn = connections[alias]
        if conn.vendor != "postgresql":
            continue  # E010 says so
        try:
            version = conn.pg_version  # type: ignore[attr-defined]
        except DatabaseError:
            continue  # unreachable: the command that needs it reports that itself
        major, minor = divmod(int(version), 10000)
        if (major, minor) < MIN_POSTGRES:
            errors.append(
                Error(
                    f"Database {alias!r} is PostgreSQL {major}.{minor}; dispatch needs "
                    f"{MIN_POSTGRES[0]} or newer.",
                    id="dispatch.E011",
                )
            )
    return errors


@register()
def check_database_engine(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    engine = settings.DATABASES.get("default", {}).get("ENGINE", "")
    if engine.endswith("postgresql") or engine.endswith("postgis"):
        return []
    return [
        Error(
            f"dispatch needs PostgreSQL; DATABASES['default'] uses {engine or 'no engine'!r}.",
            hint="Set ENGINE to 'django.db.backends.postgresql' (PostgreSQL "
            f"{MIN_POSTGRES[0]} or newer): leases, fencing and wake-ups are PostgreSQL "
            "functions, LISTEN/NOTIFY and row locks.",
            id="dispatch.E010",
        )
    ]


@register()
def check_connector_paths(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    from django.utils.module_loading import import_string

    from dispatch.connectors.base import Connector

    errors = []
    for path in conf.extra_connectors():
        try:
            cls = import_string(path)
        except ImportError as exc:
            errors.append(
                Error(
                    f"DISPATCH_CONNECTORS entry {path!r} cannot be imported: {exc}",
                    hint="Use the dotted path of a dispatch.connectors.base.Connector "
                    "subclass, e.g. 'mysite.connectors.S3Connector'.",
                    id="dispatch.E012",
                )
            )
            continue
        if not (isinstance(cls, type) and issubclass(cls, Connector)):
            errors.append(
                Error(
                    f"DISPATCH_CONNECTORS entry {path!r} is not a "
                    "dispatch.connectors.base.Connector subclass.",
                    id="dispatch.E012",
                )
            )
    return errors


def unapplied_migrations(alias: str = "default") -> list[str]:
    """The dispatch/scheduling migrations not applied on `alias` ("app.name" each)."""
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connections[alias])
    targets = [key for key in executor.loader.graph.leaf_nodes() if key[0] in APPS]
    plan = executor.migration_plan(targets)
    return [f"{m.app_label}.{m.name}" for m, _ in plan if m.app_label in APPS]


def migrations_error(alias: str = "default") -> Error | None:
    """dispatch.E013 when migrations are missing (None when all are applied)."""
    missing = unapplied_migrations(alias)
    if not missing:
        return None
    shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
    return Error(
        f"The database is not migrated: {len(missing)} migration(s) not applied ({shown}).",
        hint="Run `manage.py migrate` first, then start the worker again.",
        id="dispatch.E013",
    )
