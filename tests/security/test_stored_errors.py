"""Error texts are made storable before they are written (dispatch.core.db.storable): a NUL
that a source put into an error used to make PostgreSQL refuse the settlement, and the
attempt held its slot until its lease ran out (LEASE_EXPIRED, the real error lost)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from django.test import override_settings

from dispatch.core.db import storable
from dispatch.core.states import Reason, Status
from dispatch.models import Attempt, Datasource, Run
from dispatch.models.ops import Alert, AlertStatus
from dispatch.ops import alerts
from dispatch.worker import claims
from tests.support import factories
from tests.support.connectors import ScratchDB, scratch_db
from tests.support.processes import Processes, wait_until, worker_env


def test_storable__escapes_control_characters_but_tab_and_newline() -> None:
    assert storable("na\x00me") == "na\\x00me"
    assert storable("a\tb\nc") == "a\tb\nc"
    assert storable("\r\x1b[31m\x7f\x85") == "\\x0d\\x1b[31m\\x7f\\x85"
    assert storable("bad byte \udcff, é ✓") == "bad byte \\udcff, é ✓"
    assert storable(storable("x\x00\udcff")) == storable("x\x00\udcff")


@pytest.mark.django_db(transaction=True)
def test_settle__any_caller_stores_the_error_escaped() -> None:
    """The escape sits where every settlement is written, not only in the runner."""
    run = factories.trigger(factories.BindingFactory())
    (c,) = claims.claim("w-settle", run_id=run.id, limit=1, generic=False)
    status = claims.settle(
        c.attempt_id, c.lease_token, "PERMANENT", reason="PERMANENT_ERROR", error="col\x00x"
    )
    assert status == Status.FAILED
    assert Attempt.objects.get(pk=c.attempt_id).error == "col\\x00x"


@pytest.fixture
def dst_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_nul_dst")


# The lease is far longer than the wait below: a settlement that fails leaves the
# attempt RUNNING until it runs out, so settling in time proves the outcome was recorded.
LEASE_SECONDS = 120


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_worker__a_nul_in_the_error_is_escaped_and_the_outcome_recorded(
    processes: Processes, dst_db: ScratchDB, tmp_path: Path
) -> None:
    (tmp_path / "in.csv").write_bytes(b"id,na\x00me\n1,x\n")
    base = {"DISPATCH_CSV_BASE_DIRS": [str(tmp_path)]}
    with override_settings(**base):
        source = Datasource(name="nul-src", kind="csv", config={"base_dir": str(tmp_path)})
        source.save()
        sink = Datasource(name="nul-dst", kind="postgresql", config=dst_db.config)
        sink.save()
    job = factories.JobFactory(
        source_spec={"path": "in.csv"},
        sink_spec={"table": "out", "mode": "append", "create": True},
        max_attempts=1,
        lease_seconds=LEASE_SECONDS,
    )
    binding = factories.BindingFactory(job=job, source=source, sink=sink)
    run = factories.trigger(binding)
    processes.worker(
        "--burst", "--worker-id", "w-nul", env=worker_env(DISPATCH_CSV_BASE_DIRS=str(tmp_path))
    )
    wait_until(
        lambda: Run.objects.get(pk=run.pk).status in (Status.SUCCEEDED, Status.FAILED),
        timeout=LEASE_SECONDS / 4,
        message=f"run {run.id} to settle",
    )
    (attempt,) = Attempt.objects.filter(run=run)
    assert attempt.status == Status.FAILED
    assert attempt.reason != Reason.LEASE_EXPIRED
    assert "\x00" not in attempt.error
    assert "na\\x00me" in attempt.error
    # The alert carries the stored (escaped) text and is sent.
    with override_settings(
        DISPATCH_HEALTH_SCAN_LAG=0.0,
        DISPATCH_ALERT_NOTIFIERS=["email"],
        ADMINS=[("ops", "ops@example.com")],
        EMAIL_BACKEND="django.core.mail.backends.locmem.EmailBackend",
    ):
        alerts.scan()
        assert alerts.drain() == 1
    assert Alert.objects.get(run_id=run.pk).status == AlertStatus.SENT
