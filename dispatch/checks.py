"""System checks: a worker or site never starts without a usable encryption key."""

from __future__ import annotations

from typing import Any

from django.core.checks import Error, Warning, register

from dispatch import conf


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
)


@register()
def check_time_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """dispatch.E005: an interval setting that is not a number within its bounds."""
    import math

    from django.conf import settings

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
    from django.conf import settings

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
def check_scan_lag(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    """dispatch.W001: the health scan's lag is shorter than the coordination timeout, so a
    settlement that commits late can fall behind the scan's cursor (no alert, no count)."""
    from dispatch import conf

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
