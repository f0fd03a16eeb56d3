"""Encryption at rest, the key check, snapshot identity, key rotation."""

from __future__ import annotations

import pytest
from cryptography.fernet import Fernet
from django.core.management import call_command
from django.db import connection
from django.test import override_settings

from dispatch import checks
from dispatch.core.states import Reason, Status
from dispatch.models import Attempt, Datasource
from dispatch.security import crypto
from dispatch.worker import claims
from dispatch.worker.runner import ExecutionControl, Runner, sanitize
from tests.support.factories import BindingFactory, DatasourceFactory, trigger
from tests.support.helpers import attempts_of, claim_one

KEY_A = Fernet.generate_key().decode()
KEY_B = Fernet.generate_key().decode()


def test_check__missing_key_is_an_error():
    with override_settings(DISPATCH_ENCRYPTION_KEYS=[]):
        assert [e.id for e in checks.check_encryption_keys()] == ["dispatch.E001"]


def test_check__invalid_key_is_an_error_naming_its_position():
    with override_settings(DISPATCH_ENCRYPTION_KEYS=[KEY_A, "not-a-key"]):
        [error] = checks.check_encryption_keys()
    assert error.id == "dispatch.E002" and "entry 2" in error.msg and "not-a-key" not in error.msg


def test_check__valid_keys_pass():
    with override_settings(DISPATCH_ENCRYPTION_KEYS=[KEY_A, KEY_B]):
        assert checks.check_encryption_keys() == []


@pytest.mark.django_db
def test_config__is_stored_encrypted_and_reads_back():
    ds = DatasourceFactory(config={"password": "s3cret-value"})
    with connection.cursor() as c:
        c.execute(
            "SELECT config_ciphertext::text, redacted_config::text FROM dispatch_datasource WHERE id = %s",
            [ds.pk],
        )
        stored = " ".join(c.fetchone())
    assert "s3cret-value" not in stored
    assert Datasource.objects.get(pk=ds.pk).config == {"password": "s3cret-value"}


@pytest.mark.django_db
def test_config__ciphertext_copied_to_another_datasource_is_refused():
    a = DatasourceFactory(config={"k": "a"})
    b = DatasourceFactory(config={"k": "b"})
    Datasource.objects.filter(pk=b.pk).update(config_ciphertext=a.config_ciphertext)
    with pytest.raises(crypto.SnapshotUnreadable, match="another datasource"):
        _ = Datasource.objects.get(pk=b.pk).config


@pytest.mark.django_db
def test_config__edit_bumps_version_and_old_ciphertext_is_refused_for_new_version():
    ds = DatasourceFactory(config={"k": 1})
    old = ds.config_ciphertext
    ds.config = {"k": 2}
    ds.save()
    assert ds.version == 2
    with pytest.raises(crypto.SnapshotUnreadable, match="version 1, expected 2"):
        crypto.decrypt_config(old, expected_id=ds.pk, expected_version=2)


@pytest.mark.django_db
def test_config__unknown_key_fails_closed():
    ds = DatasourceFactory(config={"k": 1})
    with (
        override_settings(DISPATCH_ENCRYPTION_KEYS=[KEY_B]),
        pytest.raises(crypto.SnapshotUnreadable),
    ):
        _ = Datasource.objects.get(pk=ds.pk).config


@pytest.mark.django_db(transaction=True)
def test_snapshot__undecryptable_fails_the_attempt_permanently():
    run = trigger(BindingFactory(job__max_attempts=5))
    c = claim_one()
    # The snapshot of the source, copied onto the sink's column: identity check fails.
    Attempt.objects.filter(pk=c.attempt_id).update(sink_snapshot=c.source_snapshot)
    bad = claims.ClaimedAttempt(**{**c.__dict__, "sink_snapshot": c.source_snapshot})
    assert Runner(bad, ExecutionControl(bad)).execute() == Status.FAILED
    [a] = attempts_of(run)
    assert (a.status, a.reason) == (Status.FAILED, Reason.SNAPSHOT_UNREADABLE)
    assert "another datasource" in a.error
    assert a.source_snapshot is None and a.sink_snapshot is None


@pytest.mark.django_db(transaction=True)
def test_rotate_keys__reencrypts_configs_and_live_snapshots_under_the_newest_key():
    with override_settings(DISPATCH_ENCRYPTION_KEYS=[KEY_A]):
        binding = BindingFactory()
        binding.source.config = {"password": "pw"}
        binding.source.save()
        trigger(binding)
        c = claim_one()
    with override_settings(DISPATCH_ENCRYPTION_KEYS=[KEY_B, KEY_A]):
        call_command("rotate_keys", stdout=open("/dev/null", "w"))  # noqa: SIM115
    with override_settings(DISPATCH_ENCRYPTION_KEYS=[KEY_B]):  # the old key dropped
        assert Datasource.objects.get(pk=binding.source_id).config == {"password": "pw"}
        a = Attempt.objects.get(pk=c.attempt_id)
        assert crypto.decrypt_config(
            a.source_snapshot, expected_id=binding.source_id, expected_version=a.source_version
        ) == {"password": "pw"}


def test_sanitize__strips_secret_values_url_credentials_and_password_pairs():
    text = (
        "connection to postgresql://bob:hunter2@db:5432/x failed: password=hunter2 "
        "token: abc123 and the value topsecret"
    )
    clean = sanitize(text, ["topsecret"])
    for secret in ["hunter2", "abc123", "topsecret", "bob:"]:
        assert secret not in clean
    assert "postgresql://********@db:5432/x" in clean
