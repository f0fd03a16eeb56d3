"""Numbers that reach time arithmetic are bounded by the model and by the database."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from dispatch.connectors.postgresql import PostgreSQLConnector
from dispatch.models import Job
from dispatch.security import limits
from tests.support.factories import JobFactory

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("backoff_seconds", 1e300),
        ("backoff_max_seconds", 1e300),
        ("timeout_seconds", 10**9),
        ("lease_seconds", 10**9),
        ("max_attempts", 10**6),
    ],
)
def test_job__huge_time_values_are_a_field_error_and_a_database_check(field, value):
    job = JobFactory(backoff_seconds=1, backoff_max_seconds=1)
    setattr(job, field, value)
    if field == "backoff_seconds":
        job.backoff_max_seconds = value
    with pytest.raises(ValidationError) as exc:
        job.full_clean()
    assert field in exc.value.message_dict
    assert "less than or equal" in " ".join(exc.value.message_dict[field])
    # A bulk update (no model validation) meets the CHECK constraint.
    with pytest.raises(IntegrityError, match="dispatch_job_"), transaction.atomic():
        Job.objects.filter(pk=job.pk).update(**{field: value})


def test_job__bounds_themselves_are_accepted():
    job = JobFactory(
        backoff_seconds=limits.MAX_BACKOFF_SECONDS,
        backoff_max_seconds=limits.MAX_BACKOFF_SECONDS,
        timeout_seconds=limits.MAX_TIMEOUT_SECONDS,
        lease_seconds=limits.MAX_LEASE_SECONDS,
    )
    job.full_clean()


@pytest.mark.parametrize(
    ("name", "maximum"),
    [
        ("statement_timeout_seconds", limits.MAX_STATEMENT_TIMEOUT_SECONDS),
        ("lock_timeout_seconds", limits.MAX_LOCK_TIMEOUT_SECONDS),
    ],
)
def test_postgresql_spec__timeouts_have_a_maximum(name, maximum):
    PostgreSQLConnector.validate_source_spec({"table": "t", name: maximum})
    with pytest.raises(ValidationError, match=f"{name}: must be at most"):
        PostgreSQLConnector.validate_source_spec({"table": "t", name: maximum + 1})
    with pytest.raises(ValidationError, match=f"{name}: must be at most"):
        PostgreSQLConnector.validate_sink_spec({"table": "t", "mode": "append", name: 10**12})


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("DISPATCH_POLL_INTERVAL", 0.0),
        ("DISPATCH_RECOVERY_INTERVAL", 1e300),
        ("DISPATCH_SHUTDOWN_GRACE_SECONDS", float("nan")),
        ("DISPATCH_MISFIRE_GRACE_SECONDS", -1.0),
        ("DISPATCH_LISTEN_PROBE_INTERVAL", 0.0),
        ("DISPATCH_LISTEN_PROBE_TIMEOUT", 1e300),
    ],
)
def test_check__interval_settings_out_of_bounds_are_errors(name, value):
    from django.test import override_settings

    from dispatch import checks

    assert checks.check_time_settings() == []
    with override_settings(**{name: value}):
        [error] = checks.check_time_settings()
    assert error.id == "dispatch.E005" and name in error.msg
