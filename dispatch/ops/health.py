"""Health endpoints for orchestrators and load balancers.

- `/healthz`: the process is alive and serving (no database access, never fails while
  the site answers at all).
- `/readyz`: ready for traffic: the database answers, every dispatch/scheduling migration
  is applied, and the encryption keys decrypt the sampled stored datasource configs. Any
  failing check answers 503 with a JSON body naming each check and what is wrong (never a
  secret).
"""

from __future__ import annotations

from typing import Any

from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from dispatch.core.db import DB_ERRORS


def _database() -> str | None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except DB_ERRORS as exc:  # any database failure means not ready
        return f"database unreachable: {type(exc).__name__}"
    return None


def _migrations() -> str | None:
    from dispatch.checks import unapplied_migrations

    missing = unapplied_migrations()
    if missing:
        return f"{len(missing)} migration(s) not applied: {', '.join(missing[:5])}"
    return None


def _keys() -> str | None:
    from dispatch.checks import check_encryption_keys
    from dispatch.security import keycheck

    if errors := check_encryption_keys():
        return str(errors[0].msg)
    report = keycheck.sample()
    if report is not None and report.unreadable:
        return (
            f"{report.unreadable} of {report.sampled} sampled datasource configs cannot be "
            "decrypted with DISPATCH_ENCRYPTION_KEYS"
        )
    return None


def readiness() -> dict[str, Any]:
    """Each check's error (None: passed); the later checks are skipped without a database."""
    checks: dict[str, str | None] = {"database": _database()}
    if checks["database"] is None:
        checks["migrations"] = _migrations()
        checks["keys"] = _keys() if checks["migrations"] is None else "skipped: not migrated"
    else:
        checks["migrations"] = checks["keys"] = "skipped: no database"
    return {"ready": all(v is None for v in checks.values()), "checks": checks}


@never_cache
@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"alive": True})


@never_cache
@require_GET
def readyz(request: HttpRequest) -> JsonResponse:
    result = readiness()
    return JsonResponse(result, status=200 if result["ready"] else 503)
