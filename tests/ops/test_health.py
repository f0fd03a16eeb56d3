"""/healthz and /readyz: readiness fails when migrations are missing or keys cannot decrypt."""

from __future__ import annotations

import pytest
from cryptography.fernet import Fernet
from django.db import connection
from django.test import override_settings

from tests.support.factories import DatasourceFactory

pytestmark = pytest.mark.django_db


def test_healthz__answers_alive(client):
    response = client.get("/healthz")
    assert response.status_code == 200 and response.json() == {"alive": True}


def test_readyz__ready_when_migrated_and_keys_decrypt(client):
    DatasourceFactory(config={"base_dir": "/tmp"})
    response = client.get("/readyz")
    assert response.status_code == 200, response.json()
    assert response.json()["checks"] == {"database": None, "migrations": None, "keys": None}


def test_readyz__fails_when_a_migration_is_missing(client):
    with connection.cursor() as cursor:
        cursor.execute(
            "DELETE FROM django_migrations WHERE app = 'dispatch' AND name = "
            "(SELECT max(name) FROM django_migrations WHERE app = 'dispatch')"
        )
    response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert (
        not body["ready"]
        and "1 migration(s) not applied: dispatch." in body["checks"]["migrations"]
    )


def test_readyz__fails_when_the_keys_cannot_decrypt_the_stored_configs(client):
    DatasourceFactory(config={"password": "s3cret-value"})
    with override_settings(DISPATCH_ENCRYPTION_KEYS=[Fernet.generate_key().decode()]):
        response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert "cannot be decrypted" in body["checks"]["keys"]
    assert "s3cret-value" not in response.content.decode()


def _worker(wid: str, *, stopped: bool = False, age: int = 0) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO dispatch_worker (id, host, pid, concurrency, started_at, heartbeat_at,"
            " stopped_at, stats) VALUES (%s, 'h', 1, 1, now(), now() - make_interval(secs => %s),"
            " CASE WHEN %s THEN now() END, %s)",
            [wid, age, stopped, '{"listen_state": 2, "listen_healthy": 0}'],
        )


def test_workerhealth__healthy_stale_stopped_and_unknown_workers(capsys):
    from django.core.management import call_command

    _worker("w-ok")
    _worker("w-stale", age=120)
    _worker("w-stopped", stopped=True)
    call_command("workerhealth", "--worker-id", "w-ok")
    out = capsys.readouterr().out
    assert '"healthy": true' in out and '"listen": "silent"' in out
    for wid, problem in (
        ("w-stale", "no heartbeat for"),
        ("w-stopped", "stopped"),
        ("w-none", "no such worker"),
    ):
        with pytest.raises(SystemExit) as exited:
            call_command("workerhealth", "--worker-id", wid)
        assert exited.value.code == 1 and problem in capsys.readouterr().out
    with pytest.raises(SystemExit):  # the LISTEN probe says its wake-ups stopped
        call_command("workerhealth", "--worker-id", "w-ok", "--require-listen")
