"""What the `mysql` kind's validation needs, without its driver: the spec's and config's
checks, the site's target policy, identifier quoting. The registry lists the kind and
the forms validate with it before PyMySQL is imported (connect.py, reader.py and
writer.py import it when a datasource is first connected)."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError

from dispatch.connectors.base import PermanentError, int_field
from dispatch.security import limits, targets

CONNECT_TIMEOUT_SECONDS = 10
DEFAULT_PORT = 3306
DEFAULT_STATEMENT_TIMEOUT_SECONDS = 3600
DEFAULT_LOCK_TIMEOUT_SECONDS = 10
TLS_MODES = ("preferred", "required", "verify_identity", "disabled")


def parse_table(value: Any, field: str = "table") -> tuple[str | None, str]:
    """`name` or `database.name` -> (database or None, name); each quoted with backticks."""
    if not isinstance(value, str) or not value.strip():
        raise ValidationError(f"{field}: must be a table name, 'name' or 'database.name'")
    parts = value.strip().split(".")
    if len(parts) > 2 or any(not p.strip() for p in parts):
        raise ValidationError(f"{field}: {value!r} is not 'name' or 'database.name'")
    if any("`" in p or "\x00" in p or len(p) > 64 for p in parts):
        raise ValidationError(
            f"{field}: write names without backticks, at most 64 characters each; each part "
            "is quoted for you"
        )
    return (None, parts[0].strip()) if len(parts) == 1 else (parts[0].strip(), parts[1].strip())


def ident(name: str) -> str:
    """A MySQL identifier, quoted (names are validated to hold no backtick or NUL)."""
    if "`" in name or "\x00" in name:
        raise PermanentError(f"the name {name!r} cannot be quoted")
    return f"`{name}`"


def table_sql(database: str | None, name: str) -> str:
    return f"{ident(database)}.{ident(name)}" if database else ident(name)


def policy_errors(config: dict[str, Any]) -> list[str]:
    """The site's target policy (docs/security.md): the host must be allowed, and the
    site's own database server (host and port of DATABASES) is refused unless allowed."""
    host = str(config.get("host") or "")
    problems = []
    refused = targets.host_refused(host) if host else "no host given"
    if refused:
        problems.append(refused)
    if not targets.site_database_allowed():
        from django.db import connection as site

        s = site.settings_dict
        loopback = {"", "localhost", "127.0.0.1", "::1"}

        def norm(value: Any) -> str:
            text = str(value or "").lower()
            return "localhost" if text in loopback else text

        if norm(host) == norm(s.get("HOST")) and str(config.get("port") or DEFAULT_PORT) == str(
            s.get("PORT") or 5432
        ):
            problems.append(
                "this is the site's own database server; a datasource may not use it "
                "(DISPATCH_ALLOW_SITE_DATABASE)"
            )
    return problems


def timeouts(spec: dict[str, Any]) -> tuple[int, int]:
    values = []
    for name, default, maximum in (
        (
            "statement_timeout_seconds",
            DEFAULT_STATEMENT_TIMEOUT_SECONDS,
            limits.MAX_STATEMENT_TIMEOUT_SECONDS,
        ),
        ("lock_timeout_seconds", DEFAULT_LOCK_TIMEOUT_SECONDS, limits.MAX_LOCK_TIMEOUT_SECONDS),
    ):
        int_field(spec, name, default=None, minimum=1, maximum=maximum)
        values.append(int(spec.get(name) or default))
    return values[0], values[1]


def strip_query(query: str) -> str:
    return query.strip().rstrip(";").strip()
