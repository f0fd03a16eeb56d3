"""A wrong but well-formed key: `check` refuses it, and a worker that meets snapshots its
keys cannot open stops and hands its work back instead of failing runs."""

from __future__ import annotations

import subprocess
import sys

import pytest
from cryptography.fernet import Fernet
from django.test import override_settings

from dispatch import checks
from dispatch.core.states import Origin, Reason, Status
from dispatch.models import Attempt, Worker
from tests.support.factories import BindingFactory, DatasourceFactory, trigger
from tests.support.processes import ROOT, Processes, wait_until, worker_env

WRONG_KEY = Fernet.generate_key().decode()


@pytest.mark.django_db
def test_check__a_wrong_well_formed_key_is_an_error_a_right_one_is_not():
    DatasourceFactory(config={"password": "pw"})
    assert checks.check_keys_open_stored_configs() == []
    with override_settings(DISPATCH_ENCRYPTION_KEYS=[WRONG_KEY]):
        assert checks.check_encryption_keys() == []  # well-formed
        [error] = checks.check_keys_open_stored_configs()
    assert error.id == "dispatch.E003" and "1 sampled" in error.msg


@pytest.mark.django_db
def test_check__a_dropped_key_still_in_use_is_an_error():
    DatasourceFactory(config={"k": 1})
    with override_settings(DISPATCH_ENCRYPTION_KEYS=[WRONG_KEY]):
        DatasourceFactory(config={"k": 2})  # encrypted under the wrong key
    with override_settings(DISPATCH_ENCRYPTION_KEYS=[WRONG_KEY]):
        [error] = checks.check_keys_open_stored_configs()
    assert error.id == "dispatch.E004" and "1 of 2" in error.msg


@pytest.mark.django_db
def test_check__no_datasource_yet_is_no_error():
    with override_settings(DISPATCH_ENCRYPTION_KEYS=[WRONG_KEY]):
        assert checks.check_keys_open_stored_configs() == []


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_runworker__refuses_to_start_with_a_key_that_opens_nothing():
    DatasourceFactory(config={"password": "pw"})
    proc = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "runworker", "--burst"],
        env=worker_env(DISPATCH_ENCRYPTION_KEYS=WRONG_KEY),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "dispatch.E003" in proc.stderr
    assert WRONG_KEY not in proc.stderr + proc.stdout


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_worker__whose_keys_open_no_snapshot_releases_its_claim_and_stops(processes: Processes):
    # Started while nothing is stored (the start-up check has nothing to sample), then
    # work arrives encrypted under the site's real key.
    proc = processes.worker(
        "--poll-interval", "0.5", env=worker_env(DISPATCH_ENCRYPTION_KEYS=WRONG_KEY)
    )
    wait_until(
        lambda: "listening worker=" in processes.output(proc) or proc.poll() is not None,
        message="worker listening",
    )
    run = trigger(BindingFactory(job__max_attempts=1))
    assert proc.wait(60) == 0, processes.output(proc)
    attempts = list(Attempt.objects.filter(run=run).order_by("number"))
    assert attempts[0].reason == Reason.SHUTDOWN_RELEASED
    assert attempts[0].status != Status.FAILED
    # The run is untouched: a successor waits for a worker with the right keys, outside
    # the retry budget (max_attempts=1).
    assert [(a.status, a.origin) for a in attempts[1:]] == [(Status.PENDING, Origin.RELEASE)]
    assert Worker.objects.get().stopped_at is not None
    assert "open no snapshot" in processes.output(proc)
